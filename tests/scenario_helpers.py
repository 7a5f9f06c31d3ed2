"""Helpers shared by the scenario tests: `gpuplane scenario NAME` invoked through the CLI, with the run
captured so that settings can be checked without running."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner, Result

from gpuplane.cli import scenario_cmd
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


def capture_settings(monkeypatch: pytest.MonkeyPatch, model: type[M]) -> list[M]:
    """Replace the scenario run behind `gpuplane scenario`: the CLI's settings are recorded, nothing runs, and
    the JSON printed is {"captured": true}."""
    seen: list[M] = []

    def fake(scenario: object, settings: BaseModel, seeds: object, out_dir: Path, err: object,
             quiet: bool, jobs: int = 1) -> tuple[None, Path, float]:
        assert isinstance(settings, model)
        seen.append(settings)
        return None, out_dir / "report.html", 0.0

    monkeypatch.setattr(scenario_cmd, "run_scenario_command", fake)
    monkeypatch.setattr(scenario_cmd, "sweep_json", lambda sweep, report, wall_s: {"captured": True})
    return seen


def invoke_scenario(tmp_path: Path, scenario: str, args: list[str], file_text: str | None = None,
                    seeds: str = "1") -> Result:
    """`gpuplane scenario NAME --seeds SEEDS --json --out TMP ARGS`, with `file_text` as --scenario-file if given."""
    command = ["scenario", scenario, "--seeds", seeds, "--json", "--out", str(tmp_path), *args]
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


NonDefault = Mapping[str, tuple[Any, Any]]
"""Per field: (a value as written in YAML / --set, the value the settings then hold), off the default."""


def assert_covers_every_field(model: type[BaseModel], table: NonDefault) -> None:
    """The table names every field of the scenario, each with a value other than the default."""
    assert set(table) == set(model.model_fields), "a new field needs a row here"
    default = model()
    for field, (_, value) in table.items():
        assert getattr(default, field) != value, field


def assert_captured_run(result: Result) -> None:
    """The CLI accepted the settings and handed them to the (captured) run."""
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == '{"captured": true}', result.stdout


def assert_field_reaches_the_run(tmp_path: Path, scenario: str, captured: list[Any], table: NonDefault, field: str,
                                 *, via: str) -> None:
    """One field, set with `--set` (via "set") or in a YAML file (via "yaml"), reaches the run's settings."""
    import json

    raw, value = table[field]
    if via == "set":
        assert_captured_run(invoke_scenario(tmp_path, scenario, ["--set", f"{field}={json.dumps(raw)}"]))
    else:
        assert_captured_run(invoke_scenario(tmp_path, scenario, [], f"{field}: {json.dumps(raw)}\n"))
    (settings,) = captured
    assert getattr(settings, field) == value


def assert_all_fields_at_once(tmp_path: Path, scenario: str, captured: list[Any], table: NonDefault) -> None:
    """Every field at once, from a YAML file and from --set flags: the same settings."""
    import json

    text = "".join(f"{field}: {json.dumps(raw)}\n" for field, (raw, _) in table.items())
    assert_captured_run(invoke_scenario(tmp_path, scenario, [], text))
    flags = [arg for field, (raw, _) in table.items() for arg in ("--set", f"{field}={json.dumps(raw)}")]
    assert_captured_run(invoke_scenario(tmp_path, scenario, flags))
    from_file, from_flags = captured
    expected = {field: value for field, (_, value) in table.items()}
    assert {f: getattr(from_file, f) for f in expected} == expected
    assert from_flags == from_file
