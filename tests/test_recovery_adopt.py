"""`RecoveryController` adopting gangs someone else submitted, through the simulated cluster port and the real
scheduler: the owner's callback re-creates (the simulator) or deleting the pods is the restart (Kubernetes'
Job/JobSet controllers re-create them); the node agent's per-node evidence reaches the gangs on those nodes;
and `NodeHealthController` puts the book's states on the nodes (taint, label)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.health import (
    HEALTH_LABEL,
    QUARANTINE_TAINT,
    HealthEvent,
    HealthPolicy,
    NodeHealth,
    NodeHealthController,
)
from gpuplane.controllers.recovery import (
    AdoptedGang,
    CheckpointPlanner,
    Evidence,
    RecoveryOutcome,
)
from gpuplane.model import PodRequest, QoS, WholeCards
from gpuplane.model.failures import FailureAction
from gpuplane.port import Status
from gpuplane.sim.cluster import SimCluster
from test_recovery_controller import Rig

XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2417, GPU has fallen off the bus."
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
ILLEGAL_ADDRESS = "RuntimeError: CUDA error: an illegal memory access was encountered"
JOB_LABEL = ("batch.kubernetes.io/job-name", "train")


class Owner:
    """Someone else's job: it creates a gang of four 8-GPU pods per attempt, named `train-<attempt>-<i>`, in gang
    `train-<attempt>` (renamed per attempt, so adopted by label) or always `train` (adopted by gang name)."""

    def __init__(self, cluster: SimCluster, *, rename: bool) -> None:
        self.cluster = cluster
        self.rename = rename
        self.attempt = 0
        self.restarts: list[int] = []

    def create(self) -> None:
        gang = f"train-{self.attempt}" if self.rename else "train"
        for i in range(4):
            self.cluster.create_pod(PodRequest(f"train-{self.attempt}-{i}", cpu_milli=64_000, memory_mib=512_000,
                                               gpu=WholeCards(8), qos=QoS.OFFLINE, gang=gang, gang_size=4,
                                               labels=(JOB_LABEL,)))

    def restart(self, gang: AdoptedGang, outcome: RecoveryOutcome) -> Status:
        self.restarts.append(gang.attempt)
        self.attempt += 1
        self.create()
        return Status.success()


def tainted(rig: Rig) -> list[str]:
    return sorted(n.name for n in rig.cluster.list_nodes() if QUARANTINE_TAINT in n.spec.taints)


def planner() -> CheckpointPlanner:
    return CheckpointPlanner(4, prior_rate_per_node_day=0.01)


@dataclass(frozen=True)
class Case:
    name: str
    by_label: bool
    callback: bool
    line: str
    action: FailureAction
    isolated: int
    """nodes isolated: Xid 79 blames its own node, the others none"""
    restarted: bool
    pods_after: int
    """live gang pods right after the failure: 4 when the owner's callback re-created them, else 0"""


