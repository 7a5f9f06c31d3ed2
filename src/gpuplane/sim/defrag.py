"""The online-defragmentation scenario: pods come and go, and whole-card pods wait behind scattered fractions.

Built on the scenario kit's world (`build_world`: `EventLoop` + `SimCluster` + the production `Scheduler`),
its checkpointing job and its lost-work ledger. Pods take the trace's shapes (openb: whole cards,
fractions, CPU-only), arrive as a Poisson process whose rate follows the kit's load model, and run for the
trace's lifetimes (clipped); every pod is a `CheckpointingJob` owned by a workload of its own, so its owner
would create it again if it were evicted. Departures leave fractional pods scattered over cards, and a
whole-card pod may find no card free while the free GPU in total would hold it.

Two arms on the same cluster, arrivals, shapes and durations:

- no defragmentation: the production scheduler alone (it retries parked pods as capacity frees);
- defragmentation: the same, plus the `DefragController` every `defrag_every_s`. It moves the fewest
  fractional pods that free cards for a pending large pod, within `max_moves_per_hour`, and reserves the
  freed cards for that pod through the scheduler's nomination. A moved pod gets its grace
  (`grace_s`), saves if it traps SIGTERM, exits, its container takes `kubelet_stop_s` to stop, and it is
  created again and resumes from its last kept save; the work since is lost to the move (the ledger's
  cause `moved`). `no_move_share` of the pods are annotated `gpuplane.io/no-move`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np
from pydantic import Field, model_validator

from gpuplane.controllers.defrag import NO_MOVE_ANNOTATION, DefragController, DefragPolicy, moves_per_hour
from gpuplane.model import MILLI_PER_CARD, Catalog, ClusterState, NodeSpec, PodRequest, WholeCards, default_catalog
from gpuplane.port import ClusterEvent, EventKind
from gpuplane.scheduler import Profile, default_registry
from gpuplane.sim.backfill import _arrivals, _nodes_path, _placeable, _profile, _sample_nodes, _trace_nodes, _trace_pods
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
    series,
)
from gpuplane.sim.scenario_file import ScenarioError
from gpuplane.sim.trace import TracePod, resolve_trace

NO_DEFRAG = "no-defrag"
DEFRAG = "defrag"
MOVED = "moved"
"""The ledger's cause for work lost to a move."""


class DefragSettings(WorldSettings):
    """Every parameter of the scenario. Loadable from YAML (`--scenario-file`) or `--set field=value`."""

    trace: str = Field(default="default", description="pod trace: a bundled name (default, gpushare40, "
                       "gpushare100) or a path to an openb pod list")
    nodes: str = Field(default="nodes", description="node list: 'nodes' (the bundled openb cluster) or a path")
    node_count: int = Field(default=16, ge=0, description="nodes drawn from the node list (0: all of it)")
    days: float = Field(default=0.75, gt=0, le=60)
    warmup_hours: float = Field(default=2.0, ge=0, description="left out of the figures while the cluster fills")
    load: float = Field(default=1.0, gt=0, le=3, description="mean offered GPU load (of the cluster's GPUs)")
    peak_trough_ratio: float = Field(default=1.5, ge=1.0, description="the arrival rate's daily peak over its "
                                     "trough")
    peak_hour: float = Field(default=15.0, ge=0, lt=24)
    min_duration_s: float = Field(default=60.0, gt=0)
    max_duration_s: float = Field(default=14400.0, gt=0)
    save_every_s: float = Field(default=1800.0, ge=0, description="work between a job's saves (0: never saves)")
    save_s: float = Field(default=60.0, ge=0, description="how long one save takes")
    saves_on_signal: bool = Field(default=True, description="a job traps SIGTERM, saves, then exits")
    grace_s: float = Field(default=30.0, ge=0, description="grace of a moved pod "
                           "(Kubernetes' default terminationGracePeriodSeconds)")
    max_moves_per_hour: int = Field(default=12, ge=0, description="the controller's move budget")
    defrag_every_s: float = Field(default=60.0, gt=0, description="how often the controller plans")
    no_move_share: float = Field(default=0.0, ge=0, le=1, description="share of pods annotated "
                                 f"{NO_MOVE_ANNOTATION}: true")
    sample_every_s: float = Field(default=300.0, gt=0)
    node_policy: str = "binpack"

    @model_validator(mode="after")
    def _consistent(self) -> DefragSettings:
        if self.min_duration_s > self.max_duration_s:
            raise ValueError(f"min_duration_s {self.min_duration_s} is above max_duration_s {self.max_duration_s}")
        if self.warmup_hours * 3600.0 >= self.days * DAY_S:
            raise ValueError(f"warmup_hours {self.warmup_hours} leaves nothing of {self.days} day(s) to measure")
        if self.node_policy not in default_registry().node_policies:
            raise ValueError(f"unknown node_policy {self.node_policy!r} "
                             f"(choose from {', '.join(sorted(default_registry().node_policies))})")
        return self

    def load_model(self) -> LoadModel:
        return LoadModel(peak_trough_ratio=self.peak_trough_ratio, peak_hour=self.peak_hour)

    def save(self) -> SaveModel:
        return SaveModel(every_s=self.save_every_s, save_s=self.save_s, on_signal=self.saves_on_signal)

    def policy(self) -> DefragPolicy:
        return DefragPolicy(max_moves_per_hour=self.max_moves_per_hour)


