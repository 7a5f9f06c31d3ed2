"""`gpuplane simulate --scenario NAME`: scenarios with every parameter a YAML field or a `--set` flag."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuplane.model import GpuplaneError, default_catalog
from gpuplane.scheduler import PolicyConfig, Profile, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim import TracePod, bundled_path, load_nodes, load_pods, resolve_trace
from gpuplane.sim.backfill import BackfillScenario, run_comparison
from gpuplane.sim.scenario_file import ScenarioError, read_scenario_file


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
        update[key] = _parse_value(value.strip())
    update |= {k: v for k, v in explicit.items() if v is not None}
    try:
        return model.model_validate(update)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        if path is not None and first["loc"] and first["loc"][0] in from_file:
            raise ScenarioError(f"{path}: {where}: {first['msg']}") from None
        if path is not None and not first["loc"] and any(name in first["msg"] for name in from_file):
            # a check across fields, some of which the file set
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


@dataclass(frozen=True, slots=True)
class ScenarioOutput:
    figures: dict[str, Any]
    report: Path
    rows: Sequence[tuple[str, ...]]
    columns: tuple[str, ...]
    title: str
    summary: str
    more: Sequence[tuple[str, tuple[str, ...], Sequence[tuple[str, ...]]]] = ()
    """Further tables: (title, columns, rows)."""


def _progress(name: str, err: Console, quiet: bool) -> tuple[Progress, Callable[[str, int, int], None]]:
    progress = Progress(TextColumn(f"[bold]{name}[/] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, transient=True, disable=quiet)
    tasks: dict[str, Any] = {}

    def tick(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = progress.add_task(label, total=total)
        progress.update(tasks[label], completed=done, total=total)

    return progress, tick


def _profile(node_policy: str, seed: int, pods: Sequence[TracePod] | None) -> Profile:
    if node_policy not in default_registry().node_policies:
        raise GpuplaneError(f"scenario field node_policy: unknown policy {node_policy!r}")
    typical = TypicalPods.from_workload(p.request for p in pods) if pods else None
    return default_registry().build(PolicyConfig(node_policy=node_policy, seed=seed, typical=typical))


def run_training_backfill(settings: BaseModel, trace: str, nodes_path: Path | None, out_dir: Path,
                          err: Console, quiet: bool) -> ScenarioOutput:
    from gpuplane.report.backfill import comparison_rows, write_backfill_report

    assert isinstance(settings, BackfillScenario)
    catalog = default_catalog()
    nodes = load_nodes(nodes_path or bundled_path("nodes"), catalog)
    pods = load_pods(resolve_trace(trace), catalog)
    profile = _profile(settings.node_policy, settings.seed, pods)
    progress, tick = _progress("training-backfill", err, quiet)
    with progress:
        comparison = run_comparison(catalog, nodes, pods, profile, settings, progress=tick)
    report = write_backfill_report(comparison, out_dir / "report.html")
    figures = comparison.figures() | {"report": str(report)}
    return ScenarioOutput(figures, report, comparison_rows(comparison), ("no backfill", "backfill"),
                          f"training-backfill: {figures['nodes']} nodes, {figures['gpus']} GPUs, "
                          f"{settings.days:g} day(s)",
                          f"allocation gain: {figures['allocation_gain_points']} points; normal-pod wait change: "
                          f"p50 {figures['normal_wait_p50_change_pct']} %, "
                          f"p95 {figures['normal_wait_p95_change_pct']} %")


def run_tidal_scenario(settings: BaseModel, trace: str, nodes_path: Path | None, out_dir: Path,
                       err: Console, quiet: bool) -> ScenarioOutput:
    from gpuplane.report.tidal import comparison_rows, headline_rows, write_tidal_report
    from gpuplane.sim.tidal import TidalScenario, run_tidal_comparison

    assert isinstance(settings, TidalScenario)
    profile = _profile(settings.node_policy, settings.seed, None)
    progress, tick = _progress("tidal", err, quiet)
    with progress:
        comparison = run_tidal_comparison(default_catalog(), settings, profile, progress=tick)
    report = write_tidal_report(comparison, out_dir / "report.html")
    figures = comparison.figures() | {"report": str(report)}
    rows: list[tuple[str, ...]] = list(comparison_rows(comparison))
    rows += [(label, "", value) for label, value in headline_rows(comparison)]
    return ScenarioOutput(figures, report, rows, ("baseline", "tidal"),
                          f"tidal: {settings.inference_nodes} inference + {settings.training_nodes} training nodes, "
                          f"{settings.days:g} day(s)",
                          f"night conversion {figures['night_conversion_pct']} %, utilisation gain "
                          f"{figures['utilisation_gain_points']} points, SLO minutes added "
                          f"{figures['slo_violation_minutes_added_by_tidal']}")


def run_colocation_scenario(settings: BaseModel, trace: str, nodes_path: Path | None, out_dir: Path,
                            err: Console, quiet: bool) -> ScenarioOutput:
    from gpuplane.report.colocation import comparison_rows, placement_rows, policy_names, write_colocation_report
    from gpuplane.sim.colocation import ColocationScenario, run_colocation

    assert isinstance(settings, ColocationScenario)
    progress, tick = _progress("colocation", err, quiet)
    with progress:
        comparison = run_colocation(settings, progress=lambda done, total: tick("policy x card", done, total))
    report = write_colocation_report(comparison, out_dir / "report.html")
    figures = comparison.figures() | {"report": str(report)}
    summary = "priority+memory-guard not run"
    if "goals_met" in figures:
        guarded = "priority_memory_guard"
        summary = (f"priority+memory-guard: online p99 {figures[f'{guarded}_online_p99_vs_exclusive_pct']} % "
                   f"against exclusive, offline uses {figures[f'{guarded}_offline_share_of_usable_idle_pct']} % "
                   f"of the idle time it could use, {figures[f'{guarded}_online_oom_added']} online OOM events added; "
                   f"goals met: {figures['goals_met']}")
    placement = ("placement of offline pods beside online pods", tuple(p.policy for p in comparison.placement),
                 placement_rows(comparison))
    return ScenarioOutput(figures, report, comparison_rows(comparison), tuple(policy_names(comparison)),
                          f"colocation: {settings.cards} card(s), {settings.days:g} day(s)", summary, (placement,))


def run_autoscale_scenario(settings: BaseModel, trace: str, nodes_path: Path | None, out_dir: Path,
                           err: Console, quiet: bool) -> ScenarioOutput:
    from gpuplane.report.autoscale import comparison_rows, write_autoscale_report
    from gpuplane.sim.autoscale import AutoscaleScenario, run_autoscale

    assert isinstance(settings, AutoscaleScenario)
    progress, tick = _progress("autoscale", err, quiet)
    with progress:
        comparison = run_autoscale(settings, progress=lambda done, total: tick("policy x service", done, total))
    report = write_autoscale_report(comparison, out_dir / "report.html")
    figures = comparison.figures() | {"report": str(report)}
    summary = (f"GPU scaler: shortage {figures['gpu_scaler_shortage_cut_vs_static_pct']} % below static "
               f"provisioning for the average, GPU-hours {figures['gpu_scaler_gpu_hours_vs_oracle_pct']} % against "
               f"the oracle; goals met: {figures['goals_met']}")
    return ScenarioOutput(figures, report, comparison_rows(comparison), tuple(comparison.runs),
                          f"autoscale: {settings.services} services, {settings.days:g} day(s)", summary)


def run_training_faults_scenario(settings: BaseModel, trace: str, nodes_path: Path | None, out_dir: Path,
                                 err: Console, quiet: bool) -> ScenarioOutput:
    from gpuplane.report.training_faults import case_columns, ettr_rows, write_training_faults_report
    from gpuplane.sim.training_faults import TrainingFaultsScenario, run_training_faults

    assert isinstance(settings, TrainingFaultsScenario)
    progress, tick = _progress("training-faults", err, quiet)
    with progress:
        comparison = run_training_faults(settings, progress=lambda done, total: tick("runs", done, total))
    report = write_training_faults_report(comparison, out_dir / "report.html")
    figures = comparison.figures() | {"report": str(report)}
    summary = (f"ETTR: baseline {figures['baseline_ettr_pct']} %, platform {figures['platform_ettr_pct']} %, "
               f"Llama 3 rate at {figures['llama_gpus']:,} GPUs {figures['llama_ettr_pct']} %; "
               f"goals met: {figures['goals_met']}")
    return ScenarioOutput(figures, report, ettr_rows(comparison), tuple(case_columns(comparison)),
                          f"training-faults: {settings.days:g} days, {settings.replications} runs", summary)


@dataclass(frozen=True, slots=True)
class ScenarioKind:
    model: type[BaseModel]
    run: Callable[[BaseModel, str, Path | None, Path, Console, bool], ScenarioOutput]


def scenario_kinds() -> dict[str, ScenarioKind]:
    from gpuplane.sim.autoscale import AutoscaleScenario
    from gpuplane.sim.colocation import ColocationScenario
    from gpuplane.sim.tidal import TidalScenario
    from gpuplane.sim.training_faults import TrainingFaultsScenario

    return {"training-backfill": ScenarioKind(BackfillScenario, run_training_backfill),
            "tidal": ScenarioKind(TidalScenario, run_tidal_scenario),
            "colocation": ScenarioKind(ColocationScenario, run_colocation_scenario),
            "autoscale": ScenarioKind(AutoscaleScenario, run_autoscale_scenario),
            "training-faults": ScenarioKind(TrainingFaultsScenario, run_training_faults_scenario)}


def print_output(out: Console, output: ScenarioOutput) -> None:
    for title, columns, rows in ((output.title, output.columns, output.rows), *output.more):
        table = Table(title=title)
        table.add_column("")
        for column in columns:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*row)
        out.print(table)
    out.print(output.summary)
