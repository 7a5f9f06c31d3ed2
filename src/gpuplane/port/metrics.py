"""gpuplane's scheduler and controller metrics, in Prometheus' exposition format.

Every metric the scheduler, the extender and the controllers export is defined here, at the port layer, so
any layer above may record into it. `PlaneMetrics` owns one `CollectorRegistry` and holds three kinds:

* **counters and histograms recorded by a call** (`attempt`, `cycle`, `eviction`, `loan`, `reclaim`,
  `recovery_action`, `extender_request`, `pod_scheduled`) and the leader gauge (`set_leader`);
* **gauges read at scrape time** from a `PlaneSnapshot` source (`observe`): queue depth, unschedulable pods by
  reason, cards and fragmentation per pool, nodes by health, queue quota use, lent nodes and how late their
  reclaim is. A snapshot is a plain typed value, so a world's observer computes it and nothing here needs to
  know how (`gpuplane.controllers.observer.ClusterObserver` computes one from a cluster port's events);
* **counters a component already keeps** (`counters`): a callable read at scrape time, for counts such as a
  scheduler's preemption attempts that live in that component's own stats.

Names follow Prometheus' conventions: the `gpuplane_` prefix, base units (`_seconds`, GPUs as whole cards),
`_total` on counters, `_ratio` on 0-1 gauges. Label values are bounded sets (classes, queues, pools, causes,
reasons as `reason_label` folds them); a node name appears only on lent nodes (`TIDAL_LOAN_OVERDUE`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# ------------------------------------------------------------------------------------------------ the names
PENDING_PODS = "gpuplane_scheduler_pending_pods"
UNSCHEDULABLE_PODS = "gpuplane_scheduler_unschedulable_pods"
OLDEST_PENDING = "gpuplane_scheduler_oldest_pending_gpu_pod_age_seconds"
ATTEMPTS = "gpuplane_scheduler_schedule_attempts_total"
CYCLE_DURATION = "gpuplane_scheduler_cycle_duration_seconds"
POD_SCHEDULING_DURATION = "gpuplane_scheduler_pod_scheduling_duration_seconds"
PREEMPTION_ATTEMPTS = "gpuplane_scheduler_preemption_attempts_total"
PREEMPTION_VICTIMS = "gpuplane_scheduler_preemption_victims_total"
GANGS = "gpuplane_scheduler_gangs_total"
GPUS = "gpuplane_cluster_gpus"
FRAGMENTATION = "gpuplane_cluster_gpu_fragmentation_ratio"
NODES = "gpuplane_cluster_nodes"
QUEUE_ALLOCATED = "gpuplane_queue_gpus_allocated"
QUEUE_MIN = "gpuplane_queue_gpus_min"
QUEUE_MAX = "gpuplane_queue_gpus_max"
EVICTIONS = "gpuplane_evictions_total"
TIDAL_LOANS = "gpuplane_tidal_loans_total"
TIDAL_RECLAIMS = "gpuplane_tidal_reclaims_total"
TIDAL_LENT = "gpuplane_tidal_lent_nodes"
TIDAL_LOAN_OVERDUE = "gpuplane_tidal_loan_overdue_seconds"
RECOVERY_ACTIONS = "gpuplane_recovery_actions_total"
LEADER = "gpuplane_leader"
EXTENDER_REQUESTS = "gpuplane_extender_requests_total"
EXTENDER_DURATION = "gpuplane_extender_request_duration_seconds"

RESULTS = ("scheduled", "unschedulable", "waiting", "error")
"""`ATTEMPTS`' result label: bound now; no node fits (or preemption found none); waiting (nominated, a gang not
all submitted, a queue at its quota); the world failed the bind."""
CARD_STATES = ("free", "partial", "full")
"""`GPUS`' state label: nothing allocated on the card; some of it; all of its compute."""
EVICTION_CAUSES = ("preemption", "tidal-reclaim", "tidal-early-reclaim", "defragmentation", "recovery", "gang",
                   "completed", "other")
"""`EVICTIONS`' cause label; `eviction_cause` folds an eviction-reason annotation into one of them."""
RECOVERY_ACTION_NAMES = ("quarantine", "probation", "retire", "return")
"""`RECOVERY_ACTIONS`' action label: a node isolated, back on probation after repair, retired as a lemon,
returned to service."""

POD_LATENCY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0,
                       86400.0)
"""Pod creation to bind, seconds: from seconds (an idle cluster) to a day (a training gang waiting for a tide)."""
CYCLE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""One scheduling pass's wall time, seconds."""

