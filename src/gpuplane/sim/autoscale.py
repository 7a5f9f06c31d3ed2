"""The autoscaling scenario: inference services with a diurnal load, bursts and a drifting request mix,
under static provisioning, a CPU-style HPA and the GPU scaler (KEDA + HPA on GPU utilisation), against
an oracle that knows the load.

World, per service (one GPU per replica, a replica serves one GPU-second of work per second):
- demand(t) = rate(t) × work per request(t), in GPU-seconds per second. The rate follows the diurnal
  curve rate ∝ 1 + a·cos(2π(t − peak)/24 h), a = (R − 1)/(R + 1), with multiplicative noise per
  `noise_minutes` window and flash crowds (×`burst_factor` for `burst_minutes`). The work per request drifts
  (a log-normal random walk per hour: `mix_drift_cv`): longer prompts, larger batches.
- Non-production services (the last `non_production_services`) only get load during working hours.
- A new replica serves after `startup_s`; removed replicas stop at once. Demand above the ready replicas'
  capacity is a shortage minute.

Policies (all decide every `sync_s`, the HPA sync period):
- `static-average`: replicas for the mean demand, no headroom: the provisioning the goal compares with;
  `static-peak`: replicas for the noise-free daily peak at the target utilisation.
- `oracle`: replicas = ceil(demand / target utilisation) at every step, ready at once.
- `cpu-hpa`: Kubernetes' HPA on CPU utilisation. CPU work is per request and does not follow the request
  mix, so its target, tuned for the mean mix, misreads GPU load when the mix drifts.
- `gpu-scaler`: GPU utilisation (DCGM_FI_DEV_GPU_UTIL summed over the replicas) through the metrics
  pipeline (`metric_delay_s` behind), `ScalerPolicy` for activity, KEDA's activation for 0 ↔ 1 and the HPA
  (AverageValue, target `target_util_pct` per replica) for 1 ↔ N; non-production services scale to zero
  after `idle_cooldown_s` + `keda_cooldown_s` without load.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.controllers.autoscale import (
    Hpa,
    HpaSpec,
    KedaActivation,
    ScaledObjectSpec,
    ScalerPolicy,
    average_value_replicas,
    utilization_replicas,
)
from gpuplane.model.tidal import DAY_S, ClockTime, diurnal, parse_clock
from gpuplane.sim.scenario_file import ScenarioError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Progress = Callable[[int, int], None]

POLICIES = ("static-average", "static-peak", "oracle", "cpu-hpa", "gpu-scaler")


class AutoscaleScenarioError(ScenarioError):
    pass


class AutoscaleScenario(BaseModel):
    """Every parameter of the autoscaling scenario; loadable from YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    days: float = Field(default=2.0, gt=0, le=30)
    seed: int = Field(default=1, ge=0)
    services: int = Field(default=6, ge=1, le=200)
    non_production_services: int = Field(default=2, ge=0)
    mean_gpus: float = Field(default=12.0, gt=0, description="mean demand of a service, GPUs at 100 %")
    service_size_spread: float = Field(default=0.5, ge=0, lt=1, description="services are mean × U(1 ± spread)")
    peak_trough_ratio: float = Field(default=2.5, ge=1)
    peak_hour: float = Field(default=21.0, ge=0, lt=24)
    noise_cv: float = Field(default=0.08, ge=0)
    noise_minutes: float = Field(default=5.0, gt=0)
    bursts_per_day: float = Field(default=2.0, ge=0)
    burst_factor: float = Field(default=3.0, ge=1)
    burst_minutes: float = Field(default=10.0, gt=0)
    burst_ramp_minutes: float = Field(default=2.0, ge=0, description="a flash crowd builds up over this long")
    mix_drift_cv: float = Field(default=0.15, ge=0, description="hourly log-normal drift of GPU work per request")
    working_hours_start: ClockTime = "09:00"
    working_hours_end: ClockTime = "19:00"
    startup_s: float = Field(default=60.0, ge=0, description="a new replica serves after this long")
    sync_s: float = Field(default=15.0, gt=0, description="HPA sync period")
    metric_delay_s: float = Field(default=30.0, ge=0, description="exporter interval + scrape: metric age")
    target_util_pct: float = Field(default=70.0, gt=0, le=100)
    max_replicas: int = Field(default=200, ge=1)
    keda_polling_s: float = Field(default=30.0, gt=0)
    keda_cooldown_s: float = Field(default=300.0, ge=0)
    idle_cooldown_s: float = Field(default=300.0, ge=0)
    cpu_at_gpu_saturation_pct: float = Field(default=40.0, gt=0, le=100,
                                             description="CPU use of a replica whose GPU is saturated, at the mean mix")
    cpu_target_pct: float | None = Field(default=None, gt=0, le=100,
                                         description="None: tuned so that the mean mix sits at the GPU target")
    goal_shortage_cut_pct: float = Field(default=90.0, ge=0, le=100)
    goal_gpu_hours_over_oracle_pct: float = Field(default=15.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> AutoscaleScenario:
        if self.non_production_services > self.services:
            raise ValueError(f"non_production_services ({self.non_production_services}) is above services "
                             f"({self.services})")
        return self

    @property
    def steps(self) -> int:
        return math.ceil(self.days * DAY_S / self.sync_s)

    @property
    def cpu_target(self) -> float:
        if self.cpu_target_pct is not None:
            return self.cpu_target_pct
        return self.cpu_at_gpu_saturation_pct * self.target_util_pct / 100.0


@dataclass(frozen=True, slots=True)
class ServiceLoad:
    name: str
    production: bool
    demand: FloatArray
    """GPU-seconds per second at each step."""
    mix: FloatArray
    """GPU work per request relative to the mean at each step (CPU work per request is constant)."""
    mean_diurnal_peak: float


def service_loads(s: AutoscaleScenario, rng: np.random.Generator) -> list[ServiceLoad]:
    t = np.arange(s.steps, dtype=np.float64) * s.sync_s
    shape = diurnal(t, s.peak_trough_ratio, s.peak_hour)
    r = s.peak_trough_ratio
    a = (r - 1.0) / (r + 1.0)
    loads = []
    for i in range(s.services):
        production = i < s.services - s.non_production_services
        mean = s.mean_gpus * rng.uniform(1 - s.service_size_spread, 1 + s.service_size_spread)
        daily = mean * shape
        windows = (t // (s.noise_minutes * 60.0)).astype(np.int64)
        noise = rng.lognormal(-0.5 * math.log1p(s.noise_cv ** 2), math.sqrt(math.log1p(s.noise_cv ** 2)),
                              windows.max() + 1)[windows] if s.noise_cv > 0 else np.ones(len(t))
        bursts = np.ones(len(t))
        for start in rng.uniform(0.0, s.days * DAY_S, rng.poisson(s.bursts_per_day * s.days)):
            ramp = max(s.burst_ramp_minutes * 60.0, 1e-9)
            rising = np.clip((t - start) / ramp, 0.0, 1.0)
            inside = (t >= start) & (t < start + s.burst_minutes * 60.0)
            bursts = np.where(inside, np.maximum(bursts, 1 + (s.burst_factor - 1) * rising), bursts)
        hours = (t // 3600.0).astype(np.int64)
        drift = np.zeros(hours.max() + 1)
        # a mean-reverting (AR(1), 0.9 per hour) log drift whose spread is mix_drift_cv
        shocks = rng.normal(0.0, s.mix_drift_cv * math.sqrt(1 - 0.9 ** 2), len(drift))
        drift[0] = rng.normal(0.0, s.mix_drift_cv)
        for h in range(1, len(drift)):
            drift[h] = 0.9 * drift[h - 1] + shocks[h]
        mix = np.exp(drift)[hours]
        rate = daily * noise * bursts
        if not production:
            clock = t % DAY_S
            start_s, end_s = parse_clock(s.working_hours_start), parse_clock(s.working_hours_end)
            working = ((clock >= start_s) & (clock < end_s)) if start_s <= end_s else (
                (clock >= start_s) | (clock < end_s))
            rate = np.where(working, rate, 0.0)
        loads.append(ServiceLoad(f"svc-{i}" if production else f"dev-{i}", production, rate * mix, mix,
                                 mean * (1 + a)))
    return loads


@dataclass(slots=True)
class ServiceRun:
    replicas: IntArray
    ready: IntArray
    shortage_steps: int = 0
    scale_events: int = 0


@dataclass(slots=True)
class PolicyRun:
    policy: str
    services: list[ServiceRun] = field(default_factory=list)
    wall_s: float = 0.0


class _Replicas:
    """Replica count with start-up delay: `ready(now)` counts replicas started at least `startup_s` ago."""

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
                self.starting.pop()  # the newest, still starting, goes first
            else:
                self.running -= 1

    def ready(self, now: float) -> int:
        while self.starting and self.starting[0] <= now:
            self.starting.popleft()
            self.running += 1
        return self.running


def _run_service(s: AutoscaleScenario, policy: str, load: ServiceLoad) -> ServiceRun:
    steps = s.steps
    target = s.target_util_pct / 100.0
    demand = load.demand
    replicas = np.zeros(steps, np.int64)
    ready = np.zeros(steps, np.int64)
    fixed = {"static-average": max(1, math.ceil(float(demand.mean()) - 1e-9)),
             "static-peak": max(1, math.ceil(load.mean_diurnal_peak / target - 1e-9))}
    oracle = np.ceil(demand / target - 1e-9).astype(np.int64)
    if load.production:
        oracle = np.maximum(oracle, 1)
    if policy in fixed or policy == "oracle":
        plan = np.full(steps, fixed[policy], np.int64) if policy in fixed else oracle
        return ServiceRun(plan, plan, int((demand > plan + 1e-9).sum()), int((np.diff(plan) != 0).sum()))
    # max_replicas bounds the autoscalers; the static plans and the oracle are references
    lag = max(1, round(s.metric_delay_s / s.sync_s)) if s.metric_delay_s > 0 else 0
    pool = _Replicas(min(max(int(oracle[0]), 1), s.max_replicas), s.startup_s)
    hpa = Hpa(HpaSpec(min_replicas=1, max_replicas=s.max_replicas))
    spec = ScaledObjectSpec(name=load.name, query="sum(DCGM_FI_DEV_GPU_UTIL)", target=s.target_util_pct,
                            activation_query="sum(rate(gateway_requests_total[1m]))", production=load.production,
                            idle_cooldown_s=s.idle_cooldown_s, min_replicas=1 if load.production else 0,
                            max_replicas=s.max_replicas)
    scaler = ScalerPolicy(spec)
    keda = KedaActivation(min_replicas=spec.min_replicas, cooldown_s=s.keda_cooldown_s)
    gpu_util: deque[float] = deque(maxlen=lag + 1)  # summed GPU utilisation (%) per step, newest last
    cpu_util: deque[float] = deque(maxlen=lag + 1)  # mean CPU utilisation (%) over the replicas
    next_poll = 0.0
    shortage = 0
    for k in range(steps):
        now = k * s.sync_s
        up = pool.ready(now)
        served = min(float(demand[k]), float(up))
        gpu_util.append(served * 100.0)
        # the HPA counts replicas still starting as 0 % CPU when it scales up (kube's readiness rule)
        per_replica_rps = served / load.mix[k] / pool.total if pool.total else 0.0
        cpu_util.append(s.cpu_at_gpu_saturation_pct * per_replica_rps)
        shortage += int(demand[k] > up + 1e-9)
        replicas[k], ready[k] = pool.total, up
        current = pool.total
        if policy == "cpu-hpa":
            seen = cpu_util[0]
            desired = utilization_replicas(seen, s.cpu_target, current, 0.1)
            pool.set(now, hpa.step(now, current, max(desired, 1)))
        elif policy == "gpu-scaler":
            report = scaler.observe(now, gpu_util[0], activity=float(demand[max(k - lag, 0)]))
            if now >= next_poll:
                next_poll = now + s.keda_polling_s
                to = keda.target(now, report.active, current)
                if to is not None:
                    pool.set(now, to)
                    continue
            if current >= 1:
                desired = average_value_replicas(report.value, s.target_util_pct, current, 0.1)
                pool.set(now, hpa.step(now, current, max(desired, 1)))
    return ServiceRun(replicas, ready, shortage, pool.events)


@dataclass(slots=True)
class AutoscaleComparison:
    scenario: AutoscaleScenario
    loads: list[ServiceLoad]
    runs: dict[str, PolicyRun]
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        s = self.scenario
        hours = s.sync_s / 3600.0
        out: dict[str, Any] = {"scenario": "autoscale", "days": s.days, "seed": s.seed, "services": s.services,
                               "non_production_services": s.non_production_services,
                               "demand_gpu_hours": round(float(sum(ld.demand.sum() for ld in self.loads)) * hours, 1)}
        for policy, run in self.runs.items():
            key = policy.replace("-", "_")
            out |= {
                f"{key}_shortage_minutes": round(sum(r.shortage_steps for r in run.services) * s.sync_s / 60.0, 1),
                f"{key}_gpu_hours": round(float(sum(r.replicas.sum() for r in run.services)) * hours, 1),
                f"{key}_scale_events": sum(r.scale_events for r in run.services),
                f"{key}_zero_replica_service_hours": round(
                    float(sum((r.replicas == 0).sum() for r in run.services)) * hours, 2),
                f"{key}_wall_s": round(run.wall_s, 2),
            }
        if "oracle" in self.runs:
            base = out["oracle_gpu_hours"]
            for policy in self.runs:
                key = policy.replace("-", "_")
                out[f"{key}_gpu_hours_vs_oracle_pct"] = round((out[f"{key}_gpu_hours"] - base) * 100.0
                                                              / max(base, 1e-9), 2)
        if "static-average" in self.runs:
            base = out["static_average_shortage_minutes"]
            for policy in self.runs:
                key = policy.replace("-", "_")
                out[f"{key}_shortage_cut_vs_static_pct"] = (
                    round(float((base - out[f"{key}_shortage_minutes"]) * 100.0 / base), 2) if base > 0 else None)
        if {"gpu-scaler", "oracle", "static-average"} <= set(self.runs):
            cut = out["gpu_scaler_shortage_cut_vs_static_pct"]
            over = out["gpu_scaler_gpu_hours_vs_oracle_pct"]
            out["goal_shortage_cut_met"] = bool(cut is not None and cut >= s.goal_shortage_cut_pct)
            out["goal_gpu_hours_met"] = bool(abs(over) <= s.goal_gpu_hours_over_oracle_pct)
            out["goals_met"] = out["goal_shortage_cut_met"] and out["goal_gpu_hours_met"]
        out["wall_s"] = round(self.wall_s, 2)
        return out


def run_autoscale(s: AutoscaleScenario, policies: tuple[str, ...] = POLICIES,
                  progress: Progress | None = None) -> AutoscaleComparison:
    """Every policy on the same service loads."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise AutoscaleScenarioError(f"unknown autoscaling policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    started = time.perf_counter()
    loads = service_loads(s, np.random.default_rng(s.seed))
    runs: dict[str, PolicyRun] = {}
    total = len(policies) * len(loads)
    for i, policy in enumerate(policies):
        begun = time.perf_counter()
        run = PolicyRun(policy)
        for j, load in enumerate(loads):
            run.services.append(_run_service(s, policy, load))
            if progress is not None:
                progress(i * len(loads) + j + 1, total)
        run.wall_s = time.perf_counter() - begun
        runs[policy] = run
    return AutoscaleComparison(s, loads, runs, time.perf_counter() - started)
