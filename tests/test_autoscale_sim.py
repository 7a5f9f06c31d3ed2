"""The autoscaling world (`gpuplane.sim.autoscale`) and the measured GPU signal it reads
(`gpuplane.sim.scenario.signal`): sampling, lag and noise as dcgm-exporter and Prometheus give them, the
service loads, and each arm's invariants, on quick runs."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers import autoscale as controllers
from gpuplane.sim import autoscale
from gpuplane.sim.autoscale import (
    SCENARIO,
    AutoscaleFigures,
    AutoscaleSettings,
    NoData,
    SimPrometheus,
    gpu_scaled_object,
    service_loads,
)
from gpuplane.sim.scenario import DAY_S, no_progress, with_overrides
from gpuplane.sim.scenario.signal import DcgmSignal, IntervalAverage, ScrapedRate, SignalSettings, Ticker

QUICK = with_overrides(AutoscaleSettings(), dict(SCENARIO.quick))


@functools.cache
def quick(seed: int = 1, **changes: Any) -> AutoscaleFigures:
    return SCENARIO.run(with_overrides(QUICK, {"seed": seed} | changes), no_progress)


def _arm(name: str, seed: int = 1, **changes: Any) -> tuple[list[autoscale.ServiceLoad], list[autoscale.ServiceRun]]:
    """One arm's runs on quick settings, with the loads they ran on."""
    s = with_overrides(QUICK, {"seed": seed} | changes)
    loads = service_loads(s, np.random.default_rng(s.seed))
    rng = np.random.default_rng(99)
    run = {"cpu-hpa": lambda ld: autoscale._cpu_hpa(s, ld, rng),
           "gpu-scaler": lambda ld: autoscale._gpu_scaler(s, ld, rng),
           "static-peak": autoscale._static_peak, "oracle": lambda ld: autoscale._oracle(s, ld)}[name]
    return loads, [run(ld) for ld in loads]


# -- the measured signal -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("period", "phase", "due_at"), [
    (30.0, 10.0, [10, 40, 70]),   # ticks every 5 s from 0: due at the phase, then every period
    (30.0, 12.0, [15, 45, 75]),   # a phase between ticks: the first tick at or after it
    (15.0, 0.0, [0, 15, 30, 45, 60, 75]),
])
def test_a_ticker_is_due_once_per_period(period: float, phase: float, due_at: list[int]) -> None:
    ticker = Ticker(period, phase)
    assert [t for t in range(0, 80, 5) if ticker.due(float(t))] == due_at


def test_an_interval_average_is_the_mean_of_the_steps_before_it() -> None:
    average = IntervalAverage(20.0, 0.0, 5.0, 1)
    got = [average.tick(float(t), (float(v),)) for t, v in zip(range(0, 45, 5), [1, 2, 3, 4, 5, 6, 7, 8, 9],
                                                                     strict=True)]
    # at 0: the first value itself; at 20: mean(1, 2, 3, 4) = 2.5 over 0..20; at 40: mean(5..8) = 6.5
    assert [g for g in got if g is not None] == [(1.0,), (2.5,), (6.5,)]


def _signal(field: str = "DCGM_FI_DEV_GPU_UTIL", noise: float = 0.0, phases: tuple[float, float] = (10.0, 20.0),
            **more: Any) -> DcgmSignal:
    settings = SignalSettings.model_validate({"field": field, "noise_cv": noise} | more)
    return DcgmSignal(settings, 5.0, np.random.default_rng(0), phases)


def test_the_query_sees_a_step_only_after_the_collect_and_then_the_scrape() -> None:
    # collect every 30 s from 10 (10, 40, 70, …), scrape every 15 s from 20 (20, 35, 50, 65, 80, …);
    # 4 cards busy until 45 s, then 8 (of 10 ready): the collect at 70 sees 8, the scrape at 80 passes it on
    signal = _signal()
    seen = {}
    for t in range(0, 100, 5):
        signal.tick(float(t), 4.0 if t < 45 else 8.0, 10, 10)
        seen[t] = signal.query()
    assert [seen[t] for t in (15, 20, 75, 80)] == [None, 400.0, 400.0, 800.0]
    # the value read at 95 was sampled at 70: 25 s old, a step 35 s late
    assert signal.sample_time == 70.0


