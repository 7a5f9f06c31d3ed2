"""The node agent on a journald-only node: the kernel's entries of a real systemd journal (files written by
systemd-journal-remote from the journal export format, read by the real journalctl) are followed with their
cursors, resumed after a restart with nothing lost and nothing posted twice, and chosen among the kernel-log
candidates when there is no kern.log."""

from __future__ import annotations

import queue
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemons import free_port, gpuplane_daemon, healthy, sigterm
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.node_reports import EVENTS_PATH, REPORT_LABEL, reports_in_order
from gpuplane.node.reporter import (
    Finding,
    JournalPosition,
    PositionStore,
    find_kernel_log,
    follow_journal,
    follow_kernel_log,
    is_journal,
    journal_end,
)
from node_agent import Agent

BOOT = "0123456789abcdef0123456789abcdef"
T0_US = 1_764_374_400_000_000  # 2025-11-29T00:00:00Z in microseconds


def xid(bus: str) -> str:
    return f"NVRM: Xid (PCI:0000:{bus}): 79, pid=2417, GPU has fallen off the bus."


def _remote() -> str:
    found = shutil.which("systemd-journal-remote") or next(
        (str(p) for p in (Path("/lib/systemd/systemd-journal-remote"), Path("/usr/lib/systemd/systemd-journal-remote"))
         if p.exists()), None)
    assert found is not None, "systemd-journal-remote is needed to write journal files (scripts/test installs it)"
    assert shutil.which("journalctl"), "journalctl is needed (Debian's systemd package)"
    return found


@dataclass
class Journal:
    """A directory of real journal files, appended to as journald would (one writer, readers following)."""

    directory: Path
    seq: int = 0

    def write(self, *entries: tuple[str, str | bytes]) -> None:
        """Append entries (transport, message); a bytes message that is not UTF-8 is written as a binary field."""
        chunks: list[bytes] = []
        for transport, message in entries:
            self.seq += 1
            head = (f"__REALTIME_TIMESTAMP={T0_US + self.seq * 1_000_000}\n__MONOTONIC_TIMESTAMP={self.seq}\n"
                    f"_BOOT_ID={BOOT}\n_TRANSPORT={transport}\nSYSLOG_IDENTIFIER=kernel\n").encode()
            raw = message if isinstance(message, bytes) else message.encode()
            # the export format's binary field: the name, a newline, the length (64-bit little endian), the data
            chunks.append(head + b"MESSAGE\n" + struct.pack("<Q", len(raw)) + raw + b"\n\n")
        export = self.directory.parent / f"entries-{self.seq}.export"
        export.write_bytes(b"".join(chunks))
        done = subprocess.run([_remote(), f"--output={self.directory / 'remote.journal'}", str(export)],
                              capture_output=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    directory = tmp_path / "journal"
    directory.mkdir()
    return Journal(directory)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def wait_until(condition: Callable[[], bool], what: str, *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def take(findings: queue.Queue[Finding], count: int) -> list[Finding]:
    return [findings.get(timeout=20) for _ in range(count)]


def test_the_kernel_entries_after_the_end_come_with_their_cursors(journal: Journal) -> None:
    journal.write(("kernel", "boot line"), ("stdout", "a service's line"))
    end = journal_end(journal.directory)  # the last kernel entry now: the "boot line"
    assert end is not None and end.path == PositionStore.key(journal.directory)
    findings: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=follow_journal, args=(journal.directory, findings, stop),
                              kwargs={"resume": end})
    thread.start()
    try:
        # a kernel line, a service's line (not the kernel's: not read), and a kernel line that is not UTF-8,
        # which journalctl's JSON gives as an array of byte values
        journal.write(("kernel", xid("3b:00")), ("stdout", xid("5e:00")), ("kernel", b"NVRM: bad \xff byte"))
        got = take(findings, 2)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert [f.line for f in got] == [xid("3b:00"), "NVRM: bad \ufffd byte"]
    cursors = [f.position.cursor for f in got if isinstance(f.position, JournalPosition)]
    assert len(set(cursors)) == 2 and end.cursor not in cursors
    assert findings.empty()


def test_a_journal_with_no_kernel_entry_has_no_end_and_a_missing_one_is_an_error(journal: Journal) -> None:
    journal.write(("stdout", "a service's line"))
    assert journal_end(journal.directory) is None and is_journal(journal.directory)
    assert not is_journal(journal.directory.parent / "nothing")
    with pytest.raises(ValueError, match="journalctl --directory"):
        journal_end(journal.directory.parent / "nothing")


@pytest.mark.parametrize(("cursor", "restart", "expected"), [
    # t= is the entry's realtime in hex microseconds: 0x644b06d5ce000 µs = 1,764,374,400 s (T0)
    ("s=ab;i=1;b=cd;m=1;t=644b06d5ce000;x=ef", ["--since", "@1764374400"], [xid("18:00"), xid("3b:00")]),
    # no time in it: from the journal's end
    ("not a cursor", ["--lines=0"], []),
])
def test_a_cursor_journalctl_refuses_is_replaced_by_its_time_or_the_end(
        journal: Journal, tmp_path: Path, cursor: str, restart: list[str], expected: list[str]) -> None:
    assert hex(T0_US)[2:] == "644b06d5ce000"
    journal.write(("kernel", xid("18:00")), ("kernel", xid("3b:00")))  # at T0 + 1 s and T0 + 2 s
    calls = tmp_path / "calls"
    wrapper = tmp_path / "journalctl"  # the real journalctl, each call's arguments recorded
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {shutil.which("journalctl")} "$@"\n')
    wrapper.chmod(0o755)
    findings: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=follow_journal, args=(journal.directory, findings, stop), kwargs={
        "resume": JournalPosition("j", cursor), "restart_s": 0.05, "journalctl": str(wrapper)})
    thread.start()
    try:
        wait_until(lambda: calls.exists() and len(calls.read_text().splitlines()) >= 2, "journalctl started again")
        got = take(findings, len(expected))
    finally:
        stop.set()
        thread.join(10)
    first, second = calls.read_text().splitlines()[:2]
    assert f"--after-cursor {cursor}" in first and "--after-cursor" not in second
    assert " ".join(restart) in second
    assert [f.line for f in got] == expected


