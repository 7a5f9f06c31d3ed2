"""Node policies `binpack` and `spread`: allocation-based node scores over GPU, CPU and memory."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from gpuplane.model import ClusterState, PodRequest
from gpuplane.model.cluster import RowIndex
from gpuplane.scheduler.framework import CycleState, FloatArray, IntArray
from gpuplane.scheduler.scoring import least_allocated, most_allocated


@dataclass(frozen=True, slots=True)
class ResourceWeights:
    """Weights of the GPU, CPU and memory dimensions in allocation scores.

    The defaults rank nodes by GPU alone. On a GPU fleet, packing CPU as well strands GPUs on nodes
    whose CPUs ran out: on the bundled trace (seed 42) binpack leaves 8.0 % of GPUs unallocated at 100 %
    arrived with equal weights and 5.5 % with GPU-only weights. CPU-only pods then go to the nodes whose
    GPUs are busiest (binpack), where their CPU use strands the fewest GPUs.
    """

    gpu: float = 1.0
    cpu: float = 0.0
    memory: float = 0.0

    def __post_init__(self) -> None:
        if min(self.gpu, self.cpu, self.memory) < 0:
            raise ValueError("resource weights must not be negative")
        if self.gpu + self.cpu + self.memory <= 0:
            raise ValueError("at least one resource weight must be positive")

    def array(self) -> FloatArray:
        return np.array([self.gpu, self.cpu, self.memory], np.float64)


_ALLOCATION = "allocation"
"""The `ClusterState.node_values` key prefix of the allocation scores."""


def _vectors(pod: PodRequest, state: ClusterState, nodes: RowIndex,
             weights: FloatArray) -> tuple[IntArray, IntArray, IntArray, FloatArray]:
    """(used, request, capacity, weights) over the dimensions whose weight is not zero."""
    dims = np.flatnonzero(weights)
    used_rows, request_rows, capacity_rows = [], [], []
    for dim in dims:
        if dim == 0:
            used_rows.append(state.gpu_milli_used[nodes])
            capacity_rows.append(state.gpu_milli_cap[nodes])
            request_rows.append(pod.gpu_milli_total)
        elif dim == 1:
            used_rows.append(state.cpu_cap[nodes] - state.cpu_free[nodes])
            capacity_rows.append(state.cpu_cap[nodes])
            request_rows.append(pod.cpu_milli)
        else:
            used_rows.append(state.mem_cap[nodes] - state.mem_free[nodes])
            capacity_rows.append(state.mem_cap[nodes])
            request_rows.append(pod.memory_mib)
    used = np.array(used_rows, np.int64)
    request = np.array(request_rows, np.int64)[:, None]
    return used, request, np.array(capacity_rows, np.int64), weights[dims]


class _AllocationScore:
    _function = staticmethod(most_allocated)

    def __init__(self, weights: ResourceWeights | None = None) -> None:
        self.weights = (weights or ResourceWeights()).array()
        self._weights_key = self.weights.tobytes()

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        # A node's score depends on its own accounting alone: kept per node version (`ClusterState.node_values`)
        # for what the pod asks of the weighted dimensions. Every operation is per node (the sum over the
        # dimensions too), so a node scores the same bit for bit whichever nodes are computed with it.
        asked = tuple(r for r, w in zip((pod.gpu_milli_total, pod.cpu_milli, pod.memory_mib), self.weights,
                                        strict=True) if w)
        key = (_ALLOCATION, self._function, self._weights_key, asked)
        out: FloatArray = state.node_values(key, partial(self._rows, pod, state))[nodes]
        return out

    def _rows(self, pod: PodRequest, state: ClusterState, rows: RowIndex) -> FloatArray:
        return self._function(*_vectors(pod, state, rows, self.weights))


class BinpackScore(_AllocationScore):
    """Fill the most-used nodes first (MostAllocated after placing the pod)."""

    name = "Binpack"
    _function = staticmethod(most_allocated)


class SpreadScore(_AllocationScore):
    """Use the least-used nodes first (LeastAllocated after placing the pod)."""

    name = "Spread"
    _function = staticmethod(least_allocated)