CASES = [
    Case("xid79-by-gang-name-owner-callback", False, True, XID_79, FailureAction.ISOLATE_NODE, 1, True, 4),
    Case("xid79-by-label-owner-callback", True, True, XID_79, FailureAction.ISOLATE_NODE, 1, True, 4),
    # Kubernetes: the controller deletes the pods; the Job controller (not here) re-creates them
    Case("xid79-by-label-delete-is-restart", True, False, XID_79, FailureAction.ISOLATE_NODE, 1, True, 0),
    Case("software-restarts-in-place", False, True, ILLEGAL_ADDRESS, FailureAction.RESTART_JOB, 0, True, 4),
    Case("oom-not-retried", True, True, OOM, FailureAction.DO_NOT_RETRY, 0, False, 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_adopted_gang_is_recovered_through_its_owner(case: Case) -> None:
    rig = Rig()
    owner = Owner(rig.cluster, rename=case.by_label)
    owner.create()
    gang = rig.controller.adopt(AdoptedGang(
        "train", planner(), gang=None if case.by_label else "train", label=JOB_LABEL if case.by_label else None,
        restart=owner.restart if case.callback else None))
    rig.advance(0.0)
    first = rig.placement()
    assert len(first) == 4 and gang.running_since == 0.0  # all four bound at t = 0
    rig.advance(700.0)
    rig.controller.checkpointed("train", 10.0)  # saved at t = 700
    rig.advance(1_000.0)
    culprit = first["train-0-2"]
    outcome = rig.controller.on_failure("train", [Evidence(culprit, line=case.line)])
    assert outcome.classification.action is case.action
    assert len(outcome.isolated) == case.isolated and outcome.resubmitted is case.restarted
    assert outcome.lost_s == pytest.approx(300.0)  # 1,000 - 700 since the save
    assert tainted(rig) == ([culprit] if case.isolated else [])
    assert len(gang.members(rig.cluster.list_pods())) == case.pods_after
    # the callback is told the attempt it starts: 1
    assert owner.restarts == ([1] if case.callback and case.restarted else [])
    assert [(r.job, r.action, r.restarted) for r in rig.controller.history] == [("train", case.action, case.restarted)]
    rig.advance(1_000.0)
    placed = rig.placement()
    assert len(placed) == case.pods_after
    if case.pods_after:  # the new attempt runs, never on an isolated node, and the gang is running again
        assert not set(outcome.isolated) & set(placed.values()) and gang.running_since == 1_000.0


def test_node_evidence_reaches_the_gang_on_that_node_and_a_lone_node_is_still_isolated() -> None:
    rig = Rig()
    owner = Owner(rig.cluster, rename=False)
    owner.create()
    rig.controller.adopt(AdoptedGang("train", planner(), gang="train", restart=owner.restart))
    rig.advance(0.0)
    busy = set(rig.placement().values())
    (spare,) = {f"node-{i}" for i in range(5)} - busy
    # the spare reports Xid 79 with no gang on it: isolated, no gang fails
    assert rig.controller.on_node_evidence([Evidence(spare, xid=79)]) == {}
    assert tainted(rig) == [spare] and owner.restarts == []
    # a busy node reports it: the gang on it fails and restarts (on the three others; the spare is out)
    culprit = sorted(busy)[0]
    outcomes = rig.controller.on_node_evidence([Evidence(culprit, line=XID_79)])
    assert list(outcomes) == ["train"] and outcomes["train"].isolated == (culprit,)
    assert owner.restarts == [1] and tainted(rig) == sorted([spare, culprit])
    rig.advance(10.0)
    assert rig.placement() == {}  # 3 healthy nodes left for a gang of 4: it waits, on no tainted node
    assert rig.controller.on_node_evidence([]) == {}


def test_adoption_is_by_gang_name_or_label_exactly_one() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        AdoptedGang("x", planner())
    with pytest.raises(ValueError, match="exactly one"):
        AdoptedGang("x", planner(), gang="x", label=JOB_LABEL)
    gang = AdoptedGang("x", planner(), label=JOB_LABEL)
    request = PodRequest("p", gang="other", gang_size=1)
    assert not gang.matches(request) and gang.matches(replace(request, labels=(JOB_LABEL,)))


@dataclass(frozen=True)
class HealthCase:
    name: str
    events: tuple[HealthEvent, ...]
    state: NodeHealth
    label: str | None
    tainted: bool
    isolations: int


HEALTH_CASES = [
    HealthCase("passed-check-changes-nothing", (HealthEvent.CHECK_PASSED,), NodeHealth.HEALTHY, None, False, 0),
    HealthCase("failed-check-suspect", (HealthEvent.CHECK_FAILED,), NodeHealth.SUSPECT, "suspect", True, 0),
    HealthCase("suspect-cleared", (HealthEvent.CHECK_FAILED, HealthEvent.CHECK_PASSED), NodeHealth.HEALTHY, None,
               False, 0),
    HealthCase("two-failed-checks-quarantine", (HealthEvent.CHECK_FAILED, HealthEvent.CHECK_FAILED),
               NodeHealth.QUARANTINED, "quarantined", True, 1),
    HealthCase("critical-quarantines-at-once", (HealthEvent.CRITICAL_FAILURE,), NodeHealth.QUARANTINED,
               "quarantined", True, 1),
    HealthCase("repair-then-probation-keeps-the-taint",
               (HealthEvent.CRITICAL_FAILURE, HealthEvent.REPAIR_STARTED, HealthEvent.REPAIR_DONE),
               NodeHealth.PROBATION, "probation", True, 1),
    # the exclusion policy: 2 attributed failures within 7 days quarantine (the second raises the limit)
    HealthCase("exclusion-limit", (HealthEvent.FAILURE_ATTRIBUTED, HealthEvent.FAILURE_ATTRIBUTED),
               NodeHealth.QUARANTINED, "quarantined", True, 1),
    # an illegal event (repair done on a healthy node) is refused: nothing moves, nothing is written
    HealthCase("illegal-is-refused", (HealthEvent.REPAIR_DONE,), NodeHealth.HEALTHY, None, False, 0),
]


@pytest.mark.parametrize("case", HEALTH_CASES, ids=[c.name for c in HEALTH_CASES])
def test_node_health_states_reach_the_node(case: HealthCase) -> None:
    rig = Rig()
    health = NodeHealthController(rig.cluster, rig.book, rig.loop.now)
    for event in case.events:
        health.apply("node-3", event, f"{event.value} by the test")
    spec = next(n.spec for n in rig.cluster.list_nodes() if n.name == "node-3")
    assert rig.book.state("node-3") is case.state
    assert dict(spec.labels).get(HEALTH_LABEL) == case.label
    assert (QUARANTINE_TAINT in spec.taints) is case.tainted
    assert [n for _, n, _ in health.isolations] == ["node-3"] * case.isolations
    assert sum(QUARANTINE_TAINT in n.spec.taints for n in rig.cluster.list_nodes()) == int(case.tainted)


@settings(max_examples=80, deadline=None)
@given(events=st.lists(st.sampled_from(list(HealthEvent)), max_size=12))
def test_a_node_is_tainted_exactly_while_the_book_keeps_it_out_of_any_job(events: list[HealthEvent]) -> None:
    rig = Rig()
    rig.book.policy = HealthPolicy(probation_s=0.0)  # probation may pass at once
    health = NodeHealthController(rig.cluster, rig.book, rig.loop.now)
    for event in events:
        health.apply("node-1", event)
        spec = next(n.spec for n in rig.cluster.list_nodes() if n.name == "node-1")
        state = rig.book.state("node-1")
        # healthy: no taint, no label; any other state: tainted (probation keeps the repair's taint), labelled
        assert (QUARANTINE_TAINT in spec.taints) is (state is not NodeHealth.HEALTHY)
        assert dict(spec.labels).get(HEALTH_LABEL) == (None if state is NodeHealth.HEALTHY else state.value)
    entered = sum(1 for r in rig.book.history if r.to_state is NodeHealth.QUARANTINED
                  and r.from_state is not NodeHealth.QUARANTINED)
    assert len(health.isolations) == entered  # one isolation recorded per entry into quarantine
