"""The training-backfill scenario: normal pods with a diurnal arrival rate, with and without low-priority backfill.

Normal pods take the trace's shapes (openb), arrive as a Poisson process whose rate follows the day
(thinning) and run for the trace's lifetimes; they are `training` pods (with `online_share_of_ls`, pods of
online QoS get the `online` class and preempt training pods). The backfill run adds a data-production
pipeline: it keeps `batch_backlog` low-priority batch pods (class `batch-low`, the trace's
one-card-or-less shapes) pending at all times, so they soak up every idle card and fragment; the scheduler
preempts them at once (grace 0 s) when a normal pod needs the room.
A preempted pod (of any class) is resubmitted with the work it still has to do, and the work since its last
checkpoint is counted as lost.

Both runs share the seed, the cluster and the normal pods' arrival times, shapes and durations, so the
differences are the backfill's doing. Everything the scheduler does goes through the cluster port.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.model import MILLI_PER_CARD, Catalog, ClusterState, NodeSpec, PodRequest, QoS
from gpuplane.model.priority import (
    BATCH_LOW,
    ONLINE,
    TRAINING,
    PriorityClass,
    PriorityClasses,
    default_priority_classes,
)
from gpuplane.port import ClusterEvent, EventKind
from gpuplane.scheduler import Framework, Outcome, Profile, Scheduler
from gpuplane.scheduler.admission import Admission
from gpuplane.scheduler.framework import CycleState
from gpuplane.scheduler.preemption import VictimOrder
from gpuplane.scheduler.scheduler import SchedulingRules
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop, _Entry
from gpuplane.sim.replay import window_mean
from gpuplane.sim.scenario_file import ScenarioError, load_scenario_model
from gpuplane.sim.trace import TracePod

Progress = Callable[[int, int], None]
DAY_S = 86400.0


class BackfillScenario(BaseModel):
    """Every parameter of the scenario; the defaults are the issue's. Loadable from YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_count: int = Field(default=256, ge=0, description="nodes drawn from the trace cluster (0: all of it)")
    days: float = Field(default=2.0, gt=0, le=60)
    warmup_hours: float = Field(default=6.0, ge=0, description="left out of the figures while the cluster fills")
    normal_load: float = Field(default=0.7, gt=0, le=3, description="mean offered GPU load of normal pods")
    diurnal_amplitude: float = Field(default=0.35, ge=0, lt=1,
                                     description="rate(t) = mean × (1 + a·cos(2π (t − peak)/24 h))")
    peak_hour: float = Field(default=15.0, ge=0, lt=24)
    min_duration_s: float = Field(default=60.0, gt=0)
    max_duration_s: float = Field(default=14400.0, gt=0)
    online_share_of_ls: bool = Field(default=False, description="trace pods of LS QoS run as class online "
                                     "(which preempts training); off: a training cluster, every normal pod training")
    batch_backlog: int = Field(default=64, ge=1, description="low-priority pods kept pending (backfill run)")
    batch_mean_duration_s: float = Field(default=3600.0, gt=0)
    batch_checkpoint_every_s: float = Field(default=600.0, ge=0, description="0: batch pods never checkpoint")
    training_checkpoint_every_s: float = Field(default=1800.0, ge=0)
    batch_grace_s: float = Field(default=0.0, ge=0, description="grace period of a preempted batch pod")
    normal_grace_s: float = Field(default=30.0, ge=0, description="grace period of a preempted normal pod")
    sample_every_s: float = Field(default=300.0, gt=0)
    victim_order: VictimOrder = Field(default=VictimOrder.LOWEST_PRIORITY_FIRST,
                                      description="rank of candidate victims (see VictimOrder)")
    node_policy: str = "binpack"
    seed: int = 42

    @model_validator(mode="after")
    def _consistent(self) -> BackfillScenario:
        if self.min_duration_s > self.max_duration_s:
            raise ValueError(f"min_duration_s {self.min_duration_s} is above max_duration_s {self.max_duration_s}")
        if self.warmup_hours * 3600.0 >= self.days * DAY_S:
            raise ValueError(f"warmup_hours {self.warmup_hours} leaves nothing of {self.days} day(s) to measure")
        return self

    def classes(self) -> PriorityClasses:
        base = {c.name: c for c in default_priority_classes()}
        return PriorityClasses([
            base[ONLINE],
            replace(base[TRAINING], victim_grace_s=self.normal_grace_s),
            base["dev"],
            replace(base[BATCH_LOW], victim_grace_s=self.batch_grace_s),
        ])


