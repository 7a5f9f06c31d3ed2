"""How fast the guard stops offline work: wall time from online demand appearing to every offline process
being stopped, on real processes.

The card is a `FakeGpuBackend` (no GPU is needed), the processes are real: busy loops as offline work, a
sleeping process as the online one. Each sample flips the online process's SM utilisation to 80 % at a
random moment of the poll cycle and polls `/proc/<pid>/stat` until every offline process shows `T`.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.node.guard import ColocationGuard, ContainerSpec, GuardConfig, GuardOptions
from gpuplane.node.processes import ProcessState, process_state

_BUSY = "while True: pass"
_SLEEP = "import time; time.sleep(3600)"


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `condition` until it holds; the time (perf counter) it was seen to hold."""
    deadline = time.perf_counter() + timeout_s
    while True:
        now = time.perf_counter()
        if condition():
            return now
        if now > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.0002)


def _all_in(pids: Sequence[int], stopped: bool) -> Callable[[], bool]:
    return lambda: all((process_state(pid) is ProcessState.STOPPED) == stopped for pid in pids)


def measure_reaction(samples: int, poll_s: float, *, offline: int = 2, min_slice_s: float = 0.0, seed: int = 42,
                     timeout_s: float = 5.0) -> list[float]:
    """Reaction times in seconds: online demand set on the card -> every offline process stopped (`T`).

    Runs the guard loop in a thread with poll period `poll_s` over `offline` busy-loop processes; between
    samples, online goes idle and the test waits for them to resume."""
    if samples < 1 or offline < 1 or poll_s <= 0:
        raise ValueError("samples and offline must be at least 1, poll_s above 0")
    rng = random.Random(seed)
    children: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    loop: threading.Thread | None = None
    try:
        online = subprocess.Popen([sys.executable, "-c", _SLEEP])
        children.append(online)
        workers = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(offline)]
        children.extend(workers)
        pids = [w.pid for w in workers]
        backend = FakeGpuBackend()
        backend.set_process(0, online.pid, 4 * GIB, 0.0)
        for pid in pids:
            backend.set_process(0, pid, GIB, 100.0)
        config = GuardConfig(
            guard=GuardOptions(poll_s=poll_s, min_slice_s=min_slice_s),
            containers=(ContainerSpec(name="online", card=0, qos="online", pids=(online.pid,)),
                        *(ContainerSpec(name=f"offline-{i}", card=0, qos="offline", pids=(pid,))
                          for i, pid in enumerate(pids))))
        guard = ColocationGuard(config, backend)
        loop = threading.Thread(target=guard.run, args=(stop,), name="guard", daemon=True)
        loop.start()
        reactions: list[float] = []
        for _ in range(samples):
            _wait_until(_all_in(pids, stopped=False), timeout_s, "offline resuming")
            time.sleep(rng.uniform(0.0, poll_s))
            started = time.perf_counter()
            backend.set_process(0, online.pid, 4 * GIB, 80.0)
            reactions.append(_wait_until(_all_in(pids, stopped=True), timeout_s, "offline stopping") - started)
            backend.set_process(0, online.pid, 4 * GIB, 0.0)
        _wait_until(_all_in(pids, stopped=False), timeout_s, "offline resuming")
        return reactions
    finally:
        stop.set()
        if loop is not None:
            loop.join(timeout=timeout_s)
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.wait()
