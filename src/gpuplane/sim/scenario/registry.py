"""The scenarios `gpuplane scenario NAME` runs, by name. Each module exposes a `SCENARIO` object."""

from __future__ import annotations

import importlib
from typing import Any

from gpuplane.model import GpuplaneError
from gpuplane.sim.scenario.kit import Scenario

_MODULES: dict[str, str] = {
    "colocation": "gpuplane.sim.colocation",
    "training-faults": "gpuplane.sim.training_faults",
    "tidal": "gpuplane.sim.tidal",
    "autoscale": "gpuplane.sim.autoscale",
    "training-backfill": "gpuplane.sim.backfill",
    "defrag": "gpuplane.sim.defrag",
    "platform-week": "gpuplane.sim.platform",
}


class UnknownScenario(GpuplaneError):
    pass


def scenario_names() -> tuple[str, ...]:
    return tuple(_MODULES)


def get_scenario(name: str) -> Scenario[Any, Any]:
    module = _MODULES.get(name)
    if module is None:
        raise UnknownScenario(f"no scenario {name!r}: choose one of {', '.join(_MODULES)}")
    found: Scenario[Any, Any] = importlib.import_module(module).SCENARIO
    return found
