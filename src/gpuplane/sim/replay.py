"""Trace replays on the simulated cluster: `fill` (the FGD paper's protocol) and `timed`.

Both drive the real scheduler through the cluster port; nothing here places pods itself.

- fill: shuffle with the seed, tune the workload to 130 % of cluster GPU capacity by resampling with
  replacement, submit one pod at a time, no departures, no retries. Records allocation against arrived
  workload after every pod.
- timed: pods arrive over virtual time (Poisson at a rate set for a target load, or the trace's own
  creation times) and leave after their trace lifetime; unschedulable pods wait in the queue and are
  retried when capacity frees. Records allocation, card occupancy and utilisation over time, and waits.
"""

from __future__ import annotations

import enum
import functools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from gpuplane.model import MILLI_PER_CARD, Catalog, GpuplaneError, NodeSpec, PodRequest, PoolConfig, QoS
from gpuplane.scheduler import Decision, Outcome, Profile, Scheduler
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop
from gpuplane.sim.trace import TracePod

Progress = Callable[[int, int], None]
"""Called as progress(done, total) while a replay runs."""


class ReplayMode(enum.Enum):
    FILL = "fill"
    TIMED = "timed"


@dataclass(frozen=True, slots=True)
class Placement:
    """One decision, as written to the placements CSV."""

    seq: int
    request: PodRequest
    node: str
    cards: tuple[int, ...]
    outcome: str


@dataclass(slots=True)
class TimeSeries:
    time_s: list[float] = field(default_factory=list)
    allocation_pct: list[float] = field(default_factory=list)
    occupied_cards_pct: list[float] = field(default_factory=list)
    utilisation_pct: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SimulationResult:
    mode: ReplayMode
    trace: str
    profile: str
    seed: int
    nodes: int
    total_gpus: int
    submitted: int = 0
    placed: int = 0
    failed_by_reason: Counter[str] = field(default_factory=Counter)
    decisions: int = 0
    wall_s: float = 0.0
    arrived_pct: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    allocation_pct: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(0))
    card_used_milli_at_50: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    card_used_milli_at_100: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """Used milli of every card when the arrived workload first reached 50 % and 100 % (fill), or at the
    moment of peak allocation (timed, both)."""
    card_used_milli_at_end: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    placements: list[Placement] = field(default_factory=list)
    why: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """Per-node reasons for the pods asked about with `why=`: pod → [(node, reason or "feasible")]."""
    why_message: dict[str, str] = field(default_factory=dict)
    series: TimeSeries | None = None
    waits_s: list[float] = field(default_factory=list)
    never_placed: int = 0
    oversubscribed: int = 0
    """Placements that promise card memory beyond its physical size (oversold pools)."""
    window_s: tuple[float, float] = (0.0, 0.0)
    """Timed replays: the measurement window (after warm-up, up to the last arrival)."""

    @property
    def failed(self) -> int:
        return sum(self.failed_by_reason.values())

    @property
    def decisions_per_s(self) -> float:
        return self.decisions / self.wall_s if self.wall_s > 0 else 0.0

    def allocation_at(self, arrived: float) -> float:
        """Allocation % after the last pod whose arrival kept the arrived workload ≤ `arrived` %."""
        if not len(self.arrived_pct):
            return 0.0
        index = int(np.searchsorted(self.arrived_pct, arrived + 1e-9, side="right")) - 1
        return float(self.allocation_pct[index]) if index >= 0 else 0.0

    def unallocated_at(self, arrived: float) -> float:
        return 100.0 - self.allocation_at(arrived)

    def window_mean(self, values: Sequence[float]) -> float:
        """Mean of a timed series over the measurement window (all samples if the window is empty)."""
        if self.series is None:
            return 0.0
        return window_mean(self.series.time_s, values, self.window_s)


def window_mean(times: Sequence[float], values: Sequence[float], window: tuple[float, float],
                mask: Sequence[bool] | None = None) -> float:
    """Mean of the samples taken within `window` (every sample if none falls in it) and, if given, `mask`;
    0 when nothing is left."""
    if not len(values):
        return 0.0
    at = np.asarray(times)
    inside = (at >= window[0]) & (at <= window[1])
    if not inside.any():
        inside = np.ones(len(at), np.bool_)
    if mask is not None:
        inside &= np.asarray(mask, np.bool_)
    chosen = np.asarray(values, np.float64)[inside]
    return float(chosen.mean()) if len(chosen) else 0.0


