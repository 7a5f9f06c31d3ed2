"""Autoscaling decisions: the Kubernetes HPA algorithm, KEDA's activation, and the GPU scaler's policy.

Pure and clock-injected: the simulator (`gpuplane.sim.autoscale`) and the GPU scaler service
(`gpuplane.scaler`) make the same decisions from the same code.

- `Hpa` is kube-controller-manager's replica calculation: the tolerance, the stabilisation windows
  (scale-down takes the highest recommendation in its window, scale-up the lowest), the scaling
  policies (Pods / Percent per period, `selectPolicy` Max / Min / Disabled) and min/max, with the
  defaults Kubernetes fills in (up: 4 pods or 100 % per 15 s, no window; down: 100 % per 15 s, 300 s).
- `KedaActivation` is KEDA's scale executor for 0 ↔ 1: scale up from zero when active, scale to zero only
  after `cooldown_s` without activity.
- `ScalerPolicy` is what the GPU scaler reports for one scaled object from a metric reading: the value, and
  whether the object is active. A failed reading (Prometheus down, an empty result, a dead exporter) is
  never read as zero: the last good value is kept for `failure_threshold` failed readings (KEDA's
  `failureThreshold`: fallback once failures exceed it), then the fallback (`target × fallback_replicas`,
  what KEDA's fallback feeds the HPA) is reported. The object stays active unless its activation query
  (which sees demand without the service's own pods) says it is idle. Only a non-production object is
  ever reported inactive, and only after `idle_cooldown_s` without activity.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PolicyKind(enum.Enum):
    PODS = "Pods"
    PERCENT = "Percent"


class SelectPolicy(enum.Enum):
    MAX = "Max"
    MIN = "Min"
    DISABLED = "Disabled"


class ScalingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    type: PolicyKind
    value: int = Field(gt=0)
    period_s: float = Field(gt=0, le=1800)


class ScalingRules(BaseModel):
    """One direction of an HPA's `behavior`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    stabilization_window_s: float = Field(ge=0, le=3600)
    policies: tuple[ScalingPolicy, ...]
    select_policy: SelectPolicy = SelectPolicy.MAX


DEFAULT_SCALE_UP = ScalingRules(stabilization_window_s=0, policies=(
    ScalingPolicy(type=PolicyKind.PODS, value=4, period_s=15), ScalingPolicy(type=PolicyKind.PERCENT, value=100,
                                                                            period_s=15)))
DEFAULT_SCALE_DOWN = ScalingRules(stabilization_window_s=300, policies=(
    ScalingPolicy(type=PolicyKind.PERCENT, value=100, period_s=15),))


class HpaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=100, ge=1)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN

    @model_validator(mode="after")
    def _bounds(self) -> HpaSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


_MAX_REPLICAS = 2**31 - 1
"""Kubernetes counts replicas in an int32."""


def _within(ratio: float, tolerance: float) -> bool:
    """Kubernetes' tolerance test, 1 − t ≤ ratio ≤ 1 + t (so a ratio of exactly 1.1 keeps the count)."""
    return 1.0 - tolerance <= ratio <= 1.0 + tolerance


def average_value_replicas(total: float, target: float, current: int, tolerance: float) -> int:
    """Replicas for an external `AverageValue` metric: ceil(total / target), independent of the current
    count, unless total / (target × current) is within the tolerance of 1 (then the current count)."""
    if target <= 0:
        raise ValueError(f"target must be positive, got {target}")
    if current > 0 and _within(total / (target * current), tolerance):
        return current
    wanted = total / target
    if not math.isfinite(wanted) or wanted >= _MAX_REPLICAS:
        return _MAX_REPLICAS  # the HPA's max clamps it
    return math.ceil(wanted - 1e-9)


def utilization_replicas(utilization: float, target: float, current: int, tolerance: float) -> int:
    """Replicas for a resource `Utilization` target (CPU-style): ceil(current × utilization / target)."""
    if target <= 0:
        raise ValueError(f"target must be positive, got {target}")
    ratio = utilization / target
    if current == 0 or _within(ratio, tolerance):
        return current
    return math.ceil(current * ratio - 1e-9)


@dataclass(slots=True)
class Hpa:
    """One HorizontalPodAutoscaler's memory: its recent recommendations and scale events."""

    spec: HpaSpec
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)
    events: deque[tuple[float, int]] = field(default_factory=deque)
    """(time, replica change) of its own scalings."""

    def step(self, now: float, current: int, desired: int) -> int:
        """The replicas to set now, given the metric's raw recommendation `desired`."""
        spec = self.spec
        self.recommendations.append((now, desired))
        longest = max(spec.scale_up.stabilization_window_s, spec.scale_down.stabilization_window_s)
        while self.recommendations and self.recommendations[0][0] < now - longest:
            self.recommendations.popleft()
        up, down = desired, desired
        for at, value in self.recommendations:
            if at > now - spec.scale_up.stabilization_window_s:
                up = min(up, value)
            if at > now - spec.scale_down.stabilization_window_s:
                down = max(down, value)
        stabilized = min(max(current, up), down)
        longest_period = max((p.period_s for r in (spec.scale_up, spec.scale_down) for p in r.policies), default=0)
        while self.events and self.events[0][0] < now - longest_period:
            self.events.popleft()
        # kube never lets a rate limit move the count the other way: an up limit below the current count
        # (after a scale-down within the period) holds it, and so does a down limit above it
        if stabilized > current:
            target = min(stabilized, max(self._up_limit(now, current), current), spec.max_replicas)
        elif stabilized < current:
            target = max(stabilized, min(self._down_limit(now, current), current), spec.min_replicas)
        else:
            target = current
        target = min(max(target, spec.min_replicas), spec.max_replicas)
        if target != current:
            self.events.append((now, target - current))
        return target

    def _period_start(self, now: float, current: int, period_s: float) -> int:
        """Replicas at the start of the period: the current count less every change within it, up and down
        (kubernetes#109058)."""
        return current - sum(delta for at, delta in self.events if at > now - period_s)

    def _up_limit(self, now: float, current: int) -> int:
        rules = self.spec.scale_up
        if rules.select_policy is SelectPolicy.DISABLED:
            return current
        limits = []
        for p in rules.policies:
            start = self._period_start(now, current, p.period_s)
            limits.append(start + p.value if p.type is PolicyKind.PODS
                          else math.ceil(start * (1 + p.value / 100.0) - 1e-9))
        if not limits:
            return current
        return max(limits) if rules.select_policy is SelectPolicy.MAX else min(limits)

    def _down_limit(self, now: float, current: int) -> int:
        rules = self.spec.scale_down
        if rules.select_policy is SelectPolicy.DISABLED:
            return current
        limits = []
        for p in rules.policies:
            start = self._period_start(now, current, p.period_s)
            # kube truncates the percent scale-down limit: int32(start × (1 − value/100))
            limits.append(start - p.value if p.type is PolicyKind.PODS
                          else math.floor(start * (1 - p.value / 100.0) + 1e-9))
        if not limits:
            return current
        return min(limits) if rules.select_policy is SelectPolicy.MAX else max(limits)


