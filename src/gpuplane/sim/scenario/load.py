"""One load model for every scenario: a diurnal shape, multiplicative noise and flash-crowd bursts.

load(t) = mean × shape(t) × noise(t) × burst(t), where

- shape(t) = 1 + a·cos(2π(t − peak)/24 h) + s·exp(−(Δt_midday / 2 h)²), a = (R − 1)/(R + 1) for a
  peak/trough ratio R and a midday shoulder s (0 by default);
- noise is lognormal with mean 1 and coefficient of variation `noise_cv`, one draw per `noise_minutes`;
- bursts arrive as a Poisson process (`bursts_per_day`), ramp up over `burst_ramp_minutes` to
  ×`burst_factor` and last `burst_minutes`.

The curve is sampled once on a fixed grid; scenarios read it by time. Its noise-free shape is what
the world does on average, never what a controller may know: forecasters learn from observed history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from gpuplane.model.tidal import DAY_S

__all__ = ["DAY_S", "LoadCurve", "LoadModel", "sample_load"]


class LoadModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    peak_trough_ratio: float = Field(default=3.0, ge=1.0, description="daily peak over daily trough")
    peak_hour: float = Field(default=20.0, ge=0.0, lt=24.0)
    midday_shoulder: float = Field(default=0.0, ge=0.0, description="added height of a bump around midday_hour")
    midday_hour: float = Field(default=12.5, ge=0.0, lt=24.0)
    noise_cv: float = Field(default=0.05, ge=0.0, le=2.0)
    noise_minutes: float = Field(default=10.0, gt=0.0)
    bursts_per_day: float = Field(default=0.0, ge=0.0)
    burst_factor: float = Field(default=3.0, ge=1.0)
    burst_minutes: float = Field(default=10.0, gt=0.0)
    burst_ramp_minutes: float = Field(default=2.0, ge=0.0)

    def shape(self, t_s: float | npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """The noise-free daily shape at `t_s` (seconds since the start, which is midnight)."""
        hours = (np.asarray(t_s, dtype=np.float64) % DAY_S) / 3600.0
        a = (self.peak_trough_ratio - 1.0) / (self.peak_trough_ratio + 1.0)
        value = 1.0 + a * np.cos(2.0 * math.pi * (hours - self.peak_hour) / 24.0)
        if self.midday_shoulder > 0:
            gap = (hours - self.midday_hour + 12.0) % 24.0 - 12.0
            value = value + self.midday_shoulder * np.exp(-((gap / 2.0) ** 2))
        return np.asarray(value)


@dataclass(frozen=True, slots=True)
class LoadCurve:
    """A sampled load: `value[i]` holds over [t[i], t[i] + step_s)."""

    step_s: float
    t: npt.NDArray[np.float64]
    shape: npt.NDArray[np.float64]
    noise: npt.NDArray[np.float64]
    burst: npt.NDArray[np.float64]
    value: npt.NDArray[np.float64]
    bursts: tuple[tuple[float, float], ...]
    """(start_s, end_s) of each flash crowd."""

    def at(self, t_s: float) -> float:
        i = min(max(int(t_s // self.step_s), 0), len(self.value) - 1)
        return float(self.value[i])

    def index(self, t_s: float) -> int:
        return min(max(int(t_s // self.step_s), 0), len(self.value) - 1)

    def peak(self) -> float:
        return float(self.value.max())


def sample_load(model: LoadModel, *, days: float, mean: float, rng: np.random.Generator,
                step_s: float = 60.0) -> LoadCurve:
    """Sample `model` over `days` on a `step_s` grid, scaled so the noise-free shape averages `mean`."""
    if days <= 0 or step_s <= 0:
        raise ValueError(f"a load curve needs days > 0 and step_s > 0, got {days}, {step_s}")
    t = np.arange(0.0, days * DAY_S, step_s)
    shape = model.shape(t)
    scale = mean / float(model.shape(np.arange(0.0, DAY_S, 60.0)).mean())
    if model.noise_cv > 0:
        windows = (t // (model.noise_minutes * 60.0)).astype(np.int64)
        sigma = math.sqrt(math.log1p(model.noise_cv ** 2))
        noise = rng.lognormal(-0.5 * sigma ** 2, sigma, int(windows.max()) + 1)[windows]
    else:
        noise = np.ones(len(t))
    burst = np.ones(len(t))
    spans: list[tuple[float, float]] = []
    starts = np.sort(rng.uniform(0.0, days * DAY_S, rng.poisson(model.bursts_per_day * days)))
    for start in starts:
        end = float(start) + model.burst_minutes * 60.0
        ramp = max(model.burst_ramp_minutes * 60.0, 1e-9)
        rising = np.clip((t - start) / ramp, 0.0, 1.0)
        inside = (t >= start) & (t < end)
        burst = np.where(inside, np.maximum(burst, 1.0 + (model.burst_factor - 1.0) * rising), burst)
        spans.append((float(start), end))
    return LoadCurve(step_s, t, shape * scale, noise, burst, shape * scale * noise * burst, tuple(spans))
