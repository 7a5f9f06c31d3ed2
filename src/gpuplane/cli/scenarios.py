"""`gpuplane simulate --scenario NAME`: scenarios with every parameter a YAML field or a `--set` flag."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuplane.model import GpuplaneError, default_catalog
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim import bundled_path, load_nodes, load_pods, resolve_trace
from gpuplane.sim.backfill import BackfillScenario, ScenarioError, read_scenario_file, run_comparison

SCENARIOS = ("training-backfill",)


def scenario_settings(model: type[BaseModel], path: Path | None, assignments: Sequence[str],
                      explicit: dict[str, Any]) -> BaseModel:
    """Defaults, then the YAML file, then `--set field=value` pairs, then explicit flags, validated once
    together; errors name the file (for a field the file set) and the field."""
    from_file = read_scenario_file(path) if path is not None else {}
    update: dict[str, Any] = dict(from_file)
    for item in assignments:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ScenarioError(f"--set {item!r}: write field=value")
        if key not in model.model_fields:
            known = ", ".join(sorted(model.model_fields))
            raise ScenarioError(f"--set {key}: no such scenario field (fields: {known})")
        update[key] = value.strip()
    update |= {k: v for k, v in explicit.items() if v is not None}
    try:
        return model.model_validate(update)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if path is not None and first["loc"] and first["loc"][0] in from_file:
            raise ScenarioError(f"{path}: {where}: {first['msg']}") from None
        raise ScenarioError(f"scenario field {where}: {first['msg']}" if where else f"scenario: {first['msg']}") \
            from None


def run_training_backfill(settings: BackfillScenario, trace: str, nodes_path: Path | None, out_dir: Path,
                          err: Console, quiet: bool) -> tuple[dict[str, Any], Path, list[tuple[str, str, str]]]:
    from gpuplane.report.backfill import comparison_rows, write_backfill_report

    catalog = default_catalog()
    nodes = load_nodes(nodes_path or bundled_path("nodes"), catalog)
    pods = load_pods(resolve_trace(trace), catalog)
    if settings.node_policy not in default_registry().node_policies:
        raise GpuplaneError(f"scenario field node_policy: unknown policy {settings.node_policy!r}")
    profile = default_registry().build(PolicyConfig(node_policy=settings.node_policy, seed=settings.seed,
                                                    typical=TypicalPods.from_workload(p.request for p in pods)))
    progress = Progress(TextColumn("[bold]training-backfill[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, transient=True, disable=quiet)
    with progress:
        tasks: dict[str, Any] = {}

        def tick(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=total)
            progress.update(tasks[label], completed=done, total=total)

        comparison = run_comparison(catalog, nodes, pods, profile, settings, progress=tick)
    report = write_backfill_report(comparison, out_dir / "report.html")
    figures = comparison.figures() | {"report": str(report)}
    return figures, report, comparison_rows(comparison)


def print_comparison(out: Console, title: str, rows: list[tuple[str, str, str]], figures: dict[str, Any]) -> None:
    table = Table(title=title)
    table.add_column("")
    table.add_column("no backfill", justify="right")
    table.add_column("backfill", justify="right")
    for label, a, b in rows:
        table.add_row(label, a, b)
    out.print(table)
    out.print(f"allocation gain: {figures['allocation_gain_points']} points; normal-pod wait change: "
              f"p50 {figures['normal_wait_p50_change_pct']} %, p95 {figures['normal_wait_p95_change_pct']} %")
