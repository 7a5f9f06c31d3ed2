"""Rebuilding the scheduler's cache (resync) keeps binds in flight; what a node change rebuilds and what not."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import pytest

from gpuplane.model import (
    Assignment,
    CardShare,
    ClusterState,
    MigMode,
    NodeSpec,
    NodeSpecError,
    PodRequest,
    PoolConfig,
    Taint,
    Topology,
    WholeCards,
    default_catalog,
)
from gpuplane.port import EventKind, NodeInfo, PodInfo, PodPhase
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry
from gpuplane.sim import SimCluster

CATALOG = default_catalog()
T4 = CATALOG.get("T4")
PROFILE = default_registry().build(PolicyConfig())


def t4_node(name: str, cards: int = 2, **changes: object) -> NodeSpec:
    spec = NodeSpec(name, 32000, 131072, "T4", cards)
    return spec.with_changes(**changes) if changes else spec


def gpu_pod(name: str, cards: int = 1) -> PodRequest:
    return PodRequest(name, cpu_milli=1000, memory_mib=1024, gpu=WholeCards(cards))


def whole(node: str, *cards: int) -> Assignment:
    return Assignment(node, tuple(CardShare(c, 1000, T4.memory_mib, T4.encoders, T4.decoders, whole=True)
                                  for c in cards))


class ReshapingWorld(SimCluster):
    """A simulated cluster whose nodes can change shape (a node agent publishing a new inventory)."""

    def reshape(self, spec: NodeSpec) -> None:
        info = self._nodes[spec.name]
        self._nodes[spec.name] = NodeInfo(spec, info.resource_version + 1)
        self._emit(EventKind.NODE_UPDATED, node=self._nodes[spec.name])


# ------------------------------------------------------------------ ClusterState.update_node
BASE = NodeSpec("n", 32000, 131072, "V100-16GB", 2)
IN_PLACE = "in place"


@pytest.mark.parametrize(("change", "expected"), [
    ({"labels": (("zone", "b"),)}, IN_PLACE),
    ({"taints": (Taint("k", "v"),)}, IN_PLACE),
    ({"pool": "dev"}, IN_PLACE),
    ({"schedulable": False}, IN_PLACE),
    ({"gpu_model": "V100M16"}, IN_PLACE),                           # an alias of the same card: no change
    ({"gpus": 1, "topology": Topology.default(1)}, "gpus, topology"),   # one card fewer: its place goes too
    ({"cpu_milli": 16000}, "cpu_milli"),
    ({"memory_mib": 65536}, "memory_mib"),
    ({"gpu_model": "T4"}, "gpu_model"),
    ({"mig_mode": MigMode.OFF}, "mig_mode"),
    ({"topology": Topology((0, 0), (0, 0), ((0, 1),))}, "topology"),
])
def test_update_node_applies_what_it_can_in_place_and_refuses_shape_changes(
        change: dict[str, object], expected: str) -> None:
    state = ClusterState(CATALOG, [BASE], {"dev": PoolConfig(memory_oversell=2.0)})
    before = state.fingerprint()
    spec = BASE.with_changes(**change)
    if expected == IN_PLACE:
        state.update_node(spec)
        assert state.nodes[0] == spec.with_changes(gpu_model="V100-16GB")
        assert state.check_invariants() == []
        return
    with pytest.raises(NodeSpecError, match=rf"^node n: {expected} changed"):
        state.update_node(spec)
    assert state.nodes[0] == BASE and state.fingerprint() == before


# ------------------------------------------------------------------ the scheduler's resync
def test_a_shape_change_rebuilds_the_cache_and_a_label_change_does_not() -> None:
    world = ReshapingWorld(CATALOG, [t4_node("n1"), t4_node("n2")])
    scheduler = Scheduler(world, CATALOG, PROFILE, seed=0, queue_pods=False)
    cache = scheduler.state
    assert world.patch_node("n1", labels={"zone": "a"}).ok
    assert scheduler.state is cache and scheduler.state.nodes[0].label("zone") == "a"
    world.reshape(t4_node("n2", mig_mode=MigMode.OFF))   # not a capacity: the old check let it through
    assert scheduler.state is not cache
    assert scheduler.state.nodes[scheduler.state.node_index["n2"]].mig_mode is MigMode.OFF


def test_resync_keeps_the_reservations_of_binds_in_flight() -> None:
    world = ReshapingWorld(CATALOG, [t4_node("n1", cards=1), t4_node("n2", cards=1)])
    scheduler = Scheduler(world, CATALOG, PROFILE, seed=0, queue_pods=False)
    first, second, third = gpu_pod("a"), gpu_pod("b"), gpu_pod("c")
    for request in (first, second, third):
        assert world.create_pod(request).ok
    scheduler.assume(first, whole("n1", 0))
    scheduler.assume(second, whole("n2", 0))
    # n2 loses its card: b's reservation no longer fits and is dropped; a's is held again after the rebuild.
    world.reshape(t4_node("n2", cards=0, gpu_model=None))
    assert scheduler.reserved("a") == whole("n1", 0)
    assert scheduler.state.bindings["a"].assignment == whole("n1", 0)
    assert scheduler.reserved("b") is None and "b" not in scheduler.state.bindings
    assert scheduler.decide(third).assignment is None               # n1's card is a's: nothing for c
    assert scheduler.state.check_invariants() == []
    # The bind then settles as before: confirmed by the world, or given back when it failed.
    assert world.bind("a", whole("n1", 0)).ok
    assert scheduler.reserved("a") is None and scheduler.state.bindings["a"].assignment == whole("n1", 0)


class UnplacedWorld(SimCluster):
    """A cluster whose lists show a running pod on a node that does not exist (an edited annotation)."""

    def list_pods(self) -> Sequence[PodInfo]:
        torn = PodInfo(gpu_pod("ml/torn"), PodPhase.RUNNING, whole("gone", 0), bound_at=0.0)
        return [*super().list_pods(), torn]


def test_a_running_pod_the_cache_cannot_hold_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    world = UnplacedWorld(CATALOG, [t4_node("n1")])
    with caplog.at_level(logging.WARNING, logger="gpuplane.scheduler.scheduler"):
        scheduler = Scheduler(world, CATALOG, PROFILE, seed=0, queue_pods=False)
    why = "cannot place ml/torn on gone: node gone does not exist"
    assert scheduler.unplaced == [("ml/torn", why)]
    assert [r.getMessage() for r in caplog.records] == [f"running pod ml/torn left out of the scheduler's cache: {why}"]


def test_a_nomination_is_not_held_again_by_a_resync() -> None:
    # A nominated pod's reservation is not a bind in flight: resync requeues it (its victims are re-listed).
    world = ReshapingWorld(CATALOG, [t4_node("n1", cards=1)])
    scheduler = Scheduler(world, CATALOG, PROFILE, seed=0)
    low = replace(gpu_pod("low"), priority=0)
    assert world.create_pod(low).ok
    scheduler.run_pending()
    high = replace(gpu_pod("high"), priority=100)
    assert world.create_pod(high).ok
    scheduler.run_pending()
    assert "high" in scheduler.state.bindings and scheduler.reserved("high") is None
    world.reshape(t4_node("n1", cards=1, cpu_milli=16000))
    assert "high" not in scheduler.state.bindings
    assert "high" in {entry.request.name for entry in scheduler.queue.entries()}