def test_a_field_averaged_over_the_interval_reads_the_mean_and_is_older() -> None:
    # GR_ENGINE_ACTIVE (a ratio) is averaged over the collect interval: the collect at 70 covers 40..70,
    # busy 4 for 40, 45 is 8 thereafter: (4·5 + 8·25) / 30 = 7.333 cards
    signal = _signal("DCGM_FI_PROF_GR_ENGINE_ACTIVE")
    for t in range(0, 85, 5):
        signal.tick(float(t), 4.0 if t < 45 else 8.0, 10, 10)
    assert signal.query() == pytest.approx((4 * 5 + 8 * 25) / 30)
    assert signal.sample_time == 70.0 - 15.0  # the middle of its window


def test_no_cards_is_no_data_and_loading_cards_read_zero() -> None:
    signal = _signal()
    for t in range(0, 40, 5):
        signal.tick(float(t), 0.0, 0, 0 if t < 30 else 3)
    assert signal.query() is None  # scraped at 20 and 35, the collect at 10 saw no series
    for t in range(40, 55, 5):
        signal.tick(float(t), 0.0, 0, 3)  # three cards still loading their model
    assert signal.query() == 0.0


@settings(max_examples=40, deadline=None)
@given(busy=st.floats(0.0, 50.0), ready=st.integers(1, 60), noise=st.floats(0.0, 2.0))
def test_a_reading_is_between_zero_and_the_ready_cards(busy: float, ready: int, noise: float) -> None:
    signal = _signal(noise=noise, phases=(0.0, 0.0))
    signal.tick(0.0, min(busy, ready), ready, ready)
    value = signal.query()
    assert value is not None and 0.0 <= value <= 100.0 * ready


@pytest.mark.parametrize(("field", "cards", "spread"), [
    # one card at u = 0.5 with cv 0.1 on a 1-s sample: 0.1·0.5 = 0.05 card
    ("DCGM_FI_DEV_GPU_UTIL", 1, 0.05),
    # 16 cards sharing 8 busy: cv·u·√n = 0.1·0.5·4 = 0.2 card
    ("DCGM_FI_DEV_GPU_UTIL", 16, 0.2),
    # averaged over the 30 s interval: the spread shrinks by √30, 0.2 / 5.477 = 0.0365 card
    ("DCGM_FI_PROF_SM_ACTIVE", 16, 0.2 / math.sqrt(30.0)),
])
def test_the_noise_spread_follows_the_cards_and_the_window(field: str, cards: int, spread: float) -> None:
    settings = SignalSettings(field=field, noise_cv=0.1)
    signal = DcgmSignal(settings, 5.0, np.random.default_rng(7), (0.0, 0.0))
    readings = [signal._read(cards / 2, float(cards)) for _ in range(4000)]
    assert np.mean(readings) == pytest.approx(cards / 2, rel=0.01)
    assert np.std(readings) == pytest.approx(spread, rel=0.08)


@pytest.mark.parametrize(("window", "expected"), [
    (60.0, 10.0),  # 600 requests between the scrapes at 15 and 75: 600 / 60
    (15.0, 10.0),  # irate: the last two scrapes, 150 / 15
])
def test_a_scraped_rate_reads_the_counter_over_its_window(window: float, expected: float) -> None:
    rate = ScrapedRate(15.0, window, 0.0)
    assert rate.query() is None
    for t in range(0, 80, 5):
        rate.tick(float(t), 50)  # 50 requests per 5 s step: 10 per second
    assert rate.query() == pytest.approx(expected)


def test_a_rate_window_follows_a_change_later_than_irate() -> None:
    slow, fast = ScrapedRate(15.0, 60.0, 0.0), ScrapedRate(15.0, 15.0, 0.0)
    for t in range(0, 200, 5):
        arrivals = 10 if t < 150 else 40  # 2/s, then 8/s from 150 s
        slow.tick(float(t), arrivals)
        fast.tick(float(t), arrivals)
    # last scrape at 195: irate over 180..195 is 8/s; rate[1m] over 135..195 is (15·2 + 45·8) / 60 = 6.5
    assert (fast.query(), slow.query()) == pytest.approx((8.0, 6.5))


def test_the_simulated_prometheus_answers_as_the_scaler_expects() -> None:
    values: dict[str, float | None] = {"q": 3.0, "empty": None}
    prometheus = SimPrometheus({"q": lambda: values["q"], "empty": lambda: values["empty"]})
    assert prometheus.query("q") == 3.0
    with pytest.raises(NoData, match="no data"):
        prometheus.query("empty")
    with pytest.raises(NoData, match="no such series"):
        prometheus.query("other")


# -- the loads ---------------------------------------------------------------------------------------------


