"""A measured GPU signal: what a controller reading Prometheus sees of a service's GPUs, not their truth.

dcgm-exporter collects every `collect_interval_s` (its `-c`, 30,000 ms by default) and serves the last
collection; Prometheus scrapes it every `scrape_interval_s` (the Helm chart's ServiceMonitor: 15 s) and an
instant query returns the last scrape. So a reading is a sample of the GPUs' state that is between 0 and
collect + scrape seconds old when it is read, and a reader that polls (KEDA's `pollingInterval`, the HPA's
sync) adds its own period on top. What each field measures at a collection:

- `DCGM_FI_DEV_GPU_UTIL` (%, 0–100): the share of the driver's last sample period (1/6 s to 1 s by product)
  with a kernel running: a near-instant sample, noisy because the load within one second is;
- `DCGM_FI_PROF_GR_ENGINE_ACTIVE` and `DCGM_FI_PROF_SM_ACTIVE` (ratio, 0–1): averaged over the interval DCGM
  watches the field at, which dcgm-exporter sets to its collect interval: smoother, and older by half an
  interval on average.

Noise: a reading over a window of w seconds of one card busy a fraction u reads u·(1 + ε), ε normal with
spread `noise_cv`·√(1 s / w), clipped to [0, 1] (an assumption: the load within a second varies as request
arrivals and batch sizes do; `noise_cv` is not a measured value). A card still loading its model has a
series and reads 0. A service with no cards has no series: the query has no data.

Sources: the reference notes `tidal-colocation-autoscale.md` §4 (exporter defaults and field meanings) and §2
(KEDA's `pollingInterval`, 30 s). The noise spread and the linearity of the fields in load are assumptions.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

DcgmField = Literal["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE"]

DCGM_COLLECT_INTERVAL_S = 30.0
"""dcgm-exporter's default collect interval (`-c 30000`, `DCGM_EXPORTER_INTERVAL`)."""
SCRAPE_INTERVAL_S = 15.0
"""The dcgm-exporter Helm chart's ServiceMonitor interval (Prometheus' own default is 60 s)."""
KEDA_POLLING_S = 30.0
"""KEDA's default `pollingInterval`."""
GPU_UTIL_SAMPLE_S = 1.0
"""The longest driver sample period behind `DCGM_FI_DEV_GPU_UTIL` (1/6 s to 1 s by product)."""


class SignalSettings(BaseModel):
    """How a service's GPU load reaches a Prometheus query."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    field: DcgmField = "DCGM_FI_DEV_GPU_UTIL"
    collect_interval_s: float = Field(default=DCGM_COLLECT_INTERVAL_S, gt=0)
    scrape_interval_s: float = Field(default=SCRAPE_INTERVAL_S, gt=0)
    noise_cv: float = Field(default=0.1, ge=0, le=2, description="spread of a 1-second reading of one card")

    @property
    def scale(self) -> float:
        """The field's value for a fully busy card: 100 (percent) or 1 (ratio)."""
        return 100.0 if self.field == "DCGM_FI_DEV_GPU_UTIL" else 1.0

    @property
    def window_s(self) -> float:
        """What one collection averages over."""
        return GPU_UTIL_SAMPLE_S if self.field == "DCGM_FI_DEV_GPU_UTIL" else self.collect_interval_s

    @property
    def window_noise_cv(self) -> float:
        return self.noise_cv * math.sqrt(GPU_UTIL_SAMPLE_S / max(self.window_s, GPU_UTIL_SAMPLE_S))


class Ticker:
    """Times at a fixed period from a phase: `due(now)` is true once per period, at the first tick at or
    after each time `phase + k·period`."""

    def __init__(self, period_s: float, phase_s: float) -> None:
        self.period_s = period_s
        self.next_s = phase_s

    def due(self, now: float) -> bool:
        if now + 1e-9 < self.next_s:
            return False
        while self.next_s <= now + 1e-9:
            self.next_s += self.period_s
        return True