NO_QUEUE = "none"
"""The queue label of pods that name no queue (and of pods without a priority class: `NO_CLASS`)."""
NO_CLASS = "none"
OTHER_REASON = "other"
MAX_REASONS = 32
"""Distinct `UNSCHEDULABLE_PODS` reasons kept; later ones are counted as `OTHER_REASON`."""


def reason_label(reason: str) -> str:
    """A bounded label for an unschedulable reason: the text before a `": "` (a plugin's or a policy's name,
    dropping the pod, workload or gang named after it), else the text itself, stripped of a trailing full stop."""
    head = reason.split(": ", 1)[0] if ": " in reason else reason
    return head.strip().rstrip(".") or OTHER_REASON


# ----------------------------------------------------------------------------------------------- snapshots
@dataclass(frozen=True, slots=True)
class QueueUse:
    """One quota queue: GPUs its running pods hold, its guaranteed minimum and its cap (None: no cap)."""

    allocated_gpus: float
    min_gpus: float
    max_gpus: float | None


@dataclass(frozen=True, slots=True)
class PlaneSnapshot:
    """The gauges of one scrape. Keys are label values, in the order of each metric's labels."""

    pending: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(priority class, queue) -> pending pods."""
    oldest_pending: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(priority class, queue) -> seconds the oldest pending pod that asks for GPUs has waited since creation."""
    unschedulable: Mapping[str, int] = field(default_factory=dict)
    """reason (`reason_label`) -> pending pods whose last attempt failed for it."""
    gpus: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(pool, card state) -> cards."""
    fragmentation: Mapping[str, float] = field(default_factory=dict)
    """pool -> free compute on partly used cards over all free compute (0 when nothing is free)."""
    nodes: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """(pool, health) -> nodes."""
    queues: Mapping[str, QueueUse] = field(default_factory=dict)
    lent_nodes: Mapping[str, int] = field(default_factory=dict)
    """pool the nodes are lent to -> lent nodes."""
    loan_overdue: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(node, window) -> seconds past the loan's reclaim deadline (negative: time left)."""


class SnapshotSource(Protocol):
    def snapshot(self) -> PlaneSnapshot: ...


@dataclass(frozen=True, slots=True)
class CounterReading:
    """A count a component keeps itself, exported as a counter (`name` ends in `_total`)."""

    name: str
    documentation: str
    values: Mapping[tuple[str, ...], float]
    labels: tuple[str, ...] = ()


