"""The README's two commands, and the test command's setup: CI calls the same script, and the script
installs every tool some test runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _two_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Two commands", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_gives_exactly_two_commands() -> None:
    main_job, tests = _two_commands()
    assert main_job.startswith("python3 -m pip install .") and "gpuplane simulate" in main_job
    assert tests == "scripts/test"


def test_ci_runs_the_readmes_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^exec scripts/test\s*$", ci, re.MULTILINE)


def test_the_test_command_installs_every_tool_the_tests_run() -> None:
    script = (ROOT / "scripts" / "test").read_text(encoding="utf-8")
    used = set()
    for path in (ROOT / "tests").glob("*.py"):
        source = path.read_text(encoding="utf-8")
        used |= {tool for tool in ("prometheus", "promtool", "chromium", "openssl", "kubectl")
                 if re.search(rf"""which\(\s*["']{tool}["']""", source)}
    assert used, "the tests run no external tool: this check would prove nothing"
    for tool in used:
        assert f"command -v {tool}" in script, f"scripts/test does not install {tool}, which a test runs"
    assert (ROOT / "scripts" / "test").stat().st_mode & 0o111, "scripts/test must be executable"
