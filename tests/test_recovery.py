"""Checkpoint intervals, the first-order ETTR model and the ETTR account (`gpuplane.controllers.recovery`) against the
fault-tolerance reference (shared/reference/fault-tolerance.md §1-2).

Symbols as in the reference: C = blocking checkpoint cost, τ = checkpoint interval, R = recovery time,
M = job MTBF = 86 400 s / (N_nodes × λ). First-order waste: ETTR ≈ 1 − C/τ − (τ/2 + R)/M. Young: τ* = √(2CM).
Daly: τ* = √(2CM)·[1 + ⅓√(C/2M) + (C/2M)/9] − C for C < 2M, else M.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.recovery import (
    DAY_S,
    CheckpointPlanner,
    EttrAccount,
    daly_interval,
    first_order_ettr,
    young_interval,
)

H = 3600.0
MIN = 60.0


def mtbf(nodes: int, rate_per_node_day: float) -> float:
    """M = 86 400 s / (N × λ)."""
    return DAY_S / (nodes * rate_per_node_day)


def first_order_ettr_pct(cost_s: float, interval_s: float, recovery_s: float, mtbf_s: float) -> float:
    """`first_order_ettr` with the job's MTBF M in place of its failures per day (86,400 / M), in per cent."""
    return 100.0 * first_order_ettr(cost_s, interval_s, recovery_s, DAY_S / mtbf_s)


# ------------------------------------------------------------------------------------------ Young and Daly
YOUNG_CASES = [
    # (C, M, τ*): √(2CM)
    pytest.param(30.0, 691_200.0, math.sqrt(41_472_000.0), id="C30-M192h"),  # 2·30·691 200 = 41 472 000 -> 6 439.9 s
    pytest.param(300.0, 34_560.0, math.sqrt(20_736_000.0), id="C300-M9.6h"),  # 2·300·34 560 -> 4 553.7 s = 75.9 min
    pytest.param(5.0, 691_200.0, math.sqrt(6_912_000.0), id="C5-M192h"),  # 2·5·691 200 -> 2 629.1 s = 43.8 min
    pytest.param(50.0, 10_000.0, 1_000.0, id="exact"),  # 2·50·10 000 = 10⁶
    pytest.param(0.0, 10_000.0, 0.0, id="free-checkpoints"),
]


@pytest.mark.parametrize(("cost", "m", "expected"), YOUNG_CASES)
def test_young(cost: float, m: float, expected: float) -> None:
    assert young_interval(cost, m) == pytest.approx(expected, rel=1e-12)


def test_young_worked_number() -> None:
    # C = 30 s, M = 192 h = 691 200 s: √(2·30·691 200) = √41 472 000 = 6 439.88 s = 107.3 min (the reference's row 3)
    assert young_interval(30.0, 192 * H) == pytest.approx(6_439.876, abs=1e-3)
    assert young_interval(30.0, 192 * H) / MIN == pytest.approx(107.3, abs=0.05)


DALY_CASES = [
    # (C, M, τ*)
    # C = 30, M = 691 200: x = C/2M = 30/1 382 400 = 2.170e-5, √x = 4.6585e-3
    # √(2CM)·(1 + 4.6585e-3/3 + 2.170e-5/9) − 30 = 6 439.876·1.0015552 − 30 = 6 449.891 − 30 = 6 419.891
    pytest.param(30.0, 691_200.0, 6_419.891, id="C30-M192h"),
    # C = 50, M = 10 000: x = 1/400, √x = 0.05; 1 000·(1 + 0.05/3 + 0.0025/9) − 50 = 1 000·1.016944 − 50 = 966.944
    pytest.param(50.0, 10_000.0, 1_000.0 * (1 + 0.05 / 3 + 0.0025 / 9) - 50.0, id="C50-M10000"),
    # C ≥ 2M: the interval is M
    pytest.param(100.0, 50.0, 50.0, id="C-equals-2M"),
    pytest.param(100.0, 40.0, 40.0, id="C-above-2M"),
    pytest.param(1e6, 1.0, 1.0, id="C-far-above-2M"),
    # just under 2M: x -> 1, √(2CM) -> 2M, so τ* -> 2M·(1 + 1/3 + 1/9) − 2M = 8M/9 (Daly's formula jumps to M at 2M)
    pytest.param(99.999_999, 50.0, 8 * 50.0 / 9, id="C-just-under-2M"),
]


