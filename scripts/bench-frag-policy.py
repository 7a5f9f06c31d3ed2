"""Decisions per CPU-second of one node policy on the trace cluster and on a synthetic cluster, one core.

    python3 scripts/bench-frag-policy.py --policy fgd-plus --nodes 10000 --decisions 3000

Fill protocol (the tuned default trace, one pod at a time, failed pods removed), the first `--decisions`
decisions after a warm-up of 200; the clock is this process's CPU time, so other jobs on the machine do not
count. Pinned to one core with one BLAS thread.
"""

from __future__ import annotations

import argparse
import json
import os
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

from gpuplane.model import default_catalog  # noqa: E402
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry  # noqa: E402
from gpuplane.scheduler.plugins.frag import TypicalPods  # noqa: E402
from gpuplane.sim import bundled_path, load_nodes, load_pods  # noqa: E402
from gpuplane.sim.cluster import SimCluster  # noqa: E402
from gpuplane.sim.replay import tune_workload  # noqa: E402
from gpuplane.sim.synthetic import synthetic_nodes  # noqa: E402

WARM_UP = 200


def bench(policy: str, node_count: int | None, decisions: int, seed: int) -> dict[str, float | int | str]:
    catalog = default_catalog()
    nodes = load_nodes(bundled_path("nodes"), catalog)
    if node_count is not None:
        nodes = synthetic_nodes(nodes, node_count, seed)
    pods = [p.request for p in load_pods(bundled_path("default"), catalog)]
    profile = default_registry().build(PolicyConfig(node_policy=policy, typical=TypicalPods.from_workload(pods),
                                                    seed=seed))
    cluster = SimCluster(catalog, nodes)
    scheduler = Scheduler(cluster, catalog, profile, seed=seed)
    workload = tune_workload(pods, cluster.state.total_gpu_milli(), seed, 1.3)[: WARM_UP + decisions]
    started = 0.0
    for seq, request in enumerate(workload):
        if seq == WARM_UP:
            started = time.process_time()
        cluster.create_pod(request)
        outcome = scheduler.run_pending(on_outcome=lambda _: False)[-1]
        if not (outcome.decision.status.ok and outcome.decision.assignment is not None):
            cluster.delete_pod(request.name)
    cpu = time.process_time() - started
    timed = len(workload) - WARM_UP
    return {"policy": policy, "nodes": len(nodes), "decisions": timed, "cpu_s": round(cpu, 2),
            "decisions_per_cpu_s": round(timed / cpu, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="fgd-plus")
    parser.add_argument("--nodes", type=int, default=10_000, help="synthetic cluster size (besides the trace's)")
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    for count in (None, args.nodes):
        print(json.dumps(bench(args.policy, count, args.decisions, args.seed)), flush=True)


if __name__ == "__main__":
    main()
