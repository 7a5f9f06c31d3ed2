"""The FGD paper's baseline node policies, defined as its simulator defines them.

Every score is an integer in 0…100 (the simulator's only score plugin, so ties are broken at random by
the framework). Normalisation constants: 128,000 milli-CPU and 8,000 milli-GPU (an 8-card node).

- random: every feasible node scores the same; cards are chosen at random among those that fit.
- dotprod: 100 · (1 − (free · request) / 2) over [CPU, GPU], each divided by its max spec (Tetris).
- gpu-clustering: bands by the GPU classes already on the node (only this class (75, 100], mixed
  with it (50, 75], empty (25, 50], only others (0, 25]), plus 25 · used share of 8,000 milli-GPU.
- gpu-packing: use shared cards first ([50, 100]), then free cards of a used node ([33, 50]), then
  idle nodes (≤ 33).
- bestfit: 100 · (1 − Σ ½ (free − request) / max spec) over CPU and GPU, min–max normalised.
"""

from __future__ import annotations

import numpy as np

from gpuplane.model import MILLI_PER_CARD, ClusterState, Fraction, MigSlice, PodRequest, WholeCards
from gpuplane.scheduler.framework import BoolArray, CardPick, CycleState, FloatArray, IntArray
from gpuplane.scheduler.plugins.cards import CardOrder, OrderedCardPicker

MAX_SPEC_CPU = 128_000
MAX_SPEC_GPU = 8_000


def _node_free_gpu(state: ClusterState, nodes: IntArray) -> IntArray:
    usable = state.card_valid[nodes] & ~state.card_mig[nodes]
    out: IntArray = np.where(usable, state.card_milli_free[nodes], 0).sum(axis=1)
    return out


class RandomScore:
    """One feasible node drawn uniformly (the simulator's PreScore pick scores 100, the rest 0)."""

    name = "Random"

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        scores = np.zeros(len(nodes), np.float64)
        if len(nodes):
            scores[self.rng.integers(len(nodes))] = 100.0
        return scores


class RandomCardPicker:
    """Random card(s) among those that fit, from a seeded generator."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self._fallback = OrderedCardPicker("random", CardOrder.PACK)

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        gpu = pod.gpu
        cards = np.flatnonzero(eligible)
        if isinstance(gpu, Fraction) and len(cards):
            free = state.milli_free_for(pod, node)
            fitting = [int(c) for c in cards if free[c] >= gpu.compute_milli]
            if len(fitting) < gpu.count:
                return None
            only = np.zeros_like(eligible)
            if gpu.count == 1:
                only[fitting[int(self.rng.integers(len(fitting)))]] = True
            else:
                only[self.rng.choice(fitting, gpu.count, replace=False)] = True
            return self._fallback.pick(cycle, pod, state, node, only)
        if isinstance(gpu, WholeCards) and len(cards) >= gpu.count:
            only = np.zeros_like(eligible)
            only[self.rng.choice(cards, gpu.count, replace=False)] = True
            return self._fallback.pick(cycle, pod, state, node, only)
        return self._fallback.pick(cycle, pod, state, node, eligible)


class DotProdScore:
    name = "DotProd"

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        free_cpu = state.cpu_free[nodes] / MAX_SPEC_CPU
        free_gpu = _node_free_gpu(state, nodes) / MAX_SPEC_GPU
        dot = free_cpu * (pod.cpu_milli / MAX_SPEC_CPU) + free_gpu * (pod.gpu_milli_total / MAX_SPEC_GPU)
        return np.floor(100.0 * (1.0 - dot / 2.0))


def gpu_class(pod: PodRequest) -> int:
    """0 CPU-only, 1 GPU-sharing, else the number of whole cards + 1 (2: one card, 3: two, …)."""
    gpu = pod.gpu
    if isinstance(gpu, WholeCards):
        return gpu.count + 1
    if isinstance(gpu, Fraction):
        return 1
    return 0


class GpuClusteringScore:
    name = "GpuClustering"
    CLASSES = 10  # CPU-only, sharing, 1…8 whole cards

    def __init__(self) -> None:
        self._state_id = -1
        self._version = np.zeros(0, np.int64)
        self._present = np.zeros((0, self.CLASSES), np.bool_)

    def _classes(self, state: ClusterState, nodes: IntArray) -> BoolArray:
        """Which GPU classes each node holds, recomputed only for nodes that changed."""
        n = state.size
        if self._state_id != state.uid or len(self._version) < n:
            self._state_id = state.uid
            self._version = np.full(n, -1, np.int64)
            self._present = np.zeros((n, self.CLASSES), np.bool_)
        for node in nodes[self._version[nodes] != state.node_version[nodes]]:
            row = np.zeros(self.CLASSES, np.bool_)
            for name in state.node_pods[int(node)]:
                row[min(gpu_class(state.bindings[name].request), self.CLASSES - 1)] = True
            row[0] = False
            self._present[node] = row
            self._version[node] = state.node_version[node]
        out: BoolArray = self._present[nodes]
        return out

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        mine = min(gpu_class(pod), self.CLASSES - 1)
        if mine == 0:
            return np.zeros(len(nodes), np.float64)
        present = self._classes(state, nodes)
        kinds = present.sum(axis=1)
        has_mine = present[:, mine]
        band = np.where(has_mine, np.where(kinds == 1, 75, 50), np.where(kinds == 0, 25, 0))
        used = (MAX_SPEC_GPU - _node_free_gpu(state, nodes)) * 25 // MAX_SPEC_GPU
        return (band + used).astype(np.float64)


class GpuPackingScore:
    name = "GpuPacking"

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        gpu = pod.gpu
        if gpu is None or isinstance(gpu, MigSlice):
            return np.zeros(len(nodes), np.float64)
        valid = state.card_valid[nodes] & ~state.card_mig[nodes]
        left = np.where(valid, state.card_milli_free[nodes], -1)
        cards = valid.sum(axis=1)
        fully_free = (left == MILLI_PER_CARD).sum(axis=1)
        idle_node = np.maximum(100 // 3 - fully_free, fully_free)
        if isinstance(gpu, WholeCards):
            # Whole cards can only come from fully free cards: case 2 on a used node.
            used_node = np.maximum(100 // 2 - gpu.count, 100 // 3)
            whole_scores: FloatArray = np.where(fully_free == cards, idle_node, used_node).astype(np.float64)
            return whole_scores
        # A sharing pod takes the card with the least milli left that still fits it.
        fits = np.where(left >= gpu.compute_milli, left, MILLI_PER_CARD + 1)
        best = fits.min(axis=1)
        shared = np.maximum(100 - (best * 100 // MILLI_PER_CARD) // 10, 100 // 2)
        on_free_card = np.where(best == MILLI_PER_CARD, 100 // 2 - 1, shared)
        out = np.where(fully_free == cards, idle_node, np.where(best > MILLI_PER_CARD, 0, on_free_card))
        return out.astype(np.float64)


class BestFitScore:
    name = "BestFit"

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        left_cpu = (state.cpu_free[nodes] - pod.cpu_milli) / MAX_SPEC_CPU
        left_gpu = (_node_free_gpu(state, nodes) - pod.gpu_milli_total) / MAX_SPEC_GPU
        raw = np.floor((1.0 - (0.5 * left_cpu + 0.5 * left_gpu)) * 100.0).astype(np.int64)
        low, high = int(raw.min()), int(raw.max())
        if high == low:
            return np.zeros(len(nodes), np.float64)
        return ((raw - low) * 100 // (high - low)).astype(np.float64)
