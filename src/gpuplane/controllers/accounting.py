"""GPU accounting over the cluster port: a ledger of the cards each pod holds, and the idle-card policy.

The ledger (`AccountingLedger`) watches pod events and books, per pod, the GPU-seconds it holds from its bind to its
deletion (a Terminating pod still holds its cards) and the GPU-seconds it uses, from a `UtilisationReader`:

- allocated GPU-seconds = the assignment's `gpu_milli` / 1000 × seconds held (a quarter card for an hour is 900);
- used GPU-seconds = allocated × the pod's busy share (0..1) of what it holds, read when the pod binds, at every
  sample (`sample_s`) and when it turns Terminating, and held until the next reading (piecewise constant);
- idle-allocated = allocated − used. A pod with no reading (the exporter is down) books used 0 and the same
  seconds as `unmeasured_gpu_s`, so a missing series is visible and never read as busy.

Each booked interval (`Booking`) names the pod, its namespace, team, queue, card model, priority class and node. The
namespace is the part of the pod's key before `/` (`default` for a bare name, as in Kubernetes); the team is the
pod's `gpuplane.io/team` label, else its queue (the tenant its quota counts against), else its namespace. Times come
from the event (the port's clock) and from the injected `Clock`, never the OS: the simulator's virtual seconds, or
the wall clock's Unix seconds in a live cluster. The same port inputs at the same times give the same bookings in
every world (tests/test_accounting_worlds.py).

The idle policy (`IdlePolicy`) names pods whose cards sit allocated but idle over a window and acts on them, each
action announced before it happens: a notice (the `gpuplane.io/idle-notice` annotation, with the action, its time
and the efficiency that triggered it, and a Warning Event `IdleGpuNotice` about the pod saying the same), then after
the rule's grace, if the pod is still idle, the action: scale its workload to zero, or evict it. A pod that turns
busy again within the grace has its notice withdrawn (a Normal Event `IdleGpuNoticeWithdrawn`).
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Protocol, TextIO

from gpuplane.model import MILLI_PER_CARD, GpuplaneError
from gpuplane.port import Clock, ClusterEvent, ClusterPort, EventKind, EventType, PodInfo, PodPhase, Timer

log = logging.getLogger(__name__)

TEAM_LABEL = "gpuplane.io/team"
IDLE_NOTICE = "gpuplane.io/idle-notice"
IDLE_REASON = "idle"
IDLE_NOTICED = "IdleGpuNotice"
"""The Warning Event's reason at a notice (beside the annotation)."""
IDLE_WITHDRAWN = "IdleGpuNoticeWithdrawn"
"""The Normal Event's reason when a notice is withdrawn (the pod turned busy within the grace)."""
DEFAULT_NAMESPACE = "default"


# ---------------------------------------------------------------------------------------------- who pays


@dataclass(frozen=True, slots=True)
class Holder:
    """Whom a pod's cards are booked to."""

    pod: str
    namespace: str
    team: str
    queue: str
    card_model: str
    priority_class: str
    node: str
    gpu_milli: int


def namespace_of(pod: str) -> str:
    """The namespace of a pod key `ns/name` (a bare name is in `default`)."""
    namespace, _, _ = pod.rpartition("/")
    return namespace or DEFAULT_NAMESPACE


def team_of(pod: PodInfo) -> str:
    """The `gpuplane.io/team` label, else the queue, else the namespace."""
    return dict(pod.request.labels).get(TEAM_LABEL) or pod.request.queue or namespace_of(pod.name)


# ---------------------------------------------------------------------------------------------- utilisation


class UtilisationReader(Protocol):
    """A pod's busy share (0..1) of the cards it holds, now; None when there is no reading."""

    def busy_share(self, pod: PodInfo, now: float) -> float | None: ...

    def busy_shares(self, pods: Sequence[PodInfo], now: float) -> Mapping[str, float | None]:
        """`busy_share` of each of `pods` (by name), now: a sample's readings, in one read where the source allows
        it (`DcgmReader`: one query for all pods)."""
        ...


