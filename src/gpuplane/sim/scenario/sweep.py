"""Seed sweeps: one scenario run per seed, each figure summarised as its median and spread."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Generic

import numpy as np
from pydantic import BaseModel, ValidationError

from gpuplane.model import GpuplaneError
from gpuplane.sim.scenario.kit import F, Figures, Goal, Progress, S, Scenario, no_progress, numeric_figures

MIN_HEADLINE_SEEDS = 10
"""A headline is a median over at least this many seeds."""


class SeedsError(GpuplaneError):
    pass


def parse_seeds(text: str) -> tuple[int, ...]:
    """"1-10", "3", "1,4,9" or "1-5,20" → the seeds, in order, each once."""
    seeds: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise SeedsError(f"--seeds {text!r}: write a seed, a range like 1-10, or a comma list")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise SeedsError(f"--seeds {text!r}: range {part} runs backwards")
        seeds.extend(s for s in range(low, high + 1) if s not in seeds)
    return tuple(seeds)


@dataclass(frozen=True, slots=True)
class Spread:
    """One figure over the seeds: median, quartiles and range."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    seeds: int

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        data = np.asarray(values, dtype=np.float64)
        q1, q3 = np.percentile(data, [25.0, 75.0])
        return Spread(float(statistics.median(values)), float(q1), float(q3), float(data.min()),
                      float(data.max()), len(values))

    def show(self, digits: int = 2) -> str:
        if self.seeds == 1 or self.low == self.high:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}–{self.high:.{digits}f}]"


@dataclass(frozen=True, slots=True)
class GoalResult:
    goal: Goal
    value: float
    met: bool


@dataclass(frozen=True, slots=True)
class Sweep(Generic[S, F]):
    """Every seed's figures, and each numeric figure's spread."""

    scenario: str
    settings: S
    seeds: tuple[int, ...]
    runs: tuple[F, ...]
    spreads: dict[str, Spread]
    goals: tuple[GoalResult, ...]

    @property
    def headline_ready(self) -> bool:
        return len(self.seeds) >= MIN_HEADLINE_SEEDS

    @property
    def goals_met(self) -> bool:
        return all(g.met for g in self.goals)

    def median_run(self, figure: str) -> F:
        """The run whose `figure` is the median's (the lower middle for an even count), for tables and plots."""
        ranked = sorted(range(len(self.runs)), key=lambda i: float(getattr(self.runs[i], figure)))
        return self.runs[ranked[(len(ranked) - 1) // 2]]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: a figure a run did not measure (NaN, e.g. an ablation arm not run) is null."""
        data: dict[str, Any] = _no_nan({"scenario": self.scenario, "seeds": list(self.seeds),
                "settings": self.settings.model_dump(mode="json"),
                "figures": {name: {"median": s.median, "q1": s.q1, "q3": s.q3, "min": s.low, "max": s.high}
                            for name, s in self.spreads.items()},
                "goals": [{"name": g.goal.name, "figure": g.goal.figure, "op": g.goal.op, "target": g.goal.target,
                           "median": g.value, "met": g.met} for g in self.goals],
                "goals_met": self.goals_met,
                "runs": [{"seed": seed} | run.model_dump(mode="json")
                         for seed, run in zip(self.seeds, self.runs, strict=True)]})
        return data


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def summarise(scenario: Scenario[S, F], settings: S, seeds: Sequence[int], runs: Sequence[F]) -> Sweep[S, F]:
    names = numeric_figures(scenario.figures)
    spreads = {name: Spread.of([float(getattr(run, name)) for run in runs]) for name in names}
    goals = tuple(GoalResult(goal, spreads[goal.figure].median, goal.met(spreads[goal.figure].median))
                  for goal in scenario.goals)
    return Sweep(scenario.name, settings, tuple(seeds), tuple(runs), spreads, goals)


def with_overrides(settings: S, overrides: dict[str, Any]) -> S:
    """`settings` with fields changed, validated again (a bad value is an error naming the field)."""
    try:
        return type(settings).model_validate(settings.model_dump() | overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise SeedsError(f"scenario field {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def run_seeds(scenario: Scenario[S, F], settings: S, seeds: Sequence[int],
              progress: Progress = no_progress, *, jobs: int = 1) -> Sweep[S, F]:
    """Run `scenario` once per seed (the settings' own seed is replaced) and summarise. With `jobs` > 1 the
    seeds run in that many worker processes (a run is a pure function of its settings, so the figures are the
    same); progress then counts seeds only."""
    if not seeds:
        raise SeedsError("a sweep needs at least one seed")
    if jobs < 1:
        raise SeedsError(f"--jobs must be at least 1, got {jobs}")
    each = [with_overrides(settings, {"seed": seed}) for seed in seeds]
    runs: list[F] = []
    if jobs == 1 or len(seeds) == 1:
        for done, one in enumerate(each):
            progress("seeds", done, len(seeds))
            runs.append(scenario.run(one, progress))
    else:
        progress("seeds", 0, len(seeds))
        with ProcessPoolExecutor(max_workers=min(jobs, len(seeds))) as pool:
            futures = [pool.submit(scenario.run, one, no_progress) for one in each]
            for done, _ in enumerate(as_completed(futures), start=1):
                progress("seeds", done, len(seeds))
            runs = [f.result() for f in futures]
    progress("seeds", len(seeds), len(seeds))
    return summarise(scenario, settings, seeds, runs)


def figures_of(model: type[Figures], values: BaseModel) -> dict[str, float]:
    return {name: float(getattr(values, name)) for name in numeric_figures(model)}
