"""Node policies `binpack` and `spread`: allocation-based node scores over GPU, CPU and memory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuplane.model import ClusterState, PodRequest
from gpuplane.scheduler.framework import CycleState, FloatArray, IntArray
from gpuplane.scheduler.scoring import least_allocated, most_allocated


@dataclass(frozen=True, slots=True)
class ResourceWeights:
    gpu: float = 1.0
    cpu: float = 1.0
    memory: float = 1.0

    def array(self) -> FloatArray:
        return np.array([self.gpu, self.cpu, self.memory], np.float64)


def _vectors(pod: PodRequest, state: ClusterState, nodes: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    used = np.stack([
        state.gpu_milli_used[nodes],
        state.cpu_cap[nodes] - state.cpu_free[nodes],
        state.mem_cap[nodes] - state.mem_free[nodes],
    ])
    capacity = np.stack([state.gpu_milli_cap[nodes], state.cpu_cap[nodes], state.mem_cap[nodes]])
    request = np.array([pod.gpu_milli_total, pod.cpu_milli, pod.memory_mib], np.int64)[:, None]
    return used, np.broadcast_to(request, used.shape), capacity


class BinpackScore:
    """Fill the most-used nodes first (MostAllocated after placing the pod)."""

    name = "Binpack"

    def __init__(self, weights: ResourceWeights | None = None) -> None:
        self.weights = (weights or ResourceWeights()).array()

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        return most_allocated(*_vectors(pod, state, nodes), self.weights)


class SpreadScore:
    """Use the least-used nodes first (LeastAllocated after placing the pod)."""

    name = "Spread"

    def __init__(self, weights: ResourceWeights | None = None) -> None:
        self.weights = (weights or ResourceWeights()).array()

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        return least_allocated(*_vectors(pod, state, nodes), self.weights)
