"""The co-location scenario: online inference and hungry offline work on one shared card, under five
arbitration policies, replayed request by request over a day.

World, per card (`cards` independent cards, each with its own seed):
- Online requests arrive with a diurnal rate, rate(t) ∝ 1 + a·cos(2π(t − peak)/24 h) with a = (R − 1)/(R + 1)
  for a peak/trough ratio R, scaled so that online keeps the card busy `online_peak_util` of the time at the
  peak, plus a few flash crowds (×`burst_factor` for `burst_minutes`). Inter-arrival times are Gamma with
  coefficient of variation `arrival_cv` (burstier than Poisson), mapped through the cumulative rate. Each
  request needs a Gamma-distributed GPU time (mean `online_service_ms`) and is served first come, first
  served. Online memory = `online_base_gib` + `online_request_gib` per request in flight.
- Offline work is a backlog that never runs dry: a job is admitted when its footprint fits (uniform in
  [`offline_min_gib`, `offline_max_gib`], the largest the card can take when less); it runs continuous
  kernels for an exponential amount of GPU work (mean `offline_job_minutes`), checkpointing every
  `offline_checkpoint_minutes`; an evicted job loses the work since its checkpoint. A suspended job keeps
  its memory. With `offline_gpu_hours_per_day` set, jobs arrive instead (Poisson, footprints drawn on
  arrival) and wait in a queue; the first waiting job that fits is admitted, and an evicted job goes back
  to the head of the queue with the work it lost to do again.

Policies:
- `exclusive`: online alone (the baseline).
- `time-slice`: round-robin slices of `timeslice_ms`: a request that finds online idle waits for the
  running offline slice to end, and while both have work each gets half the card.
- `mps`: concurrent sharing: online kernels run `mps_online_slowdown` times slower while offline is
  resident; offline runs at `mps_offline_rate_busy` of its speed while online is busy.
- `priority`: online demand suspends offline at once (the offline kernels in flight drain: up to
  `suspend_latency_ms`); offline resumes after online has been idle `min_slice_ms`, paying
  `resume_overhead_ms`. This is `gpuplane.controllers.colocation.SliceArbiter`.
- `priority+memory-guard`: plus the node guard's memory line (`MemoryGuard`), sampled every
  `guard_period_ms`: offline is evicted when free memory falls below it, and its memory is free
  `eviction_ms` later.

Without the guard nothing stops online from running out of memory: a request that finds online's memory
plus offline's above the card fails (an online out-of-memory event). Offline admission is checked at every
guard period for every policy.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuplane.controllers.colocation import GIB, GuardSettings, MemoryGuard, OfflineEvent, SliceArbiter
from gpuplane.model import (
    MILLI_PER_CARD,
    ClusterState,
    Fraction,
    GpuplaneError,
    NodeSpec,
    PodRequest,
    QoS,
    default_catalog,
)
from gpuplane.model.tidal import DAY_S, diurnal
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.framework import Framework

FloatArray = npt.NDArray[np.float64]
Progress = Callable[[int, int], None]


class ColocationPolicy(enum.Enum):
    EXCLUSIVE = "exclusive"
    TIME_SLICE = "time-slice"
    MPS = "mps"
    PRIORITY = "priority"
    PRIORITY_MEMORY_GUARD = "priority+memory-guard"

    @property
    def shares(self) -> bool:
        return self is not ColocationPolicy.EXCLUSIVE

    @property
    def preempts(self) -> bool:
        return self in (ColocationPolicy.PRIORITY, ColocationPolicy.PRIORITY_MEMORY_GUARD)


ALL_POLICIES = tuple(ColocationPolicy)


class ColocationScenario(BaseModel):
    """Every parameter of the co-location scenario; defaults are the issue's values. Loadable from YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    days: float = Field(default=1.0, gt=0, le=14)
    cards: int = Field(default=1, ge=1, le=64, description="independent shared cards, one seed each")
    seed: int = Field(default=1, ge=0)
    policies: tuple[ColocationPolicy, ...] = ALL_POLICIES
    card_memory_gib: float = Field(default=80.0, gt=0)
    bucket_minutes: float = Field(default=10.0, gt=0, description="resolution of the utilisation curves")
    # online
    online_service_ms: float = Field(default=20.0, gt=0)
    online_service_cv: float = Field(default=0.5, ge=0)
    online_peak_util: float = Field(default=0.45, gt=0, lt=1, description="card busy share of online at the peak")
    peak_trough_ratio: float = Field(default=2.5, ge=1)
    peak_hour: float = Field(default=21.0, ge=0, lt=24)
    arrival_cv: float = Field(default=1.5, gt=0, description="inter-arrival coefficient of variation")
    bursts_per_day: float = Field(default=4.0, ge=0)
    burst_factor: float = Field(default=1.6, ge=1)
    burst_minutes: float = Field(default=10.0, gt=0)
    online_base_gib: float = Field(default=20.0, ge=0)
    online_request_gib: float = Field(default=0.5, ge=0)
    # offline
    offline_min_gib: float = Field(default=20.0, gt=0)
    offline_max_gib: float = Field(default=56.0, gt=0)
    offline_job_minutes: float = Field(default=30.0, gt=0)
    offline_checkpoint_minutes: float = Field(default=10.0, gt=0)
    offline_restart_s: float = Field(default=30.0, ge=0, description="delay before a new job after an eviction")
    offline_gpu_hours_per_day: float = Field(
        default=0.0, ge=0, description="offline work submitted per card and day (GPU-hours at solo speed, Poisson "
                                       "arrivals); 0: a backlog that never runs dry")
    # policies
    timeslice_ms: float = Field(default=2.0, gt=0)
    mps_online_slowdown: float = Field(default=1.3, ge=1)
    mps_offline_rate_busy: float = Field(default=0.5, ge=0, le=1)
    suspend_latency_ms: float = Field(default=1.0, ge=0)
    min_slice_ms: float = Field(default=5.0, ge=0)
    resume_overhead_ms: float = Field(default=0.5, ge=0)
    guard_period_ms: float = Field(default=100.0, gt=0)
    eviction_ms: float = Field(default=500.0, ge=0)
    safety_margin_gib: float = Field(default=2.0, ge=0)
    growth_factor: float = Field(default=1.5, ge=0)
    min_growth_gib: float = Field(default=2.0, ge=0)
    admit_hysteresis_gib: float = Field(default=2.0, ge=0)
    growth_window_minutes: float = Field(default=60.0, gt=0)
    admit_window_minutes: float = Field(default=10.0, ge=0)
    # placement: offline pods onto a cluster already holding online pods, binpack against colocation
    placement_nodes: int = Field(default=16, ge=1, le=2000)
    placement_gpu_model: str = "H100-80GB"
    placement_gpus_per_node: int = Field(default=8, ge=1, le=16)
    placement_online_pods_per_card: float = Field(default=1.0, ge=0)
    placement_offline_pods_per_card: float = Field(default=1.0, gt=0)
    # goals (for the verdict in the report)
    goal_p99_over_exclusive_pct: float = Field(default=5.0, ge=0)
    goal_offline_share_of_idle_pct: float = Field(
        default=60.0, ge=0, le=100, description="of the idle time, or of the offline work offered when that is less")

    @model_validator(mode="after")
    def _consistent(self) -> ColocationScenario:
        if self.offline_min_gib > self.offline_max_gib:
            raise ValueError(f"offline_min_gib ({self.offline_min_gib}) is above offline_max_gib "
                             f"({self.offline_max_gib})")
        if self.online_base_gib >= self.card_memory_gib:
            raise ValueError(f"online_base_gib ({self.online_base_gib}) leaves no room on a "
                             f"{self.card_memory_gib} GiB card")
        if not self.policies:
            raise ValueError("policies: name at least one policy")
        return self

    @field_validator("placement_gpu_model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        try:
            return default_catalog().canonical(value)
        except GpuplaneError as exc:
            raise ValueError(str(exc)) from None

    def guard_settings(self) -> GuardSettings:
        return GuardSettings(
            min_slice_s=self.min_slice_ms / 1000.0,
            memory_guard=True,
            safety_margin_bytes=int(self.safety_margin_gib * GIB),
            growth_factor=self.growth_factor,
            min_growth_bytes=int(self.min_growth_gib * GIB),
            reaction_horizon_s=(self.guard_period_ms + self.eviction_ms) / 1000.0,
            growth_window_s=self.growth_window_minutes * 60.0,
            admit_hysteresis_bytes=int(self.admit_hysteresis_gib * GIB),
            admit_window_s=self.admit_window_minutes * 60.0)


# ---------------------------------------------------------------------------------------------- online load
def rate_shape(s: ColocationScenario, t: FloatArray, bursts: FloatArray) -> FloatArray:
    """Relative online rate (1 at the diurnal peak) at times `t` (s), with flash crowds starting at `bursts`."""
    r = s.peak_trough_ratio
    shape = diurnal(t, r, s.peak_hour) / (1.0 + (r - 1.0) / (r + 1.0))  # 1 at the peak
    if len(bursts):
        starts = np.searchsorted(bursts, t, side="right") - 1
        inside = (starts >= 0) & (t < bursts[np.maximum(starts, 0)] + s.burst_minutes * 60.0)
        shape = np.where(inside, shape * s.burst_factor, shape)
    return shape


@dataclass(frozen=True, slots=True)
class OnlineLoad:
    arrivals: FloatArray
    """Seconds, sorted."""
    service: FloatArray
    """GPU seconds per request at full card."""


def online_load(s: ColocationScenario, rng: np.random.Generator) -> OnlineLoad:
    horizon = s.days * DAY_S
    bursts = np.sort(rng.uniform(0.0, horizon, rng.poisson(s.bursts_per_day * s.days)))
    grid = np.arange(0.0, horizon + 1.0, 1.0)
    peak_rate = s.online_peak_util / (s.online_service_ms / 1000.0)
    rate = peak_rate * rate_shape(s, grid, bursts)
    cumulative = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) / 2.0)))
    shape_k = 1.0 / (s.arrival_cv ** 2)
    expected = int(cumulative[-1] * 1.05 + 10.0 * math.sqrt(cumulative[-1] + 1.0) + 10)
    steps = rng.gamma(shape_k, 1.0 / shape_k, expected)
    operational = np.cumsum(steps)
    operational = operational[operational < cumulative[-1]]
    arrivals = np.interp(operational, cumulative, grid)
    mean = s.online_service_ms / 1000.0
    if s.online_service_cv > 0:
        k = 1.0 / (s.online_service_cv ** 2)
        service = rng.gamma(k, mean / k, len(arrivals))
    else:
        service = np.full(len(arrivals), mean)
    return OnlineLoad(arrivals, service)