def test_the_services_and_their_names() -> None:
    loads = service_loads(QUICK, np.random.default_rng(1))
    assert [ld.name for ld in loads] == ["svc-0", "svc-1", "svc-2", "dev-3"]
    assert [ld.production for ld in loads] == [True, True, True, False]
    assert all(len(ld.demand) == QUICK.steps for ld in loads)


@pytest.mark.parametrize(("start", "end"), [("09:00", "19:00"), ("22:00", "06:00")])
def test_non_production_is_loaded_in_working_hours_only(start: str, end: str) -> None:
    s = with_overrides(QUICK, {"working_hours_start": start, "working_hours_end": end})
    dev = service_loads(s, np.random.default_rng(1))[-1]
    clock = np.arange(s.steps) * s.tick_s % DAY_S / 3600.0
    h0, h1 = int(start[:2]), int(end[:2])
    inside = (clock >= h0) & (clock < h1) if h0 < h1 else (clock >= h0) | (clock < h1)
    assert (dev.rate[~inside] == 0).all() and (dev.rate[inside] > 0).all()


def test_the_request_mix_drifts_by_mix_drift_cv() -> None:
    s = with_overrides(QUICK, {"days": 20.0, "services": 1, "non_production_services": 0})
    mix = service_loads(s, np.random.default_rng(3))[0].mix
    assert float(np.std(np.log(mix[:: int(3600 / s.tick_s)]))) == pytest.approx(0.15, rel=0.2)
    steady = service_loads(with_overrides(s, {"mix_drift_cv": 0.0}), np.random.default_rng(3))[0].mix
    assert (steady == 1.0).all()


def test_the_same_seed_gives_the_same_figures_and_another_seed_others() -> None:
    assert quick(1) == SCENARIO.run(with_overrides(QUICK, {"seed": 1}), no_progress)
    assert quick(2).gpu_scaler_gpu_hours != quick(1).gpu_scaler_gpu_hours


# -- the arms ---------------------------------------------------------------------------------------------


def test_static_peak_holds_each_services_peak_and_is_never_short() -> None:
    loads, runs = _arm("static-peak")
    for load, run in zip(loads, runs, strict=True):
        assert (run.replicas == math.ceil(float(load.demand.max()))).all()
        assert (load.demand <= run.ready + 1e-9).all()


def test_the_oracle_is_never_short_and_holds_the_target() -> None:
    loads, runs = _arm("oracle")
    for load, run in zip(loads, runs, strict=True):
        assert (load.demand <= run.ready * 0.7 + 1e-9).all()
        assert (run.replicas[load.demand > 0] < load.demand[load.demand > 0] / 0.7 + 1).all()


@pytest.mark.parametrize("arm", ["cpu-hpa", "gpu-scaler"])
def test_autoscalers_stay_within_max_replicas_and_production_never_at_zero(arm: str) -> None:
    loads, runs = _arm(arm, max_replicas=9)
    for load, run in zip(loads, runs, strict=True):
        assert run.replicas.max() <= 9
        assert (run.ready <= run.replicas).all()
        if load.production or arm == "cpu-hpa":  # an HPA alone never goes below 1
            assert run.replicas.min() >= 1


def test_non_production_scales_to_zero_at_night_and_back_in_working_hours() -> None:
    loads, runs = _arm("gpu-scaler")
    dev, run = loads[-1], runs[-1]
    clock_h = np.arange(len(run.replicas)) * QUICK.tick_s % DAY_S / 3600.0
    # idle since midnight: 300 s idle cooldown + 300 s KEDA cooldown, then zero until 09:00
    assert (run.replicas[(clock_h > 1) & (clock_h < 9)] == 0).all()
    # working hours: served within the start-up delay, KEDA's poll and the activation window
    assert (run.ready[(clock_h > 9.1) & (clock_h < 19)] > 0).all()
    assert dev.demand[(clock_h > 9.1) & (clock_h < 19)].min() > 0


def test_external_push_wakes_a_service_from_zero_sooner_than_keda_s_poll() -> None:
    def first_ready_after_nine(**changes: Any) -> float:
        _, runs = _arm("gpu-scaler", keda_polling_s=300.0, **changes)
        clock_s = np.arange(len(runs[-1].ready)) * QUICK.tick_s
        return float(clock_s[(clock_s >= 9 * 3600) & (runs[-1].ready > 0)][0]) - 9 * 3600

    polled, pushed = first_ready_after_nine(), first_ready_after_nine(keda_external_push=True)
    # a poll every 300 s wakes it up to 300 s late, plus the 60 s start-up; the stream within a scrape or two
    assert pushed < polled
    assert 60.0 <= pushed <= 60.0 + 2 * QUICK.scrape_interval_s + QUICK.tick_s


