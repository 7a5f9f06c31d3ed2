"""Metrics from what a cluster port shows: an observer of its events, so few components need a call to record.

`ClusterObserver` watches a `ClusterPort` and records into a `PlaneMetrics`:

* from pod events: pod scheduling latency (creation to bind), evictions by cause (the eviction-reason
  annotation a world writes on an evicted pod, folded by `eviction_cause`);
* from node events: tidal loans and reclaims (the tidal controller's loan label and reclaim-at annotation),
  recovery actions (the recovery controller's health label);
* at scrape time, as a `PlaneSnapshot`: pending pods by priority class and queue (and the age of the
  oldest that asks for GPUs), unschedulable pods by reason, cards by allocation state and the fragmentation
  per pool, nodes by health, quota use per queue, lent nodes and how late their reclaim is.

Scheduling decisions are not events of the port: the scheduler's driver hands each pass's outcomes to
`record_outcomes` (or runs the pass through `run_pending`, which also times it). `scheduler_counters` exports
a scheduler's own preemption and gang counts.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from gpuplane.controllers.defrag import MOVE_REASON
from gpuplane.controllers.recovery import HEALTH_LABEL
from gpuplane.controllers.tidal import (
    EARLY_RECLAIM_REASON,
    LOAN_ANNOTATION,
    LOAN_LABEL,
    RECLAIM_ANNOTATION,
    RECLAIM_REASON,
)
from gpuplane.model import MILLI_PER_CARD, Quotas
from gpuplane.port import ClusterEvent, ClusterPort, Code, EventKind, NodeInfo, PodInfo, PodPhase
from gpuplane.port.metrics import (
    GANGS,
    MAX_REASONS,
    NO_CLASS,
    NO_QUEUE,
    OTHER_REASON,
    PREEMPTION_ATTEMPTS,
    PREEMPTION_VICTIMS,
    CounterReading,
    PlaneMetrics,
    PlaneSnapshot,
    QueueUse,
    reason_label,
)
from gpuplane.scheduler.scheduler import Outcome, Scheduler

EVICTION_REASON = "gpuplane.io/eviction-reason"
"""The pod annotation the worlds write on eviction (`SimCluster.evict`, `KubeCluster.evict`)."""
HEALTHY = "healthy"
"""The health of a node without the recovery controller's health label."""

_RECOVERY_EVICTION = re.compile(r": attempt \d+ failed$")
_HEALTH_ACTIONS = {"quarantined": "quarantine", "probation": "probation", "lemon": "retire"}


def eviction_cause(reason: str) -> str:
    """Fold an eviction reason into `EVICTION_CAUSES`.

    The reasons are those of the scheduler ("preempted by …", a gang's "gang could not start whole"), the
    tidal controller, the defragmentation controller, the recovery controller ("job: attempt N failed") and
    the simulated workloads ("completed", "gang stop")."""
    if reason.startswith("preempted by"):
        return "preemption"
    if reason == RECLAIM_REASON:
        return "tidal-reclaim"
    if reason == EARLY_RECLAIM_REASON:
        return "tidal-early-reclaim"
    if reason == MOVE_REASON:
        return "defragmentation"
    if _RECOVERY_EVICTION.search(reason):
        return "recovery"
    if reason.startswith("gang"):
        return "gang"
    if reason == "completed":
        return "completed"
    return "other"


def outcome_result(outcome: Outcome) -> str:
    """`RESULTS`' label for one scheduling attempt."""
    code = outcome.decision.status.code
    if code is Code.SUCCESS:
        return "scheduled"
    if code is Code.WAIT:
        return "waiting"
    if code in (Code.UNSCHEDULABLE, Code.UNSCHEDULABLE_AND_UNRESOLVABLE):
        return "unschedulable"
    return "error"


def outcome_reason(outcome: Outcome) -> str:
    """Why the attempt did not bind, as a bounded label: the diagnosis' reason that rejected the most nodes
    (ties: the first in the profile's filter order), else the status message folded by `reason_label`."""
    decision = outcome.decision
    if decision.diagnosis is not None:
        counts = decision.diagnosis.counts()
        if counts:
            return reason_label(max(counts, key=lambda r: counts[r]))
    message = decision.status.message
    if decision.status.code is Code.WAIT:
        if message.startswith("nominated"):
            return "nominated"
        if message.startswith("queue "):
            return "queue at its quota"
        if message.startswith("gang "):
            return "gang members missing"
    if message.startswith("gang "):
        return "gang does not fit whole"
    if message.startswith("queue "):
        return "queue at its quota"
    return reason_label(message) if message else OTHER_REASON


