"""Card policies: which card(s) of the chosen node a pod gets.

- `binpack`: the fullest card that fits (keeps whole cards whole); whole-card requests take the
  smallest NVLink group (then NUMA node) that holds them all.
- `spread`: the emptiest card that fits; whole-card requests take the largest such group.
- `card-only-one`: a card hosts at most one instance of the same workload (scope `workload`) or one
  instance at all (scope `all`); among allowed cards it packs like `binpack`.

Multi-card whole requests prefer one NVLink group, then one NUMA node; a share on several cards (HAMi's
`gpu: N` with `gpumem`) takes N distinct cards, each by the policy's order. MIG requests take the legal slot that
leaves the most future (profile, slot) placements possible. RDMA functions come from a NIC on the same
PCIe switch as the pod's cards, else the same NUMA node, else any NIC.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from gpuplane.model import (
    MILLI_PER_CARD,
    CardShare,
    ClusterState,
    Fraction,
    MigProfile,
    MigSlice,
    PodRequest,
    RdmaLocality,
    RdmaShare,
    WholeCards,
)
from gpuplane.scheduler.framework import NEAR_CARDS, BoolArray, CardCheck, CardPick, Check, CycleState, IntArray


class CardOrder(enum.Enum):
    PACK = "pack"
    SPREAD = "spread"


class OrderedCardPicker:
    """Picks cards by a packing or spreading order; the base of every card policy."""

    def __init__(self, name: str, order: CardOrder) -> None:
        self.name = name
        self.order = order

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        gpu = pod.gpu
        cards = [int(c) for c in np.flatnonzero(eligible)] if gpu is not None else []
        shares: tuple[CardShare, ...]
        if gpu is None:
            shares = ()
        elif isinstance(gpu, WholeCards):
            near = cycle.get(NEAR_CARDS, {}).get(node, frozenset())
            chosen = self.whole_cards(state, node, cards, gpu.count, near)
            if chosen is None:
                return None
            shares = tuple(CardShare(c, MILLI_PER_CARD, int(state.card_mem_cap[node, c]),
                                     int(state.card_enc_cap[node, c]), int(state.card_dec_cap[node, c]), whole=True)
                           for c in chosen)
        elif isinstance(gpu, Fraction):
            fractions = self.fractions(state, node, cards, gpu, state.milli_free_for(pod, node))
            if fractions is None:
                return None
            shares = fractions
        else:
            mig = self.mig(state, node, cards, gpu)
            if mig is None:
                return None
            shares = (mig,)
        rdma = None
        if pod.rdma_vfs:
            rdma = pick_rdma(state, node, [s.card for s in shares], pod.rdma_vfs)
            if rdma is None:
                return None
        return CardPick(shares, rdma)

    # ------------------------------------------------------------------ fractions
    def fractions(self, state: ClusterState, node: int, cards: Sequence[int], gpu: Fraction,
                  milli_free: IntArray | None = None) -> tuple[CardShare, ...] | None:
        """`gpu.count` distinct cards, each taking the share: the first by the order (packing: least left after
        the share, compute then memory, then index; spreading: most left), or None when fewer cards fit.
        `milli_free`: the node's card compute the pod may take (`ClusterState.milli_free_for`; default the
        cards' `card_milli_free`)."""
        sign = 1 if self.order is CardOrder.PACK else -1
        free = state.card_milli_free[node] if milli_free is None else milli_free
        ranked: list[tuple[int, int, int, int]] = []
        for c in cards:
            memory = gpu.memory_on(int(state.card_mem_phys[node, c]))
            if state.card_mem_free[node, c] < memory or free[c] < gpu.compute_milli:
                continue
            ranked.append((sign * int(free[c] - gpu.compute_milli),
                           sign * int(state.card_mem_free[node, c] - memory), c, memory))
        if len(ranked) < gpu.count:
            return None
        chosen = sorted(sorted(ranked)[: gpu.count], key=lambda r: r[2])
        return tuple(CardShare(c, gpu.compute_milli, memory, gpu.encoders, gpu.decoders) for _, _, c, memory in chosen)

    # ------------------------------------------------------------------ whole cards
    def whole_cards(self, state: ClusterState, node: int, cards: Sequence[int], count: int,
                    near: frozenset[int] = frozenset()) -> list[int] | None:
        """`count` cards in one NVLink group if possible, else one NUMA node; with `near` (a gang's cards
        on this node), a group that already holds some of them comes first."""
        if len(cards) < count:
            return None
        topology = state.nodes[node].topology
        domains: list[list[list[int]]] = []
        if topology.nvlink_groups:
            if near:
                beside = [[c for c in group if c in cards] for group in topology.nvlink_groups if near & set(group)]
                domains.append(beside)
            domains.append([[c for c in group if c in cards] for group in topology.nvlink_groups])
        numa_ids = sorted(set(topology.numa))
        domains.append([[c for c in cards if topology.numa[c] == numa] for numa in numa_ids])
        for level in domains:
            fitting = [group for group in level if len(group) >= count]
            if fitting:
                if self.order is CardOrder.PACK:
                    group = min(fitting, key=lambda g: (len(g), g[0]))
                else:
                    group = max(fitting, key=lambda g: (len(g), -g[0]))
                return sorted(group)[:count]
        return sorted(cards)[:count]

    # ------------------------------------------------------------------ MIG
    def mig(self, state: ClusterState, node: int, cards: Sequence[int], gpu: MigSlice) -> CardShare | None:
        model = state.model_of(node)
        profile = model.mig_profile(gpu.profile) if model is not None else None
        if model is None or profile is None:
            return None
        best: tuple[int, int, int, int] | None = None
        choice: tuple[int, int] | None = None
        sign = 1 if self.order is CardOrder.PACK else -1
        for c in cards:
            occupied = int(state.card_mig_slots[node, c])
            compute = int(state.card_mig_compute[node, c])
            for start in state.mig_fits(node, c, profile):
                after = occupied | profile.slot_mask(start)
                future = future_placements(model.mig_profiles.values(), after, compute + profile.compute_slices,
                                           model.compute_slices)
                key = (-sign * occupied.bit_count(), -future, c, start)
                if best is None or key < best:
                    best, choice = key, (c, start)
        if choice is None:
            return None
        card, start = choice
        return CardShare(card, model.mig_compute_milli(profile), profile.memory_mib, 0, 0,
                         mig_profile=profile.profile_id, mig_start=start)


