"""Node health: the transition table row by row, the exclusion policy, lemons, eligibility, stragglers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.health import (
    DAY_S,
    HEALTH_TRANSITIONS,
    HealthEvent,
    HealthPolicy,
    HealthRecord,
    NodeHealth,
    NodeHealthBook,
    Straggler,
    stragglers,
)
from gpuplane.port.status import Code

H, S, Q, R, P = (NodeHealth.HEALTHY, NodeHealth.SUSPECT, NodeHealth.QUARANTINED, NodeHealth.REPAIRING,
                 NodeHealth.PROBATION)
E = HealthEvent

# -- the table ----------------------------------------------------------------------------------------------

LEGAL = sorted(HEALTH_TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
ILLEGAL = [(s, e) for s, e in itertools.product(NodeHealth, HealthEvent) if (s, e) not in HEALTH_TRANSITIONS]


def test_the_table_is_the_documented_lifecycle() -> None:
    # the main path: healthy -> suspect -> quarantined -> repairing -> probation -> healthy
    assert HEALTH_TRANSITIONS[(H, E.FAILURE_ATTRIBUTED)] is S
    assert HEALTH_TRANSITIONS[(S, E.CHECK_FAILED)] is Q
    assert HEALTH_TRANSITIONS[(Q, E.REPAIR_STARTED)] is R
    assert HEALTH_TRANSITIONS[(R, E.REPAIR_DONE)] is P
    assert HEALTH_TRANSITIONS[(P, E.PROBATION_PASSED)] is H
    # and the side roads
    assert HEALTH_TRANSITIONS[(S, E.CHECK_PASSED)] is H
    assert HEALTH_TRANSITIONS[(H, E.CRITICAL_FAILURE)] is Q
    assert HEALTH_TRANSITIONS[(P, E.PROBATION_FAILED)] is Q
    assert HEALTH_TRANSITIONS[(P, E.FAILURE_ATTRIBUTED)] is Q
    # every state is reachable and can be left
    assert {to for to in HEALTH_TRANSITIONS.values()} == set(NodeHealth)
    assert all(any(s is state and to is not state for (s, _), to in HEALTH_TRANSITIONS.items()) for state in NodeHealth)


@pytest.mark.parametrize(("pair", "target"), LEGAL, ids=[f"{s.value}+{e.value}" for (s, e), _ in LEGAL])
def test_every_legal_row_moves_and_records(pair: tuple[NodeHealth, HealthEvent], target: NodeHealth) -> None:
    state, event = pair
    policy = HealthPolicy()
    book = NodeHealthBook(policy)
    book.register("n1", 0.0, state)
    now = policy.probation_s  # probation (if any) is just over
    result = book.apply("n1", event, now, "why")
    assert result.ok and result.code is Code.SUCCESS and result.reasons == ()
    assert result.state is target is book.state("n1")
    # a fresh node has one failure at most, below the limit of 2: one record only
    assert result.records == (HealthRecord(now, "n1", state, event, target, "why"),)
    assert book.history == list(result.records) == book.history_of("n1")


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=[f"{s.value}+{e.value}" for s, e in ILLEGAL])
def test_every_other_pair_is_refused_with_a_reason(state: NodeHealth, event: HealthEvent) -> None:
    book = NodeHealthBook()
    book.register("n1", 0.0, state)
    result = book.apply("n1", event, 10 * DAY_S)
    assert not result.ok and result.code is Code.ERROR
    assert result.message == f"n1: {event.value} is not legal in state {state.value}"
    assert result.state is state is book.state("n1")
    assert result.records == () and book.history == []
    assert book.failures_within("n1", 10 * DAY_S) == 0  # a refused failure does not count either


def test_an_unknown_node_is_healthy_and_registered_by_its_first_accepted_event() -> None:
    book = NodeHealthBook()
    assert book.state("ghost") is H and book.entered_at("ghost") is None
    assert not book.apply("ghost", E.REPAIR_DONE, 5.0).ok
    assert book.states() == {}
    assert book.apply("ghost", E.CHECK_FAILED, 5.0).state is S
    assert book.states() == {"ghost": S} and book.entered_at("ghost") == 5.0


# -- exclusion policy (§8.4: 2 attributed failures in 7 days, or 1 critical) -------------------------------


def test_two_failures_within_seven_days_quarantine() -> None:
    book = NodeHealthBook(nodes=["n1"])
    assert book.apply("n1", E.FAILURE_ATTRIBUTED, 0.0, "job 1 Xid 13 x3").state is S
    assert book.apply("n1", E.CHECK_PASSED, 1 * DAY_S, "dcgm r2 clean").state is H
    # day 6: the second failure within 7 days -> suspect, then the limit quarantines it (two records)
    result = book.apply("n1", E.FAILURE_ATTRIBUTED, 6 * DAY_S, "job 2 NCCL timeout")
    assert result.ok and result.state is Q
    assert [(r.from_state, r.event, r.to_state) for r in result.records] == [
        (H, E.FAILURE_ATTRIBUTED, S), (S, E.FAILURE_LIMIT_REACHED, Q)]
    assert result.records[1].reason == "exclusion policy: 2 attributed failures within 7 d (limit 2)"
    assert book.failures_within("n1", 6 * DAY_S) == 2


def test_two_failures_eight_days_apart_do_not() -> None:
    book = NodeHealthBook(nodes=["n1"])
    book.apply("n1", E.FAILURE_ATTRIBUTED, 0.0)
    book.apply("n1", E.CHECK_PASSED, 1 * DAY_S)
    # day 8: the first failure is 8 days old, outside the window: 1 failure within 7 days
    result = book.apply("n1", E.FAILURE_ATTRIBUTED, 8 * DAY_S)
    assert result.state is S and len(result.records) == 1
    assert book.failures_within("n1", 8 * DAY_S) == 1


def test_the_window_includes_its_edge_and_a_suspect_still_counts() -> None:
    book = NodeHealthBook()
    book.apply("n1", E.FAILURE_ATTRIBUTED, 0.0)
    # still SUSPECT (no check ran); exactly 7 days later: 7 d <= 7 d -> within
    assert book.apply("n1", E.FAILURE_ATTRIBUTED, 7 * DAY_S).state is Q


def test_the_limit_is_a_policy() -> None:
    book = NodeHealthBook(HealthPolicy(max_failures=3, window_s=2 * DAY_S))
    for day, expected in ((0, S), (1, S), (2, Q)):  # 3 failures within 2 days
        assert book.apply("n1", E.FAILURE_ATTRIBUTED, day * DAY_S).state is expected


def test_a_critical_failure_quarantines_at_once() -> None:
    book = NodeHealthBook(nodes=["n1"])
    result = book.apply("n1", E.CRITICAL_FAILURE, 3.0, "Xid 79: fallen off the bus")
    assert result.state is Q and len(result.records) == 1
    assert book.failures_within("n1", 3.0) == 1
    assert HealthPolicy().is_critical_xid(79) and not HealthPolicy().is_critical_xid(13)


def test_the_repair_road_and_a_probation_that_must_be_served() -> None:
    policy = HealthPolicy(probation_s=3 * DAY_S)
    book = NodeHealthBook(policy, ["n1"])
    book.apply("n1", E.CRITICAL_FAILURE, 0.0, "Xid 48")
    book.apply("n1", E.REPAIR_STARTED, 1 * DAY_S, "GPU reset, then RMA")
    assert book.apply("n1", E.CHECK_FAILED, 2 * DAY_S, "burn-in failed").state is Q  # back to quarantine
    book.apply("n1", E.REPAIR_STARTED, 3 * DAY_S)
    book.apply("n1", E.CHECK_PASSED, 4 * DAY_S, "dcgm r3")
    assert book.apply("n1", E.REPAIR_DONE, 4 * DAY_S, "dcgm r4 + burn-in clean").state is P
    # probation started on day 4 and lasts 3 days: on day 6.5 it is too early (0.5 d left)
    early = book.apply("n1", E.PROBATION_PASSED, 6.5 * DAY_S)
    assert early.code is Code.WAIT and early.state is P and early.records == ()
    assert early.message == "n1: probation ends at t=604800 (0.50 d left)"
    assert not book.probation_over("n1", 6.5 * DAY_S) and book.probation_over("n1", 7 * DAY_S)
    assert book.apply("n1", E.PROBATION_PASSED, 7 * DAY_S).state is H
    assert [r.to_state for r in book.history_of("n1")] == [Q, R, Q, R, R, P, H]


def test_a_failure_in_probation_quarantines_and_bad_nodes_stay_bad() -> None:
    book = NodeHealthBook(HealthPolicy(probation_s=1 * DAY_S))
    book.apply("n1", E.FAILURE_ATTRIBUTED, 0.0)
    book.apply("n1", E.CHECK_FAILED, 0.1 * DAY_S)
    book.apply("n1", E.REPAIR_STARTED, 0.2 * DAY_S)
    book.apply("n1", E.REPAIR_DONE, 1 * DAY_S)
    assert book.apply("n1", E.FAILURE_ATTRIBUTED, 1.5 * DAY_S).state is Q
    # the repair did not clear the record: two attributed failures within 7 days
    assert book.failures_within("n1", 1.5 * DAY_S) == 2
    assert book.in_state(Q) == ["n1"]


# -- lemons ---------------------------------------------------------------------------------------------------


def lemon_fleet(policy: HealthPolicy | None = None) -> NodeHealthBook:
    """10 nodes seen since day 0; n0 fails on days 1, 10, 19, n2 on days 5, 14, n1 on day 3."""
    book = NodeHealthBook(policy, nodes=[f"n{i}" for i in range(10)], now=0.0)
    for node, days in (("n0", (1, 10, 19)), ("n2", (5, 14)), ("n1", (3,))):
        for day in days:
            assert book.apply(node, E.FAILURE_ATTRIBUTED, day * DAY_S).ok
    return book


def test_lemons_fail_far_more_often_than_the_fleet() -> None:
    book = lemon_fleet()
    now = 30 * DAY_S
    # fleet: 6 failures over 10 nodes x 30 days = 0.02 per node-day
    assert book.fleet_failure_rate(now) == pytest.approx(0.02)
    # n0: 3 / 30 = 0.1 = 5.0x the fleet (>= 5, and 3 >= 2 failures) -> lemon
    # n2: 2 / 30 = 0.0667 = 3.3x -> not; n1: 1 failure < 2 -> not
    assert book.failure_rate("n0", now) == pytest.approx(0.1)
    assert book.lemons(now) == {"n0"}
    assert book.is_lemon("n0", now) and not book.is_lemon("n2", now) and not book.is_lemon("n1", now)


def test_lemon_evidence_ages_out_of_the_window() -> None:
    book = lemon_fleet()
    # day 45: the 30-day window holds n0's day-19 failure and n2's day-14 one only: nobody has 2
    assert book.lemons(45 * DAY_S) == set()


def test_a_stricter_policy_and_an_empty_fleet() -> None:
    assert lemon_fleet(HealthPolicy(lemon_factor=6.0)).lemons(30 * DAY_S) == set()  # n0 is 5.0x
    assert lemon_fleet(HealthPolicy(lemon_factor=3.0)).lemons(30 * DAY_S) == {"n0", "n2"}  # n2 is 3.3x
    assert lemon_fleet(HealthPolicy(lemon_min_failures=4)).lemons(30 * DAY_S) == set()
    assert NodeHealthBook().lemons(0.0) == set()
    assert NodeHealthBook(nodes=["a", "b"]).lemons(30 * DAY_S) == set()  # no failures: fleet rate 0


def test_a_new_node_counts_at_least_one_node_day() -> None:
    book = NodeHealthBook(nodes=[f"n{i}" for i in range(20)], now=0.0)
    book.register("new", 30 * DAY_S - 3600)  # seen for an hour
    book.apply("new", E.FAILURE_ATTRIBUTED, 30 * DAY_S - 60)
    # 1 failure / max(1 h, 1 d) = 1 per node-day, not 24
    assert book.failure_rate("new", 30 * DAY_S) == pytest.approx(1.0)


# -- eligibility -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("node", "job_gpus", "eligible", "why"), [
    ("ok", 512, True, ""),
    ("ok", 8, True, ""),
    ("lemon", 8, True, ""),  # lemons still take small jobs
    ("lemon", 256, False, "lemon: lemon, no jobs of 256+ GPUs"),  # 256 >= large_job_gpus
    ("lemon", 255, True, ""),
    ("probation", 8, True, ""),
    ("probation", 256, False, "probation: in probation, no jobs of 256+ GPUs"),
    ("suspect", 8, False, "suspect: suspect"),
    ("quarantined", 8, False, "quarantined: quarantined"),
    ("repairing", 8, False, "repairing: repairing"),
])
def test_eligibility(node: str, job_gpus: int, eligible: bool, why: str) -> None:
    book = NodeHealthBook(nodes=[f"n{i}" for i in range(20)] + ["ok", "lemon"], now=0.0)
    for day in (1, 10, 19):  # 3 failures, never 2 within 7 days: stays healthy after each check
        book.apply("lemon", E.FAILURE_ATTRIBUTED, day * DAY_S)
        book.apply("lemon", E.CHECK_PASSED, (day + 0.5) * DAY_S)
    for name, state in (("probation", P), ("suspect", S), ("quarantined", Q), ("repairing", R)):
        book.register(name, 0.0, state)
    now = 30 * DAY_S
    assert book.lemons(now) == {"lemon"}
    assert book.eligible(node, job_gpus, now) is eligible
    status = book.eligibility(node, job_gpus, now)
    assert status.message == why and status.code is (Code.SUCCESS if eligible else Code.UNSCHEDULABLE)


# -- stragglers ----------------------------------------------------------------------------------------------

FLEET = {f"n{i}": [1.0] * 20 for i in range(4)}


@pytest.mark.parametrize(("slow_times", "slowdown"), [
    ([1.15] * 20, 1.15),  # 15 % slower: flagged
    ([1.05] * 20, None),  # 5 % slower: within 1.10
    ([1.10] * 20, None),  # exactly at the threshold: not above it
    ([1.0] * 19 + [5.0], None),  # one slow step (a checkpoint): the median ignores it
    ([1.5] * 50 + [1.0] * 50, None),  # slow long ago, fine over the last 50 steps
    ([1.0] * 50 + [1.2] * 50, 1.2),  # slow over the last 50 steps
    ([], None),  # no step times: ignored
])
def test_stragglers(slow_times: list[float], slowdown: float | None) -> None:
    found = stragglers({**FLEET, "slow": slow_times})
    if slowdown is None:
        assert found == []
    else:
        assert found == [Straggler("slow", found[0].slowdown)] and found[0].slowdown == pytest.approx(slowdown)


def test_the_fleet_median_resists_several_slow_nodes_and_the_slowest_come_first() -> None:
    # medians: 1.0 x4, 1.3, 1.2 -> fleet median 1.0 (of 6 values: (1.0 + 1.0) / 2)
    times = {**FLEET, "b": [1.3] * 5, "a": [1.2] * 5}
    found = stragglers(times)
    assert [s.node for s in found] == ["b", "a"] and [s.slowdown for s in found] == pytest.approx([1.3, 1.2])
    assert [s.node for s in stragglers(times, threshold=1.25)] == ["b"]
    assert stragglers(times, last_k=1) == stragglers(times)


def test_no_fleet_no_stragglers_and_bad_arguments() -> None:
    assert stragglers({"only": [5.0]}) == []
    assert stragglers({"a": [], "b": [1.0]}) == []
    assert stragglers({"a": [0.0], "b": [0.0], "c": [1.0]}) == []  # fleet median 0: nothing to compare with
    with pytest.raises(ValueError, match="threshold"):
        stragglers(FLEET, threshold=0.0)
    with pytest.raises(ValueError, match="last_k"):
        stragglers(FLEET, last_k=0)


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="max_failures"):
        HealthPolicy(max_failures=0)
    with pytest.raises(ValueError, match="window_s"):
        HealthPolicy(window_s=float("inf"))
    with pytest.raises(ValueError, match="probation_s"):
        HealthPolicy(probation_s=-1.0)


# -- properties ----------------------------------------------------------------------------------------------

steps = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(list(HealthEvent)),
                           st.floats(min_value=0.0, max_value=4 * DAY_S, allow_nan=False)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_any_sequence_keeps_valid_states_and_a_legal_history(sequence: list[tuple[str, HealthEvent, float]]) -> None:
    book = NodeHealthBook(HealthPolicy(probation_s=2 * DAY_S))
    now = 0.0
    for node, event, dt in sequence:
        now += dt
        before_state, before_len = book.state(node), len(book.history)
        result = book.apply(node, event, now)
        assert result.state in NodeHealth and result.state is book.state(node)
        new = book.history[before_len:]
        if not result.ok:
            assert result.reasons and new == [] and result.state is before_state
            continue
        assert new == list(result.records) and 1 <= len(new) <= 2
        state = before_state
        for record in new:
            assert (record.node, record.t, record.from_state) == (node, now, state)
            assert HEALTH_TRANSITIONS[(record.from_state, record.event)] is record.to_state
            state = record.to_state
        assert state is result.state
    # replaying each node's history from HEALTHY follows the table to its current state
    for node in ("a", "b"):
        state = H
        for record in book.history_of(node):
            assert record.from_state is state
            state = HEALTH_TRANSITIONS[(state, record.event)]
        assert state is book.state(node)
