"""A bind the world refuses after the scheduler committed: a gang rolled back after some members bound, a plain
pod whose nominated bind fails, and the collateral of a preempted gang (its other members, still terminating).

The queue must then hold each pending pod exactly once, never a pod the world has bound or deleted, and the
cache must keep what the world still runs (a terminating pod's cards are not free until it is gone)."""

from __future__ import annotations

from dataclasses import replace

from builders import CATALOG, node, pod
from gpuplane.model import Assignment, PodRequest
from gpuplane.model.priority import PriorityClass, PriorityClasses, default_priority_classes
from gpuplane.port import PodPhase, Status
from gpuplane.scheduler import PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())
CLASSES = PriorityClasses([*default_priority_classes(), PriorityClass("low-now", 10, victim_grace_s=0.0),
                           PriorityClass("high-now", 900, victim_grace_s=0.0)])


class RefusingCluster(SimCluster):
    """A simulated cluster that refuses the first bind of the pods named in `refuse` (a conflict the scheduler
    could not foresee: another writer, a node agent's veto)."""

    def __init__(self, *args: object, refuse: set[str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.refuse = set(refuse)

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        if pod in self.refuse:
            self.refuse.discard(pod)
            return Status.error(f"conflict: {pod} refused by the test")
        return super().bind(pod, assignment, node_version=node_version)


def member(name: str, gang: str, size: int, cards: int = 8, priority_class: str | None = None) -> PodRequest:
    priority = CLASSES.get(priority_class).value if priority_class is not None else 0
    return replace(pod(name).whole(cards).obj(), gang=gang, gang_size=size, priority_class=priority_class,
                   priority=priority)


def single(name: str, cards: int, priority_class: str) -> PodRequest:
    return replace(pod(name).whole(cards).obj(), priority_class=priority_class,
                   priority=CLASSES.get(priority_class).value)


def queued_names(scheduler: Scheduler) -> list[str]:
    return sorted(e.request.name for e in scheduler.queue.entries())


def test_a_gang_rolled_back_after_a_member_bound_leaves_that_member_out_of_the_queue() -> None:
    # Two 8-card nodes, a gang of two 8-card members: h0 binds, h1's bind is refused, so h0 is evicted (the gang
    # never runs in part). h0 stays Terminating for the kubelet's 30 s stop and in the cache meanwhile; it must
    # not be queued again (trial-placing it again raised "already placed"), and h1 is queued once.
    cluster = RefusingCluster(CATALOG, [node("n0").gpus(8).obj(), node("n1").gpus(8).obj()], stop_s=30.0,
                              refuse={"h1"})
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now)
    for name in ("h0", "h1"):
        assert cluster.create_pod(member(name, "team/h", 2)).ok
    scheduler.run_pending()
    assert cluster.get_pod("h0").phase is PodPhase.TERMINATING  # type: ignore[union-attr]
    assert "h0" in scheduler.state.bindings  # its cards are not free until it is gone
    assert queued_names(scheduler) == ["h1"]
    assert len(scheduler.queue) == 1
    scheduler.run_pending()  # the retry sees one member of two: it waits, it does not place h0 again
    assert cluster.get_pod("h1").phase is PodPhase.PENDING  # type: ignore[union-attr]
    cluster.loop.run(until=31.0)  # h0's stop ends: it is deleted
    assert cluster.get_pod("h0") is None and "h0" not in scheduler.state.bindings
    assert cluster.create_pod(member("h0", "team/h", 2)).ok  # its operator submits it again
    scheduler.run_pending()
    assert {n: cluster.get_pod(n).phase for n in ("h0", "h1")} == {  # type: ignore[union-attr]
        "h0": PodPhase.RUNNING, "h1": PodPhase.RUNNING}
    assert len(scheduler.queue) == 0


def test_a_gang_whose_pending_members_are_deleted_during_the_rollback_is_not_queued_again() -> None:
    # As above, but the world deletes the gang's pending members as soon as one member is evicted (the platform
    # week's operator stops the whole gang): nothing of the gang may stay queued.
    cluster = RefusingCluster(CATALOG, [node(f"n{i}").gpus(8).obj() for i in range(3)], stop_s=30.0,
                              refuse={"h2"})
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now)

    def stop_gang(event: object) -> None:
        pod_info = getattr(event, "pod", None)
        if pod_info is not None and pod_info.phase is PodPhase.TERMINATING and pod_info.request.gang == "team/h":
            for other in cluster.list_pods():
                if other.request.gang == "team/h" and other.phase is PodPhase.PENDING:
                    cluster.delete_pod(other.name)

    cluster.watch(stop_gang)
    for name in ("h0", "h1", "h2"):
        assert cluster.create_pod(member(name, "team/h", 3)).ok
    scheduler.run_pending()  # h0 and h1 bind, h2 is refused: h0 and h1 evicted, h2 deleted
    assert cluster.get_pod("h2") is None
    assert len(scheduler.queue) == 0
    for _ in range(3):
        scheduler.run_pending()
    cluster.loop.run(until=400.0)  # past the 300 s flush of parked pods
    scheduler.run_pending()
    assert len(scheduler.queue) == 0 and scheduler.state.bindings.keys() == set()


