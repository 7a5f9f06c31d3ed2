"""Tuning loop for fgd-plus: median unallocated GPU % at 100 % arrived for one (delta_scale, used_bonus).

    python3 scripts/tune-fgd-plus.py 1000 0.5 default,gpushare40,gpushare100 0,1,2,3

Tune on seeds 0-9 only; seeds 42-51 are for reporting (docs/fragmentation.md). Unallocated GPU is read at the
last arrival with arrived <= 100 %.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from gpuplane.model import default_catalog
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins.fgd import FgdCardPicker
from gpuplane.scheduler.plugins.fgd_plus import FgdPlusScore
from gpuplane.scheduler.registry import NodePolicy, _paper
from gpuplane.sim.experiment import _nodes, _pods, _typical
from gpuplane.sim.replay import run_fill


def main() -> None:
    scale, bonus = float(sys.argv[1]), float(sys.argv[2])
    traces = sys.argv[3].split(",")
    seeds = [int(s) for s in sys.argv[4].split(",")]

    def factory(config: PolicyConfig) -> NodePolicy:
        assert config.typical is not None
        return _paper(FgdPlusScore(config.typical, scale, bonus), FgdCardPicker())

    for trace in traces:
        values: list[float] = []
        started = time.process_time()
        for seed in seeds:
            registry = default_registry()
            registry.register_node_policy("tuned", factory)
            profile = registry.build(PolicyConfig(node_policy="tuned", typical=_typical(trace), seed=seed))
            result = run_fill(default_catalog(), _nodes(None), _pods(trace), profile, seed=seed, trace=trace)
            at = int(np.searchsorted(result.arrived_pct, 100.0, side="right")) - 1
            values.append(100.0 - float(result.allocation_pct[at]))
        cpu = (time.process_time() - started) / len(seeds)
        print(f"MEDIAN {trace} scale={scale} bonus={bonus} {float(np.median(values)):.3f} "
              f"{[round(v, 2) for v in values]} cpu/run {cpu:.1f}", flush=True)


if __name__ == "__main__":
    main()
