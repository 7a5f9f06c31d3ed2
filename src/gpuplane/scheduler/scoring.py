"""Pure scoring functions over resource vectors (no state, no side effects).

Each returns scores in 0…100 for a batch of nodes. `used`, `request` and `capacity` are arrays of shape
(dims, nodes); a dimension with zero capacity on a node (a CPU-only node's GPUs) is left out of that
node's weighted mean.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MAX_NODE_SCORE = 100.0


def _weighted_mean(fraction: FloatArray, capacity: IntArray, weights: FloatArray) -> FloatArray:
    present = capacity > 0
    w = weights[:, None] * present
    denominator = w.sum(axis=0)
    numerator = (w * fraction).sum(axis=0)
    out: FloatArray = np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)
    return out


def most_allocated(used: IntArray, request: IntArray, capacity: IntArray, weights: FloatArray) -> FloatArray:
    """Binpack: 100 · Σ wᵢ·(usedᵢ + reqᵢ)/capᵢ / Σ wᵢ. Fuller nodes score higher."""
    safe = np.maximum(capacity, 1)
    fraction = np.clip((used + request) / safe, 0.0, 1.0)
    return MAX_NODE_SCORE * _weighted_mean(fraction, capacity, weights)


def least_allocated(used: IntArray, request: IntArray, capacity: IntArray, weights: FloatArray) -> FloatArray:
    """Spread: 100 · Σ wᵢ·(capᵢ − usedᵢ − reqᵢ)/capᵢ / Σ wᵢ. Emptier nodes score higher."""
    safe = np.maximum(capacity, 1)
    fraction = np.clip((capacity - used - request) / safe, 0.0, 1.0)
    return MAX_NODE_SCORE * _weighted_mean(fraction, capacity, weights)
