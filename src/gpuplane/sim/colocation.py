"""The co-location scenario: online inference and hungry offline work on shared cards, replayed request by
request, with the node guard's own policy deciding every pass.

World, per card (`cards` independent cards, each with its own seed):
- Online requests arrive at the kit's load (`LoadModel`: diurnal, noise, flash crowds) scaled so that online
  keeps the card busy `online_peak_util` of the time at the noise-free peak. Inter-arrival times are Gamma
  with coefficient of variation `arrival_cv` (burstier than Poisson) through the cumulative rate; each
  request needs Gamma GPU time (mean `online_service_ms`), first come first served. Online memory is
  `online_base_gib` plus `online_request_gib` per request in flight; a request that finds no memory left
  fails (an online out-of-memory event).
- Offline work never runs dry: up to `offline_slots` offline containers per card, each a `CheckpointingJob`
  (the kit's save model) with a footprint uniform in [`offline_min_gib`, `offline_max_gib`] that it
  allocates when it first runs. An eviction books lost work in the kit's `WorkLedger`; an evicted job goes
  back to the head of the backlog and restarts from its last save.
- While online and offline kernels run together, online runs `share_online_slowdown` times slower and
  offline at `share_offline_rate` of its speed (MPS-style concurrency: the best plain sharing does).

Arms (every sharing arm admits offline work by the same rule, `admission`, or none does):
- `exclusive`: online alone.
- `shared`: plain sharing, no guard: offline runs whenever it is admitted; nothing suspends or evicts it.
- `guard` (ours): the node guard. Every `poll_s` it reads the card (online demand = online busy more than
  `online_sm_threshold_pct` of the last poll) and takes its decisions from `CardPolicy.decide`, the code
  `gpuplane.node.guard` runs: the slice arbiter (`min_slice_s`), the transition table, the memory guard's
  safety line with `pick_eviction`, and admission. A suspension (SIGSTOP) lands once the offline kernels
  already queued drain (uniform up to `offline_drain_ms`); a resume (SIGCONT) after `resume_ms`.
- `kernel-gate`: a kernel-launch gate (HAMi-core's task priority, REEF- or Orion-style interception): the
  same `CardPolicy`, but its slice arbiter sees every online launch and idle moment, with
  `kernel_gate_detect_ms` until offline launches are blocked and `kernel_gate_slice_ms` of idle before they
  go on; the in-flight offline kernel drains (up to `kernel_gate_drain_ms`). Memory is guarded by the node
  guard's passes, as in `guard`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from gpuplane.controllers.colocation import (
    GIB,
    GUARD_REACTION,
    CardPolicy,
    GuardSettings,
    OfflineAction,
    OfflineEvent,
    OfflineState,
    OfflineView,
    offline_transition,
)
from gpuplane.sim.scenario import (
    DAY_S,
    CheckpointingJob,
    Figures,
    Goal,
    Headline,
    LoadModel,
    Progress,
    SaveModel,
    ScenarioSettings,
    Table,
    WorkLedger,
    figure,
    sample_load,
    series,
)

FloatArray = npt.NDArray[np.float64]
_GUARD = GUARD_REACTION
_POLICY = GuardSettings()

EXCLUSIVE, SHARED, GUARD, KERNEL = "exclusive", "shared", "guard", "kernel-gate"
ARMS = (EXCLUSIVE, SHARED, GUARD, KERNEL)
SHARING = (SHARED, GUARD, KERNEL)


class ColocationSettings(ScenarioSettings):
    """Every parameter of the co-location scenario. The guard's reaction and thresholds default to
    `gpuplane.node.guard`'s own (`GuardOptions`, `GuardSettings`)."""

    hours: float = Field(default=1.0, gt=0, le=14 * 24, description="simulated hours per card")
    start_hour: float = Field(default=20.5, ge=0, lt=24, description="time of day the run starts (the evening "
                              "peak by default: the least idle time, the most requests to disturb)")
    cards: int = Field(default=1, ge=1, le=64, description="independent shared cards, one seed each")
    card_memory_gib: float = Field(default=80.0, gt=0)
    bucket_minutes: float = Field(default=10.0, gt=0, description="resolution of the utilisation series")
    # online
    online_service_ms: float = Field(default=20.0, gt=0)
    online_service_cv: float = Field(default=0.5, ge=0)
    online_peak_util: float = Field(default=0.45, gt=0, lt=1, description="online's busy share at the peak")
    arrival_cv: float = Field(default=1.5, gt=0, description="inter-arrival coefficient of variation")
    peak_trough_ratio: float = Field(default=2.5, ge=1)
    peak_hour: float = Field(default=21.0, ge=0, lt=24)
    noise_cv: float = Field(default=0.05, ge=0, le=2)
    bursts_per_day: float = Field(default=4.0, ge=0)
    burst_factor: float = Field(default=1.6, ge=1)
    burst_minutes: float = Field(default=10.0, gt=0)
    online_base_gib: float = Field(default=20.0, ge=0)
    online_request_gib: float = Field(default=0.5, ge=0)
    # offline
    offline_slots: int = Field(default=2, ge=1, le=8, description="offline containers a card holds at most")
    offline_min_gib: float = Field(default=10.0, gt=0)
    offline_max_gib: float = Field(default=28.0, gt=0)
    offline_job_minutes: float = Field(default=30.0, gt=0, description="mean GPU work of a job (exponential)")
    offline_save_every_minutes: float = Field(default=10.0, gt=0)
    offline_save_s: float = Field(default=10.0, ge=0)
    offline_start_s: float = Field(default=2.0, ge=0, description="from placement to its first kernels")
    offline_restart_s: float = Field(default=30.0, ge=0, description="before the next placement after an eviction")
    offline_exit_s: float = Field(default=0.5, ge=0, description="from a process's exit to its memory freed")
    share_online_slowdown: float = Field(default=1.3, ge=1)
    share_offline_rate: float = Field(default=0.5, ge=0, le=1)
    # the node guard (process-level gate)
    poll_s: float = Field(default=_GUARD.poll_s, gt=0, description="the guard's pass period (node/guard.py)")
    min_slice_s: float = Field(default=_GUARD.min_slice_s, ge=0, description="idle before the guard resumes")
    online_sm_threshold_pct: float = Field(default=_GUARD.online_sm_threshold_pct, ge=0, le=100)
    kill_grace_s: float = Field(default=_GUARD.kill_grace_s, ge=0)
    offline_drain_ms: float = Field(default=10.0, ge=0, description="queued offline kernels finish after SIGSTOP")
    resume_ms: float = Field(default=0.5, ge=0)
    admission: bool = Field(default=True, description="every sharing arm admits offline work by the safety line")
    evictions: bool = Field(default=True, description="the memory guard evicts (guard and kernel-gate arms)")
    safety_margin_gib: float = Field(default=_POLICY.safety_margin_bytes / GIB, ge=0)
    growth_factor: float = Field(default=_POLICY.growth_factor, ge=0)
    min_growth_gib: float = Field(default=_POLICY.min_growth_bytes / GIB, ge=0)
    reaction_horizon_s: float = Field(default=_POLICY.reaction_horizon_s, ge=0)
    admit_hysteresis_gib: float = Field(default=_POLICY.admit_hysteresis_bytes / GIB, ge=0)
    admit_window_s: float = Field(default=_POLICY.admit_window_s, ge=0)
    admit_timeout_s: float = Field(default=_POLICY.admit_timeout_s, ge=0)
    # the kernel-launch gate
    kernel_gate_detect_ms: float = Field(default=0.0, ge=0, description="online launch to offline blocked")
    kernel_gate_drain_ms: float = Field(default=1.0, ge=0)
    kernel_gate_slice_ms: float = Field(default=5.0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> ColocationSettings:
        if self.offline_min_gib > self.offline_max_gib:
            raise ValueError(f"offline_min_gib ({self.offline_min_gib}) is above offline_max_gib "
                             f"({self.offline_max_gib})")
        if self.online_base_gib >= self.card_memory_gib:
            raise ValueError(f"online_base_gib ({self.online_base_gib}) leaves no room on a "
                             f"{self.card_memory_gib} GiB card")
        return self

    def guard_settings(self) -> GuardSettings:
        return GuardSettings(
            min_slice_s=self.min_slice_s, memory_guard=True, safety_margin_bytes=int(self.safety_margin_gib * GIB),
            growth_factor=self.growth_factor, min_growth_bytes=int(self.min_growth_gib * GIB),
            reaction_horizon_s=self.reaction_horizon_s, growth_window_s=_POLICY.growth_window_s,
            admit_hysteresis_bytes=int(self.admit_hysteresis_gib * GIB), admit_window_s=self.admit_window_s,
            admission=self.admission, admit_timeout_s=self.admit_timeout_s)


# ---------------------------------------------------------------------------------------------- online load
@dataclass(frozen=True, slots=True)
class OnlineLoad:
    arrivals: FloatArray
    """Seconds from the run's start, sorted."""
    service: FloatArray
    """GPU seconds per request at full card."""


def online_load(s: ColocationSettings, rng: np.random.Generator) -> OnlineLoad:
    """Gamma inter-arrivals through the cumulative rate of the kit's load curve."""
    start, horizon = s.start_hour * 3600.0, s.hours * 3600.0
    model = LoadModel(peak_trough_ratio=s.peak_trough_ratio, peak_hour=s.peak_hour, noise_cv=s.noise_cv,
                      bursts_per_day=s.bursts_per_day, burst_factor=s.burst_factor, burst_minutes=s.burst_minutes)
    day_shape = model.shape(np.arange(0.0, DAY_S, 60.0))
    peak_rate = s.online_peak_util / (s.online_service_ms / 1000.0)
    mean = peak_rate * float(day_shape.mean() / day_shape.max())
    curve = sample_load(model, days=(start + horizon) / DAY_S, mean=mean, rng=rng, step_s=1.0)
    first = int(start)
    rate = curve.value[first:first + math.ceil(horizon) + 1]
    grid = np.arange(len(rate), dtype=np.float64)
    cumulative = np.concatenate(([0.0], np.cumsum(rate[:-1])))
    k = 1.0 / (s.arrival_cv ** 2)
    expected = int(cumulative[-1] * 1.05 + 10.0 * math.sqrt(cumulative[-1] + 1.0) + 10)
    operational = np.cumsum(rng.gamma(k, 1.0 / k, expected))
    operational = operational[operational < cumulative[-1]]
    arrivals = np.interp(operational, cumulative, grid)
    arrivals = arrivals[arrivals < horizon]
    service_s = s.online_service_ms / 1000.0
    if s.online_service_cv > 0:
        kk = 1.0 / (s.online_service_cv ** 2)
        service = rng.gamma(kk, service_s / kk, len(arrivals))
    else:
        service = np.full(len(arrivals), service_s)
    return OnlineLoad(arrivals, service)


def exclusive_departures(arrivals: FloatArray, service: FloatArray) -> FloatArray:
    """Departures of a first-come-first-served server alone on the card, in closed form:
    D_n = max(A_n, D_{n-1}) + S_n = C_n + max_{k<=n}(A_k - C_{k-1}), with C the running sum of S."""
    done = np.cumsum(service)
    before = np.concatenate(([0.0], done[:-1]))
    return np.asarray(done + np.maximum.accumulate(arrivals - before))


# ---------------------------------------------------------------------------------------------- one card
@dataclass(slots=True)
class OfflineJob:
    """One offline container on the card."""

    name: str
    footprint: int
    job: CheckpointingJob
    placed_at: float
    state: OfflineState = OfflineState.RUNNING
    since: float = 0.0
    starting: bool = True
    clock: float = 0.0
    """GPU seconds of work it has received since its (re)start: the checkpointing job's own clock."""
    finish_clock: float = math.inf
    run_from: float = math.inf
    """Its kernels run from here (inf: stopped)."""
    stop_at: float = math.inf
    """... until here (a suspension's drain)."""
    allocated_at: float = math.inf
    gone_at: float = math.inf
    """Its processes are gone and its memory free from here (an eviction's exit)."""

    def executing(self, t: float) -> bool:
        return self.run_from <= t < self.stop_at

    def run_at(self, t: float) -> None:
        self.run_from = t
        if self.allocated_at == math.inf:
            self.allocated_at = t  # it allocates its footprint as it first runs

    def holds(self, t: float) -> int:
        return self.footprint if self.allocated_at <= t < self.gone_at else 0


@dataclass(slots=True)
class CardRun:
    """What one arm did on one card."""

    arm: str
    horizon_s: float
    latencies: FloatArray
    oom: int
    online_work_s: float
    ledger: WorkLedger
    evictions: int
    holds: int
    timeouts: int
    suspensions: int
    busy: FloatArray
    """Per bucket: seconds some kernel ran on the card."""
    wall_s: float


class CardSim:
    """One card under one arm. `run()` replays the online load; the guard's passes run every `poll_s`."""

    def __init__(self, s: ColocationSettings, arm: str, load: OnlineLoad, seed: int) -> None:
        self.s = s
        self.arm = arm
        self.arrivals = load.arrivals.tolist()
        self.service = load.service.tolist()
        self.rng = np.random.default_rng([seed, 11])
        self.jobs_rng = np.random.default_rng([seed, 7])
        settings = s.guard_settings()
        if arm == KERNEL:
            settings = replace(settings, min_slice_s=s.kernel_gate_slice_ms / 1000.0)
        self.policy = CardPolicy(settings, evictions=s.evictions and arm in (GUARD, KERNEL))
        self.total = int(s.card_memory_gib * GIB)
        self.base = int(s.online_base_gib * GIB)
        self.per_request = int(s.online_request_gib * GIB)
        self.save = SaveModel(every_s=s.offline_save_every_minutes * 60.0, save_s=s.offline_save_s, on_signal=True)
        self.ledger = WorkLedger()
        self.backlog: deque[OfflineJob] = deque()
        self.jobs: list[OfflineJob] = []
        self.named = 0
        self.t = 0.0
        self.queue: deque[list[float]] = deque()
        """[arrival, work left] of the requests in flight, the head in service."""
        self.next_arrival = 0
        self.busy_total = 0.0
        """Seconds online has been busy so far (the guard's SM reading differences it)."""
        self.latencies: list[float] = []
        self.oom = 0
        self.evictions = self.holds = self.timeouts = self.suspensions = 0
        self.next_place = 0.0
        self.gate_check = math.inf
        """The kernel gate: when online's idle slice ends (inf: none pending)."""
        self.bucket_s = s.bucket_minutes * 60.0
        self.busy = np.zeros(max(1, math.ceil(s.hours * 3600.0 / self.bucket_s)))

    # -- the card's physics ------------------------------------------------------------------------------
    def _switch_after(self, t: float) -> float:
        nxt = self.gate_check
        for job in self.jobs:
            if t < job.run_from < nxt:
                nxt = job.run_from
            if t < job.stop_at < nxt and job.run_from <= t:
                nxt = job.stop_at
        return nxt

    def advance(self, until: float) -> None:
        """Serve online and run offline from `self.t` to `until`, one stretch of constant speeds at a time."""
        s = self.s
        arrivals, service = self.arrivals, self.service
        while self.t < until:
            t = self.t
            executing = [j for j in self.jobs if j.executing(t)]
            online_busy = bool(self.queue)
            slow = s.share_online_slowdown if executing else 1.0
            end = min(until, self._switch_after(t))
            arrival = arrivals[self.next_arrival] if self.next_arrival < len(arrivals) else math.inf
            end = min(end, arrival)
            if online_busy:
                end = min(end, t + self.queue[0][1] * slow)
            dt = end - t
            if dt > 0:
                if online_busy:
                    self.queue[0][1] -= dt / slow
                    self.busy_total += dt
                if executing:
                    rate = (s.share_offline_rate if online_busy else 1.0) / len(executing)
                    for job in executing:
                        job.clock += rate * dt
                if online_busy or executing:
                    self._book_busy(t, dt)
            self.t = end
            if online_busy and self.queue[0][1] <= 1e-12:
                arrived, _ = self.queue.popleft()
                self.latencies.append(end - arrived)
                if not self.queue:
                    self._online_idle(end)
            if end == arrival:
                self.next_arrival += 1
                self._arrive(end, service[self.next_arrival - 1])
            if end == self.gate_check:
                self.gate_check = math.inf
                self._gate(end, self.policy.arbiter.observe(end, bool(self.queue)))
            self._finish_jobs(end)

    def _book_busy(self, t: float, dt: float) -> None:
        b = min(int(t // self.bucket_s), len(self.busy) - 1)
        self.busy[b] += dt

    def _arrive(self, t: float, work: float) -> None:
        in_use = self.base + self.per_request * (len(self.queue) + 1) + sum(j.holds(t) for j in self.jobs)
        if in_use > self.total:
            self.oom += 1
            return
        self.queue.append([t, work])
        if len(self.queue) == 1 and self.arm == KERNEL:
            self.gate_check = math.inf
            self._gate(t, self.policy.arbiter.observe(t, True))

    def _online_idle(self, t: float) -> None:
        if self.arm == KERNEL:
            self._gate(t, self.policy.arbiter.observe(t, False))
            self.gate_check = t + self.s.kernel_gate_slice_ms / 1000.0

    def _finish_jobs(self, t: float) -> None:
        for job in self.jobs:
            if job.clock >= job.finish_clock - 1e-9 and job.gone_at == math.inf:
                job.job.complete(job.finish_clock)
                self.ledger.completed(job.job)
                job.run_from = job.stop_at = math.inf
                job.gone_at = t + self.s.offline_exit_s

    # -- the guard's pass --------------------------------------------------------------------------------
    def tick(self, now: float, reading_busy: float) -> None:
        s = self.s
        online_bytes = self.base + self.per_request * len(self.queue)
        held = sum(j.holds(now) for j in self.jobs)
        free = self.total - online_bytes - held
        views = [OfflineView(j.name, j.state, j.since, j.placed_at, now < j.gone_at, j.holds(now),
                             quota_bytes=j.footprint, starting=j.starting) for j in self.jobs]
        for job in self.jobs:
            job.starting = False
        if self.arm == GUARD:
            active: bool | None = reading_busy > s.online_sm_threshold_pct / 100.0 * s.poll_s
        elif self.arm == KERNEL:
            active = bool(self.queue)
        else:
            active = None
        decision = self.policy.decide(now, active, online_bytes, free, views)
        by_name = {j.name: j for j in self.jobs}
        for step in decision.steps:
            self._apply(by_name[step.name], step.event, now)
        if decision.gate is OfflineEvent.ONLINE_DEMAND:
            for job in self.jobs:
                if job.state is OfflineState.EVICTING:  # online demand during the grace: killed at once
                    job.gone_at = min(job.gone_at, now + s.offline_exit_s)
        if decision.gate is not None:
            self._gate(now, decision.gate)
        self.jobs = [j for j in self.jobs if j.state is not OfflineState.GONE]
        self._place(now)

    def _gate(self, now: float, event: OfflineEvent | None) -> None:
        if event is not None:
            for job in self.jobs:
                self._apply(job, event, now)

    def _apply(self, job: OfflineJob, event: OfflineEvent, now: float) -> None:
        s = self.s
        state, action = offline_transition(job.state, event)
        if action is None:
            return
        job.state, job.since = state, now
        if action is OfflineAction.SUSPEND or action is OfflineAction.HOLD:
            if action is OfflineAction.SUSPEND:
                self.suspensions += 1
            else:
                self.holds += 1
            if self.arm == KERNEL and action is OfflineAction.SUSPEND:
                drain = (s.kernel_gate_detect_ms + self.rng.uniform(0.0, s.kernel_gate_drain_ms)) / 1000.0
            else:
                drain = self.rng.uniform(0.0, s.offline_drain_ms) / 1000.0
            if job.run_from <= now + drain:
                job.stop_at = now + drain
            else:  # not started yet: it never runs, and allocates nothing
                job.run_from = math.inf
                if job.allocated_at > now:
                    job.allocated_at = math.inf
        elif action is OfflineAction.RESUME:
            if not job.executing(now):
                job.run_at(now + s.resume_ms / 1000.0)
            job.stop_at = math.inf
        elif action is OfflineAction.ADMIT and self.arm == SHARED:
            self._apply(job, OfflineEvent.ONLINE_IDLE, now)  # no gate: an admitted job goes on at once
        elif action is OfflineAction.EVICT:
            self._evict(job, event, now)
        elif action is OfflineAction.FORGET:
            job.state = OfflineState.GONE

    def _evict(self, job: OfflineJob, event: OfflineEvent, now: float) -> None:
        s = self.s
        if event is OfflineEvent.ADMISSION_TIMEOUT:
            self.timeouts += 1
        else:
            self.evictions += 1
        ran = job.job.running
        # SIGTERM: it may save until the guard kills it, at once when online demand shows
        grace = 0.0 if self.queue else min(s.kill_grace_s, self._next_arrival_after(now) - now + s.poll_s)
        if ran:
            outcome = job.job.stop(job.clock, grace)
            self.ledger.stopped(job.job, outcome, "eviction")
            exit_in = min(max(0.0, outcome.exit_s - job.clock), grace)
        else:
            exit_in = 0.0
        job.run_from = job.stop_at = math.inf
        job.gone_at = now + exit_in + s.offline_exit_s
        self.next_place = now + s.offline_restart_s
        if ran and event is not OfflineEvent.ADMISSION_TIMEOUT:
            self.backlog.appendleft(job)  # it restarts from its last save, the next to be placed

    def _next_arrival_after(self, now: float) -> float:
        i = self.next_arrival
        return self.arrivals[i] if i < len(self.arrivals) else now + self.s.kill_grace_s

    def _job(self, now: float) -> OfflineJob:
        s = self.s
        self.named += 1
        footprint = int(self.jobs_rng.uniform(s.offline_min_gib, s.offline_max_gib) * GIB)
        work = float(self.jobs_rng.exponential(s.offline_job_minutes * 60.0)) + 1.0
        return OfflineJob(f"offline-{self.named}", footprint, CheckpointingJob(f"offline-{self.named}", work, 1.0,
                                                                              self.save), now)

    def _place(self, now: float) -> None:
        if self.arm == EXCLUSIVE or now < self.next_place:
            return
        while sum(1 for j in self.jobs if j.gone_at > now) < self.s.offline_slots:
            job = self.backlog.popleft() if self.backlog else self._job(now)
            job.placed_at = job.since = now
            job.state, job.starting = OfflineState.RUNNING, True
            job.stop_at = job.allocated_at = job.gone_at = math.inf
            job.clock = 0.0
            job.job.start(0.0)
            job.finish_clock = job.job.finish_time(0.0)
            job.run_at(now + self.s.offline_start_s)
            self.jobs.append(job)

    def run(self) -> CardRun:
        started = time.perf_counter()
        horizon = self.s.hours * 3600.0
        poll = self.s.poll_s
        if self.arm != EXCLUSIVE:
            ticks = int(horizon / poll)
            last_busy = 0.0
            for k in range(1, ticks + 1):
                now = k * poll
                self.advance(now)
                self.tick(now, self.busy_total - last_busy)
                last_busy = self.busy_total
        self.advance(horizon)
        while self.queue:  # requests still in flight finish after the horizon
            self.advance(self.t + self.queue[0][1] * self.s.share_online_slowdown + 1e-9)
            if self.t > horizon + 3600.0:
                break
        for job in self.jobs:  # work done and not saved yet at the end is not lost: the job goes on
            if job.job.running and job.gone_at > self.t:
                self.ledger.useful_gpu_s += max(0.0, job.job.done_s(job.clock) - job.job.booked_s)
        return CardRun(self.arm, horizon, np.asarray(self.latencies), self.oom, float(sum(self.service)),
                       self.ledger, self.evictions, self.holds, self.timeouts, self.suspensions, self.busy,
                       time.perf_counter() - started)


def run_card(s: ColocationSettings, arm: str, load: OnlineLoad, seed: int) -> CardRun:
    return CardSim(s, arm, load, seed).run()


# ---------------------------------------------------------------------------------------------- figures
class ColocationFigures(Figures):
    idle_pct: float = figure("all", "card time online leaves idle (at full speed)", "%")
    exclusive_online_p99_ms: float = figure(EXCLUSIVE, "online p99 latency, online alone", "ms")
    exclusive_online_oom: int = figure(EXCLUSIVE, "online out-of-memory events, online alone")
    exclusive_card_busy_pct: float = figure(EXCLUSIVE, "card time some kernel ran", "%")
    shared_online_p99_ms: float = figure(SHARED, "online p99 latency", "ms")
    shared_p99_vs_exclusive_pct: float = figure(SHARED, "online p99 against exclusive", "%")
    shared_online_oom_added: int = figure(SHARED, "online out-of-memory events added to exclusive's")
    shared_offline_share_of_idle_pct: float = figure(SHARED, "useful offline work, share of the idle time", "%")
    shared_offline_lost_gpu_h: float = figure(SHARED, "offline work lost to evictions", "GPU-h")
    shared_holds: int = figure(SHARED, "offline starts held by admission")
    shared_card_busy_pct: float = figure(SHARED, "card time some kernel ran", "%")
    guard_online_p99_ms: float = figure(GUARD, "online p99 latency", "ms")
    guard_p99_vs_exclusive_pct: float = figure(GUARD, "online p99 against exclusive", "%")
    guard_online_oom_added: int = figure(GUARD, "online out-of-memory events added to exclusive's")
    guard_offline_share_of_idle_pct: float = figure(GUARD, "useful offline work, share of the idle time", "%")
    guard_offline_lost_gpu_h: float = figure(GUARD, "offline work lost to evictions", "GPU-h")
    guard_evictions: int = figure(GUARD, "memory evictions")
    guard_holds: int = figure(GUARD, "offline starts held by admission")
    guard_suspensions_per_hour: float = figure(GUARD, "suspensions (SIGSTOP) per card-hour")
    guard_card_busy_pct: float = figure(GUARD, "card time some kernel ran", "%")
    kernel_online_p99_ms: float = figure(KERNEL, "online p99 latency", "ms")
    kernel_p99_vs_exclusive_pct: float = figure(KERNEL, "online p99 against exclusive", "%")
    kernel_online_oom_added: int = figure(KERNEL, "online out-of-memory events added to exclusive's")
    kernel_offline_share_of_idle_pct: float = figure(KERNEL, "useful offline work, share of the idle time", "%")
    kernel_offline_lost_gpu_h: float = figure(KERNEL, "offline work lost to evictions", "GPU-h")
    kernel_evictions: int = figure(KERNEL, "memory evictions")
    kernel_holds: int = figure(KERNEL, "offline starts held by admission")
    kernel_card_busy_pct: float = figure(KERNEL, "card time some kernel ran", "%")
    busy_series: tuple[tuple[str, tuple[float, ...]], ...] = series("per arm: card busy % per bucket")
    latency_series: tuple[tuple[str, tuple[float, ...]], ...] = series("per arm: sorted latency sample (ms)")
    bucket_minutes: float = series("width of a busy bucket")


PREFIX = {SHARED: "shared", GUARD: "guard", KERNEL: "kernel"}


@dataclass(slots=True)
class ArmResult:
    runs: list[CardRun] = field(default_factory=list)

    def latencies_ms(self) -> FloatArray:
        return np.concatenate([r.latencies for r in self.runs]) * 1000.0

    def total(self, name: str) -> float:
        return float(sum(getattr(r, name) for r in self.runs))


def _p99(latencies_ms: FloatArray) -> float:
    return float(np.percentile(latencies_ms, 99)) if len(latencies_ms) else 0.0


def _sample(latencies_ms: FloatArray, points: int = 400) -> tuple[float, ...]:
    if len(latencies_ms) == 0:
        return ()
    return tuple(float(v) for v in np.percentile(latencies_ms, np.linspace(0.0, 100.0, points)))


def run_colocation(s: ColocationSettings, progress: Progress | None = None) -> ColocationFigures:
    """Every arm on the same cards: each card's online load and offline backlog come from its seed."""
    results = {arm: ArmResult() for arm in ARMS}
    total, done = s.cards * len(ARMS), 0
    for card in range(s.cards):
        seed = s.seed * 1_000_003 + card
        load = online_load(s, np.random.default_rng([seed, 0]))
        for arm, result in results.items():
            result.runs.append(run_card(s, arm, load, seed))
            done += 1
            if progress is not None:
                progress("arm x card", done, total)
    return figures_of(s, results)


def figures_of(s: ColocationSettings, results: dict[str, ArmResult]) -> ColocationFigures:
    horizon = s.hours * 3600.0 * s.cards
    base = results[EXCLUSIVE]
    base_lat = base.latencies_ms()
    base_p99 = _p99(base_lat)
    online_work = base.total("online_work_s")
    idle = max(horizon - online_work, 1e-9)
    values: dict[str, object] = {
        "idle_pct": round(idle * 100.0 / horizon, 3),
        "exclusive_online_p99_ms": round(base_p99, 3),
        "exclusive_online_oom": int(base.total("oom")),
        "exclusive_card_busy_pct": round(float(sum(r.busy.sum() for r in base.runs)) * 100.0 / horizon, 3)}
    for arm in SHARING:
        result, key = results[arm], PREFIX[arm]
        lat = result.latencies_ms()
        useful = sum(r.ledger.useful_gpu_s for r in result.runs)
        lost = sum(r.ledger.lost_gpu_h() for r in result.runs)
        values |= {
            f"{key}_online_p99_ms": round(_p99(lat), 3),
            f"{key}_p99_vs_exclusive_pct": round((_p99(lat) - base_p99) * 100.0 / base_p99, 3) if base_p99 else 0.0,
            f"{key}_online_oom_added": int(result.total("oom") - base.total("oom")),
            f"{key}_offline_share_of_idle_pct": round(useful * 100.0 / idle, 3),
            f"{key}_offline_lost_gpu_h": round(lost, 4),
            f"{key}_card_busy_pct": round(float(sum(r.busy.sum() for r in result.runs)) * 100.0 / horizon, 3)}
        if arm != SHARED:
            values[f"{key}_evictions"] = int(result.total("evictions"))
        values[f"{key}_holds"] = int(result.total("holds"))
    values["guard_suspensions_per_hour"] = round(results[GUARD].total("suspensions") / (horizon / 3600.0), 1)
    bucket = s.bucket_minutes * 60.0
    values["busy_series"] = tuple(
        (arm, tuple(float(v) for v in np.sum([r.busy for r in results[arm].runs], axis=0)
                    * 100.0 / (bucket * s.cards)))
        for arm in ARMS)
    values["latency_series"] = tuple((arm, _sample(results[arm].latencies_ms())) for arm in ARMS)
    values["bucket_minutes"] = s.bucket_minutes
    return ColocationFigures.model_validate(values)


ROWS: tuple[tuple[str, str], ...] = (
    ("online p99 latency (ms)", "online_p99_ms"),
    ("  against exclusive (%)", "p99_vs_exclusive_pct"),
    ("online OOM events added", "online_oom_added"),
    ("useful offline work, % of idle time", "offline_share_of_idle_pct"),
    ("offline work lost (GPU-h)", "offline_lost_gpu_h"),
    ("memory evictions", "evictions"),
    ("offline starts held by admission", "holds"),
    ("card time some kernel ran (%)", "card_busy_pct"),
)


class ColocationScenario:
    name = "colocation"
    title = "Co-location: online first, offline in the gaps"
    settings = ColocationSettings
    figures = ColocationFigures
    ours = GUARD
    arms = ARMS
    goals = (
        Goal("online p99 within 5 % of exclusive", "guard_p99_vs_exclusive_pct", "<=", 5.0),
        Goal("offline uses at least 60 % of the idle time", "guard_offline_share_of_idle_pct", ">=", 60.0),
        Goal("no online OOM that exclusive does not have", "guard_online_oom_added", "<=", 0.0),
    )
    headlines = (
        Headline("guard_offline_share_of_idle_pct", "the guard reads the cards every 20 ms (GuardOptions.poll_s)",
                 "poll_s", 0.2, "down"),
        Headline("guard_offline_share_of_idle_pct", "offline resumes at the first pass that reads online idle "
                 "(GuardOptions.min_slice_s = 0)", "min_slice_s", 1.0, "down"),
        Headline("guard_p99_vs_exclusive_pct", "offline kernels already queued drain within 10 ms of SIGSTOP",
                 "offline_drain_ms", 100.0, "up"),
        Headline("kernel_offline_share_of_idle_pct", "a launch gate resumes offline after 5 ms of online idle",
                 "kernel_gate_slice_ms", 50.0, "down"),
        Headline("guard_evictions", "an 80 GiB card leaves room for online's peaks beside two offline jobs",
                 "card_memory_gib", 50.0, "up"),
    )
    quick: ClassVar[Mapping[str, object]] = {"hours": 0.25, "start_hour": 20.75}

    def run(self, settings: ColocationSettings, progress: Progress) -> ColocationFigures:
        return run_colocation(settings, progress)

    def tables(self, figures: ColocationFigures) -> Sequence[Table]:
        rows = []
        for label, name in ROWS:
            cells = []
            for arm in SHARING:
                value = getattr(figures, f"{PREFIX[arm]}_{name}", None)
                cells.append("–" if value is None else f"{value:g}")
            rows.append((label, *cells))
        base = (("exclusive online p99 (ms)", f"{figures.exclusive_online_p99_ms:g}", "", ""),
                ("exclusive online OOM events", str(figures.exclusive_online_oom), "", ""),
                ("idle card time (%)", f"{figures.idle_pct:g}", "", ""))
        return (Table("Arms against exclusive", SHARING, tuple(rows)),
                Table("Exclusive (the reference)", ("value", "", ""), base))

    def summary(self, figures: ColocationFigures) -> str:
        return (f"guard: online p99 {figures.guard_p99_vs_exclusive_pct:+.2f} % against exclusive, offline uses "
                f"{figures.guard_offline_share_of_idle_pct:.1f} % of the idle time, "
                f"{figures.guard_online_oom_added} online OOM added; kernel gate: "
                f"{figures.kernel_p99_vs_exclusive_pct:+.2f} %, {figures.kernel_offline_share_of_idle_pct:.1f} %")


SCENARIO = ColocationScenario()
