"""The autoscaling simulator (`gpuplane.sim.autoscale`): the service loads, per-policy invariants, the goals at
the defaults and off them, the CPU-style HPA misled by the request mix, and determinism.

Runs are one virtual day (5 760 HPA syncs per service; ~0.5 s for all five policies on six services) and shared
through module-scoped fixtures. The clock starts at midnight: step k is k x 15 s after 00:00.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from gpuplane.model.tidal import DAY_S
from gpuplane.sim.autoscale import (
    POLICIES,
    AutoscaleComparison,
    AutoscaleScenario,
    AutoscaleScenarioError,
    ServiceLoad,
    run_autoscale,
    service_loads,
)
from scenario_helpers import num

FloatArray = npt.NDArray[np.float64]
DAY: dict[str, Any] = {"days": 1.0}
CLEAN: dict[str, Any] = {"days": 1.0, "noise_cv": 0.0, "bursts_per_day": 0.0, "mix_drift_cv": 0.0}
"""The noise-free diurnal curve alone."""
GOAL_POLICIES = ("static-average", "oracle", "gpu-scaler")


def loads_of(s: AutoscaleScenario) -> list[ServiceLoad]:
    return service_loads(s, np.random.default_rng(s.seed))


def hours(s: AutoscaleScenario) -> FloatArray:
    """The clock (hours after midnight) at each step."""
    return np.asarray((np.arange(s.steps) * s.sync_s % DAY_S) / 3600.0, dtype=np.float64)


def curve(s: AutoscaleScenario, load: ServiceLoad) -> FloatArray:
    """The noise-free diurnal demand of one service: mean x (1 + a cos(2 pi (t - peak) / 24 h))."""
    a = (s.peak_trough_ratio - 1) / (s.peak_trough_ratio + 1)
    mean = load.mean_diurnal_peak / (1 + a)
    t = np.arange(s.steps) * s.sync_s
    return np.asarray(mean * (1 + a * np.cos(2 * np.pi * (t - s.peak_hour * 3600.0) / DAY_S)), dtype=np.float64)


@pytest.fixture(scope="module")
def day() -> AutoscaleComparison:
    return run_autoscale(AutoscaleScenario(**DAY))


@pytest.fixture(scope="module")
def day_figures(day: AutoscaleComparison) -> dict[str, Any]:
    return day.figures()


# ------------------------------------------------------------------------------------------ the loads
def test_the_services_and_their_names() -> None:
    s = AutoscaleScenario(**DAY)
    loads = loads_of(s)
    assert [ld.name for ld in loads] == ["svc-0", "svc-1", "svc-2", "svc-3", "dev-4", "dev-5"]
    assert [ld.production for ld in loads] == [True] * 4 + [False] * 2  # the last 2 are non-production
    for ld in loads:
        assert len(ld.demand) == len(ld.mix) == s.steps == 5760  # 86 400 / 15
        assert np.all(ld.demand >= 0) and np.all(ld.mix > 0)
        # services are mean x U(0.5, 1.5): the peak is mean x (1 + a), a = 1.5 / 3.5
        a = 1.5 / 3.5
        assert 12 * 0.5 * (1 + a) <= ld.mean_diurnal_peak <= 12 * 1.5 * (1 + a)


@pytest.mark.parametrize(("start", "end"), [("09:00", "19:00"), ("22:00", "06:00"), ("08:30", "12:15")])
def test_non_production_is_loaded_in_working_hours_only(start: str, end: str) -> None:
    s = AutoscaleScenario(**DAY, working_hours_start=start, working_hours_end=end)
    h = hours(s)
    lo, hi = (int(x[:2]) + int(x[3:]) / 60 for x in (start, end))
    working = ((h >= lo) & (h < hi)) if lo <= hi else ((h >= lo) | (h < hi))
    for ld in loads_of(s):
        if ld.production:
            assert np.all(ld.demand > 0), ld.name  # production is loaded around the clock
        else:
            assert np.all(ld.demand[~working] == 0), ld.name
            assert np.all(ld.demand[working] > 0), ld.name


@pytest.mark.parametrize(("ratio", "peak_hour"), [(1.0, 21.0), (2.5, 21.0), (4.0, 3.5), (6.0, 12.0)])
def test_the_noise_free_curve_has_the_peak_trough_ratio(ratio: float, peak_hour: float) -> None:
    s = AutoscaleScenario(**CLEAN, peak_trough_ratio=ratio, peak_hour=peak_hour, non_production_services=0)
    for ld in loads_of(s):
        np.testing.assert_allclose(ld.mix, 1.0)  # no drift: the mean mix
        np.testing.assert_allclose(ld.demand, curve(s, ld), rtol=1e-12)
        # peak / trough = (1 + a) / (1 - a) = R; the peak is at peak_hour, the trough 12 h later (both on the
        # 15-s grid), and the peak is the one the scenario reports
        assert ld.demand.max() / ld.demand.min() == pytest.approx(ratio, rel=1e-9)
        assert ld.demand.max() == pytest.approx(ld.mean_diurnal_peak, rel=1e-12)
        if ratio > 1:
            assert int(np.argmax(ld.demand)) * s.sync_s == peak_hour * 3600
            assert int(np.argmin(ld.demand)) * s.sync_s == (peak_hour + 12) % 24 * 3600
        # over a whole day the cosine averages out: the mean is the service's size
        assert ld.demand.mean() == pytest.approx(ld.mean_diurnal_peak / (1 + (ratio - 1) / (ratio + 1)), rel=1e-9)


@pytest.mark.parametrize(("factor", "per_day"), [(3.0, 2.0), (5.0, 4.0), (10.0, 8.0)])
def test_flash_crowds_multiply_demand_by_the_burst_factor(factor: float, per_day: float) -> None:
    s = AutoscaleScenario(**(CLEAN | {"bursts_per_day": per_day}), burst_factor=factor, non_production_services=0,
                          services=12)
    raised: list[float] = []
    burst_steps = 0
    for ld in loads_of(s):
        multiplier = ld.demand / curve(s, ld)
        assert multiplier.min() == pytest.approx(1.0, abs=1e-9)
        assert multiplier.max() <= factor + 1e-9
        raised.append(float(multiplier.max()))
        burst_steps += int((multiplier > 1 + 1e-9).sum())
    # a crowd builds up over 2 min and lasts 10 min: at its height the demand is burst_factor x the curve
    assert max(raised) == pytest.approx(factor, rel=1e-9)
    # ~per_day crowds a service, 10 min (40 steps) each, less the first step of the ramp: 12 x per_day x ~39;
    # overlapping or cut by the end of the day they count less, so a loose band
    expected = 12 * per_day * 39
    assert 0.4 * expected <= burst_steps <= 1.6 * expected


def test_no_flash_crowds_without_bursts_or_with_factor_one() -> None:
    for fields in ({"bursts_per_day": 0.0}, {"bursts_per_day": 5.0, "burst_factor": 1.0}):
        s = AutoscaleScenario(**(CLEAN | fields), non_production_services=0)
        for ld in loads_of(s):
            np.testing.assert_allclose(ld.demand, curve(s, ld), rtol=1e-12)


def test_the_request_mix_drifts_by_mix_drift_cv() -> None:
    """The hourly log drift is AR(1) with a stationary spread of mix_drift_cv (30 days x 10 services)."""
    s = AutoscaleScenario(days=30.0, services=10, mix_drift_cv=0.3)
    spreads = []
    for ld in loads_of(s):
        hourly = np.log(ld.mix[:: 3600 // 15])  # one value an hour, constant within it
        np.testing.assert_allclose(np.log(ld.mix), np.repeat(hourly, 3600 // 15)[: s.steps])
        spreads.append(float(hourly.std()))
    assert 0.25 <= float(np.mean(spreads)) <= 0.35  # seen 0.28


def test_the_same_seed_gives_the_same_loads() -> None:
    s = AutoscaleScenario(**DAY)
    first, again = loads_of(s), loads_of(s)
    for a, b in zip(first, again, strict=True):
        assert a.name == b.name and a.mean_diurnal_peak == b.mean_diurnal_peak
        np.testing.assert_array_equal(a.demand, b.demand)
        np.testing.assert_array_equal(a.mix, b.mix)
    other = loads_of(AutoscaleScenario(**DAY, seed=2))
    assert not np.array_equal(first[0].demand, other[0].demand)


# ---------------------------------------------------------------------------------------- run invariants
def test_the_oracle_is_never_short(day: AutoscaleComparison, day_figures: dict[str, Any]) -> None:
    assert num(day_figures, "oracle_shortage_minutes") == 0
    assert day_figures["oracle_shortage_cut_vs_static_pct"] == 100.0
    for ld, run in zip(day.loads, day.runs["oracle"].services, strict=True):
        # ceil(demand / 0.7) replicas (production at least 1), ready at once
        plan = np.ceil(ld.demand / 0.7 - 1e-9)
        np.testing.assert_array_equal(run.replicas, np.maximum(plan, 1) if ld.production else plan)
        np.testing.assert_array_equal(run.ready, run.replicas)
        assert np.all(run.ready >= ld.demand)


def test_static_average_gpu_hours_are_replicas_times_hours(day: AutoscaleComparison,
                                                           day_figures: dict[str, Any]) -> None:
    replicas = [max(1, math.ceil(float(ld.demand.mean()) - 1e-9)) for ld in day.loads]
    for count, run in zip(replicas, day.runs["static-average"].services, strict=True):
        assert np.all(run.replicas == count) and np.all(run.ready == count)
        assert run.scale_events == 0
    # one day: 24 GPU-hours a replica; seen (12 + 9 + 16 + 17 + 5 + 8) x 24 = 67 x 24 = 1608
    assert num(day_figures, "static_average_gpu_hours") == sum(replicas) * 24.0
    assert day_figures["static_average_scale_events"] == 0
    assert day_figures["static_average_shortage_cut_vs_static_pct"] == 0.0


def test_static_peak_holds_at_least_the_average(day: AutoscaleComparison, day_figures: dict[str, Any]) -> None:
    for ld, peak, average in zip(day.loads, day.runs["static-peak"].services, day.runs["static-average"].services,
                                 strict=True):
        # the noise-free peak at 70 %: ceil(peak / 0.7)
        assert peak.replicas[0] == math.ceil(ld.mean_diurnal_peak / 0.7 - 1e-9)
        assert peak.replicas[0] >= average.replicas[0]
    assert num(day_figures, "static_peak_gpu_hours") >= num(day_figures, "static_average_gpu_hours")
    assert num(day_figures, "static_peak_shortage_minutes") <= num(day_figures, "static_average_shortage_minutes")


@pytest.mark.parametrize("policy", POLICIES)
def test_replicas_ready_and_shortage_are_consistent(day: AutoscaleComparison, day_figures: dict[str, Any],
                                                    policy: str) -> None:
    s = day.scenario
    key = policy.replace("-", "_")
    shortage = 0
    for ld, run in zip(day.loads, day.runs[policy].services, strict=True):
        assert len(run.replicas) == len(run.ready) == s.steps
        assert np.all(run.replicas >= 0) and np.all(run.replicas <= s.max_replicas)
        assert np.all(run.ready <= run.replicas)  # replicas still starting are not ready
        assert run.shortage_steps == int((ld.demand > run.ready + 1e-9).sum())
        shortage += run.shortage_steps
    # 15-s steps: a quarter of a minute each; GPU-hours: replicas x 15 / 3600
    assert num(day_figures, f"{key}_shortage_minutes") == pytest.approx(shortage / 4, abs=0.0501)
    total = sum(int(r.replicas.sum()) for r in day.runs[policy].services)
    assert num(day_figures, f"{key}_gpu_hours") == pytest.approx(total / 240, abs=0.0501)


CAPPED: dict[str, Any] = {"days": 0.5, "max_replicas": 8}
"""The production services need 18-34 replicas at midnight (ceil(demand / 0.7)): a cap of 8 binds."""


@pytest.fixture(scope="module")
def capped() -> AutoscaleComparison:
    return run_autoscale(AutoscaleScenario(**CAPPED), policies=("cpu-hpa", "gpu-scaler"))


@pytest.mark.parametrize("policy", ["cpu-hpa", "gpu-scaler"])
def test_autoscalers_stay_within_max_replicas_from_the_first_sync(capped: AutoscaleComparison, policy: str) -> None:
    tops = [int(run.replicas[1:].max()) for run in capped.runs[policy].services]
    assert max(tops) == 8  # the cap binds ...
    assert all(top <= 8 for top in tops)  # ... and holds


@pytest.mark.parametrize("policy", ["cpu-hpa", "gpu-scaler"])
def test_autoscalers_start_within_max_replicas(capped: AutoscaleComparison, policy: str) -> None:
    assert all(int(run.replicas[0]) <= 8 for run in capped.runs[policy].services)


def test_production_never_scales_to_zero(day: AutoscaleComparison) -> None:
    for policy in ("cpu-hpa", "gpu-scaler", "static-average", "static-peak", "oracle"):
        for ld, run in zip(day.loads, day.runs[policy].services, strict=True):
            if ld.production:
                assert run.replicas.min() >= 1, (policy, ld.name)
                assert run.ready.min() >= 1, (policy, ld.name)


def test_non_production_scales_to_zero_at_night_and_back_in_working_hours(day: AutoscaleComparison,
                                                                          day_figures: dict[str, Any]) -> None:
    s = day.scenario
    h = hours(s)
    dev = [i for i, ld in enumerate(day.loads) if not ld.production]
    assert len(dev) == 2
    for i in dev:
        run = day.runs["gpu-scaler"].services[i]
        # at midnight (step 0 is the initial state, one replica): never active, so KEDA's first poll scales to
        # zero at once
        assert run.replicas[0] == 1
        assert np.all(run.replicas[1:][h[1:] < 9] == 0)
        # at 09:00 the gateway sees requests 30 s later (the metric delay), KEDA polls every 30 s: one replica
        # by 09:01, serving 60 s later (start-up): ready by 09:02, and ready all day
        assert np.all(run.replicas[(h >= 9 + 1 / 60) & (h < 19)] >= 1)
        assert np.all(run.ready[(h >= 9 + 2 / 60) & (h < 19)] >= 1)
        # at 19:00 the load stops: the scaler reports it inactive 30 s + 300 s (idle_cooldown_s) later, KEDA
        # scales to zero 300 s (keda_cooldown_s) after its last active poll: ~19:11, well before 19:15
        assert np.all(run.replicas[h >= 19.25] == 0)
        assert np.any(run.replicas[(h >= 19) & (h < 19.25)] > 0)  # not at once
        # the CPU-style HPA (minReplicas 1) never scales to zero
        assert day.runs["cpu-hpa"].services[i].replicas.min() >= 1
    # 2 services x (9 h + ~4.8 h) at zero
    assert 2 * 13.5 <= num(day_figures, "gpu_scaler_zero_replica_service_hours") <= 2 * 14.0
    assert num(day_figures, "cpu_hpa_zero_replica_service_hours") == 0


def test_non_production_wakes_with_a_zero_idle_cooldown() -> None:
    s = AutoscaleScenario(**DAY, idle_cooldown_s=0.0)
    comparison = run_autoscale(s, policies=("gpu-scaler",))
    h = hours(s)
    for ld, run in zip(comparison.loads, comparison.runs["gpu-scaler"].services, strict=True):
        if not ld.production:
            assert np.all(run.ready[(h >= 9 + 2 / 60) & (h < 19)] >= 1), ld.name


def test_the_gpu_scaler_follows_demand(day: AutoscaleComparison) -> None:
    """Between oracle and static: it scales a lot more than static, far fewer times than the oracle."""
    f = day.figures()
    assert num(f, "static_average_scale_events") == 0
    assert 0 < num(f, "gpu_scaler_scale_events") < num(f, "oracle_scale_events")
    assert num(f, "gpu_scaler_shortage_minutes") < num(f, "static_average_shortage_minutes") / 10


UNIT_SUFFIXES = ("_minutes", "_gpu_hours", "_pct", "wall_s", "_scale_events", "_service_hours", "_met")
PER_POLICY = ("shortage_minutes", "gpu_hours", "scale_events", "zero_replica_service_hours", "wall_s",
              "gpu_hours_vs_oracle_pct", "shortage_cut_vs_static_pct")


def test_the_figures_and_their_units(day_figures: dict[str, Any]) -> None:
    f = day_figures
    expected = {"scenario", "days", "seed", "services", "non_production_services", "demand_gpu_hours",
                "goal_shortage_cut_met", "goal_gpu_hours_met", "goals_met", "wall_s"}
    expected |= {f"{p.replace('-', '_')}_{name}" for p in POLICIES for name in PER_POLICY}
    assert set(f) == expected
    assert (f["scenario"], f["days"], f["seed"], f["services"], f["non_production_services"]) == (
        "autoscale", 1.0, 1, 6, 2)
    for key, value in f.items():
        if key in ("scenario", "days", "seed", "services", "non_production_services", "goals_met"):
            continue
        assert key.endswith(UNIT_SUFFIXES), key  # every measure names its unit
        if key.endswith("_met"):
            assert isinstance(value, bool), key
        else:
            num(f, key)
    # demand: the GPU-seconds per second summed over the day
    assert num(f, "demand_gpu_hours") == pytest.approx(
        sum(float(ld.demand.sum()) for ld in loads_of(AutoscaleScenario(**DAY))) * 15 / 3600, abs=0.0501)


def test_only_the_policies_asked_for_are_run() -> None:
    comparison = run_autoscale(AutoscaleScenario(days=0.25), policies=("gpu-scaler", "cpu-hpa"))
    f = comparison.figures()
    assert list(comparison.runs) == ["gpu-scaler", "cpu-hpa"]
    assert "gpu_scaler_gpu_hours" in f and "oracle_gpu_hours" not in f
    # without the oracle and static-average there is nothing to compare with: no goals
    assert not any(k.endswith(("_vs_oracle_pct", "_vs_static_pct")) for k in f)
    assert "goals_met" not in f


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(AutoscaleScenarioError, match="unknown autoscaling policy 'keda-cron'"):
        run_autoscale(AutoscaleScenario(days=0.01), policies=("oracle", "keda-cron"))


def test_progress_counts_policy_times_service() -> None:
    ticks: list[tuple[int, int]] = []
    run_autoscale(AutoscaleScenario(days=0.01, services=3, non_production_services=1),
                  policies=("oracle", "gpu-scaler"), progress=lambda done, total: ticks.append((done, total)))
    assert ticks == [(i, 6) for i in range(1, 7)]  # 2 policies x 3 services


# ------------------------------------------------------------------------------------------------ goals
GOAL_SETTINGS: dict[str, dict[str, Any]] = {
    "defaults-1-day": {},
    "ratio-4": {"peak_trough_ratio": 4.0},
    "bursts-x5-4-a-day": {"burst_factor": 5.0, "bursts_per_day": 4.0},
    "startup-180s": {"startup_s": 180.0},
    "mix-drift-0.3": {"mix_drift_cv": 0.3},
    "20-services-seed-3": {"services": 20, "seed": 3},
    "2-gpus-a-service": {"mean_gpus": 2.0},
    "seed-5": {"seed": 5},
}
"""The goals off the defaults, one day each. Seen (shortage cut vs static %, GPU-hours vs oracle %): 98.54/3.84,
98.65/4.04, 97.16/4.56, 96.66/2.65, 98.44/3.79, 98.99/3.39, 98.72/0.55, 99.34/3.17; seeds 1-8 of each of the
first seven settings all met the goals (lowest cut 94.9 %, largest GPU-hours gap 5.3 %)."""


@pytest.mark.parametrize("name", list(GOAL_SETTINGS))
def test_the_goals_hold(name: str) -> None:
    s = AutoscaleScenario(**(DAY | GOAL_SETTINGS[name]))
    f = run_autoscale(s, policies=GOAL_POLICIES).figures()
    assert num(f, "gpu_scaler_shortage_cut_vs_static_pct") >= 90.0
    assert abs(num(f, "gpu_scaler_gpu_hours_vs_oracle_pct")) <= 15.0
    assert f["goal_shortage_cut_met"] is True and f["goal_gpu_hours_met"] is True and f["goals_met"] is True


def test_the_goals_hold_at_the_full_defaults() -> None:
    f = run_autoscale(AutoscaleScenario(), policies=GOAL_POLICIES).figures()  # 2 days: seen 98.79 / 3.56
    assert f["days"] == 2.0
    assert num(f, "gpu_scaler_shortage_cut_vs_static_pct") >= 90.0
    assert abs(num(f, "gpu_scaler_gpu_hours_vs_oracle_pct")) <= 15.0
    assert f["goals_met"] is True


@pytest.mark.parametrize(("fields", "met"), [
    ({"goal_shortage_cut_pct": 99.9}, {"goal_shortage_cut_met": False, "goal_gpu_hours_met": True}),
    ({"goal_gpu_hours_over_oracle_pct": 1.0}, {"goal_shortage_cut_met": True, "goal_gpu_hours_met": False}),
])
def test_the_verdict_follows_the_goal_settings(fields: dict[str, Any], met: dict[str, bool]) -> None:
    """Seen 98.54 % and 3.84 % at one day: a 99.9 % cut or a 1 % gap is out of reach."""
    f = run_autoscale(AutoscaleScenario(**(DAY | fields)), policies=GOAL_POLICIES).figures()
    assert {k: f[k] for k in met} == met
    assert f["goals_met"] is False


# ---------------------------------------------------------------------------- the CPU HPA and the mix drift
@pytest.fixture(scope="module")
def by_drift() -> dict[float, dict[str, Any]]:
    return {cv: run_autoscale(AutoscaleScenario(**DAY, mix_drift_cv=cv),
                              policies=("static-average", "cpu-hpa", "gpu-scaler")).figures() for cv in (0.0, 0.3)}


def test_the_cpu_hpa_is_misled_by_the_request_mix(by_drift: dict[float, dict[str, Any]]) -> None:
    steady, drifting = by_drift[0.0], by_drift[0.3]
    # seen: cpu-hpa 23.8 shortage minutes at a steady mix, 1918.8 with a drift of 0.3
    assert num(drifting, "cpu_hpa_shortage_minutes") >= 20 * num(steady, "cpu_hpa_shortage_minutes")
    # and with the drift it is short far more than the GPU scaler (58.0): it reads CPU, which the mix does not move
    assert num(drifting, "cpu_hpa_shortage_minutes") >= 10 * num(drifting, "gpu_scaler_shortage_minutes")


def test_the_gpu_scaler_is_not_misled_by_the_request_mix(by_drift: dict[float, dict[str, Any]]) -> None:
    steady, drifting = by_drift[0.0], by_drift[0.3]
    # seen: 54.2 and 58.0 shortage minutes
    assert num(drifting, "gpu_scaler_shortage_minutes") <= 1.5 * num(steady, "gpu_scaler_shortage_minutes")
    assert num(drifting, "gpu_scaler_shortage_cut_vs_static_pct") >= 90.0


def test_at_a_steady_mix_the_cpu_hpa_is_close_to_the_gpu_scaler(by_drift: dict[float, dict[str, Any]]) -> None:
    """Its CPU target is tuned for the mean mix (40 % at saturation x 70 % = 28 %): with no drift it sees the
    GPU load through the CPU, and falls short about as little as the GPU scaler (seen 23.8 and 54.2 minutes)."""
    steady = by_drift[0.0]
    assert num(steady, "cpu_hpa_shortage_cut_vs_static_pct") >= 90.0
    assert abs(num(steady, "cpu_hpa_gpu_hours") - num(steady, "gpu_scaler_gpu_hours")) <= 0.15 * num(
        steady, "gpu_scaler_gpu_hours")


# ------------------------------------------------------------------------------------------- determinism
def without_wall(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if not k.endswith("wall_s")}


def test_the_same_seed_gives_identical_figures(day_figures: dict[str, Any]) -> None:
    again = run_autoscale(AutoscaleScenario(**DAY)).figures()
    assert without_wall(again) == without_wall(day_figures)
    # the wall times are the only keys left out
    assert {k for k in again if k.endswith("wall_s")} == {f"{p.replace('-', '_')}_wall_s" for p in POLICIES} | {
        "wall_s"}
    assert len(without_wall(again)) == len(again) - 6


def test_another_seed_gives_other_figures(day_figures: dict[str, Any]) -> None:
    other = run_autoscale(AutoscaleScenario(**DAY, seed=2)).figures()
    assert other["seed"] == 2
    for key in ("demand_gpu_hours", "static_average_shortage_minutes", "gpu_scaler_gpu_hours",
                "cpu_hpa_shortage_minutes"):
        assert other[key] != day_figures[key], key
