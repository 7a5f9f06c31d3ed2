"""The tidal scenario on the scenario kit: inference with a diurnal load and a standing training backlog,
with and without the tidal controller lending emptied inference nodes to training at night.

The world is the kit's (`build_world`: `EventLoop` + `SimCluster` + the production `Scheduler`, with the
production admission and priority classes); termination takes the kubelet's time (grace, then
`kubelet_stop_s`). `inference_nodes` nodes (a `stable_share` of them never lent) serve `services`
inference services, each as a stable and a tidal workload; `training_nodes` dedicated nodes run gang jobs
from a backlog that never runs dry. Both arms see the same load curves, services and job stream; the
baseline runs the same controller with lending off (services still follow their load), so the
difference is the lending alone.

What the controller knows (the code that ships): `TidalController` with a `SeasonalForecaster`, fed once
a pass with each service's load over the last minute (what a 1-minute Prometheus rate reports), after
`history_days` of the same observations before the run; never the load to come nor its noise-free shape.

Load (`gpuplane.sim.scenario.load`, per service): the kit's diurnal shape × lognormal noise per
`noise_minutes` × Poisson flash crowds, each service's own (`bursts_per_day`) and cluster-wide ones
that hit every service at once (`shared_bursts_per_day`). A replica serves `per_replica_capacity`
requests/s once it has been up `startup_s`. SLOs are checked every `slo_check_s` (at most a minute): the
seconds of each interval in which a service's load (its value at the check) exceeds the capacity of the replicas
serving by then are SLO time (`scenario.slo.shortfall_s`, the platform week's count).

Training: each job is the kit's `CheckpointingJob` (a save takes `checkpoint_cost_s` during which the job
makes no progress; every `checkpoint_every_s` of work; a lead save `checkpoint_lead_s` before a lent
node's planned reclaim; a save on SIGTERM kept only if it completes within the grace) and the kit's
`WorkLedger` books useful work (kept by a save, or completed) and lost work by its cause. A job whose
member is told to stop stops whole (a gang), its members exiting when its last save ends, and is
resubmitted with the work it kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import Field, model_validator

from gpuplane.controllers import (
    EARLY_RECLAIM_REASON,
    LOAN_TAINT,
    RECLAIM_ANNOTATION,
    RECLAIM_REASON,
    SUBSET_LABEL,
    DrainOrder,
    SeasonalForecaster,
    ServiceBinding,
    TidalController,
)
from gpuplane.model import (
    MILLI_PER_CARD,
    Fraction,
    NodeSpec,
    PodRequest,
    QoS,
    Toleration,
    WholeCards,
    default_catalog,
)
from gpuplane.model.priority import ONLINE, TRAINING, default_priority_classes
from gpuplane.model.tidal import ClockTime, TidalPolicy, TidalService, TidalWindow
from gpuplane.port import ClusterEvent, EventKind, PodInfo, PodPhase
from gpuplane.scheduler import Outcome, PolicyConfig, default_registry
from gpuplane.scheduler.scheduler import NETWORK_BLOCK_LABEL
from gpuplane.sim.engine import _Entry
from gpuplane.sim.scenario import (
    DAY_S,
    CheckpointingJob,
    Figures,
    Goal,
    Headline,
    LoadCurve,
    LoadModel,
    Progress,
    SaveModel,
    Table,
    WorkLedger,
    WorldSettings,
    build_world,
    figure,
    sample_load,
    series,
)
from gpuplane.sim.scenario.slo import shortfall_s

EVICTION_REASON = "gpuplane.io/eviction-reason"
GANG_STOP = "gang stop"
"""The reason a job's other members are stopped with it (the cause is the first member's)."""


class TidalError(ValueError):
    pass


class TidalSettings(WorldSettings):
    """Every parameter of the tidal scenario. The defaults are the assumptions the figures rest on."""

    days: float = Field(default=3.0, gt=0, le=30, description="simulated days, warm-up included")
    history_days: int = Field(default=1, ge=0, le=7,
                              description="days of observed load the forecaster learns from before the run")
    warmup_hours: float = Field(default=12.0, ge=0, description="left out of the figures (services and backlog fill)")
    inference_nodes: int = Field(default=40, ge=2)
    stable_share: float = Field(default=0.2, gt=0, lt=1, description="share of inference nodes never lent")
    training_nodes: int = Field(default=8, ge=0)
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    gpu_model: str = "A100-80GB"
    services: int = Field(default=6, ge=1)
    fraction_share: float = Field(default=0.4, ge=0, le=1, description="share of services on half cards")
    peak_fill: float = Field(default=0.7, gt=0, le=1.2, description="share of inference GPUs the mean peak needs")
    peak_trough_ratio: float = Field(default=2.5, ge=1)
    peak_hour: float = Field(default=15.0, ge=0, lt=24)
    midday_shoulder: float = Field(default=0.1, ge=0, description="extra load around midday, share of the shape")
    midday_hour: float = Field(default=12.0, ge=0, lt=24)
    noise_cv: float = Field(default=0.05, ge=0, le=1, description="multiplicative noise per noise_minutes window")
    noise_minutes: float = Field(default=10.0, gt=0)
    bursts_per_day: float = Field(default=0.5, ge=0, description="unforeseen flash crowds per service per day")
    shared_bursts_per_day: float = Field(default=0.5, ge=0,
                                         description="flash crowds that hit every service at once, per day")
    burst_factor: float = Field(default=2.0, ge=1)
    burst_minutes: float = Field(default=20.0, gt=0)
    per_replica_capacity: float = Field(default=10.0, gt=0, description="requests/s one replica serves")
    startup_s: float = Field(default=120.0, ge=0, description="a new replica serves after this long")
    min_share: float = Field(default=0.15, ge=0, le=1, description="min replicas, share of peak replicas")
    day_floor_share: float = Field(default=0.5, ge=0, le=1, description="day floor, share of peak replicas")
    forecast_margin: float = Field(default=0.05, ge=0, description="the forecaster's fixed margin")
    forecast_z: float = Field(default=2.0, ge=0, description="the forecaster's margin in its own error's sigmas")
    forecast_horizon_s: float = Field(default=1800.0, ge=0)
    shrink_at: ClockTime = "22:30"
    lend_from: ClockTime = "23:30"
    reclaim_at: ClockTime = "07:30"
    reclaim_headroom: float = Field(default=0.1, ge=0, lt=1)
    reclaim_grace_s: float = Field(default=120.0, ge=0, description="grace of evicted training pods")
    checkpoint_lead_s: float = Field(default=600.0, ge=0, description="lead save before a planned reclaim")
    reconcile_every_s: float = Field(default=60.0, gt=0)
    drain_order: DrainOrder = DrainOrder.FEWEST_INSTANCES
    job_nodes: tuple[int, ...] = Field(default=(1, 2, 4), min_length=1, description="gang sizes, whole nodes")
    job_work_hours: tuple[float, float] = Field(default=(2.0, 12.0), description="uniform range of a job's work")
    checkpoint_every_s: float = Field(default=1800.0, ge=0, description="work between periodic saves (0: never)")
    checkpoint_cost_s: float = Field(default=60.0, ge=0, description="how long one save takes")
    save_on_signal: bool = Field(default=True, description="a training job saves when told to stop (SIGTERM)")
    training_backlog: int = Field(default=6, ge=1, description="training jobs kept pending")
    slo_check_s: float = Field(default=60.0, gt=0, le=60.0, description="how often SLOs are checked")
    node_policy: str = "binpack"

    @model_validator(mode="after")
    def _consistent(self) -> TidalSettings:
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
        if not self.training_nodes and max(self.job_nodes) > self.tidal_nodes:
            raise ValueError(f"job_nodes: a job of {max(self.job_nodes)} nodes can never run")
        self.window()
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

    def load_model(self) -> LoadModel:
        return LoadModel(peak_trough_ratio=self.peak_trough_ratio, peak_hour=self.peak_hour,
                         midday_shoulder=self.midday_shoulder, midday_hour=self.midday_hour, noise_cv=self.noise_cv,
                         noise_minutes=self.noise_minutes, bursts_per_day=self.bursts_per_day,
                         burst_factor=self.burst_factor, burst_minutes=self.burst_minutes)

    def save_model(self) -> SaveModel:
        return SaveModel(every_s=self.checkpoint_every_s, save_s=self.checkpoint_cost_s,
                         on_signal=self.save_on_signal)


class TidalFigures(Figures):
    night_conversion_pct: float = figure("tidal", "share of inference GPUs lent, mean over the loan windows", "%")
    lent_gpu_h: float = figure("tidal", "GPU-hours lent to training", "GPU-h")
    tidal_useful_training_gpu_h: float = figure(
        "tidal", "useful training work: progress kept by a save or a completion", "GPU-h")
    baseline_useful_training_gpu_h: float = figure(
        "baseline", "useful training work: progress kept by a save or a completion", "GPU-h")
    tidal_training_held_gpu_h: float = figure("tidal", "GPU-hours training pods hold (occupancy, not work)", "GPU-h")
    baseline_training_held_gpu_h: float = figure("baseline", "GPU-hours training pods hold (occupancy, not work)",
                                                 "GPU-h")
    useful_training_gain_gpu_h: float = figure("tidal", "useful training work gained over the baseline", "GPU-h")
    useful_gain_pct_of_lent: float = figure("tidal", "useful training work gained per GPU-hour lent", "%")
    tidal_training_jobs_done: int = figure("tidal", "training jobs completed")
    baseline_training_jobs_done: int = figure("baseline", "training jobs completed")
    tidal_inference_held_gpu_h: float = figure("tidal", "GPU-hours inference replicas actually hold", "GPU-h")
    baseline_inference_held_gpu_h: float = figure("baseline", "GPU-hours inference replicas actually hold",
                                                  "GPU-h")
    tidal_idle_gpu_h: float = figure("tidal", "GPU-hours no pod holds", "GPU-h")
    baseline_idle_gpu_h: float = figure("baseline", "GPU-hours no pod holds", "GPU-h")
    allocation_gain_points: float = figure("tidal", "GPU allocation (held by any pod) over the baseline's",
                                           "points")
    tidal_slo_minutes: float = figure("tidal", "service-minutes with load above the serving capacity", "min")
    baseline_slo_minutes: float = figure("baseline", "service-minutes with load above the serving capacity",
                                         "min")
    slo_minutes_added: float = figure("tidal", "SLO service-minutes tidal adds to the baseline's", "min")
    tidal_lost_gpu_h: float = figure("tidal", "training work lost, every cause", "GPU-h")
    baseline_lost_gpu_h: float = figure("baseline", "training work lost, every cause", "GPU-h")
    lost_to_reclaim_gpu_h: float = figure("tidal", "training work lost to reclaim (planned and early)", "GPU-h")
    lost_to_early_reclaim_gpu_h: float = figure("tidal", "training work lost to early reclaim", "GPU-h")
    lost_to_reclaim_pct_of_lent: float = figure("tidal", "training work lost to reclaim per GPU-hour lent", "%")
    loans: int = figure("tidal", "nodes lent")
    early_reclaims: int = figure("tidal", "nodes taken back before the window's end")
    load_misses: int = figure("tidal", "load readings the forecaster did not get")
    drain_emptied_fewest_instances: float = figure(
        "tidal", "nodes emptied per night, fewest-instances first (the controller's order)", "nodes")
    drain_emptied_newest: float = figure("tidal", "nodes the same scale-downs empty newest first (Kubernetes')",
                                         "nodes")
    time_h: tuple[float, ...] = series("time of each SLO check (h)")
    nodes_lent: tuple[int, ...] = series("lent nodes at each check")
    tidal_inference_gpus: tuple[float, ...] = series("GPUs inference holds, tidal arm")
    tidal_training_gpus: tuple[float, ...] = series("GPUs training holds, tidal arm")
    baseline_training_gpus: tuple[float, ...] = series("GPUs training holds, baseline arm")
    tidal_violations: tuple[int, ...] = series("services violating at each check, tidal arm")
    baseline_violations: tuple[int, ...] = series("services violating at each check, baseline arm")
    load_share: tuple[float, ...] = series("total load over total peak-replica capacity at each check")


# ---------------------------------------------------------------------------------------------- the world
@dataclass(frozen=True, slots=True)
class ServiceModel:
    name: str
    gpu_milli: int
    peak_replicas: int
    mean_rate: float


def build_services(settings: TidalSettings, rng: np.random.Generator) -> list[ServiceModel]:
    """Each service's share of the peak, its replica size and its mean load (requests/s)."""
    weights = rng.dirichlet(np.ones(settings.services) * 2.0)
    fractional = set(rng.permutation(settings.services)[: round(settings.fraction_share * settings.services)].tolist())
    inference_gpus = settings.inference_nodes * settings.gpus_per_node
    model = settings.load_model()
    day = np.arange(0.0, DAY_S, 60.0)
    peak_over_mean = float(model.shape(day).max() / model.shape(day).mean())
    services = []
    for i, weight in enumerate(weights):
        gpu_milli = 500 if i in fractional else MILLI_PER_CARD
        peak_replicas = max(1, int(weight * settings.peak_fill * inference_gpus * MILLI_PER_CARD / gpu_milli))
        mean_rate = peak_replicas * settings.per_replica_capacity / peak_over_mean
        services.append(ServiceModel(f"svc-{i:02d}", gpu_milli, peak_replicas, mean_rate))
    return services


