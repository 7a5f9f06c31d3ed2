"""`fgd-plus`: FGD with two knobs, set on tuning seeds 0–3 of the bundled traces (docs/fragmentation.md).

1. The score's scale, ⌊100 · sigmoid(Δ / `delta_scale`)⌋ (FGD: 1000). A coarser scale makes more nodes tie,
   and ties go to the fixed seeded node order that makes FGD pack small pods onto the same nodes. Tuning kept
   FGD's 1000: 3000 was worse on gpushare40.
2. Among equal scores, a node already in use beats an untouched one (+`used_bonus`, below one score step), so
   idle nodes stay whole for pods that need a whole node. Tuning kept 0.5.

M, the target workload, is given (learned offline from history, as the published FGD takes it).
"""

from __future__ import annotations

import numpy as np

from gpuplane.model import ClusterState
from gpuplane.scheduler.framework import FloatArray, IntArray
from gpuplane.scheduler.plugins.fgd import FgdScore
from gpuplane.scheduler.plugins.frag import TypicalPods


def used_nodes(state: ClusterState, nodes: IntArray) -> FloatArray:
    """1.0 for each node that runs something (GPU or CPU in use), else 0.0."""
    used = (state.gpu_milli_used[nodes] > 0) | (state.cpu_free[nodes] < state.cpu_cap[nodes])
    out: FloatArray = used.astype(np.float64)
    return out


class FgdPlusScore(FgdScore):
    name = "FGD-plus"

    def __init__(self, typical: TypicalPods, delta_scale: float = 1000.0, used_bonus: float = 0.5) -> None:
        if delta_scale <= 0 or not 0.0 <= used_bonus < 1.0:
            raise ValueError("fgd-plus: delta_scale must be > 0 and used_bonus in [0, 1)")
        super().__init__(typical)
        self.delta_scale = delta_scale
        self.used_bonus = used_bonus

    def _with_node_terms(self, state: ClusterState, nodes: IntArray, scores: IntArray) -> FloatArray:
        # Whether a node is in use changes only with its state, so the bonus is cached with the FGD score.
        base = scores.astype(np.float64)
        if not self.used_bonus:
            return base
        out: FloatArray = base + self.used_bonus * used_nodes(state, nodes)
        return out
