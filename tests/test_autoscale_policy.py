"""The autoscaling decisions (`gpuplane.controllers.autoscale`) against Kubernetes' and KEDA's documented
behaviour: the HPA's replica formulas and tolerance, its scaling behaviour (policies, stabilisation windows,
`selectPolicy`, min/max), KEDA's 0 <-> 1 activation, the ScaledObject's validation and the GPU scaler's
reading policy (last good value, fallback, activity).

All pure: readings in, decisions out. Times are multiples of 0.5 s so that the window arithmetic in the
comments is exact; the boundaries Kubernetes draws (`timestamp.After(now - period)`: an event exactly one
period old no longer counts) are tested on the exact boundary.

References: shared/reference/tidal-colocation-autoscale.md §2.2 (KEDA's scale executor) and §3 (the HPA);
kubernetes/kubernetes `pkg/controller/podautoscaler/{horizontal,replica_calculator}.go`.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gpuplane.controllers.autoscale import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    Hpa,
    HpaSpec,
    KedaActivation,
    PolicyKind,
    ReadingSource,
    RiseReserve,
    ScaledObjectScaler,
    ScaledObjectSpec,
    ScalerPolicy,
    ScalerReport,
    ScalingPolicy,
    ScalingRules,
    SelectPolicy,
    ValuePerRequest,
    average_value_replicas,
    utilization_replicas,
)
from gpuplane.model import GpuplaneError

PODS, PERCENT = PolicyKind.PODS, PolicyKind.PERCENT
METRIC, LAST_GOOD, FALLBACK = ReadingSource.METRIC, ReadingSource.LAST_GOOD, ReadingSource.FALLBACK


def rules(window_s: float, *policies: tuple[PolicyKind, int, float],
          select: SelectPolicy = SelectPolicy.MAX) -> ScalingRules:
    return ScalingRules(stabilization_window_s=window_s, select_policy=select,
                        policies=tuple(ScalingPolicy(type=t, value=v, period_s=p) for t, v, p in policies))


def drive(spec: HpaSpec, start: int, steps: list[tuple[float, int]]) -> list[int]:
    """Feed (time, raw recommendation) pairs to one HPA; each result is the next step's current count."""
    hpa = Hpa(spec)
    current, out = start, []
    for now, desired in steps:
        current = hpa.step(now, current, desired)
        out.append(current)
    return out


# ------------------------------------------------------------------------------------ the defaults
def test_the_defaults_are_kubernetes() -> None:
    """§3: up Pods 4 / Percent 100 per 15 s, no window, Max; down Percent 100 per 15 s, 300 s window, Max;
    minReplicas 1, tolerance 0.1. KEDA's HPA: maxReplicaCount 100."""
    assert rules(0, (PODS, 4, 15), (PERCENT, 100, 15)) == DEFAULT_SCALE_UP
    assert rules(300, (PERCENT, 100, 15)) == DEFAULT_SCALE_DOWN
    spec = HpaSpec()
    assert (spec.min_replicas, spec.max_replicas, spec.tolerance) == (1, 100, 0.1)
    assert spec.scale_up.select_policy is SelectPolicy.MAX and spec.scale_down.select_policy is SelectPolicy.MAX


# ----------------------------------------------------------------------------- average_value_replicas
AVERAGE_VALUE_CASES: list[Any] = [
    # (total, target, current, tolerance, expected)
    pytest.param(350.0, 70.0, 1, 0.1, 5, id="ceil-350/70=5"),
    # independent of the current count: the same total gives 5 from 1, 3 or 10 replicas (ratios 5, 1.67, 0.5)
    pytest.param(350.0, 70.0, 3, 0.1, 5, id="same-from-3"),
    pytest.param(350.0, 70.0, 10, 0.1, 5, id="same-from-10"),
    pytest.param(351.0, 70.0, 3, 0.1, 6, id="ceil-5.01=6"),
    pytest.param(0.0, 70.0, 4, 0.1, 0, id="no-load-0"),  # the HPA's minReplicas clamps later
    pytest.param(25.0, 10.0, 0, 0.1, 3, id="from-zero-no-tolerance"),  # ceil(2.5); no ratio at 0 replicas
    # within the tolerance: |1 - 105 / (10 x 10)| = 0.05 <= 0.1: keep 10 although ceil(10.5) = 11
    pytest.param(105.0, 10.0, 10, 0.1, 10, id="ratio-1.05-keeps"),
    pytest.param(100.0, 10.0, 10, 0.1, 10, id="ratio-1-keeps"),
    pytest.param(111.0, 10.0, 10, 0.1, 12, id="ratio-1.11-scales"),  # 0.11 > 0.1: ceil(11.1) = 12
    pytest.param(90.0, 10.0, 10, 0.1, 10, id="ratio-0.9-keeps"),  # 1 - 0.9 = 0.0999.. <= 0.1
    pytest.param(89.0, 10.0, 10, 0.1, 9, id="ratio-0.89-scales"),  # ceil(8.9) = 9
    pytest.param(95.0, 10.0, 10, 0.04, 10, id="ratio-0.95-tolerance-0.04"),  # 0.05 > 0.04: ceil(9.5) = 10
    pytest.param(101.0, 10.0, 10, 0.0, 11, id="tolerance-0"),  # ceil(10.1) = 11
    pytest.param(150.0, 10.0, 10, 0.5, 10, id="tolerance-0.5"),  # |1 - 1.5| = 0.5 <= 0.5
    # float noise must not add a replica: 2.1 / 0.7 = 3.0000000000000004 in binary floating point
    pytest.param(2.1, 0.7, 1, 0.1, 3, id="float-noise"),
]


@pytest.mark.parametrize(("total", "target", "current", "tolerance", "expected"), AVERAGE_VALUE_CASES)
def test_average_value_replicas(total: float, target: float, current: int, tolerance: float,
                                expected: int) -> None:
    assert average_value_replicas(total, target, current, tolerance) == expected