class IntervalAverage:
    """Means of a few values over fixed intervals: `tick(now, values)` once per step returns, when an
    interval ends at `now`, the means over it (the values of steps before `now`), else None. The first
    interval's end returns the values of the step now."""

    def __init__(self, period_s: float, phase_s: float, tick_s: float, width: int) -> None:
        self._ticker = Ticker(period_s, phase_s)
        self.tick_s = tick_s
        self._sums = [0.0] * width
        self._span_s = 0.0

    def tick(self, now: float, values: tuple[float, ...]) -> tuple[float, ...] | None:
        means: tuple[float, ...] | None = None
        if self._ticker.due(now):
            means = (tuple(total / self._span_s for total in self._sums) if self._span_s > 0 else values)
            self._sums = [0.0] * len(self._sums)
            self._span_s = 0.0
        for i, value in enumerate(values):
            self._sums[i] += value * self.tick_s
        self._span_s += self.tick_s
        return means


class DcgmSignal:
    """One service's cards through dcgm-exporter and Prometheus: call `tick` once per time step (the truth
    over the step just begun), then `query` reads `sum(<field>{service's pods})` as Prometheus answers it.

    `tick_s` is the step of the caller's clock. The exporter's and the scrape's phases are drawn from `rng`
    unless given."""

    def __init__(self, settings: SignalSettings, tick_s: float, rng: np.random.Generator,
                 phases: tuple[float, float] | None = None) -> None:
        self.settings = settings
        self.tick_s = tick_s
        self.rng = rng
        collect, scrape = settings.collect_interval_s, settings.scrape_interval_s
        collect_at, scrape_at = phases or (float(rng.uniform(0.0, collect)), float(rng.uniform(0.0, scrape)))
        self._collect = IntervalAverage(collect, collect_at, tick_s, 2)
        self._scrape = Ticker(scrape, scrape_at)
        self.exported: float | None = None
        """The exporter's last collection (None: no series)."""
        self.exported_time: float | None = None
        """The time the last collection describes (the middle of its window for averaged fields)."""
        self.scraped: float | None = None
        self.scraped_at: float | None = None
        self.sample_time: float | None = None
        """The time the last scraped value describes."""

    def tick(self, now: float, busy: float, ready: int, cards: int) -> None:
        """`busy`: the busy card-equivalents over the step from `now` (at most `ready`); `ready` cards
        serve; `cards` hold a series (ready and still loading)."""
        s = self.settings
        means = self._collect.tick(now, (busy, float(ready)))
        if means is not None:
            if cards == 0:
                self.exported = None
            elif s.window_s <= self.tick_s:  # a sample of the step now
                self.exported = self._read(busy, float(ready)) * s.scale
            else:  # averaged over the interval that just ended
                self.exported = self._read(means[0], means[1]) * s.scale
            self.exported_time = now if s.window_s <= self.tick_s else now - s.collect_interval_s / 2
        if self._scrape.due(now):
            self.scraped, self.scraped_at, self.sample_time = self.exported, now, self.exported_time

    def _read(self, busy: float, ready: float) -> float:
        """The summed reading of `ready` cards sharing `busy` evenly, each with its own noise."""
        cv = self.settings.window_noise_cv
        if busy <= 0 or ready <= 0:
            return 0.0
        if cv <= 0:
            return min(busy, ready)
        # n cards at u = busy / n each: the sum's spread is cv·u·√n = cv·busy/√n
        noisy = busy + float(self.rng.normal(0.0, cv * busy / math.sqrt(ready)))
        return min(max(noisy, 0.0), ready)

    def query(self) -> float | None:
        """The value of the last scrape, or None (no data: no series, or nothing scraped yet)."""
        return self.scraped


class ScrapedRate:
    """A request counter scraped every `scrape_interval_s`, read as `rate(counter[window])`: the increase
    between the last scrape and the last one at least `window_s` before it, per second (a window of one
    scrape interval reads as `irate`)."""

    def __init__(self, scrape_interval_s: float, window_s: float, phase_s: float) -> None:
        self.window_s = window_s
        self._scrape = Ticker(scrape_interval_s, phase_s)
        self._count = 0
        self._samples: deque[tuple[float, int]] = deque()

    def tick(self, now: float, arrivals: int) -> None:
        """`arrivals`: the requests counted over the step from `now`."""
        if self._scrape.due(now):
            self._samples.append((now, self._count))
            while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s + 1e-9:
                self._samples.popleft()
        self._count += arrivals

    def query(self) -> float | None:
        """Requests per second over the window, or None before two scrapes."""
        if len(self._samples) < 2:
            return None
        first_t, first_c = self._samples[0]
        last_t, last_c = self._samples[-1]
        return (last_c - first_c) / (last_t - first_t)
