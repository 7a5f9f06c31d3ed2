"""One checkpointing-job actor and one lost-work ledger for every scenario.

The save model, explicitly:

- a running job alternates `every_s` of work with a save of `save_s`, during which it makes no progress
  (a synchronous checkpoint: its cost is time); a save commits the progress made up to its start, and
  only when it completes;
- a lead save (`save_now`, e.g. ahead of a planned reclaim) starts a save at once and restarts the cycle;
- an eviction signalled at t with grace g: a save already in flight is kept if it completes by t + g;
  then, if the job saves on the signal, a new save starts (at t, or when the one in flight ends) and is
  kept if it completes by t + g. Everything since the last kept save is lost;
- the job's process exits when its last save ends, or at once if it makes none; the kubelet kills it at
  t + g otherwise. `StopOutcome.exit_s` says when.

Times are arguments, so the actor runs under any clock; it holds no timers of its own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

MIN_SAVE_INTERVAL_S = 1.0
"""A periodic save interval is 0 (never) or at least this: shorter is not a checkpoint but a stall."""


class SaveModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    every_s: float = Field(default=1800.0, ge=0.0, description="work between periodic saves; 0: never saves")
    save_s: float = Field(default=60.0, ge=0.0, description="how long one save takes")
    on_signal: bool = Field(default=True, description="the job starts a save when it is told to stop (SIGTERM)")

    @field_validator("every_s")
    @classmethod
    def _an_interval(cls, value: float) -> float:
        if 0 < value < MIN_SAVE_INTERVAL_S:
            raise ValueError(f"saves every {value} s: 0 (never) or at least {MIN_SAVE_INTERVAL_S:g} s")
        return value


@dataclass(frozen=True, slots=True)
class StopOutcome:
    done_s: float
    """work done when the signal came"""
    saved_s: float
    """work kept: it resumes from here"""
    lost_s: float
    exit_s: float
    """when the process is gone (the kubelet's SIGKILL at the latest)"""


@dataclass(frozen=True, slots=True)
class _State:
    done: float
    committed: float
    in_flight: tuple[float, float] | None
    """(end time, value) of a save under way"""


class CheckpointingJob:
    """A job of `work_s` seconds of work on `gpus` GPUs that saves its progress by `save`."""

    def __init__(self, name: str, work_s: float, gpus: float, save: SaveModel) -> None:
        if work_s <= 0:
            raise ValueError(f"job {name}: work_s must be positive, got {work_s}")
        self.name = name
        self.work_s = work_s
        self.gpus = gpus
        self.save = save
        self._anchor: float | None = None
        """when the current work cycle began (None: not running)"""
        self._anchor_done = 0.0
        self._committed = 0.0
        self._lead: tuple[float, float] | None = None
        self.starts = 0
        self.booked_s = 0.0
        """work already booked as useful in a `WorkLedger`"""

    @property
    def running(self) -> bool:
        return self._anchor is not None

    @property
    def saved_s(self) -> float:
        """Work kept as of the last completed save (valid while stopped; use `state(now)` while running)."""
        return self._committed

    def start(self, now: float) -> None:
        """(Re)start from the last kept save."""
        if self._anchor is not None:
            raise RuntimeError(f"job {self.name} is already running")
        self._anchor, self._anchor_done, self._lead = now, self._committed, None
        self.starts += 1

    def _state(self, now: float) -> _State:
        if self._anchor is None:
            return _State(self._committed, self._committed, None)
        t0, done, committed = self._anchor, self._anchor_done, self._committed
        if self._lead is not None:
            end, value = self._lead
            if now < end:
                return _State(done, committed, self._lead)
            committed, t0 = max(committed, value), end
        every, save = self.save.every_s, self.save.save_s
        elapsed = max(0.0, now - t0)
        if every <= 0:
            return _State(min(self.work_s, done + elapsed), committed, None)
        cycle = every + save
        n = math.floor(elapsed / cycle) if cycle > 0 else 0
        rest = elapsed - n * cycle
        if n > 0:
            committed = max(committed, done + n * every)
        in_flight = (t0 + (n + 1) * cycle, done + (n + 1) * every) if rest > every else None
        return _State(min(self.work_s, done + n * every + min(rest, every)), min(committed, self.work_s), in_flight)

    def done_s(self, now: float) -> float:
        """Work done by `now`, kept or not."""
        return self._state(now).done

    def kept_s(self, now: float) -> float:
        """Work kept by the saves completed by `now`."""
        return self._state(now).committed

    def save_now(self, now: float) -> None:
        """Start a save at once (a lead checkpoint); a save in flight is abandoned for it."""
        if self._anchor is None:
            return
        state = self._state(now)
        self._anchor, self._anchor_done, self._committed = now, state.done, state.committed
        self._lead = (now + self.save.save_s, state.done)

    def finish_time(self, now: float) -> float:
        """When the job completes its work if nothing stops it (math.inf when not running)."""
        if self._anchor is None:
            return math.inf
        t0, done = self._anchor, self._anchor_done
        if self._lead is not None:
            t0 = max(t0, self._lead[0])
        left = self.work_s - done
        every = self.save.every_s
        if every <= 0 or left <= every:
            return t0 + left
        full = math.ceil(left / every) - 1
        return t0 + full * (every + self.save.save_s) + (left - full * every)

    def complete(self, now: float) -> float:
        """The job finished its work at `now`; the work it did this run (all of it is useful)."""
        state = self._state(now)
        ran = self.work_s - self._anchor_done
        self._anchor, self._committed, self._anchor_done, self._lead = None, self.work_s, self.work_s, None
        if state.done < self.work_s - 1e-6:
            raise RuntimeError(f"job {self.name} completed at {now} with {self.work_s - state.done:.3f} s left")
        return ran

    def stop(self, now: float, grace_s: float) -> StopOutcome:
        """Told to stop at `now` with `grace_s` before the kill: what is kept, what is lost, when it exits."""
        if self._anchor is None:
            return StopOutcome(self._committed, self._committed, 0.0, now)
        state = self._state(now)
        deadline = now + max(0.0, grace_s)
        committed, free_at = state.committed, now
        if state.in_flight is not None and state.in_flight[0] <= deadline:
            committed, free_at = max(committed, state.in_flight[1]), state.in_flight[0]
        exit_s = free_at
        if self.save.on_signal and state.done > committed:
            if free_at + self.save.save_s <= deadline:
                committed, exit_s = state.done, free_at + self.save.save_s
            else:
                exit_s = deadline
        self._anchor, self._committed, self._anchor_done, self._lead = None, committed, committed, None
        return StopOutcome(state.done, committed, state.done - committed, exit_s)

    def crash(self, now: float) -> StopOutcome:
        """The job died at `now` (a fault): nothing more is saved."""
        if self._anchor is None:
            return StopOutcome(self._committed, self._committed, 0.0, now)
        state = self._state(now)
        self._anchor, self._committed, self._anchor_done, self._lead = None, state.committed, state.committed, None
        return StopOutcome(state.done, state.committed, state.done - state.committed, now)


@dataclass(slots=True)
class WorkLedger:
    """GPU-seconds of work: useful (kept by a save, or completed) and lost, by cause. Work enters once: as
    useful when a save keeps it or the job completes, or as lost to the cause that stopped the job."""

    useful_gpu_s: float = 0.0
    lost_gpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def stopped(self, job: CheckpointingJob, outcome: StopOutcome, cause: str) -> None:
        """Book a stop (eviction or crash): newly kept work is useful, the rest is lost to `cause`."""
        self.useful_gpu_s += max(0.0, outcome.saved_s - job.booked_s) * job.gpus
        job.booked_s = max(job.booked_s, outcome.saved_s)
        if outcome.lost_s > 0:
            self.lost_gpu_s[cause] += outcome.lost_s * job.gpus

    def completed(self, job: CheckpointingJob) -> None:
        self.useful_gpu_s += max(0.0, job.work_s - job.booked_s) * job.gpus
        job.booked_s = job.work_s

    def lost_gpu_h(self, cause: str | None = None) -> float:
        if cause is None:
            return sum(self.lost_gpu_s.values()) / 3600.0
        return self.lost_gpu_s.get(cause, 0.0) / 3600.0

    @property
    def useful_gpu_h(self) -> float:
        return self.useful_gpu_s / 3600.0