RATIO_EXACTLY_1_1: list[Any] = [
    # (total, target, current): total / (target x current) == 1.1 as a float
    pytest.param(11.0, 10.0, 1, id="11/(10x1)"),
    pytest.param(110.0, 10.0, 10, id="110/(10x10)"),
    pytest.param(77.0, 70.0, 1, id="77/(70x1)"),
]


@pytest.mark.parametrize(("total", "target", "current"), RATIO_EXACTLY_1_1)
def test_average_value_ratio_exactly_1_1_keeps(total: float, target: float, current: int) -> None:
    assert total / (target * current) == 1.1
    assert average_value_replicas(total, target, current, 0.1) == current


@pytest.mark.parametrize("target", [0.0, -1.0])
def test_average_value_target_must_be_positive(target: float) -> None:
    with pytest.raises(ValueError, match="target must be positive"):
        average_value_replicas(100.0, target, 2, 0.1)


# ------------------------------------------------------------------------------- utilization_replicas
UTILIZATION_CASES: list[Any] = [
    # (utilization, target, current, tolerance, expected): ceil(current x utilization / target)
    pytest.param(140.0, 70.0, 4, 0.1, 8, id="double"),  # 4 x 2 = 8
    pytest.param(35.0, 70.0, 4, 0.1, 2, id="half"),  # 4 x 0.5 = 2
    pytest.param(80.0, 70.0, 10, 0.1, 12, id="ceil"),  # 10 x 1.143 = 11.43 -> 12
    pytest.param(60.0, 70.0, 7, 0.1, 6, id="float-noise"),  # 7 x 0.857.. = 6 (not 7 from 6.000000000000001)
    pytest.param(75.0, 70.0, 4, 0.1, 4, id="within-tolerance"),  # ratio 1.071: keep
    pytest.param(64.0, 70.0, 4, 0.1, 4, id="within-below"),  # ratio 0.914: keep (4 x 0.914 = 3.66 -> 4 anyway)
    pytest.param(60.0, 70.0, 20, 0.1, 18, id="below-tolerance"),  # ratio 0.857: 20 x 0.857 = 17.1 -> 18
    pytest.param(0.0, 70.0, 5, 0.1, 0, id="idle"),
    pytest.param(500.0, 70.0, 0, 0.1, 0, id="zero-stays-zero"),  # no replica, no utilisation to scale by
    pytest.param(71.0, 70.0, 100, 0.0, 102, id="tolerance-0"),  # 100 x 1.0143 = 101.4 -> 102
]


@pytest.mark.parametrize(("utilization", "target", "current", "tolerance", "expected"), UTILIZATION_CASES)
def test_utilization_replicas(utilization: float, target: float, current: int, tolerance: float,
                              expected: int) -> None:
    assert utilization_replicas(utilization, target, current, tolerance) == expected


@pytest.mark.parametrize(("utilization", "target", "current"), [(77.0, 70.0, 4), (11.0, 10.0, 10)])
def test_utilization_ratio_exactly_1_1_keeps(utilization: float, target: float, current: int) -> None:
    assert utilization / target == 1.1
    assert utilization_replicas(utilization, target, current, 0.1) == current


@pytest.mark.parametrize("target", [0.0, -70.0])
def test_utilization_target_must_be_positive(target: float) -> None:
    with pytest.raises(ValueError, match="target must be positive"):
        utilization_replicas(50.0, target, 2, 0.1)


# ---------------------------------------------------------------------------------------- HPA: scale up
def test_default_scale_up_worked_numbers() -> None:
    """Every 15 s the limit is max(start + 4, 2 x start), start being the count 15 s ago."""
    steps = [(15.0 * i, 1000) for i in range(8)]
    got = drive(HpaSpec(max_replicas=100), 1, steps)
    # 1 -> max(5, 2) = 5 -> max(9, 10) = 10 -> max(14, 20) = 20 -> 40 -> 80 -> max(84, 160) capped at 100
    assert got == [5, 10, 20, 40, 80, 100, 100, 100]


def test_scale_up_stops_at_the_recommendation() -> None:
    # 3 -> desired 6: within max(7, 6); then 6 -> 9: within max(10, 12)
    assert drive(HpaSpec(), 3, [(0.0, 6), (15.0, 9), (30.0, 9)]) == [6, 9, 9]


def test_events_within_the_period_count_and_one_exactly_a_period_old_does_not() -> None:
    steps = [(0.0, 1000), (7.5, 1000), (14.5, 1000), (15.0, 1000), (29.5, 1000), (30.0, 1000)]
    got = drive(HpaSpec(), 1, steps)
    # t=0: 1 -> 5 (+4). t=7.5 and 14.5: the +4 at 0 s is in (now - 15, now]: start 5 - 4 = 1: limit 5, no change.
    # t=15: the event at 0 is exactly 15 s old: out (Kubernetes: timestamp.After(now - 15)): start 5 -> 10.
    # t=29.5: the +5 at 15 s counts: start 5: limit 10. t=30: out: start 10 -> 20.
    assert got == [5, 5, 5, 10, 10, 20]


def test_a_pods_only_scale_up_policy() -> None:
    spec = HpaSpec(scale_up=rules(0, (PODS, 2, 60)))
    steps = [(0.0, 50), (15.0, 50), (59.5, 50), (60.0, 50), (120.0, 50)]
    # 10 -> 12; within 60 s of the +2 no more; at 60 s the event is out: 14; 16
    assert drive(spec, 10, steps) == [12, 12, 12, 14, 16]


def test_select_policy_min_takes_the_smaller_limit() -> None:
    spec = HpaSpec(scale_up=rules(0, (PODS, 4, 15), (PERCENT, 100, 15), select=SelectPolicy.MIN))
    got = drive(spec, 1, [(15.0 * i, 1000) for i in range(8)])
    # min(start + 4, 2 x start): 1 -> 2 -> 4 -> min(8, 8) = 8 -> min(12, 16) = 12 -> 16 -> 20 -> 24 -> 28
    assert got == [2, 4, 8, 12, 16, 20, 24, 28]


