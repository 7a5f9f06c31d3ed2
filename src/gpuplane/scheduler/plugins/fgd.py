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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuplane.model import MILLI_PER_CARD, CardShare, ClusterState, Fraction, PodRequest, WholeCards
from gpuplane.model.cluster import row_any
from gpuplane.scheduler.framework import CARD_OK, BoolArray, CardPick, CycleState, FloatArray, IntArray, StateKey
from gpuplane.scheduler.plugins.cards import CardOrder, OrderedCardPicker
from gpuplane.scheduler.plugins.frag import Shape, ShapeArrays, TypicalPods, pod_shape, sigmoid_score

FGD_CARD: StateKey[IntArray] = StateKey("fgd/card")
"""Per node row, the card FGD chose (valid for the nodes scored this cycle), for the picker."""


@dataclass(slots=True)
class _Cache:
    version: IntArray
    card: IntArray
    value: FloatArray
    """What `score` returns: the FGD score plus the variant's node terms (`_with_node_terms`)."""


def _shape_terms(free: IntArray, cpu: IntArray, static: BoolArray, shapes: ShapeArrays
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
    F_n(m) scores exactly 50, and the weighting is an `einsum`, whose sum for a row does not depend on how many
    rows are computed with it (a BLAS matrix product's does, in the last bit). The old form, F(M) before −
    F(M) after as two BLAS-weighted sums, gave the same scores on every decision of the bundled traces
    (tests/test_fgd_plus_equivalence.py).
    """
    delta = np.einsum("...m,m->...", (before - after).astype(np.float64), shapes.popularity)
    return sigmoid_score(delta, scale)


@dataclass(frozen=True, slots=True)
class _Terms:
    """What FGD needs of k node states: usable milli free per card (0 on MIG and padding cards), which cards
    are usable and idle (whole, no holder), free CPU, and per typical shape the `_shape_terms` and `static`."""

    free: IntArray  # (k, W)
    usable: BoolArray  # (k, W)
    idle: BoolArray  # (k, W)
    cpu: IntArray  # (k,)
    static: BoolArray  # (k, M)
    small: IntArray  # (k, M)
    count: IntArray  # (k, M)
    before: IntArray  # (k, M)

    @staticmethod
    def of_rows(milli_free: IntArray, valid: BoolArray, mig: BoolArray, holders: IntArray, cpu: IntArray,
                static: BoolArray, shapes: ShapeArrays) -> _Terms:
        usable = valid & ~mig
        free = np.where(usable, milli_free, 0)
        idle = (free == MILLI_PER_CARD) & (holders == 0)  # a whole free card is usable (others have 0 free)
        small, count, before = _shape_terms(free, cpu, static, shapes)
        return _Terms(free, usable, idle, cpu, static, small, count, before)

    def take(self, rows: IntArray) -> _Terms:
        return _Terms(self.free[rows], self.usable[rows], self.idle[rows], self.cpu[rows], self.static[rows],
                      self.small[rows], self.count[rows], self.before[rows])

    def one_share(self, share: int, cpu_milli: int, shapes: ShapeArrays, scale: float) -> IntArray:
        """(k, W): the score of `share` milli more on each card that can take it (−1 on the others); only those
        cards are evaluated.

        Taking d from card g changes only R(g) and the CPU, so for each typical shape m the small-card sum
        and the big-card count move by card g alone: a card already too small for m takes d off the sum; a card
        that drops below d_m adds R(g) − d to the sum and leaves the count.
        """
        rows, cards = np.nonzero(self.usable & (self.free >= share))
        out = np.full(self.free.shape, -1, np.int64)
        if not len(rows):
            return out
        r = self.free[rows, cards][:, None]  # (P, 1)
        d_m = shapes.milli
        r_after = r - share
        below = r < d_m  # (P, M)
        crossing = (r_after < d_m) & ~below
        small = self.small[rows] - share * below + np.where(crossing, r_after, 0)
        count = self.count[rows] - crossing
        host = (count >= shapes.cards) & ((self.cpu[rows] - cpu_milli)[:, None] >= shapes.cpu) \
            & self.static[rows]
        total_after = self.free.sum(axis=1)[rows] - share
        after = np.where(host, small, total_after[:, None])
        out[rows, cards] = _delta_score(self.before[rows], after, shapes, scale)
        return out


class _NodeClasses:
    """Node states by content, for one cluster state and one M, kept per `ClusterState.node_version`.

    FGD's terms of a node depend only on its cards' milli free, holders, MIG mode and validity, its free CPU and
    its card model. Nodes equal in these share a class whose `_Terms` are computed once, when a node first
    shows that state. On a large cluster most idle nodes fall into a few classes, so the first score of a pod
    shape costs a few classes, not every node.
    """

    LIMIT_PER_NODE = 4
    """Classes kept per node (at least 4,096) before the table starts over; a node's old states are dropped."""

    def __init__(self, shapes: ShapeArrays, static: BoolArray, width: int) -> None:
        self.shapes = shapes
        self.static_of_model = static
        self.width = width
        self.version = np.full(0, -1, np.int64)
        self.class_of = np.zeros(0, np.int64)
        self._ids: dict[tuple[bytes, bytes, bytes, bytes, int, int], int] = {}
        self.size = 0
        m = len(shapes.cpu)
        self._terms = _Terms(np.zeros((0, width), np.int64), np.zeros((0, width), np.bool_),
                             np.zeros((0, width), np.bool_), np.zeros(0, np.int64), np.zeros((0, m), np.bool_),
                             np.zeros((0, m), np.int64), np.zeros((0, m), np.int64), np.zeros((0, m), np.int64))

    def full(self, nodes: int) -> bool:
        return self.size > self.LIMIT_PER_NODE * max(nodes, 1024)

    def of(self, state: ClusterState, nodes: IntArray) -> IntArray:
        """The class of each of `nodes` (new states get a class and their terms)."""
        n = state.size
        if len(self.version) < n:
            grown = max(n, 2 * len(self.version))
            self.version = np.concatenate([self.version, np.full(grown - len(self.version), -1, np.int64)])
            self.class_of = np.concatenate([self.class_of, np.zeros(grown - len(self.class_of), np.int64)])
        stale = nodes[self.version[nodes] != state.node_version[nodes]]
        if len(stale):
            self._assign(state, stale)
        out: IntArray = self.class_of[nodes]
        return out

    def terms(self, classes: IntArray) -> _Terms:
        return self._terms.take(classes)

    def _assign(self, state: ClusterState, stale: IntArray) -> None:
        milli, holders = state.card_milli_free[stale], state.card_holders[stale]
        valid, mig = state.card_valid[stale], state.card_mig[stale]
        cpu = state.cpu_free[stale]
        model = state.model_idx[stale]
        keys = zip(_row_bytes(milli), _row_bytes(holders), _row_bytes(valid), _row_bytes(mig), cpu.tolist(),
                   model.tolist(), strict=True)
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
            self._add(_Terms.of_rows(milli[fresh], valid[fresh], mig[fresh], holders[fresh], cpu[fresh],
                                     self.static_of_model[model[fresh]], self.shapes))
        self.class_of[stale] = found
        self.version[stale] = state.node_version[stale]

    def _add(self, new: _Terms) -> None:
        start, end = self.size, self.size + len(new.cpu)
        t = self._terms
        if end > len(t.cpu):  # capacity doubles, so adding classes one at a time stays linear
            grown = max(end, 2 * len(t.cpu), 64)
            arrays = []
            for old in (t.free, t.usable, t.idle, t.cpu, t.static, t.small, t.count, t.before):
                wider = np.zeros((grown, *old.shape[1:]), old.dtype)
                wider[:start] = old[:start]
                arrays.append(wider)
            t = self._terms = _Terms(*arrays)
        for into, rows in ((t.free, new.free), (t.usable, new.usable), (t.idle, new.idle), (t.cpu, new.cpu),
                           (t.static, new.static), (t.small, new.small), (t.count, new.count),
                           (t.before, new.before)):
            into[start:end] = rows
        self.size = end


def _row_bytes(rows: npt.NDArray[np.generic]) -> list[bytes]:
    """Each row of a 2-D array as its bytes (`row.tobytes()`), for dictionary keys."""
    contiguous = np.ascontiguousarray(rows)
    out: list[bytes] = contiguous.view(np.dtype((np.void, contiguous.shape[1] * contiguous.itemsize)))[:, 0].tolist()
    return out


SMALL_BATCH = 32
"""Up to this many nodes are scored from their own rows; more are grouped into classes first."""


def _distinct(values: IntArray, bound: int) -> tuple[IntArray, IntArray]:
    """`np.unique(values, return_inverse=True)` for values in [0, bound), by marking instead of sorting."""
    present = np.zeros(bound, np.bool_)
    present[values] = True
    distinct = np.flatnonzero(present)
    position = np.zeros(bound, np.int64)
    position[distinct] = np.arange(len(distinct))
    return distinct, position[values]


def _static_of_model(shapes: ShapeArrays) -> BoolArray:
    """(models + 1, M): whether typical shape m can use a node of each card model and asks for a GPU share
    (the last row: nodes without a GPU model, as `model_idx` −1 indexes it)."""
    out: BoolArray = np.ascontiguousarray((shapes.model_ok & (shapes.milli > 0)[:, None]).T)
    return out


class FgdScore:
    name = "FGD"
    delta_scale = 1000.0
    """Δ is scored as ⌊100 · sigmoid(Δ / delta_scale)⌋; a coarser scale makes more nodes tie."""

    def __init__(self, typical: TypicalPods) -> None:
        self.typical = typical
        self._state_id = -1
        self._arrays: ShapeArrays | None = None
        self._static = np.zeros((0, 0), np.bool_)
        self._node_classes: _NodeClasses | None = None
        self._caches: dict[tuple[object, ...], _Cache] = {}

    # ------------------------------------------------------------------ bookkeeping
    def _reset(self, state: ClusterState) -> ShapeArrays:
        self._state_id = state.uid
        self._arrays = ShapeArrays.build(self.typical, state)
        self._static = _static_of_model(self._arrays)
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
            classes = self._node_classes = _NodeClasses(shapes, self._static, state.width)
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
            cache = _Cache(np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.float64))
            self._caches[key] = cache
        # One contiguous comparison over the cluster, then a look-up per asked node (cheaper than two gathers).
        stale = nodes[(cache.version[:n] != state.node_version[:n])[nodes]]
        if len(stale):
            card_ok = cycle.find(CARD_OK)
            scores, cards = self._compute(pod, state, stale, shapes,
                                          card_ok[stale] if card_ok is not None else None)
            cache.card[stale] = cards
            cache.value[stale] = self._with_node_terms(state, stale, scores)
            cache.version[stale] = state.node_version[stale]
        cycle.write(FGD_CARD, cache.card)
        out: FloatArray = cache.value[nodes]
        return out

    def _with_node_terms(self, state: ClusterState, nodes: IntArray, scores: IntArray) -> FloatArray:
        """The score `score` returns for `nodes` from their FGD scores. Variants add terms that depend on the
        node's state alone; they are cached with the FGD score, so they too are recomputed only for nodes that
        changed (`ClusterState.node_version`)."""
        return scores.astype(np.float64)

    def _compute(self, pod: PodRequest, state: ClusterState, nodes: IntArray, shapes: ShapeArrays,
                 card_ok: BoolArray | None = None) -> tuple[IntArray, IntArray]:
        """Scores and chosen cards of `nodes`; `card_ok` (nodes × cards) is what the filters allow.

        Score = ⌊100 · sigmoid((F_n(M) before − F_n(M) after) / delta_scale)⌋. A share on one card scores every
        card that can take it and keeps the first with the best score; whole cards take the lowest idle cards.
        A large batch (a pod shape's first score) is grouped into node classes (`_NodeClasses`), so nodes in
        equal states are computed once.
        """
        gpu = pod.gpu
        if gpu is None and not pod.cpu_milli:
            return np.full(len(nodes), 100, np.int64), np.full(len(nodes), -1, np.int64)
        if len(nodes) <= SMALL_BATCH:
            return self._compute_rows(pod, state, nodes, shapes, card_ok)
        return self._compute_classes(pod, state, nodes, shapes, card_ok)

    def _compute_rows(self, pod: PodRequest, state: ClusterState, nodes: IntArray, shapes: ShapeArrays,
                      card_ok: BoolArray | None) -> tuple[IntArray, IntArray]:
        """A few nodes, from their own rows; at this size the cost is the number of numpy calls, not their size.
        A share: the nodes' terms, then one evaluation per card that can take it. Otherwise F_n(m) of each node
        as it is and as it would be, in one `_shape_terms` call over 2k rows."""
        scale = self.delta_scale
        gpu = pod.gpu
        cpu = state.cpu_free[nodes]
        static = self._static[state.model_idx[nodes]]
        if isinstance(gpu, Fraction):
            terms = _Terms.of_rows(state.card_milli_free[nodes], state.card_valid[nodes], state.card_mig[nodes],
                                   state.card_holders[nodes], cpu, static, shapes)
            per_card = terms.one_share(gpu.compute_milli, pod.cpu_milli, shapes, scale)
            return self._place_share(gpu, pod.cpu_milli, state, nodes, shapes, card_ok, terms.usable, terms.free,
                                     per_card, lambda: (terms.before, cpu, static))
        free = np.where(state.card_valid[nodes] & ~state.card_mig[nodes], state.card_milli_free[nodes], 0)
        after_free = free
        if isinstance(gpu, WholeCards):
            idle = (free == MILLI_PER_CARD) & (state.card_holders[nodes] == 0)
            after_free = np.where(idle & (np.cumsum(idle, axis=1) <= gpu.count), 0, free)
        _, _, per_shape = _shape_terms(np.concatenate([free, after_free]),
                                       np.concatenate([cpu, cpu - pod.cpu_milli]),
                                       np.concatenate([static, static]), shapes)
        k = len(nodes)
        return _delta_score(per_shape[:k], per_shape[k:], shapes, scale), np.full(k, -1, np.int64)

    def _compute_classes(self, pod: PodRequest, state: ClusterState, nodes: IntArray, shapes: ShapeArrays,
                         card_ok: BoolArray | None) -> tuple[IntArray, IntArray]:
        """Many nodes (a pod shape's first score): per node class (`_NodeClasses`), so nodes in equal states are
        computed once, then spread back to the nodes."""
        scale = self.delta_scale
        gpu = pod.gpu
        classes = self._classes(state, shapes)
        uniq, inverse = _distinct(classes.of(state, nodes), classes.size)
        terms = classes.terms(uniq)
        if isinstance(gpu, Fraction):
            d = gpu.compute_milli
            per_class = terms.one_share(d, pod.cpu_milli, shapes, scale)
            if gpu.count == 1:
                # A node whose filters allow every card its class could take decides as its class; only the
                # others (a card ruled out by memory, a card policy, ...) are placed one by one.
                card = np.argmax(per_class, axis=1)
                score, chosen = per_class[np.arange(len(uniq)), card][inverse], card[inverse]
                possible = (terms.usable & (terms.free >= d))[inverse]
                if card_ok is not None:
                    odd = np.flatnonzero(row_any(possible & ~card_ok))
                elif gpu.memory_mib:
                    odd = np.flatnonzero(row_any(possible & (state.card_mem_free[nodes] < gpu.memory_mib)))
                else:
                    odd = np.zeros(0, np.int64)
                if len(odd):
                    score[odd], chosen[odd] = self._place_share(
                        gpu, pod.cpu_milli, state, nodes[odd], shapes, None if card_ok is None else card_ok[odd],
                        terms.usable[inverse[odd]], terms.free[inverse[odd]], per_class[inverse[odd]],
                        lambda: (terms.before[inverse[odd]], terms.cpu[inverse[odd]], terms.static[inverse[odd]]))
                return score, chosen.astype(np.int64)

            def node_terms() -> tuple[IntArray, IntArray, BoolArray]:
                return terms.before[inverse], terms.cpu[inverse], terms.static[inverse]

            return self._place_share(gpu, pod.cpu_milli, state, nodes, shapes, card_ok, terms.usable[inverse],
                                     terms.free[inverse], per_class[inverse], node_terms)
        free = terms.free
        if isinstance(gpu, WholeCards):
            free = np.where(terms.idle & (np.cumsum(terms.idle, axis=1) <= gpu.count), 0, free)
        _, _, after = _shape_terms(free, terms.cpu - pod.cpu_milli, terms.static, shapes)
        scores = _delta_score(terms.before, after, shapes, scale)
        return scores[inverse], np.full(len(nodes), -1, np.int64)

    def _place_share(self, gpu: Fraction, cpu_milli: int, state: ClusterState, nodes: IntArray, shapes: ShapeArrays,
                     card_ok: BoolArray | None, usable: BoolArray, free: IntArray, per_card: IntArray,
                     node_terms: Callable[[], tuple[IntArray, IntArray, BoolArray]]) -> tuple[IntArray, IntArray]:
        """A share's node scores and cards from the score of the share on each card (`per_card`, k × W): cards
        the filters or the free milli rule out score −1. `node_terms` gives (F_n(m) now, free CPU, static) of
        the nodes, which a share on several cards needs."""
        d = gpu.compute_milli
        fits = usable & (free >= d)
        if card_ok is not None:
            fits &= card_ok
        elif gpu.memory_mib:
            fits &= state.card_mem_free[nodes] >= gpu.memory_mib
        per_card = np.where(fits, per_card, -1)
        if gpu.count > 1:
            # A share on several cards: the `count` best cards alone (stable: lower index first on a tie)
            # take it; the score is the node's fragmentation change, and the picker chooses the cards.
            best = np.argsort(-per_card, axis=1, kind="stable")[:, : gpu.count]
            taken = np.zeros(free.shape, np.bool_)
            np.put_along_axis(taken, best, True, axis=1)
            taken &= fits
            before, cpu, static = node_terms()
            _, _, after = _shape_terms(free - d * taken, cpu - cpu_milli, static, shapes)
            return _delta_score(before, after, shapes, self.delta_scale), np.full(len(nodes), -1, np.int64)
        card = np.argmax(per_card, axis=1)  # the first card with the best integer score
        return per_card[np.arange(len(nodes)), card], card.astype(np.int64)


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

    def _with_node_terms(self, state: ClusterState, nodes: IntArray, scores: IntArray) -> FloatArray:
        used = (state.gpu_milli_used[nodes] > 0) | (state.cpu_free[nodes] < state.cpu_cap[nodes])
        out: FloatArray = scores.astype(np.float64) + 0.5 * used
        return out
