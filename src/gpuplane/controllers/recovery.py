"""Keeping a large training job running: checkpoint intervals, the ETTR account, and recovery decisions.

- `young_interval` / `daly_interval`: the checkpoint interval that minimises expected waste for a blocking
  checkpoint cost C and a job mean time between failures M (Young 1974: √(2CM); Daly 2006's higher-order
  form, M when C ≥ 2M).
- `CheckpointPlanner`: picks the interval from the *measured* checkpoint cost (a moving average of the
  saves it is told about) and the job's *observed* failure rate (failures per node-day, with the fleet's
  rate as a prior worth `prior_node_days`), so that a job on a bad patch of the fleet checkpoints more often.
- `first_order_ettr`: the reference's closed form, ETTR ≈ 1 − C/τ − (τ/2 + R)/M (the scenario's cross-check).
- `EttrAccount`: where a job's wall-clock time went: productive training, blocking checkpoint saves, work
  lost to rollbacks, detection, diagnosis, rescheduling, restart and checkpoint load, manual escalation.
  ETTR = productive / wall.
- `RecoveryController`: the decisions on a failure, through the cluster port (see its docstring), with
  `classify_incident`, `nodes_to_isolate` and `hang_suspects` as its pure parts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from gpuplane.controllers.classifier import Classification, FailureClassifier
from gpuplane.controllers.health import HEALTH_LABEL as HEALTH_LABEL
from gpuplane.controllers.health import QUARANTINE_TAINT as QUARANTINE_TAINT
from gpuplane.controllers.health import (
    HealthEvent,
    HealthResult,
    NodeHealth,
    NodeHealthBook,
    NodeHealthController,
)
from gpuplane.model import PodRequest
from gpuplane.model.failures import FailureAction, FailureClass
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, PodInfo, PodPhase, Status

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


def first_order_ettr(cost_s: float, interval_s: float, downtime_s: float, job_failures_per_day: float) -> float:
    """Reference §2: ETTR ≈ 1 − C/τ − (τ/2 + R)/M with M = 1 day / the job's failures per day (at least 0)."""
    waste = cost_s / interval_s if interval_s > 0 else 1.0
    if job_failures_per_day > 0:
        waste += (interval_s / 2.0 + downtime_s) * job_failures_per_day / DAY_S
    return max(0.0, 1.0 - waste)


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


# ---------------------------------------------------------------------------------------------- the controller
@dataclass(frozen=True, slots=True)
class Evidence:
    """One piece of what a failure left behind: a log line, an Xid, or an exit code / signal, on a node."""

    node: str
    line: str | bytes | None = None
    xid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    t: float | None = None
    """when the node's clock says it happened (None: when the incident is classified)"""


def classify_incident(classifier: FailureClassifier, evidence: Sequence[Evidence], now: float,
                      scope: str = "") -> Classification:
    """One incident's verdict from everything it left behind (the classifier starts afresh). Evidence is
    timed by its own `t` (the node's clock) when it has one, else by `now`. `scope` (the job) is whose
    repeats escalate: a job's deterministic fault restarts once, then stops, on whatever nodes it reruns."""
    classifier.reset(scope=scope)
    for item in evidence:
        t = now if item.t is None else item.t
        if item.line is not None:
            classifier.feed_line(item.node, item.line, t)
        if item.xid is not None:
            classifier.feed_xid(item.node, item.xid, t)
        if item.exit_code is not None or item.signal is not None:
            classifier.feed_exit(item.node, item.exit_code, item.signal, t)
    return classifier.verdict()


_COMPLETED = re.compile(r"last completed NCCL work: (\d+)")


def hang_suspects(verdict: Classification) -> tuple[str, ...]:
    """A hang's suspect when nothing blames a node: the node whose ranks completed the fewest NCCL
    operations (reference §4.1: "the rank with the lowest completed sequence ... is the suspect"), when
    exactly one node is behind the others; no suspect otherwise."""
    if verdict.blamed_nodes or verdict.action is not FailureAction.RESTART_JOB:
        return ()
    completed: dict[str, int] = {}
    for match in verdict.matches:
        found = _COMPLETED.search(match.evidence)
        if found is not None:
            value = int(found.group(1))
            completed[match.node] = min(value, completed.get(match.node, value))
    if len(completed) < 2:
        return ()
    low = min(completed.values())
    behind = [node for node, value in completed.items() if value == low]
    return tuple(behind) if len(behind) == 1 and max(completed.values()) > low else ()