def _gauge(name: str, doc: str, labels: tuple[str, ...], items: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    for key, value in sorted(items):
        family.add_metric(list(key), float(value))
    return family


class _SnapshotCollector(Collector):
    def __init__(self, sources: dict[str, SnapshotSource], readers: dict[str, Callable[[], Iterable[CounterReading]]],
                 lock: threading.Lock) -> None:
        self._sources = sources
        self._readers = readers
        self._lock = lock

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources, readers = list(self._sources.values()), list(self._readers.values())
        if sources:
            yield from snapshot_families(_merge([s.snapshot() for s in sources]))
        for reader in readers:
            for reading in reader():
                family = CounterMetricFamily(reading.name.removesuffix("_total"), reading.documentation,
                                             labels=list(reading.labels))
                for key, value in sorted(reading.values.items()):
                    family.add_metric(list(key), float(value))
                yield family


def _merge(snapshots: list[PlaneSnapshot]) -> PlaneSnapshot:
    if len(snapshots) == 1:
        return snapshots[0]
    merged: dict[str, dict[Any, Any]] = {f.name: {} for f in fields(PlaneSnapshot)}
    for snap in snapshots:
        for name, values in merged.items():
            values.update(getattr(snap, name))
    return PlaneSnapshot(**merged)


def _by_one(values: Mapping[str, float]) -> Iterator[tuple[tuple[str, ...], float]]:
    return (((key,), value) for key, value in values.items())


def snapshot_families(snap: PlaneSnapshot) -> Iterator[Metric]:
    """The scrape-time gauges of `snap` (a metric with no value is still announced, so queries find it)."""
    queues = snap.queues
    yield _gauge(PENDING_PODS, "Pods waiting to be scheduled, by priority class and quota queue.",
                 ("priority_class", "queue"), snap.pending.items())
    yield _gauge(OLDEST_PENDING, "Age of the oldest pending pod that asks for GPUs, by priority class and queue.",
                 ("priority_class", "queue"), snap.oldest_pending.items())
    yield _gauge(UNSCHEDULABLE_PODS, "Pending pods whose last scheduling attempt failed, by the reason that "
                 "rejected the most nodes.", ("reason",), _by_one(snap.unschedulable))
    yield _gauge(GPUS, "GPU cards by pool and allocation state (free, partial, full).", ("pool", "state"),
                 snap.gpus.items())
    yield _gauge(FRAGMENTATION, "Free GPU compute on partly allocated cards over all free GPU compute.", ("pool",),
                 _by_one(snap.fragmentation))
    yield _gauge(NODES, "Nodes by pool and health state.", ("pool", "health"), snap.nodes.items())
    yield _gauge(QUEUE_ALLOCATED, "GPUs held by the running pods of a quota queue.", ("queue",),
                 _by_one({k: q.allocated_gpus for k, q in queues.items()}))
    yield _gauge(QUEUE_MIN, "A quota queue's guaranteed GPUs.", ("queue",),
                 _by_one({k: q.min_gpus for k, q in queues.items()}))
    yield _gauge(QUEUE_MAX, "A quota queue's GPU cap (queues without a cap are left out).", ("queue",),
                 _by_one({k: q.max_gpus for k, q in queues.items() if q.max_gpus is not None}))
    yield _gauge(TIDAL_LENT, "Nodes lent by the tidal controller, by the pool they are lent to.", ("pool",),
                 _by_one(snap.lent_nodes))
    yield _gauge(TIDAL_LOAN_OVERDUE, "Seconds a lent node is past its reclaim deadline (negative: time left).",
                 ("node", "window"), snap.loan_overdue.items())


# ------------------------------------------------------------------------------------------------ recording
class Recorder(Protocol):
    """What a component records by a call. `PlaneMetrics` implements it; `NULL_RECORDER` drops everything."""

    def attempt(self, result: str, count: int = 1) -> None: ...

    def cycle(self, seconds: float) -> None: ...

    def pod_scheduled(self, seconds: float) -> None: ...

    def eviction(self, cause: str) -> None: ...

    def loan(self, pool: str) -> None: ...

    def reclaim(self, *, early: bool) -> None: ...

    def recovery_action(self, action: str) -> None: ...

    def set_leader(self, component: str, leading: bool) -> None: ...

    def extender_request(self, verb: str, *, ok: bool, seconds: float) -> None: ...


class NullRecorder:
    """Records nothing: the default where no registry was given."""

    def attempt(self, result: str, count: int = 1) -> None:
        pass

    def cycle(self, seconds: float) -> None:
        pass

    def pod_scheduled(self, seconds: float) -> None:
        pass

    def eviction(self, cause: str) -> None:
        pass

    def loan(self, pool: str) -> None:
        pass

    def reclaim(self, *, early: bool) -> None:
        pass

    def recovery_action(self, action: str) -> None:
        pass

    def set_leader(self, component: str, leading: bool) -> None:
        pass

    def extender_request(self, verb: str, *, ok: bool, seconds: float) -> None:
        pass


NULL_RECORDER: Recorder = NullRecorder()


class PlaneMetrics:
    """The registry and every gpuplane scheduler and controller metric on it.

    Label values outside a metric's documented set raise `ValueError` (a typo would otherwise start a new
    series no alert reads)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self._attempts = Counter(ATTEMPTS, "Scheduling attempts by result.", ["result"], registry=reg)
        for result in RESULTS:
            self._attempts.labels(result)
        self._cycle = Histogram(CYCLE_DURATION, "Wall time of one scheduling pass over the active queue.",
                                buckets=CYCLE_BUCKETS, registry=reg)
        self._pod_latency = Histogram(POD_SCHEDULING_DURATION, "Pod creation to bind, in the cluster's clock.",
                                      buckets=POD_LATENCY_BUCKETS, registry=reg)
        self._evictions = Counter(EVICTIONS, "Pods evicted, by cause.", ["cause"], registry=reg)
        for cause in EVICTION_CAUSES:
            self._evictions.labels(cause)
        self._loans = Counter(TIDAL_LOANS, "Nodes lent by the tidal controller, by the pool they went to.", ["pool"],
                              registry=reg)
        self._reclaims = Counter(TIDAL_RECLAIMS, "Lent nodes taken back (early: before the window's end).",
                                 ["kind"], registry=reg)
        for kind in ("scheduled", "early"):
            self._reclaims.labels(kind)
        self._recovery = Counter(RECOVERY_ACTIONS, "Node recovery actions.", ["action"], registry=reg)
        for action in RECOVERY_ACTION_NAMES:
            self._recovery.labels(action)
        self._leader = Gauge(LEADER, "1 while this process holds its component's leader lease, else 0.",
                             ["component"], registry=reg)
        self._extender = Counter(EXTENDER_REQUESTS, "Scheduler-extender requests by verb and result.",
                                 ["verb", "result"], registry=reg)
        self._extender_seconds = Histogram(EXTENDER_DURATION, "Scheduler-extender request handling time.", ["verb"],
                                           buckets=CYCLE_BUCKETS, registry=reg)
        self._lock = threading.Lock()
        self._sources: dict[str, SnapshotSource] = {}
        self._readers: dict[str, Callable[[], Iterable[CounterReading]]] = {}
        reg.register(_SnapshotCollector(self._sources, self._readers, self._lock))

    # ---------------------------------------------------------------- scrape-time sources
    def observe(self, source: SnapshotSource, key: str = "cluster") -> None:
        """Export `source`'s snapshot at every scrape, in place of an earlier source under `key` (a component
        that takes over again after losing its lease replaces its old observer). Several keys: merged, the
        later key's values winning on the same labels."""
        with self._lock:
            self._sources[key] = source

    def counters(self, reader: Callable[[], Iterable[CounterReading]], key: str = "scheduler") -> None:
        """Export the counts `reader` returns at every scrape, in place of an earlier reader under `key`.
        Two readers must not return the same metric name."""
        with self._lock:
            self._readers[key] = reader

    def drop(self, key: str, source: SnapshotSource | None = None) -> None:
        """Stop exporting the source and the reader under `key` (their gauges vanish from the next scrape);
        with `source`, the source only, and only if it is still the one under `key`."""
        with self._lock:
            if source is None:
                self._sources.pop(key, None)
                self._readers.pop(key, None)
            elif self._sources.get(key) is source:
                del self._sources[key]

    # ---------------------------------------------------------------- recorded by a call
    def attempt(self, result: str, count: int = 1) -> None:
        _check(result, RESULTS, "result")
        self._attempts.labels(result).inc(count)

    def cycle(self, seconds: float) -> None:
        self._cycle.observe(seconds)

    def pod_scheduled(self, seconds: float) -> None:
        self._pod_latency.observe(max(0.0, seconds))

    def eviction(self, cause: str) -> None:
        _check(cause, EVICTION_CAUSES, "cause")
        self._evictions.labels(cause).inc()

    def loan(self, pool: str) -> None:
        self._loans.labels(pool).inc()

    def reclaim(self, *, early: bool) -> None:
        self._reclaims.labels("early" if early else "scheduled").inc()

    def recovery_action(self, action: str) -> None:
        _check(action, RECOVERY_ACTION_NAMES, "action")
        self._recovery.labels(action).inc()

    def set_leader(self, component: str, leading: bool) -> None:
        self._leader.labels(component).set(1.0 if leading else 0.0)

    def extender_request(self, verb: str, *, ok: bool, seconds: float) -> None:
        self._extender.labels(verb, "ok" if ok else "error").inc()
        self._extender_seconds.labels(verb).observe(seconds)

    # ---------------------------------------------------------------- exposition
    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (what a scrape of `serve` returns)."""
        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve `/metrics` on a daemon thread; returns the bound port (`port` 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(allowed)}")


__all__ = [
    "ATTEMPTS", "CARD_STATES", "CYCLE_DURATION", "EVICTIONS", "EVICTION_CAUSES", "EXTENDER_DURATION",
    "EXTENDER_REQUESTS", "FRAGMENTATION", "GANGS", "GPUS", "LEADER", "MAX_REASONS", "NODES", "NO_CLASS",
    "NO_QUEUE", "NULL_RECORDER", "OLDEST_PENDING", "OTHER_REASON", "PENDING_PODS", "POD_SCHEDULING_DURATION",
    "PREEMPTION_ATTEMPTS", "PREEMPTION_VICTIMS", "QUEUE_ALLOCATED", "QUEUE_MAX", "QUEUE_MIN", "RECOVERY_ACTIONS",
    "RECOVERY_ACTION_NAMES", "RESULTS", "TIDAL_LENT", "TIDAL_LOANS", "TIDAL_LOAN_OVERDUE", "TIDAL_RECLAIMS",
    "UNSCHEDULABLE_PODS", "CounterReading", "NullRecorder", "PlaneMetrics", "PlaneSnapshot", "QueueUse", "Recorder",
    "SnapshotSource", "reason_label", "snapshot_families",
]
