"""fgd-plus: FGD with a coarser score (Δ / delta_scale) and used nodes first among equal scores."""

from __future__ import annotations

import numpy as np
import pytest

from builders import cluster, node, pod
from gpuplane.model import Assignment, CardShare, ClusterState
from gpuplane.scheduler import CycleState, PolicyConfig, default_registry
from gpuplane.scheduler.plugins.fgd import FgdScore
from gpuplane.scheduler.plugins.fgd_plus import FgdPlusScore, used_nodes
from gpuplane.scheduler.plugins.frag import TypicalPods

WHOLE = TypicalPods(((1000, 1000, 1, None),), np.array([1.0]))


def sliver_cluster() -> ClusterState:
    """a: card 0 has 500 free, card 1 is held whole. b: two idle cards."""
    state = cluster(node("a").gpus(2).obj(), node("b").gpus(2).obj())
    state.place(pod("u1").fraction(500).obj(), Assignment("a", (CardShare(0, 500, 0),)))
    state.place(pod("u2").whole(1).obj(), Assignment("a", (CardShare(1, 1000, 0, whole=True),)))
    return state


@pytest.mark.parametrize(("scale", "bonus", "expected"), [
    # typical whole card; pod 500 milli. a: F 500 → 0, Δ = +500; b: F 0 → 500, Δ = −500.
    # scale 1000: ⌊100·σ(0.5)⌋ = 62, ⌊100·σ(−0.5)⌋ = 37 (FGD's own figures)
    (1000.0, 0.0, [62.0, 37.0]),
    # scale 3000: ⌊100·σ(1/6)⌋ = ⌊54.16⌋ = 54, ⌊100·σ(−1/6)⌋ = ⌊45.84⌋ = 45
    (3000.0, 0.0, [54.0, 45.0]),
    # a runs pods (used): +0.5; b is idle: +0
    (3000.0, 0.5, [54.5, 45.0]),
], ids=["fgd-scale", "coarse", "coarse-used-first"])
def test_fgd_plus_scores(scale: float, bonus: float, expected: list[float]) -> None:
    got = FgdPlusScore(WHOLE, scale, bonus).score(CycleState(), pod("p").cpu(1000).fraction(500).obj(),
                                                  sliver_cluster(), np.arange(2))
    assert got.tolist() == expected


def test_fgd_plus_at_fgd_scale_without_bonus_is_fgd() -> None:
    state, request = sliver_cluster(), pod("p").cpu(1000).fraction(500).obj()
    nodes = np.arange(2)
    assert FgdPlusScore(WHOLE, 1000.0, 0.0).score(CycleState(), request, state, nodes).tolist() == \
        FgdScore(WHOLE).score(CycleState(), request, state, nodes).tolist()


def test_used_nodes_counts_gpu_or_cpu_in_use() -> None:
    state = cluster(node("idle").gpus(2).obj(), node("gpu").gpus(2).obj(), node("cpu").gpus(2).obj())
    state.place(pod("g").fraction(100).obj(), Assignment("gpu", (CardShare(0, 100, 0),)))
    state.place(pod("c").cpu(500).obj(), Assignment("cpu", ()))
    assert used_nodes(state, np.arange(3)).tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(("scale", "bonus"), [(0.0, 0.5), (-1.0, 0.0), (1000.0, 1.0), (1000.0, -0.1)])
def test_fgd_plus_rejects_bad_settings(scale: float, bonus: float) -> None:
    with pytest.raises(ValueError, match="fgd-plus"):
        FgdPlusScore(WHOLE, scale, bonus)


def test_fgd_plus_is_a_node_and_a_card_policy() -> None:
    registry = default_registry()
    assert registry.build(PolicyConfig(node_policy="fgd-plus", typical=WHOLE)).name == "fgd-plus/fgd"
    assert registry.build(PolicyConfig(node_policy="binpack", card_policy="fgd-plus")).name == "binpack/fgd-plus"
