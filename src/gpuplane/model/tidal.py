"""TidalPolicy: when inference shrinks, when its emptied nodes are lent to training, when they come back.

YAML form::

    services:                       # the inference services the policy manages
      - {name: chat, min_replicas: 8, max_replicas: 120, day_floor: 40}
    windows:                        # at most one loan window a day per policy; times are local HH:MM
      - {name: night, shrink_at: "22:30", lend_from: "23:30", reclaim_at: "07:30",
         night_replicas: {chat: 8}}  # optional per-service night floor (never below min_replicas)
    reclaim_headroom: 0.1           # reclaim at once when load needs more than (1 - headroom) of what is left

A window runs from `shrink_at` to `reclaim_at` (crossing midnight when `reclaim_at` is earlier); nodes are
lent from `lend_from` on. Errors name the file and the field: windows that overlap, a minimum above a
maximum, a service the cluster does not run, a night floor under a service's minimum.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import numpy.typing as npt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from gpuplane.model.errors import GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model

DAY_S = 86400.0


class TidalPolicyError(GpuplaneError):
    pass


def diurnal(t_s: npt.NDArray[np.float64], peak_trough_ratio: float, peak_hour: float) -> npt.NDArray[np.float64]:
    """The daily load curve 1 + a·cos(2π(t − peak)/24 h) at times `t_s` (seconds), a = (R − 1)/(R + 1), so
    that peak / trough = R (the diurnal inference-load model's seed form)."""
    a = (peak_trough_ratio - 1.0) / (peak_trough_ratio + 1.0)
    return np.asarray(1.0 + a * np.cos(2.0 * np.pi * (t_s - peak_hour * 3600.0) / DAY_S))


def parse_clock(value: str) -> float:
    """"HH:MM" (or "HH:MM:SS") → seconds after midnight."""
    parts = value.strip().split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise ValueError(f"{value!r} is not a time of day HH:MM")
    hours, minutes = int(parts[0]), int(parts[1])
    seconds = int(parts[2]) if len(parts) == 3 else 0
    if not (0 <= hours < 24 and 0 <= minutes < 60 and 0 <= seconds < 60):
        raise ValueError(f"{value!r} is not a time of day HH:MM")
    return float(hours * 3600 + minutes * 60 + seconds)


def _valid_clock(value: str) -> str:
    parse_clock(value)
    return value


ClockTime = Annotated[str, AfterValidator(_valid_clock)]
"""A time of day "HH:MM" (or "HH:MM:SS"), validated."""


class TidalService(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    min_replicas: int = Field(ge=0, description="the owner's guaranteed minimum (the stable subset)")
    max_replicas: int = Field(ge=1)
    day_floor: int = Field(default=0, ge=0, description="replicas kept outside loan windows, as CronHPA would")

    @model_validator(mode="after")
    def _bounds(self) -> TidalService:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        if self.day_floor > self.max_replicas:
            raise ValueError(f"day_floor {self.day_floor} is above max_replicas {self.max_replicas}")
        return self


class TidalWindow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    shrink_at: ClockTime
    lend_from: ClockTime
    reclaim_at: ClockTime
    night_replicas: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _order(self) -> TidalWindow:
        shrink, lend, reclaim = (parse_clock(t) for t in (self.shrink_at, self.lend_from, self.reclaim_at))
        length = (reclaim - shrink) % DAY_S
        if length == 0:
            raise ValueError("shrink_at and reclaim_at are the same time")
        if not 0 <= (lend - shrink) % DAY_S < length:
            raise ValueError(f"lend_from {self.lend_from} is not between shrink_at {self.shrink_at} and "
                             f"reclaim_at {self.reclaim_at}")
        return self

    @property
    def start_s(self) -> float:
        return parse_clock(self.shrink_at)

    @property
    def lend_s(self) -> float:
        return parse_clock(self.lend_from)

    @property
    def end_s(self) -> float:
        return parse_clock(self.reclaim_at)

    def phase(self, t: float) -> str:
        """"day", "shrink" (shrunk, not lending yet) or "lend" at virtual time `t` (seconds; day = t mod 86400)."""
        day_t = t % DAY_S
        since = (day_t - self.start_s) % DAY_S
        if since >= (self.end_s - self.start_s) % DAY_S:
            return "day"
        return "lend" if since >= (self.lend_s - self.start_s) % DAY_S else "shrink"

    def next_reclaim(self, t: float) -> float:
        """The next virtual time the window closes at or after `t`."""
        day_t = t % DAY_S
        return t + (self.end_s - day_t) % DAY_S


class TidalPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    services: tuple[TidalService, ...] = Field(min_length=1)
    windows: tuple[TidalWindow, ...] = Field(min_length=1)
    reclaim_headroom: float = Field(default=0.1, ge=0, lt=1)
    reclaim_grace_s: float = Field(default=120.0, ge=0, description="final-checkpoint grace of training pods")
    checkpoint_lead_s: float = Field(default=600.0, ge=0,
                                     description="training checkpoints this long before the planned reclaim")

    @model_validator(mode="after")
    def _consistent(self) -> TidalPolicy:
        names = [s.name for s in self.services]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"services defined twice: {', '.join(twice)}")
        by_name = {s.name: s for s in self.services}
        for i, window in enumerate(self.windows):
            for service, replicas in window.night_replicas.items():
                spec = by_name.get(service)
                if spec is None:
                    raise ValueError(f"windows.{i}.night_replicas: unknown service {service!r}")
                if replicas < spec.min_replicas:
                    raise ValueError(f"windows.{i}.night_replicas.{service}: {replicas} would drop {service} under "
                                     f"its minimum of {spec.min_replicas}")
                if replicas > spec.max_replicas:
                    raise ValueError(f"windows.{i}.night_replicas.{service}: {replicas} is above {service}'s "
                                     f"maximum of {spec.max_replicas}")
        spans = sorted((w.start_s, (w.end_s - w.start_s) % DAY_S, w.name) for w in self.windows)
        for (a_start, a_len, a), (b_start, _, b) in itertools.pairwise(spans):
            if b_start < a_start + a_len:
                raise ValueError(f"windows {a} and {b} overlap")
        if len(spans) > 1:
            last_start, last_len, last = spans[-1]
            first_start, _, first = spans[0]
            if last_start + last_len > DAY_S + first_start:
                raise ValueError(f"windows {last} and {first} overlap")
        return self

    def service(self, name: str) -> TidalService:
        for spec in self.services:
            if spec.name == name:
                return spec
        raise TidalPolicyError(f"unknown service {name!r}")

    def window_at(self, t: float) -> tuple[TidalWindow | None, str]:
        """The window covering `t` and its phase, or (None, "day")."""
        for window in self.windows:
            phase = window.phase(t)
            if phase != "day":
                return window, phase
        return None, "day"

    def check_services(self, running: Iterable[str]) -> None:
        """Refuse a policy that names services the cluster does not run."""
        present = set(running)
        unknown = sorted(s.name for s in self.services if s.name not in present)
        if unknown:
            raise TidalPolicyError(f"services: unknown service(s) {', '.join(unknown)} (running: "
                                   f"{', '.join(sorted(present)) or 'none'})")


@dataclass(frozen=True, slots=True)
class Loan:
    """One node lent to training: from `since` until it is returned (`returned` None while lent)."""

    node: str
    since: float
    window: str
    returned: float | None = None
    early: bool = False


def load_tidal_policy(path: str | Path) -> TidalPolicy:
    """Read and validate a TidalPolicy YAML file; errors name the file and the field."""
    return load_yaml_model(path, TidalPolicy, TidalPolicyError)
