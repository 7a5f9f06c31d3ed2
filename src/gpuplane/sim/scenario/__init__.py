"""The scenario kit: one contract, one load model, one checkpointing job, one world and one seed sweep
for every scenario gpuplane reports figures from."""

from gpuplane.sim.scenario.checkpoint import CheckpointingJob, SaveModel, StopOutcome, WorkLedger
from gpuplane.sim.scenario.kit import (
    Figures,
    Goal,
    Headline,
    Progress,
    Scenario,
    ScenarioSettings,
    Table,
    check_scenario,
    figure,
    figure_arm,
    no_progress,
    numeric_figures,
    series,
)
from gpuplane.sim.scenario.load import DAY_S, LoadCurve, LoadModel, sample_load
from gpuplane.sim.scenario.registry import UnknownScenario, get_scenario, scenario_names
from gpuplane.sim.scenario.sweep import (
    MIN_HEADLINE_SEEDS,
    GoalResult,
    SeedsError,
    Spread,
    Sweep,
    parse_seeds,
    run_seeds,
    summarise,
    with_overrides,
)
from gpuplane.sim.scenario.world import KUBELET_STOP_S, World, WorldSettings, build_world

__all__ = [
    "DAY_S",
    "KUBELET_STOP_S",
    "MIN_HEADLINE_SEEDS",
    "CheckpointingJob",
    "Figures",
    "Goal",
    "GoalResult",
    "Headline",
    "LoadCurve",
    "LoadModel",
    "Progress",
    "SaveModel",
    "Scenario",
    "ScenarioSettings",
    "SeedsError",
    "Spread",
    "StopOutcome",
    "Sweep",
    "Table",
    "UnknownScenario",
    "WorkLedger",
    "World",
    "WorldSettings",
    "build_world",
    "check_scenario",
    "figure",
    "figure_arm",
    "get_scenario",
    "no_progress",
    "numeric_figures",
    "parse_seeds",
    "run_seeds",
    "sample_load",
    "scenario_names",
    "series",
    "summarise",
    "with_overrides",
]