def load_scenario(path: str | Path, **overrides: object) -> BackfillScenario:
    """The scenario in `path` with `overrides` applied, validated together; errors name the file and field."""
    return load_scenario_model(path, BackfillScenario, overrides, ScenarioError)


@dataclass(slots=True)
class _Job:
    request: PodRequest
    kind: str
    """normal or batch"""
    arrival: float
    remaining_s: float
    pod: str
    attempt: int = 0
    started: float = -1.0
    departure: _Entry | None = None
    finishing: bool = False


@dataclass(slots=True)
class BackfillRun:
    """One run's figures (the window excludes the warm-up)."""

    backfill: bool
    nodes: int
    gpus: int
    time_s: list[float] = field(default_factory=list)
    allocation_pct: list[float] = field(default_factory=list)
    normal_allocation_pct: list[float] = field(default_factory=list)
    normal_waits_s: list[float] = field(default_factory=list)
    normal_submitted: int = 0
    normal_placed: int = 0
    normal_pending_at_end: int = 0
    batch_submitted: int = 0
    batch_completed: int = 0
    batch_gpu_hours_done: float = 0.0
    preemptions: int = 0
    """Pods evicted by preemption."""
    normal_preempted: int = 0
    batch_preempted: int = 0
    work_lost_gpu_hours: float = 0.0
    preemption_plans: int = 0
    decisions: int = 0
    wall_s: float = 0.0
    window_s: tuple[float, float] = (0.0, 0.0)

    @property
    def mean_allocation_pct(self) -> float:
        return window_mean(self.time_s, self.allocation_pct, self.window_s)

    @property
    def mean_normal_allocation_pct(self) -> float:
        return window_mean(self.time_s, self.normal_allocation_pct, self.window_s)

    def wait_percentile(self, q: float) -> float:
        return float(np.percentile(self.normal_waits_s, q)) if self.normal_waits_s else 0.0


@dataclass(slots=True)
class BackfillComparison:
    scenario: BackfillScenario
    without: BackfillRun
    with_backfill: BackfillRun
    excluded_shapes: int = 0
    """Trace pods left out because no node of the sampled cluster could ever hold them."""

    def figures(self) -> dict[str, float | int | str | bool]:
        """Flat keys with units, as `--json` prints them."""
        a, b = self.without, self.with_backfill
        out: dict[str, float | int | str | bool] = {"scenario": "training-backfill", "nodes": a.nodes, "gpus": a.gpus,
                                                   "days": self.scenario.days, "seed": self.scenario.seed,
                                                   "node_policy": self.scenario.node_policy,
                                                   "victim_order": self.scenario.victim_order.value}
        for prefix, run in (("no_backfill", a), ("backfill", b)):
            out |= {
                f"{prefix}_mean_allocation_pct": round(run.mean_allocation_pct, 3),
                f"{prefix}_normal_allocation_pct": round(run.mean_normal_allocation_pct, 3),
                f"{prefix}_normal_wait_p50_s": round(run.wait_percentile(50), 1),
                f"{prefix}_normal_wait_p95_s": round(run.wait_percentile(95), 1),
                f"{prefix}_normal_wait_mean_s": round(float(np.mean(run.normal_waits_s)) if run.normal_waits_s
                                                      else 0.0, 1),
                f"{prefix}_normal_pods_submitted": run.normal_submitted,
                f"{prefix}_normal_pods_placed": run.normal_placed,
                f"{prefix}_normal_pods_pending_at_end": run.normal_pending_at_end,
                f"{prefix}_preemptions": run.preemptions,
                f"{prefix}_normal_pods_preempted": run.normal_preempted,
                f"{prefix}_batch_pods_preempted": run.batch_preempted,
                f"{prefix}_work_lost_gpu_hours": round(run.work_lost_gpu_hours, 2),
                f"{prefix}_batch_gpu_hours_done": round(run.batch_gpu_hours_done, 2),
                f"{prefix}_batch_pods_completed": run.batch_completed,
                f"{prefix}_wall_s": round(run.wall_s, 2),
            }
        out["allocation_gain_points"] = round(b.mean_allocation_pct - a.mean_allocation_pct, 3)
        out["normal_wait_p50_change_pct"] = _change(a.wait_percentile(50), b.wait_percentile(50))
        out["normal_wait_p95_change_pct"] = _change(a.wait_percentile(95), b.wait_percentile(95))
        out["excluded_trace_shapes"] = self.excluded_shapes
        return out


