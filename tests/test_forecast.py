"""The seasonal forecaster learns from what it observed and from nothing else: a daily profile, the recent
level against it, and its own error; before a bin has been seen it falls back to the recent maximum."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.forecast import NO_FORECAST, FixedForecast, SeasonalForecaster

DAY = 86400.0
HOUR = 3600.0
MINUTE = 60.0


def step_day(t: float) -> float:
    """10 requests/s from 00:00 to 07:00, 30 from 07:00 to 24:00."""
    return 10.0 if t % DAY < 7 * HOUR else 30.0


def feed(forecaster: SeasonalForecaster, load: Callable[[float], float], start: float, end: float,
         service: str = "chat") -> None:
    t = start
    while t < end:
        forecaster.observe(service, t, load(t))
        t += MINUTE


def plain(**kwargs: float) -> SeasonalForecaster:
    """No margins: the forecast is the learnt value itself."""
    return SeasonalForecaster(**({"z": 0.0, "margin": 0.0} | kwargs))


@pytest.mark.parametrize(("at", "horizon", "expected", "why"), [
    # 06:30 + 30 min reaches the 07:00 bin, which the two days taught is 30 (the last hour says 10).
    (2 * DAY + 6.5 * HOUR, 1800.0, 30.0, "the morning step is foreseen from yesterday"),
    # 06:00 + 15 min ends in the 06:15 bin: night only, 10.
    (2 * DAY + 6.0 * HOUR, 900.0, 10.0, "a horizon short of the step sees the night"),
    # 23:00 + 2 h: the night ahead is 10, but the last 10 minutes were 30: never below what was just seen.
    (2 * DAY + 23.0 * HOUR, 2 * HOUR, 30.0, "never below the recent maximum"),
])
def test_the_profile_foresees_the_day(at: float, horizon: float, expected: float, why: str) -> None:
    forecaster = plain()
    feed(forecaster, step_day, 0.0, at + MINUTE)
    assert forecaster.peak_over("chat", at, horizon) == pytest.approx(expected, rel=1e-6), why


def test_a_bin_never_seen_falls_back_to_the_recent_maximum() -> None:
    forecaster = plain(cold_s=HOUR)
    # Six hours of the first day only: 10, then 12 for the last half hour. 07:00 has never been seen.
    feed(forecaster, lambda t: 12.0 if t >= 5.5 * HOUR else 10.0, 0.0, 6 * HOUR)
    # Bins 06:00-07:45 (horizon 1.5 h): those seen hold 10 or 12, the unseen ones the last hour's max, 12.
    assert forecaster.peak_over("chat", 6 * HOUR, 1.5 * HOUR) == pytest.approx(12.0)
    assert forecaster.peak_over("other", 6 * HOUR, 1.5 * HOUR) == 0.0  # nothing observed, nothing forecast


def test_a_busier_day_lifts_the_forecast_of_the_hours_ahead() -> None:
    usual, busy = plain(), plain()
    feed(usual, step_day, 0.0, 2 * DAY)
    feed(busy, step_day, 0.0, 2 * DAY)
    at = 2 * DAY + 6.5 * HOUR
    feed(usual, step_day, 2 * DAY, at + MINUTE)
    feed(busy, lambda t: 2.0 * step_day(t), 2 * DAY, at + MINUTE)  # tonight runs at twice the usual night
    # usual: the 07:00 bin, 30. busy: the level (observed / profile) has risen towards 2, so more than
    # 30 × 1.5, and at most 30 × 2 (the profile's night bins also drift up, which keeps the level under 2).
    assert usual.peak_over("chat", at, 1800.0) == pytest.approx(30.0)
    assert 45.0 < busy.peak_over("chat", at, 1800.0) <= 60.0


def test_its_own_error_widens_the_margin() -> None:
    steady, noisy = SeasonalForecaster(z=2.0, margin=0.0), SeasonalForecaster(z=2.0, margin=0.0)
    feed(steady, lambda t: 20.0, 0.0, 2 * DAY)
    # ±20 % alternating minute by minute, same mean: log errors about ±0.2, so sigma about 0.2.
    feed(noisy, lambda t: 20.0 * (1.2 if int(t // MINUTE) % 2 else 0.8), 0.0, 2 * DAY)
    assert steady.sigma("chat") == pytest.approx(0.0, abs=1e-9)
    assert 0.1 < noisy.sigma("chat") < 0.3
    # steady: 20 exactly. noisy: the recent max 24 at least, times e^(2 sigma) > e^0.2 = 1.22.
    assert steady.peak_over("chat", 2 * DAY, 1800.0) == pytest.approx(20.0)
    assert noisy.peak_over("chat", 2 * DAY, 1800.0) > 24.0 * 1.22


@pytest.mark.parametrize("reading", [math.nan, math.inf, -1.0])
def test_readings_that_are_not_loads_teach_nothing(reading: float) -> None:
    forecaster = plain()
    feed(forecaster, lambda t: 10.0, 0.0, HOUR)
    before = forecaster.peak_over("chat", HOUR, 1800.0)
    forecaster.observe("chat", HOUR, reading)
    forecaster.observe("chat", 10.0, 99.0)  # out of order: older than the last reading
    assert forecaster.peak_over("chat", HOUR, 1800.0) == before == pytest.approx(10.0)


@pytest.mark.parametrize("kwargs", [{"bin_s": 7000.0}, {"bin_s": 0.0}, {"memory_days": 0.0}, {"z": -1.0},
                                    {"margin": -0.1}, {"level_s": -5.0}])
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs)) if "bin_s" not in kwargs else "bin_s"):
        SeasonalForecaster(**kwargs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e4), min_size=1, max_size=120),
       st.floats(min_value=0.0, max_value=6 * HOUR))
def test_the_forecast_is_never_below_the_last_reading(loads: list[float], horizon: float) -> None:
    forecaster = SeasonalForecaster()
    for i, load in enumerate(loads):
        forecaster.observe("chat", i * MINUTE, load)
    now = (len(loads) - 1) * MINUTE
    assert forecaster.peak_over("chat", now, horizon) >= loads[-1]


def test_a_fixed_forecast_learns_nothing() -> None:
    fixed = FixedForecast(lambda service, t, horizon: 7.0)
    fixed.observe("chat", 0.0, 1000.0)
    assert fixed.peak_over("chat", 0.0, 1800.0) == 7.0
    assert NO_FORECAST.peak_over("chat", 0.0, 1800.0) == 0.0