def _card_used(nodes: Iterable[NodeInfo], pods: Iterable[PodInfo]) -> dict[str, list[int]]:
    used = {n.name: [MILLI_PER_CARD if c in n.spec.foreign_cards else 0 for c in range(n.spec.gpus)] for n in nodes}
    for pod in pods:
        if pod.assignment is None or pod.phase not in (PodPhase.RUNNING, PodPhase.TERMINATING):
            continue
        cards = used.get(pod.assignment.node)
        if cards is None:
            continue
        for share in pod.assignment.cards:
            if 0 <= share.card < len(cards):
                cards[share.card] += MILLI_PER_CARD if share.whole else share.compute_milli
    return used


class ClusterObserver:
    """Keeps a copy of the port's nodes and pods from its events and records metrics from them.

    `now` is the port's clock (simulated time in a simulation), the clock of the reclaim-at annotation;
    `quotas` the scheduler's queue quotas, for `QUEUE_*`; `key` the name its snapshot is exported under
    (`PlaneMetrics.observe`). Safe to scrape from another thread."""

    def __init__(self, port: ClusterPort, metrics: PlaneMetrics, *, now: Callable[[], float],
                 quotas: Quotas | None = None, key: str = "cluster") -> None:
        self.metrics = metrics
        self.key = key
        self.now = now
        self.quotas = quotas
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeInfo] = {n.name: n for n in port.list_nodes()}
        self._pods: dict[str, PodInfo] = {p.name: p for p in port.list_pods()}
        self._reasons: dict[str, str] = {}
        self._unsubscribe = port.watch(self._on_event)
        metrics.observe(self, key)

    def close(self) -> None:
        """Stop watching; the snapshot gauges leave the exposition (the counters keep their counts)."""
        self._unsubscribe()
        self.metrics.drop(self.key, self)

    # ---------------------------------------------------------------- events
    def _on_event(self, event: ClusterEvent) -> None:
        with self._lock:
            if event.pod is not None:
                self._on_pod(event.kind, event.pod, event.time)
            elif event.node is not None:
                self._on_node(event.kind, event.node, event.time)

    def _on_pod(self, kind: EventKind, pod: PodInfo, t: float) -> None:
        name = pod.name
        if kind in (EventKind.POD_DELETED, EventKind.POD_FAILED):
            self._pods.pop(name, None)
            self._reasons.pop(name, None)
            return
        before = self._pods.get(name)
        self._pods[name] = pod
        if kind is EventKind.POD_BOUND:
            self._reasons.pop(name, None)
            bound = pod.bound_at if pod.bound_at is not None else t
            self.metrics.pod_scheduled(bound - pod.created_at)
        elif kind is EventKind.POD_TERMINATING and (before is None or before.phase is not PodPhase.TERMINATING):
            annotations = dict(pod.annotations)
            if EVICTION_REASON in annotations:  # a deletion (not an eviction) carries no reason
                self.metrics.eviction(eviction_cause(annotations[EVICTION_REASON]))

    def _on_node(self, kind: EventKind, node: NodeInfo, t: float) -> None:
        before = self._nodes.get(node.name)
        if kind is EventKind.NODE_REMOVED:
            self._nodes.pop(node.name, None)
            return
        self._nodes[node.name] = node
        old = dict(before.spec.labels) if before is not None else {}
        new = dict(node.spec.labels)
        if LOAN_LABEL in new and LOAN_LABEL not in old:
            self.metrics.loan(node.spec.pool)
        elif LOAN_LABEL in old and LOAN_LABEL not in new and before is not None:
            deadline = _reclaim_at(before)
            self.metrics.reclaim(early=deadline is not None and t < deadline)
        health_old, health_new = old.get(HEALTH_LABEL), new.get(HEALTH_LABEL)
        if health_new != health_old:
            if health_new is None:
                self.metrics.recovery_action("return")
            elif health_new in _HEALTH_ACTIONS:
                self.metrics.recovery_action(_HEALTH_ACTIONS[health_new])

    # ---------------------------------------------------------------- scheduling outcomes
    def record_outcomes(self, outcomes: Sequence[Outcome]) -> None:
        """Count each attempt by result and keep the reason of each pod left pending."""
        results = Counter(outcome_result(o) for o in outcomes)
        for result, count in results.items():
            self.metrics.attempt(result, count)
        with self._lock:
            for outcome in outcomes:
                name = outcome.request.name
                if outcome.decision.status.ok:
                    self._reasons.pop(name, None)
                else:
                    self._reasons[name] = outcome_reason(outcome)

    def run_pending(self, scheduler: Scheduler, on_outcome: Callable[[Outcome], bool] | None = None) -> list[Outcome]:
        """`scheduler.run_pending(on_outcome)`, timed into `CYCLE_DURATION`, its outcomes recorded."""
        started = time.perf_counter()
        outcomes = scheduler.run_pending(on_outcome)
        self.metrics.cycle(time.perf_counter() - started)
        self.record_outcomes(outcomes)
        return outcomes

    # ---------------------------------------------------------------- the scrape
    def snapshot(self) -> PlaneSnapshot:
        with self._lock:
            nodes, pods, reasons = list(self._nodes.values()), list(self._pods.values()), dict(self._reasons)
        now = self.now()
        pending: Counter[tuple[str, str]] = Counter()
        oldest: dict[tuple[str, str], float] = {}
        unschedulable: Counter[str] = Counter()
        for pod in pods:
            if pod.phase is not PodPhase.PENDING:
                continue
            key = (pod.request.priority_class or NO_CLASS, pod.request.queue or NO_QUEUE)
            pending[key] += 1
            if pod.request.gpu is not None:
                oldest[key] = max(oldest.get(key, 0.0), now - pod.created_at)
            reason = reasons.get(pod.name)
            if reason is not None:
                unschedulable[reason] += 1
        kept = dict(unschedulable.most_common(MAX_REASONS))
        if len(unschedulable) > MAX_REASONS:
            kept[OTHER_REASON] = kept.get(OTHER_REASON, 0) + sum(
                v for k, v in unschedulable.items() if k not in kept)
        gpus: Counter[tuple[str, str]] = Counter()
        free_all: Counter[str] = Counter()
        free_partial: Counter[str] = Counter()
        card_used = _card_used(nodes, pods)
        for node in nodes:
            pool = node.spec.pool
            for used in card_used[node.name]:
                free = max(0, MILLI_PER_CARD - used)
                state = "free" if used <= 0 else "full" if free == 0 else "partial"
                gpus[(pool, state)] += 1
                free_all[pool] += free
                if state == "partial":
                    free_partial[pool] += free
        fragmentation = {pool: (free_partial[pool] / free_all[pool] if free_all[pool] else 0.0)
                         for pool in {p for p, _ in gpus}}
        health: Counter[tuple[str, str]] = Counter(
            (n.spec.pool, dict(n.spec.labels).get(HEALTH_LABEL, HEALTHY)) for n in nodes)
        lent: Counter[str] = Counter(n.spec.pool for n in nodes if LOAN_LABEL in dict(n.spec.labels))
        overdue: dict[tuple[str, str], float] = {}
        for node in nodes:
            deadline = _reclaim_at(node)
            if deadline is not None:
                overdue[(node.name, _loan_window(node))] = now - deadline
        return PlaneSnapshot(pending=dict(pending), oldest_pending=oldest, unschedulable=kept, gpus=dict(gpus),
                             fragmentation=fragmentation, nodes=dict(health), queues=self._queues(pods),
                             lent_nodes=dict(lent), loan_overdue=overdue)

    def _queues(self, pods: Sequence[PodInfo]) -> dict[str, QueueUse]:
        if self.quotas is None:
            return {}
        held: Counter[str] = Counter()
        for pod in pods:
            if pod.assignment is not None and pod.phase in (PodPhase.RUNNING, PodPhase.TERMINATING):
                held[pod.request.queue or NO_QUEUE] += pod.assignment.gpu_milli
        return {q.name: QueueUse(held[q.name] / MILLI_PER_CARD, q.min_gpus, q.max_gpus) for q in self.quotas}