def test_select_policy_disabled_never_scales_up() -> None:
    spec = HpaSpec(scale_up=rules(0, (PODS, 4, 15), select=SelectPolicy.DISABLED))
    assert drive(spec, 3, [(15.0 * i, 50) for i in range(30)]) == [3] * 30


def test_a_scale_up_window_takes_the_lowest_recommendation() -> None:
    spec = HpaSpec(scale_up=rules(60, (PODS, 4, 15), (PERCENT, 100, 15)))
    steps = [(0.0, 3), (15.0, 10), (30.0, 10), (45.0, 10), (60.5, 10), (75.0, 10), (75.5, 10)]
    got = drive(spec, 2, steps)
    # t=0: lowest of {3} = 3 (within max(6, 4)). 15-45: lowest of {3, 10} = 3. t=60.5: window (0.5, 60.5] holds
    # only 10s: 10, limited to max(3 + 4, 2 x 3) = 7. t=75: the +4 at 60.5 s still counts: start 3, 7.
    # t=75.5: it is out: max(7 + 4, 14) = 14, capped at the recommendation 10.
    assert got == [3, 3, 3, 3, 7, 7, 10]


# -------------------------------------------------------------------------------------- HPA: scale down
def test_default_scale_down_waits_the_300s_window_then_drops_at_once() -> None:
    steps = [(0.0, 20)] + [(15.0 * i, 2) for i in range(1, 20)] + [(300.5, 2), (315.0, 2)]
    got = drive(HpaSpec(), 20, steps)
    # the 20 at 0 s is the highest recommendation until it leaves the window: 20 through 285 s;
    # at 300.5 s the window (0.5, 300.5] holds only 2s and Percent 100 per 15 s lets all go: 2
    assert got == [20] * 20 + [2, 2]


def test_the_window_takes_the_highest_recommendation_in_it() -> None:
    steps = [(0.0, 20), (15.0, 5), (30.0, 12), (45.0, 3), (300.5, 3), (322.5, 3), (337.5, 3)]
    got = drive(HpaSpec(), 20, steps)
    # 300.5: window (0.5, 300.5] = {5, 12, 3, 3}: 12. 322.5: (22.5, ..] = {12, 3, ..}: 12. 337.5: (37.5, ..]: 3
    assert got == [20, 20, 20, 20, 12, 12, 3]


def test_scale_down_stops_at_min_replicas() -> None:
    spec = HpaSpec(min_replicas=3)
    steps = [(0.0, 10)] + [(300.5 + 15.0 * i, 0) for i in range(3)]
    assert drive(spec, 10, steps) == [10, 3, 3, 3]  # desired 0, Percent 100 allows 0: max(0, 0, min 3) = 3


def test_a_pods_scale_down_policy_limits_removals() -> None:
    spec = HpaSpec(scale_down=rules(0, (PODS, 2, 60)))
    steps = [(15.0 * i, 1) for i in range(18)]
    got = drive(spec, 10, steps)
    # 2 pods per 60 s: 10 -> 8 at 0 s; 8 until the -2 is 60 s old; 6 at 60 s, 4 at 120 s, 2 at 180 s; then
    # 1 at 240 s (2 - 2 = 0, but the recommendation is 1)
    assert got == [8] * 4 + [6] * 4 + [4] * 4 + [2] * 4 + [1] * 2


def test_select_policy_min_for_scale_down_removes_the_least() -> None:
    spec = HpaSpec(scale_down=rules(0, (PODS, 1, 15), (PERCENT, 100, 15), select=SelectPolicy.MIN))
    # the smallest removal: max(start - 1, 0) = start - 1 per 15 s
    assert drive(spec, 5, [(15.0 * i, 1) for i in range(6)]) == [4, 3, 2, 1, 1, 1]


def test_select_policy_disabled_never_scales_down() -> None:
    spec = HpaSpec(scale_down=rules(0, (PERCENT, 100, 15), select=SelectPolicy.DISABLED))
    assert drive(spec, 10, [(15.0 * i, 1) for i in range(30)]) == [10] * 30


def test_a_percent_scale_down_limit_truncates_like_kubernetes() -> None:
    spec = HpaSpec(scale_down=rules(0, (PERCENT, 10, 15)))
    # Kubernetes: int32(9 x 0.9) = int32(8.1) = 8, then int32(8 x 0.9) = 7, ...
    assert drive(spec, 9, [(0.0, 1), (15.0, 1)]) == [8, 7]


def test_the_period_start_counts_both_directions() -> None:
    spec = HpaSpec(scale_down=rules(0, (PODS, 2, 60)))
    got = drive(spec, 10, [(0.0, 4), (15.0, 20), (30.0, 4)])
    # 0 s: 10 -> 8 (-2). 15 s: up from 8: max(12, 16) = 16 (+8). 30 s, down, the 60-s policy: the period
    # began at 16 - 8 + 2 = 10 replicas, 10 - 2 = 8 allowed (here: 16 + 2 - 2 = 16, no change)
    assert got == [8, 16, 8]


@pytest.mark.parametrize(("spec", "start", "steps", "expected"), [
    # down, 300 s: the 20 at 0 s is out at 300 s: drop to 2
    pytest.param(HpaSpec(), 20, [(0.0, 20), (150.0, 2), (300.0, 2)], [20, 20, 2], id="scale-down-window"),
    # up, 60 s: the 3 at 0 s is out at 60 s: up to 3 + 4 = 7
    pytest.param(HpaSpec(scale_up=rules(60, (PODS, 4, 15), (PERCENT, 100, 15))), 2,
                 [(0.0, 3), (30.0, 10), (60.0, 10)], [3, 3, 7], id="scale-up-window"),
])
def test_a_recommendation_exactly_the_window_old_no_longer_counts(spec: HpaSpec, start: int,
                                                                  steps: list[tuple[float, int]],
                                                                  expected: list[int]) -> None:
    assert drive(spec, start, steps) == expected