def exclusive_departures(arrivals: FloatArray, service: FloatArray) -> FloatArray:
    """Departure times of a first-come-first-served server with no one else on the card, in closed form:
    D_n = max(A_n, D_{n-1}) + S_n = C_n + max_{k<=n}(A_k - C_{k-1}), with C the running sum of S."""
    done = np.cumsum(service)
    before = np.concatenate(([0.0], done[:-1]))
    return np.asarray(done + np.maximum.accumulate(arrivals - before))


def memory_room_pct(s: ColocationScenario, load: OnlineLoad, step_s: float = 1.0) -> float:
    """Share of the time online alone leaves room for the smallest offline job: the most any policy that
    does not oversubscribe memory can give offline work."""
    departures = exclusive_departures(load.arrivals, load.service)
    t = np.arange(0.0, s.days * DAY_S, step_s)
    in_flight = np.searchsorted(load.arrivals, t, side="right") - np.searchsorted(departures, t, side="right")
    online = s.online_base_gib + s.online_request_gib * in_flight
    return float(np.mean(s.card_memory_gib - online >= s.offline_min_gib) * 100.0)


# ---------------------------------------------------------------------------------------------- one card
@dataclass(slots=True)
class OfflineJob:
    footprint: int
    work_left: float
    since_checkpoint: float = 0.0


