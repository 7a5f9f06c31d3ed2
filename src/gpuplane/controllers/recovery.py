"""Keeping a large training job running: checkpoint intervals, the ETTR account, and recovery decisions.

- `young_interval` / `daly_interval`: the checkpoint interval that minimises expected waste for a blocking
  checkpoint cost C and a job mean time between failures M (Young 1974: √(2CM); Daly 2006's higher-order
  form, M when C ≥ 2M).
- `CheckpointPlanner`: picks the interval from the *measured* checkpoint cost (a moving average of the
  saves it is told about) and the job's *observed* failure rate (failures per node-day, with the fleet's
  rate as a prior worth `prior_node_days`), so that a job on a bad patch of the fleet checkpoints more often.
- `EttrAccount`: where a job's wall-clock time went: productive training, blocking checkpoint saves, work
  lost to rollbacks, detection, diagnosis, rescheduling, restart and checkpoint load, manual escalation.
  ETTR = productive / wall.
- `segment_outcome`: what a run of `duration` seconds between a restart and the next failure yields, given
  the interval and the cost: saves every `interval` of training, each blocking for `cost`; the work since
  the last completed save is lost at the failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from gpuplane.controllers.classifier import Classification, FailureClassifier
from gpuplane.controllers.health import HealthEvent, NodeHealthBook
from gpuplane.model import PodRequest, Taint
from gpuplane.model.failures import FailureAction
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, PodPhase, Status

DAY_S = 86_400.0


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """τ* = √(2CM)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006): √(2CM)·[1 + ⅓√(C/2M) + (C/2M)/9] − C for C < 2M, else M."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


@dataclass(slots=True)
class CheckpointPlanner:
    """The checkpoint interval for one job, from measured costs and observed failures."""

    nodes: int
    prior_rate_per_node_day: float
    prior_node_days: float = 1_000.0
    formula: str = "daly"
    cost_s: float | None = None
    cost_weight: float = 0.2
    failures: int = 0
    node_days: float = 0.0

    def measured_cost(self, seconds: float) -> None:
        self.cost_s = seconds if self.cost_s is None else (
            (1 - self.cost_weight) * self.cost_s + self.cost_weight * seconds)

    def observed(self, node_days: float, failures: int = 0) -> None:
        self.node_days += node_days
        self.failures += failures

    def rate_per_node_day(self) -> float:
        prior = self.prior_rate_per_node_day * self.prior_node_days
        return (self.failures + prior) / (self.node_days + self.prior_node_days)

    def mtbf_s(self) -> float:
        rate = self.rate_per_node_day() * self.nodes
        return math.inf if rate <= 0 else DAY_S / rate

    def interval_s(self, default_cost_s: float) -> float:
        cost = self.cost_s if self.cost_s is not None else default_cost_s
        mtbf = self.mtbf_s()
        if not math.isfinite(mtbf):
            return math.inf
        return young_interval(cost, mtbf) if self.formula == "young" else daly_interval(cost, mtbf)


@dataclass(slots=True)
class EttrAccount:
    """Seconds of a job's wall clock by where they went; they add up to `wall_s`."""

    productive_s: float = 0.0
    checkpoint_s: float = 0.0
    lost_s: float = 0.0
    detection_s: float = 0.0
    diagnosis_s: float = 0.0
    reschedule_s: float = 0.0
    restart_s: float = 0.0
    checkpoint_load_s: float = 0.0
    manual_s: float = 0.0
    failures: int = 0
    isolated_nodes: int = 0

    @property
    def wall_s(self) -> float:
        return float(sum(getattr(self, f.name) for f in fields(self) if f.name.endswith("_s")))

    @property
    def ettr(self) -> float:
        wall = self.wall_s
        return self.productive_s / wall if wall > 0 else 1.0

    def add(self, other: EttrAccount) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def shares_pct(self) -> dict[str, float]:
        wall = self.wall_s or 1.0
        return {f.name.removesuffix("_s"): getattr(self, f.name) * 100.0 / wall for f in fields(self)
                if f.name.endswith("_s")}


