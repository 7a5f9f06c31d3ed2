"""The `gpuplane` command line: simulate, explain, bench."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuplane.cli import bound_cmd, classify_cmd, snapshot_cmd
from gpuplane.cli.common import fail as _fail
from gpuplane.cli.common import policy_config
from gpuplane.controllers.colocation import GUARD_REACTION
from gpuplane.model import (
    MILLI_PER_CARD,
    Catalog,
    GpuplaneError,
    NodeSpec,
    PoolConfig,
    WholeCards,
    default_catalog,
)
from gpuplane.report import occupancy_histogram, summary_rows, write_report
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim import (
    LoadReport,
    ReplayMode,
    SimulationResult,
    TimedConfig,
    TracePod,
    bundled_path,
    load_nodes,
    load_pods,
    resolve_trace,
    run_fill,
    run_timed,
)
from gpuplane.sim.pools import load_pools

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="gpuplane: GPU-cluster scheduling, sharing and simulation.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print their figures.")
app.add_typer(bench_app, name="bench")
experiment_app = typer.Typer(no_args_is_help=True, help="Experiments over policies, traces and seeds.")
app.add_typer(experiment_app, name="experiment")

err = Console(stderr=True)
out = Console()


@dataclass(frozen=True, slots=True)
class Inputs:
    catalog: Catalog
    nodes: list[NodeSpec]
    pods: list[TracePod]
    trace: str
    reports: tuple[LoadReport, LoadReport]
    pools: dict[str, PoolConfig]


def _load(trace: str, nodes_path: Path | None, skip_bad_rows: bool, pools_path: Path | None = None) -> Inputs:
    catalog = default_catalog()
    pools = load_pools(pools_path) if pools_path is not None else {}
    node_report = LoadReport(str(nodes_path or "bundled node list"))
    pod_path = resolve_trace(trace)
    pod_report = LoadReport(str(pod_path))
    nodes = load_nodes(nodes_path or bundled_path("nodes"), catalog, skip_bad_rows=skip_bad_rows, report=node_report)
    pods = load_pods(pod_path, catalog, skip_bad_rows=skip_bad_rows, report=pod_report)
    if not nodes:
        raise GpuplaneError(f"{node_report.path}: no usable nodes")
    if not pods:
        raise GpuplaneError(f"{pod_report.path}: no usable pods")
    unknown = sorted({n.pool for n in nodes} - set(pools) - {"default"}) if pools else []
    if unknown:
        raise GpuplaneError(f"{pools_path}: nodes name pools the file does not declare: {', '.join(unknown)}")
    return Inputs(catalog, nodes, pods, trace, (node_report, pod_report), pools)


def _policy(node_policy: str, card_policy: str | None, scope: str, topo: Path | None, inputs: Inputs,
            seed: int) -> PolicyConfig:
    config = policy_config(node_policy, card_policy, scope, topo, seed,
                           typical=TypicalPods.from_workload(p.request for p in inputs.pods))
    if config.custom_topo is not None:
        names = {n.name for n in inputs.nodes}
        missing = sorted({n for rule in config.custom_topo.rules for n in rule.nodes or () if n not in names})
        if missing:
            raise GpuplaneError(f"{topo}: rules name nodes the cluster lacks: {', '.join(missing[:10])}")
    return config


def _run(inputs: Inputs, config: PolicyConfig, mode: ReplayMode, seed: int, *, record: bool, why: list[str],
         timed: TimedConfig, quiet: bool) -> SimulationResult:
    profile = default_registry().build(config)
    progress = Progress(TextColumn(f"[bold]{profile.name}[/] {mode.value}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=err, transient=True, disable=quiet)
    with progress:
        task = progress.add_task("replay", total=None)

        def tick(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        if mode is ReplayMode.FILL:
            return run_fill(inputs.catalog, inputs.nodes, [p.request for p in inputs.pods], profile, seed=seed,
                            trace=inputs.trace, record_placements=record, why=why, pools=inputs.pools,
                            progress=tick)
        return run_timed(inputs.catalog, inputs.nodes, inputs.pods, profile, seed=seed, trace=inputs.trace,
                         config=timed, record_placements=record, why=why, pools=inputs.pools, progress=tick)


def _summary_json(result: SimulationResult, report: Path | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "mode": result.mode.value,
        "trace": result.trace,
        "policy": result.profile,
        "seed": result.seed,
        "nodes": result.nodes,
        "gpus": result.total_gpus,
        "submitted_pods": result.submitted,
        "placed_pods": result.placed,
        "failed_pods": result.failed,
        "oversubscribed_pods": result.oversubscribed,
        "failed_by_reason": dict(result.failed_by_reason.most_common()),
        "decisions": result.decisions,
        "decisions_per_s": round(result.decisions_per_s, 1),
        "wall_s": round(result.wall_s, 3),
        "card_occupancy_buckets": ["idle", "1-250", "251-500", "501-750", "751-999", "full"],
        "card_occupancy_at_50": occupancy_histogram(result.card_used_milli_at_50),
        "card_occupancy_at_100": occupancy_histogram(result.card_used_milli_at_100),
    }
    if result.mode is ReplayMode.FILL:
        data |= {
            "allocation_at_100": round(result.allocation_at(100), 3),
            "allocation_at_130": round(result.allocation_at(130), 3),
            "unallocated_at_100": round(result.unallocated_at(100), 3),
            "unallocated_at_130": round(result.unallocated_at(130), 3),
        }
    elif result.series is not None and result.series.allocation_pct:
        waits = np.asarray(result.waits_s) if result.waits_s else np.zeros(1)
        data |= {
            "allocation_at_100": None,
            "allocation_at_130": None,
            "mean_allocation_pct": round(result.window_mean(result.series.allocation_pct), 3),
            "mean_utilisation_pct": round(result.window_mean(result.series.utilisation_pct), 3),
            "mean_occupied_cards_pct": round(result.window_mean(result.series.occupied_cards_pct), 3),
            "window_s": [round(t, 1) for t in result.window_s],
            "peak_allocation_pct": round(max(result.series.allocation_pct), 3),
            "wait_p50_s": round(float(np.percentile(waits, 50)), 1),
            "wait_p95_s": round(float(np.percentile(waits, 95)), 1),
            "never_placed_pods": result.never_placed,
        }
    if report is not None:
        data["report"] = str(report)
    return data


def _write_placements(result: SimulationResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["seq", "pod", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "node", "cards",
                         "outcome"])
        for p in result.placements:
            request = p.request
            gpu = request.gpu
            num_gpu = gpu.count if isinstance(gpu, WholeCards) else 0 if gpu is None else 1
            gpu_milli = MILLI_PER_CARD if isinstance(gpu, WholeCards) else request.gpu_milli_total
            spec = "|".join(sorted(request.models)) if request.models else ""
            writer.writerow([p.seq, request.name, request.cpu_milli, request.memory_mib, num_gpu, gpu_milli, spec,
                             p.node, ";".join(map(str, p.cards)), p.outcome])


def _print_summary(results: list[SimulationResult], skipped: tuple[LoadReport, LoadReport]) -> None:
    table = Table(title="gpuplane replay", show_lines=False)
    table.add_column("")
    for result in results:
        table.add_column(result.profile)
    rows = [summary_rows(r) for r in results]
    for i, (key, _) in enumerate(rows[0]):
        table.add_row(key, *(r[i][1] for r in rows))
    out.print(table)
    for result in results:
        if result.failed_by_reason:
            reasons = Table(title=f"failed pods by reason: {result.profile}")
            reasons.add_column("reason")
            reasons.add_column("pods", justify="right")
            for reason, count in result.failed_by_reason.most_common():
                reasons.add_row(reason, str(count))
            out.print(reasons)
    for report in skipped:
        if report.skipped:
            err.print(f"[yellow]skipped rows:[/] {report.summary()}")


def _print_why(result: SimulationResult, pod: str, show_all: bool) -> None:
    rows = result.why.get(pod)
    if rows is None:
        out.print(f"[red]pod {pod} was not submitted in this run[/] (names of resampled copies end in -tuned-N)")
        return
    out.print(f"[bold]{pod}[/]: {result.why_message.get(pod, '')}")
    by_reason: dict[str, list[str]] = {}
    for node, reason in rows:
        by_reason.setdefault(reason, []).append(node)
    table = Table(title=f"per-node reasons for {pod}")
    table.add_column("reason")
    table.add_column("nodes", justify="right")
    table.add_column("for example")
    for reason, nodes in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        table.add_row(reason, str(len(nodes)), ", ".join(nodes[:4]) + (" …" if len(nodes) > 4 else ""))
    out.print(table)
    if show_all:
        for node, reason in rows:
            out.print(f"{node}\t{reason}")


TraceOpt = Annotated[str, typer.Option(help="default, gpushare40, gpushare100, or a path to an openb pod CSV")]
NodesOpt = Annotated[Path | None, typer.Option(help="openb node CSV (default: the bundled 1,213-node cluster); "
                                                 "an optional `pool` column puts nodes in pools")]
PoolsOpt = Annotated[Path | None, typer.Option(help="pool settings (YAML), e.g. memory oversell for dev pools")]
ModeOpt = Annotated[str, typer.Option(help="fill (FGD protocol) or timed")]
NodePolicyOpt = Annotated[str, typer.Option(
    help="node policy: binpack, spread, random, dotprod, gpu-clustering, gpu-packing, bestfit, fgd, fgd-online")]
CardPolicyOpt = Annotated[str | None, typer.Option(
    help="card policy: binpack, spread, card-only-one or custom-topo (default: the node policy's own, else binpack)")]
ScopeOpt = Annotated[str, typer.Option(help="card-only-one scope: workload or all")]
TopoOpt = Annotated[Path | None, typer.Option(help="custom-topo rules (YAML)")]
SeedOpt = Annotated[int, typer.Option(help="seed for shuffling, resampling and tie-breaks")]
SkipOpt = Annotated[bool, typer.Option(help="skip bad trace rows (and report them) instead of stopping")]
LoadOpt = Annotated[float, typer.Option(help="timed mode: offered GPU load as a share of capacity")]
ArrivalOpt = Annotated[str, typer.Option(help="timed mode: poisson or trace (the trace's creation times)")]


def _timed_config(load: float, arrival: str, hours: float) -> TimedConfig:
    try:
        return TimedConfig(arrival=arrival, load=load, hours=hours)
    except ValueError as exc:
        raise GpuplaneError(str(exc)) from None


WEEK_SEEDS = "1"
JobsOpt = Annotated[int, typer.Option(help="run the seeds in this many worker processes (the figures are the same)")]


@app.command()
def simulate(
    scenario_file: Annotated[Path | None, typer.Option(help="the week's settings (YAML, any field of "
                                                       "PlatformSettings)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="a settings field=value (repeatable), e.g. "
                                                   "--set a100_nodes=50 --set ablation=false")] = None,
    seeds: Annotated[str, typer.Option(help="seeds to run: 1-10, 3, or 1,4,9; figures are medians over them "
                                       "(the default, one seed, is a look, not a headline: a headline is 10)")]
        = WEEK_SEEDS,
    days: Annotated[float | None, typer.Option(help="simulated days (default 7)")] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="directory for platform-week.html")] = Path("out"),
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    jobs: JobsOpt = 1,
    trace: Annotated[str | None, typer.Option(hidden=True)] = None,
    mode: Annotated[str | None, typer.Option(hidden=True)] = None,
    node_policy: Annotated[str | None, typer.Option("--node-policy", "--policy", hidden=True)] = None,
    snapshot: Annotated[Path | None, typer.Option(hidden=True)] = None,
    scenario: Annotated[str | None, typer.Option(hidden=True)] = None,
) -> None:
    """The platform week (the main job): one heterogeneous fleet for 7 days with every capability on, against
    vanilla Kubernetes and with each capability off in turn, on the same workload and seeds. Prints the
    comparison with the reports' figures and the ablation, and writes DIR/platform-week.html."""
    if scenario is not None:
        _fail(f"--scenario moved: run `gpuplane scenario {scenario}` (with --set, --scenario-file and --seeds)")
    for flag, given in (("--trace", trace), ("--mode", mode), ("--policy", node_policy), ("--snapshot", snapshot)):
        if given is not None:
            _fail(f"{flag}: `gpuplane simulate` runs the platform week; a trace replay or a snapshot what-if is "
                  f"`gpuplane replay {flag} …` (the same options as before)")
    assignments = [*(set_ or []), *([f"days={days}"] if days is not None else [])]
    scenario_cmd("platform-week", scenario_file=scenario_file, set_=assignments, seeds=seeds, out_dir=out_dir,
                 as_json=as_json, jobs=jobs)


