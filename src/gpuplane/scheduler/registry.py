"""The explicit plugin registry: policy names → factories that build a `Profile`.

No import-time side effects and no module globals: `default_registry()` returns a fresh object that
callers extend (`register_node_policy`) and pass to the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuplane.model import GpuplaneError
from gpuplane.scheduler.framework import CardPicker, FilterPlugin, Profile, ScorePlugin, TieBreak, WeightedScore
from gpuplane.scheduler.plugins.allocation import BinpackScore, ResourceWeights, SpreadScore
from gpuplane.scheduler.plugins.baselines import (
    BestFitScore,
    DotProdScore,
    GpuClusteringScore,
    GpuPackingScore,
    RandomCardPicker,
    RandomScore,
)
from gpuplane.scheduler.plugins.cards import CardOnlyOne, CardOnlyOneScope, CardOrder, OrderedCardPicker
from gpuplane.scheduler.plugins.colocation import ColocationCardPicker, ColocationScore, GuardLineFit
from gpuplane.scheduler.plugins.constraints import (
    NODE_AFFINITY_WEIGHT,
    TAINT_TOLERATION_WEIGHT,
    NodeAffinityScore,
    TaintTolerationScore,
)
from gpuplane.scheduler.plugins.fgd import FgdCardPicker, FgdScore, FgdUsedScore, OnlineFgdScore
from gpuplane.scheduler.plugins.fgd_plus import FgdPlusScore
from gpuplane.scheduler.plugins.fit import GpuFit, NodeFit
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.scheduler.plugins.topo import CustomTopo, TopoConfig


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Node policy and card policy are separate settings, as in the reports.

    `card_policy` None takes the node policy's own card choice where it has one (FGD, random), else
    binpack. `typical` is the target workload M for fragmentation-aware policies; `seed` seeds
    policies that draw at random.
    """

    node_policy: str = "binpack"
    card_policy: str | None = None
    card_only_one_scope: CardOnlyOneScope = CardOnlyOneScope.WORKLOAD
    custom_topo: TopoConfig | None = None
    weights: ResourceWeights = field(default_factory=ResourceWeights)
    typical: TypicalPods | None = None
    seed: int = 0
    tie_break: TieBreak | None = None
    """None: the node policy's default (random for binpack/spread, ordered for the FGD paper's policies)."""
    guard_reserve_mib: int = 0
    """> 0: offline fractions sharing a card with online pods leave this much memory unpromised (the node
    guard's admission line, `GuardLineFit`); 0: no such filter."""


@dataclass(frozen=True, slots=True)
class NodePolicy:
    scores: Sequence[WeightedScore]
    picker: CardPicker | None = None
    """The policy's own card choice, used unless a card policy is named."""
    tie_break: TieBreak = TieBreak.RANDOM


NodePolicyFactory = Callable[[PolicyConfig], NodePolicy]
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
        node_policy = node(config)
        tie_break = config.tie_break or node_policy.tie_break
        fits: tuple[FilterPlugin, ...] = (NodeFit(), GpuFit())
        if config.guard_reserve_mib > 0:
            fits = (*fits, GuardLineFit(config.guard_reserve_mib))
        card_name = config.card_policy
        if card_name is None and node_policy.picker is not None:
            return Profile(name=f"{config.node_policy}/{node_policy.picker.name}",
                           filters=fits, scores=_with_constraints(node_policy.scores),
                           picker=node_policy.picker, tie_break=tie_break)
        card_name = card_name or "binpack"
        card = self.card_policies.get(card_name)
        if card is None:
            raise PolicyError(f"unknown card policy {card_name!r} "
                              f"(choose from {', '.join(sorted(self.card_policies))})")
        card_filters, picker = card(config)
        return Profile(
            name=f"{config.node_policy}/{card_name}",
            filters=(*fits, *card_filters),
            scores=_with_constraints(node_policy.scores),
            picker=picker,
            tie_break=tie_break,
        )