@pytest.mark.parametrize(("cost", "m", "expected"), DALY_CASES)
def test_daly(cost: float, m: float, expected: float) -> None:
    assert daly_interval(cost, m) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(("cost", "m"), [(30.0, 691_200.0), (5.0, 691_200.0), (300.0, 34_560.0), (2.0, 5_000.0)])
def test_daly_is_young_less_two_thirds_of_the_cost_when_checkpoints_are_cheap(cost: float, m: float) -> None:
    # √(2CM)·⅓√(C/2M) = C/3, so Daly − Young = C/3 − C + √(2CM)·(C/2M)/9 = −2C/3 + O(C·√(C/M))
    young, daly = young_interval(cost, m), daly_interval(cost, m)
    assert daly < young
    assert young - daly == pytest.approx(2 * cost / 3, rel=0.02)


def test_daly_with_an_infinite_mtbf_is_infinite() -> None:
    assert daly_interval(30.0, math.inf) == math.inf
    assert young_interval(30.0, math.inf) == math.inf


REFERENCE_ROWS = [
    # (λ per node-day, nodes, R, C, τ or None for Young's, expected τ in minutes, expected ETTR %)
    # M = 86 400/(125·0.02) = 34 560 s = 9.6 h; 1 − 300/10 800 − (5 400 + 7 200)/34 560 = 1 − 0.0278 − 0.3646 = 60.8 %
    pytest.param(0.02, 125, 2 * H, 300.0, 3 * H, 180.0, 60.8, id="manual-3h"),
    # τ = √(2·300·34 560) = 4 553.7 s = 75.9 min; 1 − 0.0659 − (2 276.8 + 7 200)/34 560 = 1 − 0.0659 − 0.2742 = 66.0 %
    pytest.param(0.02, 125, 2 * H, 300.0, None, 75.9, 66.0, id="manual-young"),
    # M = 86 400/(125·0.001) = 691 200 s = 192 h; τ = 6 439.9 s = 107.3 min
    # 1 − 30/6 439.9 − (3 219.9 + 600)/691 200 = 1 − 0.00466 − 0.00553 = 99.0 %
    pytest.param(0.001, 125, 10 * MIN, 30.0, None, 107.3, 99.0, id="platform-C30"),
    # τ = √(2·5·691 200) = 2 629.1 s = 43.8 min
    # 1 − 5/2 629.1 − (1 314.5 + 600)/691 200 = 1 − 0.00190 − 0.00277 = 99.5 %
    pytest.param(0.001, 125, 10 * MIN, 5.0, None, 43.8, 99.5, id="platform-C5-async"),
]


@pytest.mark.parametrize(("rate", "nodes", "recovery", "cost", "interval", "minutes", "ettr"), REFERENCE_ROWS)
def test_the_reference_table_60_to_99(rate: float, nodes: int, recovery: float, cost: float, interval: float | None,
                                      minutes: float, ettr: float) -> None:
    m = mtbf(nodes, rate)
    tau = interval if interval is not None else young_interval(cost, m)
    assert tau / MIN == pytest.approx(minutes, abs=0.05)
    assert first_order_ettr_pct(cost, tau, recovery, m) == pytest.approx(ettr, abs=0.1)


def test_the_reference_mtbfs() -> None:
    assert mtbf(125, 0.02) == pytest.approx(9.6 * H)
    assert mtbf(125, 0.001) == pytest.approx(192 * H)


LLAMA_ROWS = [
    # M = 2.78 h = 10 008 s; (C, R, Young τ* min, ETTR %)
    # C = 5: τ = √(2·5·10 008) = 316.4 s = 5.3 min; 1 − 5/316.4 − (158.2 + 300)/10 008 = 1 − 0.0158 − 0.0458 = 93.8 %
    pytest.param(5.0, 300.0, 5.3, 93.8, id="C5-R5min"),
    pytest.param(5.0, 600.0, 5.3, 90.8, id="C5-R10min"),
    pytest.param(30.0, 600.0, 12.9, 86.3, id="C30-R10min"),
    pytest.param(60.0, 300.0, 18.3, 86.1, id="C60-R5min"),
    # τ = √(2·300·10 008) = 2 450.5 s = 40.8 min
    # 1 − 300/2 450.5 − (1 225.2 + 1 800)/10 008 = 1 − 0.1224 − 0.3023 = 57.5 %
    pytest.param(300.0, 1800.0, 40.8, 57.5, id="C300-R30min"),
]


@pytest.mark.parametrize(("cost", "recovery", "minutes", "ettr"), LLAMA_ROWS)
def test_the_reference_llama_table(cost: float, recovery: float, minutes: float, ettr: float) -> None:
    m = 2.78 * H
    tau = young_interval(cost, m)
    assert tau / MIN == pytest.approx(minutes, abs=0.05)
    assert first_order_ettr_pct(cost, tau, recovery, m) == pytest.approx(ettr, abs=0.1)