class DefragFigures(Figures):
    """One seed's figures; waits, moves and allocation leave out the warm-up, work counts the whole run."""

    nodes: int = figure("all", "nodes in the sampled cluster")
    gpus: int = figure("all", "GPUs in the sampled cluster")
    whole_pods: int = figure("all", "whole-card pods that arrived after the warm-up")
    no_defrag_whole_wait_p50_s: float = figure(NO_DEFRAG, "whole-card pods' median pending time", "s")
    no_defrag_whole_wait_p95_s: float = figure(NO_DEFRAG, "whole-card pods' 95th-percentile pending time", "s")
    no_defrag_whole_wait_mean_s: float = figure(NO_DEFRAG, "whole-card pods' mean pending time", "s")
    defrag_whole_wait_p50_s: float = figure(DEFRAG, "whole-card pods' median pending time", "s")
    defrag_whole_wait_p95_s: float = figure(DEFRAG, "whole-card pods' 95th-percentile pending time", "s")
    defrag_whole_wait_mean_s: float = figure(DEFRAG, "whole-card pods' mean pending time", "s")
    whole_wait_p95_cut_pct: float = figure(DEFRAG, "cut of the whole-card p95 pending time against no "
                                           "defragmentation", "%")
    whole_wait_mean_cut_pct: float = figure(DEFRAG, "cut of the whole-card mean pending time", "%")
    moves_per_hour: float = figure(DEFRAG, "pods moved per hour", "1/h")
    moves: int = figure(DEFRAG, "pods moved after the warm-up")
    pods_freed_for: int = figure(DEFRAG, "pending pods given cards by moves (after the warm-up)")
    moved_lost_gpu_h: float = figure(DEFRAG, "work lost to moves (since the last kept save)", "GPU-h")
    moved_lost_pct: float = figure(DEFRAG, "work lost to moves as a share of all work done", "%")
    no_defrag_unallocated_pct: float = figure(NO_DEFRAG, "mean unallocated GPU", "%")
    defrag_unallocated_pct: float = figure(DEFRAG, "mean unallocated GPU (cards of Terminating pods count as "
                                           "allocated)", "%")
    no_defrag_whole_pending_at_end: int = figure(NO_DEFRAG, "whole-card pods still pending at the end")
    defrag_whole_pending_at_end: int = figure(DEFRAG, "whole-card pods still pending at the end")
    excluded_trace_shapes: int = figure("all", "trace pods left out: no node of the sampled cluster holds them")
    window_s: tuple[float, float] = series("the measurement window (after the warm-up)")
    time_s: tuple[float, ...] = series("sample times")
    no_defrag_unallocated_series: tuple[float, ...] = series("unallocated GPU over time, no defragmentation (%)")
    defrag_unallocated_series: tuple[float, ...] = series("unallocated GPU over time, defragmentation (%)")
    no_defrag_whole_waits_s: tuple[float, ...] = series("each measured whole-card pod's pending time, no "
                                                        "defragmentation")
    defrag_whole_waits_s: tuple[float, ...] = series("each measured whole-card pod's pending time, "
                                                     "defragmentation (same order)")


@dataclass(frozen=True, slots=True)
class _Workload:
    pods: list[tuple[float, PodRequest, float, bool]]
    """(arrival, request, duration, annotated no-move) of every pod."""