@app.command()
def replay(
    trace: TraceOpt = "default",
    nodes: NodesOpt = None,
    pools: PoolsOpt = None,
    mode: ModeOpt = "fill",
    node_policy: Annotated[str | None, typer.Option(
        "--node-policy", "--policy",
        help="node policy: binpack (default), spread, random, dotprod, gpu-clustering, gpu-packing, bestfit, fgd, "
             "fgd-online")] = None,
    card_policy: CardPolicyOpt = None,
    card_only_one_scope: ScopeOpt = "workload",
    topo: TopoOpt = None,
    seed: Annotated[int | None, typer.Option(help="seed for shuffling, resampling and tie-breaks (default 42)")]
        = None,
    out_dir: Annotated[Path, typer.Option("--out", help="directory for report.html")] = Path("out"),
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    placements: Annotated[Path | None, typer.Option(help="write every decision to this CSV")] = None,
    why: Annotated[list[str] | None, typer.Option(help="show per-node reasons for this pod (repeatable)")] = None,
    compare: Annotated[list[str] | None, typer.Option(
        help="also run this policy (as node and card policy) and draw it in the same report; repeatable")] = None,
    skip_bad_rows: SkipOpt = False,
    load: LoadOpt = 0.9,
    arrival: ArrivalOpt = "poisson",
    hours: Annotated[float, typer.Option(help="timed mode: arrival horizon in virtual hours")] = 8.0,
    set_: Annotated[list[str] | None, typer.Option("--set", help="--snapshot: load_scale=…, mean_lifetime_s=… "
                                                   "(repeatable)")] = None,
    snapshot: Annotated[Path | None, typer.Option(help=(
        "what-if: replay a `gpuplane snapshot --out` directory (or a kubectl dump): its running pods in place, its "
        "pending pods, then --hours of arrivals drawn from its pods (--set load_scale=…, mean_lifetime_s=…)"))] = None,
    seeds: Annotated[str | None, typer.Option(help="--snapshot: replay these seeds (1-10) and show medians with "
                                                   "their range")] = None,
) -> None:
    """Replay a trace on the simulated cluster (fill or timed), print a summary and write DIR/report.html; with
    --snapshot, replay a real cluster's snapshot under policies (what-if)."""
    if snapshot is not None:
        snapshot_cmd.simulate_snapshot(snapshot, node_policy or "binpack", compare or [], seed, hours, set_ or [],
                                       as_json, seeds)
        return
    node_policy = node_policy or "binpack"
    seed = 42 if seed is None else seed
    try:
        replay_mode = ReplayMode(mode)
    except ValueError:
        _fail(f"--mode: choose fill or timed, got {mode!r}")
    try:
        inputs = _load(trace, nodes, skip_bad_rows, pools)
        timed = _timed_config(load, arrival, hours)
        configs = [_policy(node_policy, card_policy, card_only_one_scope, topo, inputs, seed)]
        cards = default_registry().card_policies
        configs += [_policy(p, p if p in cards else None, card_only_one_scope, topo, inputs, seed)
                    for p in compare or []]
        results = [_run(inputs, c, replay_mode, seed, record=placements is not None and i == 0, why=why or [],
                        timed=timed, quiet=False) for i, c in enumerate(configs)]
        report = write_report(results, out_dir / "report.html")
    except GpuplaneError as exc:
        _fail(str(exc))
    if placements is not None:
        _write_placements(results[0], placements)
    if as_json:
        data = _summary_json(results[0], report)
        if len(results) > 1:
            data["compare"] = [_summary_json(r, None) for r in results[1:]]
        skipped = [s.summary() for s in inputs.reports if s.skipped]
        if skipped:
            data["skipped_rows"] = skipped
        print(json.dumps(data))
        return
    _print_summary(results, inputs.reports)
    for pod in why or []:
        _print_why(results[0], pod, show_all=False)
    out.print(f"report: {report}")