class Labelled(Protocol):
    """One element of an instant vector (`scaler.prometheus.Series`)."""

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def value(self) -> float: ...


class QuerySource(Protocol):
    """Instant queries (`scaler.prometheus.PrometheusClient`): one number, or raises a `GpuplaneError` for no data;
    or every element of a vector (an empty list for none), raising a `GpuplaneError` for an error answer."""

    def query(self, query: str, *, timeout_s: float | None = None) -> float: ...

    def vector(self, query: str, *, timeout_s: float | None = None) -> Sequence[Labelled]: ...


DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
"""dcgm-exporter's card utilisation, percent of time a kernel ran (per card, labelled with the holding pod)."""
DCGM_SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
"""dcgm-exporter's profiling SM-active ratio (0..1): closer to the simulator's SM busy share."""


class DcgmReader:
    """Busy share from dcgm-exporter through Prometheus: `avg(METRIC{namespace=…,pod=…})` over the pod's cards,
    scaled to 0..1 (`DCGM_FI_DEV_GPU_UTIL` is a percent, `DCGM_FI_PROF_SM_ACTIVE` a ratio).

    A sample (`busy_shares`) reads every pod with one query, `avg by (namespace, pod) (METRIC{pod!=""})`: the same
    average over the same series per pod, grouped by the labels dcgm-exporter puts on a card a pod holds. A pod
    without an element, or whose element is NaN or ±Inf, has no reading, as its own query would have none; an
    error answer leaves every pod without a reading. A single pod (at its bind and at Terminating) is read with its
    own query (`busy_share`).

    dcgm-exporter reports a card's figure for every pod on it: for a pod holding a fraction of a card the card's
    busy milli is given to that pod up to its share (share = card busy × cards × 1000 / gpu_milli, at most 1), an
    upper bound where several pods share the card."""

    def __init__(self, source: QuerySource, metric: str = DCGM_GPU_UTIL, *, timeout_s: float | None = None) -> None:
        self.source = source
        self.metric = metric
        self.scale = 100.0 if metric == DCGM_GPU_UTIL else 1.0
        self.timeout_s = timeout_s

    def query(self, pod: PodInfo) -> str:
        name = pod.name.rpartition("/")[2]
        return f'avg({self.metric}{{namespace="{namespace_of(pod.name)}",pod="{name}"}})'

    def vector_query(self) -> str:
        return f'avg by (namespace, pod) ({self.metric}{{pod!=""}})'

    def busy_share(self, pod: PodInfo, now: float) -> float | None:
        try:
            card_busy = self.source.query(self.query(pod), timeout_s=self.timeout_s)
        except GpuplaneError as exc:
            log.debug("no utilisation for %s: %s", pod.name, exc)
            return None
        return self._share(pod, card_busy)

    def busy_shares(self, pods: Sequence[PodInfo], now: float) -> Mapping[str, float | None]:
        if not pods:
            return {}
        try:
            series = self.source.vector(self.vector_query(), timeout_s=self.timeout_s)
        except GpuplaneError as exc:
            log.warning("no utilisation for %d pod(s): %s", len(pods), exc)
            return {pod.name: None for pod in pods}
        busy = {(s.labels.get("namespace", ""), s.labels.get("pod", "")): s.value for s in series}
        shares: dict[str, float | None] = {}
        for pod in pods:
            card_busy = busy.get((namespace_of(pod.name), pod.name.rpartition("/")[2]))
            shares[pod.name] = self._share(pod, card_busy) if card_busy is not None and math.isfinite(card_busy) \
                else None
        return shares

    def _share(self, pod: PodInfo, card_busy: float) -> float | None:
        assignment = pod.assignment
        if assignment is None or not assignment.cards or assignment.gpu_milli <= 0:
            return None
        held = assignment.gpu_milli / (len(assignment.cards) * MILLI_PER_CARD)
        return min(1.0, max(0.0, card_busy / self.scale) / held)


