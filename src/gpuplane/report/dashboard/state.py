"""What the dashboard shows, read over the cluster port: the fleet (nodes × cards and their holders), the queues
and a history of samples (the tide, loans, preemptions and evictions, node health, allocation and utilisation).

`Board` holds the port, the optional scheduler (its quotas) and utilisation reader, and one lock: every read of the
world (`state`, `sample`) takes it, and a driver that advances a simulated world holds it while the world moves.

Why a pod waits comes from the scheduling passes a driver hands to `record_outcomes` (an in-process scheduler),
else from the world (`pending_reasons`: on a cluster, the `PodScheduled=False` conditions its scheduler wrote,
`KubeCluster.pending_reasons`); the quotas from the scheduler, `quotas=`, or `quota_source` (on a cluster, its
Queue and GpuPool resources, `kube.declarations.Declarations.quotas`), read at every `state`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuplane.controllers.accounting import UtilisationReader
from gpuplane.controllers.observer import EVICTION_REASON, HEALTHY, eviction_cause, outcome_reason
from gpuplane.controllers.recovery import HEALTH_LABEL
from gpuplane.controllers.tidal import LOAN_LABEL
from gpuplane.model import MILLI_PER_CARD, Catalog, Quotas
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, NodeInfo, PodInfo, PodPhase
from gpuplane.scheduler.scheduler import Outcome, Scheduler

HISTORY_POINTS = 720
"""Samples kept for the charts (12 h at one sample a minute)."""
PENDING_LISTED = 60
"""Pending pods listed by name (the oldest first); the counts cover all of them."""
NOT_TRIED = "not tried yet"
"""The reason of a pending pod no scheduling attempt has judged (or whose scheduler the dashboard does not see)."""
NO_TEAM = "(none)"
HOLDING = (PodPhase.RUNNING, PodPhase.TERMINATING)


def team_of(pod: PodInfo) -> str:
    """The pod's team: its quota queue, else `NO_TEAM`."""
    return pod.request.queue or NO_TEAM


@dataclass(slots=True)
class Sample:
    """One point of the history."""

    t: float
    nodes: dict[str, int]
    """pool -> nodes (the tide)."""
    lent: int
    preemptions: int
    evictions: int
    health: dict[str, int]
    """health label (`healthy` when absent) -> nodes."""
    alloc_pct: float
    util_pct: float | None

    def json(self) -> dict[str, Any]:
        return {"t": self.t, "nodes": self.nodes, "lent": self.lent, "preemptions": self.preemptions,
                "evictions": self.evictions, "health": self.health, "alloc": round(self.alloc_pct, 2),
                "util": None if self.util_pct is None else round(self.util_pct, 2)}


@dataclass(slots=True)
class Counts:
    """Counted from the port's events since the board started."""

    evictions: Counter[str] = field(default_factory=Counter)
    """cause (`eviction_cause`) -> evictions."""

    @property
    def preemptions(self) -> int:
        return self.evictions["preemption"]


