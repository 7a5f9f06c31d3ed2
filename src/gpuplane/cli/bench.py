"""`gpuplane bench schedule`: decisions per second and peak memory of fill replays.

Each cluster runs in its own child process (spawned, pinned to one core, one BLAS thread) so that its
peak resident memory is its own.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
from typing import Any

from rich.console import Console


def _one(kind: str, node_count: int, seed: int) -> dict[str, Any]:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from gpuplane.model import default_catalog
    from gpuplane.scheduler import PolicyConfig, default_registry
    from gpuplane.sim import bundled_path, load_nodes, load_pods, run_fill
    from gpuplane.sim.synthetic import synthetic_nodes

    catalog = default_catalog()
    nodes = load_nodes(bundled_path("nodes"), catalog)
    if kind == "synthetic":
        nodes = synthetic_nodes(nodes, node_count, seed)
    pods = [p.request for p in load_pods(bundled_path("default"), catalog)]
    profile = default_registry().build(PolicyConfig())
    started = time.perf_counter()
    result = run_fill(catalog, nodes, pods, profile, seed=seed, trace="default")
    return {
        "nodes": len(nodes),
        "decisions": result.decisions,
        "decisions_per_s": round(result.decisions_per_s, 1),
        "wall_s": round(time.perf_counter() - started, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run_schedule_bench(node_count: int, seed: int, progress: Console | None = None) -> dict[str, dict[str, Any]]:
    env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.environ.update(env)
    context = multiprocessing.get_context("spawn")
    figures: dict[str, dict[str, Any]] = {}
    for kind in ("trace", "synthetic"):
        if progress is not None:
            progress.print(f"running the fill replay on the {kind} cluster …")
        with context.Pool(1) as pool:
            figures[kind] = pool.apply(_one, (kind, node_count, seed))
    return figures


def run_preempt_bench(fill_pct: float, preemptors: int, seed: int, max_candidates: int = 16,
                      order: str = "fewest-first") -> dict[str, Any]:
    """Fill the trace cluster with low-priority pods to `fill_pct` % of its GPUs, then submit high-priority
    pods one at a time: each has to preempt. Returns preemption decisions per second and their victims."""
    from dataclasses import replace

    import numpy as np

    from gpuplane.model import PriorityClass, PriorityClasses, default_catalog
    from gpuplane.port import Code
    from gpuplane.scheduler import PolicyConfig, Scheduler, SchedulingRules, VictimOrder, default_registry
    from gpuplane.sim import SimCluster, bundled_path, load_nodes, load_pods

    catalog = default_catalog()
    nodes = load_nodes(bundled_path("nodes"), catalog)
    pods = [p.request for p in load_pods(bundled_path("default"), catalog)]
    classes = PriorityClasses([PriorityClass("high", 1000), PriorityClass("low", 100, victim_grace_s=0.0)])
    cluster = SimCluster(catalog, nodes)
    rules = SchedulingRules(classes=classes, max_candidates=max_candidates, victim_order=VictimOrder(order))
    scheduler = Scheduler(cluster, catalog, default_registry().build(PolicyConfig()), seed=seed,
                          now=cluster.loop.now, rules=rules)
    rng = np.random.default_rng(seed)
    gpu_pods = [p for p in pods if p.gpu is not None]
    capacity = cluster.state.total_gpu_milli()
    filled = 0
    while cluster.state.used_gpu_milli() * 100.0 < fill_pct * capacity and filled < 20 * len(pods):
        shape = gpu_pods[int(rng.integers(len(gpu_pods)))]
        cluster.create_pod(replace(shape, name=f"low-{filled}", priority=100, priority_class="low"))
        outcome = scheduler.run_pending()[-1]
        if not outcome.decision.status.ok:
            cluster.delete_pod(outcome.request.name)
        filled += 1
    fill = cluster.state.used_gpu_milli() * 100.0 / capacity
    low_before = len(cluster.state.bindings)
    decided = placed = nominated = failed = 0
    elapsed = preempt_elapsed = 0.0
    preempting = 0
    for k in range(preemptors):
        shape = gpu_pods[int(rng.integers(len(gpu_pods)))]
        cluster.create_pod(replace(shape, name=f"high-{k}", priority=1000, priority_class="high"))
        plans_before = scheduler.stats.plans
        started = time.perf_counter()
        outcomes = scheduler.run_pending()
        spent = time.perf_counter() - started
        elapsed += spent
        if scheduler.stats.plans > plans_before:
            preempting += 1
            preempt_elapsed += spent
        for outcome in outcomes:
            decided += 1
            code = outcome.decision.status.code
            placed += code is Code.SUCCESS
            nominated += code is Code.WAIT
            failed += code not in (Code.SUCCESS, Code.WAIT)
            if code not in (Code.SUCCESS, Code.WAIT):
                cluster.delete_pod(outcome.request.name)
    stats = scheduler.stats
    return {
        "nodes": len(nodes),
        "fill_pct": round(fill, 2),
        "low_priority_pods": low_before,
        "preemptors": preemptors,
        "decisions": decided,
        "preemption_plans": stats.plans,
        "victims": stats.victims,
        "victims_per_plan": round(stats.victims / max(stats.plans, 1), 2),
        "placed_without_preemption": placed - stats.plans,
        "unschedulable": failed,
        "decisions_per_s": round(decided / elapsed, 1) if elapsed > 0 else 0.0,
        "preemption_decisions_per_s": round(preempting / preempt_elapsed, 1) if preempt_elapsed > 0 else 0.0,
        "preemption_decision_ms": round(preempt_elapsed * 1000.0 / max(preempting, 1), 3),
        "wall_s": round(elapsed, 3),
        "max_candidates": max_candidates,
        "victim_order": order,
    }


def run_guard_bench(samples: int, poll_s: float, offline: int, seed: int) -> dict[str, Any]:
    """The co-location guard's reaction (online demand -> offline processes stopped) on real processes."""
    import numpy as np

    from gpuplane.node.bench import measure_reaction

    reactions_ms = np.asarray(measure_reaction(samples, poll_s, offline=offline, seed=seed)) * 1000.0
    return {
        "samples": samples,
        "offline_processes": offline,
        "poll_ms": round(poll_s * 1000.0, 3),
        "median_ms": round(float(np.median(reactions_ms)), 3),
        "p99_ms": round(float(np.percentile(reactions_ms, 99)), 3),
        "max_ms": round(float(reactions_ms.max()), 3),
    }