def _change(before: float, after: float) -> float:
    """Relative change in percent; waits under one second count as equal."""
    if max(before, after) < 1.0:
        return 0.0
    return round((after - before) * 100.0 / max(before, 1.0), 2)


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


def _arrivals(scenario: BackfillScenario, mean_rate: float, rng: np.random.Generator) -> npt.NDArray[np.float64]:
    """Non-homogeneous Poisson arrivals by thinning: rate(t) = mean × (1 + a·cos(2π (t − peak)/day))."""
    horizon = scenario.days * DAY_S
    peak_rate = mean_rate * (1.0 + scenario.diurnal_amplitude)
    count = int(peak_rate * horizon * 1.1) + 32
    times = np.cumsum(rng.exponential(1.0 / peak_rate, count))
    times = times[times < horizon]
    phase = 2.0 * math.pi * (times - scenario.peak_hour * 3600.0) / DAY_S
    accept = rng.random(len(times)) < (1.0 + scenario.diurnal_amplitude * np.cos(phase)) / \
        (1.0 + scenario.diurnal_amplitude)
    accepted: npt.NDArray[np.float64] = times[accept]
    return accepted


@dataclass(frozen=True, slots=True)
class _Workload:
    normal: list[tuple[float, PodRequest, float]]
    """(arrival, request, duration) of every normal pod."""
    batch_shapes: list[PodRequest]


def _workload(scenario: BackfillScenario, pods: Sequence[TracePod], capacity_milli: int,
              rng: np.random.Generator) -> _Workload:
    lifetimes = np.array([p.lifetime if p.lifetime is not None else np.nan for p in pods], np.float64)
    median = float(np.nanmedian(lifetimes)) if np.isfinite(lifetimes).any() else 600.0
    durations = np.clip(np.where(np.isfinite(lifetimes), lifetimes, median), scenario.min_duration_s,
                        scenario.max_duration_s)
    gpu = np.array([p.request.gpu_milli_total for p in pods], np.float64)
    mean_work = float((gpu * durations).mean())
    if mean_work <= 0:
        raise ScenarioError("the trace's pods ask for no GPU: nothing to schedule")
    rate = scenario.normal_load * capacity_milli / mean_work
    times = _arrivals(scenario, rate, rng)
    picks = rng.integers(len(pods), size=len(times))
    normal: list[tuple[float, PodRequest, float]] = []
    for k, (at, i) in enumerate(zip(times.tolist(), picks.tolist(), strict=True)):
        request = pods[i].request
        online = scenario.online_share_of_ls and request.qos is QoS.ONLINE
        request = replace(request, name=f"normal-{k:06d}", priority_class=ONLINE if online else TRAINING,
                          checkpoint_every_s=0.0 if online else scenario.training_checkpoint_every_s)
        normal.append((at, request, float(durations[i])))
    small = [p.request for p in pods if 0 < p.request.gpu_milli_total <= MILLI_PER_CARD]
    if not small:
        raise ScenarioError("the trace has no pod of one card or less to use as a batch shape")
    return _Workload(normal, small)


