"""Seeds in worker processes: the same figures as one process, in seed order, and a bad --jobs refused."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import pytest

from gpuplane.sim.scenario import Figures, Progress, ScenarioSettings, Table, figure, run_seeds
from gpuplane.sim.scenario.sweep import SeedsError


class _Settings(ScenarioSettings):
    draws: int = 1000


class _Figures(Figures):
    mean: float = figure("ours", "the mean of the seed's draws")
    pid: float = figure("ours", "the process that ran it")


class _Draws:
    name = "draws"
    title = "draws"
    settings = _Settings
    figures = _Figures
    ours = "ours"
    arms = ("ours",)
    goals = ()
    headlines = ()
    quick: Mapping[str, object] = MappingProxyType({})

    def run(self, settings: _Settings, progress: Progress) -> _Figures:
        rng = np.random.default_rng(settings.seed)
        return _Figures(mean=float(rng.normal(size=settings.draws).mean()), pid=float(os.getpid()))

    def tables(self, figures: _Figures) -> Sequence[Table]:
        return ()

    def summary(self, figures: _Figures) -> str:
        return ""


def test_worker_processes_give_the_same_figures_in_seed_order() -> None:
    seeds = (5, 1, 9, 3)
    alone = run_seeds(_Draws(), _Settings(), seeds)
    pooled = run_seeds(_Draws(), _Settings(), seeds, jobs=2)
    assert [r.mean for r in pooled.runs] == [r.mean for r in alone.runs]
    assert pooled.spreads["mean"] == alone.spreads["mean"]
    assert {r.pid for r in alone.runs} == {float(os.getpid())}
    assert float(os.getpid()) not in {r.pid for r in pooled.runs}  # they really ran elsewhere


def test_progress_counts_the_seeds_as_they_finish() -> None:
    seen: list[tuple[str, int, int]] = []
    run_seeds(_Draws(), _Settings(), (1, 2, 3), lambda label, done, total: seen.append((label, done, total)),
              jobs=2)
    assert seen[0] == ("seeds", 0, 3) and seen[-1] == ("seeds", 3, 3)
    assert sorted({done for _, done, _ in seen}) == [0, 1, 2, 3]


@pytest.mark.parametrize("jobs", [0, -2])
def test_jobs_below_one_are_refused(jobs: int) -> None:
    with pytest.raises(SeedsError, match="--jobs"):
        run_seeds(_Draws(), _Settings(), (1,), jobs=jobs)
