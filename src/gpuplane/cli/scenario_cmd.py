"""`gpuplane scenario NAME`: a scenario over seeds, every parameter a YAML field or a `--set` flag."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar
from rich.table import Table as RichTable

from gpuplane.sim.scenario import Progress, Scenario, Sweep, figure_arm, numeric_figures
from gpuplane.sim.scenario_file import ScenarioError, read_scenario_file


def scenario_settings(model: type[BaseModel], path: Path | None, assignments: Sequence[str]) -> BaseModel:
    """Defaults, then the YAML file, then `--set field=value` pairs, validated once together; errors name
    the file (for a field the file set) and the field."""
    from_file = read_scenario_file(path) if path is not None else {}
    update: dict[str, Any] = dict(from_file)
    for key in from_file:
        if key not in model.model_fields:
            known = ", ".join(sorted(model.model_fields))
            raise ScenarioError(f"{path}: {key}: no such scenario field (fields: {known})")
    for item in assignments:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ScenarioError(f"--set {item!r}: write field=value")
        if key not in model.model_fields:
            known = ", ".join(sorted(model.model_fields))
            raise ScenarioError(f"--set {key}: no such scenario field (fields: {known})")
        update[key] = _parse_value(value.strip())
    try:
        return model.model_validate(update)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if path is not None and first["loc"] and first["loc"][0] in from_file:
            raise ScenarioError(f"{path}: {where}: {first['msg']}") from None
        if path is not None and not first["loc"] and any(name in first["msg"] for name in from_file):
            raise ScenarioError(f"{path}: {first['msg']}") from None
        raise ScenarioError(f"scenario field {where}: {first['msg']}" if where else f"scenario: {first['msg']}") \
            from None


def _parse_value(text: str) -> Any:
    """A `--set` value: JSON when it parses (numbers, booleans, lists such as [1,2]), else the text itself
    (times like 22:30 and names stay strings; pydantic converts and validates)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def progress_bar(name: str, err: Console, quiet: bool) -> tuple[Bar, Progress]:
    bar = Bar(TextColumn(f"[bold]{name}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
              TimeElapsedColumn(), console=err, transient=True, disable=quiet)
    tasks: dict[str, Any] = {}

    def tick(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=total)
        bar.update(tasks[label], completed=done, total=total)

    return bar, tick


def sweep_json(sweep: Sweep[Any, Any], report: Path, wall_s: float) -> dict[str, Any]:
    return sweep.to_json() | {"report": str(report), "wall_s": round(wall_s, 2),
                              "headline_ready": sweep.headline_ready}


def print_sweep(out: Console, scenario: Scenario[Any, Any], sweep: Sweep[Any, Any], wall_s: float) -> None:
    table = RichTable(title=f"{scenario.title}: median [min–max] over {len(sweep.seeds)} seed(s)")
    for column in ("figure", "arm", "median [range]"):
        table.add_column(column, justify="right" if column.startswith("median") else "left")
    for name in numeric_figures(scenario.figures):
        table.add_row(name, figure_arm(scenario.figures, name), sweep.spreads[name].show(3))
    out.print(table)
    goals = RichTable(title="goals, on the median")
    for column in ("goal", "target", "median", "verdict"):
        goals.add_column(column)
    for g in sweep.goals:
        goals.add_row(g.goal.name, g.goal.describe(), f"{g.value:.4g}", "met" if g.met else "[red]MISSED[/]")
    if sweep.goals:
        out.print(goals)
    median_run = sweep.median_run(scenario.headlines[0].figure) if scenario.headlines else sweep.runs[0]
    out.print(scenario.summary(median_run))
    if not sweep.headline_ready:
        out.print(f"[yellow]{len(sweep.seeds)} seed(s): a headline needs a median over at least 10[/]")
    out.print(f"wall time {wall_s:.1f} s")


def run_scenario_command(scenario: Scenario[Any, Any], settings: BaseModel, seeds: Sequence[int], out_dir: Path,
                         err: Console, quiet: bool, jobs: int = 1) -> tuple[Sweep[Any, Any], Path, float]:
    from gpuplane.report.scenario import write_scenario_report
    from gpuplane.sim.scenario import run_seeds

    started = time.perf_counter()
    bar, tick = progress_bar(scenario.name, err, quiet)
    with bar:
        sweep = run_seeds(scenario, settings, seeds, tick, jobs=jobs)
    wall_s = time.perf_counter() - started
    report = write_scenario_report(scenario, sweep, out_dir / f"{scenario.name}.html")
    return sweep, report, wall_s
