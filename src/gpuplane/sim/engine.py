"""A discrete-event loop in virtual time: the simulated world's clock.

Events run in (time, priority, sequence) order, so equal-time events keep the order they were
scheduled in and runs are reproducible. Callbacks, not generator processes: state stays explicit.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

URGENT = 0
NORMAL = 1


@dataclass(order=True, slots=True)
class _Entry:
    time: float
    priority: int
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Virtual clock plus event heap; implements the `Clock` protocol."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self.processed = 0

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], None], priority: int = NORMAL) -> _Entry:
        if when < self._now:
            raise ValueError(f"cannot schedule in the past ({when} < {self._now})")
        entry = _Entry(when, priority, next(self._seq), callback)
        heapq.heappush(self._heap, entry)
        return entry

    def call_later(self, delay: float, callback: Callable[[], None], priority: int = NORMAL) -> _Entry:
        return self.call_at(self._now + max(0.0, delay), callback, priority)

    def __len__(self) -> int:
        return len(self._heap)

    def step(self) -> bool:
        """Run the next event; False when none is left."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry.cancelled:
                continue
            self._now = entry.time
            entry.callback()
            self.processed += 1
            return True
        return False

    def run(self, until: float | None = None) -> None:
        """Run events up to and including time `until` (all of them when None)."""
        while self._heap:
            head = self._heap[0]
            if until is not None and head.time > until:
                break
            self.step()
        if until is not None and until > self._now:
            self._now = until
