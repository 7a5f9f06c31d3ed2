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
- `ScaledObjectScaler` is the GPU scaler's whole decision path for one scaled object: read the query (at
  most once per `min_query_interval_s`), its demand query where it has one (`ValuePerRequest`: a
  saturated GPU cannot show demand beyond its capacity, the arrival rate can) and, for a non-production
  object, its activation query; feed the policy, and forecast the HPA. `gpuplane.scaler.service` serves it
  over gRPC from Prometheus; the autoscaling scenario drives the same object from a simulated Prometheus.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.model import GpuplaneError

log = logging.getLogger(__name__)


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

    @functools.cached_property
    def longest_period_s(self) -> float:
        """The longest scaling-policy period: scale events older than it no longer limit anything."""
        return max((p.period_s for r in (self.scale_up, self.scale_down) for p in r.policies), default=0.0)


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
        up_from = now - spec.scale_up.stabilization_window_s
        down_from = now - spec.scale_down.stabilization_window_s
        up = min((value for at, value in self.recommendations if at > up_from), default=desired)
        down = max((value for at, value in self.recommendations if at > down_from), default=desired)
        up, down = min(up, desired), max(down, desired)
        stabilized = min(max(current, up), down)
        longest_period = spec.longest_period_s
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
    demand_query: str | None = Field(default=None, min_length=1, description=(
        "PromQL for the requests arriving at the service (e.g. the gateway's request rate): it does not "
        "saturate as a busy GPU does, so the value reported is the larger of the query's and this rate times "
        "the query's value per request, learnt from the readings"))
    demand_halflife_s: float = Field(default=1800.0, gt=0, description=(
        "half-life of the learnt value per request: long against a flash crowd (whose saturated readings "
        "read low), short against a drifting request mix"))
    production: bool = True
    """Production services are never reported inactive (never scaled to zero)."""
    idle_cooldown_s: float = Field(default=300.0, ge=0)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=100, ge=1)
    fallback_replicas: int = Field(default=1, ge=1)
    failure_threshold: int = Field(default=3, ge=1)
    query_timeout_s: float = Field(default=2.0, gt=0)
    rise_lead_s: float = Field(default=0.0, ge=0, le=3600, description=(
        "a new replica's time from the scale-up to serving (image pull, model load, warm-up) plus the poll "
        "interval; above 0 the scaler also holds replicas for the largest rise of demand seen within that "
        "long (`RiseReserve`), so a flash crowd is served while the replicas it calls for start"))
    rise_window_s: float = Field(default=86_400.0, gt=0, description="how far back the rises are remembered")
    replica_capacity: float | None = Field(default=None, gt=0, description=(
        "the metric's value at one saturated replica (100 for DCGM_FI_DEV_GPU_UTIL): the reserve's replicas "
        "cover the risen demand at this value, not at `target` (which already holds its own headroom)"))

    @model_validator(mode="after")
    def _bounds(self) -> ScaledObjectSpec:
        if self.rise_lead_s > 0 and self.replica_capacity is None:
            raise ValueError("rise_lead_s needs replica_capacity (the metric's value at one saturated replica)")
        if self.replica_capacity is not None and self.replica_capacity < self.target:
            raise ValueError(f"replica_capacity ({self.replica_capacity}) is below target ({self.target})")
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


@dataclass(slots=True)
class ValuePerRequest:
    """The GPU metric's value per request per second, learnt from readings of both (an exponential mean over
    time with `halflife_s`). A saturated GPU reads less than its demand, and the arrival rate does not
    saturate: `estimate` is the larger of the reading and rate × the learnt ratio, so a flash crowd (or a
    service waking from zero) is seen at its size, not at the capacity it has now."""

    halflife_s: float
    ratio: float | None = None
    learnt_at: float | None = None

    def learn(self, now: float, value: float, rate: float) -> None:
        if not (value > 0 and rate > 0 and math.isfinite(value / rate)):
            return
        sample = value / rate
        if self.ratio is None or self.learnt_at is None:
            self.ratio = sample
        else:
            keep = 0.5 ** (max(now - self.learnt_at, 0.0) / self.halflife_s)
            self.ratio = keep * self.ratio + (1.0 - keep) * sample
        self.learnt_at = now

    def estimate(self, value: float, rate: float | None) -> float:
        if self.ratio is None or rate is None or not math.isfinite(rate) or rate <= 0:
            return value
        return max(value, rate * self.ratio)