def tune_workload(pods: Sequence[PodRequest], capacity_milli: int, seed: int, target: float = 1.3) -> list[PodRequest]:
    """The FGD protocol: shuffle, then resample with replacement up to `target` × capacity (or trim down).

    Raises GpuplaneError for an empty list or one without any GPU demand (nothing to tune towards).
    """
    if not pods:
        raise GpuplaneError("the workload is empty: nothing to replay")
    if not any(p.gpu_milli_total for p in pods):
        raise GpuplaneError("no pod asks for GPU: a fill replay tunes GPU demand and has nothing to tune")
    if target <= 0 or capacity_milli <= 0:
        raise GpuplaneError(f"tune target and capacity must be positive (got {target}, {capacity_milli})")
    rng = np.random.default_rng(seed)
    order = [pods[i] for i in rng.permutation(len(pods))]
    goal = target * capacity_milli
    total = sum(p.gpu_milli_total for p in order)
    if total <= goal:
        index = 0
        while True:
            source = pods[int(rng.integers(len(pods)))]
            if total + source.gpu_milli_total > goal:
                break
            order.append(replace(source, name=f"{source.name}-tuned-{index}"))
            total += source.gpu_milli_total
            index += 1
    else:
        while total > goal and order:
            victim = order.pop(int(rng.integers(len(order))))
            total -= victim.gpu_milli_total
    return order


def _outcome_text(decision: Decision) -> str:
    if decision.status.ok:
        return "placed"
    if decision.diagnosis is not None:
        return decision.diagnosis.dominant()
    return decision.status.message or decision.status.code.value


def _explain(result: SimulationResult, scheduler: Scheduler, request: PodRequest, decision: Decision) -> None:
    """Keep the per-node reasons (or the chosen node) of a decision someone asked about with `why=`."""
    if decision.diagnosis is None:
        node = decision.assignment.node if decision.assignment else "?"
        result.why[request.name] = [(node, "chosen")]
        result.why_message[request.name] = f"placed on {node}"
        return
    names = [spec.name for spec in scheduler.state.nodes]
    result.why[request.name] = [(names[i], decision.diagnosis.node_reason(i) or "feasible") for i in range(len(names))]
    result.why_message[request.name] = decision.status.message


def _placement(seq: int, request: PodRequest, decision: Decision) -> Placement:
    assignment = decision.assignment
    return Placement(seq, request, assignment.node if assignment else "", assignment.card_indexes if assignment else (),
                     "placed" if decision.status.ok else decision.status.message)