def _workload(settings: DefragSettings, pods: Sequence[TracePod], capacity_milli: int,
              rng: np.random.Generator) -> _Workload:
    lifetimes = np.array([p.lifetime if p.lifetime is not None else np.nan for p in pods], np.float64)
    median = float(np.nanmedian(lifetimes)) if np.isfinite(lifetimes).any() else 600.0
    durations = np.clip(np.where(np.isfinite(lifetimes), lifetimes, median), settings.min_duration_s,
                        settings.max_duration_s)
    gpu = np.array([p.request.gpu_milli_total for p in pods], np.float64)
    mean_work = float((gpu * durations).mean())
    if mean_work <= 0:
        raise ScenarioError("the trace's pods ask for no GPU: nothing to schedule")
    times = _arrivals(settings, settings.load * capacity_milli / mean_work, rng)  # type: ignore[arg-type]
    picks = rng.integers(len(pods), size=len(times))
    pinned = rng.random(len(times)) < settings.no_move_share
    out: list[tuple[float, PodRequest, float, bool]] = []
    for k, (at, i) in enumerate(zip(times.tolist(), picks.tolist(), strict=True)):
        name = f"pod-{k:06d}"
        request = replace(pods[i].request, name=name, workload=name, checkpoint_every_s=settings.save_every_s)
        out.append((at, request, float(durations[i]), bool(pinned[k])))
    return _Workload(out)


@dataclass(slots=True)
class _Job:
    job: CheckpointingJob
    request: PodRequest
    arrival: float
    bound_once: bool = False
    departure: _Entry | None = None


@dataclass(slots=True)
class ArmRun:
    time_s: list[float] = field(default_factory=list)
    unallocated_pct: list[float] = field(default_factory=list)
    waits: dict[str, float] = field(default_factory=dict)
    """whole-card pod name → pending time, arrival to first bind (arrived after the warm-up; still pending at
    the end: the time until the end, a lower bound)"""
    pending_at_end: int = 0
    ledger: WorkLedger = field(default_factory=WorkLedger)
    move_times: list[float] = field(default_factory=list)
    freed_times: list[float] = field(default_factory=list)
    window_s: tuple[float, float] = (0.0, 0.0)


def run_arm(catalog: Catalog, nodes: Sequence[NodeSpec], workload: _Workload, profile: Profile,
            settings: DefragSettings, *, defrag: bool) -> ArmRun:
    """One arm on the kit's world; `nodes` and the workload are used as given."""
    world = build_world(catalog, nodes, profile, seed=settings.seed, stop_s=settings.kubelet_stop_s)
    loop, cluster, scheduler = world.loop, world.cluster, world.scheduler
    capacity = cluster.state.total_gpu_milli()
    horizon, warmup = settings.days * DAY_S, settings.warmup_hours * 3600.0
    run = ArmRun(window_s=(warmup, horizon))
    save = settings.save()
    jobs: dict[str, _Job] = {}
    controller = DefragController(cluster, scheduler, now=loop.now, policy=settings.policy(), recreate=True,
                                  seed=settings.seed) if defrag else None

    def schedule() -> None:
        scheduler.run_pending()

    def finish(name: str) -> None:
        job = jobs.pop(name)
        job.departure = None
        job.job.complete(loop.now())
        run.ledger.completed(job.job)
        cluster.delete_pod(name)
        schedule()

    def exited(name: str) -> None:
        cluster.container_exited(name)  # refused (harmlessly) if the pod is gone already

    def on_event(event: ClusterEvent) -> None:
        if event.pod is None or event.pod.name not in jobs:
            return
        job, now = jobs[event.pod.name], loop.now()
        if event.kind is EventKind.POD_BOUND:
            job.job.start(now)
            job.departure = loop.call_at(job.job.finish_time(now), functools.partial(finish, job.request.name))
            if not job.bound_once and isinstance(job.request.gpu, WholeCards) and job.arrival >= warmup:
                run.waits[job.request.name] = now - job.arrival
            job.bound_once = True
        elif event.kind is EventKind.POD_TERMINATING:
            if job.departure is not None:
                job.departure.cancel()
                job.departure = None
            outcome = job.job.stop(now, settings.grace_s)
            run.ledger.stopped(job.job, outcome, MOVED)
            if outcome.exit_s < now + settings.grace_s:
                loop.call_at(outcome.exit_s, functools.partial(exited, job.request.name))
        elif event.kind is EventKind.POD_DELETED:
            loop.call_later(0.0, schedule)  # the controller creates a moved pod again: try it at once

    def arrive(k: int) -> None:
        at, request, duration, pinned = workload.pods[k]
        jobs[request.name] = _Job(CheckpointingJob(request.name, duration, request.gpu_milli_total / MILLI_PER_CARD,
                                                   save), request, at)
        status = cluster.create_pod(request)
        if not status.ok:
            raise ScenarioError(status.message)
        if pinned:
            cluster.patch_pod(request.name, annotations={NO_MOVE_ANNOTATION: "true"})
        schedule()

    def tick() -> None:
        if controller is not None:
            before = controller.stats.plans
            controller.tick()
            run.freed_times.extend([loop.now()] * (controller.stats.plans - before))
        schedule()
        if loop.now() + settings.defrag_every_s < horizon:
            loop.call_later(settings.defrag_every_s, tick)

    def sample() -> None:
        run.time_s.append(loop.now())
        run.unallocated_pct.append(100.0 - cluster.state.used_gpu_milli() * 100.0 / capacity)
        if loop.now() + settings.sample_every_s <= horizon:
            loop.call_later(settings.sample_every_s, sample)

    cluster.watch(on_event)
    for k, (at, _, _, _) in enumerate(workload.pods):
        loop.call_at(at, functools.partial(arrive, k))
    loop.call_at(0.0, sample)
    loop.call_at(settings.defrag_every_s, tick)
    loop.run(until=horizon)
    for name, job in jobs.items():
        if not job.bound_once and isinstance(job.request.gpu, WholeCards) and job.arrival >= warmup:
            run.waits[name] = horizon - job.arrival
            run.pending_at_end += 1
    if controller is not None:
        run.move_times = list(controller.stats.move_times)
        controller.close()
    return run


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _cut(before: float, after: float) -> float:
    return (before - after) * 100.0 / before if before > 0 else 0.0