@pytest.mark.parametrize(("cost", "m"), [(300.0, 34_560.0), (30.0, 691_200.0), (5.0, 10_008.0)])
def test_young_minimises_the_first_order_waste(cost: float, m: float) -> None:
    # d/dτ (C/τ + τ/2M) = −C/τ² + 1/2M = 0 at τ = √(2CM): 10 % either side wastes more
    tau = young_interval(cost, m)
    best = first_order_ettr_pct(cost, tau, 0.0, m)
    assert first_order_ettr_pct(cost, tau * 0.9, 0.0, m) < best
    assert first_order_ettr_pct(cost, tau * 1.1, 0.0, m) < best


# ------------------------------------------------------------------------------------------ CheckpointPlanner
def test_planner_prior_only() -> None:
    # 128 nodes at the prior 0.001/node-day: M = 86 400/(128·0.001) = 675 000 s
    planner = CheckpointPlanner(nodes=128, prior_rate_per_node_day=0.001)
    assert planner.rate_per_node_day() == pytest.approx(0.001)  # (0 + 0.001·1 000)/(0 + 1 000)
    assert planner.mtbf_s() == pytest.approx(675_000.0)
    # Daly with the default cost of 2 s: √(2·2·675 000) = 1 643.2 s, less ~2C/3
    assert planner.interval_s(2.0) == pytest.approx(daly_interval(2.0, 675_000.0))
    assert planner.interval_s(2.0) == pytest.approx(1_643.17 - 4 / 3, abs=0.05)


def test_observed_failures_raise_the_rate_and_shorten_the_interval() -> None:
    planner = CheckpointPlanner(nodes=128, prior_rate_per_node_day=0.001)
    before = planner.interval_s(2.0)
    # 1 000 node-days with 9 failures on top of a prior worth 1 000 node-days at 0.001 (1 failure):
    # (9 + 1)/(1 000 + 1 000) = 0.005 per node-day; M = 86 400/(128·0.005) = 135 000 s
    planner.observed(1_000.0, 9)
    assert planner.rate_per_node_day() == pytest.approx(0.005)
    assert planner.mtbf_s() == pytest.approx(135_000.0)
    # Daly: √(2·2·135 000) = 734.85; x = 2/270 000; 734.85·(1 + √x/3 + x/9) − 2 = 733.52
    assert planner.interval_s(2.0) == pytest.approx(733.52, abs=0.01)
    assert planner.interval_s(2.0) < before / 2  # √5 shorter: 1 641.8 -> 733.5


def test_observed_time_without_failures_lowers_the_rate() -> None:
    planner = CheckpointPlanner(nodes=10, prior_rate_per_node_day=0.01, prior_node_days=100.0)
    # (0 + 0.01·100)/(300 + 100) = 1/400 = 0.0025
    planner.observed(100.0)
    planner.observed(200.0)
    assert (planner.node_days, planner.failures) == (300.0, 0)
    assert planner.rate_per_node_day() == pytest.approx(0.0025)
    assert planner.mtbf_s() == pytest.approx(86_400.0 / 0.025)


def test_a_zero_prior_and_no_failures_means_no_checkpoints() -> None:
    planner = CheckpointPlanner(nodes=8, prior_rate_per_node_day=0.0)
    assert planner.mtbf_s() == math.inf
    assert planner.interval_s(2.0) == math.inf
    planner.observed(1.0, 1)  # (1 + 0)/(1 + 1 000): now finite
    assert math.isfinite(planner.interval_s(2.0))


def test_measured_costs_move_the_cost_by_the_ewma_weight() -> None:
    planner = CheckpointPlanner(nodes=128, prior_rate_per_node_day=0.001)
    assert planner.cost_s is None
    planner.measured_cost(10.0)  # the first measurement is taken as is
    assert planner.cost_s == 10.0
    planner.measured_cost(20.0)  # 0.8·10 + 0.2·20 = 12
    assert planner.cost_s == pytest.approx(12.0)
    planner.measured_cost(20.0)  # 0.8·12 + 0.2·20 = 13.6
    assert planner.cost_s == pytest.approx(13.6)
    # the measured cost, not the default, sets the interval
    assert planner.interval_s(2.0) == pytest.approx(daly_interval(13.6, 675_000.0))