def build_policy(settings: TidalSettings, services: Sequence[ServiceModel]) -> TidalPolicy:
    specs = []
    for s in services:
        top = max(1, math.ceil(s.peak_replicas * 1.5))
        minimum = min(top, math.ceil(settings.min_share * s.peak_replicas))
        floor = min(top, math.ceil(settings.day_floor_share * s.peak_replicas))
        specs.append(TidalService(name=s.name, min_replicas=minimum, max_replicas=top, day_floor=floor))
    return TidalPolicy(services=tuple(specs), windows=(settings.window(),), reclaim_headroom=settings.reclaim_headroom,
                       reclaim_grace_s=settings.reclaim_grace_s, checkpoint_lead_s=settings.checkpoint_lead_s)


def build_nodes(settings: TidalSettings) -> list[NodeSpec]:
    cpu, memory, gpus, model = 128_000, 1_048_576, settings.gpus_per_node, settings.gpu_model
    nodes = [NodeSpec(f"infer-stable-{i:03d}", cpu, memory, model, gpus, pool="inference-stable",
                      labels=((SUBSET_LABEL, "stable"),)) for i in range(settings.stable_nodes)]
    nodes += [NodeSpec(f"infer-tidal-{i:03d}", cpu, memory, model, gpus, pool="inference-tidal",
                       labels=((NETWORK_BLOCK_LABEL, "inference"), (SUBSET_LABEL, "tidal")))
              for i in range(settings.tidal_nodes)]
    nodes += [NodeSpec(f"train-{i:03d}", cpu, memory, model, gpus, pool="training",
                       labels=((NETWORK_BLOCK_LABEL, "training"),)) for i in range(settings.training_nodes)]
    return nodes