@dataclass(frozen=True, slots=True)
class Segment:
    productive_s: float
    checkpoint_s: float
    lost_s: float
    saves: int


def segment_outcome(duration_s: float, interval_s: float, cost_s: float, *, failed: bool) -> Segment:
    """Split `duration_s` of running into productive training, blocking saves and lost work.

    The job trains `interval_s`, saves for `cost_s`, and repeats. A failure loses the training since the
    last completed save (and a save in progress); a segment that ends without failure (the horizon) keeps
    everything it trained."""
    if duration_s <= 0:
        return Segment(0.0, 0.0, 0.0, 0)
    if not math.isfinite(interval_s):
        return Segment(0.0, 0.0, duration_s, 0) if failed else Segment(duration_s, 0.0, 0.0, 0)
    cycle = interval_s + cost_s
    if cycle <= 0:
        # saving continuously for free: every moment is saved, nothing is lost
        return Segment(duration_s, 0.0, 0.0, 0)
    saves = int(duration_s // cycle)
    rest = duration_s - saves * cycle
    productive, checkpoint = saves * interval_s, saves * cost_s
    if failed:
        return Segment(productive, checkpoint, rest, saves)
    tail_train = min(rest, interval_s)
    return Segment(productive + tail_train, checkpoint + (rest - tail_train), 0.0, saves)


@dataclass(frozen=True, slots=True)
class RecoveryTimes:
    """Seconds each recovery step takes."""

    detection_crash_s: float
    detection_hang_s: float
    diagnosis_s: float
    reschedule_spare_s: float
    reschedule_cold_s: float
    restart_s: float
    checkpoint_load_s: float
    manual_probability: float
    manual_s: float


@dataclass(slots=True)
class SparePool:
    """Warm spares for a job: replacements come from here first, then from the fleet (cold)."""

    spares: list[str] = field(default_factory=list)

    def take(self) -> str | None:
        return self.spares.pop(0) if self.spares else None

    def give(self, node: str) -> None:
        self.spares.append(node)


# ---------------------------------------------------------------------------------------------- the controller
QUARANTINE_TAINT = Taint("gpuplane.io/health", "quarantined", "NoSchedule")
"""On an isolated node: no pod tolerates it, so the scheduler places nothing there until repair."""
HEALTH_LABEL = "gpuplane.io/health"


@dataclass(frozen=True, slots=True)
class Evidence:
    """One piece of what a failure left behind: a log line, an Xid, or an exit code / signal, on a node."""

    node: str
    line: str | bytes | None = None
    xid: int | None = None
    exit_code: int | None = None
    signal: str | None = None


def classify_incident(classifier: FailureClassifier, evidence: Sequence[Evidence], now: float) -> Classification:
    """One incident's verdict from everything it left behind (the classifier starts afresh)."""
    classifier.reset()
    for item in evidence:
        if item.line is not None:
            classifier.feed_line(item.node, item.line, now)
        if item.xid is not None:
            classifier.feed_xid(item.node, item.xid, now)
        if item.exit_code is not None or item.signal is not None:
            classifier.feed_exit(item.node, item.exit_code, item.signal, now)
    return classifier.verdict()


def nodes_to_isolate(verdict: Classification) -> tuple[str, ...]:
    """The nodes an incident takes out of service: the blamed ones, when the action is to isolate."""
    return verdict.blamed_nodes if verdict.action is FailureAction.ISOLATE_NODE else ()


@dataclass(slots=True)
class GangJob:
    """A training job run as one gang: `nodes` members like `template`, restarted as a new attempt."""

    name: str
    template: PodRequest
    nodes: int
    planner: CheckpointPlanner
    attempt: int = 0
    running_since: float | None = None
    last_checkpoint_at: float | None = None
    account: EttrAccount = field(default_factory=EttrAccount)

    def members(self) -> list[str]:
        return [f"{self.name}.{self.attempt}.{i}" for i in range(self.nodes)]


@dataclass(frozen=True, slots=True)
class RecoveryOutcome:
    classification: Classification
    isolated: tuple[str, ...]
    lost_s: float
    resubmitted: bool
    status: Status


class RecoveryController:
    """On a failure: classify the evidence, isolate the blamed nodes (quarantine in the health book, a
    NoSchedule taint and a label through the cluster port), and restart the job's gang from its last
    checkpoint as a new attempt, which the scheduler places on healthy nodes (free spares included). Work
    since the last checkpoint is charged to the job's ETTR account as lost; each failure and each measured
    checkpoint cost updates the job's `CheckpointPlanner`."""

    def __init__(self, port: ClusterPort, classifier: FailureClassifier, book: NodeHealthBook,
                 now: Callable[[], float]) -> None:
        self.port = port
        self.classifier = classifier
        self.book = book
        self.now = now
        self.jobs: dict[str, GangJob] = {}
        self._member_of: dict[str, GangJob] = {}
        self._unsubscribe = port.watch(self._on_event)

    def close(self) -> None:
        self._unsubscribe()

    def submit(self, job: GangJob) -> Status:
        self.jobs[job.name] = job
        gang = f"{job.name}.{job.attempt}"
        for member in job.members():
            request = replace(job.template, name=member, gang=gang, gang_size=job.nodes)
            self._member_of[member] = job
            status = self.port.create_pod(request)
            if not status.ok:
                return status
        return Status.success()

    def checkpointed(self, job_name: str, cost_s: float) -> float:
        """The job reports a checkpoint completed now that blocked it `cost_s`; returns the interval to the
        next one (Young/Daly from the measured cost and the job's observed failure rate)."""
        job = self.jobs[job_name]
        job.last_checkpoint_at = self.now()
        job.planner.measured_cost(cost_s)
        job.account.checkpoint_s += cost_s
        return job.planner.interval_s(cost_s)

    def on_failure(self, job_name: str, evidence: Sequence[Evidence]) -> RecoveryOutcome:
        job = self.jobs[job_name]
        now = self.now()
        verdict = classify_incident(self.classifier, evidence, now)
        cause = verdict.signature.id if verdict.signature is not None else "unknown failure"
        isolated = nodes_to_isolate(verdict)
        for node in isolated:
            # an isolate-node verdict quarantines at once, whatever the node's failure count
            self.book.apply(node, HealthEvent.CRITICAL_FAILURE, now, f"isolated: {cause}")
            self._quarantine(node)
        if job.running_since is not None:
            job.planner.observed(job.nodes * (now - job.running_since) / DAY_S, 1)
        saved_at = job.last_checkpoint_at if job.last_checkpoint_at is not None else job.running_since
        lost = max(0.0, now - saved_at) if saved_at is not None else 0.0
        job.account.lost_s += lost
        job.account.failures += 1
        job.account.isolated_nodes += len(isolated)
        for member in job.members():
            self.port.delete_pod(member)
            self._member_of.pop(member, None)
        job.running_since = None
        if verdict.action is FailureAction.DO_NOT_RETRY:
            return RecoveryOutcome(verdict, isolated, lost, False, Status.error(f"{job.name}: not retried ({cause})"))
        job.attempt += 1
        return RecoveryOutcome(verdict, isolated, lost, True, self.submit(job))

    def _quarantine(self, node: str) -> None:
        info = next((n for n in self.port.list_nodes() if n.name == node), None)
        if info is None:
            return
        taints = (*(t for t in info.spec.taints if t.key != QUARANTINE_TAINT.key), QUARANTINE_TAINT)
        self.port.patch_node(node, taints=taints, labels={HEALTH_LABEL: "quarantined"})

    def _on_event(self, event: ClusterEvent) -> None:
        if event.kind is not EventKind.POD_BOUND or event.pod is None:
            return
        job = self._member_of.get(event.pod.name)
        if job is None or job.running_since is not None:
            return
        bound = {p.name for p in self.port.list_pods() if p.phase is PodPhase.RUNNING}
        if all(member in bound for member in job.members()):
            job.running_since = event.time
            if job.last_checkpoint_at is None:
                job.last_checkpoint_at = event.time