# ---------------------------------------------------------------------------------------- HPA: min, max
CLAMP_CASES: list[Any] = [
    # (min, max, current, desired, expected)
    pytest.param(1, 10, 8, 50, 10, id="desired-above-max"),  # limit max(12, 16), capped at 10
    pytest.param(1, 10, 15, 15, 10, id="current-above-max"),  # brought down at once, no window
    pytest.param(2, 10, 0, 0, 2, id="current-below-min"),  # brought up at once
    pytest.param(3, 10, 1, 1, 3, id="current-below-min-desired-below"),
    pytest.param(5, 5, 5, 100, 5, id="min-equals-max"),
    pytest.param(0, 10, 0, 0, 0, id="min-0-stays-0"),
]


@pytest.mark.parametrize(("lo", "hi", "current", "desired", "expected"), CLAMP_CASES)
def test_min_max_clamp(lo: int, hi: int, current: int, desired: int, expected: int) -> None:
    assert Hpa(HpaSpec(min_replicas=lo, max_replicas=hi)).step(0.0, current, desired) == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_replicas": 5, "max_replicas": 4}, "min_replicas (5) is above max_replicas (4)"),
    ({"min_replicas": -1}, "min_replicas"),
    ({"max_replicas": 0}, "max_replicas"),
    ({"tolerance": 1.0}, "tolerance"),
])
def test_hpa_spec_validation_names_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HpaSpec(**fields)


