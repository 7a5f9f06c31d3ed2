"""The fragmentation experiment: fill replays of policies × traces × seeds, as in the FGD paper.

Each run replays one trace with one policy and one seed in fill mode and records the allocation at
every integer arrived-workload percentage 0…130. Runs go to worker processes; results come back as
plain rows, so the same sweep can be summarised, plotted and checked by a script.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from gpuplane.model import GpuplaneError, NodeSpec, PodRequest, default_catalog
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim.replay import run_fill
from gpuplane.sim.trace import bundled_path, load_nodes, load_pods, resolve_trace

FRAG_POLICIES = ("random", "dotprod", "gpu-clustering", "gpu-packing", "bestfit", "fgd", "fgd-online", "fgd-used")
ARRIVED_POINTS = np.arange(0, 131)
PUBLISHED = {
    "default": {"random": 13.75, "dotprod": 9.445, "gpu-clustering": 8.42, "gpu-packing": 8.195,
                "bestfit": 7.09, "fgd": 4.77},
    "gpushare40": {"random": 15.04, "dotprod": 10.665, "gpu-clustering": 10.18, "gpu-packing": 10.195,
                   "bestfit": 8.53, "fgd": 6.045},
    "gpushare100": {"random": 21.075, "dotprod": 17.93, "gpu-clustering": 17.70, "gpu-packing": 17.78,
                    "bestfit": 15.40, "fgd": 13.36},
}
"""Median unallocated GPU % at 100 % arrived over seeds 42–51 (shared/reference/scheduling.md §6)."""


@dataclass(frozen=True, slots=True)
class RunKey:
    trace: str
    policy: str
    seed: int


@dataclass(frozen=True, slots=True)
class RunResult:
    key: RunKey
    allocation_pct: tuple[float, ...]
    """Allocation % at arrived = 0, 1, …, 130 %."""
    wall_s: float


def parse_seeds(text: str) -> list[int]:
    """`42-51`, `42,45,50` or a mix; errors name the bad part."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if high < low:
                    raise ValueError
                seeds.extend(range(low, high + 1))
            elif part:
                seeds.append(int(part))
        except ValueError:
            raise GpuplaneError(f"--seeds: {part!r} is not a seed or a range like 42-51") from None
    if not seeds:
        raise GpuplaneError("--seeds: no seed given")
    return seeds


def parse_policies(text: str, known: Sequence[str]) -> list[str]:
    if text.strip() == "all":
        return list(FRAG_POLICIES)
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in known]
    if unknown or not chosen:
        raise GpuplaneError(f"--policies: unknown {', '.join(unknown) or '(none given)'} "
                            f"(choose from all, {', '.join(sorted(known))})")
    return chosen


@cache
def _nodes(path: str | None) -> tuple[NodeSpec, ...]:
    return tuple(load_nodes(Path(path) if path else bundled_path("nodes"), default_catalog()))


@cache
def _pods(trace: str) -> tuple[PodRequest, ...]:
    return tuple(p.request for p in load_pods(resolve_trace(trace), default_catalog()))


@cache
def _typical(trace: str) -> TypicalPods:
    return TypicalPods.from_workload(_pods(trace))


def run_one(key: RunKey, nodes_path: str | None = None) -> RunResult:
    """One fill replay; loads (and caches, per process) the trace and node list."""
    config = PolicyConfig(node_policy=key.policy, typical=_typical(key.trace), seed=key.seed)
    profile = default_registry().build(config)
    result = run_fill(default_catalog(), _nodes(nodes_path), _pods(key.trace), profile, seed=key.seed,
                      trace=key.trace)
    allocation = tuple(round(result.allocation_at(float(x)), 4) for x in ARRIVED_POINTS)
    return RunResult(key, allocation, result.wall_s)


def _run_star(args: tuple[RunKey, str | None]) -> RunResult:
    return run_one(*args)


