"""Load forecasts learnt from the observed load history only: a seasonal daily profile plus the recent error.

The tidal controller asks one question of a forecast: the peak load of a service over the next `horizon_s`.
`SeasonalForecaster` answers it from what it has been shown (`observe`), and from nothing else: in the
simulator it is fed the load a 1-minute rate would report, in a cluster the operator feeds it each service's
load read from Prometheus. It never sees the future or the noise-free curve.

For each service it keeps:

- a daily profile: the mean load per `bin_s` bin of the day, an exponentially weighted average over about
  `memory_days` days (the first observations of a bin are plain averages);
- the recent level: an exponentially weighted ratio of observed load to the profile, time constant
  `level_s` (a busier day than usual lifts the whole forecast, a quieter one lowers it);
- the error: an exponentially weighted variance of log(observed / what the profile and level expected),
  over about a day, from which the forecast takes a `z`-sigma margin;
- the recent maximum over `recent_s`: the forecast is never below what was just seen.

peak_over(t, h) = max(recent maximum, max over the bins of [t, t + h] of profile × level) × e^(z·σ) × (1 + margin)

Bins the profile has never seen (the first day) use the recent maximum over `cold_s` instead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from gpuplane.model.tidal import DAY_S

LoadSource = Callable[[str], float | None]
"""service → its load now (requests/s), or None when it cannot be read (the forecast keeps its history)."""


class LoadForecast(Protocol):
    """What the tidal controller needs of a forecast."""

    def observe(self, service: str, t: float, load: float) -> None:
        """The load of `service` measured at `t`."""
        ...

    def peak_over(self, service: str, t: float, horizon_s: float) -> float:
        """The peak load `service` is expected to reach over [t, t + horizon_s] (requests/s)."""
        ...


class FixedForecast:
    """A forecast given as a function (tests, or a plan known in advance): it learns nothing."""

    def __init__(self, peak_over: Callable[[str, float, float], float]) -> None:
        self._peak_over = peak_over

    def observe(self, service: str, t: float, load: float) -> None:
        pass

    def peak_over(self, service: str, t: float, horizon_s: float) -> float:
        return self._peak_over(service, t, horizon_s)


NO_FORECAST = FixedForecast(lambda service, t, horizon_s: 0.0)
"""No forecast: the policy's floors alone set the replicas."""


@dataclass(slots=True)
class _History:
    profile: npt.NDArray[np.float64]
    count: npt.NDArray[np.int64]
    recent: deque[tuple[float, float]] = field(default_factory=deque)
    level: float = 1.0
    variance: float = 0.0
    errors: int = 0
    last_t: float | None = None


class SeasonalForecaster:
    """A `LoadForecast` that learns a daily profile, the recent level and its own error from observations."""

    def __init__(self, *, bin_s: float = 900.0, memory_days: float = 3.0, level_s: float = 1800.0,
                 recent_s: float = 600.0, cold_s: float = 3600.0, error_days: float = 1.0, z: float = 2.0,
                 margin: float = 0.05, day_s: float = DAY_S) -> None:
        if bin_s <= 0 or day_s % bin_s:
            raise ValueError(f"bin_s must divide the day ({day_s:g} s), got {bin_s:g}")
        for name, value in (("memory_days", memory_days), ("level_s", level_s), ("recent_s", recent_s),
                            ("cold_s", cold_s), ("error_days", error_days)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value:g}")
        if z < 0 or margin < 0:
            raise ValueError(f"z and margin must not be negative, got {z:g}, {margin:g}")
        self.bin_s = bin_s
        self.day_s = day_s
        self.bins = int(day_s // bin_s)
        self.memory_days = memory_days
        self.level_s = level_s
        self.recent_s = recent_s
        self.cold_s = cold_s
        self.error_days = error_days
        self.z = z
        self.margin = margin
        self._services: dict[str, _History] = {}

    def _history(self, service: str) -> _History:
        history = self._services.get(service)
        if history is None:
            history = self._services[service] = _History(np.zeros(self.bins), np.zeros(self.bins, dtype=np.int64))
        return history

    def _bin(self, t: float) -> int:
        return int((t % self.day_s) // self.bin_s) % self.bins

    def observe(self, service: str, t: float, load: float) -> None:
        if not math.isfinite(load) or load < 0:
            return
        h = self._history(service)
        if h.last_t is not None and t <= h.last_t:
            return  # a repeated or out-of-order reading teaches nothing
        dt = self.bin_s if h.last_t is None else min(t - h.last_t, self.bin_s)
        h.last_t = t
        b = self._bin(t)
        expected = h.profile[b] if h.count[b] > 0 else 0.0
        if expected > 0:
            ratio = load / (expected * h.level) if expected * h.level > 0 else 0.0
            if ratio > 0:
                error = max(-1.0, min(1.0, math.log(ratio)))  # a flash crowd does not own the margin
                weight = max(1.0 / (h.errors + 1), 1.0 - math.exp(-dt / (self.error_days * self.day_s)))
                h.variance += weight * (error * error - h.variance)
                h.errors += 1
            weight = 1.0 - math.exp(-dt / self.level_s)
            h.level += weight * (min(3.0, load / expected) - h.level)
        h.count[b] += 1
        # The first observations of a bin average plainly; then the weight settles at about memory_days of them.
        weight = max(1.0 / float(h.count[b]), dt / (self.memory_days * self.bin_s))
        h.profile[b] += min(1.0, weight) * (load - h.profile[b])
        h.recent.append((t, load))
        while h.recent and h.recent[0][0] < t - max(self.recent_s, self.cold_s):
            h.recent.popleft()

    def peak_over(self, service: str, t: float, horizon_s: float) -> float:
        h = self._services.get(service)
        if h is None or not h.recent:
            return 0.0
        recent = max((v for s, v in h.recent if s >= t - self.recent_s), default=h.recent[-1][1])
        cold = max(v for _, v in h.recent)
        first = self._bin(t)
        steps = min(self.bins - 1, int((t % self.bin_s + max(0.0, horizon_s)) // self.bin_s))
        seasonal = 0.0
        for i in range(steps + 1):  # every bin [t, t + horizon_s] touches
            b = (first + i) % self.bins
            seasonal = max(seasonal, h.profile[b] * h.level if h.count[b] > 0 else cold)
        sigma = math.sqrt(h.variance)
        return max(recent, seasonal) * math.exp(self.z * sigma) * (1.0 + self.margin)

    def profile(self, service: str) -> npt.NDArray[np.float64]:
        """The learnt daily profile of `service` (0 for bins never seen)."""
        h = self._services.get(service)
        return np.zeros(self.bins) if h is None else h.profile.copy()

    def sigma(self, service: str) -> float:
        """The learnt spread of log(observed / expected)."""
        h = self._services.get(service)
        return 0.0 if h is None else math.sqrt(h.variance)