@pytest.mark.parametrize(("fields", "field"), [
    ({"stabilization_window_s": 3601, "policies": ()}, "stabilization_window_s"),
    ({"stabilization_window_s": -1, "policies": ()}, "stabilization_window_s"),
])
def test_scaling_rules_validation(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ScalingRules(**fields)
    assert info.value.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize(("fields", "field"), [
    ({"value": 0, "period_s": 15}, "value"),
    ({"value": 4, "period_s": 1801}, "period_s"),  # periodSeconds <= 1800
    ({"value": 4, "period_s": 0}, "period_s"),
])
def test_scaling_policy_validation(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ScalingPolicy(type=PODS, **fields)
    assert info.value.errors()[0]["loc"] == (field,)


# ------------------------------------------------------------------------------------ HPA: properties
@st.composite
def hpa_runs(draw: st.DrawFn) -> tuple[HpaSpec, int, list[tuple[float, int]]]:
    lo = draw(st.integers(0, 3))
    hi = draw(st.integers(max(lo, 1), 40))
    start = draw(st.integers(lo, hi))
    gaps = draw(st.lists(st.tuples(st.sampled_from([0.5, 5.0, 7.5, 15.0, 30.0, 60.0, 150.0]), st.integers(0, 80)),
                         min_size=1, max_size=60))
    now, steps = 0.0, []
    for gap, desired in gaps:
        steps.append((now, desired))
        now += gap
    return HpaSpec(min_replicas=lo, max_replicas=hi), start, steps


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hpa_runs())
def test_default_behaviour_properties(run: tuple[HpaSpec, int, list[tuple[float, int]]]) -> None:
    spec, start, steps = run
    hpa = Hpa(spec)
    history: list[tuple[float, int]] = []  # (time, replicas after the step)
    seen: list[tuple[float, int]] = []  # (time, raw recommendation)
    current = start
    for now, desired in steps:
        result = hpa.step(now, current, desired)
        seen.append((now, desired))
        # 1. always within [min, max]
        assert spec.min_replicas <= result <= spec.max_replicas
        # 2. up by at most max(4 pods, 100 %) over any 15 s: against the count 15 s ago (events exactly 15 s
        #    old are out, so that is the count after the last step at or before now - 15)
        before = [r for t, r in history if t <= now - 15.0]
        base = before[-1] if before else start
        assert result <= max(base + 4, 2 * base, current)
        # 3. a scale-up never passes the recommendation (no up window: the current one)
        if result > current:
            assert result <= desired
        # 4. never below the highest recommendation of the last 300 s, clamped to [min, max] and the current
        #    count (strictly inside the window, as Kubernetes draws it)
        recent = max(d for t, d in seen if t > now - 300.0)
        assert result >= min(current, min(max(recent, spec.min_replicas), spec.max_replicas))
        history.append((now, result))
        current = result


# ---------------------------------------------------------------------------------------- KEDA activation
KedaStep = tuple[float, bool, int, int | None]

KEDA_CASES: dict[str, tuple[int, float, list[KedaStep]]] = {
    # name: (min_replicas, cooldown_s, [(now, active, current, expected target)])
    "active-at-zero-starts-one": (0, 300.0, [(0.0, True, 0, 1)]),
    "active-at-zero-starts-min": (3, 300.0, [(0.0, True, 0, 3)]),
    "active-above-zero-leaves-it-to-the-hpa": (0, 300.0, [(0.0, True, 4, None), (15.0, True, 1, None)]),
    "inactive-after-the-cooldown-only": (0, 300.0, [
        (100.0, True, 2, None),  # active: last_active = 100
        (200.0, False, 2, None),  # 100 + 300 < 200? no
        (400.0, False, 2, None),  # 100 + 300 < 400? no: the boundary is not enough (strict)
        (400.5, False, 2, 0),  # 400 < 400.5: to zero
    ]),
    "activity-restarts-the-cooldown": (0, 300.0, [
        (0.0, True, 1, None), (250.0, True, 1, None), (400.0, False, 1, None),  # 250 + 300 = 550 > 400
        (550.0, False, 1, None), (550.5, False, 1, 0),
    ]),
    "never-active-goes-to-zero-at-once": (0, 300.0, [(0.0, False, 2, 0)]),
    "zero-cooldown": (0, 0.0, [(10.0, True, 1, None), (10.0, False, 1, None), (10.5, False, 1, 0)]),
    "inactive-at-zero-stays": (0, 300.0, [(0.0, False, 0, None), (1000.0, False, 0, None)]),
    "inactive-below-min-scales-to-min": (2, 300.0, [(0.0, False, 0, 2), (15.0, False, 1, 2)]),
    # active above zero, even below min: KEDA leaves it to the HPA (whose minReplicas applies)
    "active-below-min-leaves-it-to-the-hpa": (3, 300.0, [(0.0, True, 1, None)]),
    "min-above-zero-never-to-zero": (2, 300.0, [(0.0, True, 3, None), (1000.0, False, 3, None),
                                                 (1000.0, False, 2, None)]),
    "wakes-again-after-zero": (0, 300.0, [(0.0, True, 1, None), (300.5, False, 1, 0), (900.0, True, 0, 1)]),
}


@pytest.mark.parametrize("case", list(KEDA_CASES))
def test_keda_activation(case: str) -> None:
    lo, cooldown, steps = KEDA_CASES[case]
    keda = KedaActivation(min_replicas=lo, cooldown_s=cooldown)
    got = [keda.target(now, active, current) for now, active, current, _ in steps]
    assert got == [expected for *_, expected in steps]


def test_keda_records_the_last_active_time() -> None:
    keda = KedaActivation()
    assert (keda.min_replicas, keda.cooldown_s, keda.last_active) == (0, 300.0, None)  # KEDA's defaults
    keda.target(12.5, True, 3)
    keda.target(20.0, False, 3)  # inactive: not a new last-active time
    assert keda.last_active == 12.5


# ---------------------------------------------------------------------------------- ScaledObjectSpec
def scaled(**fields: Any) -> ScaledObjectSpec:
    base: dict[str, Any] = {"name": "svc", "query": "sum(DCGM_FI_DEV_GPU_UTIL)", "target": 70.0}
    return ScaledObjectSpec(**(base | fields))


def test_scaled_object_defaults() -> None:
    spec = scaled()
    assert (spec.namespace, spec.production, spec.min_replicas, spec.max_replicas, spec.fallback_replicas,
            spec.failure_threshold, spec.idle_cooldown_s, spec.activation_threshold) == (
        "default", True, 1, 100, 1, 3, 300.0, 0.0)
    assert spec.activation_query is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_replicas": 5, "max_replicas": 4}, "min_replicas (5) is above max_replicas (4)"),
    ({"fallback_replicas": 5, "max_replicas": 4}, "fallback_replicas (5) is above max_replicas (4)"),
    ({"min_replicas": 0}, "min_replicas 0 is for non-production services (set production: false)"),
    ({"min_replicas": 0, "production": True}, "min_replicas 0 is for non-production services"),
])
def test_scaled_object_cross_field_errors_name_the_fields(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        scaled(**fields)
    assert message in str(info.value)


@pytest.mark.parametrize(("fields", "field"), [
    ({"target": 0.0}, "target"), ({"target": -5.0}, "target"), ({"name": ""}, "name"), ({"query": ""}, "query"),
    ({"activation_threshold": -1.0}, "activation_threshold"), ({"activation_query": ""}, "activation_query"),
    ({"idle_cooldown_s": -1.0}, "idle_cooldown_s"), ({"fallback_replicas": 0}, "fallback_replicas"),
    ({"failure_threshold": 0}, "failure_threshold"), ({"query_timeout_s": 0.0}, "query_timeout_s"),
    ({"max_replicas": 0}, "max_replicas"), ({"min_replicas": -1}, "min_replicas"), ({"triggers": []}, "triggers"),
])
def test_scaled_object_field_errors_name_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        scaled(**fields)
    assert info.value.errors()[0]["loc"] == (field,)


def test_non_production_may_scale_to_zero_but_its_hpa_starts_at_one() -> None:
    spec = scaled(production=False, min_replicas=0, max_replicas=40, fallback_replicas=4)
    assert spec.min_replicas == 0
    # KEDA's HPA never goes to 0 (minReplicas 1); KEDA does 0 <-> 1 itself
    assert spec.hpa() == HpaSpec(min_replicas=1, max_replicas=40)
    assert scaled(min_replicas=3, max_replicas=9).hpa() == HpaSpec(min_replicas=3, max_replicas=9)


# ------------------------------------------------------------------------------------ ScalerPolicy
Reading = tuple[float, float | None, float | None]
"""(now, value or None for a failed reading, activity)"""
Expected = tuple[float, bool, ReadingSource]

NON_PROD: dict[str, Any] = {"production": False, "min_replicas": 0}
SCALER_CASES: dict[str, tuple[dict[str, Any], list[tuple[Reading, Expected]]]] = {
    "value-is-the-metric": ({}, [((0.0, 140.0, None), (140.0, True, METRIC)),
                                 ((15.0, 0.0, None), (0.0, True, METRIC))]),
    "production-is-always-active": ({}, [((0.0, 0.0, 0.0), (0.0, True, METRIC)),
                                         ((1e6, 0.0, 0.0), (0.0, True, METRIC))]),
    # non-production: active when the signal is above the activation threshold, and for idle_cooldown_s after
    "value-decides-activity": (NON_PROD, [
        ((0.0, 0.0, None), (0.0, False, METRIC)),  # never active
        ((15.0, 35.0, None), (35.0, True, METRIC)),  # 35 > 0
        ((315.0, 0.0, None), (0.0, True, METRIC)),  # 315 - 15 = 300 <= 300: still active
        ((315.5, 0.0, None), (0.0, False, METRIC)),  # more than 300 s without activity: inactive
        ((400.0, 0.5, None), (0.5, True, METRIC)),  # active again at once
    ]),
    "activity-beats-the-value": (NON_PROD, [
        ((0.0, 0.0, 5.0), (0.0, True, METRIC)),  # no GPU metric at 0 replicas, but the gateway sees requests
        ((400.0, 50.0, 0.0), (50.0, False, METRIC)),  # the GPU is busy, the gateway idle: activity is 0
    ]),
    "activation-threshold-is-strict": ({**NON_PROD, "activation_threshold": 10.0}, [
        ((0.0, 10.0, None), (10.0, False, METRIC)),  # 10 > 10? no
        ((15.0, 10.5, None), (10.5, True, METRIC)),
    ]),
    "short-idle-cooldown": ({**NON_PROD, "idle_cooldown_s": 15.0}, [
        ((0.0, 5.0, None), (5.0, True, METRIC)),
        ((15.0, 0.0, None), (0.0, True, METRIC)),  # 15 <= 15
        ((15.5, 0.0, None), (0.0, False, METRIC)),
    ]),
    # failures: the last good value for failure_threshold readings (KEDA falls back once failures exceed
    # its failureThreshold), then target x fallback_replicas
    "failures-last-good-then-fallback": ({"fallback_replicas": 2}, [
        ((0.0, 100.0, None), (100.0, True, METRIC)),
        ((15.0, None, None), (100.0, True, LAST_GOOD)),  # failure 1 of 3
        ((30.0, None, None), (100.0, True, LAST_GOOD)),  # failure 2
        ((45.0, None, None), (100.0, True, LAST_GOOD)),  # failure 3: not above the threshold yet
        ((60.0, None, None), (140.0, True, FALLBACK)),  # failure 4 > 3: 70 x 2 = 140
        ((75.0, 30.0, None), (30.0, True, METRIC)),  # a good value resets the count
        ((90.0, None, None), (30.0, True, LAST_GOOD)),
        ((105.0, None, None), (30.0, True, LAST_GOOD)),
        ((120.0, None, None), (30.0, True, LAST_GOOD)),
        ((135.0, None, None), (140.0, True, FALLBACK)),  # failure 4 since the reset
    ]),
    "a-failure-before-any-value-falls-back-at-once": ({"fallback_replicas": 3}, [
        ((0.0, None, None), (210.0, True, FALLBACK)),  # 70 x 3
        ((15.0, 35.0, None), (35.0, True, METRIC)),
    ]),
    "threshold-1-falls-back-at-the-second-failure": ({"failure_threshold": 1}, [
        ((0.0, 100.0, None), (100.0, True, METRIC)), ((15.0, None, None), (100.0, True, LAST_GOOD)),
        ((30.0, None, None), (70.0, True, FALLBACK)),
    ]),
    "non-finite-values-are-failures": ({"failure_threshold": 3}, [
        ((0.0, 50.0, None), (50.0, True, METRIC)),
        ((15.0, math.nan, None), (50.0, True, LAST_GOOD)),
        ((30.0, math.inf, None), (50.0, True, LAST_GOOD)),
        ((45.0, -math.inf, None), (50.0, True, LAST_GOOD)),
        ((60.0, math.nan, None), (70.0, True, FALLBACK)),
    ]),
    # a failed reading is never read as zero, nor as inactivity: an idle non-production object is active on it
    "failures-keep-non-production-active": (NON_PROD, [
        ((0.0, 0.0, None), (0.0, False, METRIC)),
        ((15.0, None, None), (0.0, True, LAST_GOOD)),
        ((30.0, None, None), (0.0, True, LAST_GOOD)),
        ((45.0, None, None), (0.0, True, LAST_GOOD)),
        ((60.0, None, None), (70.0, True, FALLBACK)),
        ((75.0, 0.0, None), (0.0, False, METRIC)),  # a good reading: back to the activity clock (never active)
    ]),
    # a failed GPU metric with a working activation query: the gateway's reading decides activity
    "a-failure-with-an-idle-gateway": (NON_PROD, [
        ((0.0, 80.0, 5.0), (80.0, True, METRIC)),  # last active at 0
        ((100.0, None, 0.0), (80.0, True, LAST_GOOD)),  # 100 - 0 <= 300: still active
        ((400.0, None, 0.0), (80.0, False, LAST_GOOD)),  # 400 - 0 > 300 and the gateway saw nothing: idle
        ((415.0, None, None), (80.0, True, LAST_GOOD)),  # failure 3, activity unknown: active
        ((430.0, None, 2.0), (70.0, True, FALLBACK)),  # failure 4 > 3: fallback; the gateway sees demand
    ]),
    "failures-do-not-refresh-activity": (NON_PROD, [
        ((0.0, 80.0, None), (80.0, True, METRIC)),  # last active at 0
        ((100.0, None, None), (80.0, True, LAST_GOOD)),
        ((200.0, None, None), (80.0, True, LAST_GOOD)),
        ((400.0, 0.0, None), (0.0, False, METRIC)),  # 400 - 0 >= 300: the failures did not count as activity
    ]),
}


@pytest.mark.parametrize("case", list(SCALER_CASES))
def test_scaler_policy(case: str) -> None:
    fields, rows = SCALER_CASES[case]
    policy = ScalerPolicy(scaled(**fields))
    for (now, value, activity), (v, active, source) in rows:
        report = policy.observe(now, value, "boom" if value is None else None, activity=activity)
        assert (report.value, report.active, report.source) == (v, active, source), (now, value)
        assert (report.error is None) == (source is METRIC)


def test_zero_idle_cooldown_is_active_while_there_is_activity() -> None:
    policy = ScalerPolicy(scaled(production=False, min_replicas=0, idle_cooldown_s=0.0))
    # KEDA's own rule with no extra hold: active exactly when the value is above the activation threshold
    assert policy.observe(0.0, 5.0).active is True
    assert policy.observe(15.0, 0.0).active is False


def test_failure_reports_carry_the_reason() -> None:
    policy = ScalerPolicy(scaled())
    assert policy.observe(0.0, None, "prometheus: connection refused") == ScalerReport(
        70.0, True, FALLBACK, "prometheus: connection refused")
    policy.observe(15.0, 42.0)
    report = policy.observe(30.0, math.nan)
    assert (report.source, report.value) == (LAST_GOOD, 42.0)
    assert report.error is not None and "nan" in report.error
    assert (policy.last_good, policy.failures) == (42.0, 1)


def test_an_overflowing_ratio_asks_for_the_int32_maximum() -> None:
    # 1.7e308 / 0.5 overflows a float: kube's int32 maximum, which the HPA's policies and max then limit
    assert average_value_replicas(1.7e308, 0.5, 3, 0.1) == 2**31 - 1
    # from 3: max(3 + 4 pods, 3 x 200 %) = 7 in the first 15 s
    assert Hpa(HpaSpec(max_replicas=40)).step(0.0, 3, average_value_replicas(1.7e308, 0.5, 3, 0.1)) == 7


def test_a_scale_down_in_the_period_never_turns_a_scale_up_into_a_scale_down() -> None:
    # min 0, max 5, from 1: t=0 wants 0 -> 0 (event -1); t=7.5 wants 5: period start 0 + 1 = 1, limit max(1 + 4,
    # 1 x 2) = 5 -> 5 (event +5); t=15 wants 6: period start 5 - 5 = 0, limit max(0 + 4, 0) = 4 < 5. Kube holds
    # the count at 5 (the up limit is never below the current count); it must not drop to 4.
    hpa = Hpa(HpaSpec(min_replicas=0, max_replicas=5))
    assert [hpa.step(0.0, 1, 0), hpa.step(7.5, 0, 5), hpa.step(15.0, 5, 6)] == [0, 5, 5]


# ------------------------------------------------------------------------------------ the value per request

# (readings as (time, GPU value, request rate), then a new reading (value, rate), the estimate): half-life 600 s
@pytest.mark.parametrize(("readings", "value", "rate", "expected"), [
    ([], 50.0, 10.0, 50.0),                                # nothing learnt: the GPU value alone
    ([(0.0, 70.0, 10.0)], 70.0, 30.0, 210.0),              # 7 per request/s: a flash crowd of 30/s reads 210
    ([(0.0, 70.0, 10.0)], 80.0, 5.0, 80.0),                # the GPU value when it is the larger
    ([(0.0, 70.0, 10.0)], 80.0, None, 80.0),               # no rate (a failed query): the GPU value
    # 600 s later a sample of 5 per request/s: half way, (7 + 5) / 2 = 6; at 40/s: 240
    ([(0.0, 70.0, 10.0), (600.0, 50.0, 10.0)], 100.0, 40.0, 240.0),
    # samples with no value or no requests teach nothing (a service at zero replicas, or idle)
    ([(0.0, 70.0, 10.0), (60.0, 0.0, 10.0), (120.0, 30.0, 0.0)], 0.0, 2.0, 14.0),
])
def test_value_per_request(readings: list[tuple[float, float, float]], value: float, rate: float | None,
                           expected: float) -> None:
    learnt = ValuePerRequest(600.0)
    for now, v, r in readings:
        learnt.learn(now, v, r)
    assert learnt.estimate(value, rate) == pytest.approx(expected)


@settings(max_examples=60, deadline=None)
@given(samples=st.lists(st.tuples(st.floats(0.1, 1e4), st.floats(0.1, 1e3)), min_size=1, max_size=20),
       value=st.floats(0.0, 1e4), rate=st.floats(0.0, 1e3))
def test_the_estimate_is_never_below_the_gpu_value_and_the_ratio_stays_in_the_samples_range(
        samples: list[tuple[float, float]], value: float, rate: float) -> None:
    learnt = ValuePerRequest(300.0)
    for i, (v, r) in enumerate(samples):
        learnt.learn(15.0 * i, v, r)
    ratios = [v / r for v, r in samples]
    assert learnt.ratio is not None and min(ratios) * (1 - 1e-9) <= learnt.ratio <= max(ratios) * (1 + 1e-9)
    assert learnt.estimate(value, rate) >= value


# ------------------------------------------------------------------------------------ the decision path


GPU = "sum(DCGM_FI_DEV_GPU_UTIL)"


class Source:
    """A metric source with fixed answers; a missing or None answer fails as Prometheus' empty result does."""

    def __init__(self, answers: dict[str, float | None]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        self.asked.append(query)
        value = self.answers.get(query)
        if value is None:
            raise GpuplaneError(f"query {query!r}: no data")
        return value


def test_the_decision_path_reuses_a_reading_within_the_query_interval() -> None:
    scaler = ScaledObjectScaler(scaled(), min_query_interval_s=1.0)
    source = Source({GPU: 140.0})
    first = scaler.poll(0.0, source)
    again = scaler.poll(0.5, source)
    assert (first.fresh, again.fresh, again.report) == (True, False, first.report)
    assert source.asked == [GPU]
    assert scaler.replicas == 2  # ceil(140 / 70)
    assert scaler.poll(1.0, source).fresh


def test_the_demand_query_sees_a_flash_crowd_beyond_the_saturated_gpus() -> None:
    scaler = ScaledObjectScaler(scaled(demand_query="rate", max_replicas=50), min_query_interval_s=0.0)
    source = Source({GPU: 280.0, "rate": 40.0})  # 4 cards at 70 %: 7 per request/s
    assert scaler.poll(0.0, source).report.value == 280.0
    # the crowd: 4 cards saturated (400), 120 requests/s arriving; the estimate uses the ratio learnt so far
    source.answers.update({GPU: 400.0, "rate": 120.0})
    assert scaler.poll(15.0, source).report.value == pytest.approx(120.0 * 7)
    assert scaler.replicas == 8  # the HPA's first step from 4: max(4 + 4, 4 × 2) = 8 towards ceil(840 / 70) = 12
    # then the saturated sample 400 / 120 = 3.33 is learnt with weight 1 − 2^(−15/1800)
    assert scaler.per_request.ratio == pytest.approx(7 * 0.5 ** (15 / 1800) + 400 / 120 * (1 - 0.5 ** (15 / 1800)))


def test_a_failed_demand_query_leaves_the_gpu_value_and_says_why() -> None:
    scaler = ScaledObjectScaler(scaled(demand_query="rate"), min_query_interval_s=0.0)
    poll = scaler.poll(0.0, Source({GPU: 100.0}))
    assert poll.report.value == 100.0 and poll.report.source is METRIC
    assert poll.demand_error is not None and "no data" in poll.demand_error


def test_the_activation_query_decides_idleness_even_while_the_gpu_query_fails() -> None:
    # a non-production object at zero replicas: no GPU series at all, the gateway says no requests
    spec = scaled(production=False, min_replicas=0, idle_cooldown_s=60.0, activation_query="gateway")
    scaler = ScaledObjectScaler(spec, min_query_interval_s=0.0)
    source = Source({"gateway": 3.0})
    assert scaler.poll(0.0, source).report.active  # requests waiting: active, the GPU query failing
    source.answers["gateway"] = 0.0
    assert scaler.poll(30.0, source).report.active  # 30 s idle: within the cooldown
    poll = scaler.poll(61.0, source)
    assert not poll.report.active and poll.report.source is FALLBACK  # 61 s idle: inactive
    assert scaler.replicas == 0


def test_a_broken_source_does_not_raise_out_of_the_decision_path() -> None:
    class Broken:
        def query(self, query: str, *, timeout_s: float | None = None) -> float:
            raise RuntimeError("bug")

    poll = ScaledObjectScaler(scaled()).poll(0.0, Broken())
    assert poll.report.source is FALLBACK and poll.report.error == "RuntimeError: bug"


def test_desired_is_unknown_before_the_first_poll_then_the_hpas_count() -> None:
    # what TidalController(replicas=...) reads: None (the tidal controller scales from its forecast) until read
    scaler = ScaledObjectScaler(scaled(), min_query_interval_s=0.0)
    assert scaler.desired is None
    scaler.poll(0.0, Source({GPU: 140.0}))
    assert scaler.desired == 2  # ceil(140 / 70)
    spec = scaled(production=False, min_replicas=0, idle_cooldown_s=0.0, activation_query="gateway")
    idle = ScaledObjectScaler(spec, min_query_interval_s=0.0)
    idle.poll(0.0, Source({"gateway": 0.0}))
    assert idle.desired == 0  # inactive: 0, a count, not unknown


# ------------------------------------------------------------------------------------ the rise reserve


@pytest.mark.parametrize(("series", "expected"), [
    # (t, signal, level); lead 180 s: each reading against the latest at or before t - 180
    ([(0, 100, 100), (60, 100, 100), (180, 160, 160)], 1.6),  # 160 / 100 (t=180 against t=0)
    ([(0, 100, 100), (120, 160, 160)], 1.0),  # nothing a lead back yet
    ([(0, 100, 100), (60, 150, 150), (240, 180, 180)], 1.2),  # t=240 against t=60 (the latest before 60): 180/150
    ([(0, 40, 40), (180, 160, 160)], 1.0),  # 40 was under the floor (70): a service waking, not a crowd
    ([(0, 100, 100), (180, 80, 80)], 1.0),  # a fall: the factor never goes below 1
    ([(0, 10, 100), (180, 99, 990)], 4.0),  # 9.9 capped at 4; the level, not the signal, meets the floor
])
def test_the_reserve_is_the_largest_rise_within_a_lead(series: list[tuple[float, float, float]],
                                                       expected: float) -> None:
    reserve = RiseReserve(lead_s=180.0, window_s=3600.0, floor=70.0)
    for t, signal, level in series:
        reserve.observe("svc", t, signal, level)
    assert reserve.factor(series[-1][0]) == pytest.approx(expected)


def test_a_rise_is_forgotten_after_the_window_and_shared_by_every_object() -> None:
    reserve = RiseReserve(lead_s=60.0, window_s=600.0, floor=1.0)
    reserve.observe("a", 0.0, 10.0, 10.0)
    reserve.observe("a", 60.0, 20.0, 20.0)  # a doubles in a lead
    reserve.observe("b", 60.0, 10.0, 10.0)  # b has only its first reading: it still gets a's rise
    assert reserve.factor(60.0) == 2.0 and reserve.factor(660.0) == 2.0
    assert reserve.factor(661.0) == 1.0  # 601 s after the rise, the window (600 s) has let it go


def test_observations_out_of_order_are_refused() -> None:
    reserve = RiseReserve(lead_s=60.0, window_s=600.0, floor=1.0)
    reserve.observe("a", 60.0, 10.0, 10.0)
    with pytest.raises(ValueError, match="before the last one"):
        reserve.observe("a", 0.0, 10.0, 10.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.floats(0.0, 1000.0)), min_size=1, max_size=40))
