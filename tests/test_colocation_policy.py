"""The online-first arbitration of one shared card (`gpuplane.controllers.colocation`): the offline state
machine, the slice arbiter, the memory guard's safety line and admission, the eviction choice, and the
pass that puts them together (`CardPolicy.decide`, what the node guard and the scenario both run).

All pure: readings in, decisions out. Memory is in whole GiB (`G`) so that the arithmetic in the comments is
exact; times are binary fractions (0.25, 0.5, ...) so that float comparisons at the boundaries are exact.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplane.controllers.colocation import (
    GIB,
    OFFLINE_TRANSITIONS,
    CardPolicy,
    EvictionCandidate,
    GuardSettings,
    MemoryGuard,
    OfflineAction,
    OfflineEvent,
    OfflineState,
    OfflineView,
    SliceArbiter,
    Step,
    offline_transition,
    pick_eviction,
)

G = GIB
S, E, A = OfflineState, OfflineEvent, OfflineAction

# ------------------------------------------------------------------------------------- the transition table
EXPECTED_TRANSITIONS: dict[tuple[OfflineState, OfflineEvent], tuple[OfflineState, OfflineAction]] = {
    # online always wins: demand suspends a running job at once
    (S.RUNNING, E.ONLINE_DEMAND): (S.SUSPENDED, A.SUSPEND),
    # a suspended job resumes only once online has been idle for the minimum slice
    (S.SUSPENDED, E.ONLINE_IDLE): (S.RUNNING, A.RESUME),
    # memory low or over quota: evicted, whether running or suspended (a suspended job keeps its memory)
    (S.RUNNING, E.MEMORY_LOW): (S.EVICTING, A.EVICT),
    (S.SUSPENDED, E.MEMORY_LOW): (S.EVICTING, A.EVICT),
    (S.RUNNING, E.QUOTA_EXCEEDED): (S.EVICTING, A.EVICT),
    (S.SUSPENDED, E.QUOTA_EXCEEDED): (S.EVICTING, A.EVICT),
    # exit from any live state: forgotten
    (S.RUNNING, E.EXITED): (S.GONE, A.FORGET),
    (S.SUSPENDED, E.EXITED): (S.GONE, A.FORGET),
    (S.EVICTING, E.EXITED): (S.GONE, A.FORGET),
    # admission: a starting job that would break the safety line is held (stopped) ...
    (S.RUNNING, E.NOT_ADMITTED): (S.HELD, A.HOLD),
    # ... and, once it fits, waits stopped like a suspended job for the slice arbiter to let it run
    (S.HELD, E.ADMITTED): (S.SUSPENDED, A.ADMIT),
    # held too long, low memory or over quota: evicted; exit: forgotten
    (S.HELD, E.ADMISSION_TIMEOUT): (S.EVICTING, A.EVICT),
    (S.HELD, E.MEMORY_LOW): (S.EVICTING, A.EVICT),
    (S.HELD, E.QUOTA_EXCEEDED): (S.EVICTING, A.EVICT),
    (S.HELD, E.EXITED): (S.GONE, A.FORGET),
}
"""The table written out by hand from the policy's rules (not copied from the module)."""


def test_the_transition_table_is_exactly_the_policy() -> None:
    assert dict(OFFLINE_TRANSITIONS) == EXPECTED_TRANSITIONS


@pytest.mark.parametrize(("state", "event", "expected"),
                         [(s, e, step) for (s, e), step in EXPECTED_TRANSITIONS.items()],
                         ids=[f"{s.value}+{e.value}" for s, e in EXPECTED_TRANSITIONS])
def test_listed_transitions(state: OfflineState, event: OfflineEvent,
                            expected: tuple[OfflineState, OfflineAction]) -> None:
    assert offline_transition(state, event) == expected


UNLISTED = [(s, e) for s, e in itertools.product(OfflineState, OfflineEvent) if (s, e) not in EXPECTED_TRANSITIONS]


