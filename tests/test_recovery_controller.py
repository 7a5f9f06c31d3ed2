"""The recovery controller in virtual time, through the simulated cluster port and the real scheduler:
failure → classified → blamed node isolated → gang restarted on healthy nodes (the spare included), with
the work since the last checkpoint charged as lost; which nodes a verdict isolates, a hang's suspect and
its stop-time check, the exclusion policy, and the repair cycle back to service."""

from __future__ import annotations

import pytest

from gpuplane.controllers.classifier import Classification, FailureClassifier
from gpuplane.controllers.health import HealthEvent, NodeHealth, NodeHealthBook
from gpuplane.controllers.recovery import (
    HEALTH_LABEL,
    QUARANTINE_TAINT,
    CheckpointPlanner,
    Evidence,
    GangJob,
    RecoveryController,
    classify_incident,
    daly_interval,
    hang_suspects,
    nodes_to_isolate,
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

    def __init__(self, stop_s: float = 0.0) -> None:
        catalog = default_catalog()
        nodes = [NodeSpec(f"node-{i}", 128_000, 1_024_000, "H100-80GB", 8) for i in range(5)]
        self.loop = EventLoop()
        self.cluster = SimCluster(catalog, nodes, loop=self.loop, stop_s=stop_s)
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


# ------------------------------------------------------------------------------ what to isolate, what to suspect

IB_PEER = ("gpu-node-017:2231:2870 [5] NCCL WARN NET/IB : Got completion with status=12 opcode=0 len=0 "
           "vendor err 129")
WATCHDOG = ("[rank{r}]:[E501 12:13:11.2 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=900, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
            "600012 milliseconds before timing out.")
PROGRESS = ("[rank{r}]:[E501 12:13:11.2 ProcessGroupNCCL.cpp:1834] [PG 0 (default_pg) Rank {r}] Exception (either an "
            "error or timeout) detected by watchdog at work: 900, last enqueued NCCL work: 900, last completed NCCL "
            "work: {done}.")
LAUNCH_FAILURE = "RuntimeError: CUDA error: unspecified launch failure"


def _verdict(evidence: list[Evidence]) -> Classification:
    return classify_incident(FailureClassifier(load_signature_library()), evidence, 0.0)


# (evidence as (node, line, t), isolated)
@pytest.mark.parametrize(("evidence", "isolated"), [
    # the dead GPU's node is the culprit; its peers' InfiniBand completions to it failing are symptoms
    ([("node-2", XID_79, 10.0), ("node-0", IB_PEER, 25.0), ("node-1", IB_PEER, 30.0)], ("node-2",)),
    # the peers' IB errors come first by their clocks: the Xid still wins within the window, same decision
    ([("node-0", IB_PEER, 8.0), ("node-2", XID_79, 10.0)], ("node-2",)),
    # nothing but IB completion errors: unclear which side erred, both go (reference §4.3 #25)
    ([("node-0", IB_PEER, 8.0), ("node-1", IB_PEER, 9.0)], ("node-0", "node-1")),
    # a second hardware fault of its own on another node goes too
    ([("node-2", XID_79, 10.0), ("node-3", "NVRM: Xid (PCI:0000:5e:00): 48, pid=1, name=python, An uncorrectable "
      "double bit error (DBE) has been detected on GPU in the framebuffer at partition 3, subpartition 0.", 11.0)],
     ("node-2", "node-3")),
])
def test_nodes_to_isolate(evidence: list[tuple[str, str, float]], isolated: tuple[str, ...]) -> None:
    verdict = _verdict([Evidence(node, line=line, t=t) for node, line, t in evidence])
    assert nodes_to_isolate(verdict) == isolated


# (completed NCCL work per node, suspects)
@pytest.mark.parametrize(("completed", "suspects"), [
    ({"node-0": 899, "node-1": 899, "node-2": 898, "node-3": 899}, ("node-2",)),  # one node behind
    ({"node-0": 899, "node-1": 898, "node-2": 898, "node-3": 899}, ()),           # two behind: no single suspect
    ({"node-0": 899, "node-1": 899}, ()),                                         # all level
    ({"node-0": 899}, ()),                                                        # no one to compare with
])
def test_hang_suspects(completed: dict[str, int], suspects: tuple[str, ...]) -> None:
    evidence = [Evidence(node, line=line.format(r=rank, done=done), t=600.0 + rank)
                for rank, (node, done) in enumerate(completed.items()) for line in (WATCHDOG, PROGRESS)]
    verdict = _verdict(evidence)
    assert verdict.action is FailureAction.RESTART_JOB and verdict.blamed_nodes == ()
    assert hang_suspects(verdict) == suspects


def test_a_blamed_node_is_never_a_hang_suspect() -> None:
    evidence = [Evidence("node-0", line=PROGRESS.format(r=0, done=898), t=600.0),
                Evidence("node-1", line=PROGRESS.format(r=8, done=899), t=600.0),
                Evidence("node-1", line=XID_79, t=10.0)]
    assert hang_suspects(_verdict(evidence)) == ()


# ------------------------------------------------------------------------------ the controller's health cycle


def _tainted(rig: Rig, node: str) -> bool:
    return QUARANTINE_TAINT in next(n.spec.taints for n in rig.cluster.list_nodes() if n.name == node)


def _label(rig: Rig, node: str) -> str | None:
    return dict(next(n.spec.labels for n in rig.cluster.list_nodes() if n.name == node)).get(HEALTH_LABEL)


def test_a_blaming_restart_verdict_counts_and_the_exclusion_policy_quarantines_the_second(rig: Rig) -> None:
    culprit = rig.placement()["train.0.1"]
    rig.advance(1_000.0)
    first = rig.controller.on_failure("train", [Evidence(culprit, line=LAUNCH_FAILURE)])
    # a launch failure blames its node but restarts in place: attributed (suspect), not isolated
    assert first.classification.action is FailureAction.RESTART_JOB and first.isolated == ()
    assert rig.book.state(culprit) is NodeHealth.SUSPECT and not _tainted(rig, culprit)
    rig.advance(2 * 86_400.0)  # two days on: past the launch failure's 24 h escalation, inside the 7-day window
    second = rig.controller.on_failure("train", [Evidence(culprit, line=LAUNCH_FAILURE)])
    # 2 attributed failures within 7 days: the exclusion policy quarantines it, and the controller isolates it
    assert second.isolated == (culprit,)
    assert rig.book.state(culprit) is NodeHealth.QUARANTINED and _tainted(rig, culprit)


def test_a_hang_suspect_sits_out_the_restart_until_its_check(rig: Rig) -> None:
    placement = rig.placement()
    nodes = [placement[m] for m in rig.job.members()]
    stuck = nodes[2]
    rig.advance(1_000.0)
    evidence = [Evidence(node, line=line.format(r=i, done=898 if node == stuck else 899), t=1_000.0 + i)
                for i, node in enumerate(nodes) for line in (WATCHDOG, PROGRESS)]
    outcome = rig.controller.on_failure("train", evidence)
    assert outcome.suspects == (stuck,) and outcome.isolated == () and outcome.resubmitted
    assert rig.book.state(stuck) is NodeHealth.SUSPECT and _tainted(rig, stuck) and _label(rig, stuck) == "suspect"
    rig.advance(1_000.0)
    assert stuck not in rig.placement().values()  # the restart ran without it (on the spare)
    assert rig.controller.check_done(stuck, passed=True).state is NodeHealth.HEALTHY
    assert not _tainted(rig, stuck) and _label(rig, stuck) is None


def test_a_suspect_that_fails_its_check_is_quarantined(rig: Rig) -> None:
    nodes = [rig.placement()[m] for m in rig.job.members()]
    evidence = [Evidence(node, line=PROGRESS.format(r=i, done=898 if i == 0 else 899), t=10.0 + i)
                for i, node in enumerate(nodes)]
    outcome = rig.controller.on_failure("train", evidence)
    assert outcome.suspects == (nodes[0],)
    assert rig.controller.check_done(nodes[0], passed=False).state is NodeHealth.QUARANTINED
    assert _tainted(rig, nodes[0]) and _label(rig, nodes[0]) == "quarantined"


# (failures attributed before the repair, untainted after probation): a node that failed twice in 30 days at
# far above the fleet's rate is a lemon and stays off large jobs
@pytest.mark.parametrize(("lemon", "untainted"), [(False, True), (True, False)])
def test_the_repair_cycle_gives_back_only_what_the_book_trusts(rig: Rig, lemon: bool, untainted: bool) -> None:
    node = rig.placement()["train.0.0"]
    if lemon:
        rig.book.apply(node, HealthEvent.FAILURE_ATTRIBUTED, 0.0, "an earlier failure")
    rig.advance(10.0)
    rig.controller.isolate(node, "xid-79")
    assert rig.controller.repair_started(node).state is NodeHealth.REPAIRING
    rig.advance(2 * 86_400.0)
    assert rig.controller.repair_done(node).state is NodeHealth.PROBATION
    assert _tainted(rig, node) and _label(rig, node) == "probation"  # no large job during probation
    early = rig.controller.probation_passed(node)
    assert not early.ok and _tainted(rig, node)  # 3 days of probation are not over
    rig.advance(5 * 86_400.0 + 10.0)
    assert rig.controller.probation_passed(node).state is NodeHealth.HEALTHY
    assert _tainted(rig, node) is not untainted
    assert _label(rig, node) == (None if untainted else "lemon")


def test_the_failed_attempts_pods_take_the_kubelets_stop_time() -> None:
    r = Rig(stop_s=2.0)
    assert r.controller.submit(r.job).ok
    r.advance(0.0)
    r.advance(100.0)
    r.controller.on_failure("train", [Evidence("node-0", line=ILLEGAL_ADDRESS)])
    phases = {p.name: p.phase for p in r.cluster.list_pods()}
    assert {phases[f"train.0.{i}"] for i in range(4)} == {PodPhase.TERMINATING}
    r.advance(101.9)  # the stop takes 2 s: the old attempt still holds its cards, the new one waits
    assert r.placement() == {} and all(r.cluster.get_pod(f"train.0.{i}") is not None for i in range(4))
    r.advance(102.0)
    assert sorted(r.placement()) == [f"train.1.{i}" for i in range(4)]
