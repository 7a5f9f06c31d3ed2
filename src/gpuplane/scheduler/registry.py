"""The explicit plugin registry: policy names → factories that build a `Profile`.

No import-time side effects and no module globals: `default_registry()` returns a fresh object that
callers extend (`register_node_policy`) and pass to the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuplane.model import GpuplaneError
from gpuplane.scheduler.framework import CardPicker, FilterPlugin, Profile, WeightedScore
from gpuplane.scheduler.plugins.allocation import BinpackScore, ResourceWeights, SpreadScore
from gpuplane.scheduler.plugins.cards import CardOnlyOne, CardOnlyOneScope, CardOrder, OrderedCardPicker
from gpuplane.scheduler.plugins.fit import GpuFit, NodeFit
from gpuplane.scheduler.plugins.topo import CustomTopo, TopoConfig


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Node policy and card policy are separate settings, as in the reports."""

    node_policy: str = "binpack"
    card_policy: str = "binpack"
    card_only_one_scope: CardOnlyOneScope = CardOnlyOneScope.WORKLOAD
    custom_topo: TopoConfig | None = None
    weights: ResourceWeights = field(default_factory=ResourceWeights)


NodePolicyFactory = Callable[[PolicyConfig], Sequence[WeightedScore]]
CardPolicyFactory = Callable[[PolicyConfig], tuple[tuple[FilterPlugin, ...], CardPicker]]


class PolicyError(GpuplaneError):
    pass


class Registry:
    def __init__(self) -> None:
        self.node_policies: dict[str, NodePolicyFactory] = {}
        self.card_policies: dict[str, CardPolicyFactory] = {}

    def register_node_policy(self, name: str, factory: NodePolicyFactory) -> None:
        if name in self.node_policies:
            raise PolicyError(f"node policy {name!r} registered twice")
        self.node_policies[name] = factory

    def register_card_policy(self, name: str, factory: CardPolicyFactory) -> None:
        if name in self.card_policies:
            raise PolicyError(f"card policy {name!r} registered twice")
        self.card_policies[name] = factory

    def build(self, config: PolicyConfig) -> Profile:
        """Resolve the policy names once, at construction; unknown names are an error naming the choices."""
        node = self.node_policies.get(config.node_policy)
        if node is None:
            raise PolicyError(f"unknown node policy {config.node_policy!r} "
                              f"(choose from {', '.join(sorted(self.node_policies))})")
        card = self.card_policies.get(config.card_policy)
        if card is None:
            raise PolicyError(f"unknown card policy {config.card_policy!r} "
                              f"(choose from {', '.join(sorted(self.card_policies))})")
        card_filters, picker = card(config)
        return Profile(
            name=f"{config.node_policy}/{config.card_policy}",
            filters=(NodeFit(), GpuFit(), *card_filters),
            scores=tuple(node(config)),
            picker=picker,
        )


def _custom_topo(config: PolicyConfig) -> tuple[tuple[FilterPlugin, ...], CardPicker]:
    if config.custom_topo is None:
        raise PolicyError("card policy custom-topo needs a topology file (--topo FILE)")
    plugin = CustomTopo(config.custom_topo)
    return (plugin,), plugin


def _card_only_one(config: PolicyConfig) -> tuple[tuple[FilterPlugin, ...], CardPicker]:
    plugin = CardOnlyOne(config.card_only_one_scope)
    return (plugin,), plugin


def default_registry() -> Registry:
    registry = Registry()
    registry.register_node_policy("binpack", lambda c: [WeightedScore(BinpackScore(c.weights))])
    registry.register_node_policy("spread", lambda c: [WeightedScore(SpreadScore(c.weights))])
    registry.register_card_policy("binpack", lambda c: ((), OrderedCardPicker("binpack", CardOrder.PACK)))
    registry.register_card_policy("spread", lambda c: ((), OrderedCardPicker("spread", CardOrder.SPREAD)))
    registry.register_card_policy("card-only-one", _card_only_one)
    registry.register_card_policy("custom-topo", _custom_topo)
    return registry
