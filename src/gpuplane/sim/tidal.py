"""The tidal scenario: a week of inference with a diurnal load and a standing training backlog,
with and without the tidal controller lending emptied inference nodes to training at night.

The world: `inference_nodes` nodes (a `stable_share` of them stable, the rest loanable "tidal" nodes) serve
`services` inference services, each as a stable and a tidal workload (see `gpuplane.controllers.tidal`);
`training_nodes` dedicated nodes run gang jobs from a backlog that never runs dry. Both runs use the same
load curves, services and jobs; the baseline runs the same controller with lending off (services still
follow their load), so the difference is the lending alone.

Load model (per service): rate(t) = mean · (1 + a·cos(2π(t − peak)/24 h) + s·exp(−((h − midday)/2)²))
· noise · spikes, a = (R − 1)/(R + 1) for a peak/trough ratio R, multiplicative noise per 10-minute
window. The controller's forecast is the noise-free curve over its horizon and the load it sees now, with
a margin. A replica serves `per_replica_capacity` requests/s once it has been up for `startup_s`.

Training: a job of n whole nodes (gang) runs `work` seconds; it checkpoints every `checkpoint_every_s`,
and ahead of a lent node's planned reclaim (`checkpoint_lead_s`); evicted with a grace at least its
checkpoint cost, it saves its progress, otherwise it loses the work since its last checkpoint; a stopped
job is resubmitted with what it has left.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.controllers import (
    LOAN_TAINT,
    RECLAIM_ANNOTATION,
    SUBSET_LABEL,
    DrainOrder,
    LoadForecast,
    ServiceBinding,
    TidalController,
)
from gpuplane.model import (
    MILLI_PER_CARD,
    Catalog,
    Fraction,
    NodeSpec,
    PodRequest,
    QoS,
    Toleration,
    WholeCards,
)
from gpuplane.model.priority import ONLINE, TRAINING, default_priority_classes
from gpuplane.model.tidal import DAY_S, ClockTime, TidalPolicy, TidalService, TidalWindow
from gpuplane.port import ClusterEvent, EventKind, PodPhase
from gpuplane.scheduler import Admission, Outcome, Profile, Scheduler, SchedulingRules
from gpuplane.scheduler.scheduler import NETWORK_BLOCK_LABEL
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop, _Entry
from gpuplane.sim.replay import window_mean
from gpuplane.sim.scenario_file import ScenarioError, load_scenario_model, read_scenario_file

Progress = Callable[[int, int], None]


class TidalScenarioError(ScenarioError):
    pass


class TidalScenario(BaseModel):
    """Every parameter of the tidal scenario; defaults are the issue's values. Loadable from YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    days: float = Field(default=7.0, gt=0, le=60)
    warmup_hours: float = Field(default=12.0, ge=0)
    inference_nodes: int = Field(default=200, ge=2)
    stable_share: float = Field(default=0.2, gt=0, lt=1, description="share of inference nodes never lent")
    training_nodes: int = Field(default=40, ge=0)
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    gpu_model: str = "A100-80GB"
    services: int = Field(default=10, ge=1)
    fraction_share: float = Field(default=0.4, ge=0, le=1, description="share of services on half cards")
    peak_fill: float = Field(default=0.7, gt=0, le=1.2, description="share of inference GPUs the peak needs")
    peak_trough_ratio: float = Field(default=2.5, ge=1)
    peak_hour: float = Field(default=15.0, ge=0, lt=24)
    midday_shoulder: float = Field(default=0.1, ge=0, description="extra load around midday, share of mean")
    midday_hour: float = Field(default=12.0, ge=0, lt=24)
    noise_cv: float = Field(default=0.05, ge=0, le=1, description="per-10-minute multiplicative noise")
    spikes: tuple[tuple[float, float, float], ...] = Field(
        default=(), description="(start hour since t0, length h, factor): unforeseen load spikes")
    per_replica_capacity: float = Field(default=10.0, gt=0, description="requests/s one replica serves")
    startup_s: float = Field(default=120.0, ge=0, description="a new replica serves after this long")
    min_share: float = Field(default=0.15, ge=0, le=1, description="min replicas, share of peak replicas")
    day_floor_share: float = Field(default=0.5, ge=0, le=1, description="day floor, share of peak replicas")
    forecast_margin: float = Field(default=0.1, ge=0)
    forecast_horizon_s: float = Field(default=1800.0, ge=0)
    shrink_at: ClockTime = "22:30"
    lend_from: ClockTime = "23:30"
    reclaim_at: ClockTime = "07:30"
    reclaim_headroom: float = Field(default=0.1, ge=0, lt=1)
    reclaim_grace_s: float = Field(default=120.0, ge=0)
    checkpoint_lead_s: float = Field(default=600.0, ge=0)
    reconcile_every_s: float = Field(default=60.0, gt=0)
    drain_order: DrainOrder = DrainOrder.FEWEST_INSTANCES
    job_nodes: tuple[int, ...] = Field(default=(1, 2, 4), min_length=1, description="gang sizes, whole nodes")
    job_work_hours: tuple[float, float] = Field(default=(2.0, 12.0), description="uniform range of a job's work")
    checkpoint_every_s: float = Field(default=1800.0, gt=0)
    checkpoint_cost_s: float = Field(default=60.0, ge=0)
    training_backlog: int = Field(default=8, ge=1, description="training jobs kept pending")
    training_util: float = Field(default=0.9, ge=0, le=1)
    sample_every_s: float = Field(default=300.0, gt=0)
    node_policy: str = "binpack"
    seed: int = 42

    @model_validator(mode="after")
    def _consistent(self) -> TidalScenario:
        if self.warmup_hours * 3600.0 >= self.days * DAY_S:
            raise ValueError(f"warmup_hours {self.warmup_hours} leaves nothing of {self.days} day(s) to measure")
        low, high = self.job_work_hours
        if not 0 < low <= high:
            raise ValueError(f"job_work_hours must be 0 < low <= high, got {self.job_work_hours}")
        if any(n < 1 for n in self.job_nodes):
            raise ValueError("job_nodes: every gang needs at least one node")
        if self.training_nodes and max(self.job_nodes) > self.training_nodes:
            raise ValueError(f"job_nodes: a job of {max(self.job_nodes)} nodes can never run on the "
                             f"{self.training_nodes} training nodes of the baseline (which lends nothing)")
        if self.training_nodes == 0 and max(self.job_nodes) > self.tidal_nodes:
            raise ValueError(f"job_nodes: a job of {max(self.job_nodes)} nodes can never run")
        self.window()  # raises on a bad window
        return self

    @property
    def stable_nodes(self) -> int:
        return max(1, round(self.inference_nodes * self.stable_share))

    @property
    def tidal_nodes(self) -> int:
        return self.inference_nodes - self.stable_nodes

    def window(self) -> TidalWindow:
        return TidalWindow(name="night", shrink_at=self.shrink_at, lend_from=self.lend_from,
                           reclaim_at=self.reclaim_at)


