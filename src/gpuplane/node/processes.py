"""Process control on real PIDs (Linux): read a process's state, signal it, find a container's processes.

A PID alone does not name a process for long: once it exits, the kernel may hand the number to another
one. `read_stat` returns the start time too (`starttime`, clock ticks since boot), and callers that keep
PIDs compare it before signalling.
"""

from __future__ import annotations

import enum
import os
import signal
from dataclasses import dataclass
from pathlib import Path


class ProcessState(enum.Enum):
    RUNNING = "running"
    """Running or sleeping (any state that runs when scheduled)."""
    STOPPED = "stopped"
    """`T` (stopped by a signal) or `t` (stopped by a tracer)."""
    ZOMBIE = "zombie"
    """Exited, not yet reaped (`Z`, or `X` dead)."""
    GONE = "gone"
    """No such process."""


class SignalResult(enum.Enum):
    OK = "ok"
    GONE = "gone"
    DENIED = "denied"


@dataclass(frozen=True, slots=True)
class ProcStat:
    state: ProcessState
    start_ticks: int


_STOPPED = frozenset("Tt")
_DEAD = frozenset("ZXx")


def read_stat(pid: int) -> ProcStat | None:
    """The process's state and start time from `/proc/<pid>/stat`; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and ')'.
    fields = text[text.rindex(")") + 2:].split()
    code = fields[0]
    state = (ProcessState.STOPPED if code in _STOPPED
             else ProcessState.ZOMBIE if code in _DEAD else ProcessState.RUNNING)
    return ProcStat(state, int(fields[19]))


def process_state(pid: int) -> ProcessState:
    stat = read_stat(pid)
    return ProcessState.GONE if stat is None else stat.state


def signal_process(pid: int, sig: signal.Signals) -> SignalResult:
    """Send `sig` to one process. Never raises for a vanished process or a denied signal; a PID of 0 or
    below (a process group, or every process) is refused with `ValueError`."""
    if pid <= 0:
        raise ValueError(f"pid: must be a single process (> 0), got {pid}")
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return SignalResult.GONE
    except PermissionError:
        return SignalResult.DENIED
    return SignalResult.OK


def cgroup_pids(cgroup: Path) -> tuple[int, ...]:
    """Every PID in a cgroup v2 directory and its descendants (`cgroup.procs` files), in ascending order;
    empty when the cgroup no longer exists."""
    pids: set[int] = set()
    for directory, _, files in os.walk(cgroup):
        if "cgroup.procs" not in files:
            continue
        try:
            text = (Path(directory) / "cgroup.procs").read_text(encoding="utf-8")
        except (FileNotFoundError, ProcessLookupError):
            continue
        pids.update(int(line) for line in text.split())
    return tuple(sorted(pids))


def container_pids(pids: tuple[int, ...], cgroup: Path | None) -> tuple[int, ...]:
    """A container's PIDs: those of its cgroup when it names one, else the explicit list."""
    return cgroup_pids(cgroup) if cgroup is not None else pids