def run_fill(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest], profile: Profile, *,
             seed: int = 42, trace: str = "", tune: float = 1.3, record_placements: bool = False,
             why: Sequence[str] = (), pools: dict[str, PoolConfig] | None = None,
             progress: Progress | None = None) -> SimulationResult:
    """Replay `pods` in fill mode. Deterministic for a given seed."""
    seen: set[str] = set()
    for request in pods:
        if request.name in seen:
            raise GpuplaneError(f"pod name {request.name!r} appears twice in the workload")
        seen.add(request.name)
    cluster = SimCluster(catalog, nodes, pools=pools)
    scheduler = Scheduler(cluster, catalog, profile, seed=seed, pools=pools)
    capacity = cluster.state.total_gpu_milli()
    workload = tune_workload(pods, capacity, seed, tune)
    result = SimulationResult(ReplayMode.FILL, trace, profile.name, seed, cluster.state.size,
                              capacity // MILLI_PER_CARD)
    arrived = np.zeros(len(workload), np.float64)
    allocated = np.zeros(len(workload), np.float64)
    wanted = set(why)
    arrived_milli = 0
    used_milli = 0
    snapshots = {50.0: False, 100.0: False}
    total = len(workload)
    started = time.perf_counter()
    for seq, request in enumerate(workload):
        cluster.create_pod(request)
        outcomes = scheduler.run_pending(on_outcome=_drop_failed)
        decision = outcomes[-1].decision
        arrived_milli += request.gpu_milli_total
        if decision.status.ok and decision.assignment is not None:
            used_milli += decision.assignment.gpu_milli
            result.placed += 1
            result.oversubscribed += decision.assignment.oversubscribed
        else:
            result.failed_by_reason[_outcome_text(decision)] += 1
            cluster.delete_pod(request.name)
        arrived[seq] = arrived_milli * 100.0 / capacity
        allocated[seq] = used_milli * 100.0 / capacity
        for mark, taken in snapshots.items():
            if not taken and arrived[seq] >= mark:
                used_cards = cluster.state.card_used_milli()
                if mark == 50.0:
                    result.card_used_milli_at_50 = used_cards
                else:
                    result.card_used_milli_at_100 = used_cards
                snapshots[mark] = True
        if record_placements:
            result.placements.append(_placement(seq, request, decision))
        if request.name in wanted:
            _explain(result, scheduler, request, decision)
        if progress is not None and (seq % 512 == 0 or seq == total - 1):
            progress(seq + 1, total)
    result.wall_s = time.perf_counter() - started
    result.decisions = total
    result.submitted = total
    result.arrived_pct = arrived
    result.allocation_pct = allocated
    result.card_used_milli_at_end = cluster.state.card_used_milli()
    if not snapshots[50.0]:
        result.card_used_milli_at_50 = result.card_used_milli_at_end
    if not snapshots[100.0]:
        result.card_used_milli_at_100 = result.card_used_milli_at_end
    return result


def _drop_failed(outcome: Outcome) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class TimedConfig:
    """Parameters of a timed replay."""

    arrival: str = "poisson"
    """`poisson`: exponential gaps at a rate set for `load`; `trace`: the trace's own creation times."""
    load: float = 0.9
    """Target offered GPU load, as a share of cluster GPU capacity (Little's law on mean lifetimes)."""
    hours: float = 8.0
    """Arrival horizon (poisson): pods arrive for this long, the trace in shuffled order and then drawn
    again with replacement. The trace alone spans about one mean lifetime at 90 % load, too short to
    reach a steady state."""
    min_duration_s: float = 60.0
    max_duration_s: float = 7200.0
    warmup_hours: float = 2.0
    """Left out of the summary figures while the cluster fills up (about the longest lifetime)."""
    sample_every_s: float = 300.0
    utilisation: tuple[tuple[QoS, float, float], ...] = (
        (QoS.ONLINE, 0.2, 0.6), (QoS.OFFLINE, 0.6, 0.95), (QoS.BEST_EFFORT, 0.3, 0.9))
    """Modelling assumption (the trace has no utilisation): each pod busies this share of its GPU
    allocation, drawn uniformly per pod from its QoS class's range."""

    def __post_init__(self) -> None:
        if self.arrival not in ("poisson", "trace"):
            raise ValueError(f"arrival: choose poisson or trace, got {self.arrival!r}")
        if not 0 < self.load <= 10:
            raise ValueError(f"load: must be within (0, 10], got {self.load}")
        if self.hours <= 0:
            raise ValueError(f"hours: must be positive, got {self.hours}")
        if not 0 <= self.warmup_hours < self.hours:
            raise ValueError(f"warmup_hours: must be within [0, hours), got {self.warmup_hours}")
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError("min_duration_s must be positive and at most max_duration_s")
        if self.sample_every_s <= 0:
            raise ValueError("sample_every_s must be positive")


def run_timed(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[TracePod], profile: Profile, *,
              seed: int = 42, trace: str = "", config: TimedConfig | None = None,
              record_placements: bool = False, why: Sequence[str] = (),
              pools: dict[str, PoolConfig] | None = None, progress: Progress | None = None) -> SimulationResult:
    """Replay `pods` arriving over virtual time; pods leave after their (clipped) trace lifetime."""
    config = config or TimedConfig()
    rng = np.random.default_rng(seed)
    loop = EventLoop()
    cluster = SimCluster(catalog, nodes, loop=loop, pools=pools)
    scheduler = Scheduler(cluster, catalog, profile, seed=seed, pools=pools, now=loop.now)
    capacity = cluster.state.total_gpu_milli()
    result = SimulationResult(ReplayMode.TIMED, trace, profile.name, seed, cluster.state.size,
                              capacity // MILLI_PER_CARD)
    def clipped(group: Sequence[TracePod]) -> npt.NDArray[np.float64]:
        lifetimes = np.array([p.lifetime if p.lifetime is not None else np.nan for p in group], np.float64)
        median = float(np.nanmedian(lifetimes)) if np.isfinite(lifetimes).any() else 600.0
        return np.clip(np.where(np.isfinite(lifetimes), lifetimes, median), config.min_duration_s,
                       config.max_duration_s)

    if config.arrival == "poisson":
        work = np.array([p.request.gpu_milli_total for p in pods], np.float64) * clipped(pods)
        mean_work = float(work.mean())
        rate = config.load * capacity / mean_work if mean_work > 0 else 1.0
        horizon = config.hours * 3600.0
        count = max(1, int(rate * horizon * 1.2) + 16)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
        arrivals = arrivals[arrivals <= horizon]
        order = [pods[i] for i in rng.permutation(len(pods))][: len(arrivals)]
        for k in range(len(arrivals) - len(order)):
            source = pods[int(rng.integers(len(pods)))]
            order.append(replace(source, request=replace(source.request, name=f"{source.request.name}-r{k}")))
        window = (config.warmup_hours * 3600.0, horizon)
    else:
        order = sorted(pods, key=lambda p: (p.creation_time or 0.0, p.line))
        origin = min((p.creation_time or 0.0) for p in order)
        arrivals = np.array([(p.creation_time or origin) - origin for p in order], np.float64)
        window = (0.0, float(arrivals[-1]) if len(arrivals) else 0.0)
    durations = clipped(order)
    ranges = {qos: (lo, hi) for qos, lo, hi in config.utilisation}
    busy_share = np.array([rng.uniform(*ranges.get(p.request.qos, (0.5, 0.5))) for p in order])
    index_of = {p.request.name: i for i, p in enumerate(order)}
    series = TimeSeries()
    busy_milli = 0.0
    wanted = set(why)
    seq = 0
    total = len(order)
    done = 0

    def record(outcome: Outcome) -> bool:
        nonlocal seq, busy_milli
        decision = outcome.decision
        request = outcome.request
        result.decisions += 1
        if request.name in wanted:
            _explain(result, scheduler, request, decision)
        if decision.status.ok and decision.assignment is not None:
            i = index_of[request.name]
            result.placed += 1
            result.oversubscribed += decision.assignment.oversubscribed
            result.waits_s.append(outcome.waited)
            busy_milli += decision.assignment.gpu_milli * busy_share[i]
            loop.call_later(float(durations[i]), functools.partial(depart, request.name, i))
        if record_placements and (decision.status.ok or outcome.attempt == 1):
            result.placements.append(_placement(seq, request, decision))
            seq += 1
        return True

    def depart(name: str, i: int) -> None:
        nonlocal busy_milli, done
        binding = cluster.state.bindings.get(name)
        if binding is not None:
            busy_milli -= binding.assignment.gpu_milli * busy_share[i]
        cluster.delete_pod(name)
        done += 1
        scheduler.run_pending(record)

    def arrive(i: int) -> None:
        cluster.create_pod(order[i].request)
        result.submitted += 1
        scheduler.run_pending(record)
        if progress is not None and (i % 256 == 0 or i == total - 1):
            progress(i + 1, total)

    def sample() -> None:
        state = cluster.state
        n = state.size
        series.time_s.append(loop.now())
        allocation = state.used_gpu_milli() * 100.0 / capacity
        if not series.allocation_pct or allocation > max(series.allocation_pct):
            # The busiest moment stands in for both fill snapshots.
            result.card_used_milli_at_100 = result.card_used_milli_at_50 = state.card_used_milli()
        series.allocation_pct.append(allocation)
        occupied = ((state.card_holders[:n] > 0) | state.card_mig[:n]) & state.card_valid[:n]
        series.occupied_cards_pct.append(float(occupied.sum()) * 100.0 / max(1, int(state.card_valid[:n].sum())))
        series.utilisation_pct.append(busy_milli * 100.0 / capacity)
        series.pending.append(len(scheduler.queue))
        if len(loop) > 0:
            loop.call_later(config.sample_every_s, sample)

    for i, at in enumerate(arrivals):
        loop.call_at(float(at), functools.partial(arrive, i))
    loop.call_at(0.0, sample)
    started = time.perf_counter()
    loop.run()
    result.wall_s = time.perf_counter() - started
    result.never_placed = len(scheduler.queue)
    if result.never_placed:
        result.failed_by_reason["still pending at the end"] += result.never_placed
    result.series = series
    result.window_s = window
    result.card_used_milli_at_end = cluster.state.card_used_milli()
    if not len(result.card_used_milli_at_100):
        result.card_used_milli_at_100 = result.card_used_milli_at_50 = result.card_used_milli_at_end
    return result