@dataclass(frozen=True, slots=True)
class Inputs:
    """What both arms share: services, policy, the load curves (history first) and the job stream's seed."""

    services: tuple[ServiceModel, ...]
    policy: TidalPolicy
    curves: Mapping[str, LoadCurve]
    offset_s: float
    """curve time of the run's t = 0 (the history before it)"""

    def load(self, service: str, t: float) -> float:
        """The load of `service` over the minute from run time `t`."""
        return self.curves[service].at(t + self.offset_s)


def build_inputs(settings: TidalSettings) -> Inputs:
    rng = np.random.default_rng(settings.seed)
    services = build_services(settings, rng)
    offset = settings.history_days * DAY_S
    model = settings.load_model()
    days = settings.history_days + settings.days
    curves = {s.name: sample_load(model, days=days, mean=s.mean_rate, rng=rng) for s in services}
    # Cluster-wide flash crowds: the kit's bursts on a flat curve, multiplied into every service's load.
    shared = sample_load(LoadModel(noise_cv=0.0, peak_trough_ratio=1.0, bursts_per_day=settings.shared_bursts_per_day,
                                   burst_factor=settings.burst_factor, burst_minutes=settings.burst_minutes),
                         days=days, mean=1.0, rng=rng)
    curves = {name: dataclasses.replace(c, burst=c.burst * shared.burst, value=c.value * shared.burst,
                                        bursts=tuple(sorted(c.bursts + shared.bursts)))
              for name, c in curves.items()}
    return Inputs(tuple(services), build_policy(settings, services), curves, offset)