def test_the_unlisted_pairs_include_the_ones_that_matter() -> None:
    # 5 states x 8 events = 40 pairs, 15 listed, 25 change nothing
    assert len(UNLISTED) == 40 - 15
    for pair in [(S.HELD, E.ONLINE_IDLE),  # a held job never resumes before it is admitted
                 (S.HELD, E.ONLINE_DEMAND),
                 (S.SUSPENDED, E.NOT_ADMITTED),  # admission is for starting jobs only
                 (S.SUSPENDED, E.ONLINE_DEMAND),  # already suspended: demand again changes nothing
                 (S.RUNNING, E.ONLINE_IDLE),  # already running
                 (S.EVICTING, E.MEMORY_LOW),  # already told to exit: no second SIGTERM
                 (S.EVICTING, E.ONLINE_IDLE),  # an evicting job never resumes
                 (S.GONE, E.ONLINE_IDLE), (S.GONE, E.EXITED)]:
        assert pair in UNLISTED


@pytest.mark.parametrize(("state", "event"), UNLISTED, ids=[f"{s.value}+{e.value}" for s, e in UNLISTED])
def test_unlisted_pairs_change_nothing(state: OfflineState, event: OfflineEvent) -> None:
    assert offline_transition(state, event) == (state, None)


# ------------------------------------------------------------------------------------------ slice arbiter
ArbiterStep = tuple[float, bool, OfflineEvent | None]

ARBITER_CASES: dict[str, tuple[float, list[ArbiterStep]]] = {
    # idle from the start (idle_since = 0): 0.25 - 0 >= 0.25
    "idle-from-start": (0.25, [(0.125, False, None), (0.25, False, E.ONLINE_IDLE)]),
    "demand-then-short-idle-then-slice": (0.25, [
        (10.0, True, E.ONLINE_DEMAND),
        (10.5, False, None),  # idle since 10.5: 0 s idle
        (10.625, False, None),  # 0.125 s < 0.25
        (10.75, False, E.ONLINE_IDLE),  # 0.25 s: the boundary counts (>=)
        (11.0, False, E.ONLINE_IDLE),  # and stays idle
    ]),
    "demand-resets-the-idle-clock": (0.25, [
        (10.0, True, E.ONLINE_DEMAND),
        (10.5, False, None),  # idle since 10.5
        (10.625, True, E.ONLINE_DEMAND),  # demand again
        (10.75, False, None),  # idle since 10.75 (not 10.5, which would give 0.25 s here)
        (10.875, False, None),  # 0.125 s
        (11.0, False, E.ONLINE_IDLE),  # 0.25 s since 10.75
    ]),
    "demand-after-idle-is-demand": (0.25, [
        (1.0, False, E.ONLINE_IDLE), (1.5, True, E.ONLINE_DEMAND), (1.5, True, E.ONLINE_DEMAND),
    ]),
    "zero-slice-resumes-at-once": (0.0, [(5.0, True, E.ONLINE_DEMAND), (5.0, False, E.ONLINE_IDLE)]),
}


@pytest.mark.parametrize("case", list(ARBITER_CASES))
def test_slice_arbiter(case: str) -> None:
    min_slice, steps = ARBITER_CASES[case]
    arbiter = SliceArbiter(min_slice)
    got = [arbiter.observe(now, active) for now, active, _ in steps]
    assert got == [expected for _, _, expected in steps]


# ------------------------------------------------------------------------------------------- memory guard
DEFAULTS = GuardSettings()
"""margin 2 GiB, factor 1.5, min growth 2 GiB, horizon 0.6 s, growth window 3600 s, hysteresis 2 GiB,
admission window 600 s."""


def guard_after(readings: list[tuple[float, int]], **fields: Any) -> MemoryGuard:
    guard = MemoryGuard(GuardSettings(**fields))
    for now, online in readings:
        guard.observe(now, online)
    return guard


