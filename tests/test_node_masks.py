"""`ClusterState.node_mask` (masks kept per node version) and the framework's skipping of neutral scores give what
a computation from scratch gives, through placements, releases, node updates, added nodes and copies."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from builders import cluster, framework, node, pod, renamed
from gpuplane.model import ClusterState, NodeSpecError, PodRequest, PoolConfig
from gpuplane.scheduler import ResourceWeights
from gpuplane.scheduler.framework import CARD_OK, CardCheck, CycleState
from gpuplane.scheduler.plugins.allocation import BinpackScore, SpreadScore, _vectors
from gpuplane.scheduler.plugins.fit import GpuFit

REQUESTS = [
    pod("whole1").cpu(1000).whole(1).obj(),
    pod("whole2").cpu(1000).whole(2).obj(),
    pod("frac").cpu(500).fraction(300).obj(),
    pod("frac-big").cpu(500).fraction(700).obj(),
    pod("frac-mem").cpu(500).fraction(200, mem=9000).obj(),
    pod("frac-pct").cpu(500).fraction(100, pct=40).obj(),
    pod("frac-codec").cpu(500).fraction(100, enc=1, dec=1).obj(),
]


def _scratch_checks(request: PodRequest, state: ClusterState) -> list[tuple[str, bytes]]:
    """GpuFit's card checks as the arrays of a copy computed from scratch (a copy starts with no masks)."""
    return _checks(request, state.copy())


def _checks(request: PodRequest, state: ClusterState) -> list[tuple[str, bytes]]:
    cycle = CycleState()
    cycle.write(CARD_OK, state.card_valid[: state.size].copy())
    return [(c.reason, np.ascontiguousarray(c.passed).tobytes()) for c in GpuFit().checks(cycle, request, state)
            if isinstance(c, CardCheck)]


@pytest.mark.parametrize("logged", [1024, 1])
def test_card_masks_follow_every_change(logged: int) -> None:
    """`logged` 1: the log of changed nodes is cut every few changes, so masks also catch up by their versions."""
    specs = [node(f"n{i}").gpus(1 + i % 4, "T4" if i % 3 else "A100-40GB").cpu(64000).mem(262144).obj()
             for i in range(12)]
    state = cluster(*specs, pools={"dev": PoolConfig(memory_oversell=2.0)})
    state.CHANGES_LOGGED_MIN = logged
    fw = framework("binpack")
    rng = np.random.default_rng(3)
    placed: list[str] = []
    for step in range(300):
        action = rng.integers(5)
        if action < 3 or not placed:
            named = renamed(REQUESTS[int(rng.integers(len(REQUESTS)))], f"p{step}")
            decision = fw.schedule(named, state)
            if decision.assignment is not None:
                state.place(named, decision.assignment)
                placed.append(named.name)
        elif action == 3:
            state.release(placed.pop(int(rng.integers(len(placed)))))
        else:
            i = int(rng.integers(len(state.nodes)))
            spec = state.nodes[i]
            if step % 2:
                # Refused (nothing changed) when the pool would leave promised memory without backing.
                with contextlib.suppress(NodeSpecError):
                    state.update_node(spec.with_changes(pool="dev" if spec.pool != "dev" else "default"))
            elif step % 7 == 0:
                state.add_node(node(f"extra{step}").gpus(8 if step % 3 else 2, "T4").cpu(32000).mem(131072).obj())
        for request in REQUESTS:
            assert _checks(request, state) == _scratch_checks(request, state), (step, request.name)


def test_masks_are_read_only_and_copies_keep_their_own() -> None:
    state = cluster(node("a").gpus(2).cpu(8000).mem(65536).obj(), node("b").gpus(2).cpu(8000).mem(65536).obj())
    request = pod("p").cpu(100).fraction(500).obj()
    masks = [c.passed for c in GpuFit().checks(CycleState(), request, state) if isinstance(c, CardCheck)]
    assert masks and not any(m.flags.writeable for m in masks)
    clone = state.copy()
    decision = framework("binpack").schedule(request, clone)
    assert decision.assignment is not None
    clone.place(request, decision.assignment)
    clone.place(pod("q").cpu(100).fraction(500).obj(), decision.assignment)
    assert _checks(request, state) == _scratch_checks(request, state)
    assert _checks(request, clone) == _scratch_checks(request, clone)
    assert _checks(request, state) != _checks(request, clone)


def test_neutral_scores_are_skipped_without_changing_the_sum() -> None:
    state = cluster(*(node(f"n{i}").gpus(4).cpu(32000 + 1000 * i).mem(131072).obj() for i in range(6)))
    fw = framework("binpack")
    request = pod("p").cpu(1000).fraction(300).obj()
    nodes = np.arange(state.size)
    summed = np.zeros(len(nodes), np.float64)
    for weighted in fw.profile.scores:
        summed += weighted.weight * weighted.plugin.score(CycleState(), request, state, nodes)
    assert fw.score_nodes(CycleState(), request, state, nodes).tobytes() == summed.tobytes()


def test_allocation_scores_kept_per_node_equal_a_fresh_computation() -> None:
    """Binpack and spread keep each node's score per node version; every subset of nodes scores as computed afresh
    over that subset, bit for bit, through placements and releases."""
    specs = [node(f"n{i}").gpus(2 + i % 3).cpu(16000 + 1000 * i).mem(65536 + 4096 * i).obj() for i in range(20)]
    state = cluster(*specs)
    rng = np.random.default_rng(5)
    plugins = [BinpackScore(), SpreadScore(), BinpackScore(ResourceWeights(1.0, 1.0, 1.0)),
               SpreadScore(ResourceWeights(0.5, 2.0, 1.0))]
    fw = framework("binpack")
    placed: list[str] = []
    for step in range(150):
        if rng.integers(3) or not placed:
            named = renamed(REQUESTS[int(rng.integers(len(REQUESTS)))], f"p{step}")
            decision = fw.schedule(named, state)
            if decision.assignment is not None:
                state.place(named, decision.assignment)
                placed.append(named.name)
        else:
            state.release(placed.pop(int(rng.integers(len(placed)))))
        nodes = np.flatnonzero(rng.random(state.size) < 0.7)
        for request in REQUESTS[:3]:
            for plugin in plugins:
                fresh = plugin._function(*_vectors(request, state, nodes, plugin.weights))
                assert plugin.score(CycleState(), request, state, nodes).tobytes() == fresh.tobytes(), step
