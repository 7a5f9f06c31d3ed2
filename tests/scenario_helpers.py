"""Helpers shared by the scenario tests (training-backfill, tidal)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel
from rich.console import Console
from typer.testing import CliRunner, Result

from gpuplane.cli import scenarios
from gpuplane.cli.main import app

M = TypeVar("M", bound=BaseModel)


def num(figures: Mapping[str, Any], key: str) -> float:
    """A figure that must be a number (not a bool)."""
    value = figures[key]
    assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
    return float(value)


def flat(text: str) -> str:
    """CLI text with all whitespace removed: rich wraps long error lines (and paths) at 80 columns."""
    return "".join(text.split())


def without_wall_time(figures: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if not k.endswith("_wall_s") and k != "report"}


def capture_settings(monkeypatch: pytest.MonkeyPatch, runner_name: str, model: type[M]) -> list[M]:
    """Replace a scenario's run (`scenarios.<runner_name>`): the CLI's settings are recorded, nothing runs."""
    seen: list[M] = []

    def fake(settings: BaseModel, trace: str, nodes_path: Path | None, out_dir: Path, err: Console,
             quiet: bool) -> scenarios.ScenarioOutput:
        assert isinstance(settings, model)
        seen.append(settings)
        return scenarios.ScenarioOutput({"captured": True}, out_dir / "report.html", [], ("a", "b"), "", "")

    monkeypatch.setattr(scenarios, runner_name, fake)
    return seen


def invoke_scenario(tmp_path: Path, scenario: str, args: list[str], file_text: str | None = None) -> Result:
    """`gpuplane simulate --scenario NAME --json --out TMP ARGS`, with `file_text` as --scenario-file if given."""
    command = ["simulate", "--scenario", scenario, "--json", "--out", str(tmp_path), *args]
    if file_text is not None:
        path = tmp_path / "s.yaml"
        path.write_text(file_text)
        command += ["--scenario-file", str(path)]
    return CliRunner().invoke(app, command)


def assert_refused(result: Result, captured: list[Any], message: str) -> None:
    """The CLI exited 2 before any run, with `message` (whitespace aside) and no traceback."""
    assert result.exit_code == 2, result.output
    assert not captured, "bad input must be refused before the run"
    assert flat(message) in flat(result.output), result.output
    assert "Traceback" not in result.output