def _with_constraints(scores: Sequence[WeightedScore]) -> tuple[WeightedScore, ...]:
    """The policy's scores, then the scores of the pod's node constraints (zero for a pod without them)."""
    return (*scores, WeightedScore(NodeAffinityScore(), NODE_AFFINITY_WEIGHT),
            WeightedScore(TaintTolerationScore(), TAINT_TOLERATION_WEIGHT))


def _custom_topo(config: PolicyConfig) -> tuple[tuple[FilterPlugin, ...], CardPicker]:
    if config.custom_topo is None:
        raise PolicyError("card policy custom-topo needs a topology file (--topo FILE)")
    plugin = CustomTopo(config.custom_topo)
    return (plugin,), plugin


def _card_only_one(config: PolicyConfig) -> tuple[tuple[FilterPlugin, ...], CardPicker]:
    plugin = CardOnlyOne(config.card_only_one_scope)
    return (plugin,), plugin


def _typical(config: PolicyConfig) -> TypicalPods:
    if config.typical is None:
        raise PolicyError(f"node policy {config.node_policy} needs the target workload (typical pods)")
    return config.typical


def _one(score: ScorePlugin, picker: CardPicker | None = None) -> NodePolicy:
    return NodePolicy((WeightedScore(score),), picker)


def _paper(score: ScorePlugin, picker: CardPicker | None = None) -> NodePolicy:
    """The FGD paper's policies settle ties by a seeded node order, as its simulator does."""
    return NodePolicy((WeightedScore(score),), picker, TieBreak.ORDERED)


def default_registry() -> Registry:
    registry = Registry()
    registry.register_node_policy("binpack", lambda c: _one(BinpackScore(c.weights)))
    registry.register_node_policy("spread", lambda c: _one(SpreadScore(c.weights)))
    # The FGD paper's policies, as its simulator defines them (best-fit cards unless noted).
    registry.register_node_policy("random", lambda c: _paper(RandomScore(c.seed), RandomCardPicker(c.seed)))
    registry.register_node_policy("dotprod", lambda c: _paper(DotProdScore()))
    registry.register_node_policy("gpu-clustering", lambda c: _paper(GpuClusteringScore()))
    registry.register_node_policy("gpu-packing", lambda c: _paper(GpuPackingScore()))
    registry.register_node_policy("bestfit", lambda c: _paper(BestFitScore()))
    registry.register_node_policy("fgd", lambda c: _paper(FgdScore(_typical(c)), FgdCardPicker()))
    registry.register_node_policy("fgd-online", lambda c: _paper(OnlineFgdScore(), FgdCardPicker()))
    # Ours: online M, ties go to nodes already in use (docs/fragmentation.md).
    registry.register_node_policy("fgd-used", lambda c: _paper(FgdUsedScore(), FgdCardPicker()))
    # Ours: FGD with M from history, a coarser score and used nodes first, tuned on seeds 0-9.
    registry.register_node_policy("fgd-plus", lambda c: _paper(FgdPlusScore(_typical(c)), FgdCardPicker()))
    registry.register_card_policy("fgd-plus", lambda c: ((), FgdCardPicker()))
    # Ours: offline pods onto cards with little online load and a matching memory-to-compute ratio.
    registry.register_node_policy("colocation", lambda c: NodePolicy(
        (WeightedScore(ColocationScore()), WeightedScore(BinpackScore(c.weights))), ColocationCardPicker()))
    registry.register_card_policy("binpack", lambda c: ((), OrderedCardPicker("binpack", CardOrder.PACK)))
    registry.register_card_policy("spread", lambda c: ((), OrderedCardPicker("spread", CardOrder.SPREAD)))
    registry.register_card_policy("card-only-one", _card_only_one)
    registry.register_card_policy("custom-topo", _custom_topo)
    registry.register_card_policy("colocation", lambda c: ((), ColocationCardPicker()))
    return registry
