"""`custom-topo`: an operator-supplied mapping from workload (or workload + instance) to nodes and cards.

YAML form::

    rules:
      - workload: llm-serving        # required
        instance: 0                  # optional: only this instance index
        nodes: [gpu-node-01, gpu-node-02]   # optional: allowed node names
        cards: [0, 1]                # optional: allowed card indexes on those nodes

A rule for the pod's workload and instance wins over a rule for the workload alone. Workloads no rule
names are placed freely. A pod a rule blocks fails with a reason naming the rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuplane.model import ClusterState, GpuplaneError, PodRequest
from gpuplane.model.yamlfile import load_yaml_model
from gpuplane.scheduler.framework import BoolArray, CardCheck, CardPick, Check, CycleState, NodeCheck
from gpuplane.scheduler.plugins.cards import CardOrder, OrderedCardPicker


class TopoRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    workload: str = Field(min_length=1)
    instance: int | None = Field(default=None, ge=0)
    nodes: tuple[str, ...] | None = None
    cards: tuple[int, ...] | None = None

    @field_validator("cards")
    @classmethod
    def _cards_non_negative(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and any(c < 0 for c in value):
            raise ValueError("card indexes must not be negative")
        return value


class TopoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[TopoRule, ...]


class TopoConfigError(GpuplaneError):
    pass


def load_topo_config(path: str | Path) -> TopoConfig:
    """Parse and validate a custom-topo YAML file; errors name the file, rule and field."""
    config = load_yaml_model(path, TopoConfig, TopoConfigError)
    seen: set[tuple[str, int | None]] = set()
    for index, rule in enumerate(config.rules):
        key = (rule.workload, rule.instance)
        if key in seen:
            raise TopoConfigError(f"{path}: rules.{index}: a second rule for workload {rule.workload!r}"
                                  + (f" instance {rule.instance}" if rule.instance is not None else ""))
        seen.add(key)
    return config


class CustomTopo:
    """Filter and picker that honour a `TopoConfig` exactly."""

    name = "CustomTopo"

    def __init__(self, config: TopoConfig, order: CardOrder = CardOrder.PACK) -> None:
        self.config = config
        self._picker = OrderedCardPicker("custom-topo", order)
        self._rules: dict[tuple[str, int | None], tuple[int, TopoRule]] = {
            (rule.workload, rule.instance): (index, rule) for index, rule in enumerate(config.rules)}

    def unknown_nodes(self, state: ClusterState) -> list[str]:
        """Node names that rules mention but the cluster lacks (for start-up validation)."""
        return sorted({n for rule in self.config.rules for n in rule.nodes or () if n not in state.node_index})

    def rule_for(self, pod: PodRequest) -> tuple[int, TopoRule] | None:
        if pod.workload is None:
            return None
        return self._rules.get((pod.workload, pod.instance)) or self._rules.get((pod.workload, None))

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        found = self.rule_for(pod)
        if found is None:
            return
        index, rule = found
        label = f"custom-topo rule {index} (workload {rule.workload}" + (
            f" instance {rule.instance})" if rule.instance is not None else ")")
        n = state.size
        if rule.nodes is not None:
            allowed = np.zeros(n, np.bool_)
            for name in rule.nodes:
                row = state.node_index.get(name)
                if row is not None:
                    allowed[row] = True
            yield NodeCheck(f"{label}: node not allowed", allowed, resolvable=False)
        if rule.cards is not None and pod.gpu is not None:
            mask = np.zeros((n, state.width), np.bool_)
            cols = [c for c in rule.cards if c < state.width]
            mask[:, cols] = True
            yield CardCheck(f"{label}: allowed cards not free", mask)

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        return self._picker.pick(cycle, pod, state, node, eligible)
