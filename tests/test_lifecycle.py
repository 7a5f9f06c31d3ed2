"""The node lifecycle controller: cordon → drain (budgets honoured) → repair → probation → return, on the node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import CATALOG, node, pod
from gpuplane.controllers.health import (
    HEALTH_LABEL,
    QUARANTINE_TAINT,
    HealthEvent,
    HealthPolicy,
    NodeHealth,
    NodeHealthBook,
    NodeHealthController,
)
from gpuplane.controllers.lifecycle import (
    LIFECYCLE_ANNOTATION,
    LIFECYCLE_HISTORY,
    InstantRepair,
    LifecycleStep,
    NodeLifecycleController,
    lifecycle_of,
)
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.model import Assignment, CardShare
from gpuplane.port import ClusterPort, NodeInfo
from gpuplane.port.status import Code, Status
from gpuplane.sim import SimCluster
from test_kube_cluster import World

GRACE_S = 5.0
PROBATION_S = 100.0


def whole(node_name: str, card: int) -> Assignment:
    return Assignment(node_name, (CardShare(card=card, compute_milli=1000, memory_mib=40960, whole=True),))


def node_of(port: ClusterPort, name: str) -> NodeInfo:
    return next(n for n in port.list_nodes() if n.name == name)


def steps_on(port: ClusterPort, name: str) -> list[str]:
    return [entry["step"] for entry in json.loads(dict(node_of(port, name).annotations).get(LIFECYCLE_HISTORY, "[]"))]


class SimWorld:
    def __init__(self, pods_on_n0: int = 2, fail: tuple[str, ...] = ()) -> None:
        self.cluster = SimCluster(CATALOG, [node("n0").gpus(4).obj(), node("n1").gpus(4).obj()])
        self.book = NodeHealthBook(HealthPolicy(probation_s=PROBATION_S), ["n0", "n1"])
        self.health = NodeHealthController(self.cluster, self.book, self.cluster.loop.now)
        self.repair = InstantRepair(fail)
        self.life = NodeLifecycleController(self.cluster, self.health, self.repair, grace_s=GRACE_S)
        for i in range(pods_on_n0):
            self.place(f"a{i}", "n0", i)
        self.place("b0", "n1", 0)

    def place(self, name: str, node_name: str, card: int) -> None:
        assert self.cluster.create_pod(pod(name).cpu(100).mem(256).whole(1).obj()).ok
        assert self.cluster.bind(name, whole(node_name, card)).ok

    def run(self, seconds: float) -> None:
        self.cluster.loop.run(until=self.cluster.loop.now() + seconds)


def test_a_quarantined_node_goes_round_the_whole_lifecycle_and_back() -> None:
    w = SimWorld()
    w.health.isolate("n0", "xid 79")
    # (what one pass writes, then how long the world runs before the next pass)
    passes: list[tuple[list[LifecycleStep], float]] = [
        ([LifecycleStep.CORDONED, LifecycleStep.DRAINING], GRACE_S),  # two evictions sent; their grace runs out
        ([LifecycleStep.DRAINED, LifecycleStep.REPAIRING], 1.0),      # no pods left: repair starts
        ([LifecycleStep.PROBATION], 1.0),                             # InstantRepair is done at its first poll
        ([], PROBATION_S),                                            # 1 s into 100 s of probation: nothing
        ([LifecycleStep.RETURNED], 1.0),
        ([], 1.0),                                                    # healthy: the controller leaves it be
    ]
    states = []
    for expected, then in passes:
        assert [r.step for r in w.life.step()] == expected
        states.append(w.book.state("n0"))
        w.run(then)
    assert states == [NodeHealth.QUARANTINED, NodeHealth.REPAIRING, NodeHealth.PROBATION, NodeHealth.PROBATION,
                      NodeHealth.HEALTHY, NodeHealth.HEALTHY]
    assert steps_on(w.cluster, "n0") == ["cordoned", "draining", "drained", "repairing", "probation", "returned"]
    n0 = node_of(w.cluster, "n0")
    assert n0.spec.schedulable and QUARANTINE_TAINT not in n0.spec.taints and HEALTH_LABEL not in dict(n0.spec.labels)
    assert w.repair.started == ["n0"]
    # n1 was never touched: its pod still runs, and it carries no lifecycle annotation.
    assert [p.name for p in w.cluster.list_pods()] == ["b0"]
    assert lifecycle_of(node_of(w.cluster, "n1")) is None


def test_probation_uncordons_and_keeps_the_label_for_small_jobs_only() -> None:
    w = SimWorld(pods_on_n0=0)
    w.health.isolate("n0", "xid 48")
    w.life.step()  # cordoned, drained, repairing
    w.life.step()  # probation
    n0 = node_of(w.cluster, "n0")
    assert n0.spec.schedulable and QUARANTINE_TAINT not in n0.spec.taints
    assert dict(n0.spec.labels)[HEALTH_LABEL] == "probation"
    assert w.book.eligible("n0", 8, w.cluster.loop.now()) and not w.book.eligible("n0", 256, w.cluster.loop.now())


def test_a_failed_repair_goes_back_to_quarantine_and_round_again() -> None:
    w = SimWorld(pods_on_n0=0, fail=("n0",))
    w.health.isolate("n0", "xid 79")
    assert [r.step for r in w.life.step()] == [LifecycleStep.CORDONED, LifecycleStep.DRAINED, LifecycleStep.REPAIRING]
    assert [r.step for r in w.life.step()] == [LifecycleStep.REPAIR_FAILED]
    assert w.book.state("n0") is NodeHealth.QUARANTINED and not node_of(w.cluster, "n0").spec.schedulable
    # Still cordoned, so no second cordon: drained (nothing on it) and a second repair.
    assert [r.step for r in w.life.step()] == [LifecycleStep.DRAINED, LifecycleStep.REPAIRING]
    assert [r.step for r in w.life.step()] == [LifecycleStep.PROBATION]
    assert w.repair.started == ["n0", "n0"]


def test_suspect_and_healthy_nodes_are_left_alone() -> None:
    w = SimWorld()
    assert w.health.apply("n0", HealthEvent.FAILURE_ATTRIBUTED, "one job failed").state is NodeHealth.SUSPECT
    assert w.life.step() == []
    assert len(w.cluster.list_pods()) == 3 and node_of(w.cluster, "n0").spec.schedulable is True


# -- a disruption budget through the Kubernetes port ----------------------------------------------------------------


class KubeWorld(World):
    """test_kube_cluster's world (a manual clock at t=1000, manual dispatch) with the health and lifecycle
    controllers on it; one eviction attempt per call, so a budget's refusal comes back at once."""

    def __init__(self, server: FakeApiServer) -> None:
        super().__init__(server)
        self.cluster.eviction_attempts = 1
        self.book = NodeHealthBook(HealthPolicy(probation_s=PROBATION_S), ["n1"])
        self.health = NodeHealthController(self.cluster, self.book, self.cluster.clock.now)
        self.life = NodeLifecycleController(self.cluster, self.health, InstantRepair(), grace_s=0)