class NoReader:
    """No utilisation source: every second is unmeasured (allocation-only accounting)."""

    def busy_share(self, pod: PodInfo, now: float) -> float | None:
        return None

    def busy_shares(self, pods: Sequence[PodInfo], now: float) -> Mapping[str, float | None]:
        return {pod.name: None for pod in pods}


# ---------------------------------------------------------------------------------------------- bookings


@dataclass(frozen=True, slots=True)
class Booking(Holder):
    """One booked interval of one pod: cards held from `start` to `end` with one busy share."""

    start: float
    end: float
    busy_share: float | None
    """None: no reading (booked as used 0, unmeasured)."""

    @staticmethod
    def of(holder: Holder, start: float, end: float, busy_share: float | None) -> Booking:
        return Booking(pod=holder.pod, namespace=holder.namespace, team=holder.team, queue=holder.queue,
                       card_model=holder.card_model, priority_class=holder.priority_class, node=holder.node,
                       gpu_milli=holder.gpu_milli, start=start, end=end, busy_share=busy_share)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def allocated_gpu_s(self) -> float:
        return self.gpu_milli * self.seconds / MILLI_PER_CARD

    @property
    def used_gpu_s(self) -> float:
        return self.allocated_gpu_s * (self.busy_share or 0.0)

    @property
    def idle_gpu_s(self) -> float:
        return self.allocated_gpu_s - self.used_gpu_s

    @property
    def unmeasured_gpu_s(self) -> float:
        return self.allocated_gpu_s if self.busy_share is None else 0.0

    def clipped(self, start: float, end: float) -> Booking | None:
        """The part of this booking within [start, end), or None if none."""
        lo, hi = max(self.start, start), min(self.end, end)
        if hi <= lo:
            return None
        return replace(self, start=lo, end=hi)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> Booking:
        raw = json.loads(line)
        share = raw["busy_share"]
        text = {f.name: str(raw[f.name]) for f in fields(Holder) if f.name != "gpu_milli"}
        return Booking(**text, gpu_milli=int(raw["gpu_milli"]), start=float(raw["start"]), end=float(raw["end"]),
                       busy_share=None if share is None else float(share))


class LedgerError(GpuplaneError):
    """A ledger file that cannot be read; the message names the file and line."""


def read_ledger(path: Path) -> list[Booking]:
    """The bookings of a ledger file (JSON lines, one `Booking` each)."""
    bookings: list[Booking] = []
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        bookings.append(Booking.from_json(line))
                    except (ValueError, KeyError, TypeError) as exc:
                        raise LedgerError(f"{path}:{number}: not a booking: {exc}") from None
    except OSError as exc:
        raise LedgerError(f"{path}: {exc}") from None
    return bookings