def _figures(base: ArmRun, ours: ArmRun, nodes: int, gpus: int, excluded: int) -> DefragFigures:
    names = sorted(base.waits)
    a = [base.waits[n] for n in names]
    b = [ours.waits.get(n, math.nan) for n in names]
    b = [w for w in b if math.isfinite(w)]
    lost = ours.ledger.lost_gpu_h(MOVED)
    done = ours.ledger.useful_gpu_h + lost
    start, end = ours.window_s
    mean_a, mean_b = (float(np.mean(a)) if a else 0.0), (float(np.mean(b)) if b else 0.0)
    return DefragFigures(
        nodes=nodes, gpus=gpus, whole_pods=len(names),
        no_defrag_whole_wait_p50_s=_pct(a, 50), no_defrag_whole_wait_p95_s=_pct(a, 95),
        no_defrag_whole_wait_mean_s=mean_a,
        defrag_whole_wait_p50_s=_pct(b, 50), defrag_whole_wait_p95_s=_pct(b, 95), defrag_whole_wait_mean_s=mean_b,
        whole_wait_p95_cut_pct=_cut(_pct(a, 95), _pct(b, 95)), whole_wait_mean_cut_pct=_cut(mean_a, mean_b),
        moves_per_hour=moves_per_hour(ours.move_times, ours.window_s),
        moves=sum(1 for t in ours.move_times if start <= t < end),
        pods_freed_for=sum(1 for t in ours.freed_times if start <= t < end),
        moved_lost_gpu_h=lost, moved_lost_pct=lost * 100.0 / done if done > 0 else 0.0,
        no_defrag_unallocated_pct=window_mean(base.time_s, base.unallocated_pct, base.window_s),
        defrag_unallocated_pct=window_mean(ours.time_s, ours.unallocated_pct, ours.window_s),
        no_defrag_whole_pending_at_end=base.pending_at_end, defrag_whole_pending_at_end=ours.pending_at_end,
        excluded_trace_shapes=excluded, window_s=base.window_s, time_s=tuple(base.time_s),
        no_defrag_unallocated_series=tuple(base.unallocated_pct), defrag_unallocated_series=tuple(ours.unallocated_pct),
        no_defrag_whole_waits_s=tuple(a), defrag_whole_waits_s=tuple(ours.waits.get(n, math.nan) for n in names),
    )