# ---------------------------------------------------------------------------------------------- one arm
@dataclass(slots=True)
class _Job:
    job: CheckpointingJob
    nodes: int
    attempt: int = 0
    members: list[str] = field(default_factory=list)
    bound: set[str] = field(default_factory=set)
    stopping: bool = False
    finish: _Entry | None = None
    lead_for: float = -1.0
    """the reclaim time a lead save was taken for"""


@dataclass(slots=True)
class ArmResult:
    useful_gpu_h: float = 0.0
    lost_gpu_h: dict[str, float] = field(default_factory=dict)
    jobs_done: int = 0
    inference_held_gpu_h: float = 0.0
    training_held_gpu_h: float = 0.0
    idle_gpu_h: float = 0.0
    held_gpu_h: float = 0.0
    lent_gpu_h: float = 0.0
    lent_night_share: list[float] = field(default_factory=list)
    slo_minutes: float = 0.0
    loans: int = 0
    early_reclaims: int = 0
    load_misses: int = 0
    drain_emptied: dict[str, float] = field(default_factory=dict)
    time_h: list[float] = field(default_factory=list)
    nodes_lent: list[int] = field(default_factory=list)
    inference_gpus: list[float] = field(default_factory=list)
    training_gpus: list[float] = field(default_factory=list)
    violations: list[int] = field(default_factory=list)
    load_share: list[float] = field(default_factory=list)


def _cause(reason: str) -> str:
    if reason == EARLY_RECLAIM_REASON:
        return "early reclaim"
    if reason == RECLAIM_REASON:
        return "reclaim"
    return reason or "deleted"


