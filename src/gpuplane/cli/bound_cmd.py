"""`gpuplane experiment bound`: the limit (lower bounds on unallocated GPU %) against every node policy.

For each trace and seed: the bounds of `gpuplane.sim.bound` on the pods arrived by 100 %, and each policy's
unallocated GPU % at 100 % arrived from the fragmentation experiment's fill replays, with its gap to the bound
(policy − bound, in points); then medians over the seeds with their min–max.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuplane.model import GpuplaneError, default_catalog
from gpuplane.scheduler import default_registry

TRACES = "default,gpushare40,gpushare100"
ARRIVED = 100
TracesOpt = Annotated[str, typer.Option("--trace", "--traces", help="comma-separated bundled names or pod CSV paths")]
SeedsOpt = Annotated[str, typer.Option(help="seeds, e.g. 42-51 or 42,43")]
PoliciesOpt = Annotated[str, typer.Option(help="comma-separated node policies, or all (every registered one)")]
WorkersOpt = Annotated[int, typer.Option(help="worker processes")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    low: float
    high: float

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        return Spread(float(np.median(values)), float(min(values)), float(max(values)))

    def text(self) -> str:
        return f"{self.median:.2f} [{self.low:.2f}–{self.high:.2f}]"

    def json(self) -> dict[str, float]:
        return {"median": round(self.median, 3), "min": round(self.low, 3), "max": round(self.high, 3)}


def _limit_job(job: tuple[str, int, str | None]) -> dict[str, Any]:
    from gpuplane.sim.bound import limit
    from gpuplane.sim.experiment import _nodes, _pods

    trace, seed, nodes_path = job
    found = limit(default_catalog(), _nodes(nodes_path), _pods(trace), seed=seed, trace=trace,
                  arrived_pct=float(ARRIVED))
    return {"trace": trace, "seed": seed, "bound": round(found.bound_pct, 4), "cards": round(found.cards_pct, 4),
            "fluid": round(found.fluid_pct, 4), "demand": round(found.demand_pct, 4), "pod_types": found.pod_types,
            "node_types": found.node_types, "wall_s": round(found.wall_s, 3)}


def _policies(text: str) -> list[str]:
    """`all` is every registered node policy (the frag experiment's `all` is the paper's set)."""
    from gpuplane.sim.experiment import parse_policies

    known = list(default_registry().node_policies)
    return known if text.strip() == "all" else parse_policies(text, known)


def run_bound(traces: Sequence[str], policies: Sequence[str], seeds: Sequence[int], *, nodes_path: str | None = None,
              workers: int = 2, console: Console | None = None) -> dict[str, Any]:
    """Bounds and policy replays for every trace × seed, as the JSON object `--json` prints."""
    from gpuplane.sim.experiment import _nodes, _pods, sweep

    started = time.perf_counter()
    _nodes(nodes_path)
    for trace in traces:
        _pods(trace)
    jobs = [(trace, seed, nodes_path) for trace in traces for seed in seeds]
    bar = Progress(TextColumn("[bold]experiment bound"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console or Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task("bounds", total=len(jobs))
        if workers <= 1:
            limits = []
            for job in jobs:
                limits.append(_limit_job(job))
                bar.advance(task)
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                limits = []
                for item in pool.imap(_limit_job, jobs):
                    limits.append(item)
                    bar.advance(task)
        replays = bar.add_task("replays", total=len(traces) * len(policies) * len(seeds))
        results = sweep(traces, policies, seeds, nodes_path=nodes_path, workers=workers,
                        progress=lambda done, _: bar.update(replays, completed=done))
    unallocated = {(r.key.trace, r.key.policy, r.key.seed): 100.0 - r.allocation_pct[ARRIVED] for r in results}
    report: dict[str, Any] = {"arrived_pct": ARRIVED, "seeds": list(seeds), "policies": list(policies), "traces": {}}
    for trace in traces:
        rows = [item for item in limits if item["trace"] == trace]
        per_seed: dict[str, Any] = {}
        for item in rows:
            seed = item["seed"]
            per_seed[str(seed)] = {
                "bound": {k: item[k] for k in ("bound", "cards", "fluid", "demand", "pod_types", "node_types",
                                               "wall_s")},
                "policies": {p: {"unallocated": round(unallocated[(trace, p, seed)], 4),
                                 "gap": round(unallocated[(trace, p, seed)] - item["bound"], 4)} for p in policies},
            }
        median: dict[str, Any] = {"bound": Spread.of([item["bound"] for item in rows]).json(),
                                  "fluid": Spread.of([item["fluid"] for item in rows]).json(),
                                  "bound_wall_s": Spread.of([item["wall_s"] for item in rows]).json(), "policies": {}}
        for p in policies:
            mine = [per_seed[str(s)]["policies"][p] for s in seeds]
            median["policies"][p] = {"unallocated": Spread.of([m["unallocated"] for m in mine]).json(),
                                     "gap": Spread.of([m["gap"] for m in mine]).json()}
        report["traces"][trace] = {"seeds": per_seed, "median": median}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def _spread(entry: dict[str, float]) -> str:
    return Spread(entry["median"], entry["min"], entry["max"]).text()


def print_bound(report: dict[str, Any], console: Console) -> None:
    """One table per trace: the bound's row, then every policy sorted by its median, with its gap."""
    seeds = report["seeds"]
    for trace, data in report["traces"].items():
        median = data["median"]
        table = Table(title=escape(f"{trace}: unallocated GPU % at {report['arrived_pct']} % arrived, "
                                   f"median [min–max] over {len(seeds)} seed(s)"))
        for column in ("policy", "unallocated %", "gap to the bound (points)"):
            table.add_column(column, justify="right")
        table.add_row("bound (cards LP)", _spread(median["bound"]), "")
        table.add_row("bound (fluid LP)", _spread(median["fluid"]), "")
        order = sorted(median["policies"], key=lambda p: median["policies"][p]["unallocated"]["median"])
        for p in order:
            table.add_row(p, _spread(median["policies"][p]["unallocated"]), _spread(median["policies"][p]["gap"]))
        console.print(table)
        console.print(f"bound per seed: {median['bound_wall_s']['median']:.1f} s (median)")
    console.print(f"wall time: {report['wall_s']:.0f} s")


def bound_command(traces: str, seeds: str, policies: str, nodes: Path | None, workers: int, as_json: bool) -> None:
    """`gpuplane experiment bound`; raises GpuplaneError for bad flags or inputs."""
    from gpuplane.sim.experiment import parse_seeds

    trace_list = [t.strip() for t in traces.split(",") if t.strip()]
    if not trace_list:
        raise GpuplaneError("--trace: no trace given")
    if workers < 1:
        raise GpuplaneError(f"--workers: must be at least 1, got {workers}")
    report = run_bound(trace_list, _policies(policies), parse_seeds(seeds),
                       nodes_path=str(nodes) if nodes else None, workers=workers)
    if as_json:
        print(json.dumps(report))
        return
    print_bound(report, Console())
