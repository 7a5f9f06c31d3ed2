"""The training-backfill scenario: normal pods with a diurnal arrival rate, with and without low-priority backfill.

Built on the scenario kit's world (`build_world`: `EventLoop` + `SimCluster` + the production `Scheduler`
with its admission) and its checkpointing job and lost-work ledger.

Normal pods take the trace's shapes (openb), arrive as a Poisson process whose rate follows the kit's
load model (thinning) and run for the trace's lifetimes; they are `training` pods (with
`online_share_of_ls`, pods of online QoS get the `online` class and preempt training pods). The backfill
arm adds a data-production pipeline that keeps `batch_backlog` low-priority batch pods (class
`batch-low`, the trace's one-card-or-less shapes) pending at all times, so they soak up every idle card
and fragment. A pod above the backfill is placed as if the backfill were not there, and the batch pods in
its way are evicted; it is nominated to those cards and bound when the last victim is gone.

An eviction takes the kubelet's real time: the victim gets its class's grace (`batch_grace_s`,
`normal_grace_s`), a job that traps SIGTERM starts a save and exits as soon as it is written (through
`SimCluster.container_exited`), one whose save cannot finish within the grace is killed when the grace
runs out, and the container then takes `kubelet_stop_s` to stop and free its cards. So a normal pod that
displaces backfill waits for that whole termination, and the wait figures say how long.

A preempted pod is resubmitted and resumes from its last kept save; what it did since is lost
(`WorkLedger`). Both arms share the seed, the cluster and the normal pods' arrivals, shapes and
durations, so the differences are the backfill's doing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from gpuplane.model import MILLI_PER_CARD, Catalog, ClusterState, NodeSpec, PodRequest, QoS, default_catalog
from gpuplane.model.priority import BATCH_LOW, DEV, ONLINE, TRAINING, PriorityClasses, default_priority_classes
from gpuplane.port import ClusterEvent, EventKind
from gpuplane.port.status import Code
from gpuplane.scheduler import Framework, Outcome, PolicyConfig, Profile, default_registry
from gpuplane.scheduler.framework import CycleState
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.scheduler.preemption import VictimOrder
from gpuplane.scheduler.scheduler import SchedulingRules
from gpuplane.sim.engine import _Entry
from gpuplane.sim.replay import window_mean
from gpuplane.sim.scenario import (
    DAY_S,
    CheckpointingJob,
    Figures,
    Goal,
    Headline,
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
from gpuplane.sim.scenario_file import ScenarioError
from gpuplane.sim.trace import TracePod, bundled_path, load_nodes, load_pods, resolve_trace

NO_BACKFILL = "no-backfill"
BACKFILL = "backfill"
PREEMPTED = "preempted"
"""The ledger's cause for work lost to a preemption."""