def nodes_to_isolate(verdict: Classification) -> tuple[str, ...]:
    """The nodes an incident takes out of service, when the action is to isolate: the blamed ones, except
    that when some blamed node shows a fault of its own outside the network (an Xid, ECC, a host error),
    nodes blamed only by network symptoms (their InfiniBand completions to the dead node failing) are its
    peers, not culprits. With network evidence alone, both sides go (reference §4.3 #25: "ISOLATE the erring
    side (both if unclear)")."""
    if verdict.action is not FailureAction.ISOLATE_NODE:
        return ()
    own = {m.node for m in verdict.matches
           if m.blames_node and m.failure_class is not FailureClass.NETWORK}
    return tuple(n for n in verdict.blamed_nodes if n in own) if own else verdict.blamed_nodes


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


RestartHook = Callable[["AdoptedGang", "RecoveryOutcome"], Status]
"""The owner's restart of an adopted gang (the simulator's resubmission); its pods are already stopped."""


@dataclass(slots=True)
class AdoptedGang:
    """A gang someone else submitted and re-creates: its members are the live pods whose `PodRequest.gang` is
    `gang`, or whose labels hold `label` (an owner that renames its gang per attempt labels its pods, as the
    Job controller's `batch.kubernetes.io/job-name` or JobSet's `jobset.sigs.k8s.io/jobset-name` do).

    On a restart the controller stops the members, then calls `restart` when there is one (the simulator's
    owner resubmits); without one, stopping is the restart: in Kubernetes the Job/JobSet controller re-creates
    the deleted pods. `nodes` is the gang's size (0: the members' `gang_size`)."""

    name: str
    planner: CheckpointPlanner
    gang: str | None = None
    label: tuple[str, str] | None = None
    restart: RestartHook | None = None
    nodes: int = 0
    attempt: int = 0
    running_since: float | None = None
    last_checkpoint_at: float | None = None
    account: EttrAccount = field(default_factory=EttrAccount)

    def __post_init__(self) -> None:
        if (self.gang is None) == (self.label is None):
            raise ValueError(f"{self.name}: adopt a gang by its gang name or by a label, exactly one")

    @property
    def key(self) -> tuple[str, str] | tuple[str, str, str]:
        """What a member carries: ("gang", name) or ("label", key, value)."""
        if self.gang is not None:
            return ("gang", self.gang)
        assert self.label is not None
        return ("label", *self.label)

    def matches(self, request: PodRequest) -> bool:
        if self.gang is not None:
            return request.gang == self.gang
        assert self.label is not None
        return self.label in request.labels

    def members(self, pods: Sequence[PodInfo]) -> list[PodInfo]:
        """The gang's live pods (pending or running), by name."""
        return sorted((p for p in pods if p.phase in (PodPhase.PENDING, PodPhase.RUNNING) and self.matches(p.request)),
                      key=lambda p: p.name)

    def size(self, members: Sequence[PodInfo]) -> int:
        return self.nodes or max((p.request.gang_size for p in members), default=0) or len(members)


Gang = GangJob | AdoptedGang


@dataclass(frozen=True, slots=True)
class RecoveryOutcome:
    classification: Classification
    isolated: tuple[str, ...]
    lost_s: float
    resubmitted: bool
    status: Status
    suspects: tuple[str, ...] = ()
    """nodes held out of the restart until a stop-time check clears them (`check_done`)"""


@dataclass(frozen=True, slots=True)
class RecoveryRecord:
    """One decision on one gang, in `RecoveryController.history`."""

    t: float
    job: str
    cause: str
    action: FailureAction
    isolated: tuple[str, ...]
    restarted: bool