def future_placements(profiles: Iterable[MigProfile], occupied: int, compute_used: int, compute_total: int) -> int:
    """How many (profile, start) placements stay legal on a card with `occupied` memory slices."""
    total = 0
    for profile in profiles:
        if compute_used + profile.compute_slices > compute_total:
            continue
        total += sum(1 for s in profile.starts if not occupied & profile.slot_mask(s))
    return total


def pick_rdma(state: ClusterState, node: int, cards: Sequence[int], vfs: int) -> RdmaShare | None:
    """A NIC with `vfs` free functions, nearest first: same PCIe switch, same NUMA node, any."""
    topology = state.nodes[node].topology
    switches = {topology.pcie_switch[c] for c in cards}
    numas = {topology.numa[c] for c in cards}
    best: tuple[int, int, int] | None = None
    for index, nic in enumerate(topology.nics):
        free = state.nic_free[node][index]
        if free < vfs:
            continue
        rank = 0 if nic.pcie_switch in switches else 1 if nic.numa in numas else 2
        key = (rank, free, index)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    locality = (RdmaLocality.PCIE_SWITCH, RdmaLocality.NUMA, RdmaLocality.REMOTE)[best[0]]
    return RdmaShare(best[2], vfs, locality)


class CardOnlyOneScope(enum.Enum):
    WORKLOAD = "workload"
    ALL = "all"


class CardOnlyOne:
    """Filter and picker: at most one instance per card (of the same workload, or at all)."""

    name = "CardOnlyOne"

    def __init__(self, scope: CardOnlyOneScope = CardOnlyOneScope.WORKLOAD) -> None:
        self.scope = scope
        self._picker = OrderedCardPicker("card-only-one", CardOrder.PACK)

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        if pod.gpu is None:
            return
        n = state.size
        if self.scope is CardOnlyOneScope.ALL:
            yield CardCheck("card-only-one: every card already hosts an instance", state.card_holders[:n] == 0)
            return
        if pod.workload is None:
            return
        taken = state.workload_cards.get(pod.workload)
        if not taken:
            return
        mask = np.ones((n, state.width), np.bool_)
        rows, cols = zip(*taken, strict=True)
        mask[list(rows), list(cols)] = False
        yield CardCheck(f"card-only-one: cards already host workload {pod.workload}", mask)

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        return self._picker.pick(cycle, pod, state, node, eligible)
