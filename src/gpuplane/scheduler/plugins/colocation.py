"""Co-location-aware placement: where an offline or near-line pod shares a card with online work.

For a fractional pod whose QoS is not online, every card that fits costs

    cost = w_pressure · online_pressure + w_ratio · ratio_mismatch          (both in 0…1)

- `online_pressure`: the share of the card's compute held by online pods (`ClusterState.card_online_milli`).
  Offline work on a card with little online load is suspended less often, and disturbs fewer online
  requests (docs/colocation.md).
- `ratio_mismatch`: |free memory / card memory − free compute / card compute| after the pod is placed. A card
  left with memory but no compute (or the reverse) strands the other dimension; matching the pod's
  memory-to-compute ratio to what the card has left keeps both usable.

The `colocation` card policy picks the cheapest card; the `colocation` node policy scores nodes by their
cheapest card (100 · (1 − cost)) and packs GPU allocation as a second score. Online pods and whole-card or
MIG requests are placed as `binpack` places them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from gpuplane.model import MILLI_PER_CARD, CardShare, ClusterState, Fraction, PodRequest, QoS
from gpuplane.scheduler.framework import BoolArray, CardCheck, CardPick, Check, CycleState, FloatArray, IntArray
from gpuplane.scheduler.plugins.cards import CardOrder, OrderedCardPicker


@dataclass(frozen=True, slots=True)
class ColocationWeights:
    pressure: float = 0.6
    ratio: float = 0.4

    def __post_init__(self) -> None:
        if min(self.pressure, self.ratio) < 0 or self.pressure + self.ratio <= 0:
            raise ValueError("co-location weights must not be negative and must not both be 0")


def ratio_mismatch(milli_left: FloatArray, mem_left: FloatArray, mem_cap: FloatArray) -> FloatArray:
    """|free memory share − free compute share| of cards after a placement (0: balanced, 1: one dimension
    full and the other empty)."""
    mem_share = np.divide(mem_left, mem_cap, out=np.zeros_like(mem_left, dtype=np.float64), where=mem_cap > 0)
    return np.asarray(np.abs(mem_share - milli_left / MILLI_PER_CARD))


def colocation_cost(pressure: FloatArray, mismatch: FloatArray, weights: ColocationWeights) -> FloatArray:
    """Weighted cost in 0…1 (lower is better)."""
    total = weights.pressure + weights.ratio
    return np.asarray((weights.pressure * pressure + weights.ratio * mismatch) / total)


def shares_card(pod: PodRequest) -> bool:
    """Whether the pod is placed by co-location cost: a fraction of a card, not online."""
    return isinstance(pod.gpu, Fraction) and pod.qos is not QoS.ONLINE


GUARD_LINE = "GPU memory under the node guard's safety line"


class GuardLineFit:
    """A filter: a fractional pod that is not online goes only where it leaves `reserve_mib` of the card's
    memory unpromised: the node guard's admission line (its safety line, the growth it allows online and the
    hysteresis, `MemoryGuard.admissible_bytes`). The guard evicts offline work under its line on any card it
    watches, whether online holds the card now or arrives later; without this filter the scheduler packs
    offline work where the guard evicts it at once, and re-places it there (`docs/platform.md`). Online
    pods are not limited."""

    name = "GuardLineFit"

    def __init__(self, reserve_mib: int) -> None:
        self.reserve_mib = reserve_mib

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        gpu = pod.gpu
        if self.reserve_mib <= 0 or not isinstance(gpu, Fraction) or pod.qos is QoS.ONLINE:
            return
        n = state.size
        phys = state.card_mem_phys[:n]
        need = phys * gpu.memory_pct // 100 if gpu.memory_pct else gpu.memory_mib
        yield CardCheck(GUARD_LINE, state.card_mem_free[:n] - need >= self.reserve_mib)


def card_costs(pod: PodRequest, state: ClusterState, nodes: IntArray,
               weights: ColocationWeights) -> FloatArray:
    """Cost per (node, card) for a fractional pod; +inf where the pod does not fit."""
    gpu = pod.gpu
    assert isinstance(gpu, Fraction)
    phys = state.card_mem_phys[nodes]
    memory = phys * gpu.memory_pct // 100 if gpu.memory_pct else np.full_like(phys, gpu.memory_mib)
    milli_left = state.milli_free_for(pod, nodes) - gpu.compute_milli
    mem_left = state.card_mem_free[nodes] - memory
    fits = (state.card_valid[nodes] & ~state.card_mig[nodes] & ~state.card_whole[nodes]
            & (milli_left >= 0) & (mem_left >= 0)
            & (state.card_enc_free[nodes] >= gpu.encoders) & (state.card_dec_free[nodes] >= gpu.decoders))
    pressure = state.card_online_milli[nodes] / MILLI_PER_CARD
    cost = colocation_cost(pressure, ratio_mismatch(milli_left.astype(np.float64), mem_left.astype(np.float64),
                                                    state.card_mem_cap[nodes].astype(np.float64)), weights)
    return np.where(fits, cost, np.inf)


class ColocationScore:
    """Node score: 100 · (1 − the cheapest card's cost) for offline fractional pods; 0 for other pods."""

    name = "Colocation"

    def __init__(self, weights: ColocationWeights | None = None) -> None:
        self.weights = weights or ColocationWeights()

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        if not shares_card(pod) or len(nodes) == 0:
            return np.zeros(len(nodes))
        best = card_costs(pod, state, nodes, self.weights).min(axis=1)
        return np.where(np.isfinite(best), 100.0 * (1.0 - np.minimum(best, 1.0)), 0.0)


class ColocationCardPicker(OrderedCardPicker):
    """The cheapest card for offline fractional pods (ties: the fuller card, then the lower index);
    `binpack` for everything else."""

    def __init__(self, weights: ColocationWeights | None = None) -> None:
        super().__init__("colocation", CardOrder.PACK)
        self.weights = weights or ColocationWeights()

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        gpu = pod.gpu
        if not shares_card(pod) or not isinstance(gpu, Fraction) or pod.rdma_vfs:
            return super().pick(cycle, pod, state, node, eligible)
        costs = card_costs(pod, state, np.array([node]), self.weights)[0, : len(eligible)]
        costs = np.where(eligible, costs, np.inf)
        if int(np.isfinite(costs).sum()) < gpu.count:
            return None
        order = np.lexsort((np.arange(len(costs)), state.milli_free_for(pod, node)[: len(costs)], costs))
        chosen = sorted(int(c) for c in order[: gpu.count])  # a share on several cards: the cheapest ones
        return CardPick(tuple(CardShare(c, gpu.compute_milli, gpu.memory_on(int(state.card_mem_phys[node, c])),
                                        gpu.encoders, gpu.decoders) for c in chosen))
