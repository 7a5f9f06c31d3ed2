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