def run_defrag(settings: DefragSettings, progress: Progress) -> DefragFigures:
    """Sample the cluster, then run both arms on the same workload."""
    catalog = default_catalog()
    trace = _trace_pods(str(resolve_trace(settings.trace)))
    rng = np.random.default_rng(settings.seed)
    sampled = _sample_nodes(_trace_nodes(str(_nodes_path(settings.nodes))), settings.node_count, rng)
    profile = _profile(settings, trace)  # type: ignore[arg-type]
    usable, excluded = _placeable(catalog, sampled, profile, trace)
    if not usable:
        raise ScenarioError("no trace pod fits any node of the sampled cluster")
    capacity = ClusterState(catalog, sampled).total_gpu_milli()
    workload = _workload(settings, usable, capacity, rng)
    arms: list[ArmRun] = []
    for done, defrag in enumerate((False, True)):
        progress("arms", done, 2)
        arms.append(run_arm(catalog, sampled, workload, _profile(settings, trace),  # type: ignore[arg-type]
                            settings, defrag=defrag))
    progress("arms", 2, 2)
    return _figures(arms[0], arms[1], len(sampled), capacity // MILLI_PER_CARD, excluded)


class _DefragScenario:
    name = "defrag"
    title = "Online defragmentation: moving fractional pods for pending whole-card pods"
    settings = DefragSettings
    figures = DefragFigures
    ours = DEFRAG
    arms = (NO_DEFRAG, DEFRAG)
    goals = (
        Goal("moves cut the whole-card pods' p95 pending time", "whole_wait_p95_cut_pct", ">=", 30.0),
        Goal("moves lose little work", "moved_lost_pct", "<=", 1.0),
    )
    headlines = (
        Headline("moves_per_hour", "the controller moves at most max_moves_per_hour pods in any hour",
                 "max_moves_per_hour", 2, "down"),
        Headline("moved_lost_gpu_h", "a job saves every save_every_s; a move loses the work since the last save",
                 "save_every_s", 7200.0, "up"),
        Headline("moved_lost_gpu_h", "a moved pod's grace (30 s) is shorter than its save (60 s), so the save "
                 "on SIGTERM is cut off", "grace_s", 120.0, "down"),
    )
    quick: Mapping[str, object] = MappingProxyType({"node_count": 12, "days": 0.4, "warmup_hours": 1.5})

    def run(self, settings: DefragSettings, progress: Progress) -> DefragFigures:
        return run_defrag(settings, progress)

    def tables(self, figures: DefragFigures) -> Sequence[Table]:
        f = figures
        rows = (
            ("whole-card pending time p50 (s)", f"{f.no_defrag_whole_wait_p50_s:.0f}",
             f"{f.defrag_whole_wait_p50_s:.0f}"),
            ("whole-card pending time p95 (s)", f"{f.no_defrag_whole_wait_p95_s:.0f}",
             f"{f.defrag_whole_wait_p95_s:.0f}"),
            ("whole-card pending time mean (s)", f"{f.no_defrag_whole_wait_mean_s:.0f}",
             f"{f.defrag_whole_wait_mean_s:.0f}"),
            ("whole-card pods pending at the end", str(f.no_defrag_whole_pending_at_end),
             str(f.defrag_whole_pending_at_end)),
            ("unallocated GPU (%)", f"{f.no_defrag_unallocated_pct:.1f}", f"{f.defrag_unallocated_pct:.1f}"),
            ("moves per hour", "0", f"{f.moves_per_hour:.2f}"),
            ("pending pods given cards by moves", "0", str(f.pods_freed_for)),
            ("work lost to moves (GPU-h)", "0", f"{f.moved_lost_gpu_h:.2f}"),
            ("work lost to moves (% of work done)", "0", f"{f.moved_lost_pct:.3f}"),
        )
        return (Table(f"{f.nodes} nodes, {f.gpus} GPUs, {f.whole_pods} measured whole-card pods",
                      ("no defragmentation", "defragmentation"), rows),)

    def summary(self, figures: DefragFigures) -> str:
        f = figures
        return (f"defrag: whole-card pending p95 {f.no_defrag_whole_wait_p95_s:.0f} → "
                f"{f.defrag_whole_wait_p95_s:.0f} s "
                f"({f.whole_wait_p95_cut_pct:+.1f} % cut), p50 {f.no_defrag_whole_wait_p50_s:.0f} → "
                f"{f.defrag_whole_wait_p50_s:.0f} s; {f.moves_per_hour:.2f} moves/h, work lost "
                f"{f.moved_lost_gpu_h:.2f} GPU-h ({f.moved_lost_pct:.3f} %); unallocated "
                f"{f.no_defrag_unallocated_pct:.1f} → {f.defrag_unallocated_pct:.1f} %")


SCENARIO = _DefragScenario()

__all__ = ["DEFRAG", "MOVED", "NO_DEFRAG", "SCENARIO", "ArmRun", "DefragFigures", "DefragSettings", "run_arm",
           "run_defrag"]