@pytest.fixture
def kube() -> Iterator[KubeWorld]:
    with FakeApiServer() as server:
        server.add_node(node_json("n1", cards=8))
        world = KubeWorld(server)
        yield world
        world.cluster.close()


def test_a_budget_refusal_holds_the_drain_and_the_next_pass_retries(kube: KubeWorld) -> None:
    kube.server.add_pod(pod_json("p", limits={"nvidia.com/gpu": "1"}))
    assert kube.settle(lambda: kube.cluster.get_pod("default/p") is not None)
    assert kube.cluster.bind("default/p", whole("n1", 0)).ok
    kube.health.isolate("n1", "xid 79")
    assert kube.settle(lambda: node_of(kube.cluster, "n1").spec.taints != ())
    kube.server.block_eviction("default/p")
    records = kube.life.step()
    assert [r.step for r in records] == [LifecycleStep.CORDONED, LifecycleStep.DRAIN_BLOCKED]
    assert records[-1].detail == "budget refused default/p"
    assert kube.server.get("pods", "default/p") is not None  # the budget held: the pod runs on
    stored = kube.server.get("nodes", "n1")
    assert stored is not None and json.loads(stored["metadata"]["annotations"][LIFECYCLE_ANNOTATION])["step"] == \
        "drain-blocked"
    assert kube.settle(lambda: lifecycle_of(node_of(kube.cluster, "n1")) is not None)
    assert kube.life.step() == []  # still blocked, the same detail: nothing new written
    kube.server.unblock_eviction("default/p")
    assert [r.step for r in kube.life.step()] == [LifecycleStep.DRAINING]
    assert kube.settle(lambda: kube.cluster.get_pod("default/p") is None)
    assert kube.settle(lambda: lifecycle_of(node_of(kube.cluster, "n1")) is not None and
                       lifecycle_of(node_of(kube.cluster, "n1")).step is LifecycleStep.DRAINING)  # type: ignore[union-attr]
    assert [r.step for r in kube.life.step()] == [LifecycleStep.DRAINED, LifecycleStep.REPAIRING]
    assert kube.book.state("n1") is NodeHealth.REPAIRING