@dataclass(slots=True)
class CardRun:
    """What one policy did on one card."""

    policy: ColocationPolicy
    horizon_s: float
    latencies: FloatArray
    online_work_s: float
    oom_events: int
    offline_work_s: float
    """GPU seconds of offline work done, at solo speed."""
    offline_lost_s: float
    """Of which lost to evictions (since the last checkpoint)."""
    offline_offered_s: float
    """GPU seconds of offline work submitted (inf: a backlog that never runs dry)."""
    evictions: int
    suspensions: int
    offline_jobs_done: int
    bucket_s: float
    online_busy: FloatArray
    offline_alone: FloatArray
    """Per bucket: seconds the card ran online kernels / offline kernels with online idle."""
    peak_memory_gib: float
    wall_s: float = 0.0


def run_card(s: ColocationScenario, policy: ColocationPolicy, load: OnlineLoad, seed: int) -> CardRun:
    """Replay one card's day under `policy`; `seed` drives the offline jobs and the drain/slice waits so
    that every policy sees the same offline backlog."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    horizon = s.days * DAY_S
    arrivals, service = load.arrivals, load.service
    n = len(arrivals)
    waits = rng.uniform(0.0, 1.0, n)
    total_mem = int(s.card_memory_gib * GIB)
    online_base = int(s.online_base_gib * GIB)
    per_request = int(s.online_request_gib * GIB)
    offline_min, offline_max = int(s.offline_min_gib * GIB), int(s.offline_max_gib * GIB)
    job_work_mean = s.offline_job_minutes * 60.0
    checkpoint = s.offline_checkpoint_minutes * 60.0
    settings = s.guard_settings()
    guard = MemoryGuard(settings) if policy is ColocationPolicy.PRIORITY_MEMORY_GUARD else None
    arbiter = SliceArbiter(settings.min_slice_s)
    period = s.guard_period_ms / 1000.0
    eviction_delay = s.eviction_ms / 1000.0
    restart_delay = s.offline_restart_s
    min_slice = s.min_slice_ms / 1000.0
    resume_cost = s.resume_overhead_ms / 1000.0
    drain = s.suspend_latency_ms / 1000.0
    slice_s = s.timeslice_ms / 1000.0
    busy_rate = {ColocationPolicy.TIME_SLICE: 0.5, ColocationPolicy.MPS: s.mps_offline_rate_busy}.get(policy, 0.0)
    stretch = {ColocationPolicy.TIME_SLICE: 2.0, ColocationPolicy.MPS: s.mps_online_slowdown}.get(policy, 1.0)
    bucket_s = s.bucket_minutes * 60.0
    buckets = max(1, math.ceil(horizon / bucket_s))
    online_busy = np.zeros(buckets)
    offline_alone = np.zeros(buckets)

    latencies = np.empty(n)
    departures = np.empty(n)
    served = 0
    gone = 0  # departures[:gone] are <= the current time
    oom = 0
    job: OfflineJob | None = None
    running = False  # offline kernels may run (resident, admitted, not being evicted)
    freeing_at = -1.0  # an evicted job's memory is held until then
    freeing_bytes = 0
    next_admit = 0.0
    offline_done = lost = 0.0
    evictions = suspensions = jobs_done = 0
    backlog: deque[OfflineJob] = deque()
    submitted: list[tuple[float, OfflineJob]] = []
    offered = math.inf
    arriving = s.offline_gpu_hours_per_day > 0
    if arriving:
        stream = np.random.default_rng([seed, 7])
        jobs = stream.poisson(s.offline_gpu_hours_per_day * 3600.0 * s.days / job_work_mean)
        works = stream.exponential(job_work_mean, jobs)
        sizes = stream.uniform(offline_min, offline_max + 1, jobs).astype(np.int64)
        submitted = sorted(zip(stream.uniform(0.0, horizon, jobs).tolist(),
                               (OfflineJob(int(m), float(w)) for m, w in zip(sizes, works, strict=True)),
                               strict=True), key=lambda item: item[0])
        offered = float(works.sum())
    arrived = 0
    busy_until = 0.0  # online server busy until
    accounted = 0.0  # offline progress is accounted up to here
    peak_mem = 0
    next_tick = 0.0

    def online_bytes(now: float) -> int:
        nonlocal gone
        while gone < served and departures[gone] <= now:
            gone += 1
        return online_base + per_request * (served - gone)

    def offline_bytes(now: float) -> int:
        held = job.footprint if job is not None else 0
        return held + (freeing_bytes if now < freeing_at else 0)

    def account(upto: float) -> None:
        """Offline progress from `accounted` to `upto`: a busy part (online running) then an idle part."""
        nonlocal accounted, offline_done, job, running, jobs_done, next_admit
        start = accounted
        if upto <= start:
            return
        accounted = upto
        busy = max(0.0, min(busy_until, upto) - start)
        idle_from = max(busy_until, start)
        idle = max(0.0, upto - idle_from)
        b = min(int(start // bucket_s), buckets - 1)
        online_busy[b] += busy
        if job is None or not running:
            return
        if policy.preempts:
            resumed_at = busy_until + min_slice + resume_cost if busy_until > 0 else 0.0
            idle = max(0.0, upto - max(idle_from, resumed_at))
        work = busy * busy_rate + idle
        offline_alone[b] += idle
        used = min(work, job.work_left)
        job.work_left -= used
        offline_done += used
        job.since_checkpoint = (job.since_checkpoint + used) % checkpoint
        if job.work_left <= 1e-9:
            jobs_done += 1
            job, running = None, False
            next_admit = upto

    def tick(now: float) -> None:
        """The periodic look at the card: the guard's evictions, and offline admissions."""
        nonlocal job, running, freeing_at, freeing_bytes, next_admit, evictions, lost, arrived
        account(now)
        online = online_bytes(now)
        free = total_mem - online - offline_bytes(now)
        if guard is not None:
            guard.observe(now, online)
            if job is not None and guard.should_evict(free):
                lost += job.since_checkpoint
                evictions += 1
                freeing_at, freeing_bytes = now + eviction_delay, job.footprint
                if arriving:
                    job.work_left += job.since_checkpoint
                    job.since_checkpoint = 0.0
                    backlog.appendleft(job)
                job, running = None, False
                next_admit = now + restart_delay
                return
        while arrived < len(submitted) and submitted[arrived][0] <= now:
            backlog.append(submitted[arrived][1])
            arrived += 1
        if job is None and policy.shares and now >= next_admit:
            room = guard.admissible_bytes(free) if guard is not None else free
            if not arriving and room >= offline_min:
                footprint = int(rng.uniform(offline_min, min(offline_max, room) + 1))
                job = OfflineJob(footprint, float(rng.exponential(job_work_mean)))
                running = True
            elif arriving:
                for index, waiting in enumerate(backlog):
                    if waiting.footprint <= room:
                        del backlog[index]
                        job, running = waiting, True
                        break

    for i in range(n):
        a = arrivals[i]
        while next_tick <= a:
            if guard is None and job is not None:
                # nothing to admit and no guard watching: skip the idle looks
                next_tick = (math.floor(a / period) + 1) * period
                break
            tick(next_tick)
            next_tick += period
        account(a)
        online = online_bytes(a) + per_request
        in_use = online + offline_bytes(a)
        if in_use > total_mem:
            oom += 1
            continue
        peak_mem = max(peak_mem, in_use)
        setup = 0.0
        sharing = job is not None and running
        if policy.preempts:
            if a >= busy_until:
                arbiter.observe(busy_until, False)
                if arbiter.observe(a, False) is OfflineEvent.ONLINE_IDLE and sharing:
                    # offline had resumed: suspend it; its kernels in flight drain first
                    setup = waits[i] * drain
                    suspensions += 1
            arbiter.observe(a, True)
        elif policy is ColocationPolicy.TIME_SLICE and sharing and a >= busy_until:
            setup = waits[i] * slice_s  # the running offline slice ends first
        if setup:
            account(a + setup)
        start = max(a + setup, busy_until)
        busy_until = start + service[i] * (stretch if sharing else 1.0)
        departures[served] = busy_until
        latencies[served] = busy_until - a
        served += 1
    while next_tick <= horizon:
        tick(next_tick)
        next_tick += period
    account(horizon)
    return CardRun(policy, horizon, latencies[:served].copy(), float(service.sum()), oom, offline_done, lost,
                   offered, evictions, suspensions, jobs_done, bucket_s, online_busy, offline_alone, peak_mem / GIB,
                   time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------- comparison
@dataclass(slots=True)
class PolicyResult:
    """One policy pooled over every card."""

    policy: ColocationPolicy
    runs: list[CardRun] = field(default_factory=list)

    @property
    def latencies_ms(self) -> FloatArray:
        return np.concatenate([r.latencies for r in self.runs]) * 1000.0

    def total(self, name: str) -> float:
        return float(sum(getattr(r, name) for r in self.runs))

    def busy_pct(self) -> tuple[FloatArray, FloatArray]:
        """Per bucket, the share of the cards' time online kernels ran, and offline kernels ran alone."""
        first = self.runs[0]
        widths = np.full(len(first.online_busy), first.bucket_s)
        widths[-1] = max(first.horizon_s - first.bucket_s * (len(widths) - 1), 0.0)
        keep = widths > 0
        scale = 100.0 / (widths[keep] * len(self.runs))
        online = np.sum([r.online_busy for r in self.runs], axis=0)[keep] * scale
        offline = np.sum([r.offline_alone for r in self.runs], axis=0)[keep] * scale
        return np.asarray(online), np.asarray(offline)

    def utilisation_pct(self) -> FloatArray:
        """Per bucket, the share of the cards' time some kernel ran (a card-busy ratio, like GPU_UTIL)."""
        online, offline = self.busy_pct()
        return np.asarray(np.minimum(online + offline, 100.0))


def figure_key(policy: ColocationPolicy) -> str:
    return policy.value.replace("+", "_").replace("-", "_")


@dataclass(slots=True)
class ColocationComparison:
    scenario: ColocationScenario
    results: dict[ColocationPolicy, PolicyResult]
    placement: list[PlacementResult] = field(default_factory=list)
    memory_room_pct: float = 100.0
    """Mean over the cards of `memory_room_pct`."""
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        s = self.scenario
        out: dict[str, Any] = {"scenario": "colocation", "days": s.days, "cards": s.cards, "seed": s.seed}
        base = self.results.get(ColocationPolicy.EXCLUSIVE)
        base_p99 = float(np.percentile(base.latencies_ms, 99)) if base is not None else math.nan
        base_qps = len(base.latencies_ms) / (s.days * DAY_S * s.cards) if base is not None else math.nan
        base_util = float(np.mean(base.utilisation_pct())) if base is not None else math.nan
        base_peak = float(np.max(base.utilisation_pct())) if base is not None else math.nan
        base_oom = int(base.total("oom_events")) if base is not None else None
        out["offline_memory_room_pct"] = round(self.memory_room_pct, 3)
        for policy, result in self.results.items():
            key = figure_key(policy)
            lat = result.latencies_ms
            horizon = s.days * DAY_S * s.cards
            idle = horizon - result.total("online_work_s")
            useful = result.total("offline_work_s") - result.total("offline_lost_s")
            util = result.utilisation_pct()
            p99 = float(np.percentile(lat, 99)) if len(lat) else math.nan
            qps = len(lat) / horizon
            out |= {
                f"{key}_online_p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
                f"{key}_online_p99_ms": round(p99, 3) if len(lat) else None,
                f"{key}_online_p99_vs_exclusive_pct": _change(p99, base_p99),
                f"{key}_online_qps": round(qps, 3),
                f"{key}_online_qps_vs_exclusive_pct": _change(qps, base_qps),
                f"{key}_online_oom_events": int(result.total("oom_events")),
                f"{key}_online_oom_added": None if base_oom is None else int(result.total("oom_events")) - base_oom,
                f"{key}_offline_share_of_idle_pct": round(useful * 100.0 / max(idle, 1e-9), 3),
                f"{key}_offline_share_of_usable_idle_pct": round(
                    useful * 100.0 / max(min(idle, result.total("offline_offered_s")), 1e-9), 3),
                f"{key}_offline_gpu_hours": round(useful / 3600.0, 3),
                f"{key}_offline_lost_gpu_hours": round(result.total("offline_lost_s") / 3600.0, 3),
                f"{key}_offline_done_pct_of_offered": _share(useful, result.total("offline_offered_s")),
                f"{key}_offline_jobs_done": int(result.total("offline_jobs_done")),
                f"{key}_evictions": int(result.total("evictions")),
                f"{key}_suspensions_per_hour": round(result.total("suspensions") / (horizon / 3600.0), 1),
                f"{key}_card_utilisation_pct": round(float(np.mean(util)), 3),
                f"{key}_card_utilisation_peak_pct": round(float(np.max(util)), 3),
                f"{key}_utilisation_gain_points": _points(float(np.mean(util)), base_util),
                f"{key}_peak_utilisation_gain_points": _points(float(np.max(util)), base_peak),
                f"{key}_peak_memory_gib": round(max(r.peak_memory_gib for r in result.runs), 2),
                f"{key}_wall_s": round(result.total("wall_s"), 2),
            }
        guarded = figure_key(ColocationPolicy.PRIORITY_MEMORY_GUARD)
        if ColocationPolicy.PRIORITY_MEMORY_GUARD in self.results and base is not None:
            p99_ok = out[f"{guarded}_online_p99_vs_exclusive_pct"] <= s.goal_p99_over_exclusive_pct
            offline_ok = out[f"{guarded}_offline_share_of_usable_idle_pct"] >= s.goal_offline_share_of_idle_pct
            oom_ok = out[f"{guarded}_online_oom_added"] == 0
            out |= {"goal_p99_met": bool(p99_ok), "goal_offline_share_met": bool(offline_ok),
                    "goal_zero_online_oom_met": bool(oom_ok), "goals_met": bool(p99_ok and offline_ok and oom_ok)}
        for placed in self.placement:
            prefix = f"placement_{placed.policy}"
            out |= {f"{prefix}_offline_pods_placed": placed.offline_placed,
                    f"{prefix}_online_pressure_under_offline": placed.online_pressure_under_offline,
                    f"{prefix}_offline_on_busy_cards_pct": placed.offline_on_busy_cards_pct,
                    f"{prefix}_stranded_compute_pct": placed.stranded_compute_pct,
                    f"{prefix}_stranded_memory_pct": placed.stranded_memory_pct}
        out["wall_s"] = round(self.wall_s, 2)
        return out


def _change(value: float, base: float) -> float | None:
    if not math.isfinite(value) or not math.isfinite(base) or base <= 0:
        return None
    return round((value - base) * 100.0 / base, 3)


def _share(part: float, whole: float) -> float | None:
    """`part` as % of `whole`; None for a backlog that never runs dry."""
    return round(part * 100.0 / whole, 3) if math.isfinite(whole) and whole > 0 else None


def _points(value: float, base: float) -> float | None:
    return round(value - base, 3) if math.isfinite(base) else None


def run_colocation(s: ColocationScenario, progress: Progress | None = None) -> ColocationComparison:
    """Every policy on the same cards: each card's online load and offline backlog are drawn once from its
    seed and replayed under each policy. Then the placement comparison (`run_placement`)."""
    started = time.perf_counter()
    results = {p: PolicyResult(p) for p in dict.fromkeys(s.policies)}
    total, done = s.cards * len(results), 0
    rooms = []
    for card in range(s.cards):
        seed = s.seed * 1_000_003 + card
        load = online_load(s, np.random.default_rng([seed, 0]))
        rooms.append(memory_room_pct(s, load))
        for policy, result in results.items():
            result.runs.append(run_card(s, policy, load, seed))
            done += 1
            if progress is not None:
                progress(done, total)
    placement = run_placement(s)
    return ColocationComparison(s, results, placement, float(np.mean(rooms)), time.perf_counter() - started)



# ---------------------------------------------------------------------------------------------- placement
PLACEMENT_POLICIES = ("binpack", "colocation")


@dataclass(frozen=True, slots=True)
class PlacementResult:
    policy: str
    offline_offered: int
    offline_placed: int
    online_pressure_under_offline: float
    """Compute-weighted mean share of a card held by online pods, over the cards offline pods went to."""
    offline_on_busy_cards_pct: float
    """Offline pods placed on cards where online holds more than half the compute."""
    stranded_compute_pct: float
    """Free compute on cards with less than the smallest offline memory request free (% of all compute)."""
    stranded_memory_pct: float
    """Free memory on cards with less than the smallest offline compute request free (% of all memory)."""


def _placement_pods(s: ColocationScenario, card_mib: int, rng: np.random.Generator) -> tuple[list[PodRequest],
                                                                                               list[PodRequest]]:
    cards = s.placement_nodes * s.placement_gpus_per_node
    online, offline = [], []
    for i in range(round(cards * s.placement_online_pods_per_card)):
        milli = int(rng.choice(np.arange(100, 501, 50)))
        mem = int(card_mib * milli / MILLI_PER_CARD * rng.uniform(0.7, 1.3))
        online.append(PodRequest(f"online-{i}", gpu=Fraction(compute_milli=milli, memory_mib=mem), qos=QoS.ONLINE,
                                 priority=1000))
    for i in range(round(cards * s.placement_offline_pods_per_card)):
        if rng.random() < 0.5:  # compute-heavy: half the memory its compute share would suggest, or less
            milli, ratio = int(rng.choice(np.arange(200, 501, 50))), rng.uniform(0.2, 0.5)
        else:  # memory-heavy
            milli, ratio = int(rng.choice(np.arange(100, 251, 50))), rng.uniform(1.5, 3.0)
        mem = min(int(card_mib * milli / MILLI_PER_CARD * ratio), card_mib)
        offline.append(PodRequest(f"offline-{i}", gpu=Fraction(compute_milli=milli, memory_mib=mem), qos=QoS.OFFLINE,
                                  priority=100))
    return online, offline


def run_placement(s: ColocationScenario) -> list[PlacementResult]:
    """Online pods first, spread over nodes and cards as inference fleets spread replicas (the same for both),
    then offline pods by each policy; the same pods for both."""
    catalog = default_catalog()
    model = catalog.get(s.placement_gpu_model)
    nodes = [NodeSpec(f"node-{i:04d}", 128_000, 1_024_000, model.name, s.placement_gpus_per_node)
             for i in range(s.placement_nodes)]
    online, offline = _placement_pods(s, model.memory_mib, np.random.default_rng([s.seed, 1]))
    registry = default_registry()
    spread = Framework(registry.build(PolicyConfig(node_policy="spread", card_policy="spread", seed=s.seed)),
                       np.random.default_rng([s.seed, 2]))
    results = []
    for policy in PLACEMENT_POLICIES:
        state = ClusterState(catalog, nodes)
        for pod in online:
            decision = spread.schedule(pod, state)
            if decision.assignment is not None:
                state.place(pod, decision.assignment)
        framework = Framework(registry.build(PolicyConfig(node_policy=policy, seed=s.seed)),
                              np.random.default_rng([s.seed, 3]))
        pressures, weights = [], []
        busy = 0
        for pod in offline:
            decision = framework.schedule(pod, state)
            if decision.assignment is None:
                continue
            share = decision.assignment.cards[0]
            pressure = float(state.card_online_milli[decision.node, share.card]) / MILLI_PER_CARD
            pressures.append(pressure)
            weights.append(share.compute_milli)
            busy += pressure > 0.5
            state.place(pod, decision.assignment)
        results.append(_placement_result(policy, state, offline, pressures, weights, busy))
    return results


def _placement_result(policy: str, state: ClusterState, offline: Sequence[PodRequest], pressures: list[float],
                      weights: list[int], busy: int) -> PlacementResult:
    n = state.size
    valid = state.card_valid[:n]
    milli_free = state.card_milli_free[:n][valid]
    mem_free = state.card_mem_free[:n][valid]
    smallest_mem = min(p.gpu.memory_mib for p in offline if isinstance(p.gpu, Fraction))
    smallest_milli = min(p.gpu.compute_milli for p in offline if isinstance(p.gpu, Fraction))
    stranded_compute = milli_free[mem_free < smallest_mem].sum()
    stranded_memory = mem_free[milli_free < smallest_milli].sum()
    placed = len(pressures)
    return PlacementResult(
        policy, len(offline), placed,
        round(float(np.average(pressures, weights=weights)), 4) if placed else 0.0,
        round(busy * 100.0 / max(placed, 1), 3),
        round(float(stranded_compute) * 100.0 / float(valid.sum() * MILLI_PER_CARD), 3),
        round(float(stranded_memory) * 100.0 / max(float(state.card_mem_cap[:n][valid].sum()), 1.0), 3))