THRESHOLD_CASES: list[Any] = [
    # no reading yet: margin + 1.5 x min growth = 2 + 1.5 x 2 = 5 GiB
    pytest.param([], {}, 5 * G, id="no-readings"),
    # flat online memory: the rise is 0 < min growth: still 5 GiB
    pytest.param([(0.0, 20 * G), (0.5, 20 * G)], {}, 5 * G, id="flat"),
    # a fall is no growth
    pytest.param([(0.0, 30 * G), (0.5, 20 * G)], {}, 5 * G, id="fall"),
    # +6 GiB within 0.5 s <= 0.6 s: 2 + 1.5 x 6 = 11 GiB
    pytest.param([(0.0, 20 * G), (0.5, 26 * G)], {}, 11 * G, id="rise-within-horizon"),
    # +6 GiB over exactly the horizon (0.6 - 0.6 = 0: the reading at 0 is still in it): 11 GiB
    pytest.param([(0.0, 20 * G), (0.6, 26 * G)], {}, 11 * G, id="rise-over-exactly-the-horizon"),
    # +6 GiB over 0.75 s > 0.6 s: no single horizon saw it, 5 GiB
    pytest.param([(0.0, 20 * G), (0.75, 26 * G)], {}, 5 * G, id="rise-slower-than-the-horizon"),
    # a staircase +1 GiB per 0.25 s: within 0.6 s at most 2 steps (0 -> 0.5): +2 GiB = min growth, 5 GiB
    pytest.param([(0.25 * i, (20 + i) * G) for i in range(9)], {}, 5 * G, id="staircase"),
    # the same staircase with a 1 s horizon: 4 steps (0 -> 1.0): +4 GiB: 2 + 6 = 8 GiB
    pytest.param([(0.25 * i, (20 + i) * G) for i in range(9)], {"reaction_horizon_s": 1.0}, 8 * G,
                 id="staircase-long-horizon"),
    # the largest rise counts, not the latest: +8 then +3 (and a dip in between): 2 + 12 = 14 GiB
    pytest.param([(0.0, 20 * G), (0.5, 28 * G), (10.0, 10 * G), (10.5, 13 * G)], {}, 14 * G, id="largest-rise"),
    # other settings: margin 1, factor 2, min growth 0: 1 + 2 x 3 = 7 GiB
    pytest.param([(0.0, 20 * G), (0.25, 23 * G)],
                 {"safety_margin_bytes": G, "growth_factor": 2.0, "min_growth_bytes": 0}, 7 * G, id="other-settings"),
    # factor 1.5 on an odd byte count rounds up: 2 GiB + ceil(1.5 x (3 GiB + 1)) = 2 + 4.5 GiB + 2 bytes
    pytest.param([(0.0, 0), (0.5, 3 * G + 1)], {}, 2 * G + 4 * G + G // 2 + 2, id="rounds-up"),
]


@pytest.mark.parametrize(("readings", "fields", "threshold"), THRESHOLD_CASES)
def test_threshold(readings: list[tuple[float, int]], fields: dict[str, Any], threshold: int) -> None:
    assert guard_after(readings, **fields).threshold() == threshold


def test_rises_expire_after_the_growth_window() -> None:
    # +6 GiB at 0.5 s: 11 GiB; it counts while 0.5 >= now - 3600, i.e. up to now = 3600.5
    guard = guard_after([(0.0, 20 * G), (0.5, 26 * G)])
    assert guard.threshold() == 11 * G
    guard.observe(1800.0, 26 * G)
    assert guard.threshold() == 11 * G
    guard.observe(3600.5, 26 * G)  # the boundary: still counted
    assert guard.threshold() == 11 * G
    guard.observe(3601.0, 26 * G)  # 0.5 < 3601 - 3600: expired, back to 2 + 1.5 x 2
    assert guard.threshold() == 5 * G
    assert guard.expected_growth() == 2 * G


def test_a_smaller_later_rise_outlives_a_larger_expired_one() -> None:
    guard = guard_after([(0.0, 20 * G), (0.5, 28 * G)], growth_window_s=100.0)  # +8: 2 + 12 = 14
    guard.observe(50.0, 25 * G)
    guard.observe(50.5, 28 * G)  # +3
    assert guard.threshold() == 14 * G
    guard.observe(120.0, 28 * G)  # the +8 at 0.5 s expired (0.5 < 20), the +3 at 50.5 s not: 2 + 1.5 x 3 = 6.5
    assert guard.threshold() == 2 * G + 4 * G + G // 2


@pytest.mark.parametrize(("free", "evict"), [
    (11 * G + 1, False), (11 * G, False),  # free == threshold: kept (evict only below the line)
    (11 * G - 1, True), (0, True),
])
def test_should_evict_below_the_line_only(free: int, evict: bool) -> None:
    guard = guard_after([(0.0, 20 * G), (0.5, 26 * G)])  # threshold 11 GiB (above)
    assert guard.should_evict(free) is evict


def test_without_the_guard_nothing_is_evicted_and_whatever_fits_is_admitted() -> None:
    guard = guard_after([(0.0, 20 * G), (0.5, 60 * G), (1.0, 30 * G)], memory_guard=False)
    for free in (0, G, 11 * G, 100 * G):
        assert not guard.should_evict(free)
        assert guard.admissible_bytes(free) == free
        assert guard.may_admit(free, free)
        assert not guard.may_admit(free, free + 1)


def test_admission_leaves_the_line_and_the_hysteresis() -> None:
    guard = guard_after([(10.0, 20 * G)])
    # threshold 5 GiB, hysteresis 2, no peak above now: 60 - 5 - 2 = 53 GiB
    assert guard.admissible_bytes(60 * G) == 53 * G
    assert guard.may_admit(60 * G, 53 * G)
    assert not guard.may_admit(60 * G, 53 * G + 1)
    # too little free: negative room, nothing admitted
    assert guard.admissible_bytes(6 * G) == -G
    assert not guard.may_admit(6 * G, 0)


def test_a_lull_after_a_peak_admits_less_until_the_peak_expires() -> None:
    # peak 30 GiB at 0 s, lull 20 GiB at 10 s: a fall, so no rise: threshold 5 GiB
    guard = guard_after([(0.0, 30 * G), (10.0, 20 * G)])
    assert guard.threshold() == 5 * G
    assert guard.recent_peak() == 30 * G
    # online may come back to 30: 60 - (30 - 20) - 5 - 2 = 43 GiB, 10 less than without the peak (53)
    assert guard.admissible_bytes(60 * G) == 43 * G
    assert guard_after([(10.0, 20 * G)]).admissible_bytes(60 * G) == 53 * G
    guard.observe(600.0, 20 * G)  # the peak at 0 still counts: 0 >= 600 - 600
    assert guard.admissible_bytes(60 * G) == 43 * G
    guard.observe(601.0, 20 * G)  # 0 < 601 - 600: expired
    assert guard.recent_peak() == 20 * G
    assert guard.admissible_bytes(60 * G) == 53 * G


def test_a_shorter_admission_window_forgets_the_peak_sooner() -> None:
    guard = guard_after([(0.0, 30 * G), (10.0, 20 * G), (61.0, 20 * G)], admit_window_s=60.0)
    assert guard.recent_peak() == 20 * G  # 0 < 61 - 60
    assert guard.admissible_bytes(60 * G) == 53 * G


# ----------------------------------------------------------------------- the guard against a brute force
@dataclass(frozen=True)
class Naive:
    """O(n^2) reference for the guard after readings `times`/`online`."""

    settings: GuardSettings
    times: list[float]
    online: list[int]

    def rise_at(self, j: int) -> int:
        """The largest increase ending at reading j within the reaction horizon (the reading itself: 0)."""
        h = self.settings.reaction_horizon_s
        return max(self.online[j] - self.online[i] for i in range(j + 1) if self.times[i] >= self.times[j] - h)

    def threshold(self) -> int:
        s, now = self.settings, self.times[-1]
        seen = max(self.rise_at(j) for j in range(len(self.times)) if self.times[j] >= now - s.growth_window_s)
        return s.safety_margin_bytes + math.ceil(s.growth_factor * max(seen, s.min_growth_bytes))

    def recent_peak(self) -> int:
        now = self.times[-1]
        return max(b for t, b in zip(self.times, self.online, strict=True)
                   if t >= now - self.settings.admit_window_s)


guard_settings = st.builds(
    GuardSettings,
    safety_margin_bytes=st.sampled_from([0, G, 2 * G]),
    growth_factor=st.sampled_from([0.0, 1.0, 1.5, 2.5]),
    min_growth_bytes=st.sampled_from([0, G // 2, 2 * G]),
    reaction_horizon_s=st.sampled_from([0.0, 0.5, 0.6, 2.0]),
    growth_window_s=st.sampled_from([1.0, 5.0, 3600.0]),
    admit_window_s=st.sampled_from([0.0, 2.0, 600.0]),
)
readings = st.lists(st.tuples(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 3.0]),
                              st.integers(0, 80 * G)), min_size=1, max_size=40)
"""(time step, online bytes): a step of 0 is two readings at the same time."""


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(guard_settings, readings)
def test_guard_matches_a_naive_recomputation(s: GuardSettings, steps: list[tuple[float, int]]) -> None:
    guard = MemoryGuard(s)
    times: list[float] = []
    online: list[int] = []
    now = 0.0
    floor = s.safety_margin_bytes + math.ceil(s.growth_factor * s.min_growth_bytes)
    for step, value in steps:
        now += step
        guard.observe(now, value)
        times.append(now)
        online.append(value)
        naive = Naive(s, times, online)
        assert guard.threshold() >= floor
        assert guard.threshold() == naive.threshold()
        assert guard.recent_peak() == naive.recent_peak()
        assert guard.online_bytes == value


# ---------------------------------------------------------------------------------------- eviction choice
def c(name: str, gib: int, started: float) -> EvictionCandidate:
    return EvictionCandidate(name, gib * G, started)


FOUR = [c("a", 10, 1.0), c("b", 20, 2.0), c("c", 20, 5.0), c("d", 30, 3.0)]

EVICTION_CASES: list[Any] = [
    pytest.param(FOUR, 5, "a", id="smallest-that-covers"),
    pytest.param(FOUR, 10, "a", id="exactly-covers"),
    pytest.param(FOUR, 0, "a", id="no-shortfall-smallest"),
    # 20 GiB covers 15; b and c both hold 20: c started later (5 > 2), it has done the least work
    pytest.param(FOUR, 15, "c", id="newest-among-equals"),
    pytest.param(FOUR, 21, "d", id="only-the-largest-covers"),
    # nothing alone frees 40 GiB: the largest, d (30)
    pytest.param(FOUR, 40, "d", id="none-covers-largest"),
    # none covers and the largest are equal: the newest of them
    pytest.param([c("x", 5, 1.0), c("y", 5, 2.0), c("z", 1, 9.0)], 10, "y", id="none-covers-newest-largest"),
    pytest.param([c("only", 1, 0.0)], 50, "only", id="single"),
    pytest.param([], 1, None, id="empty"),
    pytest.param([], 0, None, id="empty-no-shortfall"),
]


@pytest.mark.parametrize(("candidates", "shortfall_gib", "expected"), EVICTION_CASES)
def test_pick_eviction(candidates: list[EvictionCandidate], shortfall_gib: int, expected: str | None) -> None:
    picked = pick_eviction(candidates, shortfall_gib * G)
    assert (picked.name if picked is not None else None) == expected


def test_pick_eviction_does_not_depend_on_the_order() -> None:
    for order in itertools.permutations(FOUR):
        picked = pick_eviction(order, 15 * G)
        assert picked is not None and picked.name == "c"


# ----------------------------------------------------------------------------------- settings validation
@pytest.mark.parametrize(("field", "value"), [
    ("min_slice_s", -0.001), ("min_slice_s", math.inf), ("reaction_horizon_s", math.nan),
    ("growth_window_s", -1.0), ("admit_window_s", math.inf),
    ("safety_margin_bytes", -1), ("min_growth_bytes", -G), ("admit_hysteresis_bytes", -1),
    ("growth_factor", -0.5), ("growth_factor", math.inf), ("growth_factor", math.nan),
])
def test_guard_settings_errors_name_the_field(field: str, value: float) -> None:
    fields: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=rf"^{field}: must be"):
        GuardSettings(**fields)


