"""The autoscaling scenario: inference services on the kit's load model, provisioned statically for their
peak, by a CPU-style HPA, and by the GPU scaler (KEDA + HPA on a DCGM metric), with an oracle as reference.

World, per service (one GPU per replica; a replica serves one GPU-second of work per second):
- demand(t) = rate(t) × work per request(t), in cards busy. The rate is the kit's load model
  (`sample_load`: diurnal shape, lognormal noise, flash crowds); the work per request drifts (a
  mean-reverting log drift per hour with spread `mix_drift_cv`: longer prompts, larger batches), and CPU
  work per request does not.
- The last `non_production_services` get load only in working hours.
- A new replica serves after `startup_s`; a removed one stops at once (the newest, still starting, first).
  Demand above the ready replicas is shortage.

Arms (the autoscalers decide on the HPA's `hpa_sync_s`, KEDA on its `keda_polling_s`):
- `static-peak` (baseline): each service held at the replicas its own highest demand of the run needs, at
  100 %: what operators do today, in its best configuration (it knows the run's peak, bursts included),
  so it is never short;
- `cpu-hpa` (baseline): Kubernetes' HPA on CPU utilisation from metrics-server (a mean over
  `metrics_resolution_s`, refreshed as often), its target set so that the mean request mix sits at the
  GPU target (the calibration a load test gives), replicas still starting counted at 0 % CPU, as kube
  does; it cannot scale to zero;
- `gpu-scaler` (ours): the shipping decision path, `ScaledObjectScaler` of `gpuplane.controllers.autoscale`
  (what `gpuplane scaler` serves to KEDA), reading `sum(<dcgm field>)` of the service's pods from a
  simulated Prometheus (`gpuplane.sim.scenario.signal`: dcgm-exporter's collect interval, the scrape,
  measurement noise, no data without pods) and, for non-production services, the gateway's request rate as
  its activation query; KEDA's scale executor (`KedaActivation`) for 0 ↔ 1 at each poll and KEDA's HPA
  (`Hpa`, AverageValue) for 1 ↔ N at each sync;
- `oracle` (reference, not a baseline): replicas = ceil(demand / target) at every step, ready at once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from gpuplane.controllers.autoscale import (
    Hpa,
    HpaSpec,
    KedaActivation,
    ScaledObjectScaler,
    ScaledObjectSpec,
    average_value_replicas,
    utilization_replicas,
)
from gpuplane.model import GpuplaneError
from gpuplane.model.tidal import ClockTime, parse_clock
from gpuplane.sim.scenario import (
    DAY_S,
    Figures,
    Goal,
    Headline,
    LoadModel,
    Progress,
    ScenarioSettings,
    Table,
    figure,
    sample_load,
    series,
)
from gpuplane.sim.scenario.signal import (
    DCGM_COLLECT_INTERVAL_S,
    KEDA_POLLING_S,
    SCRAPE_INTERVAL_S,
    DcgmField,
    DcgmSignal,
    IntervalAverage,
    ScrapedRate,
    SignalSettings,
    Ticker,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

ARMS = ("static-peak", "cpu-hpa", "gpu-scaler", "oracle")
WARMUP_S = 900.0
"""The autoscalers run this long on the first step's load before the run counts: a service that has been
running (metrics scraped, the HPA's windows filled), not one created at the start."""
OURS = "gpu-scaler"


class AutoscaleSettings(ScenarioSettings):
    """Every parameter of the autoscaling scenario; a YAML field or a `--set` flag each."""

    days: float = Field(default=2.0, gt=0, le=30)
    tick_s: float = Field(default=5.0, gt=0, le=15, description="simulation step: the truth is constant over one")
    services: int = Field(default=6, ge=1, le=200)
    non_production_services: int = Field(default=2, ge=0)
    mean_gpus: float = Field(default=12.0, gt=0, le=10_000, description="mean demand of a service, cards busy")
    service_size_spread: float = Field(default=0.5, ge=0, lt=1, description="services are mean × U(1 ± spread)")
    peak_trough_ratio: float = Field(default=2.5, ge=1, le=20)
    peak_hour: float = Field(default=21.0, ge=0, lt=24)
    noise_cv: float = Field(default=0.08, ge=0, le=2, description="load noise per noise_minutes window")
    noise_minutes: float = Field(default=5.0, gt=0)
    bursts_per_day: float = Field(default=2.0, ge=0, le=100)
    burst_factor: float = Field(default=3.0, ge=1, le=20)
    burst_minutes: float = Field(default=10.0, gt=0)
    burst_ramp_minutes: float = Field(default=2.0, ge=0, description="a flash crowd builds up over this long")
    mix_drift_cv: float = Field(default=0.15, ge=0, le=2, description="hourly log drift of GPU work per request")
    working_hours_start: ClockTime = "09:00"
    working_hours_end: ClockTime = "19:00"
    startup_s: float = Field(default=60.0, ge=0, description="a new replica serves after this long (model load)")
    target_util_pct: float = Field(default=70.0, gt=0, le=100, description="per-replica GPU target of both HPAs")
    max_replicas: int = Field(default=200, ge=1)
    hpa_sync_s: float = Field(default=15.0, gt=0, description="--horizontal-pod-autoscaler-sync-period")
    dcgm_field: DcgmField = "DCGM_FI_DEV_GPU_UTIL"
    dcgm_collect_interval_s: float = Field(default=DCGM_COLLECT_INTERVAL_S, gt=0,
                                           description="dcgm-exporter's collect interval (-c)")
    scrape_interval_s: float = Field(default=SCRAPE_INTERVAL_S, gt=0, description="Prometheus' scrape of it")
    signal_noise_cv: float = Field(default=0.1, ge=0, le=2,
                                   description="spread of a 1-second reading of one card (an assumption)")
    keda_polling_s: float = Field(default=KEDA_POLLING_S, gt=0, description="KEDA's pollingInterval")
    keda_use_cached_metrics: bool = Field(default=False, description=(
        "KEDA's useCachedMetrics: the HPA gets the value of KEDA's last poll instead of a fresh reading"))
    keda_external_push: bool = Field(default=False, description=(
        "the trigger is external-push: the scaler's StreamIsActive wakes a service from zero between polls"))
    keda_cooldown_s: float = Field(default=300.0, ge=0, description="KEDA's cooldownPeriod (to zero)")
    idle_cooldown_s: float = Field(default=300.0, ge=0, description="the scaler's idle cooldown (non-production)")
    activation_window_s: float = Field(default=60.0, gt=0, description="the gateway queries' rate() window")
    requests_per_gpu_s: float = Field(default=1.0, gt=0, description=(
        "requests a card serves per second at the mean mix (an assumption; the gateway counts them)"))
    gpu_scaler_demand_query: bool = Field(default=True, description=(
        "the GPU scaler's objects name the gateway's request rate as their demand query"))
    cpu_at_gpu_saturation_pct: float = Field(default=40.0, gt=0, le=100, description=(
        "CPU use of a replica whose GPU is saturated, at the mean request mix"))
    metrics_resolution_s: float = Field(default=15.0, gt=0, description="metrics-server's --metric-resolution")

    @model_validator(mode="after")
    def _consistent(self) -> AutoscaleSettings:
        if self.non_production_services > self.services:
            raise ValueError(f"non_production_services ({self.non_production_services}) is above services "
                             f"({self.services})")
        return self

    @property
    def steps(self) -> int:
        return math.ceil(self.days * DAY_S / self.tick_s)

    @property
    def cpu_target_pct(self) -> float:
        """The CPU-style HPA's target: the CPU use of a replica at the GPU target, at the mean mix."""
        return self.cpu_at_gpu_saturation_pct * self.target_util_pct / 100.0

    def load_model(self) -> LoadModel:
        return LoadModel(peak_trough_ratio=self.peak_trough_ratio, peak_hour=self.peak_hour, noise_cv=self.noise_cv,
                         noise_minutes=self.noise_minutes, bursts_per_day=self.bursts_per_day,
                         burst_factor=self.burst_factor, burst_minutes=self.burst_minutes,
                         burst_ramp_minutes=self.burst_ramp_minutes)

    def signal(self) -> SignalSettings:
        return SignalSettings(field=self.dcgm_field, collect_interval_s=self.dcgm_collect_interval_s,
                              scrape_interval_s=self.scrape_interval_s, noise_cv=self.signal_noise_cv)


# -- the world ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServiceLoad:
    name: str
    production: bool
    rate: FloatArray
    """Requests per second, in requests of the mean mix's size (one GPU-second each), per step."""
    mix: FloatArray
    """GPU work per request relative to the mean, per step (CPU work per request is constant)."""

    @property
    def demand(self) -> FloatArray:
        """Cards busy at 100 % per step."""
        return self.rate * self.mix


def service_loads(s: AutoscaleSettings, rng: np.random.Generator) -> list[ServiceLoad]:
    model = s.load_model()
    loads = []
    start_s, end_s = parse_clock(s.working_hours_start), parse_clock(s.working_hours_end)
    for i in range(s.services):
        production = i < s.services - s.non_production_services
        mean = s.mean_gpus * rng.uniform(1 - s.service_size_spread, 1 + s.service_size_spread)
        curve = sample_load(model, days=s.days, mean=mean, rng=rng, step_s=s.tick_s)
        t = curve.t[: s.steps]
        rate = curve.value[: s.steps]
        hours = (t // 3600.0).astype(np.int64)
        # a mean-reverting (AR(1), 0.9 per hour) log drift whose spread is mix_drift_cv
        drift = np.zeros(int(hours.max()) + 1)
        shocks = rng.normal(0.0, s.mix_drift_cv * math.sqrt(1 - 0.9 ** 2), len(drift))
        drift[0] = rng.normal(0.0, s.mix_drift_cv)
        for h in range(1, len(drift)):
            drift[h] = 0.9 * drift[h - 1] + shocks[h]
        mix = np.exp(drift)[hours]
        if not production:
            clock = t % DAY_S
            working = ((clock >= start_s) & (clock < end_s)) if start_s <= end_s else (
                (clock >= start_s) | (clock < end_s))
            rate = np.where(working, rate, 0.0)
        loads.append(ServiceLoad(f"svc-{i}" if production else f"dev-{i}", production, rate, mix))
    return loads


class Replicas:
    """A replica count with a start-up delay: `ready(now)` counts replicas started `startup_s` ago or more."""

    def __init__(self, initial: int, startup_s: float) -> None:
        self.starting: deque[float] = deque()
        self.running = initial
        self.startup_s = startup_s
        self.events = 0

    @property
    def total(self) -> int:
        return self.running + len(self.starting)

    def set(self, now: float, target: int) -> None:
        if target == self.total:
            return
        self.events += 1
        while self.total < target:
            self.starting.append(now + self.startup_s)
        while self.total > target:
            if self.starting:
                self.starting.pop()  # a ReplicaSet deletes pods not yet ready first, the newest of them first
            else:
                self.running -= 1

    def ready(self, now: float) -> int:
        while self.starting and self.starting[0] <= now:
            self.starting.popleft()
            self.running += 1
        return self.running


@dataclass(frozen=True, slots=True)
class ServiceRun:
    replicas: IntArray
    """Replicas holding a card per step (running and starting)."""
    ready: IntArray
    scale_events: int
    signal_age_s: float = 0.0
    """Mean age of the GPU metric's sample when the HPA read it (the gpu-scaler arm)."""
    signal_error_pct: float = 0.0
    """Mean |value − demand| / demand of the value the HPA read, in cards, in % (the gpu-scaler arm)."""


class NoData(GpuplaneError):
    """The simulated Prometheus has no series for a query (as an empty vector is an error to the scaler)."""


class SimPrometheus:
    """A `MetricSource` over one service's simulated series: each query the scaled object names, read from
    its signal (None: an empty result, which the scaler gets as an error, as from Prometheus)."""

    def __init__(self, series: dict[str, Callable[[], float | None]]) -> None:
        self.series = series

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        read = self.series.get(query)
        if read is None:
            raise NoData(f"query {query!r}: no such series in the simulated Prometheus")
        value = read()
        if value is None:
            raise NoData(f"query {query!r}: no data: exporter down or query matches nothing")
        return value


def _static_peak(load: ServiceLoad) -> ServiceRun:
    level = max(1, math.ceil(float(load.demand.max()) - 1e-9))
    plan = np.full(len(load.demand), level, np.int64)
    return ServiceRun(plan, plan, 0)


def _oracle(s: AutoscaleSettings, load: ServiceLoad) -> ServiceRun:
    plan = np.ceil(load.demand / (s.target_util_pct / 100.0) - 1e-9).astype(np.int64)
    if load.production:
        plan = np.maximum(plan, 1)
    return ServiceRun(plan, plan, int((np.diff(plan) != 0).sum()))


def _initial(s: AutoscaleSettings, load: ServiceLoad) -> int:
    """Autoscalers start in the steady state for the first step's demand."""
    return min(max(math.ceil(float(load.demand[0]) / (s.target_util_pct / 100.0) - 1e-9), 1), s.max_replicas)


def _warmup_steps(s: AutoscaleSettings) -> int:
    return math.ceil(WARMUP_S / s.tick_s)


def _cpu_hpa(s: AutoscaleSettings, load: ServiceLoad, rng: np.random.Generator) -> ServiceRun:
    steps, demand = s.steps, load.demand
    replicas, ready = np.zeros(steps, np.int64), np.zeros(steps, np.int64)
    pool = Replicas(_initial(s, load), s.startup_s)
    hpa = Hpa(HpaSpec(min_replicas=1, max_replicas=s.max_replicas))
    sync = Ticker(s.hpa_sync_s, 0.0)
    metrics = IntervalAverage(s.metrics_resolution_s, float(rng.uniform(0.0, s.metrics_resolution_s)), s.tick_s, 1)
    cpu: float | None = None
    warmup = _warmup_steps(s)
    for k in range(warmup + steps):
        now, i = k * s.tick_s, max(k - warmup, 0)
        up = pool.ready(now)
        served = min(float(demand[i]), float(up))
        # CPU follows requests, not GPU work; pods still starting count as 0 % (kube's rule on scale-up)
        utilisation = s.cpu_at_gpu_saturation_pct * served / float(load.mix[i]) / pool.total if pool.total else 0.0
        window = metrics.tick(now, (utilisation,))
        if window is not None:
            cpu = window[0]
        if sync.due(now) and cpu is not None:
            current = pool.total
            desired = utilization_replicas(cpu, s.cpu_target_pct, current, 0.1)
            pool.set(now, hpa.step(now, current, max(desired, 1)))
        if k >= warmup:
            replicas[i], ready[i] = max(pool.total, up), up  # a card removed now served this step
    return ServiceRun(replicas, ready, pool.events)


def gpu_scaled_object(s: AutoscaleSettings, load: ServiceLoad) -> ScaledObjectSpec:
    """The scaled object an operator would configure for `load` (an object that may scale to zero reads 0
    without series, `… or on() vector(0)`, as docs/autoscaling.md advises)."""
    signal = s.signal()
    query = f'sum({signal.field}{{namespace="serving",pod=~"{load.name}-.*"}})'
    if not load.production:
        query += " or on() vector(0)"
    rate = f'sum(rate(gateway_requests_total{{service="{load.name}"}}[1m]))'
    return ScaledObjectSpec(
        name=load.name, namespace="serving", query=query, target=s.target_util_pct / 100.0 * signal.scale,
        activation_query=rate, demand_query=rate if s.gpu_scaler_demand_query else None,
        production=load.production, idle_cooldown_s=s.idle_cooldown_s, min_replicas=1 if load.production else 0,
        max_replicas=s.max_replicas)


def _gpu_scaler(s: AutoscaleSettings, load: ServiceLoad, rng: np.random.Generator) -> ServiceRun:
    steps, demand = s.steps, load.demand
    replicas, ready = np.zeros(steps, np.int64), np.zeros(steps, np.int64)
    spec = gpu_scaled_object(s, load)
    signal = s.signal()
    gpu = DcgmSignal(signal, s.tick_s, rng)
    gateway = ScrapedRate(s.scrape_interval_s, s.activation_window_s, float(rng.uniform(0.0, s.scrape_interval_s)))

    def gpu_value() -> float | None:
        value = gpu.query()
        if value is None and not load.production and gpu.scraped_at is not None:
            return 0.0  # `or on() vector(0)`
        return value

    assert spec.activation_query is not None
    prometheus = SimPrometheus({spec.query: gpu_value, spec.activation_query: gateway.query})
    scaler = ScaledObjectScaler(spec)
    keda = KedaActivation(min_replicas=spec.min_replicas, cooldown_s=s.keda_cooldown_s)
    hpa = Hpa(spec.hpa())
    pool = Replicas(_initial(s, load), s.startup_s)
    sync = Ticker(s.hpa_sync_s, 0.0)
    polling = Ticker(s.keda_polling_s, float(rng.uniform(0.0, s.keda_polling_s)))
    polled: float | None = None
    ages: list[float] = []
    errors: list[float] = []
    warmup = _warmup_steps(s)
    arrivals = rng.poisson(load.rate * s.requests_per_gpu_s * s.tick_s)
    for k in range(warmup + steps):
        now, i = k * s.tick_s, max(k - warmup, 0)
        up = pool.ready(now)
        served = min(float(demand[i]), float(up))
        gpu.tick(now, served, up, pool.total)
        gateway.tick(now, int(arrivals[i]))
        if polling.due(now):  # KEDA's poll: GetMetrics, then IsActive (one reading), then 0 <-> 1
            report = scaler.poll(now, prometheus).report
            polled = report.value
            to = keda.target(now, report.active, pool.total)
            if to is not None:
                pool.set(now, to)
        elif s.keda_external_push and pool.total == 0 and scaler.poll(now, prometheus).report.active:
            # StreamIsActive (the scaler re-reads every min_query_interval_s): KEDA wakes it between polls
            pool.set(now, keda.target(now, True, 0) or 1)
        if sync.due(now) and pool.total >= 1:  # KEDA's HPA, 1 <-> N
            if s.keda_use_cached_metrics and polled is not None:
                value = polled
            else:
                value = scaler.poll(now, prometheus).report.value
            if k >= warmup and gpu.sample_time is not None and demand[i] > 0:
                ages.append(now - gpu.sample_time)
                errors.append(abs(value / signal.scale - float(demand[i])) / float(demand[i]))
            current = pool.total
            desired = average_value_replicas(value, spec.target, current, hpa.spec.tolerance)
            pool.set(now, hpa.step(now, current, max(desired, 1)))
        if k >= warmup:
            replicas[i], ready[i] = max(pool.total, up), up  # a card removed now served this step
    return ServiceRun(replicas, ready, pool.events, float(np.mean(ages)) if ages else 0.0,
                      100.0 * float(np.mean(errors)) if errors else 0.0)


# -- figures ------------------------------------------------------------------------------------------------


class AutoscaleFigures(Figures):
    """One run of every arm on the same services."""

    demand_gpu_hours: float = figure("all", "GPU-hours of work the services were asked for", "GPU-h")
    static_peak_gpu_hours: float = figure("static-peak", "GPU-hours held, each service at its run's peak", "GPU-h")
    cpu_hpa_gpu_hours: float = figure("cpu-hpa", "GPU-hours held (running and starting replicas)", "GPU-h")
    cpu_hpa_shortage_minutes: float = figure("cpu-hpa", "service-minutes with demand above the ready replicas",
                                             "service-min")
    cpu_hpa_unserved_pct: float = figure("cpu-hpa", "demand above the ready replicas, share of all demand", "%")
    cpu_hpa_gpu_hours_saved_vs_static_peak_pct: float = figure("cpu-hpa", "GPU-hours below static-peak's", "%")
    cpu_hpa_scale_events: int = figure("cpu-hpa", "replica count changes")
    gpu_scaler_gpu_hours: float = figure(OURS, "GPU-hours held (running and starting replicas)", "GPU-h")
    gpu_scaler_shortage_minutes: float = figure(OURS, "service-minutes with demand above the ready replicas",
                                                "service-min")
    gpu_scaler_unserved_pct: float = figure(OURS, "demand above the ready replicas, share of all demand", "%")
    gpu_scaler_gpu_hours_saved_vs_static_peak_pct: float = figure(OURS, "GPU-hours below static-peak's", "%")
    gpu_scaler_shortage_cut_vs_cpu_hpa_pct: float = figure(
        OURS, "shortage minutes below the CPU-style HPA's (100: none where it had some; −100: some where it "
              "had none)", "%")
    gpu_scaler_gpu_hours_vs_oracle_pct: float = figure(OURS, "GPU-hours above the oracle's", "%")
    gpu_scaler_scale_events: int = figure(OURS, "replica count changes")
    gpu_scaler_zero_replica_service_hours: float = figure(OURS, "service-hours at zero replicas", "service-h")
    gpu_scaler_signal_age_s: float = figure(OURS, "mean age of the GPU sample the HPA read (exporter + scrape)",
                                            "s")
    gpu_scaler_signal_error_pct: float = figure(OURS, "mean |value − demand| / demand of the value the HPA read",
                                                "%")
    oracle_gpu_hours: float = figure("oracle", "GPU-hours of ceil(demand / target) at every step", "GPU-h")
    wall_s: float = Field(default=0.0, exclude=True)
    trace_names: tuple[str, ...] = series("the services traced (one production, one non-production)")
    trace_demand: tuple[tuple[float, ...], ...] = series("per traced service: demand per minute, cards busy")
    trace_ready: tuple[tuple[tuple[float, ...], ...], ...] = series(
        "per traced service, per arm (ARMS order): ready replicas per minute")


def _pct_below(ours: float, base: float) -> float:
    return 100.0 * (base - ours) / base if base > 0 else 0.0


def _shortage_cut(ours: float, base: float) -> float:
    if base > 0:
        return 100.0 * (base - ours) / base
    return 0.0 if ours <= 0 else -100.0


def _per_minute(values: FloatArray | IntArray, tick_s: float) -> tuple[float, ...]:
    per = max(1, round(60.0 / tick_s))
    cut = len(values) // per * per
    return tuple(float(v) for v in np.asarray(values[:cut], np.float64).reshape(-1, per).mean(axis=1))


def figures_of(s: AutoscaleSettings, loads: Sequence[ServiceLoad], runs: dict[str, list[ServiceRun]]) \
        -> AutoscaleFigures:
    hours = s.tick_s / 3600.0

    def gpu_hours(arm: str) -> float:
        return float(sum(r.replicas.sum() for r in runs[arm])) * hours

    def shortage(arm: str) -> tuple[float, float]:
        minutes, unserved = 0.0, 0.0
        for load, run in zip(loads, runs[arm], strict=True):
            gap = load.demand - run.ready
            minutes += float((gap > 1e-9).sum()) * s.tick_s / 60.0
            unserved += float(np.clip(gap, 0.0, None).sum())
        total = float(sum(load.demand.sum() for load in loads))
        return minutes, 100.0 * unserved / total if total > 0 else 0.0

    peak, oracle, cpu, ours = (gpu_hours(a) for a in ("static-peak", "oracle", "cpu-hpa", OURS))
    cpu_short, cpu_unserved = shortage("cpu-hpa")
    our_short, our_unserved = shortage(OURS)
    shown = ([i for i, ld in enumerate(loads) if ld.production][:1]
             + [i for i, ld in enumerate(loads) if not ld.production][:1])
    scaled = runs[OURS]
    return AutoscaleFigures(
        demand_gpu_hours=float(sum(ld.demand.sum() for ld in loads)) * hours,
        static_peak_gpu_hours=peak, cpu_hpa_gpu_hours=cpu, cpu_hpa_shortage_minutes=cpu_short,
        cpu_hpa_unserved_pct=cpu_unserved, cpu_hpa_gpu_hours_saved_vs_static_peak_pct=_pct_below(cpu, peak),
        cpu_hpa_scale_events=sum(r.scale_events for r in runs["cpu-hpa"]),
        gpu_scaler_gpu_hours=ours, gpu_scaler_shortage_minutes=our_short, gpu_scaler_unserved_pct=our_unserved,
        gpu_scaler_gpu_hours_saved_vs_static_peak_pct=_pct_below(ours, peak),
        gpu_scaler_shortage_cut_vs_cpu_hpa_pct=_shortage_cut(our_short, cpu_short),
        gpu_scaler_gpu_hours_vs_oracle_pct=-_pct_below(ours, oracle),
        gpu_scaler_scale_events=sum(r.scale_events for r in scaled),
        gpu_scaler_zero_replica_service_hours=float(sum((r.replicas == 0).sum() for r in scaled)) * hours,
        gpu_scaler_signal_age_s=float(np.mean([r.signal_age_s for r in scaled])),
        gpu_scaler_signal_error_pct=float(np.mean([r.signal_error_pct for r in scaled])),
        oracle_gpu_hours=oracle,
        trace_names=tuple(loads[i].name for i in shown),
        trace_demand=tuple(_per_minute(loads[i].demand, s.tick_s) for i in shown),
        trace_ready=tuple(tuple(_per_minute(runs[arm][i].ready, s.tick_s) for arm in ARMS) for i in shown))


def run_autoscale(s: AutoscaleSettings, progress: Progress) -> AutoscaleFigures:
    """Every arm on the same service loads; each arm's measurement randomness from its own stream."""
    rng = np.random.default_rng(s.seed)
    loads = service_loads(s, rng)
    streams = np.random.default_rng([s.seed, 1]).spawn(2 * len(loads))
    runs: dict[str, list[ServiceRun]] = {arm: [] for arm in ARMS}
    total = len(loads)
    for j, load in enumerate(loads):
        progress("services", j, total)
        runs["static-peak"].append(_static_peak(load))
        runs["oracle"].append(_oracle(s, load))
        runs["cpu-hpa"].append(_cpu_hpa(s, load, streams[2 * j]))
        runs[OURS].append(_gpu_scaler(s, load, streams[2 * j + 1]))
    progress("services", total, total)
    return figures_of(s, loads, runs)


# -- the scenario -----------------------------------------------------------------------------------------


def _row(label: str, fmt: str, *values: float | None) -> tuple[str, ...]:
    return (label, *("–" if v is None else format(v, fmt) for v in values))


class AutoscaleScenarioDef:
    name = "autoscale"
    title = "GPU-metric autoscaling against static peak provisioning and a CPU-style HPA"
    settings = AutoscaleSettings
    figures = AutoscaleFigures
    ours = OURS
    arms = ARMS
    goals = (
        Goal("shortage at least 50 % below the CPU-style HPA's", "gpu_scaler_shortage_cut_vs_cpu_hpa_pct", ">=", 50.0),
        Goal("unserved demand at most 0.1 %", "gpu_scaler_unserved_pct", "<=", 0.1),
        Goal("GPU-hours at least 30 % below static peak provisioning", "gpu_scaler_gpu_hours_saved_vs_static_peak_pct",
             ">=", 30.0),
        Goal("GPU-hours within 15 % of the oracle's", "gpu_scaler_gpu_hours_vs_oracle_pct", "<=", 15.0),
    )
    headlines = (
        Headline("gpu_scaler_shortage_minutes", "the GPU sample's age: dcgm-exporter collects every 30 s (its default)",
                 "dcgm_collect_interval_s", 120.0, "up"),
        Headline("gpu_scaler_shortage_minutes", "Prometheus scrapes the exporter every 15 s (the Helm chart's)",
                 "scrape_interval_s", 60.0, "up"),
        Headline("gpu_scaler_shortage_minutes", "KEDA polls activation every 30 s (its default; wakes from zero)",
                 "keda_polling_s", 300.0, "up"),
        Headline("gpu_scaler_shortage_minutes", "a new replica serves 60 s after it starts (model load; an assumption)",
                 "startup_s", 300.0, "up"),
        Headline("gpu_scaler_gpu_hours_saved_vs_static_peak_pct", "the daily peak is 2.5 × the trough",
                 "peak_trough_ratio", 5.0, "up"),
        Headline("gpu_scaler_shortage_cut_vs_cpu_hpa_pct",
                 "GPU work per request drifts (15 % spread), CPU work per request does not", "mix_drift_cv", 0.4,
                 "up"),
        Headline("gpu_scaler_gpu_hours_vs_oracle_pct",
                 "a 1-second DCGM reading of one card is off by 10 % (spread; an assumption)", "signal_noise_cv", 0.5,
                 "up"),
    )
    quick: ClassVar[dict[str, object]] = {"days": 1.0, "services": 4, "non_production_services": 1}

    def run(self, settings: AutoscaleSettings, progress: Progress) -> AutoscaleFigures:
        return run_autoscale(settings, progress)

    def tables(self, figures: AutoscaleFigures) -> Sequence[Table]:
        f = figures
        rows = (
            _row("GPU-hours", ".1f", f.static_peak_gpu_hours, f.cpu_hpa_gpu_hours, f.gpu_scaler_gpu_hours,
                 f.oracle_gpu_hours),
            _row("  below static-peak (%)", ".1f", 0.0, f.cpu_hpa_gpu_hours_saved_vs_static_peak_pct,
                 f.gpu_scaler_gpu_hours_saved_vs_static_peak_pct,
                 _pct_below(f.oracle_gpu_hours, f.static_peak_gpu_hours)),
            _row("shortage (service-minutes)", ".1f", 0.0, f.cpu_hpa_shortage_minutes, f.gpu_scaler_shortage_minutes,
                 0.0),
            _row("unserved demand (%)", ".3f", 0.0, f.cpu_hpa_unserved_pct, f.gpu_scaler_unserved_pct, 0.0),
            _row("scale events", "d", 0, f.cpu_hpa_scale_events, f.gpu_scaler_scale_events, None),
        )
        return (Table("the arms side by side (the oracle is a reference, not a baseline)", ARMS, rows),
                Table("the GPU signal the scaler read", ("gpu-scaler",), (
                    _row("mean sample age when read (s)", ".1f", f.gpu_scaler_signal_age_s),
                    _row("mean reading error (%)", ".1f", f.gpu_scaler_signal_error_pct))))

    def summary(self, figures: AutoscaleFigures) -> str:
        f = figures
        return (f"GPU scaler: {f.gpu_scaler_gpu_hours_saved_vs_static_peak_pct:.1f} % fewer GPU-hours than static "
                f"peak provisioning, shortage {f.gpu_scaler_shortage_minutes:.1f} service-minutes "
                f"({f.gpu_scaler_unserved_pct:.3f} % of demand unserved) against the CPU-style HPA's "
                f"{f.cpu_hpa_shortage_minutes:.1f}; {f.gpu_scaler_gpu_hours_vs_oracle_pct:+.1f} % GPU-hours against "
                "the oracle")


SCENARIO = AutoscaleScenarioDef()
