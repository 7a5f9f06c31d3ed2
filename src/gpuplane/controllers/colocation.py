"""Online-first arbitration of one shared card: when offline work is held back, resumed or evicted.

These are pure decisions over readings (time, whether online work is active, memory in bytes). The node
agent's guard (`gpuplane.node.guard`) and the co-location scenario (`gpuplane.sim.colocation`) both take
each pass's decisions from `CardPolicy.decide`, so the policy a simulation measures is the policy the guard
enforces.

- Online always wins: the moment online demand appears, offline work is suspended. Online work is never
  suspended.
- Offline resumes only once online has been idle for a minimum slice, so a stream of short online gaps
  does not make offline thrash between stopped and running.
- Memory guard: offline work is evicted when free card memory falls below a safety line that covers how
  fast online memory has been seen to grow over the guard's reaction horizon (sampling period plus the
  time an eviction takes to free memory).
- Admission: an offline container that starts while the guard runs may go on only if, after its footprint
  (its memory quota, else what it holds), that line plus a hysteresis stays free even when online returns
  to the peak it reached in the admission window. Otherwise it is held (stopped) until it fits, and
  evicted if it has not fitted within the admission timeout (the scheduler places it again).

A world that steps in minutes (the platform week) cannot run a pass every 20 ms per card. `CardPolicy.window`
is the same rules aggregated over a window, for many cards at once (numpy arrays in, arrays out): the share
of the window the slice arbiter leaves offline work running, the online busy time that runs beside it
before a suspension lands, the suspensions, and the memory guard's eviction and admission. The gate's share
is derived from the passes' rule (a pass reads online demand when online was busy more than
`online_sm_threshold_pct` of its poll; offline runs after `min_slice_s` rounded up to whole polls of idle
readings) for online requests arriving as a Poisson stream (exponential idle gaps): tests/test_colocation_window.py
checks it against `decide` run at 20 ms over random traces. Burstier arrivals leave longer idle gaps for the
same busy share, so there offline work gets at least the aggregate's share and online runs beside it less
than the aggregate says (the co-location scenario's arrivals, cv 1.5, checked in the same test file).
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

GIB = 1 << 30
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
ArrayLike = npt.ArrayLike


@dataclass(frozen=True, slots=True)
class GuardReaction:
    """How fast the node guard reacts: the defaults of `gpuplane.node.guard.GuardOptions`, kept here so that
    the co-location scenario models the guard that ships (sim may not import node)."""

    poll_s: float = 0.02
    """One pass (a reading of every card) this often. It was 50 ms: the co-location scenario measured that
    at 50 ms offline work gets under half the idle card time at the evening peak even with no slice;
    `gpuplane bench guard` measured passes as short as 10 ms reacting in 4-7 ms (median)."""
    min_slice_s: float = 0.0
    """Offline resumes after online has been idle this long, on top of the one whole idle poll a reading
    needs to show idle. It was 250 ms (one idle reading must not resume): the scenario measured that slice
    at 2.6 % of the idle time for offline work with a p99 gain of 0.1 %, against the few tenths of a
    percent of p99 resuming at once costs (docs/colocation.md)."""
    online_sm_threshold_pct: float = 5.0
    """An online process above this SM utilisation (over the driver's sample) is online demand."""
    kill_grace_s: float = 10.0
    """SIGKILL follows SIGTERM after this long (at once on online demand)."""


GUARD_REACTION = GuardReaction()


class OfflineState(enum.Enum):
    """Where one offline container on a shared card stands."""

    RUNNING = "running"
    SUSPENDED = "suspended"
    HELD = "held"
    """Started while starting would break the safety line: stopped until admission lets it go on."""
    EVICTING = "evicting"
    """Told to exit (SIGTERM); its memory is not free yet."""
    GONE = "gone"


class OfflineEvent(enum.Enum):
    ONLINE_DEMAND = "online-demand"
    ONLINE_IDLE = "online-idle"
    """Online has been idle for at least the minimum slice."""
    MEMORY_LOW = "memory-low"
    QUOTA_EXCEEDED = "quota-exceeded"
    EXITED = "exited"
    NOT_ADMITTED = "not-admitted"
    """A container seen starting whose footprint would break the safety line."""
    ADMITTED = "admitted"
    ADMISSION_TIMEOUT = "admission-timeout"


class OfflineAction(enum.Enum):
    SUSPEND = "suspend"
    RESUME = "resume"
    EVICT = "evict"
    FORGET = "forget"
    HOLD = "hold"
    """Stop a starting container (SIGSTOP) until it is admitted."""
    ADMIT = "admit"
    """A held container may go on: it stays stopped until the slice arbiter resumes it (no signal)."""


OFFLINE_TRANSITIONS: dict[tuple[OfflineState, OfflineEvent], tuple[OfflineState, OfflineAction]] = {
    (OfflineState.RUNNING, OfflineEvent.ONLINE_DEMAND): (OfflineState.SUSPENDED, OfflineAction.SUSPEND),
    (OfflineState.SUSPENDED, OfflineEvent.ONLINE_IDLE): (OfflineState.RUNNING, OfflineAction.RESUME),
    (OfflineState.RUNNING, OfflineEvent.MEMORY_LOW): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.SUSPENDED, OfflineEvent.MEMORY_LOW): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.RUNNING, OfflineEvent.QUOTA_EXCEEDED): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.SUSPENDED, OfflineEvent.QUOTA_EXCEEDED): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.RUNNING, OfflineEvent.EXITED): (OfflineState.GONE, OfflineAction.FORGET),
    (OfflineState.SUSPENDED, OfflineEvent.EXITED): (OfflineState.GONE, OfflineAction.FORGET),
    (OfflineState.EVICTING, OfflineEvent.EXITED): (OfflineState.GONE, OfflineAction.FORGET),
    (OfflineState.RUNNING, OfflineEvent.NOT_ADMITTED): (OfflineState.HELD, OfflineAction.HOLD),
    (OfflineState.HELD, OfflineEvent.ADMITTED): (OfflineState.SUSPENDED, OfflineAction.ADMIT),
    (OfflineState.HELD, OfflineEvent.ADMISSION_TIMEOUT): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.HELD, OfflineEvent.MEMORY_LOW): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.HELD, OfflineEvent.QUOTA_EXCEEDED): (OfflineState.EVICTING, OfflineAction.EVICT),
    (OfflineState.HELD, OfflineEvent.EXITED): (OfflineState.GONE, OfflineAction.FORGET),
}
"""(state, event) -> (next state, action). Pairs not listed change nothing (e.g. demand while suspended)."""