class RecoveryController:
    """On a failure: classify the evidence, isolate the blamed nodes (quarantine in the health book, a
    NoSchedule taint and a label through the cluster port), and restart the job's gang from its last
    checkpoint as a new attempt, which the scheduler places on healthy nodes (free spares included). Work
    since the last checkpoint is charged to the job's ETTR account as lost; each failure and each measured
    checkpoint cost updates the job's `CheckpointPlanner`.

    Gangs are the controller's own (`submit(GangJob)`: it creates the pods and each attempt's) or adopted
    (`adopt(AdoptedGang)`: someone else created them and re-creates them, see `AdoptedGang`). Evidence comes
    per job (`on_failure`) or per node (`on_node_evidence`: the node agent's reports; the gangs with a member
    on a reporting node fail, and a report no gang owns still isolates or blames its node).

    A blamed node that the verdict does not isolate (a restart-job signature that blames its node) has the
    failure attributed in the health book; the exclusion policy (`HealthPolicy.max_failures` within
    `window_s`) then quarantines it like an isolation. The repair cycle (`repair_started`, `repair_done`,
    `probation_passed`) moves a quarantined node back; its taint comes off only when the book finds it
    eligible for `large_job_gpus` (not a lemon), so a lemon stays off large jobs. The taints and labels go
    through `health` (a `NodeHealthController` on the same port and book, built when not given)."""

    def __init__(self, port: ClusterPort, classifier: FailureClassifier, book: NodeHealthBook,
                 now: Callable[[], float], *, stop_grace_s: float = 0.0,
                 health: NodeHealthController | None = None) -> None:
        self.port = port
        self.classifier = classifier
        self.book = book
        self.now = now
        self.health = health if health is not None else NodeHealthController(port, book, now)
        self.stop_grace_s = stop_grace_s
        """grace given to the failed attempt's pods (the kubelet then takes its stop time)"""
        self.jobs: dict[str, GangJob] = {}
        self.adopted: dict[str, AdoptedGang] = {}
        self._adopted_by_key: dict[tuple[str, ...], dict[str, AdoptedGang]] = {}
        self._adopted_seen: dict[str, set[str]] = {}
        """Adopted gang → its pods seen running since adoption: a gang of `nodes` pods cannot be all running
        before that many were, so the world is read only from then on."""
        """a member's gang name or label → the adopted gangs it may belong to (a bind looks only at those)"""
        self.history: list[RecoveryRecord] = []
        self._member_of: dict[str, GangJob] = {}
        self._bound: dict[str, set[str]] = {}
        """per job, the current attempt's members seen bound"""
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

    def adopt(self, gang: AdoptedGang) -> AdoptedGang:
        """Watch a gang someone else submitted (its members already running or not yet created)."""
        if gang.name in self.jobs:
            raise ValueError(f"{gang.name}: already a submitted job")
        self.forget(gang.name)
        self.adopted[gang.name] = gang
        self._adopted_by_key.setdefault(gang.key, {})[gang.name] = gang
        pods = self.port.list_pods()
        members = gang.members(pods)
        self._adopted_seen[gang.name] = {p.name for p in members if p.phase is PodPhase.RUNNING}
        if gang.running_since is None and self._all_running(gang, members):
            gang.running_since = self.now()
        return gang

    def forget(self, name: str) -> None:
        """Stop watching an adopted gang (its owner deleted it)."""
        gang = self.adopted.pop(name, None)
        self._adopted_seen.pop(name, None)
        if gang is not None:
            same = self._adopted_by_key.get(gang.key, {})
            same.pop(name, None)
            if not same:
                self._adopted_by_key.pop(gang.key, None)

    def gang(self, name: str) -> Gang:
        job = self.jobs.get(name)
        return job if job is not None else self.adopted[name]

    def checkpointed(self, job_name: str, cost_s: float) -> float:
        """The job reports a checkpoint completed now that blocked it `cost_s`; returns the interval to the
        next one (Young/Daly from the measured cost and the job's observed failure rate)."""
        job = self.gang(job_name)
        job.last_checkpoint_at = self.now()
        job.planner.measured_cost(cost_s)
        job.account.checkpoint_s += cost_s
        return job.planner.interval_s(cost_s)

    def on_node_evidence(self, evidence: Sequence[Evidence]) -> dict[str, RecoveryOutcome]:
        """What node agents reported (one or more incidents, any nodes): each gang with a live member on a
        reporting node fails with the evidence of its own nodes (`on_failure`); the evidence of nodes no gang
        is on is classified on its own, and still isolates the nodes it isolates and attributes the failure
        to the nodes it blames. Returns the outcome per gang, in the order the gangs were submitted/adopted."""
        pods = self.port.list_pods()
        gangs_on: dict[str, list[str]] = {}
        live = [(name, job.members()) for name, job in self.jobs.items()]
        live += [(name, [p.name for p in gang.members(pods)]) for name, gang in self.adopted.items()]
        node_of = {p.name: p.assignment.node for p in pods if p.assignment is not None
                   and p.phase in (PodPhase.PENDING, PodPhase.RUNNING)}
        for name, members in live:
            for node in {node_of[m] for m in members if m in node_of}:
                gangs_on.setdefault(node, []).append(name)
        per_gang: dict[str, list[Evidence]] = {name: [] for name, _ in live}
        lone: list[Evidence] = []
        for item in evidence:
            for name in gangs_on.get(item.node, ()):
                per_gang[name].append(item)
            if item.node not in gangs_on:
                lone.append(item)
        if lone:
            self._blame(classify_incident(self.classifier, lone, self.now()), "")
        return {name: self.on_failure(name, items) for name, items in per_gang.items() if items}

    def on_failure(self, job_name: str, evidence: Sequence[Evidence]) -> RecoveryOutcome:
        job = self.gang(job_name)
        now = self.now()
        verdict = classify_incident(self.classifier, evidence, now, scope=job.name)
        cause = verdict.signature.id if verdict.signature is not None else "unknown failure"
        isolated, suspects = self._blame(verdict, job.name)
        if job.running_since is not None:
            job.planner.observed(self._size(job) * (now - job.running_since) / DAY_S, 1)
        saved_at = job.last_checkpoint_at if job.last_checkpoint_at is not None else job.running_since
        lost = max(0.0, now - saved_at) if saved_at is not None else 0.0
        job.account.lost_s += lost
        job.account.failures += 1
        job.account.isolated_nodes += len(isolated)
        retry = verdict.action is not FailureAction.DO_NOT_RETRY
        self.history.append(RecoveryRecord(now, job.name, cause, verdict.action, isolated, retry))
        if not retry:
            self.stop(job)
            return RecoveryOutcome(verdict, isolated, lost, False,
                                   Status.error(f"{job.name}: not retried ({cause})"), suspects)
        if isinstance(job, GangJob):
            self.stop(job)
            return RecoveryOutcome(verdict, isolated, lost, True, self.resubmit(job), suspects)
        outcome = RecoveryOutcome(verdict, isolated, lost, True, self.stop(job), suspects)
        job.attempt += 1
        if job.restart is not None:
            outcome = replace(outcome, status=job.restart(job, outcome))
        return outcome

    def _blame(self, verdict: Classification, scope: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Isolate, attribute and hold out what `verdict` blames; returns (isolated, suspects)."""
        now = self.now()
        cause = verdict.signature.id if verdict.signature is not None else "unknown failure"
        isolated = list(nodes_to_isolate(verdict))
        for node in isolated:
            # an isolate-node verdict quarantines at once, whatever the node's failure count
            self.isolate(node, f"isolated: {cause}")
        for node in verdict.blamed_nodes:
            if node in isolated:
                continue
            result = self.book.apply(node, HealthEvent.FAILURE_ATTRIBUTED, now, f"blamed: {cause}")
            if result.ok and result.state is NodeHealth.QUARANTINED:  # the exclusion policy's limit
                self._quarantine(node, reason=f"exclusion limit: {cause}")
                isolated.append(node)
        suspects = hang_suspects(verdict) if scope else ()
        for node in suspects:
            # restart without the suspect; a stop-time check decides (`check_done`)
            result = self.book.apply(node, HealthEvent.FAILURE_ATTRIBUTED, now, f"hang suspect: {cause}")
            quarantined = result.state is NodeHealth.QUARANTINED
            self._quarantine(node, "quarantined" if quarantined else "suspect", reason=f"hang suspect: {cause}")
            if quarantined:
                isolated.append(node)
        return tuple(isolated), tuple(n for n in suspects if n not in isolated)

    def check_done(self, node: str, passed: bool) -> HealthResult:
        """A suspect's stop-time check: passed, it is healthy and untainted; failed, it is quarantined
        (the repair cycle follows)."""
        now = self.now()
        if passed:
            result = self.book.apply(node, HealthEvent.CHECK_PASSED, now, "stop-time check passed")
            if result.ok and result.state is NodeHealth.HEALTHY:
                self._untaint(node)
            return result
        result = self.book.apply(node, HealthEvent.CHECK_FAILED, now, "stop-time check failed")
        if result.ok:
            self.port.patch_node(node, labels={HEALTH_LABEL: "quarantined"})
        return result

    def stop(self, job: Gang) -> Status:
        """End the job's current attempt: its pods go (with `stop_grace_s`, then the kubelet's stop). An
        adopted gang's pods are deleted at once when the grace is 0 (their owner re-creates them)."""
        reason = f"{job.name}: attempt {job.attempt} failed"
        status = Status.success()
        if isinstance(job, GangJob):
            for member in job.members():
                self.port.evict(member, grace_s=self.stop_grace_s, reason=reason)
                self._member_of.pop(member, None)
        else:
            for pod in job.members(self.port.list_pods()):
                done = (self.port.evict(pod.name, grace_s=self.stop_grace_s, reason=reason) if self.stop_grace_s > 0
                        else self.port.delete_pod(pod.name))
                if not done.ok:
                    status = done
        self._bound.pop(job.name, None)
        job.running_since = None
        job.last_checkpoint_at = None
        return status

    def resubmit(self, job: GangJob) -> Status:
        """Start the job's next attempt (from its last checkpoint)."""
        job.attempt += 1
        return self.submit(job)

    def isolate(self, node: str, reason: str) -> None:
        """Take a node out of service at once: quarantined in the book, tainted and labelled in the cluster
        (an isolate-node verdict, a failed pre-flight check, or a person's decision)."""
        self.health.isolate(node, reason)

    def repair_started(self, node: str) -> HealthResult:
        return self.book.apply(node, HealthEvent.REPAIR_STARTED, self.now(), "sent to repair")

    def repair_done(self, node: str) -> HealthResult:
        """Repaired and through the admission suite: probation (small jobs only; the taint stays for now)."""
        result = self.book.apply(node, HealthEvent.REPAIR_DONE, self.now(), "repaired")
        if result.ok:
            self.port.patch_node(node, labels={HEALTH_LABEL: "probation"})
        return result

    def probation_passed(self, node: str) -> HealthResult:
        """Probation over: healthy; the taint comes off unless the book keeps the node off large jobs."""
        now = self.now()
        result = self.book.apply(node, HealthEvent.PROBATION_PASSED, now, "probation passed")
        if not result.ok:
            return result
        if self.book.eligible(node, self.book.policy.large_job_gpus, now):
            self._untaint(node)
        else:
            self.port.patch_node(node, labels={HEALTH_LABEL: "lemon"})
        return result

    def _quarantine(self, node: str, label: str = "quarantined", reason: str = "") -> None:
        self.health.quarantine(node, reason, label=label)

    def _untaint(self, node: str) -> None:
        self.health.release(node)

    def _size(self, job: Gang) -> int:
        return job.nodes if isinstance(job, GangJob) else job.size(job.members(self.port.list_pods()))

    def _all_running(self, gang: AdoptedGang, members: Sequence[PodInfo]) -> bool:
        size = gang.size(members)
        return size > 0 and len(members) >= size and all(p.phase is PodPhase.RUNNING for p in members)

    def _on_event(self, event: ClusterEvent) -> None:
        if event.kind is not EventKind.POD_BOUND or event.pod is None:
            return
        job = self._member_of.get(event.pod.name)
        if job is None:
            self._on_adopted_bound(event.pod, event.time)
            return
        if job.running_since is not None:
            return
        self._bound.setdefault(job.name, set()).add(event.pod.name)
        if len(self._bound[job.name]) < job.nodes:
            return
        bound = {p.name for p in self.port.list_pods() if p.phase is PodPhase.RUNNING}
        if all(member in bound for member in job.members()):
            job.running_since = event.time
            if job.last_checkpoint_at is None:
                job.last_checkpoint_at = event.time

    def _on_adopted_bound(self, pod: PodInfo, t: float) -> None:
        keys: list[tuple[str, ...]] = [("label", *label) for label in pod.request.labels]
        if pod.request.gang is not None:
            keys.append(("gang", pod.request.gang))
        candidates = {name: gang for key in keys for name, gang in self._adopted_by_key.get(key, {}).items()}
        for gang in candidates.values():
            seen = self._adopted_seen.setdefault(gang.name, set())
            seen.add(pod.name)
            if gang.running_since is not None or len(seen) < gang.nodes:
                continue
            if self._all_running(gang, gang.members(self.port.list_pods())):
                gang.running_since = t
                if gang.last_checkpoint_at is None:
                    gang.last_checkpoint_at = t
