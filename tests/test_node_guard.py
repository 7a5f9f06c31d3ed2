"""The co-location guard on real processes: every assertion about a process reads its state from /proc.

The card is a `FakeGpuBackend`; the guard is driven with explicit times (`tick(now)`), and its clock (which
times reactions) reads `now + LAG`. Offline work is `while True: pass`; the online process notes every
catchable signal it gets in a file, so "never signalled" is checked, not assumed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.model import GpuplaneError
from gpuplane.node.bench import measure_reaction
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.node.guard import (
    ColocationGuard,
    ContainerSpec,
    GuardActionKind,
    GuardConfig,
    GuardConfigError,
    GuardOptions,
    load_guard_config,
)
from gpuplane.node.processes import (
    ProcessState,
    SignalResult,
    cgroup_pids,
    process_state,
    read_stat,
    signal_process,
)

LAG = 0.004
"""Every pass takes this long by the guard's clock: each suspension's reaction reads 4 ms."""
BUSY = "print('ready', flush=True)\nwhile True: pass"
STUBBORN = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + BUSY
ONLINE = """import signal, sys, time
def note(sig, frame):
    with open(sys.argv[1], "a") as out:
        out.write(f"{sig}\\n")
signal.signal(signal.SIGCONT, note)
signal.signal(signal.SIGTERM, note)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


@contextmanager
def sigterm_self_when(pid: int, state: ProcessState) -> Iterator[list[ProcessState]]:
    """For a command run in this process (CliRunner): SIGTERM it once `pid` reaches `state` (10 s at most), and
    only while the command's own SIGTERM handler is in place, never the test runner itself. Yields the list the
    state seen then is appended to; restores the previous handler on exit."""
    previous = signal.getsignal(signal.SIGTERM)
    seen: list[ProcessState] = []
    done = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 10
        while process_state(pid) is not state and time.monotonic() < deadline:
            if done.wait(0.005):
                return
        seen.append(process_state(pid))
        while signal.getsignal(signal.SIGTERM) is previous:
            if done.wait(0.005):
                return
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGTERM, previous)


def wait_state(pid: int, state: ProcessState, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := process_state(pid)) is not state:
        assert time.monotonic() < deadline, f"pid {pid} is {seen.value}, expected {state.value}"
        time.sleep(0.001)


