"""Fragmentation Gradient Descent (FGD): place each pod where cluster fragmentation grows least.

Score = ⌊100 · sigmoid((F_n(M) before − F_n(M) after) / 1000)⌋. A GPU-sharing pod tries every card
that can hold it and keeps the first card with the best integer score; whole-card pods take idle
cards. Scores are cached per (pod shape, node) and recomputed only for nodes whose state changed
(`ClusterState.node_version`) since that shape was last scored.

`FgdScore` takes M from the whole trace (the published variant); `OnlineFgdScore` learns M from the
arrivals seen so far with exponentially decayed counts, as a live scheduler must.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from gpuplane.model import MILLI_PER_CARD, CardShare, ClusterState, Fraction, PodRequest, WholeCards
from gpuplane.scheduler.framework import CARD_OK, BoolArray, CardPick, CycleState, FloatArray, IntArray, StateKey
from gpuplane.scheduler.plugins.cards import CardOrder, OrderedCardPicker
from gpuplane.scheduler.plugins.frag import Shape, ShapeArrays, TypicalPods, fragmentation, pod_shape, sigmoid_score

FGD_CARD: StateKey[IntArray] = StateKey("fgd/card")
"""Per node row, the card FGD chose (valid for the nodes scored this cycle), for the picker."""


@dataclass(slots=True)
class _Cache:
    version: IntArray
    score: IntArray
    card: IntArray


class FgdScore:
    name = "FGD"
    delta_scale = 1000.0
    """Δ is scored as ⌊100 · sigmoid(Δ / delta_scale)⌋; a coarser scale makes more nodes tie."""

    def __init__(self, typical: TypicalPods) -> None:
        self.typical = typical
        self._state_id = -1
        self._arrays: ShapeArrays | None = None
        self._caches: dict[tuple[object, ...], _Cache] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _reset(self, state: ClusterState) -> ShapeArrays:
        self._state_id = state.uid
        self._arrays = ShapeArrays.build(self.typical, state)
        self._caches.clear()
        return self._arrays

    def _shapes(self, state: ClusterState) -> ShapeArrays:
        if self._arrays is None or self._state_id != state.uid:
            return self._reset(state)
        return self._arrays

    def observe(self, pod: PodRequest) -> None:
        """Hook for variants that learn M from arrivals; the published FGD knows M in advance."""

    # ------------------------------------------------------------------ scoring
    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        self.observe(pod)
        shapes = self._shapes(state)
        n = state.size
        key = (pod.cpu_milli, pod.memory_mib, pod.gpu, pod.models)
        cache = self._caches.get(key)
        if cache is None or len(cache.version) < n:
            cache = _Cache(np.full(n, -1, np.int64), np.zeros(n, np.int64), np.full(n, -1, np.int64))
            self._caches[key] = cache
        stale = nodes[cache.version[nodes] != state.node_version[nodes]]
        if len(stale):
            card_ok = cycle.find(CARD_OK)
            scores, cards = self._compute(pod, state, stale, shapes,
                                          card_ok[stale] if card_ok is not None else None)
            cache.score[stale] = scores
            cache.card[stale] = cards
            cache.version[stale] = state.node_version[stale]
        cycle.write(FGD_CARD, cache.card)
        return cache.score[nodes].astype(np.float64)

    def _compute(self, pod: PodRequest, state: ClusterState, nodes: IntArray, shapes: ShapeArrays,
                 card_ok: BoolArray | None = None) -> tuple[IntArray, IntArray]:
        """Scores and chosen cards of `nodes`; `card_ok` (nodes × cards) is what the filters allow."""
        scale = self.delta_scale
        usable = state.card_valid[nodes] & ~state.card_mig[nodes]
        free = np.where(usable, state.card_milli_free[nodes], 0)
        cpu = state.cpu_free[nodes]
        model = state.model_idx[nodes]
        before = fragmentation(free, cpu, model, shapes)
        cpu_after = cpu - pod.cpu_milli
        gpu = pod.gpu
        none = np.full(len(nodes), -1, np.int64)
        if isinstance(gpu, Fraction):
            d = gpu.compute_milli
            width = free.shape[1]
            fits = usable & (free >= d)
            if card_ok is not None:
                fits &= card_ok
            elif gpu.memory_mib:
                fits &= state.card_mem_free[nodes] >= gpu.memory_mib
            after_free = free[:, None, :] - d * np.eye(width, dtype=np.int64)[None]
            after = fragmentation(after_free, np.repeat(cpu_after[:, None], width, axis=1),
                                  np.repeat(model[:, None], width, axis=1), shapes)
            per_card = np.where(fits, sigmoid_score(before[:, None] - after, scale), -1)
            if gpu.count > 1:
                # A share on several cards: the `count` best cards alone (stable: lower index first on a tie)
                # take it; the score is the node's fragmentation change, and the picker chooses the cards.
                best = np.argsort(-per_card, axis=1, kind="stable")[:, : gpu.count]
                taken = np.zeros(free.shape, np.bool_)
                np.put_along_axis(taken, best, True, axis=1)
                taken &= fits
                after_node = fragmentation(free - d * taken, cpu_after, model, shapes)
                return sigmoid_score(before - after_node, scale), none
            card = np.argmax(per_card, axis=1)  # the first card with the best integer score
            return per_card[np.arange(len(nodes)), card], card.astype(np.int64)
        if isinstance(gpu, WholeCards):
            idle = usable & (free == MILLI_PER_CARD) & (state.card_holders[nodes] == 0)
            taken = idle & (np.cumsum(idle, axis=1) <= gpu.count)
            after = fragmentation(np.where(taken, 0, free), cpu_after, model, shapes)
            return sigmoid_score(before - after, scale), none
        if gpu is None and not pod.cpu_milli:
            return np.full(len(nodes), 100, np.int64), none
        after = fragmentation(free, cpu_after, model, shapes)
        return sigmoid_score(before - after, scale), none


class OnlineFgdScore(FgdScore):
    """FGD with M learned from arrivals: decayed shape counts, M rebuilt every `refresh` arrivals."""

    name = "FGD-online"

    def __init__(self, half_life: float = 2000.0, refresh: int = 100, threshold: float = 0.95,
                 tolerance: float = 0.005) -> None:
        super().__init__(TypicalPods((), np.zeros(0)))
        self.tolerance = tolerance
        self.decay = 0.5 ** (1.0 / half_life)
        self.refresh = refresh
        self.threshold = threshold
        self.counts: Counter[Shape] = Counter()
        self._weight = 1.0
        self._seen: set[str] = set()
        self._since = 0

    def observe(self, pod: PodRequest) -> None:
        if pod.name in self._seen:
            return
        self._seen.add(pod.name)
        # Decayed counts without touching every entry: newer arrivals weigh more, by 1/decay each.
        self._weight /= self.decay
        self.counts[pod_shape(pod)] += self._weight  # type: ignore[assignment]
        self._since += 1
        if not self.typical.shapes or self._since >= self.refresh:
            if self._weight > 1e200:
                self.counts = Counter({k: v / self._weight for k, v in self.counts.items()})
                self._weight = 1.0
            fresh = TypicalPods.from_counts(self.counts, self.threshold)
            self._since = 0
            # Every new M invalidates every cached score: keep the old one while it barely moved.
            if fresh.shapes != self.typical.shapes or \
                    float(np.abs(fresh.popularity - self.typical.popularity).max()) > self.tolerance:
                self.typical = fresh
                self._arrays = None


class FgdCardPicker:
    """Uses the card FGD scored best on the node; whole cards go to the lowest idle indexes."""

    name = "fgd"

    def __init__(self) -> None:
        self._fallback = OrderedCardPicker("fgd", CardOrder.PACK)

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        gpu = pod.gpu
        chosen_cards = cycle.find(FGD_CARD)
        chosen = int(chosen_cards[node]) if chosen_cards is not None and node < len(chosen_cards) else -1
        if isinstance(gpu, Fraction) and gpu.count == 1 and chosen >= 0 and eligible[chosen]:
            memory = gpu.memory_on(int(state.card_mem_phys[node, chosen]))
            share = CardShare(chosen, gpu.compute_milli, memory, gpu.encoders, gpu.decoders)
            return CardPick((share,))
        if isinstance(gpu, WholeCards):
            cards = [int(c) for c in np.flatnonzero(eligible)][: gpu.count]
            if len(cards) < gpu.count:
                return None
            return CardPick(tuple(CardShare(c, MILLI_PER_CARD, int(state.card_mem_cap[node, c]),
                                            int(state.card_enc_cap[node, c]), int(state.card_dec_cap[node, c]),
                                            whole=True) for c in cards))
        return self._fallback.pick(cycle, pod, state, node, eligible)


class FgdUsedScore(OnlineFgdScore):
    """Our online policy: FGD with M learned online; among equal FGD scores, nodes already in use win.

    The FGD score is an integer, so hundreds of nodes often tie. Settling ties in one fixed node order
    is what makes FGD work (it keeps landing small pods on the same nodes); this adds one rule before
    the order: a node that already runs something beats an untouched one, so idle nodes stay whole for
    pods that need a whole node. Adding 0.5 never overrides a better FGD score.
    """

    name = "FGD-used"

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        base = super().score(cycle, pod, state, nodes)
        used = (state.gpu_milli_used[nodes] > 0) | (state.cpu_free[nodes] < state.cpu_cap[nodes])
        out: FloatArray = base + 0.5 * used
        return out