def test_guard_settings_accept_zeros() -> None:
    zero = GuardSettings(min_slice_s=0.0, safety_margin_bytes=0, growth_factor=0.0, min_growth_bytes=0,
                         reaction_horizon_s=0.0, growth_window_s=0.0, admit_hysteresis_bytes=0, admit_window_s=0.0)
    guard = MemoryGuard(zero)
    guard.observe(0.0, 10 * G)
    assert guard.threshold() == 0  # nothing kept free
    assert guard.admissible_bytes(7 * G) == 7 * G
    assert not guard.should_evict(0)


# ------------------------------------------------------------------------------- one pass: CardPolicy
def view(name: str, state: OfflineState = S.RUNNING, used: int = 0, *, quota: int | None = None,
         since: float = 0.0, first_seen: float = 0.0, alive: bool = True, known: bool = True,
         starting: bool = False) -> OfflineView:
    return OfflineView(name, state, since, first_seen, alive, used * G, known,
                       None if quota is None else quota * G, starting)


DecideCase = tuple[list[OfflineView], int, bool | None, list[tuple[str, OfflineEvent]], OfflineEvent | None]

# One pass at t = 10 s on a policy that has seen online at 20 GiB only: threshold 5 GiB (2 + 1.5 x 2),
# admission room = free - 5 - 2 (hysteresis). (views, free GiB, online active, steps, gate)
DECIDE_CASES: dict[str, DecideCase] = {
    "idle-and-room-nothing-to-do": ([view("a", used=10)], 40, False, [], E.ONLINE_IDLE),
    "demand-is-the-gate-not-a-step": ([view("a", used=10)], 40, True, [], E.ONLINE_DEMAND),
    "no-gate-read": ([view("a", used=10)], 40, None, [], None),
    "exited-is-forgotten": ([view("a", used=10, alive=False)], 40, None, [("a", E.EXITED)], None),
    # quota 8 GiB, uses 10: evicted for quota
    "over-quota": ([view("a", used=10, quota=8)], 40, None, [("a", E.QUOTA_EXCEEDED)], None),
    # free 4 < 5: shortfall 1 GiB; b (3 GiB) is the smallest that covers it
    "memory-low-picks-the-smallest-that-covers": (
        [view("a", used=10), view("b", S.SUSPENDED, used=3)], 4, None, [("b", E.MEMORY_LOW)], None),
    # shortfall 5 - 4 - 3 (already being evicted) < 0: nothing more
    "pending-eviction-counts-as-freed": (
        [view("a", used=10), view("b", S.EVICTING, used=3)], 4, None, [], None),
    # a starting job quota 30 GiB, holds 0: room 40 - 5 - 2 = 33 >= 30: goes on, no step
    "a-start-that-fits": ([view("n", quota=30, starting=True)], 40, None, [], None),
    # room 33 < 34: held
    "a-start-that-does-not-fit-is-held": (
        [view("n", quota=34, starting=True)], 40, None, [("n", E.NOT_ADMITTED)], None),
    # a running job with quota 20 holds 10: 10 more may come; room 33 - 10 = 23 < 30: held
    "the-others-growth-counts": (
        [view("a", used=10, quota=20), view("n", quota=30, starting=True, first_seen=5.0)], 40, None,
        [("n", E.NOT_ADMITTED)], None),
    # held since 9 s (1 s), quota 30 <= room 33: admitted, and the gate (idle) comes after
    "held-then-fits": ([view("h", S.HELD, quota=30, since=9.0)], 40, False, [("h", E.ADMITTED)], E.ONLINE_IDLE),
    # oldest first: o (first seen 1) takes 20 of 33, n (first seen 2) needs 20 > 13: held
    "oldest-first": ([view("n", quota=20, starting=True, first_seen=2.0),
                      view("o", S.HELD, quota=20, first_seen=1.0, since=9.0)], 40, None,
                     [("o", E.ADMITTED), ("n", E.NOT_ADMITTED)], None),
    # held since -600: 610 s >= the 600 s timeout: evicted
    "held-too-long": ([view("h", S.HELD, quota=60, since=-600.0)], 40, None, [("h", E.ADMISSION_TIMEOUT)], None),
}