class Board:
    """The dashboard's view of one cluster. `now` is the world's clock (virtual time in a simulation)."""

    def __init__(self, port: ClusterPort, catalog: Catalog, *, now: Callable[[], float],
                 scheduler: Scheduler | None = None, quotas: Quotas | None = None,
                 reader: UtilisationReader | None = None, title: str = "gpuplane",
                 lock: threading.RLock | None = None,
                 pending_reasons: Callable[[], Mapping[str, str]] | None = None,
                 quota_source: Callable[[], Quotas] | None = None) -> None:
        """`pending_reasons`: pod → why it waits, as the world records it (the reasons `record_outcomes` keeps
        win). `quota_source`: the quotas now, read at every `state` (it wins over `quotas` and the scheduler's)."""
        self.port = port
        self.catalog = catalog
        self.now = now
        self.scheduler = scheduler
        self.quotas = quotas if quotas is not None else scheduler.rules.quotas if scheduler is not None else None
        self.pending_reasons = pending_reasons
        self.quota_source = quota_source
        self.reader = reader
        self.title = title
        self.lock = lock if lock is not None else threading.RLock()
        self._tally = threading.Lock()
        """Guards `counts` and `reasons` alone: a port's watch thread writes them without `lock`, which a reader
        holds while it lists the port (taking `lock` there could deadlock against the port's own lock)."""
        self.counts = Counts()
        self.reasons: dict[str, str] = {}
        self.history: deque[Sample] = deque(maxlen=HISTORY_POINTS)
        self.status = "live"
        self._unsubscribe = port.watch(self._on_event)

    def close(self) -> None:
        self._unsubscribe()

    def _on_event(self, event: ClusterEvent) -> None:
        pod = event.pod
        if pod is None:
            return
        with self._tally:
            if event.kind is EventKind.POD_TERMINATING:
                reason = dict(pod.annotations).get(EVICTION_REASON)
                if reason is not None:
                    self.counts.evictions[eviction_cause(reason)] += 1
            elif event.kind in (EventKind.POD_BOUND, EventKind.POD_DELETED, EventKind.POD_FAILED):
                self.reasons.pop(pod.name, None)

    def record_outcomes(self, outcomes: Sequence[Outcome]) -> None:
        """Keep why each pod a scheduling pass left pending stayed there (`outcome_reason`)."""
        with self._tally:
            for outcome in outcomes:
                if outcome.decision.status.ok:
                    self.reasons.pop(outcome.request.name, None)
                else:
                    self.reasons[outcome.request.name] = outcome_reason(outcome)

    # ---------------------------------------------------------------- reads
    def sample(self) -> Sample:
        """Append one history point (the world's state now) and return it."""
        with self.lock:
            nodes, pods, now = list(self.port.list_nodes()), list(self.port.list_pods()), self.now()
            with self._tally:
                preemptions, evictions = self.counts.preemptions, sum(self.counts.evictions.values())
            point = self._sample(nodes, pods, now, preemptions, evictions)
            self.history.append(point)
            return point

    def _sample(self, nodes: Sequence[NodeInfo], pods: Sequence[PodInfo], now: float, preemptions: int,
                evictions: int) -> Sample:
        total = sum(n.spec.gpus for n in nodes) * MILLI_PER_CARD
        held = [p for p in pods if p.assignment is not None and p.phase in HOLDING]
        alloc = sum(p.assignment.gpu_milli for p in held if p.assignment is not None)
        util: float | None = None
        if self.reader is not None:
            busy = 0.0
            measured = False
            shares = self.reader.busy_shares(held, now)  # one read for every pod
            for pod in held:
                share = shares.get(pod.name)
                if share is not None and pod.assignment is not None:
                    busy += share * pod.assignment.gpu_milli
                    measured = True
            util = 100.0 * busy / total if total and measured else None
        labels = [dict(n.spec.labels) for n in nodes]
        return Sample(now, dict(Counter(n.spec.pool for n in nodes)), sum(LOAN_LABEL in la for la in labels),
                      preemptions, evictions,
                      dict(Counter(la.get(HEALTH_LABEL, HEALTHY) for la in labels)),
                      100.0 * alloc / total if total else 0.0, util)

    def state(self) -> dict[str, Any]:
        """Everything the page draws, as JSON-ready data (see `fleet`, `queues`)."""
        with self.lock:
            nodes, pods, now = list(self.port.list_nodes()), list(self.port.list_pods()), self.now()
            history = [s.json() for s in self.history]
            with self._tally:
                recorded, evictions = dict(self.reasons), dict(self.counts.evictions)
        reasons = {**self.pending_reasons(), **recorded} if self.pending_reasons is not None else recorded
        fleet = self.fleet(nodes, pods)
        return {"title": self.title, "status": self.status, "now": now, "wall": time.time(), **fleet,
                **self.queues(pods, reasons, now), "evictions": evictions, "history": history}

    def fleet(self, nodes: Sequence[NodeInfo], pods: Iterable[PodInfo]) -> dict[str, Any]:
        """`nodes`: [name, pool, model, health, schedulable, lent, cards]; each card [used milli, holder indexes,
        mig slots (0: not a MIG card)]; `holders`: [pod, qos, priority class, team, milli, mig start, mig slices,
        mig profile]; `totals`: cards by state (free, partial, full) and nodes out of service."""
        models = {n.name: self.catalog.get(n.spec.gpu_model) for n in nodes
                  if n.spec.gpu_model and n.spec.gpu_model in self.catalog}
        holders: list[list[Any]] = []
        on_card: dict[tuple[str, int], list[int]] = {}
        used: dict[tuple[str, int], int] = {}
        for pod in pods:
            a = pod.assignment
            if a is None or pod.phase not in HOLDING:
                continue
            model = models.get(a.node)
            for share in a.cards:
                milli = MILLI_PER_CARD if share.whole else share.compute_milli
                start = slices = 0
                profile = ""
                if share.mig_profile is not None:
                    mig = model.mig_profiles.get(share.mig_profile) if model is not None else None
                    if mig is not None:
                        start, slices, profile = share.mig_start or 0, mig.memory_slices, mig.name
                key = (a.node, share.card)
                on_card.setdefault(key, []).append(len(holders))
                used[key] = used.get(key, 0) + milli
                r = pod.request
                holders.append([pod.name, r.qos.value, r.priority_class or "", team_of(pod), milli, start, slices,
                                profile])
        rows: list[list[Any]] = []
        free = partial = full = 0
        out_of_service = 0
        for node in nodes:
            spec = node.spec
            labels = dict(spec.labels)
            model = models.get(spec.name)
            slots = model.memory_slices if model is not None and model.mig_capable else 0
            cards: list[list[Any]] = []
            for c in range(spec.gpus):
                milli = MILLI_PER_CARD if c in spec.foreign_cards else min(MILLI_PER_CARD, used.get((spec.name, c), 0))
                held = on_card.get((spec.name, c), [])
                cards.append([milli, held, slots if any(holders[h][6] for h in held) else 0])
                if milli <= 0:
                    free += 1
                elif milli >= MILLI_PER_CARD:
                    full += 1
                else:
                    partial += 1
            health = labels.get(HEALTH_LABEL, HEALTHY)
            out_of_service += health != HEALTHY
            rows.append([spec.name, spec.pool, spec.gpu_model or "", health, spec.schedulable, LOAN_LABEL in labels,
                         cards])
        return {"nodes": rows, "holders": holders,
                "totals": {"nodes": len(rows), "cards": free + partial + full, "free": free, "partial": partial,
                           "full": full, "out_of_service": out_of_service}}

    def queues(self, pods: Iterable[PodInfo], reasons: dict[str, str], now: float) -> dict[str, Any]:
        """`classes`: priority class -> [pending, running]; `reasons`: reason -> pending pods, over all classes;
        `class_reasons`: priority class -> reason -> pending pods, the classes by name and each class's reasons
        most first, then by name (they add up to the class's pending count); `pending`: the oldest
        `PENDING_LISTED` as [pod, class, team, waited s, reason]; `quotas`: [queue, allocated GPUs, min, max or
        null]. A pod of no class counts under `(none)`."""
        classes: dict[str, list[int]] = {}
        why: Counter[str] = Counter()
        why_by_class: dict[str, Counter[str]] = {}
        pending: list[tuple[float, str, str, str, str]] = []
        held: Counter[str] = Counter()
        for pod in pods:
            cls = pod.request.priority_class or "(none)"
            if pod.phase is PodPhase.PENDING:
                classes.setdefault(cls, [0, 0])[0] += 1
                reason = reasons.get(pod.name, NOT_TRIED)
                why[reason] += 1
                why_by_class.setdefault(cls, Counter())[reason] += 1
                pending.append((pod.created_at, pod.name, cls, team_of(pod), reason))
            elif pod.phase is PodPhase.RUNNING:
                classes.setdefault(cls, [0, 0])[1] += 1
            if pod.assignment is not None and pod.phase in HOLDING and pod.request.queue is not None:
                held[pod.request.queue] += pod.assignment.gpu_milli
        pending.sort()
        table = self.quota_source() if self.quota_source is not None else self.quotas
        quotas = [[q.name, held[q.name] / MILLI_PER_CARD, q.min_gpus, q.max_gpus]
                  for q in (table or ())]
        return {"classes": classes, "reasons": dict(why.most_common()),
                "class_reasons": {cls: dict(sorted(why_by_class[cls].items(), key=lambda kv: (-kv[1], kv[0])))
                                  for cls in sorted(why_by_class)},
                "pending": [[name, cls, team, round(now - created, 1), reason]
                            for created, name, cls, team, reason in pending[:PENDING_LISTED]],
                "pending_total": len(pending), "quotas": quotas}


__all__ = ["HISTORY_POINTS", "NOT_TRIED", "PENDING_LISTED", "Board", "Sample", "team_of"]
