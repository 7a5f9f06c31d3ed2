"""The simulated cluster as a cluster port, and the virtual-time event loop under it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.model import (
    Assignment,
    CardShare,
    Fraction,
    NodeSpec,
    PodRequest,
    PoolConfig,
    Taint,
    WholeCards,
    default_catalog,
)
from gpuplane.port import Clock, ClusterEvent, ClusterPort, Code, EventKind, PodPhase, Status
from gpuplane.sim import EventLoop, SimCluster
from gpuplane.sim.engine import NORMAL, URGENT

CATALOG = default_catalog()
T4 = CATALOG.get("T4")


def make_cluster(loop: EventLoop | None = None) -> SimCluster:
    return SimCluster(CATALOG, [NodeSpec("n0", 16000, 65536, "T4", 2), NodeSpec("n1", 32000, 131072, "T4", 4)],
                      loop=loop)


def gpu_pod(name: str, cards: int = 1, cpu: int = 1000) -> PodRequest:
    return PodRequest(name, cpu_milli=cpu, memory_mib=1024, gpu=WholeCards(cards))


def whole(node: str, *cards: int) -> Assignment:
    return Assignment(node, tuple(CardShare(c, 1000, T4.memory_mib, T4.encoders, T4.decoders, whole=True)
                                  for c in cards))


class Recorder:
    def __init__(self) -> None:
        self.events: list[ClusterEvent] = []

    def __call__(self, event: ClusterEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[tuple[EventKind, str]]:
        return [(e.kind, e.pod.name if e.pod else e.node.name if e.node else "") for e in self.events]


def assert_conflict(status: Status) -> None:
    assert not status.ok
    assert status.code is Code.ERROR
    assert status.reasons and status.reasons[0].startswith("conflict"), status.reasons


# ---------------------------------------------------------------------------------------------- port basics
def test_sim_cluster_is_a_cluster_port() -> None:
    assert isinstance(make_cluster(), ClusterPort)


def test_uses_the_event_loop_it_is_given() -> None:
    loop = EventLoop()  # empty, hence len() == 0: must still be the cluster's clock
    cluster = make_cluster(loop)
    assert cluster.loop is loop
    rec = Recorder()
    cluster.watch(rec)
    loop.call_at(5.0, lambda: None if cluster.create_pod(gpu_pod("p")).ok else pytest.fail("create failed"))
    loop.run()
    pod = cluster.get_pod("p")
    assert pod is not None and pod.created_at == 5.0
    assert rec.events[0].time == 5.0


def test_nodes_start_at_version_1_with_canonical_models() -> None:
    cluster = SimCluster(CATALOG, [NodeSpec("v", 8000, 8192, "V100M32", 2)])
    (info,) = cluster.list_nodes()
    assert (info.name, info.resource_version, info.spec.gpu_model, info.annotations) == ("v", 1, "V100-32GB", ())


def test_create_pod_emits_pod_added_and_rejects_duplicates() -> None:
    cluster = make_cluster()
    rec = Recorder()
    cluster.watch(rec)
    assert cluster.create_pod(gpu_pod("p")).ok
    (event,) = rec.events
    assert event.kind is EventKind.POD_ADDED
    assert event.pod is not None and event.pod.phase is PodPhase.PENDING and event.pod.name == "p"
    assert [p.name for p in cluster.list_pods()] == ["p"]
    assert_conflict(cluster.create_pod(gpu_pod("p", cards=2)))
    assert len(rec.events) == 1
    pod = cluster.get_pod("p")
    assert pod is not None and pod.request.gpu == WholeCards(1)


def test_bind_emits_pod_bound_and_takes_capacity() -> None:
    loop = EventLoop(start=3.0)
    cluster = make_cluster(loop)
    cluster.create_pod(gpu_pod("p", cards=2, cpu=5000))
    rec = Recorder()
    cluster.watch(rec)
    assignment = whole("n0", 0, 1)
    assert cluster.bind("p", assignment).ok
    (event,) = rec.events
    assert event.kind is EventKind.POD_BOUND and event.time == 3.0
    assert event.pod is not None and event.pod.phase is PodPhase.RUNNING and event.pod.assignment == assignment
    pod = cluster.get_pod("p")
    assert pod is not None and pod.phase is PodPhase.RUNNING and pod.bound_at == 3.0
    n0 = cluster.state.node_index["n0"]
    assert cluster.state.idle_cards[n0] == 0
    assert cluster.state.cpu_free[n0] == 16000 - 5000
    assert cluster.state.used_gpu_milli() == 2000


def test_bind_with_the_current_node_version_succeeds() -> None:
    cluster = make_cluster()
    cluster.create_pod(gpu_pod("p"))
    assert cluster.bind("p", whole("n1", 3), node_version=1).ok


def _not_pending(cluster: SimCluster) -> tuple[str, Assignment, int | None]:
    cluster.bind("p", whole("n0", 0))
    return "p", whole("n1", 0), None


def _node_missing(cluster: SimCluster) -> tuple[str, Assignment, int | None]:
    return "p", whole("n9", 0), None


def _stale_version(cluster: SimCluster) -> tuple[str, Assignment, int | None]:
    version = cluster.list_nodes()[0].resource_version
    assert cluster.patch_node("n0", labels={"zone": "a"}).ok
    return "p", whole("n0", 0), version


def _no_longer_fits(cluster: SimCluster) -> tuple[str, Assignment, int | None]:
    cluster.create_pod(gpu_pod("q"))
    assert cluster.bind("q", whole("n0", 1)).ok
    return "p", whole("n0", 1), None


def _cpu_exhausted(cluster: SimCluster) -> tuple[str, Assignment, int | None]:
    cluster.create_pod(PodRequest("hog", cpu_milli=16000))
    assert cluster.bind("hog", Assignment("n0")).ok
    return "p", whole("n0", 0), None


def _no_such_card(cluster: SimCluster) -> tuple[str, Assignment, int | None]:
    return "p", whole("n0", 2), None


@pytest.mark.parametrize("setup", [_not_pending, _node_missing, _stale_version, _no_longer_fits, _cpu_exhausted,
                                   _no_such_card])
def test_bind_conflicts(setup: Callable[[SimCluster], tuple[str, Assignment, int | None]]) -> None:
    cluster = make_cluster()
    cluster.create_pod(gpu_pod("p"))
    pod, assignment, version = setup(cluster)
    before = cluster.state.fingerprint()
    phase = cluster.get_pod(pod).phase  # type: ignore[union-attr]
    rec = Recorder()
    cluster.watch(rec)
    assert_conflict(cluster.bind(pod, assignment, node_version=version))
    assert rec.events == []
    assert cluster.state.fingerprint() == before
    assert cluster.get_pod(pod).phase is phase  # type: ignore[union-attr]


def test_bind_unknown_pod_fails() -> None:
    status = make_cluster().bind("ghost", whole("n0", 0))
    assert status.code is Code.ERROR and "not found" in status.message


# ---------------------------------------------------------------------------------------------- evict / delete
def test_evict_with_grace_terminates_then_deletes_after_grace() -> None:
    cluster = make_cluster()
    cluster.create_pod(gpu_pod("p", cards=2))
    cluster.bind("p", whole("n0", 0, 1))
    cluster.loop.run(until=10.0)
    rec = Recorder()
    cluster.watch(rec)
    assert cluster.evict("p", grace_s=30.0, reason="preempted").ok
    pod = cluster.get_pod("p")
    assert pod is not None and pod.phase is PodPhase.TERMINATING
    assert ("gpuplane.io/eviction-reason", "preempted") in pod.annotations
    assert rec.kinds() == [(EventKind.POD_TERMINATING, "p")]
    n0 = cluster.state.node_index["n0"]
    cluster.loop.run(until=39.999)
    assert cluster.get_pod("p") is not None
    assert cluster.state.idle_cards[n0] == 0  # a terminating pod still holds its cards
    cluster.loop.run(until=40.0)
    assert cluster.get_pod("p") is None
    assert rec.kinds() == [(EventKind.POD_TERMINATING, "p"), (EventKind.POD_DELETED, "p")]
    assert rec.events[-1].time == 40.0
    assert cluster.state.idle_cards[n0] == 2
    assert "p" not in cluster.state.bindings


def test_evicting_a_terminating_pod_does_not_restart_its_grace() -> None:
    cluster = make_cluster()
    cluster.create_pod(gpu_pod("p"))
    cluster.bind("p", whole("n0", 0))
    cluster.evict("p", grace_s=30.0)
    cluster.loop.run(until=20.0)
    assert cluster.evict("p", grace_s=100.0).ok
    cluster.loop.run(until=30.0)
    assert cluster.get_pod("p") is None


def test_evict_pending_or_without_grace_deletes_at_once() -> None:
    cluster = make_cluster()
    rec = Recorder()
    cluster.watch(rec)
    cluster.create_pod(gpu_pod("pending"))
    cluster.create_pod(gpu_pod("running"))
    cluster.bind("running", whole("n0", 0))
    assert cluster.evict("pending", grace_s=30.0).ok
    assert cluster.evict("running", grace_s=0.0).ok
    assert cluster.get_pod("pending") is None and cluster.get_pod("running") is None
    assert (EventKind.POD_TERMINATING, "running") not in rec.kinds()
    assert cluster.state.used_gpu_milli() == 0
    assert cluster.evict("ghost").code is Code.ERROR


def test_an_old_eviction_timer_does_not_delete_a_recreated_pod_early() -> None:
    cluster = make_cluster()
    cluster.create_pod(gpu_pod("p"))
    cluster.bind("p", whole("n0", 0))
    cluster.evict("p", grace_s=30.0)            # timer at t=30
    cluster.loop.run(until=5.0)
    cluster.delete_pod("p")
    cluster.create_pod(gpu_pod("p"))
    cluster.bind("p", whole("n0", 0))
    cluster.loop.run(until=10.0)
    cluster.evict("p", grace_s=30.0)            # this pod's grace ends at t=40
    cluster.loop.run(until=35.0)
    pod = cluster.get_pod("p")
    assert pod is not None and pod.phase is PodPhase.TERMINATING
    cluster.loop.run(until=40.0)
    assert cluster.get_pod("p") is None


def test_delete_during_grace_deletes_once() -> None:
    cluster = make_cluster()
    rec = Recorder()
    cluster.watch(rec)
    cluster.create_pod(gpu_pod("p"))
    cluster.bind("p", whole("n0", 0))
    cluster.evict("p", grace_s=30.0)
    assert cluster.delete_pod("p").ok
    cluster.loop.run()
    assert [k for k, _ in rec.kinds()].count(EventKind.POD_DELETED) == 1


def test_delete_releases_capacity() -> None:
    cluster = make_cluster()
    cluster.create_pod(gpu_pod("big", cards=4))
    assert cluster.bind("big", whole("n1", 0, 1, 2, 3)).ok
    cluster.create_pod(gpu_pod("next", cards=4))
    assert_conflict(cluster.bind("next", whole("n1", 0, 1, 2, 3)))
    rec = Recorder()
    cluster.watch(rec)
    assert cluster.delete_pod("big").ok
    assert rec.kinds() == [(EventKind.POD_DELETED, "big")]
    assert rec.events[0].pod is not None and rec.events[0].pod.assignment is not None
    assert cluster.state.used_gpu_milli() == 0
    assert cluster.bind("next", whole("n1", 0, 1, 2, 3)).ok
    assert cluster.delete_pod("big").code is Code.ERROR
    assert cluster.state.check_invariants() == []


# ---------------------------------------------------------------------------------------------- workloads
def pod_names(cluster: SimCluster) -> list[str]:
    return sorted(p.name for p in cluster.list_pods())


def test_workload_scale_up_and_down() -> None:
    cluster = make_cluster()
    rec = Recorder()
    cluster.watch(rec)
    template = gpu_pod("template")
    assert cluster.create_workload("w", template, 3).ok
    assert pod_names(cluster) == ["w-0", "w-1", "w-2"]
    assert rec.kinds() == [(EventKind.POD_ADDED, f"w-{i}") for i in range(3)]
    for i in range(3):
        pod = cluster.get_pod(f"w-{i}")
        assert pod is not None
        assert (pod.request.workload, pod.request.instance, pod.request.gpu) == ("w", i, WholeCards(1))
    assert_conflict(cluster.create_workload("w", template, 1))
    assert cluster.scale("w", 5).ok
    assert pod_names(cluster) == [f"w-{i}" for i in range(5)]
    assert cluster.workloads["w"].replicas == 5
    # w-0 and w-3 run; scaling down removes the pending pods first, newest first.
    cluster.bind("w-0", whole("n0", 0))
    cluster.bind("w-3", whole("n0", 1))
    assert cluster.scale("w", 4).ok
    assert pod_names(cluster) == ["w-0", "w-1", "w-2", "w-3"]
    assert cluster.scale("w", 2).ok
    assert pod_names(cluster) == ["w-0", "w-3"]
    # Only running pods left: the newest goes.
    assert cluster.scale("w", 1).ok
    assert pod_names(cluster) == ["w-0"]
    assert cluster.state.used_gpu_milli() == 1000
    # Indexes are never reused.
    assert cluster.scale("w", 3).ok
    assert pod_names(cluster) == ["w-0", "w-5", "w-6"]
    assert cluster.scale("w", 0).ok
    assert cluster.list_pods() == []
    assert cluster.state.used_gpu_milli() == 0


def test_workload_replaces_deleted_members_on_the_next_scale() -> None:
    cluster = make_cluster()
    cluster.create_workload("w", gpu_pod("t"), 2)
    cluster.delete_pod("w-0")
    assert pod_names(cluster) == ["w-1"]
    assert cluster.scale("w", 2).ok
    assert pod_names(cluster) == ["w-1", "w-2"]


def test_workload_errors() -> None:
    cluster = make_cluster()
    assert cluster.scale("nope", 1).code is Code.ERROR
    cluster.create_workload("w", gpu_pod("t"), 1)
    status = cluster.scale("w", -1)
    assert status.code is Code.ERROR and "negative" in status.message
    assert pod_names(cluster) == ["w-0"]


# ---------------------------------------------------------------------------------------------- nodes
def test_patch_node_changes_spec_bumps_version_and_emits() -> None:
    cluster = make_cluster()
    rec = Recorder()
    cluster.watch(rec)
    assert cluster.patch_node("n0", labels={"zone": "a", "rack": "r1"}, annotations={"note": "x"}).ok
    assert cluster.patch_node("n0", labels={"rack": None, "team": "ml"}, taints=[Taint("dedicated", "gpu")],
                              annotations={"note": None, "other": "y"}).ok
    info = next(n for n in cluster.list_nodes() if n.name == "n0")
    assert info.resource_version == 3
    assert info.spec.labels == (("team", "ml"), ("zone", "a"))
    assert info.spec.taints == (Taint("dedicated", "gpu", "NoSchedule"),)
    assert info.annotations == (("other", "y"),)
    assert [e.kind for e in rec.events] == [EventKind.NODE_UPDATED] * 2
    assert [e.node.resource_version for e in rec.events if e.node] == [2, 3]
    assert rec.events[-1].node == info
    n0 = cluster.state.node_index["n0"]
    assert cluster.state.nodes[n0].label("team") == "ml"
    assert cluster.state.nodes[n0].taints == info.spec.taints

    assert cluster.patch_node("n0", unschedulable=True).ok
    assert not cluster.state.schedulable[n0]
    info = next(n for n in cluster.list_nodes() if n.name == "n0")
    assert not info.spec.schedulable and info.resource_version == 4
    assert info.spec.labels == (("team", "ml"), ("zone", "a"))  # untouched fields keep their value
    assert cluster.patch_node("n0", unschedulable=False, taints=[]).ok
    info = next(n for n in cluster.list_nodes() if n.name == "n0")
    assert info.spec.schedulable and info.spec.taints == () and cluster.state.schedulable[n0]
    # The other node is untouched.
    assert next(n for n in cluster.list_nodes() if n.name == "n1").resource_version == 1


def test_patch_node_pool_and_unknown_node() -> None:
    cluster = make_cluster()
    assert cluster.patch_node("n1", pool="dev").ok
    assert cluster.state.nodes[cluster.state.node_index["n1"]].pool == "dev"
    status = cluster.patch_node("n9", labels={"a": "b"})
    assert status.code is Code.ERROR and "not found" in status.message


def test_add_node_emits_and_rejects_duplicates() -> None:
    cluster = make_cluster()
    rec = Recorder()
    cluster.watch(rec)
    assert cluster.add_node(NodeSpec("n2", 8000, 8192, "V100M16", 1)).ok
    assert rec.kinds() == [(EventKind.NODE_ADDED, "n2")]
    assert rec.events[0].node is not None and rec.events[0].node.spec.gpu_model == "V100-16GB"
    assert_conflict(cluster.add_node(NodeSpec("n2", 8000, 8192, "T4", 1)))
    cluster.create_pod(gpu_pod("p"))
    assert cluster.bind("p", Assignment("n2", (CardShare(0, 1000, 16160, whole=True),))).ok


# ---------------------------------------------------------------------------------------------- watch
def test_events_arrive_in_order_to_every_subscriber_until_unsubscribed() -> None:
    cluster = make_cluster()
    first, second = Recorder(), Recorder()
    cluster.watch(first)
    stop_second = cluster.watch(second)
    cluster.create_pod(gpu_pod("a"))
    cluster.bind("a", whole("n0", 0))
    cluster.patch_node("n1", labels={"x": "1"})
    cluster.evict("a", grace_s=1.0)
    cluster.loop.run()
    stop_second()
    stop_second()  # harmless twice
    cluster.create_pod(gpu_pod("b"))
    expected = [(EventKind.POD_ADDED, "a"), (EventKind.POD_BOUND, "a"), (EventKind.NODE_UPDATED, "n1"),
                (EventKind.POD_TERMINATING, "a"), (EventKind.POD_DELETED, "a"), (EventKind.POD_ADDED, "b")]
    assert first.kinds() == expected
    assert second.kinds() == expected[:-1]
    assert second.events == first.events[:-1]
    assert [e.time for e in first.events] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_events_caused_by_a_handler_reach_later_subscribers_in_order() -> None:
    cluster = make_cluster()
    reactor, observer = Recorder(), Recorder()

    def react(event: ClusterEvent) -> None:
        reactor(event)
        if event.kind is EventKind.POD_ADDED and event.pod is not None:
            cluster.bind(event.pod.name, whole("n0", 0))

    cluster.watch(react)
    cluster.watch(observer)
    cluster.create_pod(gpu_pod("p"))
    expected = [(EventKind.POD_ADDED, "p"), (EventKind.POD_BOUND, "p")]
    assert reactor.kinds() == expected
    assert observer.kinds() == expected
    pod = cluster.get_pod("p")
    assert pod is not None and pod.phase is PodPhase.RUNNING  # still synchronous with the outer call


def test_unsubscribing_during_delivery_stops_delivery_at_once() -> None:
    cluster = make_cluster()
    victim = Recorder()
    stops: list[Callable[[], None]] = []
    cluster.watch(lambda event: stops[0]())
    stops.append(cluster.watch(victim))
    cluster.create_pod(gpu_pod("p"))
    assert victim.events == []


# ---------------------------------------------------------------------------------------------- event loop
def test_event_loop_implements_the_clock() -> None:
    loop = EventLoop(start=7.0)
    assert isinstance(loop, Clock)
    assert loop.now() == 7.0
    assert len(loop) == 0 and not loop.step()


def test_same_time_events_run_in_scheduling_order_and_urgent_first() -> None:
    loop = EventLoop()
    order: list[str] = []
    loop.call_at(5.0, lambda: order.append("a"))
    loop.call_at(5.0, lambda: order.append("b"))
    loop.call_at(1.0, lambda: order.append("early"))
    loop.call_at(5.0, lambda: order.append("urgent"), priority=URGENT)
    loop.call_at(5.0, lambda: order.append("c"), priority=NORMAL)
    loop.run()
    assert order == ["early", "urgent", "a", "b", "c"]
    assert loop.processed == 5
    assert loop.now() == 5.0


def test_events_scheduled_by_a_callback_for_now_run_after_those_already_due() -> None:
    loop = EventLoop()
    order: list[str] = []

    def first() -> None:
        order.append("first")
        loop.call_later(0.0, lambda: order.append("spawned"))

    loop.call_at(1.0, first)
    loop.call_at(1.0, lambda: order.append("second"))
    loop.run()
    assert order == ["first", "second", "spawned"]


def test_cancel() -> None:
    loop = EventLoop()
    order: list[int] = []
    keep = loop.call_at(1.0, lambda: order.append(1))
    drop = loop.call_at(2.0, lambda: order.append(2))
    drop.cancel()
    loop.run()
    assert order == [1] and loop.processed == 1
    assert not keep.cancelled and drop.cancelled


def test_run_until_stops_at_the_boundary() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0, 4.0):
        loop.call_at(t, lambda: seen.append(loop.now()))
    loop.run(until=3.0)
    assert seen == [1.0, 2.0, 3.0]  # an event exactly at the boundary runs
    assert loop.now() == 3.0
    loop.run(until=3.5)
    assert seen == [1.0, 2.0, 3.0] and loop.now() == 3.5
    loop.run(until=100.0)
    assert seen == [1.0, 2.0, 3.0, 4.0] and loop.now() == 100.0
    assert len(loop) == 0


def test_run_until_never_moves_the_clock_back() -> None:
    loop = EventLoop()
    loop.call_at(20.0, lambda: None)
    loop.run(until=10.0)
    loop.run(until=5.0)
    assert loop.now() == 10.0
    loop.call_later(1.0, lambda: None)
    loop.run(until=5.0)
    assert loop.now() == 10.0


def test_scheduling_in_the_past_raises() -> None:
    loop = EventLoop()
    loop.call_at(10.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError, match="past"):
        loop.call_at(9.0, lambda: None)
    entry = loop.call_later(-5.0, lambda: None)  # a negative delay means now
    assert entry.time == 10.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([URGENT, NORMAL])), max_size=30))
def test_events_run_in_time_priority_sequence_order(specs: list[tuple[int, int]]) -> None:
    loop = EventLoop()
    ran: list[int] = []
    for index, (when, priority) in enumerate(specs):
        loop.call_at(float(when), functools.partial(ran.append, index), priority=priority)
    loop.run()
    assert ran == sorted(range(len(specs)), key=lambda i: (specs[i][0], specs[i][1], i))


def test_patch_node_refuses_a_pool_that_breaks_promised_memory() -> None:
    catalog = default_catalog()
    cluster = SimCluster(catalog, [NodeSpec("dev", 8000, 65536, "A100-40GB", 1, pool="dev")],
                         pools={"dev": PoolConfig(memory_oversell=2.0), "prod": PoolConfig()})
    # 2 × 40960 MiB can be promised in the dev pool; 60000 MiB of it is.
    cluster.create_pod(PodRequest("big", gpu=Fraction(memory_mib=60000)))
    assert cluster.bind("big", Assignment("dev", (CardShare(0, 0, 60000),))).ok
    status = cluster.patch_node("dev", pool="prod")
    assert status.code is Code.ERROR and "60000 MiB promised on 40960 MiB" in status.message
    (info,) = cluster.list_nodes()
    assert info.spec.pool == "dev" and info.resource_version == 1