def log_agent(server: FakeApiServer, candidates: list[Path], state: Path) -> Agent:
    """An agent on the node's kernel log as the command runs it: `follow_kernel_log` over the candidates."""
    store = PositionStore(state)
    found = find_kernel_log(candidates, store)  # before the threads start, as the command does
    return Agent(server, lambda findings, stop, _: follow_kernel_log(candidates, findings, stop, positions=store,
                                                                     found=found, file_poll_s=0.01), state, store)


def reported_buses(server: FakeApiServer) -> list[str]:
    items, _ = server.api.list(EVENTS_PATH, label_selector=REPORT_LABEL)
    return [(r.evidence[0].line or "").split("PCI:0000:")[1][:5] for r in reports_in_order(items)]


def saved_cursor(state: Path, directory: Path) -> str | None:
    saved = PositionStore(state).journal(directory)
    return None if saved is None else saved.cursor


def test_a_restarted_agent_on_a_journald_node_reports_what_was_logged_while_it_was_down_once(
        server: FakeApiServer, journal: Journal, tmp_path: Path) -> None:
    state = tmp_path / "state" / "positions.json"
    candidates = [tmp_path / "kern.log", tmp_path / "messages", journal.directory]  # no rsyslog on this node
    journal.write(("kernel", xid("86:00")))  # before the first start, no saved position: not read
    first = log_agent(server, candidates, state)
    try:
        journal.write(("kernel", xid("18:00")))
        wait_until(lambda: reported_buses(server) == ["18:00"], "the first Xid posted")
        wait_until(lambda: saved_cursor(state, journal.directory) is not None, "its cursor saved")
    finally:
        first.kill()
    assert first.followed == [journal.directory]
    journal.write(("kernel", "step 10 loss 1.0"), ("kernel", xid("3b:00")))  # while the agent is down
    second = log_agent(server, candidates, state)
    try:
        wait_until(lambda: reported_buses(server) == ["18:00", "3b:00"], "the Xid logged while it was down")
        last = journal_end(journal.directory)
        assert last is not None
        wait_until(lambda: saved_cursor(state, journal.directory) == last.cursor, "the journal read to its end")
    finally:
        second.kill()
    assert reported_buses(server) == ["18:00", "3b:00"]  # nothing lost, nothing posted twice