class Procs:
    """Children of the test; all killed at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.children: list[subprocess.Popen[str]] = []

    def start(self, code: str, *args: str) -> int:
        """Start `code` and wait for it to print "ready" (once its signal handlers are in place)."""
        child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
        self.children.append(child)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        return child.pid

    def busy(self, *, ignore_term: bool = False) -> int:
        return self.start(STUBBORN if ignore_term else BUSY)

    def online(self) -> int:
        return self.start(ONLINE, str(self.tmp / "online-signals.txt"))

    def assert_online_untouched(self, pid: int) -> None:
        assert process_state(pid) is ProcessState.RUNNING  # sleeping: never stopped, never ended
        assert not (self.tmp / "online-signals.txt").exists(), "the online process got a signal"

    def end(self, pid: int) -> None:
        """Kill and reap one child: its PID is gone."""
        child = next(c for c in self.children if c.pid == pid)
        child.kill()
        child.wait()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    spawned = Procs(tmp_path)
    yield spawned
    for child in spawned.children:
        child.kill()
        child.wait()


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    backend: FakeGpuBackend
    guard: ColocationGuard
    clock: FakeClock

    def at(self, now: float) -> None:
        self.clock.now = now + LAG
        self.guard.tick(now)

    def value(self, name: str, **labels: str) -> float | None:
        return self.guard.registry.get_sample_value(name, labels)

    def kinds(self) -> list[tuple[GuardActionKind, str]]:
        return [(a.kind, a.container) for a in self.guard.actions]


def online(pid: int, **fields: Any) -> ContainerSpec:
    return ContainerSpec(name="chat", card=0, qos="online", pids=(pid,), **fields)


def offline(name: str, *pids: int, **fields: Any) -> ContainerSpec:
    return ContainerSpec(name=name, card=0, qos="offline", pids=pids, **fields)


def rig(*containers: ContainerSpec, backend: FakeGpuBackend | None = None, **options: Any) -> Rig:
    clock = FakeClock()
    backend = backend or FakeGpuBackend()
    config = GuardConfig(guard=GuardOptions(**options), containers=containers)
    return Rig(backend, ColocationGuard(config, backend, clock=clock), clock)


# -- suspend and resume ---------------------------------------------------------------------------------


def test_demand_suspends_and_only_a_full_idle_slice_resumes(procs: Procs) -> None:
    chat, a, b = procs.online(), procs.busy(), procs.busy()
    r = rig(online(chat), offline("batch-a", a), offline("batch-b", b), min_slice_s=0.5)
    r.backend.set_process(0, a, GIB, 99.0)
    r.backend.set_process(0, b, GIB, 99.0)
    # (now, online SM %, offline expected): the threshold is 5 % and the minimum idle slice 0.5 s
    steps = [
        (1.0, 0.0, ProcessState.RUNNING),  # idle: nothing to do
        (1.25, 80.0, ProcessState.STOPPED),  # demand: suspended at once
        (1.5, 0.0, ProcessState.STOPPED),  # idle since 1.5
        (1.75, 4.0, ProcessState.STOPPED),  # 4 % is below the threshold: idle for 1.75 - 1.5 = 0.25 s < 0.5
        (2.0, 0.0, ProcessState.RUNNING),  # idle for 2.0 - 1.5 = 0.5 s: resumed
        (2.25, 6.0, ProcessState.STOPPED),  # 6 % > 5 %: demand again
        (2.5, 80.0, ProcessState.STOPPED),  # still demand: no second SIGSTOP
    ]
    for now, sm, expected in steps:
        r.backend.set_process(0, chat, 10 * GIB, sm)
        r.at(now)
        wait_state(a, expected)
        wait_state(b, expected)
    procs.assert_online_untouched(chat)
    assert r.kinds() == [(GuardActionKind.SUSPEND, "batch-a"), (GuardActionKind.SUSPEND, "batch-b"),
                         (GuardActionKind.RESUME, "batch-a"), (GuardActionKind.RESUME, "batch-b"),
                         (GuardActionKind.SUSPEND, "batch-a"), (GuardActionKind.SUSPEND, "batch-b")]
    assert r.guard.actions[0].pids == (a,) and r.guard.actions[0].reason == "online demand"
    assert r.value("gpuplane_guard_suspensions_total", card="0", container="batch-a") == 2
    assert r.value("gpuplane_guard_resumptions_total", card="0", container="batch-b") == 1
    assert r.value("gpuplane_guard_offline_suspended", card="0", container="batch-a") == 1
    # 4 suspensions, each 4 ms after its reading: 16 ms in all, all in the 5 ms bucket
    assert r.value("gpuplane_guard_reaction_seconds_count") == 4
    assert r.value("gpuplane_guard_reaction_seconds_sum") == pytest.approx(4 * LAG)
    assert r.value("gpuplane_guard_reaction_seconds_bucket", le="0.005") == 4
    # threshold = safety 2 GiB + 1.5 × max(growth seen 0, floor 2 GiB) = 5 GiB
    assert r.value("gpuplane_guard_memory_threshold_bytes", card="0") == 5 * GIB


def test_the_run_loop_reacts_on_its_own_and_stops(procs: Procs) -> None:
    import threading

    chat, a = procs.online(), procs.busy()
    backend = FakeGpuBackend()
    config = GuardConfig(guard=GuardOptions(poll_s=0.01), containers=(online(chat), offline("batch", a)))
    guard = ColocationGuard(config, backend)
    stop = threading.Event()
    loop = threading.Thread(target=guard.run, args=(stop,))
    loop.start()
    try:
        backend.set_process(0, chat, GIB, 80.0)
        wait_state(a, ProcessState.STOPPED)
        backend.set_process(0, chat, GIB, 0.0)
        wait_state(a, ProcessState.RUNNING)
    finally:
        stop.set()
        loop.join(timeout=2)
    assert not loop.is_alive()
    assert backend.reads >= 2


# -- eviction -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free_gib", "evicted"),
    [
        # threshold 5 GiB (safety 2 + 1.5 × floor 2); small uses 1 GiB, large 3 GiB. On the second reading
        # (memory unchanged) what is being evicted counts as freed already.
        (4, ["small"]),  # shortfall 5 - 4 = 1 GiB: small alone frees it and is the smaller; then 1 - 1 = 0
        (3, ["large"]),  # shortfall 2 GiB: only large frees it alone; then 2 - 3 < 0
        (1, ["large", "small"]),  # shortfall 4 GiB: neither does, the largest goes; then 4 - 3 = 1: small too
        (5, []),  # free 5 GiB is not under 5 GiB: nothing
    ],
)
def test_low_memory_evicts_the_container_the_policy_picks(procs: Procs, free_gib: int, evicted: list[str]) -> None:
    small, large = procs.busy(ignore_term=True), procs.busy(ignore_term=True)
    r = rig(offline("small", small), offline("large", large), kill_grace_s=1.0)
    r.backend.set_process(0, small, 1 * GIB, 50.0)
    r.backend.set_process(0, large, 3 * GIB, 50.0)
    r.backend.set_memory(0, (80 - free_gib) * GIB)
    r.at(10.0)
    r.at(10.5)
    assert r.kinds() == [(GuardActionKind.EVICT, name) for name in evicted]
    for name, pid in (("small", small), ("large", large)):
        assert process_state(pid) is ProcessState.RUNNING  # both ignore SIGTERM; the grace (1 s) is not over
        assert r.value("gpuplane_guard_evictions_total", card="0", container=name, reason="memory") == (
            1 if name in evicted else None)


def test_eviction_kills_after_the_grace_what_ignores_sigterm(procs: Procs) -> None:
    chat, stubborn = procs.online(), procs.busy(ignore_term=True)
    r = rig(online(chat), offline("batch", stubborn), kill_grace_s=2.0)
    r.backend.set_process(0, chat, 74 * GIB, 0.0)
    r.backend.set_process(0, stubborn, 4 * GIB, 0.0)
    r.at(10.0)  # free 80 - 78 = 2 GiB < 5 GiB: evicted; online is idle, so the grace runs
    assert r.kinds() == [(GuardActionKind.EVICT, "batch")]
    wait_state(stubborn, ProcessState.RUNNING)  # SIGTERM ignored, SIGCONT: still running
    r.at(11.999)  # 1.999 s after SIGTERM: not yet
    assert process_state(stubborn) is ProcessState.RUNNING
    r.at(12.0)  # 2 s: SIGKILL
    wait_state(stubborn, ProcessState.ZOMBIE)
    r.at(12.25)  # all its processes exited (a zombie counts as exited): forgotten
    assert r.kinds()[1:] == [(GuardActionKind.KILL, "batch"), (GuardActionKind.FORGET, "batch")]
    assert r.value("gpuplane_guard_kills_total") == 1
    assert r.value("gpuplane_guard_evictions_total", card="0", container="batch", reason="memory") == 1
    procs.assert_online_untouched(chat)


def test_online_demand_during_the_eviction_grace_kills_at_once(procs: Procs) -> None:
    chat, stubborn = procs.online(), procs.busy(ignore_term=True)
    r = rig(online(chat), offline("batch", stubborn), kill_grace_s=10.0)
    r.backend.set_process(0, chat, 74 * GIB, 0.0)
    r.backend.set_process(0, stubborn, 4 * GIB, 0.0)
    r.at(10.0)  # free 2 GiB < 5 GiB: evicted (SIGTERM ignored, SIGCONT: it runs)
    wait_state(stubborn, ProcessState.RUNNING)
    r.backend.set_process(0, chat, 74 * GIB, 90.0)
    r.at(10.25)  # online demand 0.25 s into a 10 s grace: a running evictee would compete, so SIGKILL now
    wait_state(stubborn, ProcessState.ZOMBIE)
    assert r.kinds() == [(GuardActionKind.EVICT, "batch"), (GuardActionKind.KILL, "batch")]
    assert r.value("gpuplane_guard_kills_total") == 1
    procs.assert_online_untouched(chat)


def test_quota_evicts_offline_even_when_stopped_and_only_counts_online(procs: Procs) -> None:
    chat, batch = procs.online(), procs.busy()
    r = rig(online(chat, memory_quota_bytes=8 * GIB), offline("batch", batch, memory_quota_bytes=2 * GIB))
    r.backend.set_process(0, chat, 1 * GIB, 80.0)
    r.backend.set_process(0, batch, 2 * GIB, 0.0)
    r.at(1.0)  # 2 GiB is not above a 2 GiB quota; online demand: suspended
    wait_state(batch, ProcessState.STOPPED)
    r.backend.set_process(0, batch, 3 * GIB, 0.0)
    r.backend.set_process(0, chat, 9 * GIB, 80.0)  # online 9 GiB > 8 GiB: logged and counted only
    r.at(1.25)  # offline 3 GiB > 2 GiB: SIGTERM + SIGCONT; online is busy, so SIGKILL follows at once
    wait_state(batch, ProcessState.ZOMBIE)
    r.at(1.5)  # still over: counted once per episode
    assert r.kinds() == [(GuardActionKind.SUSPEND, "batch"), (GuardActionKind.QUOTA_WARNING, "chat"),
                         (GuardActionKind.EVICT, "batch"), (GuardActionKind.KILL, "batch"),
                         (GuardActionKind.FORGET, "batch")]
    assert r.value("gpuplane_guard_evictions_total", card="0", container="batch", reason="quota") == 1
    assert r.value("gpuplane_guard_quota_violations_total", container="batch", qos="offline") == 1
    assert r.value("gpuplane_guard_quota_violations_total", container="chat", qos="online") == 1
    assert r.value("gpuplane_guard_offline_suspended", card="0", container="batch") == 0
    procs.assert_online_untouched(chat)


# -- admission: an offline start that would break the safety line -------------------------------------


def test_a_start_that_would_break_the_safety_line_is_held_until_it_fits(procs: Procs) -> None:
    chat, old, new = procs.online(), procs.busy(), procs.busy()
    r = rig(online(chat), offline("old", old), min_slice_s=0.0, admit_timeout_s=900.0)
    r.backend.set_process(0, chat, 40 * GIB, 0.0)
    r.backend.set_process(0, old, 10 * GIB, 50.0)
    r.at(1.0)  # the containers of the first pass were running before the guard: no admission for them
    # a pod placed while the guard runs, quota 30 GiB, nothing allocated yet
    r.guard.update_containers([online(chat), offline("old", old), offline("new", new, memory_quota_bytes=30 * GIB)])
    r.backend.set_process(0, new, 0, 0.0)
    # free 80 - 40 - 10 = 30 GiB; room = 30 - 5 (line: 2 + 1.5 x 2) - 2 (hysteresis) = 23 < 30: held
    r.at(2.0)
    wait_state(new, ProcessState.STOPPED)
    assert process_state(old) is ProcessState.RUNNING
    assert r.kinds() == [(GuardActionKind.HOLD, "new")]
    assert r.guard.actions[-1].reason == f"admission: would take {30 * GIB} B, {23 * GIB} B may start"
    assert r.value("gpuplane_guard_holds_total", card="0", container="new") == 1
    assert r.value("gpuplane_guard_offline_suspended", card="0", container="new") == 1
    r.at(3.0)  # nothing changed: still held, no second SIGSTOP
    assert len(r.kinds()) == 1
    # online falls to 30 GiB: free 40 GiB, but online may return to its 40 GiB peak of the last 600 s:
    # room = 40 - (40 - 30) - 5 - 2 = 23 < 30: still held
    r.backend.set_process(0, chat, 30 * GIB, 0.0)
    r.at(4.0)
    assert process_state(new) is ProcessState.STOPPED and len(r.kinds()) == 1
    # 601 s later the 40 GiB peak has left the admission window: room 40 - 5 - 2 = 33 >= 30: admitted,
    # and online is idle, so the slice arbiter lets it run in the same pass
    r.at(605.0)
    wait_state(new, ProcessState.RUNNING)
    assert r.kinds()[1:] == [(GuardActionKind.ADMIT, "new"), (GuardActionKind.RESUME, "new")]
    procs.assert_online_untouched(chat)


def test_a_held_start_that_never_fits_is_evicted_for_the_scheduler_to_place_again(procs: Procs) -> None:
    chat, new = procs.online(), procs.busy()
    r = rig(online(chat), admit_timeout_s=60.0)
    r.backend.set_process(0, chat, 60 * GIB, 0.0)
    r.at(1.0)
    r.guard.update_containers([online(chat), offline("new", new, memory_quota_bytes=30 * GIB)])
    r.backend.set_process(0, new, 0, 0.0)
    r.at(2.0)  # free 20 GiB, room 20 - 5 - 2 = 13 < 30: held
    wait_state(new, ProcessState.STOPPED)
    r.at(61.5)  # held 59.5 s < 60 s
    assert r.kinds() == [(GuardActionKind.HOLD, "new")]
    r.at(62.0)  # 60 s: evicted (SIGTERM + SIGCONT: the busy loop exits)
    wait_state(new, ProcessState.ZOMBIE)
    assert r.kinds()[1:] == [(GuardActionKind.EVICT, "new")]
    assert r.value("gpuplane_guard_evictions_total", card="0", container="new", reason="admission") == 1


@pytest.mark.parametrize("options", [{"admission": False}, {"memory_guard": False}], ids=["admission-off", "guard-off"])
def test_without_admission_a_start_runs(procs: Procs, options: dict[str, Any]) -> None:
    chat, new = procs.online(), procs.busy()
    r = rig(online(chat), **options)
    r.backend.set_process(0, chat, 60 * GIB, 0.0)
    r.at(1.0)
    r.guard.update_containers([online(chat), offline("new", new, memory_quota_bytes=30 * GIB)])
    r.at(2.0)
    assert process_state(new) is ProcessState.RUNNING
    assert GuardActionKind.HOLD not in [kind for kind, _ in r.kinds()]


# -- restarts and the state file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("online_sm", "used_gib", "kind", "expected"),
    [
        (0.0, 10, GuardActionKind.RESUME, ProcessState.RUNNING),  # online idle: resumed at the first reading
        (0.0, 77, GuardActionKind.EVICT, ProcessState.ZOMBIE),  # free 80 - 77 = 3 GiB < 5 GiB: evicted
        (80.0, 10, None, ProcessState.STOPPED),  # online busy: stays stopped (online first)
    ],
)
def test_a_restarted_guard_takes_over_suspended_containers(procs: Procs, tmp_path: Path, online_sm: float,
                                                           used_gib: int, kind: GuardActionKind | None,
                                                           expected: ProcessState) -> None:
    chat, batch = procs.online(), procs.busy()
    state = tmp_path / "state" / "guard.json"
    first = rig(online(chat), offline("batch", batch), state_file=state)
    first.backend.set_process(0, chat, GIB, 80.0)
    first.backend.set_process(0, batch, GIB, 0.0)
    first.at(100.0)
    wait_state(batch, ProcessState.STOPPED)
    recorded = json.loads(state.read_text())["containers"]["batch"]
    start_ticks = read_stat(batch).start_ticks  # type: ignore[union-attr]
    assert recorded == {"card": 0, "state": "suspended", "since": 100.0, "first_seen": 0.0,
                        "pids": [{"pid": batch, "start_ticks": start_ticks}]}
    assert [p.name for p in state.parent.iterdir()] == ["guard.json"]  # no temporary file left behind

    second = rig(online(chat), offline("batch", batch), state_file=state)
    assert second.value("gpuplane_guard_offline_suspended", card="0", container="batch") == 1
    second.backend.set_process(0, chat, GIB, online_sm)
    second.backend.set_process(0, batch, GIB, 0.0)
    second.backend.set_memory(0, used_gib * GIB)
    second.at(200.0)
    wait_state(batch, expected)
    assert second.kinds() == ([] if kind is None else [(kind, "batch")])
    procs.assert_online_untouched(chat)


def test_a_restarted_guard_kills_on_the_recorded_grace(procs: Procs, tmp_path: Path) -> None:
    stubborn = procs.busy(ignore_term=True)
    state = tmp_path / "guard.json"
    first = rig(offline("batch", stubborn, memory_quota_bytes=GIB), state_file=state, kill_grace_s=10.0)
    first.backend.set_process(0, stubborn, 2 * GIB, 0.0)
    first.at(100.0)  # 2 GiB > 1 GiB quota: evicted at 100
    assert json.loads(state.read_text())["containers"]["batch"]["state"] == "evicting"

    second = rig(offline("batch", stubborn, memory_quota_bytes=GIB), state_file=state, kill_grace_s=10.0)
    second.backend.set_process(0, stubborn, 2 * GIB, 0.0)
    second.at(109.5)  # 9.5 s after the recorded eviction: not yet, and not evicted twice
    assert process_state(stubborn) is ProcessState.RUNNING
    second.at(110.0)  # 100 + 10
    wait_state(stubborn, ProcessState.ZOMBIE)
    assert second.kinds() == [(GuardActionKind.KILL, "batch")]


def test_a_corrupt_state_file_is_ignored_and_stopped_offline_processes_continue(procs: Procs,
                                                                                 tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture
                                                                                 ) -> None:
    chat, batch, other = procs.online(), procs.busy(), procs.busy()
    os.kill(batch, signal.SIGSTOP)
    wait_state(batch, ProcessState.STOPPED)
    state = tmp_path / "guard.json"
    state.write_text('{"version": 1, "containers": {"batch": {"state": "suspen')
    r = rig(online(chat), offline("batch", batch, other), state_file=state)
    assert "unreadable guard state" in caplog.text
    r.backend.fail_next(1)  # even without a reading
    r.at(1.0)
    wait_state(batch, ProcessState.RUNNING)
    assert [(a.kind, a.pids) for a in r.guard.actions] == [(GuardActionKind.RESUME, (batch,))]
    assert json.loads(state.read_text())["containers"]["batch"]["state"] == "running"  # rewritten whole
    procs.assert_online_untouched(chat)


def test_a_recorded_pid_that_now_names_another_process_is_never_signalled(procs: Procs, tmp_path: Path) -> None:
    stranger = procs.busy()
    os.kill(stranger, signal.SIGSTOP)
    wait_state(stranger, ProcessState.STOPPED)
    state = tmp_path / "guard.json"
    real = read_stat(stranger).start_ticks  # type: ignore[union-attr]
    state.write_text(json.dumps({"version": 1, "containers": {"batch": {
        "card": 0, "state": "suspended", "since": 5.0, "first_seen": 1.0,
        "pids": [{"pid": stranger, "start_ticks": real - 1}]}}}))
    r = rig(offline("batch", stranger), state_file=state)
    r.at(10.0)  # the recorded process is gone: forgotten, and the stranger is left as it is
    assert r.kinds() == [(GuardActionKind.FORGET, "batch")]
    assert process_state(stranger) is ProcessState.STOPPED


@pytest.mark.parametrize("state_file", [False, True], ids=["no-state-file", "state-file"])
def test_stopping_resumes_suspended_work_unless_a_successor_will(procs: Procs, tmp_path: Path,
                                                                 state_file: bool) -> None:
    chat, batch = procs.online(), procs.busy()
    r = rig(online(chat), offline("batch", batch), state_file=tmp_path / "guard.json" if state_file else None)
    r.backend.set_process(0, chat, GIB, 80.0)
    r.at(1.0)
    wait_state(batch, ProcessState.STOPPED)
    r.guard.stop(2.0)
    wait_state(batch, ProcessState.STOPPED if state_file else ProcessState.RUNNING)


# -- fail safe ------------------------------------------------------------------------------------------


def test_unknown_pids_are_counted_once_and_ignored(procs: Procs) -> None:
    chat, batch = procs.online(), procs.busy()
    r = rig(online(chat), offline("batch", batch))
    r.backend.set_process(0, 999_999_001, 30 * GIB, 100.0)  # no such container (nor process)
    r.backend.set_process(0, os.getpid(), GIB, 100.0)  # a real process of no container
    r.at(1.0)
    r.at(1.25)
    assert r.value("gpuplane_guard_unknown_pids_total") == 2
    assert r.guard.actions == [] and process_state(batch) is ProcessState.RUNNING
    r.backend.remove_process(0, os.getpid())
    r.at(1.5)
    r.backend.set_process(0, os.getpid(), GIB, 100.0)
    r.at(1.75)  # left and came back: counted again
    assert r.value("gpuplane_guard_unknown_pids_total") == 3


def test_vanished_processes_never_crash_it(procs: Procs) -> None:
    chat, first, second = procs.online(), procs.busy(), procs.busy()
    r = rig(online(chat), offline("batch", first, second))
    r.backend.set_process(0, first, GIB, 50.0)
    procs.end(first)  # gone, though the card still lists it
    r.backend.set_process(0, chat, GIB, 80.0)
    r.at(1.0)
    wait_state(second, ProcessState.STOPPED)
    assert r.guard.actions[0].pids == (second,)
    assert r.value("gpuplane_guard_unknown_pids_total") == 1  # the dead PID is no longer the container's
    procs.end(second)
    procs.end(chat)
    r.at(1.25)
    assert r.kinds()[-1] == (GuardActionKind.FORGET, "batch")


def test_failed_readings_change_nothing_and_are_counted(procs: Procs, caplog: pytest.LogCaptureFixture) -> None:
    chat, batch = procs.online(), procs.busy()
    elsewhere = ContainerSpec(name="other", card=1, qos="offline", pids=(999_999_002,))  # no such PID, no card 1
    r = rig(online(chat), offline("batch", batch), elsewhere)
    r.backend.set_process(0, chat, GIB, 80.0)
    r.backend.fail_next(2)
    r.at(1.0)
    r.at(1.25)
    assert r.guard.actions == [] and process_state(batch) is ProcessState.RUNNING
    r.at(1.5)  # card 0 is read: suspended; card 1 is missing from the reading: counted, skipped
    wait_state(batch, ProcessState.STOPPED)
    assert r.value("gpuplane_guard_backend_errors_total") == 3
    assert "fake: injected failure" in caplog.text and "the reading has no card 1" in caplog.text


def test_cgroup_members_are_found_and_late_joiners_stopped_too(procs: Procs, tmp_path: Path) -> None:
    chat, first, late = procs.online(), procs.busy(), procs.busy()
    group = tmp_path / "kubepods" / "batch"
    (group / "worker").mkdir(parents=True)
    (group / "cgroup.procs").write_text(f"{first}\n")
    (group / "worker" / "cgroup.procs").write_text("")
    r = rig(online(chat), ContainerSpec(name="batch", card=0, qos="offline", cgroup=group), min_slice_s=0.0)
    r.backend.set_process(0, chat, GIB, 80.0)
    r.at(1.0)
    wait_state(first, ProcessState.STOPPED)
    (group / "worker" / "cgroup.procs").write_text(f"{late}\n")  # forked into a child cgroup while stopped
    r.at(1.25)
    wait_state(late, ProcessState.STOPPED)
    assert cgroup_pids(group) == tuple(sorted((first, late)))
    r.backend.set_process(0, chat, GIB, 0.0)
    r.at(1.5)
    wait_state(first, ProcessState.RUNNING)
    wait_state(late, ProcessState.RUNNING)
    assert r.guard.actions[-1].pids == (first, late)
    assert cgroup_pids(tmp_path / "no-such-cgroup") == ()


# -- processes ------------------------------------------------------------------------------------------


def test_process_state_reads_proc(procs: Procs, tmp_path: Path) -> None:
    pid = procs.busy()
    assert process_state(pid) is ProcessState.RUNNING
    assert signal_process(pid, signal.SIGSTOP) is SignalResult.OK
    wait_state(pid, ProcessState.STOPPED)
    procs.children[-1].kill()
    wait_state(pid, ProcessState.ZOMBIE)
    procs.children[-1].wait()
    assert process_state(pid) is ProcessState.GONE
    assert signal_process(pid, signal.SIGCONT) is SignalResult.GONE
    # a command name with ") T (" in it does not fool the parser
    odd = tmp_path / "x) T (y"
    odd.symlink_to(shutil.which("sleep") or "/bin/sleep")
    sleeper = subprocess.Popen([str(odd), "30"])
    try:
        wait_state(sleeper.pid, ProcessState.RUNNING)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_signal_process_reports_denied_and_refuses_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    def deny(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", deny)
    assert signal_process(12345, signal.SIGSTOP) is SignalResult.DENIED
    for pid in (0, -1):
        with pytest.raises(ValueError, match="single process"):
            signal_process(pid, signal.SIGSTOP)


# -- metrics over HTTP ----------------------------------------------------------------------------------


def test_metrics_are_served_over_http(procs: Procs) -> None:
    chat, batch = procs.online(), procs.busy()
    r = rig(online(chat), offline("batch", batch))
    r.backend.set_process(0, chat, GIB, 80.0)
    r.at(1.0)
    server, thread = r.guard.start_metrics_server(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=2)
    assert 'gpuplane_guard_suspensions_total{card="0",container="batch"} 1.0' in text
    assert 'gpuplane_guard_offline_suspended{card="0",container="batch"} 1.0' in text
    assert re.search(r"^gpuplane_guard_reaction_seconds_count 1\.0$", text, re.M)
    assert "gpuplane_guard_kills_total 0.0" in text


# -- configuration --------------------------------------------------------------------------------------


def test_the_documented_example_config_loads(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "colocation-guard.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert example is not None
    path = tmp_path / "guard.yaml"
    path.write_text(example.group(1))
    config = load_guard_config(path)
    assert {c.qos for c in config.containers} == {"online", "offline"}
    settings = config.guard.settings()
    assert (settings.min_slice_s, settings.safety_margin_bytes) == (0.5, 2 * GIB)


@pytest.mark.parametrize(("text", "expected"), [
    ("guard: {poll_s: 0.5}\n", GuardConfig(guard=GuardOptions(poll_s=0.5))),  # containers left out: from the pods
    ("containers:\n  - {name: chat, card: 0, qos: online, pids: [10]}\n",
     GuardConfig(containers=(ContainerSpec(name="chat", card=0, qos="online", pids=(10,)),))),
])
def test_a_config_file_loads_as_a_guard_config(tmp_path: Path, text: str, expected: GuardConfig) -> None:
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    assert load_guard_config(path) == expected


GOOD = "containers:\n  - {name: chat, card: 0, qos: online, pids: [10]}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("containers: []\n", "containers: Tuple should have at least 1 item"),
        ("containers:\n  - {name: chat, card: 0, pids: [10]}\n", "containers.0.qos: Field required"),
        ("containers:\n  - {name: chat, card: 0, qos: batch, pids: [10]}\n", "containers.0.qos: Input should be"),
        ("containers:\n  - {name: chat, card: -1, qos: online, pids: [10]}\n", "containers.0.card: Input should be"),
        ("containers:\n  - {name: chat, card: 0, qos: online, pids: [0]}\n", "containers.0.pids.0: Input should be"),
        ("containers:\n  - {name: chat, card: 0, qos: online}\n", "containers.0: Value error, container 'chat'"),
        ("containers:\n  - {name: a, card: 0, qos: online, pids: [1], cgroup: /x}\n", "give either pids or cgroup"),
        (GOOD + "  - {name: chat, card: 1, qos: offline, pids: [11]}\n", "container names must be unique: chat"),
        (GOOD + "  - {name: b, card: 1, qos: offline, pids: [10]}\n", "a PID belongs to one container only: 10"),
        ("guard: {poll_s: 0}\n" + GOOD, "guard.poll_s: Input should be greater than 0"),
        ("guard: {growth_factor: .nan}\n" + GOOD, "guard.growth_factor: Input should be a finite number"),
        ("guard: {pol_s: 1}\n" + GOOD, "guard.pol_s: Extra inputs are not permitted"),
        ("containers: [\n", "while parsing"),
    ],
)
def test_config_errors_name_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "guard.yaml"
    path.write_text(text)
    with pytest.raises(GuardConfigError) as caught:
        load_guard_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert isinstance(caught.value, GpuplaneError)


# -- command line ---------------------------------------------------------------------------------------

runner = CliRunner()


def test_node_guard_reports_a_bad_config_with_exit_code_2(tmp_path: Path) -> None:
    path = tmp_path / "guard.yaml"
    path.write_text("guard: {kill_grace_s: -1}\n" + GOOD)
    result = runner.invoke(app, ["node-guard", "--config", str(path)])
    assert result.exit_code == 2
    assert "guard.kill_grace_s" in result.output


def test_node_guard_without_nvml_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    path = tmp_path / "guard.yaml"
    path.write_text(GOOD)
    result = runner.invoke(app, ["node-guard", "--config", str(path)])
    assert result.exit_code == 2
    assert "nvmlInit" in result.output


def test_bench_guard_prints_reaction_figures() -> None:
    result = runner.invoke(app, ["bench", "guard", "--samples", "3", "--poll-s", "0.01", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["samples"] == 3 and figures["poll_ms"] == 10.0
    assert 0 < figures["median_ms"] <= figures["p99_ms"] <= figures["max_ms"] < 1000


def test_measure_reaction_returns_one_time_per_sample_and_cleans_up() -> None:
    before = set(children_of(os.getpid()))  # what other tests of the session may still be running
    reactions = measure_reaction(4, 0.01, offline=1)
    assert len(reactions) == 4 and all(0 < r < 1.0 for r in reactions)
    assert set(children_of(os.getpid())) <= before  # busy loops and the online process: killed and reaped


def children_of(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else 0
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == parent:
            found.append(int(entry.name))
    return found