class BackfillSettings(WorldSettings):
    """Every parameter of the scenario. Loadable from YAML (`--scenario-file`) or `--set field=value`."""

    trace: str = Field(default="default", description="pod trace: a bundled name (default, gpushare40, "
                       "gpushare100) or a path to an openb pod list")
    nodes: str = Field(default="nodes", description="node list: 'nodes' (the bundled openb cluster) or a path")
    node_count: int = Field(default=32, ge=0, description="nodes drawn from the node list (0: all of it)")
    days: float = Field(default=1.0, gt=0, le=60)
    warmup_hours: float = Field(default=4.0, ge=0, description="left out of the figures while the cluster fills")
    normal_load: float = Field(default=0.7, gt=0, le=3, description="mean offered GPU load of normal pods")
    peak_trough_ratio: float = Field(default=2.08, ge=1.0, description="the arrival rate's daily peak over its "
                                     "trough (2.08: ±35 % around the mean)")
    peak_hour: float = Field(default=15.0, ge=0, lt=24)
    load_noise_cv: float = Field(default=0.0, ge=0.0, le=2.0, description="noise on the arrival rate "
                                 "(10-minute windows, lognormal)")
    min_duration_s: float = Field(default=60.0, gt=0)
    max_duration_s: float = Field(default=14400.0, gt=0)
    online_share_of_ls: bool = Field(default=False, description="trace pods of LS QoS run as class online "
                                     "(which preempts training); off: a training cluster, every normal pod training")
    batch_backlog: int = Field(default=12, ge=1, description="low-priority pods kept pending (backfill arm)")
    batch_mean_duration_s: float = Field(default=3600.0, gt=0)
    batch_save_every_s: float = Field(default=600.0, ge=0, description="work between a batch pod's saves "
                                      "(0: never saves)")
    batch_save_s: float = Field(default=20.0, ge=0, description="how long a batch pod's save takes")
    batch_saves_on_signal: bool = Field(default=True, description="a batch pod traps SIGTERM: it saves, then "
                                        "exits as soon as the save is written")
    batch_grace_s: float = Field(default=30.0, ge=0, description="grace of a preempted batch pod "
                                 "(Kubernetes' default terminationGracePeriodSeconds)")
    training_save_every_s: float = Field(default=1800.0, ge=0)
    training_save_s: float = Field(default=60.0, ge=0)
    training_saves_on_signal: bool = True
    normal_grace_s: float = Field(default=30.0, ge=0, description="grace of a preempted normal pod")
    sample_every_s: float = Field(default=300.0, gt=0)
    victim_order: VictimOrder = Field(default=VictimOrder.LOWEST_PRIORITY_FIRST,
                                      description="rank of candidate victims (see VictimOrder)")
    node_policy: str = "binpack"
    backfill_headroom_milli: int = Field(default=0, ge=0, description="the scheduler's rule of that name: "
                                         "GPU milli a batch pod must leave free on a node with normal pods")

    @model_validator(mode="after")
    def _consistent(self) -> BackfillSettings:
        if self.min_duration_s > self.max_duration_s:
            raise ValueError(f"min_duration_s {self.min_duration_s} is above max_duration_s {self.max_duration_s}")
        if self.warmup_hours * 3600.0 >= self.days * DAY_S:
            raise ValueError(f"warmup_hours {self.warmup_hours} leaves nothing of {self.days} day(s) to measure")
        if self.node_policy not in default_registry().node_policies:
            raise ValueError(f"unknown node_policy {self.node_policy!r} "
                             f"(choose from {', '.join(sorted(default_registry().node_policies))})")
        return self

    def classes(self) -> PriorityClasses:
        base = {c.name: c for c in default_priority_classes()}
        return PriorityClasses([
            base[ONLINE],
            replace(base[TRAINING], victim_grace_s=self.normal_grace_s),
            base[DEV],
            replace(base[BATCH_LOW], victim_grace_s=self.batch_grace_s),
        ])

    def load_model(self) -> LoadModel:
        return LoadModel(peak_trough_ratio=self.peak_trough_ratio, peak_hour=self.peak_hour,
                         noise_cv=self.load_noise_cv)

    def batch_save(self) -> SaveModel:
        return SaveModel(every_s=self.batch_save_every_s, save_s=self.batch_save_s,
                         on_signal=self.batch_saves_on_signal)

    def training_save(self) -> SaveModel:
        return SaveModel(every_s=self.training_save_every_s, save_s=self.training_save_s,
                         on_signal=self.training_saves_on_signal)