@pytest.mark.parametrize(("present", "expected"), [
    # kern.log and a journal (Ubuntu keeps both): the file, which rsyslog wrote from the same kernel lines
    (("kern.log", "journal"), "kern.log"),
    (("messages", "journal"), "messages"),
    (("journal",), "journal"),  # journald only
    # a journal directory with no journal file in it yet is not a journal: the next candidate
    (("empty-journal", "run-journal"), "run-journal"),
])
def test_the_first_kernel_log_there_is_followed(tmp_path: Path, present: tuple[str, ...], expected: str) -> None:
    paths = {name: tmp_path / name for name in ("kern.log", "messages", "empty-journal", "journal", "run-journal")}
    for name in present:
        if name.endswith("journal"):
            paths[name].mkdir()
            if name != "empty-journal":
                Journal(paths[name]).write(("kernel", "boot line"))
        else:
            paths[name].write_text("boot line\n")
    stop = threading.Event()
    followed: list[Path | None] = []
    thread = threading.Thread(target=lambda: followed.append(follow_kernel_log(
        list(paths.values()), queue.Queue(), stop, positions=PositionStore(tmp_path / "state.json"))))
    thread.start()
    time.sleep(0.5)
    stop.set()
    thread.join(10)
    assert followed == [paths[expected]]


def test_with_no_kernel_log_yet_it_looks_again_until_one_appears(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    findings: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=follow_kernel_log, args=([log], findings, stop),
                              kwargs={"positions": PositionStore(tmp_path / "s.json"), "poll_s": 0.05,
                                      "file_poll_s": 0.01, "from_start": True})
    thread.start()
    try:
        time.sleep(0.2)
        log.write_text(f"{xid('18:00')}\n")
        assert findings.get(timeout=10).line == xid("18:00")
    finally:
        stop.set()
        thread.join(10)


def test_journal_cursors_are_saved_beside_the_files_positions(tmp_path: Path) -> None:
    state = tmp_path / "positions.json"
    store = PositionStore(state)
    at = JournalPosition(PositionStore.key(tmp_path / "journal"), "s=ab;i=7;b=cd;m=1;t=2;x=ef")
    store.advance(at)
    assert store.dirty
    store.save()
    again = PositionStore(state)
    assert again.journal(tmp_path / "journal") == at and again.positions == {}
    again.advance(at)  # the same cursor: nothing to save
    assert not again.dirty


def test_gpuplane_node_reporter_follows_the_journal_on_a_node_without_kern_log(
        server: FakeApiServer, journal: Journal, tmp_path: Path) -> None:
    # the node agent's container as deploy/node-agent/daemonset.yaml runs it, on a journald-only node
    state = tmp_path / "state" / "node-reporter.json"
    journal.write(("kernel", xid("86:00")))  # before the first start: not reported (read from the end)
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    port = free_port()
    with gpuplane_daemon(["node-reporter", "--node-name", "gpu-7", "--kernel-log", str(tmp_path / "kern.log"),
                          "--kernel-log", str(journal.directory), "--state-file", str(state),
                          "--health-port", str(port), "--kubeconfig", str(kubeconfig)]) as child:
        wait_until(lambda: healthy(port), "/healthz", timeout_s=60)  # served once the journal's end is taken
        journal.write(("kernel", xid("18:00")))
        wait_until(lambda: reported_buses(server) == ["18:00"], "the Xid's Event", timeout_s=60)
        wait_until(lambda: saved_cursor(state, journal.directory) is not None, "the cursor saved", timeout_s=10)
        returncode, output = sigterm(child)
        assert returncode == 0, output


def test_once_reads_the_first_kernel_log_there_whole(server: FakeApiServer, journal: Journal, tmp_path: Path) -> None:
    from typer import Typer
    from typer.testing import CliRunner

    from gpuplane.cli.node_reporter_cmd import register

    app = Typer()
    register(app)
    journal.write(("kernel", xid("18:00")), ("stdout", xid("3b:00")), ("kernel", "step 1 loss 2.0"))
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    base = ["--once", "--node-name", "gpu-7", "--kubeconfig", str(kubeconfig)]
    result = CliRunner().invoke(app, [*base, "--kernel-log", str(tmp_path / "kern.log"),
                                      "--kernel-log", str(journal.directory)])
    assert result.exit_code == 0, result.output
    assert "gpu-7: 1 report(s) posted" in result.output and reported_buses(server) == ["18:00"]  # the kernel's
    missing = CliRunner().invoke(app, [*base, "--kernel-log", str(tmp_path / "kern.log")])
    assert missing.exit_code != 0 and "none of" in missing.output