@dataclass(slots=True)
class KedaActivation:
    """KEDA's scale executor between zero and one (`minReplicaCount` 0)."""

    min_replicas: int = 0
    cooldown_s: float = 300.0
    last_active: float | None = None

    def target(self, now: float, active: bool, current: int) -> int | None:
        """Replicas KEDA sets now, or None when it leaves them to the HPA."""
        if active:
            self.last_active = now
            if current == 0:
                return max(self.min_replicas, 1)
            return None
        if current > 0 and self.min_replicas == 0:
            since = self.last_active if self.last_active is not None else -math.inf
            return 0 if since + self.cooldown_s < now else None
        if current < self.min_replicas:
            return self.min_replicas
        return None


class ScaledObjectSpec(BaseModel):
    """One service the GPU scaler serves (what a KEDA ScaledObject's trigger metadata names)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1)
    namespace: str = Field(default="default", min_length=1)
    query: str = Field(min_length=1, description="PromQL returning one element")
    target: float = Field(gt=0, description="per-replica target of the metric (AverageValue)")
    activation_threshold: float = Field(default=0.0, ge=0)
    activation_query: str | None = Field(default=None, min_length=1, description=(
        "PromQL that sees demand while no replica runs (e.g. the gateway's request rate); without it the "
        "GPU metric decides activity, and a service at zero replicas has no GPU metric to wake it"))
    production: bool = True
    """Production services are never reported inactive (never scaled to zero)."""
    idle_cooldown_s: float = Field(default=300.0, ge=0)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=100, ge=1)
    fallback_replicas: int = Field(default=1, ge=1)
    failure_threshold: int = Field(default=3, ge=1)
    query_timeout_s: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> ScaledObjectSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        if self.fallback_replicas > self.max_replicas:
            raise ValueError(f"fallback_replicas ({self.fallback_replicas}) is above max_replicas "
                             f"({self.max_replicas})")
        if self.production and self.min_replicas == 0:
            raise ValueError("min_replicas 0 is for non-production services (set production: false)")
        return self

    def hpa(self) -> HpaSpec:
        return HpaSpec(min_replicas=max(self.min_replicas, 1), max_replicas=self.max_replicas)


class ReadingSource(enum.Enum):
    METRIC = "metric"
    LAST_GOOD = "last-good"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class ScalerReport:
    """What the scaler tells KEDA for one object at one poll."""

    value: float
    active: bool
    source: ReadingSource
    error: str | None = None


@dataclass(slots=True)
class ScalerPolicy:
    """Per scaled object: turns metric readings (or failures) into the value and activity KEDA gets."""

    spec: ScaledObjectSpec
    last_good: float | None = None
    failures: int = 0
    last_active: float | None = None

    def observe(self, now: float, value: float | None, error: str | None = None, *,
                activity: float | None = None) -> ScalerReport:
        """A reading: `value`, or None with the `error` that prevented it (never read as zero). `activity`
        is the activation query's value where the object has one (else the value decides activity)."""
        spec = self.spec
        if value is not None and math.isfinite(value):
            self.last_good, self.failures = value, 0
            signal = activity if activity is not None else value
            if signal > spec.activation_threshold:
                self.last_active = now
            return ScalerReport(value, self._active(now), ReadingSource.METRIC)
        self.failures += 1
        reason = error or f"non-finite value {value!r}"
        # A failed metric says nothing about demand: active, unless an activation reading says otherwise
        # (a non-production service at zero replicas has no GPU metric, but its gateway still counts requests).
        active = True
        if activity is not None and math.isfinite(activity):
            if activity > spec.activation_threshold:
                self.last_active = now
            active = self._active(now)
        if self.last_good is not None and self.failures <= spec.failure_threshold:
            return ScalerReport(self.last_good, active, ReadingSource.LAST_GOOD, reason)
        return ScalerReport(spec.target * spec.fallback_replicas, active, ReadingSource.FALLBACK, reason)

    def _active(self, now: float) -> bool:
        """Production: always. Otherwise: activity (a value above the activation threshold, strictly, as
        KEDA compares) at most `idle_cooldown_s` ago."""
        if self.spec.production:
            return True
        return self.last_active is not None and now - self.last_active <= self.spec.idle_cooldown_s
