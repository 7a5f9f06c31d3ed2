"""Fragmentation Gradient Descent (FGD): place each pod where cluster fragmentation grows least.

Score = ⌊100 · sigmoid((F_n(M) before − F_n(M) after) / 1000)⌋. A GPU-sharing pod tries every card
that can hold it and keeps the first card with the best integer score; whole-card pods take idle
cards. Scores are cached per (pod shape, node) and recomputed only for nodes whose state changed
(`ClusterState.node_version`) since that shape was last scored.

What a recomputation costs: nodes in equal states share a class (`_NodeClasses`) whose per-shape terms
are computed once, and the score of one share on card g updates those terms by card g alone, so a new pod
shape on a 10,000-node cluster costs its distinct node states, not nodes × cards × cards.

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
from gpuplane.scheduler.plugins.frag import Shape, ShapeArrays, TypicalPods, pod_shape, sigmoid_score

FGD_CARD: StateKey[IntArray] = StateKey("fgd/card")
"""Per node row, the card FGD chose (valid for the nodes scored this cycle), for the picker."""


@dataclass(slots=True)
class _Cache:
    version: IntArray
    score: IntArray
    card: IntArray


def _terms(free: IntArray, cpu: IntArray, static: BoolArray, shapes: ShapeArrays
           ) -> tuple[IntArray, IntArray, IntArray]:
    """Per node row and typical shape m, in integer milli-GPU, from (k, W) free per card: the free milli on cards
    too small for m, how many cards are big enough, and F_n(m) (k, M each).

    F_n(m) is `frag.fragmentation`'s sum before its weighting by popularity; `static` (k, M) is "the model is
    allowed and m asks for a GPU share", which depends on the node's model only.
    """
    big = free[:, :, None] >= shapes.milli  # (k, W, M)
    small = np.where(big, 0, free[:, :, None]).sum(axis=1)
    count = big.sum(axis=1)
    host = (count >= shapes.cards) & (cpu[:, None] >= shapes.cpu) & static
    per_shape: IntArray = np.where(host, small, free.sum(axis=1)[:, None])
    return small, count, per_shape


def _delta_score(before: IntArray, after: IntArray, shapes: ShapeArrays, scale: float) -> IntArray:
    """⌊100 · sigmoid(Σ_m p_m (F_n(m) before − F_n(m) after) / scale)⌋ over the last axis (M).

    The difference is taken per shape in exact integers before the weighting, so a placement that changes no
    F_n(m) scores exactly 50 (the old form, F(M) before − F(M) after as two weighted sums, gave the same scores
    on every decision of the bundled traces; tests/test_fgd_plus_equivalence.py).
    """
    return sigmoid_score((before - after).astype(np.float64) @ shapes.popularity, scale)


class _NodeClasses:
    """Node states by content, for one cluster state and one M, kept per `ClusterState.node_version`.

    FGD's terms of a node depend only on its usable milli-GPU free per card, which cards are idle (whole, no
    holder), its free CPU and its card model. Nodes equal in these share a class, whose terms (F_n(m) per
    typical shape, and the per-shape small-card sums and big-card counts that the score of one more share
    needs) are computed once, when a node first shows that state. On a large cluster most idle nodes fall into
    a few classes, so the first score of a pod shape costs a few classes, not every node.
    """

    _TERMS = ("free", "idle", "cpu", "small", "count", "static", "before")
    LIMIT_PER_NODE = 4
    """Classes kept per node (at least 4,096) before the table starts over; a node's old states are dropped."""

    def __init__(self, shapes: ShapeArrays, width: int) -> None:
        self.shapes = shapes
        self.width = width
        self.version = np.full(0, -1, np.int64)
        self.class_of = np.zeros(0, np.int64)
        self._ids: dict[bytes, int] = {}
        m = len(shapes.cpu)
        self.size = 0
        self.free = np.zeros((0, width), np.int64)
        self.idle = np.zeros((0, width), np.bool_)
        self.cpu = np.zeros(0, np.int64)
        self.small = np.zeros((0, m), np.int64)
        self.count = np.zeros((0, m), np.int64)
        self.static = np.zeros((0, m), np.bool_)
        self.before = np.zeros((0, m), np.int64)

    def full(self, nodes: int) -> bool:
        return self.size > self.LIMIT_PER_NODE * max(nodes, 1024)

    def of(self, state: ClusterState, nodes: IntArray) -> IntArray:
        """The class of each of `nodes` (new states get a class and their terms)."""
        n = state.size
        if len(self.version) < n:
            grown = max(n, 2 * len(self.version))
            self.version = np.concatenate([self.version, np.full(grown - len(self.version), -1, np.int64)])
            self.class_of = np.concatenate([self.class_of, np.zeros(grown - len(self.class_of), np.int64)])
        versions = state.node_version[nodes]
        stale = nodes[self.version[nodes] != versions]
        if len(stale):
            self._assign(state, stale)
        out: IntArray = self.class_of[nodes]
        return out

    def _assign(self, state: ClusterState, stale: IntArray) -> None:
        usable = state.card_valid[stale] & ~state.card_mig[stale]
        free = np.where(usable, state.card_milli_free[stale], 0)
        idle = usable & (free == MILLI_PER_CARD) & (state.card_holders[stale] == 0)
        cpu = state.cpu_free[stale]
        model = state.model_idx[stale].astype(np.int64)
        rows = np.ascontiguousarray(np.concatenate(
            [free, usable.astype(np.int64) + 2 * idle, cpu[:, None], model[:, None]], axis=1))
        keys: list[bytes] = rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize)))[:, 0].tolist()
        ids = self._ids
        fresh: list[int] = []
        found: list[int] = []
        for i, key in enumerate(keys):
            cid = ids.get(key)
            if cid is None:
                cid = ids[key] = self.size + len(fresh)
                fresh.append(i)
            found.append(cid)
        if fresh:
            self._add(free[fresh], idle[fresh], cpu[fresh], model[fresh])
        self.class_of[stale] = found
        self.version[stale] = state.node_version[stale]

    def _add(self, free: IntArray, idle: BoolArray, cpu: IntArray, model: IntArray) -> None:
        shapes = self.shapes
        static = shapes.model_ok[:, model].T & (shapes.milli > 0)
        small, count, before = _terms(free, cpu, static, shapes)
        start, end = self.size, self.size + len(cpu)
        if end > len(self.cpu):  # capacity doubles, so adding classes one at a time stays linear
            grown = max(end, 2 * len(self.cpu), 64)
            for name in self._TERMS:
                old = getattr(self, name)
                new = np.zeros((grown, *old.shape[1:]), old.dtype)
                new[:start] = old[:start]
                setattr(self, name, new)
        self.free[start:end] = free
        self.idle[start:end] = idle
        self.cpu[start:end] = cpu
        self.small[start:end] = small
        self.count[start:end] = count
        self.static[start:end] = static
        self.before[start:end] = before
        self.size = end

    def one_share(self, classes: IntArray, share: int, cpu_milli: int, scale: float) -> IntArray:
        """(k, W): the score of `share` milli more on each card of each class, from the class's terms.

        Taking d from card g changes only R(g) and the CPU, so for each typical shape m the small-card sum
        and the big-card count move by card g's terms alone (before: R(g), after: R(g) − d). Cards that
        cannot take the share get meaningless values; the caller masks them.
        """
        shapes = self.shapes
        d_m = shapes.milli
        r = self.free[classes][:, :, None]  # (k, W, 1)
        r_after = r - share
        small = self.small[classes][:, None, :] - np.where(r < d_m, r, 0) + np.where(r_after < d_m, r_after, 0)
        count = self.count[classes][:, None, :] - (r >= d_m) + (r_after >= d_m)
        cpu_after = self.cpu[classes] - cpu_milli
        host = (count >= shapes.cards) & (cpu_after[:, None, None] >= shapes.cpu) & self.static[classes][:, None, :]
        total_after = self.free[classes].sum(axis=1) - share
        after = np.where(host, small, total_after[:, None, None])
        return _delta_score(self.before[classes][:, None, :], after, shapes, scale)