class LedgerFile:
    """A booking sink appending JSON lines to a file (flushed per booking: a crash loses no booked interval)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._handle: TextIO = path.open("a", encoding="utf-8")

    def __call__(self, booking: Booking) -> None:
        self._handle.write(booking.to_json() + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


@dataclass(slots=True)
class _Open:
    holder: Holder
    since: float
    share: float | None


class AccountingLedger:
    """Books the cards every pod holds (see the module docstring).

    `clock`: the time of samples and of `flush`. `sample_s`: how often utilisation is read (0: only at events and
    at explicit `sample()` calls; no timer). `sink`: gets every booking as it is made (a `LedgerFile`).
    `keep_s`: how far back `usage` can look (closed intervals older than this are dropped from memory, not from
    `bookings`). `namespace`/`team`: who pays, by default `namespace_of` and `team_of` (whose last resort is the
    namespace given here). Pods already holding cards
    when the ledger starts are booked from then on."""

    def __init__(self, cluster: ClusterPort, clock: Clock, reader: UtilisationReader, *, sample_s: float = 60.0,
                 sink: Callable[[Booking], None] | None = None, keep_s: float = 86_400.0,
                 namespace: Callable[[PodInfo], str] | None = None, team: Callable[[PodInfo], str] | None = None,
                 keep_bookings: bool = True) -> None:
        if sample_s < 0:
            raise ValueError(f"sample_s must not be negative, got {sample_s}")
        self.cluster, self.clock, self.reader = cluster, clock, reader
        self.sample_s, self.sink, self.keep_s = sample_s, sink, keep_s
        self._namespace = namespace if namespace is not None else (lambda pod: namespace_of(pod.name))
        self._team = team if team is not None else (
            lambda pod: dict(pod.request.labels).get(TEAM_LABEL) or pod.request.queue or self._namespace(pod))
        self.bookings: list[Booking] = []
        """Every booking made (when `keep_bookings`)."""
        self._keep_bookings = keep_bookings
        self._models: dict[str, str] = {n.name: n.spec.gpu_model or "" for n in cluster.list_nodes()}
        self._open: dict[str, _Open] = {}
        self._recent: dict[str, deque[Booking]] = {}
        self._timer: Timer | None = None
        self._closed = False
        now = clock.now()
        for pod in cluster.list_pods():
            if pod.assignment is not None and pod.phase in (PodPhase.RUNNING, PodPhase.TERMINATING):
                self._start(pod, now)
        self._unwatch = cluster.watch(self._on_event)
        if sample_s > 0:
            self._timer = clock.call_later(sample_s, self._tick)

    # ------------------------------------------------------------------ events
    def holder(self, pod: PodInfo) -> Holder | None:
        """Whom `pod`'s cards are booked to (None: it holds no cards)."""
        assignment = pod.assignment
        if assignment is None or assignment.gpu_milli <= 0:
            return None
        return Holder(pod.name, self._namespace(pod), self._team(pod), pod.request.queue or "",
                      self._models.get(assignment.node, ""), pod.request.priority_class or "", assignment.node,
                      assignment.gpu_milli)

    def _on_event(self, event: ClusterEvent) -> None:
        node, pod = event.node, event.pod
        if node is not None and event.kind in (EventKind.NODE_ADDED, EventKind.NODE_UPDATED):
            self._models[node.name] = node.spec.gpu_model or ""
        if pod is None:
            return
        if event.kind is EventKind.POD_BOUND:
            self._stop(pod.name, event.time)
            self._start(pod, event.time)
        elif event.kind is EventKind.POD_TERMINATING:
            if pod.name in self._open:
                self._book(pod.name, event.time)
                self._open[pod.name].share = self.reader.busy_share(pod, event.time)
            else:
                self._start(pod, event.time)
        elif event.kind in (EventKind.POD_DELETED, EventKind.POD_FAILED):
            self._stop(pod.name, event.time)
            self._recent.pop(pod.name, None)

    def _start(self, pod: PodInfo, now: float) -> None:
        holder = self.holder(pod)
        if holder is not None:
            self._open[pod.name] = _Open(holder, now, self.reader.busy_share(pod, now))

    def _stop(self, name: str, now: float) -> None:
        if name in self._open:
            self._book(name, now)
            del self._open[name]

    def _book(self, name: str, now: float) -> None:
        entry = self._open[name]
        if now > entry.since:
            booking = Booking.of(entry.holder, entry.since, now, entry.share)
            if self._keep_bookings:
                self.bookings.append(booking)
            recent = self._recent.setdefault(name, deque())
            recent.append(booking)
            while recent and recent[0].end < now - self.keep_s:
                recent.popleft()
            if self.sink is not None:
                self.sink(booking)
        entry.since = max(entry.since, now)

    # ------------------------------------------------------------------ samples
    def sample(self, now: float | None = None) -> None:
        """Read utilisation afresh (at `now`, default the clock's); an open interval whose reading changed is booked up
    to `now` and goes on with the new reading."""
        at = self.clock.now() if now is None else now
        pods = {name: self._pod(name) for name in self._open}
        present = [pod for pod in pods.values() if pod is not None]
        shares = self.reader.busy_shares(present, at) if present else {}  # one read for every pod
        for name, entry in list(self._open.items()):
            share = shares.get(name) if pods[name] is not None else entry.share
            if share != entry.share:  # an unchanged reading extends the open interval: one booking, not many
                self._book(name, at)
                entry.share = share

    def _pod(self, name: str) -> PodInfo | None:
        get = getattr(self.cluster, "get_pod", None)
        if get is not None:
            found = get(name)
            return found if isinstance(found, PodInfo) else None
        return next((p for p in self.cluster.list_pods() if p.name == name), None)

    def _tick(self) -> None:
        if self._closed:
            return
        self.sample()
        self._timer = self.clock.call_later(self.sample_s, self._tick)

    def flush(self, now: float | None = None) -> None:
        """Book every open interval up to `now` without a new reading (before a bill is drawn)."""
        at = self.clock.now() if now is None else now
        for name in list(self._open):
            self._book(name, at)

    def close(self, now: float | None = None) -> None:
        """Flush, stop watching and sampling."""
        self.flush(now)
        self._closed = True
        self._unwatch()
        if self._timer is not None:
            self._timer.cancel()

    # ------------------------------------------------------------------ reads
    def holding(self) -> Sequence[Holder]:
        """Pods holding cards now."""
        return [entry.holder for entry in self._open.values()]

    def usage(self, pod: str, since: float, now: float) -> tuple[float, float]:
        """(allocated, used) GPU-seconds of `pod` within [since, now), the open interval included at its reading."""
        allocated = used = 0.0
        for booking in self._recent.get(pod, ()):
            part = booking.clipped(since, now)
            if part is not None:
                allocated += part.allocated_gpu_s
                used += part.used_gpu_s
        entry = self._open.get(pod)
        if entry is not None:
            lo = max(entry.since, since)
            if now > lo:
                held = entry.holder.gpu_milli * (now - lo) / MILLI_PER_CARD
                allocated += held
                used += held * (entry.share or 0.0)
        return allocated, used


