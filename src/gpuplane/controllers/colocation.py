"""Online-first arbitration of one shared card: when offline work is held back, resumed or evicted.

These are pure decisions over readings (time, whether online work is active, memory in bytes). The
simulated card model (`gpuplane.sim.colocation`) and the node agent's guard (`gpuplane.node.guard`) both
act on them, so the policy a simulation measures is the policy the guard enforces.

- Online always wins: the moment online demand appears, offline work is suspended. Online work is never
  suspended.
- Offline resumes only once online has been idle for a minimum slice, so a stream of short online gaps
  does not make offline thrash between stopped and running.
- Memory guard: offline work is evicted when free card memory falls below a safety line that covers how
  fast online memory has been seen to grow over the guard's reaction horizon (sampling period plus the
  time an eviction takes to free memory). Offline is admitted only if, after its footprint, that line plus
  a hysteresis stays free even when online returns to the peak it reached in the admission window.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

GIB = 1 << 30


class OfflineState(enum.Enum):
    """Where one offline container on a shared card stands."""

    RUNNING = "running"
    SUSPENDED = "suspended"
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


class OfflineAction(enum.Enum):
    SUSPEND = "suspend"
    RESUME = "resume"
    EVICT = "evict"
    FORGET = "forget"


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

    def __post_init__(self) -> None:
        for name in ("min_slice_s", "reaction_horizon_s", "growth_window_s", "admit_window_s"):
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