def _unique(values: IntArray) -> tuple[IntArray, IntArray]:
    """Distinct values and, per entry, the index of its value (small batches skip the sort)."""
    if len(values) <= 8:
        return values, np.arange(len(values))
    uniq, inverse = np.unique(values, return_inverse=True)
    return uniq, inverse.reshape(-1)


class FgdScore:
    name = "FGD"
    delta_scale = 1000.0
    """Δ is scored as ⌊100 · sigmoid(Δ / delta_scale)⌋; a coarser scale makes more nodes tie."""

    def __init__(self, typical: TypicalPods) -> None:
        self.typical = typical
        self._state_id = -1
        self._arrays: ShapeArrays | None = None
        self._node_classes: _NodeClasses | None = None
        self._caches: dict[tuple[object, ...], _Cache] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _reset(self, state: ClusterState) -> ShapeArrays:
        self._state_id = state.uid
        self._arrays = ShapeArrays.build(self.typical, state)
        self._node_classes = None
        self._caches.clear()
        return self._arrays

    def _shapes(self, state: ClusterState) -> ShapeArrays:
        if self._arrays is None or self._state_id != state.uid:
            return self._reset(state)
        return self._arrays

    def _classes(self, state: ClusterState, shapes: ShapeArrays) -> _NodeClasses:
        classes = self._node_classes
        if classes is None or classes.shapes is not shapes or classes.width != state.width \
                or classes.full(state.size):
            classes = self._node_classes = _NodeClasses(shapes, state.width)
        return classes

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
        """Scores and chosen cards of `nodes`; `card_ok` (nodes × cards) is what the filters allow.

        Score = ⌊100 · sigmoid((F_n(M) before − F_n(M) after) / delta_scale)⌋. A share on one card scores every
        card that can take it and keeps the first with the best score; whole cards take the lowest idle cards.
        The terms come per node class (`_NodeClasses`), so nodes in equal states are computed once.
        """
        scale = self.delta_scale
        gpu = pod.gpu
        none = np.full(len(nodes), -1, np.int64)
        if gpu is None and not pod.cpu_milli:
            return np.full(len(nodes), 100, np.int64), none
        classes = self._classes(state, shapes)
        uniq, inverse = _unique(classes.of(state, nodes))
        if isinstance(gpu, Fraction):
            d = gpu.compute_milli
            usable = state.card_valid[nodes] & ~state.card_mig[nodes]
            free = classes.free[uniq][inverse]
            fits = usable & (free >= d)
            if card_ok is not None:
                fits &= card_ok
            elif gpu.memory_mib:
                fits &= state.card_mem_free[nodes] >= gpu.memory_mib
            per_card = np.where(fits, classes.one_share(uniq, d, pod.cpu_milli, scale)[inverse], -1)
            if gpu.count > 1:
                # A share on several cards: the `count` best cards alone (stable: lower index first on a tie)
                # take it; the score is the node's fragmentation change, and the picker chooses the cards.
                best = np.argsort(-per_card, axis=1, kind="stable")[:, : gpu.count]
                taken = np.zeros(free.shape, np.bool_)
                np.put_along_axis(taken, best, True, axis=1)
                taken &= fits
                members = uniq[inverse]
                _, _, after = _terms(free - d * taken, classes.cpu[members] - pod.cpu_milli,
                                     classes.static[members], shapes)
                return _delta_score(classes.before[members], after, shapes, scale), none
            card = np.argmax(per_card, axis=1)  # the first card with the best integer score
            return per_card[np.arange(len(nodes)), card], card.astype(np.int64)
        free = classes.free[uniq]
        if isinstance(gpu, WholeCards):
            idle = classes.idle[uniq]
            free = np.where(idle & (np.cumsum(idle, axis=1) <= gpu.count), 0, free)
        _, _, after = _terms(free, classes.cpu[uniq] - pod.cpu_milli, classes.static[uniq], shapes)
        return _delta_score(classes.before[uniq], after, shapes, scale)[inverse], none


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