# -- invariants ------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(pods=st.integers(0, 4), blocked=st.sets(st.integers(0, 3)), release_after=st.integers(0, 3),
       failures=st.integers(0, 2))
def test_repair_never_starts_while_a_pod_is_on_the_node(pods: int, blocked: set[int], release_after: int,
                                                         failures: int) -> None:
    """Budgets refuse some evictions for `release_after` passes; repairs fail `failures` times. Whatever the mix:
    repair starts only on an empty node, the node comes back in the end, and no pod elsewhere is touched."""
    w = SimWorld(pods_on_n0=pods, fail=("n0",) * failures)
    refused = {f"a{i}" for i in blocked if i < pods}
    evict = w.cluster.evict
    passes = [0]

    def guarded(name: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        if name in refused and passes[0] < release_after:
            return Status(Code.PENDING, ("blocked: disruption budget",))
        return evict(name, grace_s=grace_s, reason=reason)

    w.cluster.evict = guarded  # type: ignore[method-assign,assignment]
    w.health.isolate("n0", "xid 79")
    for passes[0] in range(40):
        for record in w.life.step():
            if record.step is LifecycleStep.REPAIRING:
                assert not [p for p in w.cluster.list_pods() if p.assignment and p.assignment.node == "n0"]
        w.run(PROBATION_S / 4)
        if w.book.state("n0") is NodeHealth.HEALTHY:
            break
    assert w.book.state("n0") is NodeHealth.HEALTHY
    assert steps_on(w.cluster, "n0")[-2:] == ["probation", "returned"]
    assert steps_on(w.cluster, "n0").count("repair-failed") == failures
    assert [p.name for p in w.cluster.list_pods()] == ["b0"]


@pytest.mark.parametrize("handover_after", [1, 2, 3, 4])
def test_a_new_leader_carries_on_from_the_node_labels(handover_after: int) -> None:
    """The controller is replaced after `handover_after` passes by one with a fresh book rebuilt from the nodes'
    health labels (a new leader): the node still goes round to `returned`, each step written once."""
    w = SimWorld()
    w.health.isolate("n0", "xid 79")
    for _ in range(handover_after):
        w.life.step()
        w.run(GRACE_S)
    book = NodeHealthBook(HealthPolicy(probation_s=PROBATION_S))
    health = NodeHealthController(w.cluster, book, w.cluster.loop.now)
    health.rebuild()
    assert book.state("n0") is w.book.state("n0")  # the label says where the old leader left it
    life = NodeLifecycleController(w.cluster, health, InstantRepair(), grace_s=GRACE_S)
    for _ in range(10):
        life.step()
        w.run(PROBATION_S)
    assert book.state("n0") is NodeHealth.HEALTHY
    assert steps_on(w.cluster, "n0") == ["cordoned", "draining", "drained", "repairing", "probation", "returned"]
    assert [p.name for p in w.cluster.list_pods()] == ["b0"]


class _Killed(Exception):
    """The leader's process dies here (SIGKILL: nothing after it runs)."""


class _DyingPort:
    """The cluster port of a leader that is killed right after its `die_after`-th write (a node patch or an
    eviction) has reached the cluster."""

    def __init__(self, port: ClusterPort, die_after: int) -> None:
        self._port = port
        self.die_after = die_after
        self.writes = 0

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._port, name)
        if name not in ("patch_node", "evict"):
            return attr

        def write(*args: object, **kwargs: object) -> Status:
            if self.writes >= self.die_after:
                raise _Killed(name)
            status: Status = attr(*args, **kwargs)
            self.writes += 1
            return status
        return write