class RiseReserve:
    """The largest rise of demand seen within one lead time, over a trailing window: the headroom a scaler
    holds so that what arrives while new replicas start is served.

    Each observation of an object's demand signal is compared with its value `lead_s` before (the latest
    observation at or before then); the ratio is remembered for `window_s`, and `factor` is the largest
    remembered (at least 1, at most `cap`). The signal should not saturate: the arrival rate where the object
    has a demand query (a busy GPU's reading rises as its replicas start, not as demand does). One reserve may
    be shared by several objects: a flash crowd on any of them teaches all, which a single service, seeing a
    crowd a few times a week, would learn too late. An observation whose `level` (the object's value in
    metric units) was below `floor` then (less than a replica's worth, a service waking from zero) is not
    compared: its ratios say nothing of a crowd's size. Observations come in time order.
    """

    def __init__(self, lead_s: float, window_s: float, floor: float, cap: float = 4.0) -> None:
        if lead_s <= 0 or window_s <= 0 or floor < 0 or cap < 1:
            raise ValueError(f"lead_s and window_s must be positive, floor not negative and cap at least 1, "
                             f"got {lead_s}, {window_s}, {floor}, {cap}")
        self.lead_s, self.window_s, self.floor, self.cap = lead_s, window_s, floor, cap
        self._history: dict[str, deque[tuple[float, float, float]]] = {}
        """Per object: (time, signal, level), back to the latest at or before one lead time ago."""
        self._rises: deque[tuple[float, float]] = deque()
        """(time, ratio), ratios strictly falling: the window's maximum is the first."""

    def observe(self, key: str, now: float, signal: float, level: float) -> None:
        if not (math.isfinite(signal) and math.isfinite(level)) or signal < 0:
            return
        history = self._history.setdefault(key, deque())
        if history and now < history[-1][0]:
            raise ValueError(f"{key}: observation at {now} is before the last one ({history[-1][0]})")
        then = now - self.lead_s
        while len(history) > 1 and history[1][0] <= then:
            history.popleft()
        if history and history[0][0] <= then and history[0][2] >= self.floor and history[0][1] > 0:
            ratio = min(self.cap, signal / history[0][1])
            while self._rises and self._rises[-1][1] <= ratio:
                self._rises.pop()
            self._rises.append((now, ratio))
        history.append((now, signal, level))

    def factor(self, now: float) -> float:
        while self._rises and self._rises[0][0] < now - self.window_s:
            self._rises.popleft()
        return max(1.0, self._rises[0][1]) if self._rises else 1.0


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


class MetricSource(Protocol):
    """Where the scaler reads its queries (Prometheus, through `gpuplane.scaler.prometheus.PrometheusClient`):
    one number, or an exception saying why not."""

    def query(self, query: str, *, timeout_s: float | None = None) -> float: ...


def read_metric(source: MetricSource, query: str, timeout_s: float, key: str) -> tuple[float | None, str | None]:
    """The query's value, or None and why not: a failing source never raises out of the scaler."""
    try:
        return source.query(query, timeout_s=timeout_s), None
    except GpuplaneError as exc:
        return None, str(exc)
    except Exception as exc:  # a broken source must not take the scaler down
        log.exception("%s: the metric source failed unexpectedly", key)
        return None, f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True, slots=True)
class Poll:
    """One poll of a scaled object: its report, whether it was read now (not reused), the report before
    it, and the activation and demand queries' failures where they failed."""

    report: ScalerReport
    fresh: bool
    previous: ScalerReport | None
    activation_error: str | None = None
    demand_error: str | None = None