# ---------------------------------------------------------------------------------------------- the idle policy


Action = Literal["evict", "scale-to-zero"]


@dataclass(frozen=True, slots=True)
class IdleRule:
    """Pods of `priority_class` whose used share of their cards over the last `window_s` is at most
    `max_efficiency` are noticed, then after `grace_s` acted on with `action` (scale-to-zero applies to a pod of a
    workload; a pod outside one is evicted)."""

    priority_class: str
    window_s: float = 3600.0
    max_efficiency: float = 0.05
    grace_s: float = 1800.0
    action: Action = "evict"

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.grace_s < 0 or not 0 <= self.max_efficiency < 1:
            raise ValueError(f"idle rule for {self.priority_class!r}: window_s > 0, grace_s >= 0 and "
                             f"0 <= max_efficiency < 1, got {self.window_s}, {self.grace_s}, {self.max_efficiency}")


@dataclass(frozen=True, slots=True)
class IdleAction:
    """What the policy did: `notice`, `withdraw` (busy again), `evict` or `scale-to-zero`, and whether the port
    accepted it."""

    time: float
    pod: str
    kind: str
    efficiency: float
    ok: bool = True
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Notice:
    """The `gpuplane.io/idle-notice` annotation's content."""

    action: str
    at: float
    """when the action is due"""
    efficiency: float
    noticed: float

    def encode(self) -> str:
        return json.dumps({"action": self.action, "at": self.at, "efficiency": round(self.efficiency, 4),
                           "noticed": self.noticed}, separators=(",", ":"))

    @staticmethod
    def decode(raw: str) -> Notice | None:
        try:
            value = json.loads(raw)
            return Notice(str(value["action"]), float(value["at"]), float(value["efficiency"]),
                          float(value["noticed"]))
        except (ValueError, KeyError, TypeError):
            return None