def _reclaim_at(node: NodeInfo) -> float | None:
    value = dict(node.annotations).get(RECLAIM_ANNOTATION)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _loan_window(node: NodeInfo) -> str:
    note = dict(node.annotations).get(LOAN_ANNOTATION)
    try:
        window = json.loads(note).get("window") if note is not None else None
    except (ValueError, AttributeError):
        window = None
    return str(window) if window is not None else ""


def scheduler_counters(scheduler: Scheduler) -> Callable[[], list[CounterReading]]:
    """A `PlaneMetrics.counters` reader of the scheduler's own preemption and gang counts."""

    def read() -> list[CounterReading]:
        stats = scheduler.stats
        return [
            CounterReading(PREEMPTION_ATTEMPTS, "Preemptions tried for pods no node fits.", {(): stats.attempts}),
            CounterReading(PREEMPTION_VICTIMS, "Pods chosen as preemption victims and evicted.", {(): stats.victims}),
            CounterReading(GANGS, "Gangs placed whole or failed.",
                           {("placed",): stats.gangs_placed, ("failed",): stats.gangs_failed}, ("result",)),
        ]

    return read


__all__ = ["EVICTION_REASON", "HEALTHY", "ClusterObserver", "eviction_cause", "outcome_reason", "outcome_result",
           "scheduler_counters"]