def run_arm(settings: TidalSettings, inputs: Inputs, *, lend: bool, progress: Progress | None = None,
            label: str = "") -> ArmResult:
    catalog = default_catalog()
    profile = default_registry().build(PolicyConfig(node_policy=settings.node_policy, seed=settings.seed))
    world = build_world(catalog, build_nodes(settings), profile, seed=settings.seed, stop_s=settings.kubelet_stop_s,
                        classes=default_priority_classes())
    loop, cluster, scheduler = world.loop, world.cluster, world.scheduler
    services = inputs.services
    forecaster = SeasonalForecaster(margin=settings.forecast_margin, z=settings.forecast_z)
    step = 60.0
    for i in range(int(inputs.offset_s // step)):  # the observed history before the run
        t = i * step - inputs.offset_s
        for s in services:
            forecaster.observe(s.name, t + step, inputs.load(s.name, t))

    def observed(service: str) -> float:
        """What a 1-minute rate reports now: the load over the minute just gone."""
        return inputs.load(service, loop.now() - step)

    bindings = [ServiceBinding(s.name, settings.per_replica_capacity, s.gpu_milli) for s in services]
    controller = TidalController(cluster, inputs.policy, bindings, forecaster, loop.now, load=observed, lend=lend,
                                 drain_order=settings.drain_order, forecast_horizon_s=settings.forecast_horizon_s,
                                 seed=settings.seed)
    for s in services:
        gpu = WholeCards(1) if s.gpu_milli == MILLI_PER_CARD else Fraction(compute_milli=s.gpu_milli, memory_mib=40_000)
        for subset, pool in (("stable", "inference-stable"), ("tidal", "inference-tidal")):
            template = PodRequest(f"{s.name}-{subset}", cpu_milli=4000, memory_mib=32768, gpu=gpu,
                                  priority_class=ONLINE, qos=QoS.ONLINE, pools=frozenset({pool}))
            cluster.create_workload(f"{s.name}-{subset}", template, 0)

    total_gpus = cluster.state.total_gpu_milli() / MILLI_PER_CARD
    horizon = settings.days * DAY_S
    warmup = settings.warmup_hours * 3600.0
    window = settings.window()
    save = settings.save_model()
    result = ArmResult()
    ledger = WorkLedger()
    jobs: dict[str, _Job] = {}
    job_of: dict[str, _Job] = {}
    serving_since: dict[str, tuple[str, float]] = {}
    """inference pod → (its service, when it serves)"""
    job_rng = np.random.default_rng(settings.seed + 7)
    count = [0]

    def new_job() -> None:
        size = int(settings.job_nodes[int(job_rng.integers(len(settings.job_nodes)))])
        low, high = settings.job_work_hours
        name = f"job-{count[0]:05d}"
        count[0] += 1
        gpus = size * settings.gpus_per_node
        job = _Job(CheckpointingJob(name, float(job_rng.uniform(low, high)) * 3600.0, gpus, save), size)
        jobs[name] = job
        submit(job)

    def submit(job: _Job) -> None:
        gang = f"{job.job.name}.{job.attempt}"
        job.members = [f"{gang}.{i}" for i in range(job.nodes)]
        job.bound, job.stopping = set(), False
        for member in job.members:
            request = PodRequest(member, cpu_milli=64_000, memory_mib=524_288, gpu=WholeCards(settings.gpus_per_node),
                                 priority_class=TRAINING, qos=QoS.OFFLINE, gang=gang, gang_size=job.nodes,
                                 pools=frozenset({"training"}), tolerations=(Toleration(LOAN_TAINT.key),),
                                 checkpoint_every_s=settings.checkpoint_every_s)
            job_of[member] = job
            status = cluster.create_pod(request)
            if not status.ok:
                raise TidalError(status.message)

    def top_up() -> None:
        while sum(1 for j in jobs.values() if not j.job.running and not j.stopping) < settings.training_backlog:
            new_job()

    def schedule_finish(job: _Job) -> None:
        if job.finish is not None:
            job.finish.cancel()
        job.finish = loop.call_at(job.job.finish_time(loop.now()), functools.partial(finish, job))

    def on_outcome(outcome: Outcome) -> bool:
        decision = outcome.decision
        if not decision.status.ok or decision.assignment is None:
            return True
        job = job_of.get(outcome.request.name)
        if job is None:
            return True
        job.bound.add(outcome.request.name)
        if len(job.bound) == job.nodes and not job.job.running and not job.stopping:
            job.job.start(loop.now())
            schedule_finish(job)
            loop.call_later(0.0, refill)
        return True

    def refill() -> None:
        top_up()
        scheduler.run_pending(on_outcome)

    def finish(job: _Job) -> None:
        if jobs.get(job.job.name) is not job or not job.job.running:
            return
        job.job.complete(loop.now())
        ledger.completed(job.job)
        result.jobs_done += loop.now() >= warmup
        del jobs[job.job.name]
        job.stopping = True
        for member in job.members:
            cluster.evict(member, grace_s=0.0, reason="completed")
        refill()

    def stop(job: _Job, grace_s: float, cause: str) -> None:
        """A member was told to stop (or is gone): the gang stops, saving what its grace allows."""
        now = loop.now()
        job.stopping = True
        if job.finish is not None:
            job.finish.cancel()
            job.finish = None
        exit_at = now
        if job.job.running:
            outcome = job.job.stop(now, grace_s)
            ledger.stopped(job.job, outcome, cause)
            exit_at = outcome.exit_s
        for member in job.members:
            info = cluster.get_pod(member)
            if info is not None and info.phase in (PodPhase.RUNNING, PodPhase.PENDING):
                cluster.evict(member, grace_s=max(0.0, exit_at - now), reason=GANG_STOP)
        loop.call_at(exit_at, functools.partial(exited, job))

    def exited(job: _Job) -> None:
        """The job's processes are gone (its last save ended): the kubelet stops what is still Terminating."""
        for member in job.members:
            info = cluster.get_pod(member)
            if info is not None and info.phase is PodPhase.TERMINATING:
                cluster.container_exited(member)

    def gone(job: _Job) -> None:
        """Every member is deleted: resubmit with the work kept."""
        if any(cluster.get_pod(m) is not None for m in job.members):
            return
        for member in job.members:
            job_of.pop(member, None)
        if jobs.get(job.job.name) is job:
            job.attempt += 1
            submit(job)
            scheduler.run_pending(on_outcome)

    def reclaimed_now(pod: PodInfo) -> str:
        """The cause of a pod deleted with no grace at all: a reclaim of its node, if one just happened."""
        node = pod.assignment.node if pod.assignment is not None else None
        for loan in reversed(controller.history):
            if loan.node == node and loan.returned == loop.now():
                return "early reclaim" if loan.early else "reclaim"
        return "deleted"

    def on_event(event: ClusterEvent) -> None:
        pod = event.pod
        if pod is None:
            return
        if pod.request.workload is not None:
            if event.kind is EventKind.POD_BOUND:
                serving_since[pod.name] = (pod.request.workload.rsplit("-", 1)[0], loop.now() + settings.startup_s)
            elif event.kind in (EventKind.POD_DELETED, EventKind.POD_TERMINATING):
                serving_since.pop(pod.name, None)
            return
        job = job_of.get(pod.name)
        if job is None:
            return
        if event.kind is EventKind.POD_TERMINATING and not job.stopping:
            reason = dict(pod.annotations).get(EVICTION_REASON, "")
            grace = settings.reclaim_grace_s if reason in (RECLAIM_REASON, EARLY_RECLAIM_REASON) else 0.0
            stop(job, grace, _cause(reason))
        elif event.kind is EventKind.POD_DELETED:
            if not job.stopping:
                stop(job, 0.0, reclaimed_now(pod))
            loop.call_later(0.0, functools.partial(gone, job))

    def lead_saves() -> None:
        """Jobs on lent nodes save `checkpoint_lead_s` before the reclaim time the nodes are annotated with."""
        deadlines = {info.name: float(note) for info in cluster.list_nodes()
                     if (note := dict(info.annotations).get(RECLAIM_ANNOTATION)) is not None}
        if not deadlines:
            return
        now = loop.now()
        for job in jobs.values():
            if not job.job.running or job.stopping:
                continue
            due = [deadlines[b.assignment.node] for m in job.members
                   if (b := cluster.state.bindings.get(m)) is not None and b.assignment.node in deadlines]
            if due and now >= min(due) - settings.checkpoint_lead_s and job.lead_for != min(due):
                job.lead_for = min(due)
                job.job.save_now(now)
                schedule_finish(job)

    def tick() -> None:
        controller.reconcile()
        lead_saves()
        scheduler.run_pending(on_outcome)
        if loop.now() + settings.reconcile_every_s < horizon:
            loop.call_later(settings.reconcile_every_s, tick)

    kept_at_warmup = [0.0]
    lost_at_warmup: dict[str, float] = {}

    def kept_gpu_s() -> float:
        now = loop.now()
        return ledger.useful_gpu_s + sum(max(0.0, j.job.kept_s(now) - j.job.booked_s) * j.job.gpus
                                         for j in jobs.values() if j.job.running)

    def start_measuring() -> None:
        kept_at_warmup[0] = kept_gpu_s()
        lost_at_warmup.update(ledger.lost_gpu_s)

    capacity = sum(s.peak_replicas for s in services) * settings.per_replica_capacity
    dt = settings.slo_check_s

    def check() -> None:
        now = loop.now()
        if now >= warmup:
            ready_at: dict[str, list[float]] = {}
            for service, since in serving_since.values():
                ready_at.setdefault(service, []).append(since)
            total = 0.0
            violating = 0
            for s in services:
                load = inputs.load(s.name, now)
                total += load
                # the seconds of this check's interval short of capacity, as the platform week counts them
                short = shortfall_s(load, settings.per_replica_capacity, ready_at.get(s.name, ()), now, dt)
                result.slo_minutes += short / 60.0
                violating += short > 0
            inference = training = 0.0
            for binding in cluster.state.bindings.values():
                gpus = binding.assignment.gpu_milli / MILLI_PER_CARD
                if binding.request.workload is not None:
                    inference += gpus
                else:
                    training += gpus
            lent = len(controller.ledger) * settings.gpus_per_node
            result.inference_held_gpu_h += inference * dt / 3600.0
            result.training_held_gpu_h += training * dt / 3600.0
            result.held_gpu_h += (inference + training) * dt / 3600.0
            result.idle_gpu_h += (total_gpus - inference - training) * dt / 3600.0
            result.lent_gpu_h += lent * dt / 3600.0
            if window.phase(now) == "lend":
                result.lent_night_share.append(lent / (settings.inference_nodes * settings.gpus_per_node))
            result.time_h.append(now / 3600.0)
            result.nodes_lent.append(len(controller.ledger))
            result.inference_gpus.append(inference)
            result.training_gpus.append(training)
            result.violations.append(violating)
            result.load_share.append(total / capacity)
        if progress is not None:
            progress(label, int(now), int(horizon))
        if now + dt < horizon:
            loop.call_later(dt, check)

    cluster.watch(on_event)
    scheduler.on_deferred = on_outcome
    loop.call_at(0.0, refill)
    loop.call_at(0.0, tick)
    loop.call_at(0.0, check)
    loop.call_at(warmup, start_measuring)
    loop.run(until=horizon)
    result.useful_gpu_h = (kept_gpu_s() - kept_at_warmup[0]) / 3600.0
    result.lost_gpu_h = {cause: (value - lost_at_warmup.get(cause, 0.0)) / 3600.0
                         for cause, value in ledger.lost_gpu_s.items()}
    result.loans = controller.stats.loans
    result.early_reclaims = controller.stats.early_reclaims
    result.load_misses = controller.stats.load_misses
    drains = [d for d in controller.stats.drains if d.time >= warmup]
    nights = max(1, len({int((d.time - window.start_s) // DAY_S) for d in drains}))
    for order in DrainOrder:
        result.drain_emptied[order.value] = sum(d.emptied[order.value] for d in drains) / nights
    return result


# ---------------------------------------------------------------------------------------------- the scenario
def run(settings: TidalSettings, progress: Progress) -> TidalFigures:
    inputs = build_inputs(settings)
    base = run_arm(settings, inputs, lend=False, progress=progress, label="baseline")
    ours = run_arm(settings, inputs, lend=True, progress=progress, label="tidal")
    reclaim = ours.lost_gpu_h.get("reclaim", 0.0) + ours.lost_gpu_h.get("early reclaim", 0.0)
    gain = ours.useful_gpu_h - base.useful_gpu_h
    measured_h = settings.days * 24.0 - settings.warmup_hours
    total_gpu_h = (settings.inference_nodes + settings.training_nodes) * settings.gpus_per_node * measured_h
    night = ours.lent_night_share
    return TidalFigures(
        night_conversion_pct=100.0 * float(np.mean(night)) if night else 0.0,
        lent_gpu_h=ours.lent_gpu_h,
        tidal_useful_training_gpu_h=ours.useful_gpu_h,
        baseline_useful_training_gpu_h=base.useful_gpu_h,
        tidal_training_held_gpu_h=ours.training_held_gpu_h,
        baseline_training_held_gpu_h=base.training_held_gpu_h,
        useful_training_gain_gpu_h=gain,
        useful_gain_pct_of_lent=100.0 * gain / ours.lent_gpu_h if ours.lent_gpu_h > 0 else 0.0,
        tidal_training_jobs_done=ours.jobs_done,
        baseline_training_jobs_done=base.jobs_done,
        tidal_inference_held_gpu_h=ours.inference_held_gpu_h,
        baseline_inference_held_gpu_h=base.inference_held_gpu_h,
        tidal_idle_gpu_h=ours.idle_gpu_h,
        baseline_idle_gpu_h=base.idle_gpu_h,
        allocation_gain_points=100.0 * (ours.held_gpu_h - base.held_gpu_h) / total_gpu_h,
        tidal_slo_minutes=ours.slo_minutes,
        baseline_slo_minutes=base.slo_minutes,
        slo_minutes_added=ours.slo_minutes - base.slo_minutes,
        tidal_lost_gpu_h=sum(ours.lost_gpu_h.values()),
        baseline_lost_gpu_h=sum(base.lost_gpu_h.values()),
        lost_to_reclaim_gpu_h=reclaim,
        lost_to_early_reclaim_gpu_h=ours.lost_gpu_h.get("early reclaim", 0.0),
        lost_to_reclaim_pct_of_lent=100.0 * reclaim / ours.lent_gpu_h if ours.lent_gpu_h > 0 else 0.0,
        loans=ours.loans,
        early_reclaims=ours.early_reclaims,
        load_misses=ours.load_misses,
        drain_emptied_fewest_instances=ours.drain_emptied[DrainOrder.FEWEST_INSTANCES.value],
        drain_emptied_newest=ours.drain_emptied[DrainOrder.NEWEST.value],
        time_h=tuple(ours.time_h),
        nodes_lent=tuple(ours.nodes_lent),
        tidal_inference_gpus=tuple(ours.inference_gpus),
        tidal_training_gpus=tuple(ours.training_gpus),
        baseline_training_gpus=tuple(base.training_gpus),
        tidal_violations=tuple(ours.violations),
        baseline_violations=tuple(base.violations),
        load_share=tuple(ours.load_share),
    )


def _f(value: float, digits: int = 1) -> str:
    return f"{value:.{digits}f}"


class TidalScenario:
    name = "tidal"
    title = "Tidal lending: inference nodes lent to training at night"
    settings = TidalSettings
    figures = TidalFigures
    ours = "tidal"
    arms = ("baseline", "tidal")
    goals = (
        Goal("no SLO minutes added", "slo_minutes_added", "<=", 0.0),
        Goal("reclaim loses at most 1 % of what is lent", "lost_to_reclaim_pct_of_lent", "<=", 1.0),
    )
    headlines = (
        Headline("useful_training_gain_gpu_h", "the load's daily peak/trough ratio (how much the night frees)",
                 "peak_trough_ratio", 4.0, "up"),
        Headline("lost_to_reclaim_gpu_h", "a save takes checkpoint_cost_s; one started at SIGTERM is kept only "
                 "if the reclaim grace covers it", "checkpoint_cost_s", 300.0, "up"),
        Headline("lost_to_reclaim_gpu_h", "training saves when told to stop (SIGTERM handler)",
                 "save_on_signal", False, "up"),
        Headline("slo_minutes_added", "cluster-wide flash crowds are rare (0.5 a day): one at night needs lent "
                 "nodes back, which takes the reclaim grace and a replica's start-up", "shared_bursts_per_day",
                 3.0, "up"),
    )
    quick: Mapping[str, object] = {"days": 2.0, "inference_nodes": 20, "training_nodes": 4, "services": 4,
                                   "job_nodes": (1, 2), "training_backlog": 4}

    def run(self, settings: TidalSettings, progress: Progress) -> TidalFigures:
        return run(settings, progress)

    def tables(self, figures: TidalFigures) -> Sequence[Table]:
        f = figures
        rows = (
            ("useful training work (GPU-h)", _f(f.baseline_useful_training_gpu_h), _f(f.tidal_useful_training_gpu_h)),
            ("GPU-hours training holds (occupancy)", _f(f.baseline_training_held_gpu_h),
             _f(f.tidal_training_held_gpu_h)),
            ("training jobs completed", str(f.baseline_training_jobs_done), str(f.tidal_training_jobs_done)),
            ("training work lost (GPU-h)", _f(f.baseline_lost_gpu_h, 2), _f(f.tidal_lost_gpu_h, 2)),
            ("GPU-hours inference holds", _f(f.baseline_inference_held_gpu_h), _f(f.tidal_inference_held_gpu_h)),
            ("GPU-hours no pod holds", _f(f.baseline_idle_gpu_h), _f(f.tidal_idle_gpu_h)),
            ("SLO service-minutes (seconds short, each minute)", _f(f.baseline_slo_minutes), _f(f.tidal_slo_minutes)),
        )
        lending = (
            ("night conversion (% of inference GPUs)", _f(f.night_conversion_pct)),
            ("GPU-hours lent", _f(f.lent_gpu_h)),
            ("useful training work gained (GPU-h)", _f(f.useful_training_gain_gpu_h)),
            ("  per GPU-hour lent (%)", _f(f.useful_gain_pct_of_lent)),
            ("SLO service-minutes added", _f(f.slo_minutes_added)),
            ("work lost to reclaim (GPU-h; early reclaim)",
             f"{f.lost_to_reclaim_gpu_h:.2f} ({f.lost_to_early_reclaim_gpu_h:.2f})"),
            ("  per GPU-hour lent (%)", _f(f.lost_to_reclaim_pct_of_lent, 2)),
            ("loans / early reclaims", f"{f.loans} / {f.early_reclaims}"),
            ("nodes emptied per night: fewest-instances / newest first",
             f"{f.drain_emptied_fewest_instances:.1f} / {f.drain_emptied_newest:.1f}"),
        )
        return (Table("baseline (no lending) against tidal", ("baseline", "tidal"), rows),
                Table("what lending did", ("tidal",), lending))

    def summary(self, figures: TidalFigures) -> str:
        f = figures
        return (f"tidal: night conversion {f.night_conversion_pct:.1f} %, useful training "
                f"+{f.useful_training_gain_gpu_h:.0f} GPU-h ({f.useful_gain_pct_of_lent:.0f} % of "
                f"{f.lent_gpu_h:.0f} lent), SLO minutes added "
                f"{f.slo_minutes_added:.1f}, lost to reclaim {f.lost_to_reclaim_gpu_h:.2f} GPU-h")


SCENARIO = TidalScenario()
