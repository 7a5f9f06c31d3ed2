"""The defragmentation scenario: its contract, arms that differ only by the controller, and the budget held."""

from __future__ import annotations

import math

from gpuplane.sim.defrag import SCENARIO, DefragFigures, DefragSettings, run_defrag
from gpuplane.sim.scenario import check_scenario, no_progress, with_overrides

SMALL = {"node_count": 8, "days": 0.25, "warmup_hours": 1.0, "seed": 3}


def _run(**overrides: object) -> DefragFigures:
    return run_defrag(with_overrides(DefragSettings(), SMALL | overrides), no_progress)


def test_the_scenario_keeps_the_kit_contract() -> None:
    assert check_scenario(SCENARIO) == []
    assert SCENARIO.name == "defrag" and SCENARIO.ours == "defrag"


def test_with_no_move_budget_the_arms_are_the_same_run() -> None:
    # The controller plans but may not move: the defragmentation arm must be the baseline, pod for pod (its
    # planner draws from its own generator, so the scheduler's decisions are untouched).
    f = _run(max_moves_per_hour=0)
    assert f.moves == 0 and f.moved_lost_gpu_h == 0.0
    assert f.defrag_whole_waits_s == f.no_defrag_whole_waits_s
    assert f.defrag_unallocated_series == f.no_defrag_unallocated_series


def test_moves_stay_within_the_hourly_budget_and_are_booked() -> None:
    f = _run(max_moves_per_hour=3, load=1.1)
    hours = (f.window_s[1] - f.window_s[0]) / 3600.0
    # At most 3 moves in any hour: over the window, at most 3 per started hour.
    assert f.moves <= 3 * math.ceil(hours)
    assert f.moves_per_hour == f.moves / hours
    assert f.moves > 0, "the small cluster at load 1.1 should need some moves"
    assert f.pods_freed_for <= f.moves
    # A move loses the work since the job's last save: grace 30 s is shorter than the 60 s save, so some is lost.
    assert f.moved_lost_gpu_h > 0.0
    assert f.whole_pods == len(f.no_defrag_whole_waits_s) == len(f.defrag_whole_waits_s)
