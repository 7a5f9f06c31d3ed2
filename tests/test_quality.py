"""Static checks as tests: ruff, mypy --strict and the import-layer contract run with the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "ruff", "check", "src", "tests"],
        [sys.executable, "-m", "mypy"],
        [str(Path(sys.executable).with_name("lint-imports"))],
    ],
    ids=["ruff", "mypy", "import-layers"],
)
def test_static_check_passes(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