@app.command("scenario")
def scenario_cmd(
    name: Annotated[str, typer.Argument(help="colocation, training-faults, tidal, autoscale or training-backfill")],
    scenario_file: Annotated[Path | None, typer.Option(help="scenario parameters (YAML, any field)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="scenario field=value (repeatable)")] = None,
    seeds: Annotated[str, typer.Option(help="seeds to run: 1-10, 3, or 1,4,9; figures are medians over them")]
        = "1-10",
    out_dir: Annotated[Path, typer.Option("--out", help="directory for NAME.html")] = Path("out"),
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    jobs: JobsOpt = 1,
) -> None:
    """Run a scenario over seeds: every figure as a median with its spread, goals judged on the median."""
    from gpuplane.cli.scenario_cmd import print_sweep, run_scenario_command, scenario_settings, sweep_json
    from gpuplane.sim.scenario import get_scenario, parse_seeds

    try:
        scenario = get_scenario(name)
        settings = scenario_settings(scenario.settings, scenario_file, set_ or [])
        sweep, report, wall_s = run_scenario_command(scenario, settings, parse_seeds(seeds), out_dir, err, as_json,
                                                     jobs)
    except GpuplaneError as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(sweep_json(sweep, report, wall_s)))
        return
    print_sweep(out, scenario, sweep, wall_s)
    out.print(f"report: {report}")


@app.command()
def explain(
    pod: Annotated[str, typer.Argument(help="pod name, e.g. openb-pod-0042 or openb-pod-0042-tuned-7")],
    trace: TraceOpt = "default",
    nodes: NodesOpt = None,
    mode: ModeOpt = "fill",
    node_policy: NodePolicyOpt = "binpack",
    card_policy: CardPolicyOpt = None,
    card_only_one_scope: ScopeOpt = "workload",
    topo: TopoOpt = None,
    seed: SeedOpt = 42,
    skip_bad_rows: SkipOpt = False,
    show_all: Annotated[bool, typer.Option("--all", help="list every node with its reason")] = False,
) -> None:
    """Replay the trace and show, for one pod, why each node could or could not take it."""
    try:
        inputs = _load(trace, nodes, skip_bad_rows)
        config = _policy(node_policy, card_policy, card_only_one_scope, topo, inputs, seed)
        result = _run(inputs, config, ReplayMode(mode), seed, record=False, why=[pod], timed=TimedConfig(),
                      quiet=False)
    except (GpuplaneError, ValueError) as exc:
        _fail(str(exc))
    _print_why(result, pod, show_all)
    if pod not in result.why:
        raise typer.Exit(1)


@experiment_app.command("frag")
def experiment_frag(
    traces: Annotated[str, typer.Option(help="comma-separated bundled names or pod CSV paths")] =
        "default,gpushare40,gpushare100",
    policies: Annotated[str, typer.Option(help="comma-separated policy ids, or all")] = "all",
    seeds: Annotated[str, typer.Option(help="seeds, e.g. 42-51 or 42,43")] = "42-51",
    nodes: NodesOpt = None,
    out_dir: Annotated[Path, typer.Option("--out", help="directory for the CSV, plots and table")] =
        Path("out/frag"),
    workers: Annotated[int, typer.Option(help="worker processes")] = 2,
    ray_address: Annotated[str | None, typer.Option("--ray", help=(
        "run the replays as Ray tasks on the Ray cluster at ADDRESS (host:port, or auto) instead of local worker "
        "processes"))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print {trace: {policy: {arrived: median}}}")] = False,
) -> None:
    """Fill replays of every policy × trace × seed: median unallocated GPU % against arrived workload."""
    from gpuplane.report.frag import TABLE_POINTS, medians_markdown, plot_trace
    from gpuplane.sim.experiment import ARRIVED_POINTS, parse_policies, parse_seeds, summarise, sweep

    try:
        trace_list = [t.strip() for t in traces.split(",") if t.strip()]
        policy_list = parse_policies(policies, list(default_registry().node_policies))
        seed_list = parse_seeds(seeds)
        total = len(trace_list) * len(policy_list) * len(seed_list)
        progress = Progress(TextColumn("[bold]experiment frag"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=err, transient=True)
        with progress:
            task = progress.add_task("runs", total=total)
            results = sweep(trace_list, policy_list, seed_list, nodes_path=str(nodes) if nodes else None,
                            workers=workers, progress=lambda done, _: progress.update(task, completed=done),
                            ray_address=ray_address)
    except (GpuplaneError, OSError) as exc:
        _fail(str(exc))
    summary = summarise(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "runs.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trace", "policy", "seed", "arrived_pct", "allocation_pct"])
        for result in results:
            for x, allocation in zip(ARRIVED_POINTS, result.allocation_pct, strict=True):
                writer.writerow([result.key.trace, result.key.policy, result.key.seed, int(x), allocation])
    for trace in summary.median:
        plot_trace(summary, trace, out_dir / f"unallocated-{Path(trace).stem}.png")
    (out_dir / "medians.md").write_text(medians_markdown(summary), encoding="utf-8")
    if as_json:
        print(json.dumps({trace: {policy: {str(x): round(summary.at(trace, policy, x), 3) for x in TABLE_POINTS}
                                  for policy in by_policy} for trace, by_policy in summary.median.items()}))
        return
    table = Table(title="median unallocated GPU % (lower is better)")
    for column in ("trace", "policy", *(f"{x} %" for x in TABLE_POINTS)):
        table.add_column(column, justify="right")
    for trace, by_policy in summary.median.items():
        for policy in by_policy:
            table.add_row(trace, policy, *(f"{summary.at(trace, policy, x):.2f}" for x in TABLE_POINTS))
    out.print(table)
    out.print(f"runs: {out_dir / 'runs.csv'}, table: {out_dir / 'medians.md'}, plots: {out_dir}/unallocated-*.png")


@experiment_app.command("bound")
def experiment_bound(traces: bound_cmd.TracesOpt = bound_cmd.TRACES, seeds: bound_cmd.SeedsOpt = "42-51",
                     policies: bound_cmd.PoliciesOpt = "all", nodes: NodesOpt = None,
                     workers: bound_cmd.WorkersOpt = 2, as_json: bound_cmd.JsonOpt = False) -> None:
    """The limit: lower bounds on unallocated GPU % at 100 % arrived against every node policy's fill replay."""
    try:
        bound_cmd.bound_command(traces, seeds, policies, nodes, workers, as_json)
    except GpuplaneError as exc:
        _fail(str(exc))


@experiment_app.command("parity")
def experiment_parity(
    trace: TraceOpt = "default",
    nodes: NodesOpt = None,
    pods: Annotated[int | None, typer.Option(help="fill: only the first N pods of the tuned workload")] = None,
    mode: Annotated[str, typer.Option(help="fill, timed or both")] = "both",
    node_policy: NodePolicyOpt = "binpack",
    card_policy: CardPolicyOpt = None,
    seed: SeedOpt = 42,
    scheduler: Annotated[str, typer.Option(
        help="process: `gpuplane scheduler` as a separate process; in-process: the same Scheduler over a "
             "KubeCluster in this process (the harness's own check)")] = "process",
    extender: Annotated[bool, typer.Option(
        help="fill: also replay through extender mode (kube-scheduler stand-in) for binpack and fgd, beside the "
             "simulator")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """The same workload through the simulator and through Kubernetes (the local API server): the same decisions.
    Exit 1 on any difference."""
    from gpuplane.sim import parity

    if mode not in ("fill", "timed", "both"):
        _fail(f"--mode: choose fill, timed or both, got {mode!r}")
    if scheduler not in ("process", "in-process"):
        _fail(f"--scheduler: choose process or in-process, got {scheduler!r}")
    if pods is not None and pods < 1:
        _fail("--pods must be at least 1")
    try:
        inputs = _load(trace, nodes, False)
        config = _policy(node_policy, card_policy, "workload", None, inputs, seed)
        profile = default_registry().build(config)
        with parity.temporary_workdir() as workdir:
            if scheduler == "process":
                factory = parity.separate_process(parity.scheduler_args(node_policy, card_policy, seed,
                                                                        trace=trace), Path(workdir))
            else:
                factory = parity.in_process(inputs.catalog, profile, seed)
            fill = timed = None
            if mode in ("fill", "both"):
                progress = Progress(TextColumn("[bold]parity fill"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), console=err, transient=True, disable=as_json)
                with progress:
                    task = progress.add_task("pods", total=None)
                    fill = parity.fill_parity(inputs.catalog, inputs.nodes, [p.request for p in inputs.pods], profile,
                                              factory, seed=seed, limit=pods,
                                              progress=lambda done, total: progress.update(task, completed=done,
                                                                                          total=total))
            if mode in ("timed", "both"):
                timed = parity.timed_parity(inputs.catalog, profile, factory, seed=seed)
        figures: list[parity.ExtenderFigures] = []
        if extender and mode in ("fill", "both"):
            profiles = [default_registry().build(_policy(p, None, "workload", None, inputs, seed))
                        for p in ("binpack", "fgd")]
            figures = parity.extender_parity(inputs.catalog, inputs.nodes, [p.request for p in inputs.pods], profiles,
                                             seed=seed, limit=pods)
        report = parity.ParityReport(inputs.trace, profile.name, seed, scheduler, fill, timed, tuple(figures))
    except GpuplaneError as exc:
        _fail(str(exc))
    if as_json:
        print(parity.report_json(report))
    else:
        _print_figures(f"gpuplane experiment parity ({profile.name}, seed {seed}, scheduler {scheduler})",
                       parity.summary_rows(report), False)
    if report.differences:
        raise typer.Exit(1)


@bench_app.command("schedule")
def bench_schedule(
    node_count: Annotated[int, typer.Option("--nodes", help="size of the synthetic cluster")] = 10_000,
    seed: SeedOpt = 42,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Decisions per second and peak memory of the fill replay, on the trace cluster and a synthetic one."""
    from gpuplane.cli.bench import run_schedule_bench

    figures = run_schedule_bench(node_count, seed, progress=None if as_json else err)
    if as_json:
        print(json.dumps(figures))
        return
    table = Table(title="gpuplane bench schedule (fill replay, one core)")
    for column in ("cluster", "nodes", "decisions", "decisions/s", "peak RSS (MB)"):
        table.add_column(column, justify="right")
    for name, row in figures.items():
        table.add_row(name, f"{row['nodes']:,}", f"{row['decisions']:,}", f"{row['decisions_per_s']:,.0f}",
                      f"{row['peak_rss_mb']:,.0f}")
    out.print(table)


@bench_app.command("preempt")
def bench_preempt(
    fill_pct: Annotated[float, typer.Option(help="fill the trace cluster's GPUs with low-priority pods to this %")]
        = 95.0,
    preemptors: Annotated[int, typer.Option(help="high-priority pods submitted one at a time")] = 2000,
    repeats: Annotated[int, typer.Option(help="runs (different seeds); the median is printed")] = 3,
    max_candidates: Annotated[int, typer.Option(help="candidate nodes tried in full per preemption")] = 16,
    victim_order: Annotated[str, typer.Option(help="fewest-first or lowest-priority-first")] = "fewest-first",
    seed: SeedOpt = 42,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Preemption decisions per second on the 1,213-node trace cluster filled with low-priority pods."""
    from statistics import median

    from gpuplane.cli.bench import run_preempt_bench

    if not 0 < fill_pct <= 100 or preemptors < 1 or repeats < 1 or max_candidates < 1:
        _fail("--fill-pct must be within (0, 100], --preemptors, --repeats and --max-candidates at least 1")
    if victim_order not in ("fewest-first", "lowest-priority-first"):
        _fail(f"--victim-order: choose fewest-first or lowest-priority-first, got {victim_order!r}")
    runs = []
    for k in range(repeats):
        if not as_json:
            err.print(f"run {k + 1}/{repeats}: filling to {fill_pct:g} % and preempting {preemptors} times …")
        runs.append(run_preempt_bench(fill_pct, preemptors, seed + k, max_candidates, victim_order))
    keys = ("preemption_decisions_per_s", "decisions_per_s", "preemption_decision_ms", "victims_per_plan", "fill_pct")
    figures = {k: v for k, v in runs[0].items() if k not in keys} | {
        f"median_{k}": round(median(float(r[k]) for r in runs), 3) for k in keys} | {
        "repeats": repeats, "runs_preemption_decisions_per_s": [r["preemption_decisions_per_s"] for r in runs]}
    _print_figures(f"gpuplane bench preempt ({runs[0]['nodes']:,} nodes filled to {fill_pct:g} %, median of "
                   f"{repeats})", figures, as_json)


def _print_figures(title: str, figures: dict[str, Any], as_json: bool) -> None:
    """One JSON object, or a two-column table of figure and value."""
    if as_json:
        print(json.dumps(figures))
        return
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, str(value))
    out.print(table)


@bench_app.command("guard")
def bench_guard(
    samples: Annotated[int, typer.Option(help="online-demand flips measured")] = 50,
    poll_s: Annotated[float, typer.Option(help="the guard's poll period (seconds; default the shipped one)")] \
        = GUARD_REACTION.poll_s,
    offline: Annotated[int, typer.Option(help="offline busy-loop processes to stop")] = 2,
    seed: SeedOpt = 42,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Co-location guard reaction: online demand appears -> every offline process stopped (real processes)."""
    from gpuplane.cli.bench import run_guard_bench

    if samples < 1 or offline < 1 or not poll_s > 0:
        _fail("--samples and --offline must be at least 1, --poll-s above 0")
    if not as_json:
        err.print(f"measuring {samples} reactions at a {poll_s * 1000:g} ms poll period …")
    _print_figures("gpuplane bench guard", run_guard_bench(samples, poll_s, offline, seed), as_json)


@bench_app.command("classify")
def bench_classify(
    lines: Annotated[int, typer.Option(help="lines in the mixed log (about 1 % match a signature)")] = 1_000_000,
    repeats: Annotated[int, typer.Option(help="runs over the same log; the median is printed")] = 3,
    seed: SeedOpt = 42,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Failure-classifier throughput: lines per second over a deterministic mixed training log."""
    from gpuplane.cli.bench import run_classify_bench

    if lines < 1 or repeats < 1:
        _fail("--lines and --repeats must be at least 1")
    if not as_json:
        err.print(f"building a {lines:,}-line log and classifying it {repeats} times …")
    figures = run_classify_bench(lines, seed, repeats)
    _print_figures(f"gpuplane bench classify ({lines:,} lines, median of {repeats})", figures, as_json)


@bench_app.command("extender")
def bench_extender(
    rate: Annotated[float, typer.Option(help="filter+prioritize pairs per second (open loop)")] = 200.0,
    duration: Annotated[float, typer.Option(help="seconds of load")] = 60.0,
    nodes: Annotated[int, typer.Option(help="GPU nodes in the simulated world and in every request body")] = 1000,
    connections: Annotated[int, typer.Option(help="keep-alive connections of the load generator")] = 32,
    policy: Annotated[str, typer.Option(help="node policy the extender scores with")] = "binpack",
    p99_ms: Annotated[float, typer.Option(help="target p99 latency per verb (ms); exit 1 when missed")] = 50.0,
    seed: SeedOpt = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Scheduler extender on loopback: kube-scheduler's JSON with 1,000-node bodies from a second process."""
    from gpuplane.cli.extender_cmd import format_load, run_load

    if not rate > 0 or not duration > 0 or nodes < 1 or connections < 1:
        _fail("--rate and --duration must be above 0, --nodes and --connections at least 1")
    if not as_json:
        err.print(f"{rate:g} pairs/s for {duration:g} s against {nodes:,} nodes …")
    result = run_load(rate=rate, duration_s=duration, nodes=nodes, connections=connections, seed=seed,
                      node_policy=policy)
    out.print_json(data=result.to_json()) if as_json else out.print(format_load(result))
    if not result.ok(p99_ms=p99_ms):
        raise typer.Exit(1)


@bench_app.command("kube")
def bench_kube(
    nodes: Annotated[str, typer.Option(help="comma-separated cluster sizes (GPU nodes)")] = "1000,5000",
    pods: Annotated[int, typer.Option(help="pods created per run, as fast as the API server takes them")] = 3000,
    repeats: Annotated[int, typer.Option(help="runs per size; medians are printed")] = 3,
    ceiling: Annotated[bool, typer.Option(help="also measure the API server's own ceiling (no scheduler)")] = True,
    policy: Annotated[str, typer.Option(help="node policy of `gpuplane scheduler`")] = "binpack",
    rate: Annotated[float | None, typer.Option(
        help="create this many pods a second (open loop) instead of as fast as the API server takes them")] = None,
    dra: Annotated[bool, typer.Option("--dra", help=(
        "DRA nodes (ResourceSlices) and pods asking through ResourceClaims, allocated by gpuplane-scheduler"))] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Pods bound per second through the local API server with `gpuplane scheduler` as its own process: latency
    from create to bound, API requests per bound pod by verb. Exit 1 below 500 pods/s at 5,000 nodes, above 3
    writes per bound pod, or on any read beyond the watch streams."""
    from gpuplane.sim.kube_bench import run_kube_bench

    try:
        sizes = [int(n) for n in nodes.split(",") if n.strip()]
    except ValueError:
        _fail(f"--nodes: comma-separated whole numbers, got {nodes!r}")
    if not sizes or min(sizes) < 1 or pods < 1 or repeats < 1 or (rate is not None and not rate > 0):
        _fail("--nodes, --pods and --repeats must be at least 1, --rate above 0")
    from gpuplane.cli.dra_cmd import bench_slices

    result = run_kube_bench(sizes, pods=pods, repeats=repeats, ceiling=ceiling, policy=policy, rate=rate,
                            progress=None if as_json else err.print, dra=bench_slices if dra else None)
    if as_json:
        print(json.dumps(result.to_json()))
    else:
        table = Table(title=f"gpuplane bench kube ({pods:,} pods, median of {repeats})")
        for column in ("nodes", "pods bound/s", "p50 ms", "p99 ms", "writes/pod", "API server CPU %",
                       "ceiling pods/s"):
            table.add_column(column, justify="right")
        for row in result.figures:
            table.add_row(f"{row.nodes:,}", f"{row.median_pods_bound_per_s:,.0f}", f"{row.median_p50_ms:,.0f}",
                          f"{row.median_p99_ms:,.0f}", f"{row.runs[0].scheduler_writes_per_pod:g}",
                          f"{row.runs[0].api_server_cpu_pct:g}",
                          f"{row.ceiling.pods_bound_per_s:,.0f}" if row.ceiling else "-")
        out.print(table)
        for miss in result.misses:
            err.print(f"[red]missed:[/] {miss}")
    if not result.ok:
        raise typer.Exit(1)


@app.command("classify")
def classify(
    files: Annotated[list[Path], typer.Argument(help="log files (plain or .gz), one node's each")],
    node: Annotated[str | None, typer.Option(help="node name for every file (default: each file's name "
                                                  "without its suffixes)")] = None,
    signatures: Annotated[list[Path] | None, typer.Option(
        "--signatures", help="signature file extending or overriding the bundled library (repeatable)")] = None,
    top: Annotated[int, typer.Option(min=1, help="unmatched templates and matches to print")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    review: Annotated[bool, typer.Option("--review", help="mine the unmatched lines into templates (drain3) "
                                                          "and propose signature stubs (YAML)")] = False,
) -> None:
    """Classify a failed job's logs: the first error's signature, action and blamed nodes, and the most
    frequent unmatched lines (new problems to write signatures for)."""
    if review:
        classify_cmd.classify_review(files, signatures or [], top=top, as_json=as_json)
        return
    import gzip
    from dataclasses import asdict

    from rich.markup import escape

    from gpuplane.controllers.classifier import FailureClassifier, line_timestamp
    from gpuplane.model.failures import load_signature_library

    try:
        library = load_signature_library(extra=signatures or [])
    except GpuplaneError as exc:
        _fail(str(exc))
    classifier = FailureClassifier(library, line_time=line_timestamp)
    for path in files:
        name = node or path.name.split(".")[0] or path.name
        try:
            with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
                classify_cmd.feed_log(classifier, name, handle)
        except (OSError, EOFError) as exc:
            _fail(f"{path}: {exc}")
    verdict = classifier.verdict()
    stats = classifier.stats()
    unmatched = classifier.unmatched_report(top)
    by_signature: dict[str, int] = {}
    for match in verdict.matches:
        by_signature[match.signature.id] = by_signature.get(match.signature.id, 0) + 1
    if as_json:
        data = verdict.to_dict()
        data["matches"] = data["matches"][:top]
        print(json.dumps({"verdict": data, "matches_by_signature": by_signature, "stats": asdict(stats),
                          "unmatched": [{"template": u.template, "count": u.count} for u in unmatched]}))
        return
    cause = verdict.cause
    table = Table(title="verdict (the first error wins)", show_header=False)
    table.add_column("field")
    table.add_column("value")
    table.add_row("signature", "unknown (no signature matched)" if verdict.signature is None
                  else escape(f"{verdict.signature.id}: {verdict.signature.description}"))
    table.add_row("action", verdict.action.value)
    table.add_row("class", "-" if verdict.failure_class is None else verdict.failure_class.value)
    table.add_row("blamed nodes", escape(", ".join(verdict.blamed_nodes)) or "none")
    if cause is not None:
        table.add_row("first seen", escape(f"{cause.node}: {cause.evidence}"))
    out.print(table)
    if by_signature:
        matches = Table(title=f"matches ({sum(by_signature.values()):,})")
        for column in ("signature", "count", "action", "class"):
            matches.add_column(column)
        for signature_id, count in sorted(by_signature.items(), key=lambda kv: -kv[1])[:top]:
            signature = library[signature_id]
            matches.add_row(signature_id, f"{count:,}", signature.action.value, signature.failure_class.value)
        out.print(matches)
    if unmatched:
        report = Table(title=f"unmatched lines: {stats.unmatched_lines:,} in {stats.unmatched_templates:,} "
                             "templates (most frequent first)")
        report.add_column("count", justify="right")
        report.add_column("template (digits -> N, hex -> X)")
        for item in unmatched:
            report.add_row(f"{item.count:,}", escape(item.template))
        out.print(report)
    err.print(f"{stats.lines:,} lines, {stats.matched_lines:,} matched, {stats.truncated_lines:,} cut to 4 KiB, "
              f"{len(library)} signatures")


@app.command("node-guard")
def node_guard(
    config: Annotated[Path | None, typer.Option(
        "--config", help="guard settings and containers (YAML); with --from-pods, settings and any extra containers",
    )] = None,
    metrics_port: Annotated[int | None, typer.Option(help="serve Prometheus metrics on this port")] = None,
    metrics_addr: Annotated[str, typer.Option(help="address the metrics server listens on")] = "0.0.0.0",
    from_pods: Annotated[bool, typer.Option(
        "--from-pods", help="guard the GPU pods running on this node (their QoS label, cards and pod cgroup)")] = False,
    node_name: Annotated[str | None, typer.Option(envvar="NODE_NAME", help="this node (with --from-pods)")] = None,
    kubeconfig: Annotated[Path | None, typer.Option(
        help="kubeconfig (with --from-pods) [default: in-cluster, else ~/.kube/config]")] = None,
    cgroup_driver: Annotated[str, typer.Option(
        help="the kubelet's cgroup driver, systemd or cgroupfs: where pod cgroups are")] = "systemd",
    cgroup_root: Annotated[Path, typer.Option(help="where the host's cgroup v2 tree is mounted")] = Path(
        "/sys/fs/cgroup"),
    refresh_s: Annotated[float, typer.Option(
        help="rebuild the pod containers at least this often (changes the watch brings apply at once)")] = 5.0,
) -> None:
    """Run the co-location guard on this node's GPUs (NVML) until Ctrl-C or SIGTERM. With --from-pods, the
    thresholds of the ColocationPolicy that selects the node replace the config file's."""
    import logging
    import signal
    import threading
    import time

    from gpuplane.node.gpu import NvmlBackend
    from gpuplane.node.guard import ColocationGuard, GuardConfig, load_guard_config

    if config is None and not from_pods:
        _fail("--config: give the guard's configuration, or take its containers from the pods: --from-pods")
    if from_pods and not node_name:
        _fail("--node-name: needed with --from-pods (or set $NODE_NAME)")
    if cgroup_driver not in ("systemd", "cgroupfs"):
        _fail(f"--cgroup-driver: systemd or cgroupfs, got {cgroup_driver!r}")
    if refresh_s <= 0:
        _fail(f"--refresh-s: must be above 0, got {refresh_s:g}")
    if kubeconfig is not None and not kubeconfig.is_file():
        _fail(f"--kubeconfig {kubeconfig}: no such file")
    try:
        settings = load_guard_config(config) if config is not None else GuardConfig()
    except GpuplaneError as exc:
        _fail(str(exc))
    if not settings.containers and not from_pods:
        _fail(f"{config}: containers: none listed; list them, or take them from the node's pods: --from-pods")
    if from_pods:
        from gpuplane.kube.api import KubeConfigError, connect_api
        from gpuplane.node.node_policy import NodePolicySource
        from gpuplane.node.pod_containers import CgroupLayout, PodContainerSource

        try:
            api = connect_api(str(kubeconfig) if kubeconfig is not None else None)
        except KubeConfigError as exc:
            _fail(f"--kubeconfig: cannot load a configuration: {exc}")
    try:
        backend = NvmlBackend()
    except GpuplaneError as exc:
        _fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    guard = ColocationGuard(settings, backend)
    if metrics_port is not None:
        try:
            guard.start_metrics_server(metrics_port, metrics_addr)
        except OSError as exc:
            backend.close()
            _fail(f"--metrics-port {metrics_port}: {exc}")
    stop = threading.Event()
    source, policies = None, None
    feeders: list[threading.Thread] = []
    if from_pods:
        assert node_name is not None
        layout = CgroupLayout("cgroupfs" if cgroup_driver == "cgroupfs" else "systemd", cgroup_root)
        source = PodContainerSource(api, node_name, layout,
                                    static=settings.containers, refresh_s=refresh_s, registry=guard.registry)
        policies = NodePolicySource(api, node_name, settings.guard, refresh_s=refresh_s, registry=guard.registry)
        source.start()
        policies.start()
        waited = time.monotonic()
        if source.wait_synced(30.0):
            guard.update_containers(source.containers())  # guarded from the first pass
        else:
            logging.getLogger(__name__).warning("the node's pods are not listed yet: %s", source.informer.last_error)
        if policies.wait_synced(max(0.0, 30.0 - (time.monotonic() - waited))):
            guard.update_settings(policies.resolve().options)  # the node's policy from the first pass
        else:
            logging.getLogger(__name__).warning("the node's ColocationPolicy is not known yet, the config file's "
                                                "thresholds apply: %s", policies.last_error)
        feeders = [threading.Thread(target=source.run, args=(guard, stop), name="pod containers", daemon=True),
                   threading.Thread(target=policies.run, args=(guard, stop), name="node policy", daemon=True)]
        for feeder in feeders:
            feeder.start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        guard.run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        if source is not None:
            source.stop()
        if policies is not None:
            policies.stop()
        for feeder in feeders:
            feeder.join(timeout=5)
        guard.stop(guard.clock())
        backend.close()


@app.command("node-read")
def node_read(
    samples: Annotated[int, typer.Option(help="readings to take, one a second")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per reading")] = False,
) -> None:
    """Read this node's GPUs through NVML, as the node agent does, and print what was read."""
    import dataclasses
    import time

    from gpuplane.node.gpu import NvmlBackend

    try:
        backend = NvmlBackend()
        try:
            for i in range(max(samples, 1)):
                if i:
                    time.sleep(1.0)
                cards = backend.cards()
                if as_json:
                    print(json.dumps({"cards": [dataclasses.asdict(c) for c in cards]}))
                    continue
                table = Table(title=f"GPU reading {i + 1}")
                for column in ("card", "uuid", "name", "memory used / total (GiB)", "util %", "enc / dec %",
                               "processes (pid: GiB, SM %)"):
                    table.add_column(column)
                for c in cards:
                    procs = ", ".join(f"{p.pid}: {'?' if p.used_bytes is None else f'{p.used_bytes / 2**30:.1f}'}, "
                                      f"{'?' if p.sm_util_pct is None else f'{p.sm_util_pct:g}'}" for p in c.processes)
                    table.add_row(str(c.index), c.uuid, c.name,
                                  f"{c.used_bytes / 2**30:.1f} / {c.total_bytes / 2**30:.1f}", str(c.util_pct),
                                  f"{c.enc_util_pct} / {c.dec_util_pct}", procs or "none")
                out.print(table)
        finally:
            backend.close()
    except GpuplaneError as exc:
        _fail(str(exc))


@app.command("node-exporter")
def node_exporter(
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to serve /metrics on (dcgm-exporter's)")] = 9400,
    addr: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    hostname: Annotated[str | None, typer.Option(help="the Hostname label [default: $NODE_NAME, else the host "
                                                      "name]")] = None,
    pods: Annotated[Path | None, typer.Option("--pods", help="card -> pod mapping (YAML: cards: {0: {pod, "
                                                              "namespace, container}})")] = None,
) -> None:
    """Serve this node's GPU metrics (NVML) in dcgm-exporter's names and labels until Ctrl-C or SIGTERM."""
    import logging
    import signal
    import threading

    from gpuplane.node.exporter import Exporter, load_pod_map
    from gpuplane.node.gpu import NvmlBackend

    try:
        mapper = load_pod_map(pods) if pods is not None else None
        backend = NvmlBackend(xid_events=True)
    except GpuplaneError as exc:
        _fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exporter = Exporter(backend, hostname=hostname, pods=mapper)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        try:
            server, _ = exporter.start(port, addr)
        except OSError as exc:
            _fail(f"--port {port}: {exc}")
        err.print(f"serving GPU metrics on http://{addr}:{server.server_port}/metrics "
                  f"(Hostname={exporter.collector.hostname})")
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        exporter.stop()
        backend.close()


@app.command("scaler")
def scaler(
    config: Annotated[Path, typer.Option("--config", help="Prometheus URL and scaled objects (YAML)")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="gRPC port KEDA's scalerAddress points at")] = 9091,
    addr: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    metrics_port: Annotated[int | None, typer.Option(min=0, max=65535,
                                                     help="serve the scaler's Prometheus metrics on this port")]
        = None,
) -> None:
    """Serve the GPU scaler (a KEDA external scaler over Prometheus queries) until Ctrl-C or SIGTERM."""
    import logging
    import signal
    import threading

    from gpuplane.scaler.service import GpuScaler, load_scaler_config

    try:
        settings = load_scaler_config(config)
    except GpuplaneError as exc:
        _fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = GpuScaler(settings)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        try:
            bound = service.start(port, addr)
        except GpuplaneError as exc:
            _fail(f"--port {port}: {exc}")
        if metrics_port is not None:
            try:
                metrics_server, _ = service.start_metrics_server(metrics_port, addr)
            except OSError as exc:
                _fail(f"--metrics-port {metrics_port}: {exc}")
            err.print(f"scaler metrics on http://{addr}:{metrics_server.server_port}/metrics")
        err.print(f"GPU scaler serving {', '.join(service.objects)} on {addr}:{bound} "
                  f"(Prometheus {settings.prometheus_url})")
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.stop()


def _register_kube_commands() -> None:
    """The Kubernetes world's commands live in their own modules (`docs/kubernetes.md`)."""
    from gpuplane.cli import (
        accounting_cmd,
        dashboard_cmd,
        device_plugin_cmd,
        dra_plugin_cmd,
        drill_cmd,
        extender_cmd,
        node_reporter_cmd,
        operator_cmd,
        scheduler_cmd,
    )

    snapshot_cmd.register(app)
    classify_cmd.register(app)

    device_plugin_cmd.register(app)
    dra_plugin_cmd.register(app)
    extender_cmd.register(app)
    operator_cmd.register(app)
    node_reporter_cmd.register(app)
    accounting_cmd.register(app)
    dashboard_cmd.register(app)
    drill_cmd.register(app)
    scheduler_cmd.register(app)


_register_kube_commands()


def main() -> None:
    app(prog_name="gpuplane")


if __name__ == "__main__":
    main()