def offline_transition(state: OfflineState, event: OfflineEvent) -> tuple[OfflineState, OfflineAction | None]:
    """The next state and the action to take; `None` when the event changes nothing in this state."""
    step = OFFLINE_TRANSITIONS.get((state, event))
    return (state, None) if step is None else step


@dataclass(frozen=True, slots=True)
class GuardSettings:
    """Thresholds of the online-first policy on one card (times in seconds, memory in bytes)."""

    min_slice_s: float = 0.005
    """Offline resumes only after online has been idle this long."""
    memory_guard: bool = True
    safety_margin_bytes: int = 2 * GIB
    """Free memory always kept for online, on top of its expected growth."""
    growth_factor: float = 1.5
    """Multiplies the largest online growth seen over the reaction horizon."""
    min_growth_bytes: int = 2 * GIB
    """Growth assumed at least (before any has been seen, and as a floor)."""
    reaction_horizon_s: float = 0.6
    """Sampling period plus the time an evicted process takes to free its memory."""
    growth_window_s: float = 3600.0
    """How long a growth observation counts."""
    admit_hysteresis_bytes: int = 2 * GIB
    """Offline is admitted only with the safety line plus this much free after its footprint."""
    admit_window_s: float = 600.0
    """Admission assumes online may return to the peak it reached this long back."""
    admission: bool = True
    """Hold an offline container that starts while its footprint would break the safety line (with the
    memory guard only)."""
    admit_timeout_s: float = 600.0
    """A container held this long is evicted, so that the scheduler places it again."""

    def __post_init__(self) -> None:
        for name in ("min_slice_s", "reaction_horizon_s", "growth_window_s", "admit_window_s", "admit_timeout_s"):
            if not getattr(self, name) >= 0 or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number >= 0, got {getattr(self, name)!r}")
        for name in ("safety_margin_bytes", "min_growth_bytes", "admit_hysteresis_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if not self.growth_factor >= 0 or not math.isfinite(self.growth_factor):
            raise ValueError(f"growth_factor: must be a finite number >= 0, got {self.growth_factor!r}")


class SliceArbiter:
    """Per card: suspend offline when online demand appears, resume after a minimum idle slice."""

    def __init__(self, min_slice_s: float) -> None:
        self.min_slice_s = min_slice_s
        self.idle_since: float | None = 0.0

    def observe(self, now: float, online_active: bool) -> OfflineEvent | None:
        """The event this reading raises: ONLINE_DEMAND while online is active, ONLINE_IDLE once online
        has been idle for the minimum slice, otherwise nothing."""
        if online_active:
            self.idle_since = None
            return OfflineEvent.ONLINE_DEMAND
        if self.idle_since is None:
            self.idle_since = now
        return OfflineEvent.ONLINE_IDLE if now - self.idle_since >= self.min_slice_s else None


class MemoryGuard:
    """Per card: the free-memory safety line, learnt from how fast online memory grows.

    `observe` takes online memory readings; the line is `safety_margin + growth_factor × max(rise)`, where
    `rise` is the largest increase of online memory within any reaction horizon seen in the growth
    window (at least `min_growth_bytes`). Sliding min and max use monotonic queues: O(1) per reading."""

    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self._lows: deque[tuple[float, int]] = deque()
        self._rises: deque[tuple[float, int]] = deque()
        self._highs: deque[tuple[float, int]] = deque()
        self.online_bytes = 0

    def observe(self, now: float, online_bytes: int) -> None:
        horizon = self.settings.reaction_horizon_s
        lows = self._lows
        while lows and lows[-1][1] >= online_bytes:
            lows.pop()
        lows.append((now, online_bytes))
        while lows[0][0] < now - horizon:
            lows.popleft()
        rise = online_bytes - lows[0][1]
        rises = self._rises
        while rises and rises[-1][1] <= rise:
            rises.pop()
        rises.append((now, rise))
        while rises[0][0] < now - self.settings.growth_window_s:
            rises.popleft()
        highs = self._highs
        while highs and highs[-1][1] <= online_bytes:
            highs.pop()
        highs.append((now, online_bytes))
        while highs[0][0] < now - self.settings.admit_window_s:
            highs.popleft()
        self.online_bytes = online_bytes

    def recent_peak(self) -> int:
        """The most online memory seen in the admission window (bytes)."""
        return self._highs[0][1] if self._highs else self.online_bytes

    def expected_growth(self) -> int:
        seen = self._rises[0][1] if self._rises else 0
        return max(seen, self.settings.min_growth_bytes)

    def threshold(self) -> int:
        """Free memory below which offline work is evicted (bytes)."""
        s = self.settings
        return s.safety_margin_bytes + math.ceil(s.growth_factor * self.expected_growth())

    def should_evict(self, free_bytes: int) -> bool:
        return self.settings.memory_guard and free_bytes < self.threshold()

    def admissible_bytes(self, free_bytes: int) -> int:
        """The largest offline footprint that may start now (all of `free_bytes` with the guard off): what
        leaves the safety line and the hysteresis free even if online returns to its recent peak, so that
        a job admitted in a lull is not evicted at the next rise."""
        if not self.settings.memory_guard:
            return free_bytes
        back_to_peak = max(0, self.recent_peak() - self.online_bytes)
        return free_bytes - back_to_peak - self.threshold() - self.settings.admit_hysteresis_bytes

    def may_admit(self, free_bytes: int, footprint_bytes: int) -> bool:
        """Whether an offline footprint fits with the safety line and the hysteresis still free."""
        return footprint_bytes <= self.admissible_bytes(free_bytes)


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    name: str
    used_bytes: int
    started_at: float


def pick_eviction(candidates: Sequence[EvictionCandidate], shortfall_bytes: int) -> EvictionCandidate | None:
    """The offline container to evict: the smallest that alone frees the shortfall (the newest among
    equals, as it has done the least work), else the largest."""
    if not candidates:
        return None
    enough = [c for c in candidates if c.used_bytes >= shortfall_bytes]
    if enough:
        return min(enough, key=lambda c: (c.used_bytes, -c.started_at, c.name))
    return max(candidates, key=lambda c: (c.used_bytes, c.started_at, c.name))


@dataclass(frozen=True, slots=True)
class OfflineView:
    """One offline container on a card, as one pass reads it."""

    name: str
    state: OfflineState
    since: float
    """When it entered `state`."""
    first_seen: float
    alive: bool
    """It has processes left."""
    used_bytes: int
    """Card memory its processes hold."""
    used_known: bool = True
    """False when the driver does not report (all of) its memory."""
    quota_bytes: int | None = None
    starting: bool = False
    """First seen in this pass, started while the guard runs: admission applies."""


@dataclass(frozen=True, slots=True)
class Step:
    """An event for one offline container, in the order a pass applies them."""

    name: str
    event: OfflineEvent
    reason: str


@dataclass(frozen=True, slots=True)
class CardDecision:
    steps: tuple[Step, ...]
    """Exits, quota and admission-timeout evictions, a memory eviction, then admission."""
    gate: OfflineEvent | None
    """The slice arbiter's event, applied to every offline container after the steps (None: no change, or
    no gate read in this pass)."""
    threshold: int
    """The safety line (bytes of free memory)."""


@dataclass(frozen=True, slots=True)
class WindowOutcome:
    """What the guard's passes do over one window, per card (arrays of the cards' shape). Shares are of the
    window's length; expectations, not one draw."""

    offline_share: FloatArray
    """Share of the window the slice arbiter leaves offline work running (0 where no offline demand)."""
    active_share: FloatArray
    """Share of the passes that read online demand."""
    exposed_share: FloatArray
    """Share of the window online is busy while offline still runs (before the suspension's pass; the
    caller adds its drain): the online time slowed by co-running offline kernels."""
    suspensions: FloatArray
    """Expected suspensions (offline running, then a pass reads demand) in the window."""
    threshold_bytes: IntArray
    """The memory guard's safety line (free bytes)."""
    evict: BoolArray
    """The memory guard evicts offline work in the window (the least free memory is below the line)."""
    shortfall_bytes: IntArray
    """What the eviction must free (0 where none): `pick_eviction` takes it."""
    admissible_bytes: IntArray
    """The largest offline footprint admission lets start now (`MemoryGuard.admissible_bytes`)."""


class CardPolicy:
    """The online-first policy of one card, one pass at a time: what the node guard decides from its readings
    (and the co-location scenario replays). `decide` feeds the memory guard and the slice arbiter and walks
    the offline containers through the transition table; the caller acts on the steps (signals on a node)."""

    def __init__(self, settings: GuardSettings, *, evictions: bool = True) -> None:
        self.settings = settings
        self.evictions = evictions
        """False: the safety line is kept for admission only (plain sharing with no guard acting after)."""
        self.arbiter = SliceArbiter(settings.min_slice_s)
        self.memory = MemoryGuard(settings)

    def retune(self, settings: GuardSettings) -> None:
        """New thresholds; what the arbiter and the memory guard have seen is kept."""
        self.settings = settings
        self.arbiter.min_slice_s = settings.min_slice_s
        self.memory.settings = settings

    def window(self, online_busy_share: ArrayLike, *, online_request_s: ArrayLike, offline_demand: ArrayLike,
               free_bytes: ArrayLike, offline_bytes: ArrayLike, online_rise_bytes: ArrayLike = 0,
               online_to_peak_bytes: ArrayLike = 0, window_s: float = 60.0,
               reaction: GuardReaction = GUARD_REACTION) -> WindowOutcome:
        """`decide`'s passes every `reaction.poll_s` over a window of `window_s`, aggregated, for many cards at
        once (pure: reads only the thresholds, never the arbiter's or the memory guard's state).

        Per card: `online_busy_share` u, the share of the window online kernels run; `online_request_s` S, the
        mean GPU time of one online request (arrivals Poisson at λ = u / S); `offline_demand`, whether offline
        work is there to run; `free_bytes`, the least free card memory in the window; `offline_bytes`, what
        offline work holds; `online_rise_bytes`, the largest online rise within the reaction horizon seen in
        the growth window (the memory guard's `rise`); `online_to_peak_bytes`, how far online may climb back
        to its peak of the admission window.

        The gate, from the passes' rule. A pass reads idle when online ran at most θ = threshold × poll of its
        poll p; offline runs after a pass that ends n = ceil(min_slice / p) + 1 idle readings in a row.
        With exponential idle gaps (rate λ), n polls read idle with probability
        G = (1 − u) · exp(−λ (n p − θ)) · (1 + λ θ): idle from the start (1 − u) with no arrival before the
        last θ (an arrival there runs at most θ in the poll), plus a busy poll start whose busy period ends
        within θ (probability ≈ λ θ (1 − u) to first order). Each further poll stays idle with exp(−λ p),
        so a pass suspends with G (1 − exp(−λ p)). In an open poll that starts idle, online is busy
        u (p − S (1 − exp(−p / S))) (the alternating process relaxes to u at rate λ + (1 − u) / S = 1 / S);
        after an open poll that ends in a sliver (share q = λθ / (1 + λθ) of them) the next poll starts busy
        and stays busy B (1 − exp(−p / B)), B = S / (1 − u) the mean busy period.

        The memory guard, as `decide` reads it: the line is `MemoryGuard.threshold` at that rise; the guard
        evicts where offline work holds memory and the least free is below the line. The passes compare each
        reading with the line at the rise seen so far, so the aggregate evicts whenever they do, and also
        when the window's least free memory came before its largest rise."""
        s = self.settings
        u = np.clip(np.asarray(online_busy_share, dtype=np.float64), 0.0, 1.0)
        req = np.broadcast_to(np.asarray(online_request_s, dtype=np.float64), u.shape)
        if np.any(req <= 0):
            raise ValueError("online_request_s: must be > 0")
        demand = np.broadcast_to(np.asarray(offline_demand, dtype=np.bool_), u.shape)
        p = reaction.poll_s
        theta = reaction.online_sm_threshold_pct / 100.0 * p
        polls = math.ceil(s.min_slice_s / p - 1e-9) + 1
        busy = u < 1.0
        lam = u / req
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            idle = np.where(busy, (1.0 - u) * np.exp(-lam * (polls * p - theta)) * (1.0 + lam * theta), 0.0)
            idle = np.clip(idle, 0.0, 1.0)
            stays = np.exp(-lam * p)
            period = np.where(busy, req / np.where(busy, 1.0 - u, 1.0), np.inf)
            sliver = lam * theta / (1.0 + lam * theta)
            from_idle = u * (p - req * (1.0 - np.exp(-p / req)))
            from_busy = np.where(busy, period * (1.0 - np.exp(-p / period)), p)
            exposed = idle * ((1.0 - sliver) * from_idle + sliver * from_busy) / p
        offline_share = np.where(demand, idle, 0.0)
        active = 1.0 - np.where(busy, np.clip((1.0 - u) * np.exp(-lam * (p - theta)) * (1.0 + lam * theta),
                                              0.0, 1.0), 0.0)
        suspensions = np.where(demand, window_s / p * idle * (1.0 - stays), 0.0)

        free = np.broadcast_to(np.asarray(free_bytes, dtype=np.int64), u.shape)
        held = np.broadcast_to(np.asarray(offline_bytes, dtype=np.int64), u.shape)
        rise = np.maximum(np.broadcast_to(np.asarray(online_rise_bytes, dtype=np.int64), u.shape),
                          s.min_growth_bytes)
        threshold = s.safety_margin_bytes + np.ceil(s.growth_factor * rise).astype(np.int64)
        evict = (free < threshold) & (held > 0) if self.evictions and s.memory_guard else np.zeros(u.shape, bool)
        to_peak = np.maximum(0, np.broadcast_to(np.asarray(online_to_peak_bytes, dtype=np.int64), u.shape))
        admissible = (free - to_peak - threshold - s.admit_hysteresis_bytes) if s.memory_guard else free.copy()
        return WindowOutcome(offline_share, active, np.where(demand, exposed, 0.0), suspensions, threshold,
                             evict, np.where(evict, threshold - free, 0).astype(np.int64),
                             np.asarray(admissible, dtype=np.int64))

    def decide(self, now: float, online_active: bool | None, online_bytes: int, free_bytes: int,
               offline: Sequence[OfflineView]) -> CardDecision:
        """One pass: `online_active` None when the pass reads no online demand (a gate acting elsewhere)."""
        s = self.settings
        memory = self.memory
        memory.observe(now, online_bytes)
        threshold = memory.threshold()
        states = {v.name: v.state for v in offline}
        steps: list[Step] = []

        def step(view: OfflineView, event: OfflineEvent, reason: str) -> None:
            state, action = offline_transition(states[view.name], event)
            if action is not None:
                states[view.name] = state
                steps.append(Step(view.name, event, reason))

        for view in offline:
            quota = view.quota_bytes
            if not view.alive:
                step(view, OfflineEvent.EXITED, "all its processes have exited")
            elif view.state is OfflineState.EVICTING:
                continue
            elif quota is not None and view.used_bytes > quota:
                step(view, OfflineEvent.QUOTA_EXCEEDED, f"quota: uses {view.used_bytes} B > quota {quota} B")
            elif view.state is OfflineState.HELD and now - view.since >= s.admit_timeout_s:
                step(view, OfflineEvent.ADMISSION_TIMEOUT,
                     f"admission: held {now - view.since:g} s, longer than {s.admit_timeout_s:g} s")

        if self.evictions and memory.should_evict(free_bytes):
            pending = sum(v.used_bytes for v in offline if states[v.name] is OfflineState.EVICTING and v.alive)
            shortfall = threshold - free_bytes - pending
            live = (OfflineState.RUNNING, OfflineState.SUSPENDED, OfflineState.HELD)
            candidates = [EvictionCandidate(v.name, v.used_bytes, v.first_seen) for v in offline
                          if states[v.name] in live and v.alive and (v.used_bytes > 0 or not v.used_known)]
            chosen = pick_eviction(candidates, shortfall) if shortfall > 0 else None
            if chosen is not None:
                view = next(v for v in offline if v.name == chosen.name)
                step(view, OfflineEvent.MEMORY_LOW, f"memory: free {free_bytes} B < threshold {threshold} B")

        if s.admission and s.memory_guard:
            self._admit(offline, states, free_bytes, step)

        gate = self.arbiter.observe(now, online_active) if online_active is not None else None
        return CardDecision(tuple(steps), gate, threshold)

    def _admit(self, offline: Sequence[OfflineView], states: dict[str, OfflineState], free_bytes: int,
               step: Callable[[OfflineView, OfflineEvent, str], None]) -> None:
        """Starting and held containers, oldest first: each goes on if what it will still take (its quota, else
        what it holds, less what it holds) fits in what may start now, after the growth the others have left."""
        def still_to_take(view: OfflineView) -> int:
            footprint = view.quota_bytes if view.quota_bytes is not None else view.used_bytes
            return max(0, footprint - view.used_bytes)

        def waits(view: OfflineView) -> bool:
            state = states[view.name]
            return view.alive and (state is OfflineState.HELD or (view.starting and state is OfflineState.RUNNING))

        waiting = sorted(filter(waits, offline), key=lambda v: (v.first_seen, v.name))
        if not waiting:
            return
        going = (OfflineState.RUNNING, OfflineState.SUSPENDED)
        room = self.memory.admissible_bytes(free_bytes) - sum(
            still_to_take(v) for v in offline if states[v.name] in going and v.alive and not v.starting)
        for view in waiting:
            need = still_to_take(view)
            if need <= room:
                room -= need
                if states[view.name] is OfflineState.HELD:
                    step(view, OfflineEvent.ADMITTED, f"admission: takes {need} B, {room + need} B may start")
            elif states[view.name] is OfflineState.RUNNING:
                step(view, OfflineEvent.NOT_ADMITTED, f"admission: would take {need} B, {max(room, 0)} B may start")
