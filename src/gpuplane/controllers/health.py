"""Node health: a per-node state machine with history, the exclusion policy, lemons and stragglers.

Pure decisions over events and times the caller passes in (seconds, any epoch): the recovery controller,
the node agent's check tiers (`gpuplane.node.health_checks`) and the simulator all drive the same book,
so the policy a simulation measures is the policy the cluster enforces.

States: HEALTHY → SUSPECT (a failure blamed on the node, a failed check, a straggler verdict) →
QUARANTINED (confirmed, critical, or over the exclusion limit) → REPAIRING → PROBATION (back in service,
small jobs only) → HEALTHY. Every move is a row of `HEALTH_TRANSITIONS`; an event with no row for the
node's state is refused (a `Status` with the reason), and nothing is recorded.

Exclusion policy (fault-tolerance reference §8.4, "bad nodes stay bad"): `max_failures` failures
attributed to a node within `window_s` quarantine it; one critical failure (Xid 48, 64, 79, 95 or an
isolate-node verdict) quarantines it at once. Attributed failures are never forgotten by a repair: a node
that fails again soon after its probation is quarantined again.

Lemons are nodes whose attributed-failure rate stays far above the fleet's; they pass point-in-time checks
(their faults are load-dependent), so they are kept off large jobs rather than out of the cluster.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuplane.model import Taint
from gpuplane.port import ClusterPort
from gpuplane.port.status import Code, Status

DAY_S = 86_400.0

__all__ = [
    "CRITICAL_XIDS", "DAY_S", "HEALTH_LABEL", "HEALTH_TRANSITIONS", "QUARANTINE_TAINT", "HealthEvent", "HealthPolicy",
    "HealthRecord", "HealthResult", "NodeHealth", "NodeHealthBook", "NodeHealthController", "Straggler", "stragglers",
]


class NodeHealth(enum.Enum):
    """Where one node stands."""

    HEALTHY = "healthy"
    """In service for any job."""
    SUSPECT = "suspect"
    """Under suspicion, awaiting a check; no new jobs."""
    QUARANTINED = "quarantined"
    """Out of service, waiting for repair."""
    REPAIRING = "repairing"
    """Being repaired: reset, reboot, RMA, then DCGM r3/r4 and burn-in."""
    PROBATION = "probation"
    """Back in service after a repair, for small jobs only, until `probation_s` has passed."""


class HealthEvent(enum.Enum):
    FAILURE_ATTRIBUTED = "failure-attributed"
    """A job failure blamed on this node."""
    CRITICAL_FAILURE = "critical-failure"
    """A critical Xid (48, 64, 79, 95) or an isolate-node verdict: quarantine at once."""
    FAILURE_LIMIT_REACHED = "failure-limit-reached"
    """`max_failures` attributed failures within `window_s`. The book raises it itself after the failure that
    reaches the limit; a controller with its own scoring may raise it too."""
    CHECK_FAILED = "check-failed"
    CHECK_PASSED = "check-passed"
    REPAIR_STARTED = "repair-started"
    REPAIR_DONE = "repair-done"
    """Repaired and through the admission suite (DCGM r3/r4, burn-in): probation starts."""
    PROBATION_PASSED = "probation-passed"
    """Refused until the node has been in probation for `probation_s`."""
    PROBATION_FAILED = "probation-failed"
    STRAGGLER = "straggler"
    """Persistently slower than the fleet; confirm with an isolated check (CHECK_PASSED / CHECK_FAILED)."""


_H, _S, _Q, _R, _P = (NodeHealth.HEALTHY, NodeHealth.SUSPECT, NodeHealth.QUARANTINED, NodeHealth.REPAIRING,
                      NodeHealth.PROBATION)
_E = HealthEvent

HEALTH_TRANSITIONS: dict[tuple[NodeHealth, HealthEvent], NodeHealth] = {
    # HEALTHY: any sign of trouble makes it a suspect; a critical one quarantines it.
    (_H, _E.FAILURE_ATTRIBUTED): _S,
    (_H, _E.CRITICAL_FAILURE): _Q,
    (_H, _E.FAILURE_LIMIT_REACHED): _Q,
    (_H, _E.CHECK_FAILED): _S,
    (_H, _E.CHECK_PASSED): _H,  # periodic checks on an idle node: recorded, nothing changes
    (_H, _E.STRAGGLER): _S,
    # SUSPECT: a check decides; further failures accumulate until the exclusion limit.
    (_S, _E.FAILURE_ATTRIBUTED): _S,
    (_S, _E.CRITICAL_FAILURE): _Q,
    (_S, _E.FAILURE_LIMIT_REACHED): _Q,
    (_S, _E.CHECK_FAILED): _Q,  # suspicion confirmed
    (_S, _E.CHECK_PASSED): _H,  # cleared
    (_S, _E.STRAGGLER): _S,
    # QUARANTINED: only repair moves it on; late evidence (a failure diagnosed after the quarantine) counts.
    (_Q, _E.FAILURE_ATTRIBUTED): _Q,
    (_Q, _E.CRITICAL_FAILURE): _Q,
    (_Q, _E.REPAIR_STARTED): _R,
    # REPAIRING: done means probation; a failing admission check or a critical error sends it back.
    (_R, _E.CHECK_PASSED): _R,
    (_R, _E.CHECK_FAILED): _Q,
    (_R, _E.CRITICAL_FAILURE): _Q,
    (_R, _E.REPAIR_DONE): _P,
    # PROBATION: any failure ends it in quarantine; a straggler verdict waits for its confirming check.
    (_P, _E.PROBATION_PASSED): _H,
    (_P, _E.PROBATION_FAILED): _Q,
    (_P, _E.FAILURE_ATTRIBUTED): _Q,
    (_P, _E.CRITICAL_FAILURE): _Q,
    (_P, _E.CHECK_FAILED): _Q,
    (_P, _E.CHECK_PASSED): _P,
    (_P, _E.STRAGGLER): _P,
}
"""(state, event) -> next state. Any pair not listed is illegal: `NodeHealthBook.apply` refuses it."""

_FAILURE_EVENTS = frozenset({HealthEvent.FAILURE_ATTRIBUTED, HealthEvent.CRITICAL_FAILURE})
"""Events that count as a failure attributed to the node (for the exclusion limit and lemon rates)."""

CRITICAL_XIDS: frozenset[int] = frozenset({48, 64, 79, 95})
"""Double-bit ECC, row-remapping failure, fallen off the bus, uncontained uncorrectable ECC."""


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """Thresholds of the exclusion, probation and lemon policies (times in seconds)."""

    max_failures: int = 2
    """Attributed failures within `window_s` that quarantine a node."""
    window_s: float = 7 * DAY_S
    critical_xids: frozenset[int] = CRITICAL_XIDS
    probation_s: float = 3 * DAY_S
    """How long a repaired node stays in probation (no large jobs) before PROBATION_PASSED is accepted."""
    large_job_gpus: int = 256
    """Jobs with at least this many GPUs avoid lemons and nodes in probation."""
    lemon_factor: float = 5.0
    """A lemon's failure rate is at least this multiple of the fleet's."""
    lemon_min_failures: int = 2
    """…and it has at least this many attributed failures in `lemon_window_s`."""
    lemon_window_s: float = 30 * DAY_S
    min_exposure_days: float = 1.0
    """A node's observed node-days are counted as at least this, so a node seen for an hour does not get a
    huge rate from one failure."""

    def __post_init__(self) -> None:
        for name in ("max_failures", "large_job_gpus", "lemon_min_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        for name in ("window_s", "lemon_window_s", "min_exposure_days", "lemon_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.probation_s) and self.probation_s >= 0):
            raise ValueError(f"probation_s: must be a finite number >= 0, got {self.probation_s!r}")

    def is_critical_xid(self, xid: int) -> bool:
        return xid in self.critical_xids


@dataclass(frozen=True, slots=True)
class HealthRecord:
    """One legal transition: always `HEALTH_TRANSITIONS[(from_state, event)] == to_state`."""

    t: float
    node: str
    from_state: NodeHealth
    event: HealthEvent
    to_state: NodeHealth
    reason: str


@dataclass(frozen=True, slots=True)
class HealthResult:
    """What `apply` did. `status` is SUCCESS when the event was applied, ERROR when the table has no row for
    it (illegal), WAIT when it is legal but too early (probation not over); `state` is the node's state
    afterwards (unchanged when refused); `records` what was appended to the history (empty when refused;
    two when a failure also reached the exclusion limit)."""

    status: Status
    state: NodeHealth
    records: tuple[HealthRecord, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status.ok

    @property
    def code(self) -> Code:
        return self.status.code

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.status.reasons

    @property
    def message(self) -> str:
        return self.status.message


_PLUGIN = "node-health"


@dataclass(slots=True)
class _Node:
    state: NodeHealth
    registered_at: float
    entered_at: float
    failures: list[float] = field(default_factory=list)
    """Times of the attributed failures (FAILURE_ATTRIBUTED and CRITICAL_FAILURE), in arrival order."""


class NodeHealthBook:
    """Every node's health state, the history of its transitions, and its attributed failures.

    Nodes unknown to the book read as HEALTHY; `apply` registers a node the first time an event for it is
    accepted (its observation for lemon rates starts then), `register` does so explicitly (do it for the whole
    fleet, so that nodes without failures count in the fleet's rate). Never raises for expected outcomes."""

    def __init__(self, policy: HealthPolicy | None = None, nodes: Iterable[str] = (), now: float = 0.0) -> None:
        self.policy = policy or HealthPolicy()
        self._nodes: dict[str, _Node] = {}
        self.history: list[HealthRecord] = []
        """Every transition of every node, in the order applied."""
        for node in nodes:
            self.register(node, now)

    # -- queries ------------------------------------------------------------------------------------------

    def register(self, node: str, now: float, state: NodeHealth = NodeHealth.HEALTHY) -> None:
        """Start tracking a node in `state`, without a history record (idempotent: a known node keeps its
        state and history)."""
        if node not in self._nodes:
            self._nodes[node] = _Node(state, now, now)

    def state(self, node: str) -> NodeHealth:
        entry = self._nodes.get(node)
        return NodeHealth.HEALTHY if entry is None else entry.state

    def states(self) -> dict[str, NodeHealth]:
        return {node: entry.state for node, entry in self._nodes.items()}

    def in_state(self, state: NodeHealth) -> list[str]:
        return sorted(node for node, entry in self._nodes.items() if entry.state is state)

    def history_of(self, node: str) -> list[HealthRecord]:
        return [record for record in self.history if record.node == node]

    def entered_at(self, node: str) -> float | None:
        """When the node entered its current state (its registration, for a node never moved)."""
        entry = self._nodes.get(node)
        return None if entry is None else entry.entered_at

    def failures_within(self, node: str, now: float, window_s: float | None = None) -> int:
        """Attributed failures at times t with `now - window_s <= t <= now` (default: the exclusion window)."""
        entry = self._nodes.get(node)
        if entry is None:
            return 0
        window = self.policy.window_s if window_s is None else window_s
        return sum(1 for t in entry.failures if now - window <= t <= now)

    def probation_over(self, node: str, now: float) -> bool:
        """Whether the node is in probation and has served `probation_s` of it."""
        entry = self._nodes.get(node)
        return (entry is not None and entry.state is NodeHealth.PROBATION
                and now - entry.entered_at >= self.policy.probation_s)

    # -- events -------------------------------------------------------------------------------------------

    def apply(self, node: str, event: HealthEvent, now: float, reason: str = "") -> HealthResult:
        """Move `node` by `event` at time `now`, recording the transition; refuse (and record nothing) when
        the table has no row for (state, event) or a probation is not over. A failure that brings the node's
        attributed failures within `window_s` to `max_failures` also records FAILURE_LIMIT_REACHED."""
        entry = self._nodes.get(node)
        state = NodeHealth.HEALTHY if entry is None else entry.state
        target = HEALTH_TRANSITIONS.get((state, event))
        if target is None:
            return HealthResult(Status.error(f"{node}: {event.value} is not legal in state {state.value}",
                                             plugin=_PLUGIN), state)
        if event is HealthEvent.PROBATION_PASSED and entry is not None:
            ends = entry.entered_at + self.policy.probation_s
            if now < ends:
                left_d = (ends - now) / DAY_S
                return HealthResult(Status(Code.WAIT, (f"{node}: probation ends at t={ends:g} ({left_d:.2f} d left)",),
                                           _PLUGIN), state)
        if entry is None:
            entry = self._nodes[node] = _Node(state, now, now)
        if event in _FAILURE_EVENTS:
            entry.failures.append(now)
        records = [self._move(entry, node, event, target, now, reason)]
        if event is HealthEvent.FAILURE_ATTRIBUTED:
            count = self.failures_within(node, now)
            limit_target = HEALTH_TRANSITIONS.get((entry.state, HealthEvent.FAILURE_LIMIT_REACHED))
            if count >= self.policy.max_failures and limit_target is not None:
                why = (f"exclusion policy: {count} attributed failures within {self.policy.window_s / DAY_S:g} d "
                       f"(limit {self.policy.max_failures})")
                records.append(self._move(entry, node, HealthEvent.FAILURE_LIMIT_REACHED, limit_target, now, why))
        return HealthResult(Status.success(), entry.state, tuple(records))

    def _move(self, entry: _Node, node: str, event: HealthEvent, target: NodeHealth, now: float,
              reason: str) -> HealthRecord:
        record = HealthRecord(now, node, entry.state, event, target, reason)
        self.history.append(record)
        if target is not entry.state:
            entry.entered_at = now
        entry.state = target
        return record

    # -- lemons and eligibility ---------------------------------------------------------------------------

    def _exposure_days(self, entry: _Node, now: float) -> float:
        observed = max(0.0, min(now - entry.registered_at, self.policy.lemon_window_s))
        return max(observed / DAY_S, self.policy.min_exposure_days)

    def failure_rate(self, node: str, now: float) -> float:
        """Attributed failures per node-day over the lemon window (0 for an unknown node)."""
        entry = self._nodes.get(node)
        if entry is None:
            return 0.0
        return self.failures_within(node, now, self.policy.lemon_window_s) / self._exposure_days(entry, now)

    def fleet_failure_rate(self, now: float) -> float:
        """All attributed failures over all observed node-days in the lemon window (the node itself included)."""
        days = sum(self._exposure_days(entry, now) for entry in self._nodes.values())
        if days == 0:
            return 0.0
        count = sum(self.failures_within(node, now, self.policy.lemon_window_s) for node in self._nodes)
        return count / days

    def lemons(self, now: float) -> set[str]:
        """Nodes with at least `lemon_min_failures` attributed failures in the lemon window and a failure rate
        at least `lemon_factor` times the fleet's."""
        fleet = self.fleet_failure_rate(now)
        if fleet == 0:
            return set()
        p = self.policy
        return {node for node in self._nodes
                if self.failures_within(node, now, p.lemon_window_s) >= p.lemon_min_failures
                and self.failure_rate(node, now) >= p.lemon_factor * fleet}

    def is_lemon(self, node: str, now: float) -> bool:
        p = self.policy
        if self.failures_within(node, now, p.lemon_window_s) < p.lemon_min_failures:
            return False
        fleet = self.fleet_failure_rate(now)
        return fleet > 0 and self.failure_rate(node, now) >= p.lemon_factor * fleet

    def eligibility(self, node: str, job_gpus: int, now: float) -> Status:
        """SUCCESS when a job of `job_gpus` GPUs may be placed on the node, else UNSCHEDULABLE with the reason.

        HEALTHY nodes take any job and PROBATION nodes small ones; large jobs (>= `large_job_gpus`) also
        avoid lemons. SUSPECT, QUARANTINED and REPAIRING nodes take nothing."""
        state = self.state(node)
        large = job_gpus >= self.policy.large_job_gpus
        if state is NodeHealth.PROBATION and not large:
            return Status.success()
        if state is NodeHealth.PROBATION:
            return Status.unschedulable(f"{node}: in probation, no jobs of {self.policy.large_job_gpus}+ GPUs",
                                        plugin=_PLUGIN)
        if state is not NodeHealth.HEALTHY:
            return Status.unschedulable(f"{node}: {state.value}", plugin=_PLUGIN)
        if large and self.is_lemon(node, now):
            return Status.unschedulable(f"{node}: lemon, no jobs of {self.policy.large_job_gpus}+ GPUs",
                                        plugin=_PLUGIN)
        return Status.success()

    def eligible(self, node: str, job_gpus: int, now: float) -> bool:
        return self.eligibility(node, job_gpus, now).ok


# -- stragglers ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Straggler:
    node: str
    slowdown: float
    """The node's median step time over the fleet's median (1.15 = 15 % slower)."""


def stragglers(step_times: Mapping[str, Sequence[float]], threshold: float = 1.10, *,
               last_k: int = 50) -> list[Straggler]:
    """Nodes whose step time is more than `threshold` × the fleet's, slowest first.

    Each node's step time is the median of its last `last_k` steps (one slow step, e.g. a checkpoint, does
    not count); the fleet's is the median of those node medians, so a minority of slow nodes cannot drag
    the reference up. A node is flagged when its median exceeds `threshold` × the fleet median (1.10:
    10 % slower; the reference suggests 5–10 %). Nodes without step times are ignored; with fewer than two
    nodes there is no fleet to compare with and nothing is flagged.

    This is one window's verdict: flag a node only after K consecutive windows, and confirm with an isolated
    benchmark before evicting it (STRAGGLER moves a node to SUSPECT; the check decides)."""
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold: must be a finite number > 0, got {threshold!r}")
    if last_k < 1:
        raise ValueError(f"last_k: must be >= 1, got {last_k!r}")
    medians = {node: statistics.median(times[-last_k:]) for node, times in step_times.items() if len(times)}
    if len(medians) < 2:
        return []
    fleet = statistics.median(medians.values())
    if not fleet > 0:
        return []
    slow = [Straggler(node, median / fleet) for node, median in medians.items() if median > threshold * fleet]
    return sorted(slow, key=lambda s: (-s.slowdown, s.node))


# -- the node-health controller: the book's states on the nodes ----------------------------------------------

QUARANTINE_TAINT = Taint("gpuplane.io/health", "quarantined", "NoSchedule")
"""On a node out of service (suspect under a hang, quarantined, repairing, lemon): no pod tolerates it, so the
scheduler places nothing there until the book lets it back."""
HEALTH_LABEL = "gpuplane.io/health"
"""The node's health as the cluster sees it: `suspect`, `quarantined`, `probation` or `lemon` (absent: healthy)."""

_OUT_OF_SERVICE = frozenset({NodeHealth.SUSPECT, NodeHealth.QUARANTINED, NodeHealth.REPAIRING})


class NodeHealthController:
    """Applies health events to the book and the result to the nodes, through the cluster port: a node the
    book quarantines gets `QUARANTINE_TAINT` and `HEALTH_LABEL=quarantined` (the cordon gpuplane's scheduler
    and kube-scheduler both honour); one that comes back loses both. The same object runs in the simulator and
    in the operator (fed there by the node agent's Events), so both take the same decisions on the same events.

    `isolations` lists (time, node, reason) of every node this controller quarantined, in order."""

    def __init__(self, port: ClusterPort, book: NodeHealthBook, now: Callable[[], float]) -> None:
        self.port = port
        self.book = book
        self.now = now
        self.isolations: list[tuple[float, str, str]] = []

    def apply(self, node: str, event: HealthEvent, reason: str = "") -> HealthResult:
        """One event for `node` (a check tier's verdict, an attributed failure): the book moves, and a node
        that changes state is relabelled: suspect, quarantined and repairing nodes are tainted (they take no
        job), probation keeps the taint (the repair cycle lifts it), healthy loses it."""
        before = self.book.state(node)
        result = self.book.apply(node, event, self.now(), reason)
        if not result.ok or result.state is before:
            return result
        if result.state in _OUT_OF_SERVICE:
            self.quarantine(node, reason, label=result.state.value)
        elif result.state is NodeHealth.PROBATION:
            self.label(node, NodeHealth.PROBATION.value)
        else:
            self.release(node)
        return result

    def isolate(self, node: str, reason: str) -> HealthResult:
        """Out of service at once (an isolate-node verdict, a critical check, a person's decision)."""
        result = self.book.apply(node, HealthEvent.CRITICAL_FAILURE, self.now(), reason)
        self.quarantine(node, reason)
        return result

    def quarantine(self, node: str, reason: str = "", label: str = "quarantined") -> Status:
        """Taint and label `node` (idempotent); recorded in `isolations` when `label` is `quarantined`."""
        info = next((n for n in self.port.list_nodes() if n.name == node), None)
        if info is None:
            return Status.error(f"node {node} not found")
        if label == "quarantined":
            self.isolations.append((self.now(), node, reason))
        taints = (*(t for t in info.spec.taints if t.key != QUARANTINE_TAINT.key), QUARANTINE_TAINT)
        return self.port.patch_node(node, taints=taints, labels={HEALTH_LABEL: label})

    def release(self, node: str, label: str | None = None) -> Status:
        """Take the taint off `node`; `label` what `HEALTH_LABEL` says afterwards (None: removed)."""
        info = next((n for n in self.port.list_nodes() if n.name == node), None)
        if info is None:
            return Status.error(f"node {node} not found")
        taints = tuple(t for t in info.spec.taints if t.key != QUARANTINE_TAINT.key)
        return self.port.patch_node(node, taints=taints, labels={HEALTH_LABEL: label})

    def label(self, node: str, label: str | None) -> Status:
        return self.port.patch_node(node, labels={HEALTH_LABEL: label})

    def rebuild(self) -> list[str]:
        """Register every node in the book in the state its `HEALTH_LABEL` says (a controller that starts, or
        a new leader, takes over what the nodes carry; a lemon's label reads as healthy, its failures being
        forgotten). Returns the nodes found out of healthy."""
        now = self.now()
        found = []
        for info in self.port.list_nodes():
            label = dict(info.spec.labels).get(HEALTH_LABEL)
            state = next((s for s in NodeHealth if s.value == label), NodeHealth.HEALTHY)
            self.book.register(info.name, now, state)
            if state is not NodeHealth.HEALTHY:
                found.append(info.name)
        return found