def read_tidal_file(path: str | Path) -> dict[str, Any]:
    return read_scenario_file(path, TidalScenarioError)


def load_tidal_scenario(path: str | Path, **overrides: object) -> TidalScenario:
    return load_scenario_model(path, TidalScenario, overrides, TidalScenarioError)


# ---------------------------------------------------------------------------------------------- the world
def load_shape(scenario: TidalScenario, t: float | npt.NDArray[np.float64]) -> Any:
    """The noise-free daily shape (mean about 1): a cosine with the peak/trough ratio, plus a midday shoulder."""
    ratio = scenario.peak_trough_ratio
    hours = (np.asarray(t) % DAY_S) / 3600.0
    value = 1.0 + (ratio - 1.0) / (ratio + 1.0) * np.cos(2 * math.pi * (hours - scenario.peak_hour) / 24.0)
    gap = (hours - scenario.midday_hour + 12.0) % 24.0 - 12.0
    return value + scenario.midday_shoulder * np.exp(-((gap / 2.0) ** 2))


@dataclass(frozen=True, slots=True)
class ServiceModel:
    name: str
    gpu_milli: int
    peak_replicas: int
    mean_rate: float
    """requests/s, the curve's daily mean"""


class LoadModel:
    """The services' load curves: deterministic shape × per-service noise × spikes."""

    def __init__(self, scenario: TidalScenario, services: list[ServiceModel], rng: np.random.Generator) -> None:
        self.scenario = scenario
        self.services = {s.name: s for s in services}
        windows = int(scenario.days * DAY_S / 600.0) + 2
        self.noise = {s.name: np.exp(rng.normal(0.0, scenario.noise_cv, windows)) if scenario.noise_cv > 0
                      else np.ones(windows) for s in services}

    def shape(self, t: float | npt.NDArray[np.float64]) -> Any:
        return load_shape(self.scenario, t)

    def spike(self, t: float) -> float:
        factor = 1.0
        hours = t / 3600.0
        for start, length, multiplier in self.scenario.spikes:
            if start <= hours < start + length:
                factor = max(factor, multiplier)
        return factor

    def load(self, service: str, t: float) -> float:
        spec = self.services[service]
        window = min(int(t // 600.0), len(self.noise[service]) - 1)
        return float(spec.mean_rate * self.shape(t) * self.noise[service][window] * self.spike(t))

    def forecast_peak(self, service: str, t: float, horizon: float) -> float:
        """The forecast a controller uses: the noise-free curve's peak over [t, t + horizon] and the load now."""
        spec = self.services[service]
        points = np.linspace(t, t + horizon, max(2, int(horizon // 300) + 2))
        curve = float(spec.mean_rate * np.max(self.shape(points)))
        return max(curve, self.load(service, t)) * (1.0 + self.scenario.forecast_margin)


def build_services(scenario: TidalScenario, rng: np.random.Generator) -> list[ServiceModel]:
    weights = rng.dirichlet(np.ones(scenario.services) * 2.0)
    fractional = set(rng.permutation(scenario.services)[: round(scenario.fraction_share * scenario.services)].tolist())
    inference_gpus = scenario.inference_nodes * scenario.gpus_per_node
    shape_peak = float(np.max(load_shape(scenario, np.linspace(0.0, DAY_S, 1441))))
    services = []
    for i, weight in enumerate(weights):
        gpu_milli = 500 if i in fractional else MILLI_PER_CARD
        peak_replicas = max(1, int(weight * scenario.peak_fill * inference_gpus * MILLI_PER_CARD / gpu_milli))
        mean_rate = peak_replicas * scenario.per_replica_capacity / shape_peak
        services.append(ServiceModel(f"svc-{i:02d}", gpu_milli, peak_replicas, mean_rate))
    return services


def build_policy(scenario: TidalScenario, services: list[ServiceModel]) -> TidalPolicy:
    specs = []
    for s in services:
        top = max(1, math.ceil(s.peak_replicas * 1.3))
        minimum = min(top, math.ceil(scenario.min_share * s.peak_replicas))
        floor = min(top, math.ceil(scenario.day_floor_share * s.peak_replicas))
        specs.append(TidalService(name=s.name, min_replicas=minimum, max_replicas=top, day_floor=floor))
    return TidalPolicy(services=tuple(specs), windows=(scenario.window(),), reclaim_headroom=scenario.reclaim_headroom,
                       reclaim_grace_s=scenario.reclaim_grace_s, checkpoint_lead_s=scenario.checkpoint_lead_s)


def build_nodes(scenario: TidalScenario) -> list[NodeSpec]:
    nodes = []
    cpu, memory = 128_000, 1_048_576
    for i in range(scenario.stable_nodes):
        nodes.append(NodeSpec(f"infer-stable-{i:03d}", cpu, memory, scenario.gpu_model, scenario.gpus_per_node,
                              pool="inference-stable", labels=((SUBSET_LABEL, "stable"),)))
    for i in range(scenario.tidal_nodes):
        nodes.append(NodeSpec(f"infer-tidal-{i:03d}", cpu, memory, scenario.gpu_model, scenario.gpus_per_node,
                              pool="inference-tidal",
                              labels=((NETWORK_BLOCK_LABEL, "inference"), (SUBSET_LABEL, "tidal"))))
    for i in range(scenario.training_nodes):
        nodes.append(NodeSpec(f"train-{i:03d}", cpu, memory, scenario.gpu_model, scenario.gpus_per_node,
                              pool="training", labels=((NETWORK_BLOCK_LABEL, "training"),)))
    return nodes


# ---------------------------------------------------------------------------------------------- results
@dataclass(slots=True)
class TidalRun:
    lend: bool
    gpus: int
    inference_gpus: int
    time_s: list[float] = field(default_factory=list)
    utilisation_pct: list[float] = field(default_factory=list)
    allocation_pct: list[float] = field(default_factory=list)
    nodes_inference: list[int] = field(default_factory=list)
    nodes_lent: list[int] = field(default_factory=list)
    nodes_training: list[int] = field(default_factory=list)
    lent_gpus: list[int] = field(default_factory=list)
    inference_gpu_hours: float = 0.0
    lent_gpu_hours: float = 0.0
    training_gpu_hours: float = 0.0
    training_gpu_hours_on_lent: float = 0.0
    training_lost_gpu_hours: float = 0.0
    training_lost_to_reclaim_gpu_hours: float = 0.0
    training_jobs_done: int = 0
    slo_violation_minutes: float = 0.0
    slo_violation_minutes_while_lent: float = 0.0
    loans: int = 0
    early_reclaims: int = 0
    drain_emptied: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    window_s: tuple[float, float] = (0.0, 0.0)
    night_mask: list[bool] = field(default_factory=list)

    def mean(self, values: Sequence[float], mask: Sequence[bool] | None = None) -> float:
        """Mean over the measurement window (and `mask`, e.g. the loan window's samples)."""
        return window_mean(self.time_s, values, self.window_s, mask)


@dataclass(slots=True)
class TidalComparison:
    scenario: TidalScenario
    baseline: TidalRun
    tidal: TidalRun

    def figures(self) -> dict[str, float | int | str]:
        a, b = self.baseline, self.tidal
        out: dict[str, float | int | str] = {
            "scenario": "tidal", "days": self.scenario.days, "seed": self.scenario.seed,
            "inference_nodes": self.scenario.inference_nodes, "training_nodes": self.scenario.training_nodes,
            "gpus": b.gpus, "drain_order": self.scenario.drain_order.value,
            "night_conversion_pct": round(b.mean(b.lent_gpus, b.night_mask) * 100.0 / max(b.inference_gpus, 1), 3),
        }
        for prefix, run in (("baseline", a), ("tidal", b)):
            out |= {
                f"{prefix}_utilisation_pct": round(run.mean(run.utilisation_pct), 3),
                f"{prefix}_allocation_pct": round(run.mean(run.allocation_pct), 3),
                f"{prefix}_inference_gpu_hours": round(run.inference_gpu_hours, 1),
                f"{prefix}_training_gpu_hours": round(run.training_gpu_hours, 1),
                f"{prefix}_training_jobs_done": run.training_jobs_done,
                f"{prefix}_slo_violation_minutes": round(run.slo_violation_minutes, 1),
                f"{prefix}_wall_s": round(run.wall_s, 2),
            }
        out |= {
            "utilisation_gain_points": round(b.mean(b.utilisation_pct) - a.mean(a.utilisation_pct), 3),
            "allocation_gain_points": round(b.mean(b.allocation_pct) - a.mean(a.allocation_pct), 3),
            "inference_cost_cut_pct": round((a.inference_gpu_hours - b.inference_gpu_hours) * 100.0
                                            / max(a.inference_gpu_hours, 1e-9), 3),
            "training_gpu_hours_gained": round(b.training_gpu_hours - a.training_gpu_hours, 1),
            "training_gpu_hours_on_lent_nodes": round(b.training_gpu_hours_on_lent, 1),
            "lent_gpu_hours": round(b.lent_gpu_hours, 1),
            "slo_violation_minutes_while_lent": round(b.slo_violation_minutes_while_lent, 1),
            "slo_violation_minutes_added_by_tidal": round(max(0.0, b.slo_violation_minutes
                                                              - a.slo_violation_minutes), 1),
            "training_lost_to_reclaim_gpu_hours": round(b.training_lost_to_reclaim_gpu_hours, 2),
            "training_lost_to_reclaim_pct_of_lent": round(b.training_lost_to_reclaim_gpu_hours * 100.0
                                                          / max(b.lent_gpu_hours, 1e-9), 3),
            "loans": b.loans,
            "early_reclaims": b.early_reclaims,
        }
        for order, freed in sorted(b.drain_emptied.items()):
            out[f"drain_nodes_emptied_{order.replace('-', '_')}"] = round(freed, 1)
        return out


# ---------------------------------------------------------------------------------------------- training jobs
@dataclass(slots=True)
class _Job:
    name: str
    nodes: int
    work_s: float
    saved_s: float = 0.0
    attempt: int = 0
    members: list[str] = field(default_factory=list)
    bound: set[str] = field(default_factory=set)
    started: float = -1.0
    last_checkpoint: float = -1.0
    stopping_since: float = -1.0
    finish: _Entry | None = None
    checkpoint: _Entry | None = None

    def progress(self, now: float) -> float:
        """Work done, checkpointed or not."""
        return self.saved_s + (now - self.last_checkpoint if self.started >= 0 else 0.0)


def run_tidal(catalog: Catalog, scenario: TidalScenario, profile: Profile, *, lend: bool,
              progress: Progress | None = None) -> TidalRun:
    rng = np.random.default_rng(scenario.seed)
    services = build_services(scenario, rng)
    load_model = LoadModel(scenario, services, rng)
    policy = build_policy(scenario, services)
    nodes = build_nodes(scenario)
    loop = EventLoop()
    cluster = SimCluster(catalog, nodes, loop=loop)
    classes = default_priority_classes()
    admission = Admission(classes, cluster_gpu_milli=cluster.state.total_gpu_milli)
    cluster.admission.append(admission)
    admission.attach(cluster)
    scheduler = Scheduler(cluster, catalog, profile, seed=scenario.seed, now=loop.now,
                          rules=SchedulingRules(classes=classes))
    bindings = [ServiceBinding(s.name, scenario.per_replica_capacity, s.gpu_milli) for s in services]
    controller = TidalController(cluster, policy, bindings, LoadForecast(load_model.forecast_peak), loop.now,
                                 lend=lend, drain_order=scenario.drain_order,
                                 forecast_horizon_s=scenario.forecast_horizon_s, seed=scenario.seed)
    for s in services:
        gpu = WholeCards(1) if s.gpu_milli == MILLI_PER_CARD else Fraction(compute_milli=s.gpu_milli,
                                                                           memory_mib=40_000)
        for subset, pool in (("stable", "inference-stable"), ("tidal", "inference-tidal")):
            template = PodRequest(f"{s.name}-{subset}", cpu_milli=4000, memory_mib=32768, gpu=gpu,
                                  priority_class=ONLINE, qos=QoS.ONLINE, pools=frozenset({pool}))
            cluster.create_workload(f"{s.name}-{subset}", template, 0)

    total_gpus = cluster.state.total_gpu_milli() // MILLI_PER_CARD
    inference_gpus = scenario.inference_nodes * scenario.gpus_per_node
    run = TidalRun(lend, total_gpus, inference_gpus)
    horizon = scenario.days * DAY_S
    warmup = scenario.warmup_hours * 3600.0
    run.window_s = (warmup, horizon)
    window = scenario.window()
    jobs: dict[str, _Job] = {}
    job_of: dict[str, _Job] = {}
    job_rng = np.random.default_rng(scenario.seed + 7)
    job_count = 0
    started_at: dict[str, float] = {}

    def new_job() -> None:
        nonlocal job_count
        size = int(scenario.job_nodes[int(job_rng.integers(len(scenario.job_nodes)))])
        low, high = scenario.job_work_hours
        job = _Job(f"job-{job_count:05d}", size, float(job_rng.uniform(low, high)) * 3600.0)
        job_count += 1
        jobs[job.name] = job
        submit(job)

    def submit(job: _Job) -> None:
        gang = f"{job.name}.{job.attempt}"
        job.members = [f"{gang}.{i}" for i in range(job.nodes)]
        job.bound = set()
        for member in job.members:
            request = PodRequest(member, cpu_milli=64_000, memory_mib=524_288, gpu=WholeCards(scenario.gpus_per_node),
                                 priority_class=TRAINING, qos=QoS.OFFLINE, gang=gang, gang_size=job.nodes,
                                 pools=frozenset({"training"}), tolerations=(Toleration(LOAN_TAINT.key),),
                                 checkpoint_every_s=scenario.checkpoint_every_s)
            job_of[member] = job
            status = cluster.create_pod(request)
            if not status.ok:
                raise TidalScenarioError(status.message)

    def pending_jobs() -> int:
        return sum(1 for j in jobs.values() if j.started < 0 and j.stopping_since < 0)

    def top_up() -> None:
        while pending_jobs() < scenario.training_backlog:
            new_job()

    def on_outcome(outcome: Outcome) -> bool:
        decision = outcome.decision
        if not decision.status.ok or decision.assignment is None:
            return True
        name = outcome.request.name
        started_at[name] = loop.now()
        job = job_of.get(name)
        if job is None:
            return True
        job.bound.add(name)
        if len(job.bound) == job.nodes and job.started < 0:
            now = loop.now()
            job.started = job.last_checkpoint = now
            job.finish = loop.call_later(job.work_s - job.saved_s, functools.partial(finish, job.name))
            job.checkpoint = loop.call_later(scenario.checkpoint_every_s, functools.partial(checkpoint, job.name))
            loop.call_later(0.0, refill)
        return True

    def refill() -> None:
        top_up()
        scheduler.run_pending(on_outcome)

    def checkpoint(name: str) -> None:
        job = jobs.get(name)
        if job is None or job.started < 0 or job.stopping_since >= 0:
            return
        now = loop.now()
        job.saved_s += now - job.last_checkpoint
        job.last_checkpoint = now
        job.checkpoint = loop.call_later(scenario.checkpoint_every_s, functools.partial(checkpoint, name))

    def finish(name: str) -> None:
        job = jobs.pop(name, None)
        if job is None:
            return
        run.training_jobs_done += 1
        if job.checkpoint is not None:
            job.checkpoint.cancel()
        for member in job.members:
            job_of.pop(member, None)
            cluster.delete_pod(member)
        refill()

    def stop(job: _Job, stopped: float, saved_until: float) -> None:
        """A member was evicted: the whole job stops (gang) at `stopped`, its progress saved up to `saved_until`."""
        gpus = job.nodes * scenario.gpus_per_node
        lost = max(0.0, stopped - saved_until)
        if job.started >= 0:
            job.saved_s += max(0.0, saved_until - job.last_checkpoint)
            run.training_lost_gpu_hours += lost * gpus / 3600.0
        if job.finish is not None:
            job.finish.cancel()
        if job.checkpoint is not None:
            job.checkpoint.cancel()
        for member in job.members:
            job_of.pop(member, None)
            info = cluster.get_pod(member)
            if info is not None and info.phase is not PodPhase.TERMINATING:
                cluster.delete_pod(member)
        job.attempt += 1
        job.started = job.last_checkpoint = job.stopping_since = -1.0
        job.finish = job.checkpoint = None
        loop.call_later(0.0, functools.partial(resubmit, job))
        return None

    def resubmit(job: _Job) -> None:
        submit(job)
        scheduler.run_pending(on_outcome)

    def on_event(event: ClusterEvent) -> None:
        pod = event.pod
        if pod is None:
            return
        job = job_of.get(pod.name)
        now = loop.now()
        if event.kind is EventKind.POD_TERMINATING and job is not None and job.started >= 0:
            job.stopping_since = now  # asked to stop: a final checkpoint starts now
        elif event.kind is EventKind.POD_DELETED and job is not None and pod.name in job.bound:
            if job.stopping_since >= 0 and now - job.stopping_since >= scenario.checkpoint_cost_s:
                stopped = saved = job.stopping_since  # the final checkpoint made it within the grace period
            else:
                stopped, saved = now, (job.last_checkpoint if job.started >= 0 else now)
            lost_before = run.training_lost_gpu_hours
            stop(job, stopped, saved)
            if "tidal" in dict(pod.annotations).get("gpuplane.io/eviction-reason", ""):
                run.training_lost_to_reclaim_gpu_hours += run.training_lost_gpu_hours - lost_before
        if event.kind in (EventKind.POD_DELETED, EventKind.POD_FAILED):
            started_at.pop(pod.name, None)

    def lead_checkpoints() -> None:
        """Jobs on lent nodes checkpoint `checkpoint_lead_s` before the planned reclaim."""
        deadlines: dict[str, float] = {}
        for info in cluster.list_nodes():
            note = dict(info.annotations).get(RECLAIM_ANNOTATION)
            if note is not None:
                deadlines[info.name] = float(note)
        if not deadlines:
            return
        now = loop.now()
        for job in list(jobs.values()):
            if job.started < 0 or job.stopping_since >= 0:
                continue
            due = [deadlines[b.assignment.node] - scenario.checkpoint_lead_s for m in job.members
                   if (b := cluster.state.bindings.get(m)) is not None and b.assignment.node in deadlines]
            if due and now >= min(due) and job.last_checkpoint < min(due):
                job.saved_s += now - job.last_checkpoint
                job.last_checkpoint = now

    def tick() -> None:
        controller.reconcile()
        lead_checkpoints()
        scheduler.run_pending(on_outcome)
        if loop.now() + scenario.reconcile_every_s <= horizon:
            loop.call_later(scenario.reconcile_every_s, tick)

    last_sample = [0.0]

    def sample() -> None:
        now = loop.now()
        dt = now - last_sample[0]
        last_sample[0] = now
        state = cluster.state
        lent = set(controller.ledger)
        busy = 0.0
        served: dict[str, int] = {}
        for name, binding in state.bindings.items():
            request = binding.request
            if request.workload is not None:
                if now - started_at.get(name, now) >= scenario.startup_s:
                    service = request.workload.rsplit("-", 1)[0]
                    served[service] = served.get(service, 0) + 1
            elif request.gang is not None:
                job = job_of.get(name)
                if job is not None and job.started >= 0:
                    gpus = binding.assignment.gpu_milli / MILLI_PER_CARD
                    busy += gpus * scenario.training_util
                    part = max(0.0, now - max(now - dt, warmup))
                    run.training_gpu_hours += gpus * part / 3600.0
                    if binding.assignment.node in lent:
                        run.training_gpu_hours_on_lent += gpus * part / 3600.0
        for s in services:
            load = load_model.load(s.name, now)
            replicas = served.get(s.name, 0)
            capacity = replicas * scenario.per_replica_capacity
            if capacity > 0:
                busy += min(1.0, load / capacity) * replicas * s.gpu_milli / MILLI_PER_CARD
            if load > capacity * 1.0000001 and now >= warmup:
                run.slo_violation_minutes += dt / 60.0
                if lent:
                    run.slo_violation_minutes_while_lent += dt / 60.0
        lent_gpus = len(lent) * scenario.gpus_per_node
        run.time_s.append(now)
        run.utilisation_pct.append(busy * 100.0 / total_gpus)
        run.allocation_pct.append(state.used_gpu_milli() * 100.0 / (total_gpus * MILLI_PER_CARD))
        run.nodes_lent.append(len(lent))
        run.nodes_inference.append(scenario.inference_nodes - len(lent))
        run.nodes_training.append(scenario.training_nodes + len(lent))
        run.lent_gpus.append(lent_gpus)
        run.night_mask.append(window.phase(now) == "lend")
        measured = max(0.0, now - max(now - dt, warmup))  # only the part of the interval after the warm-up
        run.inference_gpu_hours += (inference_gpus - lent_gpus) * measured / 3600.0
        run.lent_gpu_hours += lent_gpus * measured / 3600.0
        if progress is not None:
            progress(int(now), int(horizon))
        if now + scenario.sample_every_s <= horizon:
            loop.call_later(scenario.sample_every_s, sample)

    cluster.watch(on_event)
    scheduler.on_deferred = lambda outcome: on_outcome(outcome)
    loop.call_at(0.0, refill)
    loop.call_at(0.0, tick)
    loop.call_at(0.0, sample)
    started = time.perf_counter()
    loop.run(until=horizon)
    run.wall_s = time.perf_counter() - started
    run.loans = controller.stats.loans
    run.early_reclaims = controller.stats.early_reclaims
    drains = [d for d in controller.stats.drains if d.time >= warmup]
    for order in DrainOrder:
        run.drain_emptied[order.value] = float(sum(d.emptied[order.value] for d in drains)) / max(
            1, len({int(d.time // DAY_S) for d in drains}))
    return run


def run_tidal_comparison(catalog: Catalog, scenario: TidalScenario, profile: Profile,
                         progress: Callable[[str, int, int], None] | None = None) -> TidalComparison:
    runs = []
    for lend in (False, True):
        label = "tidal" if lend else "baseline"
        tick = None if progress is None else functools.partial(progress, label)
        runs.append(run_tidal(catalog, scenario, profile, lend=lend, progress=tick))
    return TidalComparison(scenario, runs[0], runs[1])