def test_the_factor_is_the_brute_force_maximum(steps: list[tuple[int, float]]) -> None:
    lead, window, floor = 120.0, 900.0, 50.0
    reserve = RiseReserve(lead_s=lead, window_s=window, floor=floor)
    seen: list[tuple[float, float]] = []
    ratios: list[tuple[float, float]] = []
    t = 0.0
    for gap, value in steps:
        t += 15.0 * gap
        earlier = [v for (u, v) in seen if u <= t - lead]
        if earlier and earlier[-1] >= floor:
            ratios.append((t, min(4.0, value / earlier[-1])))
        seen.append((t, value))
        reserve.observe("svc", t, value, value)
        expected = max([1.0, *(r for (u, r) in ratios if u >= t - window)])
        assert reserve.factor(t) == pytest.approx(expected)


def test_the_scaler_holds_replicas_for_the_rise_at_saturation() -> None:
    # 70 % target, a saturated replica reads 100: 700 needs ceil(700 / 70) = 10 replicas by the target; a
    # rise of 1.6 seen within the lead needs ceil(700 × 1.6 / 100) = 12 (11.2 rounded up)
    spec = scaled(rise_lead_s=180.0, replica_capacity=100.0, max_replicas=50)
    scaler = ScaledObjectScaler(spec, min_query_interval_s=0.0)
    assert scaler.reserve is not None
    scaler.reserve.observe("other", 0.0, 100.0, 100.0)
    scaler.reserve.observe("other", 180.0, 160.0, 160.0)
    scaler.replicas = 10
    poll = scaler.poll(200.0, Source({GPU: 700.0}))
    assert poll.report.value == pytest.approx(700.0 * 1.6 * 70.0 / 100.0)
    assert scaler.replicas == 12
    # no rise seen: the target's own headroom, as without the reserve
    plain = ScaledObjectScaler(spec, min_query_interval_s=0.0)
    plain.replicas = 10
    plain.poll(200.0, Source({GPU: 700.0}))
    assert plain.replicas == 10


def test_a_rise_lead_needs_the_saturated_value() -> None:
    with pytest.raises(ValidationError, match="replica_capacity"):
        scaled(rise_lead_s=180.0)
    with pytest.raises(ValidationError, match="below target"):
        scaled(rise_lead_s=180.0, replica_capacity=50.0)
