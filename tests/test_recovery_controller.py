"""The recovery controller in virtual time, through the simulated cluster port and the real scheduler:
failure → classified → blamed node isolated → gang restarted on healthy nodes (the spare included), with
the work since the last checkpoint charged as lost."""

from __future__ import annotations

import pytest

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.health import NodeHealth, NodeHealthBook
from gpuplane.controllers.recovery import (
    HEALTH_LABEL,
    QUARANTINE_TAINT,
    CheckpointPlanner,
    Evidence,
    GangJob,
    RecoveryController,
    daly_interval,
)
from gpuplane.model import NodeSpec, PodRequest, QoS, WholeCards, default_catalog
from gpuplane.model.failures import FailureAction, load_signature_library
from gpuplane.port import PodPhase
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop

XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2417, GPU has fallen off the bus."
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
ILLEGAL_ADDRESS = "RuntimeError: CUDA error: an illegal memory access was encountered"


class Rig:
    """Five 8-GPU nodes (four for the job, one spare), the scheduler, the controller, a virtual clock."""

    def __init__(self) -> None:
        catalog = default_catalog()
        nodes = [NodeSpec(f"node-{i}", 128_000, 1_024_000, "H100-80GB", 8) for i in range(5)]
        self.loop = EventLoop()
        self.cluster = SimCluster(catalog, nodes, loop=self.loop)
        profile = default_registry().build(PolicyConfig(node_policy="binpack", seed=1))
        self.scheduler = Scheduler(self.cluster, catalog, profile, seed=1, now=self.loop.now)
        library = load_signature_library()
        self.book = NodeHealthBook(nodes=[n.name for n in nodes])
        self.controller = RecoveryController(self.cluster, FailureClassifier(library), self.book, self.loop.now)
        template = PodRequest("train", cpu_milli=64_000, memory_mib=512_000, gpu=WholeCards(8), qos=QoS.OFFLINE)
        self.job = GangJob("train", template, nodes=4, planner=CheckpointPlanner(4, prior_rate_per_node_day=0.01))

    def advance(self, to: float) -> None:
        self.loop.run(until=to)
        self.scheduler.run_pending()

    def placement(self) -> dict[str, str]:
        return {p.name: p.assignment.node for p in self.cluster.list_pods()
                if p.phase is PodPhase.RUNNING and p.assignment is not None}


@pytest.fixture
def rig() -> Rig:
    r = Rig()
    assert r.controller.submit(r.job).ok
    r.advance(0.0)
    return r


def test_a_blamed_node_is_isolated_and_the_gang_restarts_without_it(rig: Rig) -> None:
    first = rig.placement()
    assert sorted(first) == rig.job.members() and len(set(first.values())) == 4
    assert rig.job.running_since == 0.0
    rig.advance(900.0)
    # a save completes at t = 900 after blocking 10 s; prior 0.01/node-day on 4 nodes: M = 86,400 / 0.04 s
    interval = rig.controller.checkpointed("train", 10.0)
    assert interval == pytest.approx(daly_interval(10.0, 86_400 / 0.04))
    rig.advance(1_000.0)
    culprit = first["train.0.2"]
    outcome = rig.controller.on_failure("train", [Evidence(culprit, line=XID_79)])
    # Xid 79 blames its node: isolate; lost work = 1,000 - 900 = 100 s since the last checkpoint
    assert outcome.classification.action is FailureAction.ISOLATE_NODE
    assert outcome.isolated == (culprit,)
    assert outcome.lost_s == pytest.approx(100.0)
    assert outcome.resubmitted and outcome.status.ok
    assert rig.book.state(culprit) is NodeHealth.QUARANTINED
    spec = next(n.spec for n in rig.cluster.list_nodes() if n.name == culprit)
    assert QUARANTINE_TAINT in spec.taints and dict(spec.labels)[HEALTH_LABEL] == "quarantined"
    rig.advance(1_000.0)
    second = rig.placement()
    # the new attempt runs on four nodes: the three healthy ones and the spare, never the culprit
    assert sorted(second) == rig.job.members() == [f"train.1.{i}" for i in range(4)]
    assert culprit not in second.values() and len(set(second.values())) == 4
    assert rig.job.running_since == 1_000.0
    assert (rig.job.account.failures, rig.job.account.isolated_nodes, rig.job.account.lost_s) == (1, 1, 100.0)
    # the failure counts: 1 failure in 4 nodes x 1,000 s on top of the prior's 1,000 node-days
    assert rig.job.planner.failures == 1 and rig.job.planner.rate_per_node_day() > 0.01


def test_a_software_failure_restarts_in_place_without_isolating(rig: Rig) -> None:
    first = set(rig.placement().values())
    rig.advance(600.0)  # no checkpoint yet: lost work counts from the start of the run, 600 s
    outcome = rig.controller.on_failure("train", [Evidence("node-0", line=ILLEGAL_ADDRESS)])
    assert outcome.classification.action is FailureAction.RESTART_JOB
    assert outcome.isolated == () and outcome.resubmitted
    assert outcome.lost_s == pytest.approx(600.0)
    rig.advance(600.0)
    # nothing was isolated: no node is tainted, all five stay healthy, the new attempt runs on four of them
    assert sorted(rig.placement()) == [f"train.1.{i}" for i in range(4)]
    assert len(set(rig.placement().values())) == 4
    assert not any(QUARANTINE_TAINT in n.spec.taints for n in rig.cluster.list_nodes())
    assert all(rig.book.state(f"node-{i}") is NodeHealth.HEALTHY for i in range(5)) and len(first) == 4


def test_a_deterministic_user_error_is_not_retried(rig: Rig) -> None:
    rig.advance(300.0)
    outcome = rig.controller.on_failure("train", [Evidence("node-0", line=OOM)])
    # CUDA out of memory recurs at the same step on any hardware: stop the job, blame no node
    assert outcome.classification.action is FailureAction.DO_NOT_RETRY
    assert not outcome.resubmitted and not outcome.status.ok and "not retried (cuda-oom)" in outcome.status.message
    rig.advance(300.0)
    assert rig.placement() == {}


def test_an_unknown_failure_restarts_and_is_counted(rig: Rig) -> None:
    rig.advance(50.0)
    outcome = rig.controller.on_failure("train", [Evidence("node-1", line="something nobody has seen before")])
    assert outcome.classification.unknown and outcome.classification.action is FailureAction.RESTART_JOB
    assert outcome.resubmitted and outcome.isolated == ()
    assert rig.controller.classifier.unknown_failures == 1