def test_the_gpu_scaler_arm_runs_the_shipping_decision_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # replace what ScaledObjectScaler reports: the arm's replicas must follow it, so the arm has no copy
    calls = []

    def fixed(self: controllers.ScaledObjectScaler, now: float, source: Any) -> controllers.Poll:
        calls.append(now)
        report = controllers.ScalerReport(5 * self.spec.target, True, controllers.ReadingSource.METRIC)
        return controllers.Poll(report, True, None)

    monkeypatch.setattr(controllers.ScaledObjectScaler, "poll", fixed)
    _, runs = _arm("gpu-scaler")
    assert calls
    for run in runs:  # 5 × target: 5 replicas after the HPA's scale-down window, whatever the load
        assert (run.replicas[len(run.replicas) // 2:] == 5).all()


def test_the_scaled_object_is_the_one_an_operator_writes() -> None:
    loads = service_loads(QUICK, np.random.default_rng(1))
    prod, dev = (gpu_scaled_object(QUICK, ld) for ld in (loads[0], loads[-1]))
    assert prod.query == 'sum(DCGM_FI_DEV_GPU_UTIL{namespace="serving",pod=~"svc-0-.*"})'
    assert (prod.target, prod.min_replicas, prod.production) == (70.0, 1, True)
    assert dev.query.endswith(" or on() vector(0)") and (dev.min_replicas, dev.production) == (0, False)
    assert dev.demand_query == dev.activation_query == 'sum(rate(gateway_requests_total{service="dev-3"}[1m]))'
    ratio = gpu_scaled_object(with_overrides(QUICK, {"dcgm_field": "DCGM_FI_PROF_SM_ACTIVE"}), loads[0])
    assert ratio.target == pytest.approx(0.7)  # a ratio field: the target in its units
    assert gpu_scaled_object(with_overrides(QUICK, {"gpu_scaler_demand_query": False}), loads[0]).demand_query is None


# -- figures -----------------------------------------------------------------------------------------------


def test_the_signal_is_measured_not_ideal() -> None:
    f = quick()
    # sample age when the HPA reads it: between 0 and collect + scrape (30 + 15 s), on average about half
    assert 5.0 < f.gpu_scaler_signal_age_s < 45.0
    assert f.gpu_scaler_signal_error_pct > 0.0
    slower = quick(dcgm_collect_interval_s=120.0)
    assert slower.gpu_scaler_signal_age_s > f.gpu_scaler_signal_age_s + 20.0


def test_a_noise_free_pipeline_reads_closer_to_the_demand() -> None:
    noisy = quick(signal_noise_cv=0.5).gpu_scaler_signal_error_pct
    assert quick(signal_noise_cv=0.0).gpu_scaler_signal_error_pct < noisy


def test_the_demand_query_cuts_shortage_the_saturated_gpu_metric_cannot_see() -> None:
    # median over seeds 1-3 of quick runs: the arrival rate sees flash crowds beyond the ready cards
    with_rate = np.median([quick(seed).gpu_scaler_unserved_pct for seed in (1, 2, 3)])
    without = np.median([quick(seed, gpu_scaler_demand_query=False).gpu_scaler_unserved_pct for seed in (1, 2, 3)])
    assert with_rate < without


def test_the_figures_are_consistent() -> None:
    f = quick()
    assert f.static_peak_gpu_hours > f.gpu_scaler_gpu_hours > f.demand_gpu_hours
    assert f.oracle_gpu_hours >= f.demand_gpu_hours / 0.7 - 1e-6
    # the oracle holds the least an autoscaler at the target can; static-peak the most anyone does
    assert f.oracle_gpu_hours < f.gpu_scaler_gpu_hours and f.oracle_gpu_hours < f.cpu_hpa_gpu_hours
    assert 0 < f.gpu_scaler_gpu_hours_saved_vs_static_peak_pct < 100
    assert 0 <= f.gpu_scaler_unserved_pct < 100 and f.gpu_scaler_shortage_minutes >= 0
    assert len(f.trace_names) == 2 and len(f.trace_ready[0]) == 4
    assert len(f.trace_demand[0]) == QUICK.days * 24 * 60  # one point a minute


@pytest.mark.parametrize(("fields", "message"), [
    ({"non_production_services": 5}, "non_production_services (5) is above services (4)"),
    ({"dcgm_field": "DCGM_FI_DEV_POWER_USAGE"}, "dcgm_field"),
    ({"tick_s": 30}, "tick_s"),
])
def test_bad_settings_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        with_overrides(QUICK, fields)