def sweep(traces: Sequence[str], policies: Sequence[str], seeds: Sequence[int], *, nodes_path: str | None = None,
          workers: int = 2, progress: Callable[[int, int], None] | None = None,
          ray_address: str | None = None) -> list[RunResult]:
    """Every (trace, policy, seed) run, in a pool of `workers` processes. Order of results: as listed.

    `ray_address` (`host:port` of an existing Ray cluster, or `auto`) runs the replays as Ray tasks there
    instead, one CPU each; `workers` is then ignored. Every run is deterministic in its key, so the results
    are the same either way (apart from `wall_s`). The cluster's workers need gpuplane installed, and the
    trace and node files at the same paths (the bundled traces travel with the package).
    """
    # Load every input here: bad files fail before any worker starts, and forked workers inherit the cache.
    _nodes(nodes_path)
    for trace in traces:
        _typical(trace)
    keys = [RunKey(t, p, s) for t in traces for p in policies for s in seeds]
    # The slowest runs first, so the pool does not end waiting on one long run.
    order = sorted(range(len(keys)), key=lambda i: not keys[i].policy.startswith("fgd"))
    results: list[RunResult | None] = [None] * len(keys)
    jobs = [(keys[i], nodes_path) for i in order]
    done = 0

    def finished(items: Iterator[RunResult]) -> None:
        nonlocal done
        for item in items:
            results[keys.index(item.key)] = item
            done += 1
            if progress is not None:
                progress(done, len(keys))

    if ray_address is not None:
        finished(_ray_map(jobs, ray_address))
    elif workers <= 1:
        finished(run_one(*job) for job in jobs)
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            finished(pool.imap_unordered(_run_star, jobs))
    return [r for r in results if r is not None]


def _ray_map(jobs: Sequence[tuple[RunKey, str | None]], address: str) -> Iterator[RunResult]:
    """Each job as one Ray task on the cluster at `address`, yielded as the tasks finish."""
    try:
        import ray
    except ImportError:
        raise GpuplaneError("--ray needs Ray: pip install 'gpuplane[ray]'") from None
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise GpuplaneError(f"--ray {address}: cannot join the Ray cluster: {exc}") from None
    try:
        task = ray.remote(num_cpus=1)(_run_star)
        pending = [task.remote(job) for job in jobs]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            result: RunResult = ray.get(ready[0])
            yield result
    finally:
        ray.shutdown()


def runs_rows(results: Sequence[RunResult]) -> list[tuple[str, str, int, int, float]]:
    """(trace, policy, seed, arrived %, allocation %) for every run and arrived point: the `runs.csv` rows."""
    return [(r.key.trace, r.key.policy, r.key.seed, int(x), a)
            for r in results for x, a in zip(ARRIVED_POINTS, r.allocation_pct, strict=True)]


@dataclass(frozen=True, slots=True)
class Summary:
    """Median (and 25th/75th percentile) unallocated GPU % per trace, policy and arrived point."""

    median: dict[str, dict[str, np.ndarray]]
    p25: dict[str, dict[str, np.ndarray]]
    p75: dict[str, dict[str, np.ndarray]]

    def at(self, trace: str, policy: str, arrived: int) -> float:
        return float(self.median[trace][policy][arrived])


def summarise(results: Sequence[RunResult]) -> Summary:
    grouped: dict[str, dict[str, list[np.ndarray]]] = {}
    for result in results:
        unallocated = 100.0 - np.asarray(result.allocation_pct)
        grouped.setdefault(result.key.trace, {}).setdefault(result.key.policy, []).append(unallocated)
    median: dict[str, dict[str, np.ndarray]] = {}
    p25: dict[str, dict[str, np.ndarray]] = {}
    p75: dict[str, dict[str, np.ndarray]] = {}
    for trace, by_policy in grouped.items():
        for policy, curves in by_policy.items():
            stack = np.vstack(curves)
            median.setdefault(trace, {})[policy] = np.median(stack, axis=0)
            p25.setdefault(trace, {})[policy] = np.percentile(stack, 25, axis=0)
            p75.setdefault(trace, {})[policy] = np.percentile(stack, 75, axis=0)
    return Summary(median, p25, p75)