class IdlePolicy:
    """Acts on pods whose cards sit allocated but idle, through the port, each action announced first.

    A pod is judged only once it has held its cards for a whole window (a pod just started is not idle). The
    notice lives on the pod (its annotation), so a restarted policy keeps the announced time. `reconcile()` is
    one pass; call it on a timer (or every controller pass)."""

    def __init__(self, cluster: ClusterPort, ledger: AccountingLedger, clock: Clock, rules: Iterable[IdleRule], *,
                 evict_grace_s: float = 30.0) -> None:
        self.cluster, self.ledger, self.clock = cluster, ledger, clock
        self.rules: Mapping[str, IdleRule] = {rule.priority_class: rule for rule in rules}
        self.evict_grace_s = evict_grace_s
        self.actions: list[IdleAction] = []
        self._acted: set[str] = set()

    def efficiency(self, pod: PodInfo, rule: IdleRule, now: float) -> float | None:
        """Used over allocated in the last window; None before the pod has held its cards for a whole window."""
        if pod.bound_at is None or now - pod.bound_at < rule.window_s:
            return None
        allocated, used = self.ledger.usage(pod.name, now - rule.window_s, now)
        return used / allocated if allocated > 0 else None

    def reconcile(self) -> list[IdleAction]:
        now = self.clock.now()
        done: list[IdleAction] = []
        for pod in self.cluster.list_pods():
            rule = self.rules.get(pod.request.priority_class or "")
            if rule is None or pod.phase is not PodPhase.RUNNING or pod.assignment is None or pod.name in self._acted:
                continue
            raw = dict(pod.annotations).get(IDLE_NOTICE)
            notice = Notice.decode(raw) if raw is not None else None
            efficiency = self.efficiency(pod, rule, now)
            if efficiency is None:
                continue
            idle = efficiency <= rule.max_efficiency
            if not idle:
                if raw is not None:
                    status = self.cluster.patch_pod(pod.name, annotations={IDLE_NOTICE: None})
                    if status.ok:
                        self._post(pod.name, EventType.NORMAL, IDLE_WITHDRAWN,
                                   f"GPU efficiency {efficiency:.1%} over the last {rule.window_s:g} s is above "
                                   f"{rule.max_efficiency:.1%}: the idle notice is withdrawn"
                                   + (f" ({notice.action} was due at {_when(notice.at)})" if notice else ""))
                    done.append(IdleAction(now, pod.name, "withdraw", efficiency, status.ok, status.message))
                continue
            action: Action = rule.action if pod.request.workload is not None else "evict"
            if notice is None:
                announced = Notice(action, now + rule.grace_s, efficiency, now)
                status = self.cluster.patch_pod(pod.name, annotations={IDLE_NOTICE: announced.encode()})
                if status.ok:
                    self._post(pod.name, EventType.WARNING, IDLE_NOTICED,
                               f"GPU efficiency {efficiency:.1%} over the last {rule.window_s:g} s is at most "
                               f"{rule.max_efficiency:.1%}: {action} due at {_when(announced.at)} unless the "
                               "pod's cards turn busy")
                done.append(IdleAction(now, pod.name, "notice", efficiency, status.ok,
                                       f"{action} at {announced.at:.0f}" if status.ok else status.message))
                continue
            if now < notice.at:
                continue
            if notice.action == "scale-to-zero" and pod.request.workload is not None:
                status = self.cluster.scale(pod.request.workload, 0)
            else:
                status = self.cluster.evict(pod.name, grace_s=self.evict_grace_s, reason=IDLE_REASON)
            if status.ok:
                self._acted.add(pod.name)
            done.append(IdleAction(now, pod.name, notice.action, efficiency, status.ok, status.message))
        self.actions.extend(done)
        return done

    def _post(self, pod: str, type_: EventType, reason: str, message: str) -> None:
        """The notice's Event beside its annotation; one not recorded is logged, the annotation is the record."""
        status = self.cluster.record_event("Pod", pod, type_=type_, reason=reason, message=message)
        if not status.ok:
            log.warning("the %s event of %s: %s", reason, pod, status.message)