class _RequestedRepair:
    """A `Repairer` whose state lives on the node, like the operator's `AnnotatedRepair`: `start` writes a request
    through its port; a requested repair is done at its first poll, and one never requested never is."""

    def __init__(self, port: ClusterPort) -> None:
        self.port = port

    def start(self, node: str) -> None:
        self.port.patch_node(node, annotations={REQUESTED: "yes"})

    def poll(self, node: str) -> bool | None:
        return True if dict(node_of(self.port, node).annotations).get(REQUESTED) else None


REQUESTED = "test/repair-requested"
# One whole round writes 16 times: 1 the quarantine (taint, label); pass 1: 2 the cordon, 3 `cordoned`, 4 and 5 the
# evictions of a0 and a1, 6 `draining`; pass 2: 7 `drained`, 8 the repairing label, 9 the repair request,
# 10 `repairing`; pass 3: 11 the probation label, 12 the taint lifted, 13 the uncordon, 14 `probation`; the last
# pass: 15 the label removed, 16 `returned`. The old leader is killed after each of writes 1 to 15 in turn.
ROUND = ["cordoned", "draining", "drained", "repairing", "probation", "returned"]


@pytest.mark.parametrize("die_after", range(1, 16))
def test_a_leader_killed_after_any_write_leaves_no_step_repeated_or_skipped(die_after: int) -> None:
    """The old leader is killed right after one of its writes, between two of a pass's actions; a new leader (a
    fresh book from the health labels) finishes the round: the repair requested, every step written once, in
    order (the drill `kill-operator-drain` does the same with processes)."""
    w = SimWorld()
    port = cast(ClusterPort, _DyingPort(w.cluster, die_after))
    old = NodeLifecycleController(port, NodeHealthController(port, w.book, w.cluster.loop.now),
                                  _RequestedRepair(port), grace_s=GRACE_S)
    old.health.isolate("n0", "xid 79")
    with pytest.raises(_Killed):
        for _ in range(20):
            old.step()
            w.run(PROBATION_S)
    book = NodeHealthBook(HealthPolicy(probation_s=PROBATION_S))
    health = NodeHealthController(w.cluster, book, w.cluster.loop.now)
    health.rebuild()
    life = NodeLifecycleController(w.cluster, health, _RequestedRepair(w.cluster), grace_s=GRACE_S)
    for _ in range(10):
        life.step()
        w.run(PROBATION_S)
    n0 = node_of(w.cluster, "n0")
    assert book.state("n0") is NodeHealth.HEALTHY and dict(n0.annotations).get(REQUESTED) == "yes"
    assert steps_on(w.cluster, "n0") == ROUND
    assert n0.spec.schedulable and QUARANTINE_TAINT not in n0.spec.taints
    assert [p.name for p in w.cluster.list_pods()] == ["b0"]