class ScaledObjectScaler:
    """The GPU scaler's decision path for one scaled object, clock and metric source given by the caller."""

    def __init__(self, spec: ScaledObjectSpec, min_query_interval_s: float = 1.0, *,
                 reserve: RiseReserve | None = None) -> None:
        self.spec = spec
        if reserve is None and spec.rise_lead_s > 0:
            reserve = rise_reserve_for(spec)
        self.reserve = reserve
        """Where the rises of demand are learnt (shared with other objects, or this object's own); None: off."""
        self.min_query_interval_s = min_query_interval_s
        self.policy = ScalerPolicy(spec)
        self.per_request = ValuePerRequest(spec.demand_halflife_s)
        self.hpa = Hpa(spec.hpa())
        self.replicas = 0
        """The HPA algorithm's last desired count for the reported value (0: inactive, or not polled yet)."""
        self.report: ScalerReport | None = None
        self.read_at: float | None = None

    @property
    def key(self) -> str:
        return f"{self.spec.namespace}/{self.spec.name}"

    @property
    def desired(self) -> int | None:
        """The count this scaler sets, for a controller that applies it (`TidalController(replicas=...)`): the
        HPA algorithm's last count (0 when inactive), None before the first poll."""
        return None if self.report is None else self.replicas

    def poll(self, now: float, source: MetricSource) -> Poll:
        """The report now: a fresh reading, or the one taken less than `min_query_interval_s` ago."""
        if (self.report is not None and self.read_at is not None
                and 0 <= now - self.read_at < self.min_query_interval_s):
            return Poll(self.report, False, self.report)
        spec = self.spec
        value, error = read_metric(source, spec.query, spec.query_timeout_s, self.key)
        demand_error: str | None = None
        rate: float | None = None
        if value is not None and spec.demand_query is not None:
            rate, demand_error = read_metric(source, spec.demand_query, spec.query_timeout_s, self.key)
            estimate = self.per_request.estimate(value, rate)  # a failed rate leaves the GPU value alone
            if rate is not None:
                self.per_request.learn(now, value, rate)
            value = estimate
        activity: float | None = None
        activation_error: str | None = None
        if spec.activation_query is not None and not spec.production:
            # read even while the GPU query fails: at zero replicas there are no GPU series, and the
            # gateway's count is the evidence of idleness (or of demand) that remains
            activity, activation_error = read_metric(source, spec.activation_query, spec.query_timeout_s, self.key)
            if activity is None:  # unknown demand is not "no demand": read as activity, never as idle
                activity = math.inf
                activation_error = activation_error or "no value"
        if value is not None and self.reserve is not None and math.isfinite(value):
            self.reserve.observe(self.key, now, rate if rate is not None else value, value)
            assert spec.replica_capacity is not None
            value = max(value, value * self.reserve.factor(now) * spec.target / spec.replica_capacity)
        report = self.policy.observe(now, value, error, activity=activity)
        self.replicas = self._forecast(now, report)
        previous, self.report, self.read_at = self.report, report, now
        return Poll(report, True, previous, activation_error, demand_error)

    def _forecast(self, now: float, report: ScalerReport) -> int:
        """What the HPA algorithm does with the value, tracking its own last answer as the current count."""
        if not report.active:
            return 0
        hpa = self.hpa.spec
        current = self.replicas if self.replicas > 0 else hpa.min_replicas
        if math.isfinite(report.value / self.spec.target):
            wanted = average_value_replicas(report.value, self.spec.target, current, hpa.tolerance)
        else:  # a finite value so large that value / target overflows: as many as allowed
            wanted = hpa.max_replicas
        return self.hpa.step(now, current, wanted)


def rise_reserve_for(spec: ScaledObjectSpec) -> RiseReserve:
    """A reserve with the object's lead and window, comparing readings of at least one replica's target."""
    return RiseReserve(spec.rise_lead_s, spec.rise_window_s, floor=spec.target)