class BackfillFigures(Figures):
    """One seed's figures; waits and allocation leave out the warm-up, work counts the whole run."""

    nodes: int = figure("all", "nodes in the sampled cluster")
    gpus: int = figure("all", "GPUs in the sampled cluster")
    normal_pods: int = figure("all", "normal pods that arrived after the warm-up")
    no_backfill_allocation_pct: float = figure(NO_BACKFILL, "mean GPU allocation", "%")
    backfill_allocation_pct: float = figure(BACKFILL, "mean GPU allocation (cards of Terminating pods count)", "%")
    allocation_gain_points: float = figure(BACKFILL, "allocation with backfill minus without", "points")
    backfill_normal_allocation_pct: float = figure(BACKFILL, "mean GPU allocation of normal pods alone", "%")
    no_backfill_normal_wait_mean_s: float = figure(NO_BACKFILL, "normal pods' mean wait, arrival to bind", "s")
    no_backfill_normal_wait_p50_s: float = figure(NO_BACKFILL, "normal pods' median wait", "s")
    no_backfill_normal_wait_p95_s: float = figure(NO_BACKFILL, "normal pods' 95th-percentile wait", "s")
    no_backfill_normal_wait_p99_s: float = figure(NO_BACKFILL, "normal pods' 99th-percentile wait", "s")
    backfill_normal_wait_mean_s: float = figure(BACKFILL, "normal pods' mean wait, arrival to bind", "s")
    backfill_normal_wait_p50_s: float = figure(BACKFILL, "normal pods' median wait", "s")
    backfill_normal_wait_p95_s: float = figure(BACKFILL, "normal pods' 95th-percentile wait", "s")
    backfill_normal_wait_p99_s: float = figure(BACKFILL, "normal pods' 99th-percentile wait", "s")
    normal_wait_added_mean_s: float = figure(BACKFILL, "mean wait with backfill minus without", "s")
    normal_wait_added_p95_s: float = figure(BACKFILL, "p95 wait with backfill minus without", "s")
    normal_pods_waited_longer_pct: float = figure(BACKFILL, "normal pods that waited over 1 s longer than the "
                                                  "same pod without backfill", "%")
    normal_pods_waited_for_victims_pct: float = figure(BACKFILL, "normal pods nominated to cards whose batch "
                                                       "pods were still terminating", "%")
    normal_wait_for_victims_p50_s: float = figure(BACKFILL, "median wait of the normal pods that waited for "
                                                  "victims", "s")
    batch_preemptions: int = figure(BACKFILL, "batch pods evicted by preemption")
    batch_useful_gpu_h: float = figure(BACKFILL, "batch work kept (saved or completed)", "GPU-h")
    batch_lost_gpu_h: float = figure(BACKFILL, "batch work lost to preemption (since the last kept save)", "GPU-h")
    batch_lost_pct: float = figure(BACKFILL, "batch work lost as a share of all batch work done", "%")
    no_backfill_normal_lost_gpu_h: float = figure(NO_BACKFILL, "normal work lost to preemption (online "
                                                  "preempting training)", "GPU-h")
    backfill_normal_lost_gpu_h: float = figure(BACKFILL, "normal work lost to preemption", "GPU-h")
    no_backfill_normal_pending_at_end: int = figure(NO_BACKFILL, "normal pods still pending at the end")
    backfill_normal_pending_at_end: int = figure(BACKFILL, "normal pods still pending at the end")
    excluded_trace_shapes: int = figure("all", "trace pods left out: no node of the sampled cluster holds them")
    window_s: tuple[float, float] = series("the measurement window (after the warm-up)")
    time_s: tuple[float, ...] = series("sample times")
    no_backfill_allocation_series: tuple[float, ...] = series("GPU allocation over time, without backfill (%)")
    backfill_allocation_series: tuple[float, ...] = series("GPU allocation over time, with backfill (%)")
    backfill_normal_allocation_series: tuple[float, ...] = series("normal pods' allocation with backfill (%)")
    no_backfill_waits_s: tuple[float, ...] = series("each measured normal pod's wait, without backfill")
    backfill_waits_s: tuple[float, ...] = series("each measured normal pod's wait, with backfill (same order)")


# ---------------------------------------------------------------------------------------------- inputs
@functools.lru_cache(maxsize=4)
def _trace_pods(path: str) -> tuple[TracePod, ...]:
    return tuple(load_pods(path, default_catalog()))


@functools.lru_cache(maxsize=4)
def _trace_nodes(path: str) -> tuple[NodeSpec, ...]:
    return tuple(load_nodes(path, default_catalog()))


def _nodes_path(name: str) -> Path:
    return bundled_path("nodes") if name == "nodes" else Path(name)


def _sample_nodes(nodes: Sequence[NodeSpec], count: int, rng: np.random.Generator) -> list[NodeSpec]:
    if count == 0 or count >= len(nodes):
        return list(nodes)
    picks = np.sort(rng.choice(len(nodes), size=count, replace=False))
    return [nodes[int(i)] for i in picks]