def test_the_cost_weight_is_a_parameter() -> None:
    planner = CheckpointPlanner(nodes=1, prior_rate_per_node_day=0.1, cost_weight=0.5)
    planner.measured_cost(4.0)
    planner.measured_cost(8.0)  # 0.5·4 + 0.5·8 = 6
    assert planner.cost_s == pytest.approx(6.0)


@pytest.mark.parametrize(("formula", "function"), [("young", young_interval), ("daly", daly_interval)])
def test_the_formula(formula: str, function: Callable[[float, float], float]) -> None:
    planner = CheckpointPlanner(nodes=125, prior_rate_per_node_day=0.001, formula=formula)
    # M = 691 200 s (the reference's 192 h); C = 30 s: Young 6 439.9 s, Daly 6 419.9 s
    assert planner.interval_s(30.0) == pytest.approx(function(30.0, 691_200.0))
    assert planner.interval_s(30.0) == pytest.approx(6_439.9 if formula == "young" else 6_419.9, abs=0.05)


# ------------------------------------------------------------------------------------------ EttrAccount
def sample_account() -> EttrAccount:
    return EttrAccount(productive_s=900.0, checkpoint_s=20.0, lost_s=30.0, detection_s=10.0, diagnosis_s=5.0,
                       reschedule_s=15.0, restart_s=8.0, checkpoint_load_s=7.0, manual_s=5.0, failures=2,
                       isolated_nodes=1)


def test_wall_is_the_sum_of_the_buckets() -> None:
    a = sample_account()
    # 900 + 20 + 30 + 10 + 5 + 15 + 8 + 7 + 5 = 1 000 (failures and isolated_nodes are counts, not seconds)
    assert a.wall_s == 1_000.0
    assert a.ettr == pytest.approx(0.9)


def test_an_empty_account() -> None:
    a = EttrAccount()
    assert (a.wall_s, a.ettr, a.failures, a.isolated_nodes) == (0.0, 1.0, 0, 0)
    assert all(v == 0.0 for v in a.shares_pct().values())


def test_add_sums_every_field() -> None:
    a, b = sample_account(), sample_account()
    b.productive_s, b.failures, b.isolated_nodes = 100.0, 3, 2
    a.add(b)
    assert (a.productive_s, a.checkpoint_s, a.manual_s, a.failures, a.isolated_nodes) == (1_000.0, 40.0, 10.0, 5, 3)
    assert a.wall_s == 1_000.0 + 200.0  # 1 000 + (100 + 100 of the rest)
    assert a.ettr == pytest.approx(1_000.0 / 1_200.0)


def test_shares_name_every_bucket_and_sum_to_100() -> None:
    shares = sample_account().shares_pct()
    assert list(shares) == ["productive", "checkpoint", "lost", "detection", "diagnosis", "reschedule", "restart",
                            "checkpoint_load", "manual"]
    assert shares["productive"] == pytest.approx(90.0)
    assert shares["lost"] == pytest.approx(3.0)
    assert sum(shares.values()) == pytest.approx(100.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e7, allow_nan=False), min_size=9, max_size=9).filter(
    lambda xs: sum(xs) > 0))
def test_shares_always_sum_to_100(values: list[float]) -> None:
    names = ["productive_s", "checkpoint_s", "lost_s", "detection_s", "diagnosis_s", "reschedule_s", "restart_s",
             "checkpoint_load_s", "manual_s"]
    buckets: dict[str, Any] = dict(zip(names, values, strict=True))
    a = EttrAccount(**buckets)
    assert a.wall_s == pytest.approx(sum(values))
    assert sum(a.shares_pct().values()) == pytest.approx(100.0)
    assert 0.0 <= a.ettr <= 1.0


# (C, τ, R, failures per day, ETTR): the edges of the closed form
@pytest.mark.parametrize(("cost", "tau", "recovery", "per_day", "ettr"), [
    (10.0, 1000.0, 0.0, 0.0, 0.99),         # no failures: only the saves, 10/1,000
    (0.0, 1000.0, 400.0, 86.4, 0.1),        # a failure every 1,000 s costing 500 + 400 s: 0.9 waste -> 0.1
    (0.0, 1000.0, 500.0, 86.4, 0.0),        # ... costing 1,000 s: nothing left
    (0.0, 1000.0, 5000.0, 86.4, 0.0),       # never below 0
    (10.0, 0.0, 0.0, 0.0, 0.0),             # saving continuously: nothing done
])
def test_first_order_ettr_edges(cost: float, tau: float, recovery: float, per_day: float, ettr: float) -> None:
    assert first_order_ettr(cost, tau, recovery, per_day) == pytest.approx(ettr)