def test_a_plain_pod_whose_bind_fails_after_its_victims_left_is_queued_once() -> None:
    # A 1-card node runs a low pod (grace 0, no kubelet stop: gone at once). A high pod preempts it, its victim
    # leaves during the commit, then its own bind is refused: it is queued once (not active and parked both).
    cluster = RefusingCluster(CATALOG, [node("n0").gpus(1).obj()], refuse={"hi"})
    rules = SchedulingRules(classes=CLASSES)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=rules)
    assert cluster.create_pod(single("lo", 1, "low-now")).ok
    scheduler.run_pending()
    assert cluster.create_pod(single("hi", 1, "high-now")).ok
    scheduler.run_pending()
    assert cluster.get_pod("lo") is None
    assert queued_names(scheduler) == ["hi"] and len(scheduler.queue) == 1
    scheduler.run_pending()  # nothing woke it: still queued once; the node's next event (or the flush) retries
    cluster.loop.run(until=301.0)
    scheduler.run_pending()
    assert cluster.get_pod("hi").phase is PodPhase.RUNNING  # type: ignore[union-attr]
    assert len(scheduler.queue) == 0


def test_the_collateral_of_a_preempted_gang_holds_its_cards_in_the_cache_until_it_is_gone() -> None:
    # A training gang, g0 and g1 on the two 8-card nodes. A high 8-card pod preempts one member; the other goes
    # too (a gang never runs in part) though the high pod does not need its node. While it terminates (30 s
    # grace) its cards are still the world's: a pod that needs its node must wait, not be bound into a conflict.
    cluster = SimCluster(CATALOG, [node("n0").gpus(8).obj(), node("n1").gpus(8).obj()])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now)
    for name in ("g0", "g1"):
        assert cluster.create_pod(member(name, "team/g", 2, priority_class="training")).ok
    scheduler.run_pending()
    assert {cluster.get_pod(n).phase for n in ("g0", "g1")} == {PodPhase.RUNNING}  # type: ignore[union-attr]
    assert cluster.create_pod(single("hi", 8, "online")).ok
    scheduler.run_pending()
    assert {cluster.get_pod(n).phase for n in ("g0", "g1")} == {PodPhase.TERMINATING}  # type: ignore[union-attr]
    # One member is the victim (its cards are the high pod's now), the other the collateral, still in the cache.
    assert len({"g0", "g1"} & scheduler.state.bindings.keys()) == 1
    assert cluster.create_pod(single("other", 8, "online")).ok
    scheduler.run_pending()
    assert cluster.get_pod("other").phase is PodPhase.PENDING  # type: ignore[union-attr]
    cluster.loop.run(until=31.0)  # both gone: hi binds where its victim was, other on the collateral's node
    scheduler.run_pending()
    assert {n: cluster.get_pod(n).phase for n in ("hi", "other")} == {  # type: ignore[union-attr]
        "hi": PodPhase.RUNNING, "other": PodPhase.RUNNING}