def _placeable(catalog: Catalog, nodes: Sequence[NodeSpec], profile: Profile,
               pods: Sequence[TracePod]) -> tuple[list[TracePod], int]:
    """The pods some node of an empty cluster could hold (the rest could never run there)."""
    state = ClusterState(catalog, nodes)
    framework = Framework(profile, np.random.default_rng(0))
    verdict: dict[object, bool] = {}
    kept: list[TracePod] = []
    for pod in pods:
        r = pod.request
        key = (r.cpu_milli, r.memory_mib, r.gpu, r.models)
        if key not in verdict:
            alive, _ = framework.find_nodes(CycleState(), r, state, diagnose=False)
            verdict[key] = bool(alive.any())
        if verdict[key]:
            kept.append(pod)
    return kept, len(pods) - len(kept)


def _profile(settings: BackfillSettings, pods: Sequence[TracePod]) -> Profile:
    typical = TypicalPods.from_workload(p.request for p in pods)
    return default_registry().build(PolicyConfig(node_policy=settings.node_policy, seed=settings.seed,
                                                 typical=typical))


def _arrivals(settings: BackfillSettings, mean_rate: float, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """Non-homogeneous Poisson arrivals by thinning, the rate following the kit's load model."""
    horizon = settings.days * DAY_S
    curve = sample_load(settings.load_model(), days=settings.days, mean=mean_rate, rng=rng)
    peak_rate = curve.peak()
    times = np.cumsum(rng.exponential(1.0 / peak_rate, int(peak_rate * horizon * 1.1) + 32))
    times = times[times < horizon]
    rate = curve.value[np.minimum((times // curve.step_s).astype(np.int64), len(curve.value) - 1)]
    accepted: npt.NDArray[np.float64] = times[rng.random(len(times)) < rate / peak_rate]
    return accepted


@dataclass(frozen=True, slots=True)
class _Workload:
    normal: list[tuple[float, PodRequest, float]]
    """(arrival, request, duration) of every normal pod."""
    batch_shapes: list[PodRequest]


def _workload(settings: BackfillSettings, pods: Sequence[TracePod], capacity_milli: int,
              rng: np.random.Generator) -> _Workload:
    lifetimes = np.array([p.lifetime if p.lifetime is not None else np.nan for p in pods], np.float64)
    median = float(np.nanmedian(lifetimes)) if np.isfinite(lifetimes).any() else 600.0
    durations = np.clip(np.where(np.isfinite(lifetimes), lifetimes, median), settings.min_duration_s,
                        settings.max_duration_s)
    gpu = np.array([p.request.gpu_milli_total for p in pods], np.float64)
    mean_work = float((gpu * durations).mean())
    if mean_work <= 0:
        raise ScenarioError("the trace's pods ask for no GPU: nothing to schedule")
    times = _arrivals(settings, settings.normal_load * capacity_milli / mean_work, rng)
    picks = rng.integers(len(pods), size=len(times))
    normal: list[tuple[float, PodRequest, float]] = []
    for k, (at, i) in enumerate(zip(times.tolist(), picks.tolist(), strict=True)):
        request = pods[i].request
        online = settings.online_share_of_ls and request.qos is QoS.ONLINE
        request = replace(request, name=f"normal-{k:06d}", priority_class=ONLINE if online else TRAINING,
                          checkpoint_every_s=0.0 if online else settings.training_save_every_s)
        normal.append((at, request, float(durations[i])))
    small = [p.request for p in pods if 0 < p.request.gpu_milli_total <= MILLI_PER_CARD]
    if not small:
        raise ScenarioError("the trace has no pod of one card or less to use as a batch shape")
    return _Workload(normal, small)


# ---------------------------------------------------------------------------------------------- one arm
@dataclass(slots=True)
class _Pod:
    """One job's current pod: the job outlives its pods (a preempted pod is resubmitted under a new name)."""

    job: CheckpointingJob
    request: PodRequest
    kind: str
    """normal or batch"""
    arrival: float
    attempt: int = 0
    departure: _Entry | None = None
    nominated: bool = False


@dataclass(slots=True)
class ArmRun:
    """One arm's raw results."""

    time_s: list[float] = field(default_factory=list)
    allocation_pct: list[float] = field(default_factory=list)
    normal_allocation_pct: list[float] = field(default_factory=list)
    waits: dict[str, float] = field(default_factory=dict)
    """normal pod name → wait from arrival to its first bind (pods that arrived after the warm-up)"""
    waited_for_victims: set[str] = field(default_factory=set)
    pending_at_end: int = 0
    batch_preemptions: int = 0
    batch: WorkLedger = field(default_factory=WorkLedger)
    normal: WorkLedger = field(default_factory=WorkLedger)
    window_s: tuple[float, float] = (0.0, 0.0)

    def mean(self, values: Sequence[float]) -> float:
        return window_mean(self.time_s, values, self.window_s)


def run_arm(catalog: Catalog, nodes: Sequence[NodeSpec], workload: _Workload, profile: Profile,
            settings: BackfillSettings, *, backfill: bool) -> ArmRun:
    """One arm on the kit's world; `nodes` and the workload are used as given."""
    classes = settings.classes()
    world = build_world(catalog, nodes, profile, seed=settings.seed, stop_s=settings.kubelet_stop_s,
                        classes=classes, rules=SchedulingRules(classes=classes, victim_order=settings.victim_order,
                                              backfill_headroom_milli=settings.backfill_headroom_milli))
    loop, cluster, scheduler = world.loop, world.cluster, world.scheduler
    capacity = cluster.state.total_gpu_milli()
    horizon, warmup = settings.days * DAY_S, settings.warmup_hours * 3600.0
    run = ArmRun(window_s=(warmup, horizon))
    batch_rng = np.random.default_rng([settings.seed, 1])
    batch_save, training_save = settings.batch_save(), settings.training_save()
    pods: dict[str, _Pod] = {}
    normal_milli = 0
    batch_count = 0
    pending_batch = 0
    refill_due = False

    def submit(pod: _Pod) -> None:
        nonlocal pending_batch
        pods[pod.request.name] = pod
        status = cluster.create_pod(pod.request)
        if not status.ok:
            raise ScenarioError(status.message)
        if pod.kind == "batch":
            pending_batch += 1

    def new_batch() -> None:
        nonlocal batch_count
        shape = workload.batch_shapes[int(batch_rng.integers(len(workload.batch_shapes)))]
        name = f"batch-{batch_count:06d}"
        batch_count += 1
        request = replace(shape, name=name, priority_class=BATCH_LOW, qos=QoS.BEST_EFFORT,
                          checkpoint_every_s=settings.batch_save_every_s)
        work = float(np.clip(batch_rng.exponential(settings.batch_mean_duration_s), 60.0,
                             4 * settings.batch_mean_duration_s))
        job = CheckpointingJob(name, work, shape.gpu_milli_total / MILLI_PER_CARD, batch_save)
        submit(_Pod(job, request, "batch", loop.now()))

    def top_up() -> None:
        if backfill and loop.now() < horizon:
            while pending_batch < settings.batch_backlog:
                new_batch()

    def on_outcome(outcome: Outcome) -> bool:
        pod = pods.get(outcome.request.name)
        if pod is not None and outcome.decision.status.code is Code.WAIT:
            pod.nominated = True
        return True

    def schedule() -> None:
        top_up()
        scheduler.run_pending(on_outcome)

    def refill() -> None:
        nonlocal refill_due
        refill_due = False
        schedule()

    def finish(name: str) -> None:
        pod = pods[name]
        pod.departure = None
        pod.job.complete(loop.now())
        (run.normal if pod.kind == "normal" else run.batch).completed(pod.job)
        cluster.delete_pod(name)
        schedule()

    def exited(name: str) -> None:
        cluster.container_exited(name)  # refused (harmlessly) if the pod is gone already

    def on_bound(pod: _Pod, event: ClusterEvent) -> None:
        nonlocal normal_milli, pending_batch, refill_due
        now = loop.now()
        pod.job.start(now)
        pod.departure = loop.call_at(pod.job.finish_time(now), functools.partial(finish, pod.request.name))
        if pod.kind == "batch":
            pending_batch -= 1
            if pending_batch < settings.batch_backlog and not refill_due:
                refill_due = True
                loop.call_later(0.0, refill)
            return
        assert event.pod is not None and event.pod.assignment is not None
        normal_milli += event.pod.assignment.gpu_milli
        if pod.attempt == 0 and pod.arrival >= warmup:
            run.waits[pod.request.name] = now - pod.arrival
            if pod.nominated:
                run.waited_for_victims.add(pod.request.name)

    def on_terminating(pod: _Pod, grace: float) -> None:
        now = loop.now()
        if pod.departure is not None:
            pod.departure.cancel()
            pod.departure = None
        outcome = pod.job.stop(now, grace)
        (run.normal if pod.kind == "normal" else run.batch).stopped(pod.job, outcome, PREEMPTED)
        if pod.kind == "batch":
            run.batch_preemptions += 1
        if outcome.exit_s < now + grace:
            loop.call_at(outcome.exit_s, functools.partial(exited, pod.request.name))

    def on_deleted(pod: _Pod, event: ClusterEvent) -> None:
        nonlocal normal_milli
        if pod.kind == "normal" and event.pod is not None and event.pod.assignment is not None:
            normal_milli -= event.pod.assignment.gpu_milli
        if pod.job.running or pod.job.saved_s >= pod.job.work_s:
            return  # completed (or deleted pending, which the scenario never does)
        base = pod.request.name.split("~")[0]
        again = _Pod(pod.job, replace(pod.request, name=f"{base}~{pod.attempt + 1}"), pod.kind, pod.arrival,
                     pod.attempt + 1)
        loop.call_later(0.0, functools.partial(resubmit, again))

    def on_event(event: ClusterEvent) -> None:
        if event.pod is None:
            return
        pod = pods.get(event.pod.name)
        if pod is None:
            return
        if event.kind is EventKind.POD_BOUND:
            on_bound(pod, event)
        elif event.kind is EventKind.POD_TERMINATING:
            on_terminating(pod, classes.victim_grace_s(pod.request))
        elif event.kind is EventKind.POD_DELETED:
            del pods[event.pod.name]
            if pod.job.running:  # evicted with no grace and no stop time: gone without Terminating
                on_terminating(pod, 0.0)
            if event.pod.assignment is not None:
                on_deleted(pod, event)

    def resubmit(pod: _Pod) -> None:
        submit(pod)
        schedule()

    def arrive(k: int) -> None:
        at, request, duration = workload.normal[k]
        job = CheckpointingJob(request.name, duration, request.gpu_milli_total / MILLI_PER_CARD, training_save)
        submit(_Pod(job, request, "normal", at))
        schedule()

    def sample() -> None:
        run.time_s.append(loop.now())
        run.allocation_pct.append(cluster.state.used_gpu_milli() * 100.0 / capacity)
        run.normal_allocation_pct.append(normal_milli * 100.0 / capacity)
        if loop.now() + settings.sample_every_s <= horizon:
            loop.call_later(settings.sample_every_s, sample)

    cluster.watch(on_event)
    for k, (at, _, _) in enumerate(workload.normal):
        loop.call_at(at, functools.partial(arrive, k))
    loop.call_at(0.0, sample)
    if backfill:
        loop.call_at(0.0, schedule)
    loop.run(until=horizon)
    run.pending_at_end = sum(1 for p in pods.values() if p.kind == "normal" and not p.job.running)
    return run


# ---------------------------------------------------------------------------------------------- figures
def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _figures(without: ArmRun, with_backfill: ArmRun, nodes: int, gpus: int, excluded: int) -> BackfillFigures:
    names = sorted(without.waits)
    a = [without.waits[n] for n in names]
    b = [with_backfill.waits.get(n, math.inf) for n in names]
    measured = [w for w in b if math.isfinite(w)]
    longer = sum(1 for x, y in zip(a, b, strict=True) if y > x + 1.0)
    batch_lost = with_backfill.batch.lost_gpu_h(PREEMPTED)
    batch_done = with_backfill.batch.useful_gpu_h + batch_lost
    count = max(len(names), 1)
    no_alloc, alloc = without.mean(without.allocation_pct), with_backfill.mean(with_backfill.allocation_pct)
    return BackfillFigures(
        nodes=nodes, gpus=gpus, normal_pods=len(names),
        no_backfill_allocation_pct=no_alloc, backfill_allocation_pct=alloc, allocation_gain_points=alloc - no_alloc,
        backfill_normal_allocation_pct=with_backfill.mean(with_backfill.normal_allocation_pct),
        no_backfill_normal_wait_mean_s=float(np.mean(a)) if a else 0.0,
        no_backfill_normal_wait_p50_s=_pct(a, 50), no_backfill_normal_wait_p95_s=_pct(a, 95),
        no_backfill_normal_wait_p99_s=_pct(a, 99),
        backfill_normal_wait_mean_s=float(np.mean(measured)) if measured else 0.0,
        backfill_normal_wait_p50_s=_pct(measured, 50), backfill_normal_wait_p95_s=_pct(measured, 95),
        backfill_normal_wait_p99_s=_pct(measured, 99),
        normal_wait_added_mean_s=(float(np.mean(measured)) if measured else 0.0) - (float(np.mean(a)) if a else 0.0),
        normal_wait_added_p95_s=_pct(measured, 95) - _pct(a, 95),
        normal_pods_waited_longer_pct=longer * 100.0 / count,
        normal_pods_waited_for_victims_pct=len(with_backfill.waited_for_victims) * 100.0 / count,
        normal_wait_for_victims_p50_s=_pct([with_backfill.waits[n] for n in with_backfill.waited_for_victims], 50),
        batch_preemptions=with_backfill.batch_preemptions,
        batch_useful_gpu_h=with_backfill.batch.useful_gpu_h, batch_lost_gpu_h=batch_lost,
        batch_lost_pct=batch_lost * 100.0 / batch_done if batch_done > 0 else 0.0,
        no_backfill_normal_lost_gpu_h=without.normal.lost_gpu_h(PREEMPTED),
        backfill_normal_lost_gpu_h=with_backfill.normal.lost_gpu_h(PREEMPTED),
        no_backfill_normal_pending_at_end=without.pending_at_end,
        backfill_normal_pending_at_end=with_backfill.pending_at_end,
        excluded_trace_shapes=excluded,
        window_s=without.window_s, time_s=tuple(without.time_s),
        no_backfill_allocation_series=tuple(without.allocation_pct),
        backfill_allocation_series=tuple(with_backfill.allocation_pct),
        backfill_normal_allocation_series=tuple(with_backfill.normal_allocation_pct),
        no_backfill_waits_s=tuple(a), backfill_waits_s=tuple(b),
    )


def run_backfill(settings: BackfillSettings, progress: Progress) -> BackfillFigures:
    """Sample the cluster, then run both arms on the same workload."""
    catalog = default_catalog()
    trace = _trace_pods(str(resolve_trace(settings.trace)))
    rng = np.random.default_rng(settings.seed)
    sampled = _sample_nodes(_trace_nodes(str(_nodes_path(settings.nodes))), settings.node_count, rng)
    profile = _profile(settings, trace)
    usable, excluded = _placeable(catalog, sampled, profile, trace)
    if not usable:
        raise ScenarioError("no trace pod fits any node of the sampled cluster")
    capacity = ClusterState(catalog, sampled).total_gpu_milli()
    workload = _workload(settings, usable, capacity, rng)
    arms: list[ArmRun] = []
    for done, backfill in enumerate((False, True)):
        progress("arms", done, 2)
        arms.append(run_arm(catalog, sampled, workload, _profile(settings, trace), settings, backfill=backfill))
    progress("arms", 2, 2)
    return _figures(arms[0], arms[1], len(sampled), capacity // MILLI_PER_CARD, excluded)


class _BackfillScenario:
    name = "training-backfill"
    title = "Training cluster with low-priority backfill"
    settings = BackfillSettings
    figures = BackfillFigures
    ours = BACKFILL
    arms = (NO_BACKFILL, BACKFILL)
    goals = (
        Goal("backfill fills idle cards", "allocation_gain_points", ">=", 15.0),
        Goal("normal pods' p95 wait grows by at most one eviction", "normal_wait_added_p95_s", "<=", 32.0),
    )
    headlines = (
        Headline("allocation_gain_points", "a batch backlog is always pending to fill what normal pods leave",
                 "batch_backlog", 1, "down"),
        Headline("normal_wait_added_mean_s", "a displaced batch pod's container stops kubelet_stop_s after it "
                 "exits", "kubelet_stop_s", 20.0, "up"),
        Headline("normal_wait_added_mean_s", "a batch pod traps SIGTERM and exits once its save is written",
                 "batch_saves_on_signal", False, "down"),
        Headline("normal_wait_added_mean_s", "batch pods may fill the fragments beside normal pods",
                 "backfill_headroom_milli", 1000, "down"),
        Headline("allocation_gain_points", "batch pods may fill the fragments beside normal pods",
                 "backfill_headroom_milli", 1000, "down"),
        Headline("batch_lost_gpu_h", "a batch pod saves on SIGTERM and its save fits in the grace",
                 "batch_save_s", 45.0, "up"),
        Headline("batch_lost_gpu_h", "the victims' grace (30 s, Kubernetes' default) covers a batch pod's save",
                 "batch_grace_s", 10.0, "up"),
    )
    quick: Mapping[str, object] = MappingProxyType({"node_count": 16, "days": 0.5, "warmup_hours": 2.0,
                                                    "batch_backlog": 6})

    def run(self, settings: BackfillSettings, progress: Progress) -> BackfillFigures:
        return run_backfill(settings, progress)

    def tables(self, figures: BackfillFigures) -> Sequence[Table]:
        f = figures
        rows = (
            ("mean GPU allocation (%)", f"{f.no_backfill_allocation_pct:.1f}", f"{f.backfill_allocation_pct:.1f}"),
            ("  of which normal pods (%)", f"{f.no_backfill_allocation_pct:.1f}",
             f"{f.backfill_normal_allocation_pct:.1f}"),
            ("normal pods: wait p50 (s)", f"{f.no_backfill_normal_wait_p50_s:.1f}",
             f"{f.backfill_normal_wait_p50_s:.1f}"),
            ("normal pods: wait p95 (s)", f"{f.no_backfill_normal_wait_p95_s:.1f}",
             f"{f.backfill_normal_wait_p95_s:.1f}"),
            ("normal pods: wait p99 (s)", f"{f.no_backfill_normal_wait_p99_s:.1f}",
             f"{f.backfill_normal_wait_p99_s:.1f}"),
            ("normal pods: mean wait (s)", f"{f.no_backfill_normal_wait_mean_s:.1f}",
             f"{f.backfill_normal_wait_mean_s:.1f}"),
            ("normal pods that waited longer (%)", "", f"{f.normal_pods_waited_longer_pct:.1f}"),
            ("normal pods that waited for victims (%)", "", f"{f.normal_pods_waited_for_victims_pct:.1f}"),
            ("  their median wait (s)", "", f"{f.normal_wait_for_victims_p50_s:.1f}"),
            ("normal pods pending at the end", str(f.no_backfill_normal_pending_at_end),
             str(f.backfill_normal_pending_at_end)),
            ("normal work lost (GPU-h)", f"{f.no_backfill_normal_lost_gpu_h:.2f}",
             f"{f.backfill_normal_lost_gpu_h:.2f}"),
            ("batch pods preempted", "", str(f.batch_preemptions)),
            ("batch work kept (GPU-h)", "", f"{f.batch_useful_gpu_h:.1f}"),
            ("batch work lost (GPU-h)", "", f"{f.batch_lost_gpu_h:.2f}"),
        )
        return (Table(f"{f.nodes} nodes, {f.gpus} GPUs, {f.normal_pods} measured normal pods",
                      ("no backfill", "backfill"), rows),)

    def summary(self, figures: BackfillFigures) -> str:
        f = figures
        return (f"backfill: allocation {f.no_backfill_allocation_pct:.1f} → {f.backfill_allocation_pct:.1f} % "
                f"({f.allocation_gain_points:+.1f} points); normal-pod wait mean {f.no_backfill_normal_wait_mean_s:.1f}"
                f" → {f.backfill_normal_wait_mean_s:.1f} s, p95 {f.no_backfill_normal_wait_p95_s:.1f} → "
                f"{f.backfill_normal_wait_p95_s:.1f} s; {f.normal_pods_waited_longer_pct:.1f} % of normal pods "
                f"waited longer; batch work lost {f.batch_lost_gpu_h:.2f} GPU-h")


SCENARIO = _BackfillScenario()

__all__ = ["BACKFILL", "NO_BACKFILL", "SCENARIO", "ArmRun", "BackfillFigures", "BackfillSettings", "run_arm",
           "run_backfill"]
