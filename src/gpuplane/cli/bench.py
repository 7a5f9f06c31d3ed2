"""`gpuplane bench schedule`: decisions per second and peak memory of fill replays.

Each cluster runs in its own child process (spawned, pinned to one core, one BLAS thread) so that its
peak resident memory is its own.
"""

from __future__ import annotations

import multiprocessing
import os
import random
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


# --------------------------------------------------------------------------------------- bench classify

_NOISE_NODES = tuple(f"gpu-node-{i:03d}" for i in range(64))


def _noise_line(rng: random.Random, node: str) -> str:
    """One realistic line that no signature matches: training progress, NCCL INFO, warnings, kernel and
    kubelet chatter, with varying numbers and hex ids."""
    k = rng.random()
    r = rng.randrange
    ts = f"2024-05-01 {r(24):02d}:{r(60):02d}:{r(60):02d}"
    if k < 0.30:
        return (f" [{ts}] iteration {r(500000):>8d}/  500000 | consumed samples: {r(10**9):>12d} | elapsed time per "
                f"iteration (ms): {rng.uniform(3000, 5000):.1f} | learning rate: {rng.uniform(1e-5, 3e-4):.3E} | "
                f"global batch size:  2048 | lm loss: {rng.uniform(1.5, 3.5):.6E} | loss scale: 1.0 | grad norm: "
                f"{rng.uniform(0.2, 2.0):.3f} | number of skipped iterations:   0 | number of nan iterations:   0 |")
    if k < 0.55:
        rank = r(512)
        return (f"{node}:{r(99999)}:{r(99999)} [{rank % 8}] NCCL INFO Channel {r(32):02d}/0 : {rank}[{rank % 8}] -> "
                f"{r(512)}[{rank % 8}] [{rng.choice(('send', 'receive'))}] via NET/IB/{r(8)}/GDRDMA")
    if k < 0.62:
        return (f"{node}:{r(99999)}:{r(99999)} [{r(8)}] NCCL INFO comm 0x{r(2**48):x} rank {r(512)} nranks 512 "
                f"cudaDev {r(8)} nvmlDev {r(8)} busId {r(256):x}000 commId 0x{r(2**64):016x} - Init COMPLETE")
    if k < 0.70:
        return (f"[{ts},{r(1000):03d}] [INFO] [rank{r(512)}] step {r(500000)}: tokens/s {r(10**6)} | TFLOPs "
                f"{rng.uniform(300, 450):.1f} | mem {rng.uniform(40, 79):.1f}/79.1 GiB | data wait {r(40)} ms")
    if k < 0.76:
        return ("/usr/local/lib/python3.10/dist-packages/torch/utils/checkpoint.py:464: UserWarning: "
                "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly.")
    if k < 0.82:
        return (f"[{ts},{r(1000):03d}] [INFO] [checkpointing.py:{r(900)}] saving checkpoint at iteration "
                f"{r(500000)} to /checkpoints/run-{r(40)}/iter_{r(500000):07d}")
    if k < 0.88:
        return (f"[{rng.uniform(0, 2e6):14.6f}] IPv6: ADDRCONF(NETDEV_CHANGE): cali{r(2**40):010x}: "
                f"link becomes ready")
    if k < 0.92:
        return f"[{rng.uniform(0, 100):12.6f}] mlx5_core 0000:{r(256):02x}:00.{r(2)}: firmware version: 28.39.{r(9999)}"
    if k < 0.97:
        return (f"I0501 {ts[11:]}.{r(10**6):06d}    {r(9999)} kubelet.go:{r(3000)}] \"SyncLoop (PLEG): event for "
                f"pod\" pod=\"ml-train/llama-worker-{r(64)}\" event={{ID:{r(2**32):08x} Type:ContainerStarted}}")
    return (f"[{ts}] [INFO] [dataloader] worker {r(16)} prefetched {r(4096)} samples from shard "
            f"{r(100000):05d} in {rng.uniform(0.1, 9.9):.2f} s")


def classify_bench_log(lines: int, seed: int = 42, match_pct: float = 1.0,
                       near_miss_pct: float = 0.5) -> tuple[list[bytes], list[str], int]:
    """A deterministic mixed log of `lines` lines (bytes) with their nodes: `match_pct` % of the lines are
    signature examples (spread over every signature), `near_miss_pct` % are near misses that match nothing
    (they pass the prefilter and cost a full check), the rest noise. Also returns how many lines match."""
    import random

    from gpuplane.controllers.classifier import FailureClassifier
    from gpuplane.model.failures import load_signature_library

    library = load_signature_library()
    checker = FailureClassifier(library)
    matching = [example for signature in library for example in signature.examples]
    tricky = [line for signature in library for line in signature.near_misses if checker.feed_line("x", line) is None]
    rng = random.Random(seed)
    data: list[bytes] = []
    nodes: list[str] = []
    expected = 0
    for _ in range(lines):
        node = _NOISE_NODES[rng.randrange(len(_NOISE_NODES))]
        roll = rng.random() * 100.0
        if roll < match_pct:
            line = matching[rng.randrange(len(matching))]
            expected += 1
        elif roll < match_pct + near_miss_pct:
            line = tricky[rng.randrange(len(tricky))]
        else:
            line = _noise_line(rng, node)
        data.append(line.encode())
        nodes.append(node)
    return data, nodes, expected


def run_classify_bench(lines: int, seed: int = 42, repeats: int = 3) -> dict[str, Any]:
    """Lines per second of `FailureClassifier.feed_lines` over the mixed log in batches of `BATCH_LINES`, as
    `gpuplane classify` reads a log (median of `repeats` runs, each on a fresh classifier); checks that exactly
    the injected lines matched."""
    from statistics import median

    from gpuplane.controllers.classifier import BATCH_LINES, FailureClassifier
    from gpuplane.model.failures import load_signature_library

    library = load_signature_library()
    data, nodes, expected = classify_bench_log(lines, seed)
    total_bytes = sum(len(line) for line in data)
    rates: list[float] = []
    cpu_rates: list[float] = []  # per CPU second of this process: what a loaded machine's wall clock hides
    classifier = FailureClassifier(library)
    for _ in range(repeats):
        classifier = FailureClassifier(library)
        feed = classifier.feed_lines
        started, cpu_started = time.perf_counter(), time.process_time()
        for start in range(0, lines, BATCH_LINES):
            feed(nodes[start:start + BATCH_LINES], data[start:start + BATCH_LINES])
        rates.append(lines / (time.perf_counter() - started))
        cpu_rates.append(lines / max(time.process_time() - cpu_started, 1e-9))
    stats = classifier.stats()
    verdict = classifier.verdict()
    rate = median(rates)
    return {
        "lines": lines,
        "signatures": len(library),
        "matching_lines": expected,
        "matched_lines": stats.matched_lines,
        "prefilter_candidates": stats.candidate_lines,
        "unmatched_templates": stats.unmatched_templates,
        "mean_line_bytes": round(total_bytes / max(lines, 1), 1),
        "lines_per_s": round(rate),
        "mb_per_s": round(rate * total_bytes / max(lines, 1) / 1e6, 1),
        "repeats": repeats,
        "runs_lines_per_s": [round(r) for r in rates],
        "cpu_lines_per_s": round(median(cpu_rates)),
        "runs_cpu_lines_per_s": [round(r) for r in cpu_rates],
        "batch_lines": BATCH_LINES,
        "prefilter_engine": classifier.prefilter.engine,
        "verdict": None if verdict.signature is None else verdict.signature.id,
        "verdict_action": verdict.action.value,
    }