def run_backfill(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[TracePod], profile: Profile,
                 scenario: BackfillScenario, *, backfill: bool, progress: Progress | None = None) -> BackfillRun:
    """One run of the scenario; `nodes` and `pods` are used as given (sample them first)."""
    rng = np.random.default_rng(scenario.seed)
    loop = EventLoop()
    cluster = SimCluster(catalog, nodes, loop=loop)
    classes = scenario.classes()
    admission = Admission(classes, cluster_gpu_milli=cluster.state.total_gpu_milli)
    cluster.admission.append(admission)
    admission.attach(cluster)
    scheduler = Scheduler(cluster, catalog, profile, seed=scenario.seed, now=loop.now,
                          rules=SchedulingRules(classes=classes, victim_order=scenario.victim_order))
    capacity = cluster.state.total_gpu_milli()
    run = BackfillRun(backfill, cluster.state.size, capacity // MILLI_PER_CARD)
    workload = _workload(scenario, pods, capacity, rng)
    batch_rng = np.random.default_rng(scenario.seed + 1)
    jobs: dict[str, _Job] = {}
    horizon = scenario.days * DAY_S
    warmup = scenario.warmup_hours * 3600.0
    run.window_s = (warmup, horizon)
    normal_milli = 0
    batch_count = 0
    pending_batch = 0
    refill_due = False
    total = len(workload.normal)

    def submit(job: _Job) -> None:
        nonlocal pending_batch
        jobs[job.pod] = job
        status = cluster.create_pod(replace(job.request, name=job.pod))
        if not status.ok:
            raise ScenarioError(status.message)
        if job.kind == "batch":
            pending_batch += 1

    def new_batch() -> None:
        nonlocal batch_count
        shape = workload.batch_shapes[int(batch_rng.integers(len(workload.batch_shapes)))]
        name = f"batch-{batch_count:06d}"
        batch_count += 1
        request = replace(shape, name=name, priority_class=BATCH_LOW, qos=QoS.BEST_EFFORT,
                          checkpoint_every_s=scenario.batch_checkpoint_every_s, models=shape.models)
        duration = float(np.clip(batch_rng.exponential(scenario.batch_mean_duration_s), 60.0,
                                 4 * scenario.batch_mean_duration_s))
        run.batch_submitted += 1
        submit(_Job(request, "batch", loop.now(), duration, name))

    def top_up() -> None:
        if backfill and loop.now() < horizon:
            while pending_batch < scenario.batch_backlog:
                new_batch()

    def on_bound(outcome: Outcome) -> bool:
        nonlocal normal_milli, pending_batch, refill_due
        run.decisions += 1
        if not outcome.decision.status.ok or outcome.decision.assignment is None:
            return True
        job = jobs.get(outcome.request.name)
        if job is None or job.started >= 0:
            return True
        now = loop.now()
        job.started = now
        if job.kind == "normal":
            normal_milli += outcome.decision.assignment.gpu_milli
            if job.attempt == 0:
                run.normal_placed += 1
                if job.arrival >= warmup:
                    run.normal_waits_s.append(now - job.arrival)
        else:
            pending_batch -= 1
            if pending_batch < scenario.batch_backlog and not refill_due:
                refill_due = True
                loop.call_later(0.0, refill)
        job.departure = loop.call_later(job.remaining_s, functools.partial(finish, job.pod))
        return True

    def refill() -> None:
        nonlocal refill_due
        refill_due = False
        top_up()
        scheduler.run_pending(on_bound)

    def finish(pod: str) -> None:
        job = jobs[pod]
        job.finishing = True
        if job.kind == "batch":
            run.batch_completed += 1
        cluster.delete_pod(pod)
        top_up()
        scheduler.run_pending(on_bound)

    def on_event(event: ClusterEvent) -> None:
        nonlocal normal_milli, pending_batch
        if event.kind is not EventKind.POD_DELETED or event.pod is None:
            return
        job = jobs.pop(event.pod.name, None)
        if job is None or job.started < 0:
            return
        now = loop.now()
        ran = now - job.started
        gpus = event.pod.request.gpu_milli_total / MILLI_PER_CARD
        if job.kind == "normal":
            normal_milli -= event.pod.assignment.gpu_milli if event.pod.assignment is not None else 0
        else:
            run.batch_gpu_hours_done += min(ran, job.remaining_s) * gpus / 3600.0 if job.finishing else 0.0
        if job.finishing:
            return
        # Preempted: keep what was checkpointed, lose the rest, and submit what remains.
        every = job.request.checkpoint_every_s
        saved = math.floor(ran / every) * every if every > 0 else 0.0
        lost = ran - saved
        run.preemptions += 1
        run.work_lost_gpu_hours += lost * gpus / 3600.0
        if job.departure is not None:
            job.departure.cancel()
        if job.kind == "normal":
            run.normal_preempted += 1
        else:
            run.batch_preempted += 1
            run.batch_gpu_hours_done += saved * gpus / 3600.0
        again = _Job(job.request, job.kind, job.arrival, max(1.0, job.remaining_s - saved),
                     f"{job.pod.split('~')[0]}~{job.attempt + 1}", job.attempt + 1)
        loop.call_later(0.0, functools.partial(resubmit, again))

    def resubmit(job: _Job) -> None:
        submit(job)
        scheduler.run_pending(on_bound)

    def arrive(k: int) -> None:
        at, request, duration = workload.normal[k]
        run.normal_submitted += 1
        submit(_Job(request, "normal", at, duration, request.name))
        scheduler.run_pending(on_bound)
        if progress is not None and (k % 512 == 0 or k == total - 1):
            progress(k + 1, total)

    def sample() -> None:
        run.time_s.append(loop.now())
        run.allocation_pct.append(cluster.state.used_gpu_milli() * 100.0 / capacity)
        run.normal_allocation_pct.append(normal_milli * 100.0 / capacity)
        if loop.now() + scenario.sample_every_s <= horizon:
            loop.call_later(scenario.sample_every_s, sample)

    cluster.watch(on_event)
    scheduler.on_deferred = on_bound
    for k, (at, _, _) in enumerate(workload.normal):
        loop.call_at(at, functools.partial(arrive, k))
    loop.call_at(0.0, sample)
    def start_backfill() -> None:
        top_up()
        scheduler.run_pending(on_bound)

    if backfill:
        loop.call_at(0.0, start_backfill)
    started = time.perf_counter()
    loop.run(until=horizon)
    run.wall_s = time.perf_counter() - started
    run.normal_pending_at_end = sum(1 for j in jobs.values() if j.kind == "normal" and j.started < 0)
    run.preemption_plans = scheduler.stats.plans
    return run


def run_comparison(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[TracePod], profile: Profile,
                   scenario: BackfillScenario, *, progress: Callable[[str, int, int], None] | None = None
                   ) -> BackfillComparison:
    """Sample the cluster, then run the scenario without and with backfill on the same workload."""
    rng = np.random.default_rng(scenario.seed)
    sampled = _sample_nodes(nodes, scenario.node_count, rng)
    usable, excluded = _placeable(catalog, sampled, profile, pods)
    if not usable:
        raise ScenarioError("no trace pod fits any node of the sampled cluster")
    runs = []
    for backfill in (False, True):
        label = "backfill" if backfill else "no backfill"
        tick = None if progress is None else functools.partial(progress, label)
        runs.append(run_backfill(catalog, sampled, usable, profile, scenario, backfill=backfill, progress=tick))
    return BackfillComparison(scenario, runs[0], runs[1], excluded)


__all__ = ["BackfillComparison", "BackfillRun", "BackfillScenario", "PriorityClass", "ScenarioError",
           "load_scenario", "run_backfill", "run_comparison"]
