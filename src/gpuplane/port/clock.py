"""The injected clock. Controllers ask it for the time and for timers; never the OS directly.

The simulated world supplies a virtual clock (`gpuplane.sim.engine.EventLoop`), live worlds a wall clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Timer(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the world's epoch."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` once, `delay` seconds from now."""
        ...


class WallClock:
    """Real time, with timers on threads. For live worlds only; tests use virtual time."""

    def now(self) -> float:
        return time.time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = threading.Timer(max(0.0, delay), callback)
        timer.daemon = True
        timer.start()
        return timer
