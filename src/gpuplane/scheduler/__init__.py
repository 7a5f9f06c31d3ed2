"""The scheduling core: framework, plugins, registry, queue and the scheduler that binds through the port."""

from gpuplane.scheduler.admission import Admission
from gpuplane.scheduler.framework import (
    CARD_OK,
    CardCheck,
    CardPick,
    CardPicker,
    CycleState,
    Decision,
    Diagnosis,
    FilterPlugin,
    Framework,
    NodeCheck,
    Profile,
    ScorePlugin,
    StateKey,
    TieBreak,
    WeightedScore,
)
from gpuplane.scheduler.plugins.allocation import ResourceWeights
from gpuplane.scheduler.plugins.cards import CardOnlyOneScope, CardOrder
from gpuplane.scheduler.plugins.topo import TopoConfig, TopoConfigError, TopoRule, load_topo_config
from gpuplane.scheduler.preemption import Preemption, PreemptionPlan, Victim, VictimOrder, VictimRules
from gpuplane.scheduler.queue import SchedulingQueue
from gpuplane.scheduler.registry import PolicyConfig, PolicyError, Registry, default_registry
from gpuplane.scheduler.scheduler import Outcome, PreemptionStats, Scheduler, SchedulingRules

__all__ = [
    "CARD_OK",
    "Admission",
    "CardCheck",
    "CardOnlyOneScope",
    "CardOrder",
    "CardPick",
    "CardPicker",
    "CycleState",
    "Decision",
    "Diagnosis",
    "FilterPlugin",
    "Framework",
    "NodeCheck",
    "Outcome",
    "PolicyConfig",
    "PolicyError",
    "Preemption",
    "PreemptionPlan",
    "PreemptionStats",
    "Profile",
    "Registry",
    "ResourceWeights",
    "Scheduler",
    "SchedulingQueue",
    "SchedulingRules",
    "ScorePlugin",
    "StateKey",
    "TieBreak",
    "TopoConfig",
    "TopoConfigError",
    "TopoRule",
    "Victim",
    "VictimOrder",
    "VictimRules",
    "WeightedScore",
    "default_registry",
    "load_topo_config",
]
