"""GPU fragmentation as the FGD paper defines it (Weng et al., USENIX ATC '23), vectorised.

For a node n with free milli-GPU R(g) on each card and free CPU c, and a task shape m (CPU c_m,
cards k_m, per-card share d_m, allowed models):

    F_n(m) = Σ_g R(g)                 if d_m = 0 (CPU-only task), the model is not allowed,
                                        fewer than k_m cards have R(g) ≥ d_m, or c < c_m
    F_n(m) = Σ_g R(g) · [R(g) < d_m]  otherwise (only the cards too small for m count)

F_n(M) = Σ_m p_m F_n(m) over the typical-pod set M with popularities p_m. Memory is ignored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuplane.model import MILLI_PER_CARD, ClusterState, Fraction, PodRequest, WholeCards

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

Shape = tuple[int, int, int, frozenset[str] | None]
"""(cpu milli, per-card milli, cards, allowed models) of a pod, as FGD's typical-pod set keys it."""


def pod_shape(request: PodRequest) -> Shape:
    gpu = request.gpu
    if isinstance(gpu, WholeCards):
        return request.cpu_milli, MILLI_PER_CARD, gpu.count, request.models
    if isinstance(gpu, Fraction):
        return request.cpu_milli, gpu.compute_milli, gpu.count, request.models
    return request.cpu_milli, 0, 0, request.models


@dataclass(frozen=True, slots=True)
class TypicalPods:
    """The target workload M: shapes with popularities summing to 1."""

    shapes: tuple[Shape, ...]
    popularity: FloatArray

    @staticmethod
    def from_counts(counts: Counter[Shape], threshold: float = 0.95, step: int = 10) -> TypicalPods:
        """Most frequent shapes first, taken `step` at a time until `threshold` of all pods are covered,
        then renormalised (the FGD simulator's `GetTypicalPods`: default step 10, so the set is cut at
        a multiple of 10 shapes). Ties in frequency go to the larger shape (CPU, then GPU share, then
        cards), as the simulator's reversed sort orders them.
        """
        total = sum(counts.values())
        if total <= 0:
            raise ValueError("typical pods need at least one pod")
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], -kv[0][1], -kv[0][2],
                                                        sorted(kv[0][3] or ())))
        kept: list[tuple[Shape, float]] = []
        covered = 0.0
        while covered < threshold * total and len(kept) < len(ranked):
            for shape, count in ranked[len(kept): len(kept) + step]:
                kept.append((shape, float(count)))
                covered += count
        weights = np.array([w for _, w in kept], np.float64)
        return TypicalPods(tuple(s for s, _ in kept), weights / weights.sum())

    @staticmethod
    def from_workload(pods: Iterable[PodRequest], threshold: float = 0.95, step: int = 10) -> TypicalPods:
        return TypicalPods.from_counts(Counter(pod_shape(p) for p in pods), threshold, step)


@dataclass(frozen=True, slots=True)
class ShapeArrays:
    """Typical pods as arrays for one cluster's model table."""

    cpu: IntArray  # (M,)
    milli: IntArray  # (M,)
    cards: IntArray  # (M,)
    model_ok: BoolArray  # (M, models + 1): the last column is "no GPU model"
    popularity: FloatArray  # (M,)

    @staticmethod
    def build(typical: TypicalPods, state: ClusterState) -> ShapeArrays:
        rows = [state.model_allowed(models) for *_, models in typical.shapes]
        return ShapeArrays(
            cpu=np.array([s[0] for s in typical.shapes], np.int64),
            milli=np.array([s[1] for s in typical.shapes], np.int64),
            cards=np.array([s[2] for s in typical.shapes], np.int64),
            model_ok=np.array(rows, np.bool_).reshape(len(rows), -1),
            popularity=typical.popularity,
        )


def fragmentation(free: IntArray, cpu_free: IntArray, model_idx: npt.NDArray[np.integer], shapes: ShapeArrays
                  ) -> FloatArray:
    """F_n(M) for a batch of node states.

    `free` is (..., G) milli-GPU free per card (padding 0), `cpu_free` and `model_idx` are (...,).
    Returns F with the batch shape.
    """
    values = free.astype(np.float64)
    total = values.sum(axis=-1)
    d = shapes.milli.reshape((-1, *((1,) * free.ndim)))  # (M, 1.., 1)
    big_enough = values[None] >= d  # (M, ..., G)
    # Reductions over the short card axis are slow as ufunc reduces: the sum of small cards is a matmul
    # with ones, and the count of big-enough cards reads 8 flags at a time as one uint64.
    small = (values[None] * ~big_enough) @ np.ones(free.shape[-1])  # (M, ...)
    count = _count_last_axis(big_enough)
    extra = (1,) * (free.ndim - 1)
    hostable = (count >= shapes.cards.reshape((-1, *extra))) \
        & (cpu_free[None] >= shapes.cpu.reshape((-1, *extra))) \
        & shapes.model_ok[:, model_idx] \
        & (shapes.milli.reshape((-1, *extra)) > 0)
    per_shape = np.where(hostable, small, total[None])
    out: FloatArray = np.tensordot(shapes.popularity, per_shape, axes=1)
    return out


_BYTE_SUM = np.uint64(0x0101010101010101)
_TOP_BYTE = np.uint64(56)


def _count_last_axis(flags: BoolArray) -> IntArray:
    """How many flags are set along the last axis (its length must be a multiple of 8)."""
    if flags.shape[-1] % 8:
        counted: IntArray = flags.sum(axis=-1)
        return counted
    words = np.ascontiguousarray(flags).view(np.uint64)
    counts = (words * _BYTE_SUM) >> _TOP_BYTE
    out: IntArray = counts.sum(axis=-1, dtype=np.int64) if words.shape[-1] > 1 else counts[..., 0].astype(np.int64)
    return out


def cluster_fragmentation(state: ClusterState, shapes: ShapeArrays) -> float:
    """F(M) = Σ_n F_n(M) over the whole cluster, in milli-GPU."""
    n = state.size
    free = np.where(state.card_valid[:n], state.card_milli_free[:n], 0)
    return float(fragmentation(free, state.cpu_free[:n], state.model_idx[:n], shapes).sum())


def sigmoid_score(delta: FloatArray, scale: float = 1000.0) -> IntArray:
    """FGD's node score ⌊100 · sigmoid(Δ / scale)⌋ with Δ in milli-GPU (FGD's scale: 1000)."""
    out: IntArray = np.floor(100.0 / (1.0 + np.exp(-delta / scale))).astype(np.int64)
    return out


def shapes_of(pods: Sequence[PodRequest]) -> list[Shape]:
    return [pod_shape(p) for p in pods]
