"""SLO time: how long a service's load stood above what its ready replicas serve.

A check every step that counts the whole step as violated when the load is above capacity at its start
over-counts whenever a replica becomes ready inside the step: a replica bound 2 s after a step's start
(after a preempted victim's grace) is ready 2 s after a later step's start, and would cost the whole step.
`shortfall_s` counts the seconds instead: within one step the load holds (the curves are sampled on a
grid no finer than the step) and replicas only come ready (deletions happen on the controllers' passes,
at step starts), so the shortfall ends when the replica that covers the load is ready.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["shortfall_s"]


def shortfall_s(load: float, capacity: float, ready_at: Iterable[float], start: float, length: float) -> float:
    """Seconds of [start, start + length) in which `load` exceeds `capacity` × the replicas ready by then.

    `ready_at` holds, for each replica that exists at `start`, when it serves (at or before `start` for one
    already serving). A load above zero with no capacity is short for the whole interval.
    """
    if capacity <= 0 or length <= 0:
        raise ValueError(f"capacity and length must be positive, got {capacity} and {length}")
    if load <= 0:
        return 0.0
    # the fewest replicas whose capacity covers the load (the same 1e-9 slack as the per-step check)
    need = max(1, math.ceil(load / (capacity * (1 + 1e-9))))
    times = sorted(ready_at)
    if len(times) < need:
        return length
    return min(length, max(0.0, times[need - 1] - start))