@pytest.mark.parametrize("case", list(DECIDE_CASES))
def test_one_pass(case: str) -> None:
    views, free_gib, active, steps, gate = DECIDE_CASES[case]
    policy = CardPolicy(GuardSettings(min_slice_s=0.0))
    policy.memory.observe(0.0, 20 * G)
    decision = policy.decide(10.0, active, 20 * G, free_gib * G, views)
    assert [(step.name, step.event) for step in decision.steps] == steps
    assert decision.gate is gate
    assert decision.threshold == 5 * G


def test_without_evictions_the_line_still_admits() -> None:
    # plain sharing: no eviction however low memory is, but a start that would break the line is held
    policy = CardPolicy(GuardSettings(), evictions=False)
    decision = policy.decide(0.0, None, 20 * G, 3 * G, [view("a", used=10), view("n", quota=1, starting=True)])
    assert decision.steps == (Step("n", E.NOT_ADMITTED, "admission: would take 1073741824 B, 0 B may start"),)


@pytest.mark.parametrize("fields", [{"admission": False}, {"memory_guard": False}])
def test_admission_off_admits_everything(fields: dict[str, Any]) -> None:
    policy = CardPolicy(GuardSettings(**fields))
    decision = policy.decide(0.0, None, 20 * G, 3 * G, [view("n", quota=70, starting=True)])
    assert not [s for s in decision.steps if s.event is E.NOT_ADMITTED]