def _when(t: float) -> str:
    """A due time as people read it: the clock's seconds as UTC ISO 8601 (a simulation's start at 0 reads 1970)."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------- bills


KEYS = ("namespace", "team", "queue", "card_model", "priority_class")


@dataclass(frozen=True, slots=True)
class BillRow:
    """GPU-seconds (and cost) of one group of bookings."""

    key: tuple[str, ...]
    allocated_gpu_s: float
    used_gpu_s: float
    idle_gpu_s: float
    unmeasured_gpu_s: float
    cost: float
    """allocated GPU-hours × the card model's price per card-hour"""

    @property
    def efficiency(self) -> float:
        return self.used_gpu_s / self.allocated_gpu_s if self.allocated_gpu_s > 0 else math.nan


def clip(bookings: Iterable[Booking], start: float, end: float) -> list[Booking]:
    """The parts of `bookings` within [start, end)."""
    parts = (b.clipped(start, end) for b in bookings)
    return [p for p in parts if p is not None]


def bill(bookings: Iterable[Booking], prices: Mapping[str, float], by: Sequence[str] = KEYS,
         key: Callable[[Booking], tuple[str, ...]] | None = None) -> list[BillRow]:
    """Bookings summed by the fields `by` (or by `key`), sorted by key. A card model without a price costs 0."""
    sums: dict[tuple[str, ...], list[float]] = {}
    for b in bookings:
        group = key(b) if key is not None else tuple(str(getattr(b, field)) for field in by)
        row = sums.setdefault(group, [0.0, 0.0, 0.0, 0.0, 0.0])
        allocated = b.allocated_gpu_s
        row[0] += allocated
        row[1] += b.used_gpu_s
        row[2] += b.idle_gpu_s
        row[3] += b.unmeasured_gpu_s
        row[4] += allocated / 3600.0 * prices.get(b.card_model, 0.0)
    return [BillRow(group, *values) for group, values in sorted(sums.items())]


@dataclass(frozen=True, slots=True)
class LowEfficiency:
    """A pod that held cards within the window and used at most a threshold of them."""

    pod: str
    team: str
    priority_class: str
    card_model: str
    allocated_gpu_s: float
    used_gpu_s: float
    cost: float

    @property
    def efficiency(self) -> float:
        return self.used_gpu_s / self.allocated_gpu_s if self.allocated_gpu_s > 0 else math.nan


def low_efficiency(bookings: Iterable[Booking], prices: Mapping[str, float], *, max_efficiency: float = 0.3,
                   min_gpu_s: float = 3600.0, classes: frozenset[str] | None = None) -> list[LowEfficiency]:
    """Pods of `classes` (None: every class) holding at least `min_gpu_s` whose used share is at most
    `max_efficiency`, most idle GPU-seconds first. Unmeasured seconds count as idle (they are not known used)."""
    groups: dict[str, list[Booking]] = {}
    for b in bookings:
        if classes is None or b.priority_class in classes:
            groups.setdefault(b.pod, []).append(b)
    found: list[LowEfficiency] = []
    for pod, parts in groups.items():
        allocated = sum(b.allocated_gpu_s for b in parts)
        used = sum(b.used_gpu_s for b in parts)
        if allocated >= min_gpu_s and used <= max_efficiency * allocated:
            first = parts[0]
            cost = sum(b.allocated_gpu_s / 3600.0 * prices.get(b.card_model, 0.0) for b in parts)
            found.append(LowEfficiency(pod, first.team, first.priority_class, first.card_model, allocated, used, cost))
    return sorted(found, key=lambda r: (-(r.allocated_gpu_s - r.used_gpu_s), r.pod))
