"""One arm of the platform week: the whole fleet and all its work on one world.

One `EventLoop`, one `SimCluster` and the production `Scheduler` (`build_world`, with the production
admission, priority classes and team quotas). Every controller acts through the cluster port:

- the GPU scaler (`controllers.autoscale.ScaledObjectScaler`) polls every service's DCGM-style signal
  (`sim.scenario.signal.DcgmSignal`, read through the autoscale scenario's `SimPrometheus`) every step and
  scales each A10/T4 workload to the HPA algorithm's count;
- the tidal controller (`controllers.tidal.TidalController` with the learnt `SeasonalForecaster`, fed the
  last minute's load each pass) shares the L40S services with the scaler (`replicas=`: it splits the
  scaler's count between the stable and tidal subsets, holds the policy's floor) and lends emptied tidal
  nodes to training at night, reclaiming against the count and its forecast (with `tidal` off it lends
  nothing, as the tidal scenario's baseline; with `autoscale` off it scales from its forecast alone);
- the node guard of every card near-line pods share (`controllers.colocation.CardPolicy.window`, the
  aggregate of its 20 ms passes over each sample window) lets them run its offline share and evicts them
  under its memory line; the scheduler's `GuardLineFit` keeps that line unpromised for them;
- the production scheduler places everything, preempts low-priority batch and near-line pods for the
  pods above them, and holds team quotas;
- faults on training nodes crash the gang there (a category from the training-faults scenario's mix; a
  persistent one leaves the node broken until repaired). With recovery on, the production
  `RecoveryController` has adopted every gang: the node agents' evidence (drawn by `sim.fault_streams` from
  the signature library) reaches it after the detection and diagnosis delays, the classifier's verdict
  isolates the nodes it blames (the health book's repair cycle, probation included), and the gang is
  restarted (or, on a do-not-retry verdict, left to a person). A broken node it failed to isolate breaks the
  next gang placed on it. By hand (off), the hung gang holds its cards for `manual_recovery_s` and the node
  is out for `repair_s`.

A capability that is off is what vanilla Kubernetes does instead (see `PlatformSettings.vanilla`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpuplane.controllers import (
    EARLY_RECLAIM_REASON,
    LEND_REASON,
    LOAN_TAINT,
    RECLAIM_REASON,
    SeasonalForecaster,
    ServiceBinding,
    TidalController,
)
from gpuplane.controllers.autoscale import RiseReserve, ScaledObjectScaler, ScaledObjectSpec, rise_reserve_for
from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.colocation import CardPolicy, GuardSettings, MemoryGuard
from gpuplane.controllers.health import NodeHealthBook
from gpuplane.controllers.recovery import AdoptedGang, CheckpointPlanner, RecoveryController
from gpuplane.model import MILLI_PER_CARD, Fraction, GpuForm, MigSlice, PodRequest, QoS, Toleration, default_catalog
from gpuplane.model.priority import BATCH_LOW, DEV, ONLINE, TRAINING, default_priority_classes
from gpuplane.model.quota import QueueQuota, Quotas
from gpuplane.model.tidal import TidalPolicy, TidalService, TidalWindow
from gpuplane.port import ClusterEvent, EventKind, PodPhase
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.scheduler import SchedulingRules
from gpuplane.sim.autoscale import SimPrometheus
from gpuplane.sim.engine import _Entry
from gpuplane.sim.fault_streams import HANGS, PERSISTENT, StreamMaker
from gpuplane.sim.platform.fleet import (
    DEV_POOL,
    INFERENCE_POOL,
    POOLS,
    STABLE_POOL,
    TIDAL_POOL,
    TRAINING_POOL,
    PlatformSettings,
    build_fleet,
    pool_configs,
)
from gpuplane.sim.platform.work import SCALED, TIDAL, Service, build_services, gpu_form, service_pools
from gpuplane.sim.scenario import DAY_S, CheckpointingJob, WorkLedger, build_world
from gpuplane.sim.scenario.signal import DcgmSignal, ScrapedRate, SignalSettings
from gpuplane.sim.scenario.slo import shortfall_s
from gpuplane.sim.scenario.world import World
from gpuplane.sim.training_faults import TrainingFaultsSettings, bundled_library

EVICTION_REASON = "gpuplane.io/eviction-reason"
GUARD_REASON = "colocation-memory-guard"
MIB = 1 << 20
JOB_LABEL = "gpuplane.io/job"
FAULT = "fault"
PREEMPTED = "preempted"
NEARLINE = "nearline"
"""The task kind of near-line work co-located on inference cards (its pods are named after it)."""
CLASSES = (ONLINE, TRAINING, DEV, BATCH_LOW)
NIGHT = TidalWindow(name="night", shrink_at="22:30", lend_from="23:30", reclaim_at="07:30")


class PlatformError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class _Scaled:
    """One scaled object of the GPU scaler and the series it reads: its cards' DCGM field and its gateway's rate."""

    scaler: ScaledObjectScaler
    dcgm: DcgmSignal
    gateway: ScrapedRate
    source: SimPrometheus

    def tick(self, now: float, load: float, ready: int, capacity: float, arrivals: int) -> None:
        """The step from `now`: the ready replicas serve what they can of `load`; the scaler polls."""
        self.dcgm.tick(now, min(load / capacity, float(ready)), ready, max(ready, 1))
        self.gateway.tick(now, arrivals)
        self.scaler.poll(now, self.source)


@dataclass(slots=True, eq=False)
class _Task:
    """A job of one or more pods (a gang, a batch or near-line pod, a dev box)."""

    kind: str
    job: CheckpointingJob | None
    size: int
    request: PodRequest
    team: str = ""
    attempt: int = 0
    members: list[str] = field(default_factory=list)
    bound: set[str] = field(default_factory=set)
    stopping: bool = False
    hung: bool = False
    finish: _Entry | None = None
    done: bool = False
    hold_s: float = 0.0
    """a person restarts it this long after its pods are gone (a do-not-retry verdict)"""


@dataclass(slots=True)
class ArmRun:
    """What one arm measured (samples after the warm-up; work over the whole run)."""

    time_h: list[float] = field(default_factory=list)
    util: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """pool (and "fleet") → GPU utilisation (SM busy over the pool's cards, %) at each sample"""
    alloc: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    nodes: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    inference_gpu_h: float = 0.0
    inference_cost: float = 0.0
    training_held_gpu_h: float = 0.0
    team_cost: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ledger: WorkLedger = field(default_factory=WorkLedger)
    batch: WorkLedger = field(default_factory=WorkLedger)
    waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    slo_minutes: float = 0.0
    shortage_minutes: float = 0.0
    lent_share: list[float] = field(default_factory=list)
    coloc_alloc: list[float] = field(default_factory=list)
    density: list[float] = field(default_factory=list)
    mig_pods: list[int] = field(default_factory=list)
    """per sample, the dev boxes running on a MIG instance"""
    preemptions: int = 0
    evictions: int = 0
    guard_evictions: int = 0
    """near-line pods the node guard's memory line evicted"""
    guard_offline_share: list[float] = field(default_factory=list)
    """per sample, the mean share of the window the guards let near-line work run"""
    failures: list[float] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    recovery_delays_s: list[float] = field(default_factory=list)
    """each restart: seconds from the fault to the restart decision"""
    isolated: list[str] = field(default_factory=list)
    """nodes the recovery controller isolated, in order"""
    jobs_done: int = 0
    loans: int = 0
    early_reclaims: int = 0
    lend_displaced: int = 0
    """near-line pods the tidal controller evicted from nodes it lent"""


def _memory_mib(request: PodRequest) -> int:
    return request.gpu.memory_mib if isinstance(request.gpu, Fraction) else 0


def _tidal_policy(s: PlatformSettings, services: list[Service]) -> TidalPolicy:
    specs = []
    for svc in services:
        top = max(1, math.ceil(float(svc.curve.value.max()) * 1.2 / s.per_replica_capacity))
        specs.append(TidalService(name=svc.name, min_replicas=min(top, math.ceil(0.15 * svc.peak_replicas)),
                                  max_replicas=top, day_floor=min(top, math.ceil(0.5 * svc.peak_replicas))))
    return TidalPolicy(services=tuple(specs), windows=(NIGHT,), reclaim_grace_s=s.reclaim_grace_s)


def run_arm(s: PlatformSettings, on_world: Callable[[World], None] | None = None) -> ArmRun:
    """One arm's week. `on_world` sees the world once it is built (tests sample it)."""
    catalog = default_catalog()
    rng = np.random.default_rng(s.seed)
    services = build_services(s, rng)
    nodes = build_fleet(s)
    classes = default_priority_classes()
    training_gpus = (s.a100_nodes + s.h100_nodes) * s.gpus_per_node
    teams = [f"team-{i}" for i in range(s.teams)]
    quotas = Quotas([QueueQuota(t, min_gpus=training_gpus / s.teams) for t in teams])
    guard_settings = GuardSettings()
    # the guard's admission line for a fresh guard (no online growth seen): what it keeps unpromised
    reserve_mib = ((1 << 40) - MemoryGuard(guard_settings).admissible_bytes(1 << 40)) // MIB if s.colocation else 0
    profile = default_registry().build(PolicyConfig(node_policy="binpack" if s.binpack else "spread", seed=s.seed,
                                                    guard_reserve_mib=reserve_mib))
    pools = pool_configs(s)
    world = build_world(catalog, nodes, profile, seed=s.seed, stop_s=s.kubelet_stop_s, classes=classes,
                        pools=pools, quotas=quotas,
                        rules=SchedulingRules(classes=classes, retry_preemptors_every_s=s.retry_preemptors_s))
    loop, cluster, scheduler = world.loop, world.cluster, world.scheduler
    horizon, warmup, dt = s.days * DAY_S, s.warmup_hours * 3600.0, s.step_s
    run = ArmRun()
    price = {n.name: s.price_per_gpu_h.get(n.gpu_model or "", 0.0) for n in nodes}
    gpus_of = {n.name: n.gpus for n in nodes}

    # ---------------------------------------------------------------- inference
    scaled = [svc for svc in services if svc.kind == SCALED]
    tidal_services = [svc for svc in services if svc.kind == TIDAL]
    by_workload: dict[str, Service] = {}
    for svc in services:
        for workload, allowed in service_pools(svc, lending=s.tidal, overflow=s.tidal_overflow).items():
            template = PodRequest(workload, cpu_milli=4000, memory_mib=16_384,
                                  gpu=gpu_form(s, svc.model, svc.need_milli), priority_class=ONLINE, qos=QoS.ONLINE,
                                  pools=allowed, models=frozenset({svc.model}))
            cluster.create_workload(workload, template, 0)
            by_workload[workload] = svc
    serving: dict[str, tuple[Service, float]] = {}
    """replica pod → its service and when it serves"""
    signal_rng = np.random.default_rng([s.seed, 3])
    scalers: dict[str, _Scaled] = {}
    arrivals_rng = np.random.default_rng([s.seed, 11])
    if s.autoscale:
        lead_s = s.startup_s + dt if s.rise_reserve else 0.0
        reserve: RiseReserve | None = None
        for svc in (*scaled, *tidal_services):  # a tidal service's count is split by the tidal controller
            query = f'sum(DCGM_FI_DEV_GPU_UTIL{{namespace="serving",pod=~"{svc.name}-.*"}})'
            arrivals = f'sum(rate(gateway_requests_total{{service="{svc.name}"}}[1m]))'
            spec = ScaledObjectSpec(name=svc.name, namespace="serving", query=query,
                                    demand_query=arrivals if s.gateway_demand else None,
                                    target=s.target_util_pct, max_replicas=4 * svc.peak_replicas + 4,
                                    rise_lead_s=lead_s, replica_capacity=100.0)
            if lead_s > 0 and reserve is None:  # one reserve, shared by every service
                reserve = rise_reserve_for(spec)
            dcgm = DcgmSignal(SignalSettings(), dt, signal_rng)
            gateway = ScrapedRate(dt, dt, 0.0)
            scalers[svc.name] = _Scaled(ScaledObjectScaler(spec, reserve=reserve), dcgm, gateway,
                                        SimPrometheus({query: dcgm.query, arrivals: gateway.query}))
            if svc.kind == SCALED:
                cluster.scale(svc.name, max(1, math.ceil(svc.load(0.0) / s.per_replica_capacity)))
    else:
        for svc in scaled:
            cluster.scale(svc.name, svc.static_replicas(s.per_replica_capacity, s.static_headroom))
    tidal: TidalController | None = None
    if s.autoscale or s.tidal:
        forecaster = SeasonalForecaster()
        for svc in tidal_services:  # a day of observed history before the run (the week repeats its first day)
            for k in range(int(DAY_S // 60)):
                forecaster.observe(svc.name, k * 60.0 - DAY_S + 60.0, svc.load(k * 60.0))
        bindings = [ServiceBinding(svc.name, s.per_replica_capacity, MILLI_PER_CARD) for svc in tidal_services]
        tidal = TidalController(cluster, _tidal_policy(s, tidal_services), bindings, forecaster, loop.now,
                                load=lambda name: by_workload[f"{name}-tidal"].load(max(0.0, loop.now() - 60.0)),
                                lend=s.tidal, training_pool=TRAINING_POOL, tidal_pool=TIDAL_POOL, seed=s.seed,
                                replicas=(lambda name: scalers[name].scaler.desired) if s.autoscale else None)
    else:
        for svc in tidal_services:
            static = svc.static_replicas(s.per_replica_capacity, s.static_headroom)
            stable = min(static, s.stable_nodes * s.gpus_per_node * svc.peak_replicas
                         // max(1, sum(x.peak_replicas for x in tidal_services)))
            cluster.scale(f"{svc.name}-stable", stable)
            cluster.scale(f"{svc.name}-tidal", static - stable)

    # ---------------------------------------------------------------- recovery
    recovery: RecoveryController | None = None
    streams: StreamMaker | None = None
    if s.recovery:
        library = bundled_library()
        streams = StreamMaker(library, TrainingFaultsSettings().streams())
        recovery = RecoveryController(cluster, FailureClassifier(library),
                                      NodeHealthBook(nodes=(n.name for n in nodes if n.pool == TRAINING_POOL)),
                                      loop.now)
    node_of: dict[str, str] = {}
    """pod → the node it was bound to"""

    # ---------------------------------------------------------------- jobs
    tasks: dict[str, _Task] = {}
    task_of: dict[str, _Task] = {}
    job_rng = np.random.default_rng([s.seed, 5])
    dev_rng = np.random.default_rng([s.seed, 11])  # its own stream: the MIG share moves no other draw
    counter = [0]
    save = s.save_model()
    nearline_pools = frozenset({INFERENCE_POOL} | {"none": set(), "stable": {STABLE_POOL},
                                                   "all": {STABLE_POOL, TIDAL_POOL}}[s.nearline_l40s])

    def submit(task: _Task) -> None:
        base = f"{task.request.name}.{task.attempt}"
        task.members = [f"{base}.{i}" for i in range(task.size)] if task.size > 1 else [base]
        task.bound, task.stopping, task.hung = set(), False, False
        for member in task.members:
            request = PodRequest(member, cpu_milli=task.request.cpu_milli, memory_mib=task.request.memory_mib,
                                 gpu=task.request.gpu, priority_class=task.request.priority_class,
                                 qos=task.request.qos, gang=base if task.size > 1 else None,
                                 gang_size=task.size if task.size > 1 else 0, queue=task.request.queue,
                                 pools=task.request.pools, tolerations=task.request.tolerations,
                                 checkpoint_every_s=task.request.checkpoint_every_s, labels=task.request.labels)
            task_of[member] = task
            status = cluster.create_pod(request)
            if not status.ok:
                raise PlatformError(status.message)

    def nearline_job(name: str) -> CheckpointingJob:
        work = float(np.clip(job_rng.exponential(s.nearline_hours * 3600.0), 120.0, 4 * s.nearline_hours * 3600.0))
        return CheckpointingJob(name, work, s.nearline_milli / MILLI_PER_CARD, save)

    def new_task(kind: str) -> _Task:
        counter[0] += 1
        name = f"{kind}-{counter[0]:06d}"
        if kind == TRAINING:
            size = int(s.job_nodes[int(job_rng.integers(len(s.job_nodes)))])
            team = teams[int(job_rng.integers(len(teams)))]
            low, high = s.job_work_hours
            gpus = size * s.gpus_per_node
            job: CheckpointingJob | None = CheckpointingJob(name, float(job_rng.uniform(low, high)) * 3600.0,
                                                            gpus, save)
            request = PodRequest(name, cpu_milli=64_000, memory_mib=524_288, gpu=gpu_form(s, "A100-80GB",
                                 s.gpus_per_node * MILLI_PER_CARD), priority_class=TRAINING, qos=QoS.OFFLINE,
                                 queue=team, pools=frozenset({TRAINING_POOL}), labels=((JOB_LABEL, name),),
                                 tolerations=(Toleration(LOAN_TAINT.key),), checkpoint_every_s=s.checkpoint_every_s)
            task = _Task(kind, job, size, request, team)
            if recovery is not None:
                recovery.adopt(AdoptedGang(name, CheckpointPlanner(size, s.failure_rate_per_node_day),
                                           label=(JOB_LABEL, name), nodes=size))
        elif kind == BATCH_LOW:
            work = float(np.clip(job_rng.exponential(s.batch_hours * 3600.0), 300.0, 4 * s.batch_hours * 3600.0))
            job = CheckpointingJob(name, work, 1.0, save)
            request = PodRequest(name, cpu_milli=8000, memory_mib=65_536, gpu=gpu_form(s, "A100-80GB", MILLI_PER_CARD),
                                 priority_class=BATCH_LOW, qos=QoS.BEST_EFFORT, pools=frozenset({TRAINING_POOL}),
                                 tolerations=(Toleration(LOAN_TAINT.key),), checkpoint_every_s=s.checkpoint_every_s)
            task = _Task(kind, job, 1, request)
        elif kind == NEARLINE:
            job = nearline_job(name)
            request = PodRequest(name, cpu_milli=2000, memory_mib=8192, gpu=gpu_form(s, "T4", s.nearline_milli, 0.25),
                                 priority_class=BATCH_LOW, qos=QoS.OFFLINE, pools=nearline_pools,
                                 checkpoint_every_s=s.checkpoint_every_s)
            task = _Task(kind, job, 1, request)
        else:  # a dev box: a MIG instance for dev_mig_share of them, else a quarter card with oversold memory
            mig = float(dev_rng.random()) < s.dev_mig_share
            form: GpuForm = MigSlice(s.dev_mig_profile) if mig and s.vgpu else gpu_form(
                s, "A30-24GB", 250, s.dev_memory_mib / 24_576)
            request = PodRequest(name, cpu_milli=4000, memory_mib=32_768, gpu=form, priority_class=DEV,
                                 qos=QoS.ONLINE, pools=frozenset({DEV_POOL}))
            task = _Task(kind, None, 1, request)
        tasks[name] = task
        submit(task)
        return task

    def top_up() -> int:
        """Bring each backlog back to its size; returns how many jobs were submitted."""
        if loop.now() >= horizon:
            return 0
        waiting = Counter(t.kind for t in tasks.values() if not t.bound and not t.stopping)
        submitted = 0
        for kind, on, backlog in ((TRAINING, True, s.training_backlog), (BATCH_LOW, s.backfill, s.batch_backlog),
                                  (NEARLINE, s.colocation, s.nearline_backlog)):
            if on:
                for _ in range(backlog - waiting[kind]):
                    new_task(kind)
                    submitted += 1
        return submitted

    def finish(task: _Task) -> None:
        if task.job is None or not task.job.running or task.stopping:
            return
        task.job.complete(loop.now())
        (run.ledger if task.kind == TRAINING else run.batch).completed(task.job)
        if task.kind == NEARLINE and s.nearline_worker and loop.now() < horizon:
            counter[0] += 1  # the worker takes the queue's next task in place
            task.job = nearline_job(f"{task.request.name}#{counter[0]:06d}")
            start(task)
            return
        run.jobs_done += task.kind == TRAINING
        task.done = task.stopping = True
        if recovery is not None and task.kind == TRAINING:
            recovery.forget(task.request.name)
        for member in task.members:
            cluster.evict(member, grace_s=0.0, reason="completed")

    def start(task: _Task) -> None:
        if task.job is None:
            return
        now = loop.now()
        task.job.start(now)
        task.finish = loop.call_at(task.job.finish_time(now), functools.partial(finish, task))
        if task.kind == TRAINING:
            on_broken = sorted({node_of[m] for m in task.members if node_of.get(m) in broken})
            for node in on_broken:  # a node nobody isolated breaks again under load
                loop.call_later(float(fault_rng.exponential(s.broken_refault_s)),
                                functools.partial(fault, node, broken[node]))

    def stop(task: _Task, grace_s: float, cause: str) -> None:
        now = loop.now()
        task.stopping = True
        if task.finish is not None:
            task.finish.cancel()
            task.finish = None
        exit_at = now
        if task.job is not None and task.job.running:
            outcome = task.job.stop(now, grace_s)
            (run.ledger if task.kind == TRAINING else run.batch).stopped(task.job, outcome, cause)
            exit_at = outcome.exit_s
        for member in task.members:
            info = cluster.get_pod(member)
            if info is not None and info.phase in (PodPhase.RUNNING, PodPhase.PENDING):
                cluster.evict(member, grace_s=max(0.0, exit_at - now), reason="gang stop")
        loop.call_at(exit_at, functools.partial(exited, task))

    def exited(task: _Task) -> None:
        for member in task.members:
            info = cluster.get_pod(member)
            if info is not None and info.phase is PodPhase.TERMINATING:
                cluster.container_exited(member)

    def gone(task: _Task) -> None:
        if any(cluster.get_pod(m) is not None for m in task.members):
            return
        for member in task.members:
            task_of.pop(member, None)
        if task.done or task.kind == DEV or loop.now() >= horizon:
            tasks.pop(task.request.name, None)
            return
        task.attempt += 1
        if task.hold_s > 0:
            hold, task.hold_s = task.hold_s, 0.0
            loop.call_later(hold, functools.partial(submit, task))
        else:
            submit(task)

    def on_event(event: ClusterEvent) -> None:
        pod = event.pod
        if pod is None:
            return
        now = loop.now()
        workload = pod.request.workload
        if workload is not None:
            if event.kind is EventKind.POD_BOUND:
                serving[pod.name] = (by_workload[workload], now + s.startup_s)
                if now >= warmup:
                    run.waits[ONLINE].append(now - pod.created_at)
            elif event.kind in (EventKind.POD_DELETED, EventKind.POD_TERMINATING):
                serving.pop(pod.name, None)
            return
        task = task_of.get(pod.name)
        if task is None:
            return
        if event.kind is EventKind.POD_BOUND:
            task.bound.add(pod.name)
            if pod.assignment is not None:
                node_of[pod.name] = pod.assignment.node
            if now >= warmup and pod.request.priority_class is not None and task.attempt == 0:
                run.waits[pod.request.priority_class].append(now - pod.created_at)
            if len(task.bound) == task.size and not task.stopping:
                start(task)
        elif event.kind is EventKind.POD_TERMINATING and not task.stopping:
            reason = dict(pod.annotations).get(EVICTION_REASON, "")
            if reason in (RECLAIM_REASON, EARLY_RECLAIM_REASON):
                cause, grace = "reclaim", s.reclaim_grace_s
            elif reason == LEND_REASON:
                cause, grace = "lend", s.reclaim_grace_s
            else:
                cause, grace = PREEMPTED, classes.victim_grace_s(pod.request)
            run.preemptions += cause == PREEMPTED
            run.evictions += 1
            stop(task, grace, cause)
        elif event.kind is EventKind.POD_DELETED:
            node_of.pop(pod.name, None)
            if not task.stopping:
                stop(task, 0.0, PREEMPTED)
            loop.call_later(0.0, functools.partial(gone, task))

    cluster.watch(on_event)

    # ---------------------------------------------------------------- faults
    fault_rng = np.random.default_rng([s.seed, 7])
    training_nodes = [n.name for n in nodes if n.pool == TRAINING_POOL]
    faults = TrainingFaultsSettings()
    categories = list(faults.mix())
    weights = np.asarray([faults.mix()[c] for c in categories]) / sum(faults.mix().values())
    broken: dict[str, str] = {}
    """node → the category of the fault it carries until repaired"""

    def draw_fault() -> None:
        node = training_nodes[int(fault_rng.integers(len(training_nodes)))]
        fault(node, categories[int(fault_rng.choice(len(categories), p=weights))])

    def fault(node: str, category: str) -> None:
        now = loop.now()
        run.failures.append(now / 3600.0)
        if category in PERSISTENT:
            broken[node] = category
        if recovery is None:
            cluster.patch_node(node, unschedulable=True)
            loop.call_later(s.repair_s, functools.partial(repaired, node))
        hit = {task_of[b.request.name] for b in cluster.state.bindings.values()
               if b.assignment.node == node and b.request.name in task_of}
        gangs = []
        for task in hit:
            if task.kind != TRAINING or task.stopping or task.job is None or not task.job.running:
                if task.job is not None and task.job.running and not task.stopping:
                    stop(task, 0.0, FAULT)
                continue
            if task.finish is not None:
                task.finish.cancel()
                task.finish = None
            run.ledger.stopped(task.job, task.job.crash(now), FAULT)
            task.hung = True  # the gang holds its cards until someone (or something) restarts it
            gangs.append(task)
        if recovery is None:
            for task in gangs:
                loop.call_later(s.manual_recovery_s, functools.partial(recover, task, now, task.attempt))
            return
        exit_at = faults.hang_timeout_s if category in HANGS else 0.0
        delay = exit_at + faults.detect_s + faults.diagnosis_s
        if gangs:
            for task in gangs:
                loop.call_later(delay, functools.partial(diagnose, task, node, category, now, task.attempt))
        elif category in PERSISTENT:  # no gang there: the node agent's health checks report it
            loop.call_later(delay, functools.partial(node_report, node, category, now))

    def diagnose(task: _Task, node: str, category: str, failed_at: float, attempt: int) -> None:
        assert recovery is not None and streams is not None
        if task.attempt != attempt or task.done or not task.hung:
            return  # the hung attempt is gone already (reclaimed or preempted meanwhile, and resubmitted)
        incident = streams.incident(fault_rng, category, node)
        on = sorted({node_of[m] for m in task.members if m in node_of} | {node})
        task.stopping = True
        outcome = recovery.on_failure(task.request.name, streams.stream(fault_rng, incident, on, failed_at))
        run.recoveries.append(loop.now() / 3600.0)
        run.recovery_delays_s.append(loop.now() - failed_at)
        if not outcome.resubmitted:
            task.hold_s = s.manual_recovery_s
            for member in task.members:
                if cluster.get_pod(member) is not None:
                    cluster.evict(member, grace_s=0.0, reason=FAULT)
        for isolated in outcome.isolated:
            repair_cycle(isolated)

    def node_report(node: str, category: str, failed_at: float) -> None:
        assert recovery is not None and streams is not None
        incident = streams.incident(fault_rng, category, node)
        outcome = recovery.on_node_evidence(streams.stream(fault_rng, incident, [node], failed_at))
        for result in outcome.values():
            for isolated in result.isolated:
                repair_cycle(isolated)
        if recovery.book.state(node).value == "quarantined":
            repair_cycle(node)

    repairing: set[str] = set()

    def repair_cycle(node: str) -> None:
        assert recovery is not None
        if node in repairing:
            return
        repairing.add(node)
        run.isolated.append(node)
        recovery.repair_started(node)

        def done() -> None:
            broken.pop(node, None)
            recovery.repair_done(node)
            loop.call_later(recovery.book.policy.probation_s, functools.partial(probation_over, node))

        loop.call_later(s.repair_s, done)

    def probation_over(node: str) -> None:
        assert recovery is not None
        repairing.discard(node)
        recovery.probation_passed(node)

    def repaired(node: str) -> None:
        broken.pop(node, None)
        cluster.patch_node(node, unschedulable=False)

    def recover(task: _Task, failed_at: float, attempt: int) -> None:
        if task.attempt != attempt or task.done or not task.hung:
            return  # the hung attempt is gone already (reclaimed or preempted meanwhile, and resubmitted)
        run.recoveries.append(loop.now() / 3600.0)
        run.recovery_delays_s.append(loop.now() - failed_at)
        task.stopping = True
        for member in task.members:
            if cluster.get_pod(member) is not None:
                cluster.evict(member, grace_s=0.0, reason=FAULT)

    rate = s.failure_rate_per_node_day * len(training_nodes) / DAY_S
    t = float(fault_rng.exponential(1.0 / rate)) if rate > 0 else math.inf
    while t < horizon:
        loop.call_at(t, draw_fault)
        t += float(fault_rng.exponential(1.0 / rate))

    # ---------------------------------------------------------------- the step
    dev_shape = np.asarray(s.load_model().model_copy(update={"peak_hour": 15.0}).shape(np.arange(0.0, DAY_S, 60.0)))
    dev_max = float(dev_shape.max())

    def dev_boxes() -> None:
        want = round(s.dev_boxes * float(dev_shape[int(loop.now() % DAY_S // 60)]) / dev_max)
        open_boxes = [t for t in tasks.values() if t.kind == DEV and not t.stopping]
        for _ in range(want - len(open_boxes)):
            new_task(DEV)
        for task in open_boxes[: max(0, len(open_boxes) - want)]:
            stop(task, 0.0, "closed")

    def ready_times() -> dict[str, list[float]]:
        """Service → when each of its bound replicas serves (a time after now: still starting)."""
        ready_at: dict[str, list[float]] = defaultdict(list)
        for svc_, since in serving.values():
            ready_at[svc_.name].append(since)
        return ready_at

    def ready_replicas(now: float, ready_at: dict[str, list[float]] | None = None) -> dict[str, int]:
        """Service → its replicas serving now (bound and started)."""
        times = ready_times() if ready_at is None else ready_at
        return defaultdict(int, {name: sum(t <= now for t in ts) for name, ts in times.items()})

    def step() -> None:
        now = loop.now()
        ready_at = ready_times()
        ready = ready_replicas(now, ready_at)

        def slo(svc: Service, load: float) -> None:
            if now >= warmup:
                run.slo_minutes += shortfall_s(load, s.per_replica_capacity, ready_at[svc.name], now, dt) / 60.0

        for svc in scaled:
            load = svc.load(now)
            up = ready[svc.name]
            slo(svc, load)
            if svc.name in scalers:
                scaled_ = scalers[svc.name]
                scaled_.tick(now, load, up, s.per_replica_capacity, int(arrivals_rng.poisson(load * dt)))
                if scaled_.scaler.replicas > 0:
                    cluster.scale(svc.name, max(1, scaled_.scaler.replicas))
        for svc in tidal_services:
            load = svc.load(now)
            up = ready[svc.name]
            slo(svc, load)
            if svc.name in scalers:  # the tidal controller applies the count (and holds its floor)
                scalers[svc.name].tick(now, load, up, s.per_replica_capacity, int(arrivals_rng.poisson(load * dt)))
        if tidal is not None:
            tidal.reconcile()
        dev_boxes()
        # The backlogs stay full: what the scheduler placed is replaced at once, until a pass places none
        # (at most `backlog_rounds` rounds a step).
        top_up()
        scheduler.run_pending()
        for _ in range(s.backlog_rounds - 1):
            if not top_up():
                break
            scheduler.run_pending()
        if now >= warmup:
            pending_online = any(p.phase is PodPhase.PENDING for p in cluster.list_pods()
                                 if p.request.workload is not None) if int(now // dt) % 5 == 0 else False
            run.shortage_minutes += 5 * dt / 60.0 if pending_online else 0.0
        if now + dt < horizon:
            loop.call_later(dt, step)

    def book(now: float) -> None:
        """GPU-hours by kind over the sample interval from `now`."""
        h = s.sample_s / 3600.0
        for b in cluster.state.bindings.values():
            gpus = b.assignment.gpu_milli / MILLI_PER_CARD
            node = b.assignment.node
            if b.request.workload is not None:
                run.inference_gpu_h += gpus * h
                run.inference_cost += gpus * h * price[node]
            else:
                task = task_of.get(b.request.name)
                if task is not None and task.kind == TRAINING:
                    run.training_held_gpu_h += gpus * h
                    run.team_cost[task.team] += gpus * h * price[node]

    guard = CardPolicy(guard_settings)
    offline_share: dict[str, float] = {}
    """near-line pod → the share of the last window the node guard let it run"""

    def guard_pass(ready: dict[str, int]) -> None:
        """The node guards of the cards near-line pods share, over the sample window (`CardPolicy.window`,
        the aggregate of the 20 ms passes): each pod runs for its card's offline share; where the card's
        free memory is under the guard's safety line, its near-line pods are evicted."""
        offline_share.clear()
        online: dict[tuple[str, int], float] = defaultdict(float)
        offline: dict[tuple[str, int], list[str]] = defaultdict(list)
        for b in cluster.state.bindings.values():
            if len(b.assignment.card_indexes) != 1:
                continue
            card = (b.assignment.node, b.assignment.card_indexes[0])
            task = task_of.get(b.request.name)
            if task is not None and task.kind == NEARLINE:
                offline[card].append(b.request.name)
            elif b.request.workload is not None:
                online[card] += busy_milli(b.request.name, b.assignment.gpu_milli, ready)
        if not offline:
            return
        cards = list(offline)
        state = cluster.state
        index = [(state.node_index[node], c) for node, c in cards]
        free = np.asarray([int(state.card_mem_free[n, c]) for n, c in index], np.int64) * MIB
        held = np.asarray([sum(_memory_mib(cluster.state.bindings[name].request) for name in offline[card])
                           for card in cards], np.int64) * MIB
        out = guard.window(np.asarray([online[card] / MILLI_PER_CARD for card in cards]),
                           online_request_s=s.online_request_ms / 1000.0, offline_demand=True, free_bytes=free,
                           offline_bytes=held, window_s=s.sample_s)
        for k, card in enumerate(cards):
            if out.evict[k]:
                for name in offline[card]:
                    run.guard_evictions += 1
                    cluster.evict(name, grace_s=0.0, reason=GUARD_REASON)
                continue
            for name in offline[card]:
                offline_share[name] = float(out.offline_share[k])
        run.guard_offline_share.append(float(np.mean(out.offline_share)))

    def busy_milli(name: str, milli: int, ready: dict[str, int]) -> float:
        """SM busy milli of a pod's cards: a serving replica its service's load share of what it needs; a
        running job its busy share (a near-line pod only while its card's guard lets it run); a dev box
        `dev_busy` of a card; nothing for a hung or stopped job."""
        info = cluster.get_pod(name)
        if info is None:
            return 0.0
        workload = info.request.workload
        now = loop.now()
        if workload is not None:
            if name not in serving or serving[name][1] > now:
                return 0.0
            svc = by_workload[workload]
            share = min(1.0, svc.load(now) / (max(1, ready[svc.name]) * s.per_replica_capacity))
            return share * min(svc.need_milli, milli)
        task = task_of.get(name)
        if task is None:
            return 0.0
        if task.kind == DEV:
            return s.dev_busy * MILLI_PER_CARD
        if task.job is None or not task.job.running or task.hung:
            return 0.0
        busy = s.training_busy if task.kind == TRAINING else s.batch_busy
        if task.kind == NEARLINE:
            return busy * s.nearline_milli * offline_share.get(name, 1.0)
        return busy * milli

    def sample() -> None:
        now = loop.now()
        ready = ready_replicas(now)
        if s.colocation:
            guard_pass(ready)
        if now >= warmup:
            pool_of = {n.name: n.spec.pool for n in cluster.list_nodes()}
            capacity: dict[str, int] = defaultdict(int)
            count: dict[str, int] = defaultdict(int)
            for n in cluster.list_nodes():
                capacity[n.spec.pool] += n.spec.gpus * MILLI_PER_CARD
                count[n.spec.pool] += 1
            node_busy: dict[str, float] = defaultdict(float)
            node_alloc: dict[str, int] = defaultdict(int)
            dev_pods = mig_pods = 0
            dev_cards: set[tuple[str, int]] = set()
            book(now)
            for b in cluster.state.bindings.values():
                node = b.assignment.node
                node_alloc[node] += b.assignment.gpu_milli
                node_busy[node] += busy_milli(b.request.name, b.assignment.gpu_milli, ready)
                if pool_of[node] == DEV_POOL:
                    dev_pods += 1
                    mig_pods += any(c.mig_profile is not None for c in b.assignment.cards)
                    dev_cards.update((node, c) for c in b.assignment.card_indexes)
            busy: dict[str, float] = defaultdict(float)
            alloc: dict[str, float] = defaultdict(float)
            for node, value in node_busy.items():
                busy[pool_of[node]] += min(value, gpus_of[node] * MILLI_PER_CARD)
            for node, value in node_alloc.items():
                alloc[pool_of[node]] += value
            run.time_h.append(now / 3600.0)
            for pool in POOLS:
                cap = capacity.get(pool, 0)
                run.util[pool].append(100.0 * busy[pool] / cap if cap else 0.0)
                run.alloc[pool].append(100.0 * alloc[pool] / cap if cap else 0.0)
                run.nodes[pool].append(count.get(pool, 0))
            total = sum(capacity.values())
            run.util["fleet"].append(100.0 * sum(busy.values()) / total)
            run.alloc["fleet"].append(100.0 * sum(alloc.values()) / total)
            inference_cap = sum(capacity.get(p, 0) for p in (INFERENCE_POOL, STABLE_POOL, TIDAL_POOL))
            lent = len(tidal.ledger) if tidal is not None else 0
            if NIGHT.phase(now) == "lend":
                run.lent_share.append(100.0 * lent * s.gpus_per_node * MILLI_PER_CARD / max(1, inference_cap + lent
                                                                                             * s.gpus_per_node
                                                                                             * MILLI_PER_CARD))
            run.coloc_alloc.append(run.alloc[INFERENCE_POOL][-1])
            run.density.append(dev_pods / len(dev_cards) if dev_cards else 0.0)
            run.mig_pods.append(mig_pods)
        if now + s.sample_s < horizon:
            loop.call_later(s.sample_s, sample)

    loop.call_at(0.0, step)
    loop.call_at(0.0, sample)
    if on_world is not None:
        on_world(world)
    loop.run(until=horizon)
    if tidal is not None:
        run.loans, run.early_reclaims = tidal.stats.loans, tidal.stats.early_reclaims
        run.lend_displaced = tidal.stats.offline_pods_displaced
    return run
