"""The node agent's reports through the local API server: a verdict the classifier acts on becomes a core/v1
Event about the Node (or Pod) with the evidence in its annotations; tolerated and unmatched lines post
nothing; a failing check tier posts, a passing one only after a failure; a refused post is kept and retried;
and every report reads back as it was written."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer import Typer
from typer.testing import CliRunner

from daemons import free_port, gpuplane_daemon, healthy, sigterm
from gpuplane.cli.node_reporter_cmd import register
from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.health import HealthEvent
from gpuplane.controllers.recovery import Evidence
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.node_reports import (
    COMPONENT,
    EVENTS_PATH,
    REPORT_LABEL,
    NodeReport,
    parse_report,
    report_event,
    reports_in_order,
)
from gpuplane.model.failures import load_signature_library
from gpuplane.node.health_checks import CheckResult
from gpuplane.node.reporter import (
    Finding,
    LogPosition,
    NodeReporter,
    PositionStore,
    end_of,
    follow_command,
    follow_file,
)
from node_agent import Agent

XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2417, GPU has fallen off the bus."
XID_43 = "NVRM: Xid (PCI:0000:86:00): 43, pid=3112, name=python3, Ch 00000010"
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
T0 = 1_764_374_400.0  # 2025-11-29T00:00:00Z


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def now(self) -> float:
        return self.t


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def reporter(server: FakeApiServer, clock: Clock) -> NodeReporter:
    return NodeReporter(server.api, "gpu-7", FailureClassifier(load_signature_library()), clock.now)


def events(server: FakeApiServer) -> list[dict]:
    items, _ = server.api.list(EVENTS_PATH, label_selector=REPORT_LABEL)
    return list(items)


@dataclass(frozen=True)
class LineCase:
    name: str
    line: str
    pod: str | None
    reason: str | None
    """None: nothing is posted"""
    involved: tuple[str, str, str] = ("Node", "", "gpu-7")
    namespace: str = "default"


LINE_CASES = [
    LineCase("xid-79-isolates", XID_79, None, "FaultIsolateNode"),
    LineCase("oom-in-a-pod", OOM, "ml/train-0", "FaultDoNotRetry", ("Pod", "ml", "train-0"), "ml"),
    LineCase("xid-43-is-tolerated", XID_43, None, None),
    LineCase("an-ordinary-line", "step 1200 loss 2.31", None, None),
]


@pytest.mark.parametrize("case", LINE_CASES, ids=[c.name for c in LINE_CASES])
def test_a_log_line_becomes_an_event_when_a_signature_acts_on_it(server: FakeApiServer, case: LineCase) -> None:
    clock = Clock()
    agent = reporter(server, clock)
    report = agent.line(case.line, pod=case.pod)
    posted = events(server)
    if case.reason is None:
        assert report is None and posted == []
        return
    assert report is not None and len(posted) == 1
    event = posted[0]
    kind, namespace, name = case.involved
    assert event["involvedObject"]["kind"] == kind and event["involvedObject"]["name"] == name
    assert event["involvedObject"].get("namespace", "") == namespace
    assert event["metadata"]["namespace"] == case.namespace and event["metadata"]["name"].startswith(f"{name}.")
    assert (event["reason"], event["type"], event["count"]) == (case.reason, "Warning", 1)
    assert event["source"] == {"component": COMPONENT, "host": "gpu-7"}
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2025-11-29T00:00:00Z"
    back = parse_report(event)
    assert back is not None and back.evidence == (Evidence("gpu-7", line=case.line, t=T0),)
    assert back.node == "gpu-7" and back.kind == "failure" and back.pod == case.pod


def result(passed: bool | None, critical: bool = False) -> CheckResult:
    return CheckResult("nvml", passed, "ok" if passed else "ECC errors", critical=critical)


def test_check_tiers_post_failures_and_the_pass_that_follows_one(server: FakeApiServer) -> None:
    clock = Clock()
    agent = reporter(server, clock)
    # healthy and passing: nothing; all skipped: nothing
    assert agent.checks([result(True)]) is None and agent.checks([result(None)]) is None
    clock.t += 60
    failed = agent.checks([result(False)])
    clock.t += 60
    critical = agent.checks([result(False, critical=True)])
    clock.t += 60
    cleared = agent.checks([result(True)])
    clock.t += 60
    assert agent.checks([result(True)]) is None  # healthy again: nothing more
    reports = reports_in_order(events(server))
    assert [(r.health_event, r.reason) for r in reports] == [
        (HealthEvent.CHECK_FAILED, "HealthCheckFailed"), (HealthEvent.CRITICAL_FAILURE, "HealthCheckCritical"),
        (HealthEvent.CHECK_PASSED, "HealthCheckPassed")]
    assert [r.t for r in reports] == [T0 + 60, T0 + 120, T0 + 180]
    assert failed is not None and critical is not None and cleared is not None
    assert [e["type"] for e in sorted(events(server), key=lambda e: e["firstTimestamp"])] == [
        "Warning", "Warning", "Normal"]


def test_a_refused_post_is_kept_and_retried_first(server: FakeApiServer) -> None:
    clock = Clock()
    agent = reporter(server, clock)
    server.fail_next("POST", r"/events$", 503, "ServiceUnavailable", times=1)
    agent.xid(79)
    assert events(server) == [] and len(agent.pending) == 1
    clock.t += 1
    agent.line(OOM)
    assert not agent.pending  # the kept one went first, then the new one
    reports = reports_in_order(events(server))
    assert [r.reason for r in reports] == ["FaultIsolateNode", "FaultDoNotRetry"]
    assert [r.evidence[0].xid for r in reports] == [79, None]


def test_an_event_that_is_not_a_report_reads_as_none() -> None:
    assert parse_report({"metadata": {"name": "x"}, "reason": "Scheduled"}) is None
    assert parse_report({"metadata": {"labels": {REPORT_LABEL: "health"}}, "source": {"host": "n"}}) is None
    bad = {"metadata": {"labels": {REPORT_LABEL: "failure"}, "annotations": {"gpuplane.io/evidence": "{"}}}
    assert parse_report(bad) is None


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(line=st.none() | text, xid=st.none() | st.integers(0, 200), t=st.floats(1e9, 2e9),
       pod=st.none() | st.just("ml/p-1"), health=st.none() | st.sampled_from(list(HealthEvent)))
def test_a_report_reads_back_as_written(line: str | None, xid: int | None, t: float, pod: str | None,
                                        health: HealthEvent | None) -> None:
    kind = "failure" if health is None else "health"
    report = NodeReport(kind, "gpu-1", t, "R", "m" * 2000, (Evidence("gpu-1", line=line, xid=xid, t=t),), health,
                        {"signature": "s"}, pod)
    event = report_event(report, "agent")
    assert len(event["message"]) == 1024  # cut to the limit
    back = parse_report(event)
    assert back is not None
    assert (back.kind, back.node, back.t, back.evidence, back.health_event, back.pod) == (
        kind, "gpu-1", t, report.evidence, health, pod)
    assert dict(back.verdict or {}) == {"signature": "s"}


def wait_until(condition: Callable[[], bool], what: str, *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_a_file_read_from_its_end_as_at_the_start_keeps_a_line_written_before_its_thread_runs(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line\n")
    start = end_of(log)  # what the command takes before it starts the follower and serves /healthz
    assert start is not None and start.offset == len("old line\n")
    log.write_text("old line\nnew line\n")  # written before the follower's first look at the file
    findings: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=follow_file, args=(log, findings, stop), kwargs={"poll_s": 0.01,
                                                                                      "resume": start})
    thread.start()
    try:
        assert findings.get(timeout=10).line == "new line"
    finally:
        stop.set()
        thread.join(5)
    assert end_of(tmp_path / "missing.log") is None


def test_a_followed_file_gives_its_new_lines_and_is_reopened_when_truncated(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("old line\n")
    findings: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    thread = threading.Thread(target=follow_file, args=(log, findings, stop), kwargs={"poll_s": 0.01})
    thread.start()
    try:
        time.sleep(0.05)
        with log.open("a") as handle:
            handle.write(f"{XID_79}\npartial")  # a line without its newline waits for it
        wait_until(lambda: findings.qsize() == 1, "the new line")
        assert findings.get().line == XID_79
        log.write_text("after rotation\n")  # shorter than before: truncated, read from the start
        wait_until(lambda: findings.qsize() == 1, "the line after rotation")
        assert findings.get().line == "after rotation"
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_a_followed_command_is_a_child_process_whose_lines_are_findings() -> None:
    findings: queue.Queue[Finding] = queue.Queue()
    stop = threading.Event()
    argv = [sys.executable, "-c", f"print({XID_79!r}); import time; time.sleep(30)"]
    thread = threading.Thread(target=follow_command, args=(argv, findings, stop))
    thread.start()
    try:
        wait_until(lambda: findings.qsize() == 1, "the child's line")
        assert findings.get().line == XID_79
    finally:
        stop.set()  # terminates the child: the thread ends
        thread.join(10)
    assert not thread.is_alive()


def test_gpuplane_node_reporter_once_posts_what_the_log_says(server: FakeApiServer, tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"boot ok\n{XID_79}\n{XID_43}\nstep 10 loss 1.0\n")
    app = Typer()
    register(app)  # its one command: Typer runs it as the app itself
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    result = CliRunner().invoke(app, ["--node-name", "gpu-7", "--follow", str(log), "--once",
                                      "--kubeconfig", str(kubeconfig)])
    assert result.exit_code == 0, result.output
    assert "gpu-7: 1 report(s) posted" in result.output  # Xid 79 only: Xid 43 is tolerated, the rest unmatched
    assert [r.reason for r in reports_in_order(events(server))] == ["FaultIsolateNode"]
    missing = CliRunner().invoke(app, ["--once", "--node-name", "n", "--check", "smart"])
    assert missing.exit_code == 2 and "unknown" in missing.output


def test_gpuplane_node_reporter_runs_until_sigterm_with_its_health_port(server: FakeApiServer, tmp_path: Path) -> None:
    # The node agent's container (deploy/node-agent/daemonset.yaml) runs this: a log followed from its end, the
    # state file kept, /healthz served for the kubelet's probes, SIGTERM ends it with exit 0.
    log, state = tmp_path / "kern.log", tmp_path / "state" / "node-reporter.json"
    log.write_text(f"{XID_79}\n")  # before the first start: not reported (read from the end)
    port = free_port()
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    with gpuplane_daemon(["node-reporter", "--node-name", "gpu-7", "--follow", str(log), "--state-file", str(state),
                          "--health-port", str(port), "--kubeconfig", str(kubeconfig)]) as child:
        wait_until(lambda: healthy(port), "/healthz", timeout_s=60)
        with log.open("a") as handle:
            handle.write(f"{XID_79}\n")
        wait_until(lambda: len(events(server)) == 1, "the Xid's Event", timeout_s=30)
        wait_until(state.exists, "the state file", timeout_s=10)
        returncode, output = sigterm(child)
        assert returncode == 0, output
    assert [r.reason for r in reports_in_order(events(server))] == ["FaultIsolateNode"]
    assert not healthy(port)


def file_agent(server: FakeApiServer, log: Path, state: Path) -> Agent:
    """An agent following one log file from its saved position."""
    return Agent(server, lambda findings, stop, store: follow_file(log, findings, stop, poll_s=0.01,
                                                                   resume=store.get(log)), state)


def xid_line(bus: str) -> str:
    return XID_79.replace("18:00", bus)


def reported_buses(server: FakeApiServer) -> list[str]:
    """The PCI bus of each posted report's line, in posting order (a bus twice: reported twice)."""
    lines = [r.evidence[0].line or "" for r in reports_in_order(events(server))]
    return [line.split("PCI:0000:")[1][:5] for line in lines]


def saved_offset(state: Path, log: Path) -> int | None:
    position = PositionStore(state).get(log)
    return None if position is None else position.offset


@dataclass(frozen=True)
class DownCase:
    name: str
    while_down: Callable[[Path], None]
    """what happens to the log while the agent is down"""
    expected: list[str]
    """the buses reported over both lives, in order: "18:00" before the kill"""


def _append(log: Path) -> None:
    with log.open("a") as handle:
        handle.write(f"step 10 loss 1.0\n{xid_line('3b:00')}\n")


def _rotate_longer(log: Path) -> None:
    log.rename(log.with_name("kern.log.1"))  # the old file stays: its inode is not reused
    log.write_text(f"{'boot ok ' * 20}\n{xid_line('5e:00')}\n")  # longer than the saved offset: the inode tells


def _truncate(log: Path) -> None:
    log.write_text(f"{xid_line('86:00')}\n")  # same inode, shorter than the saved offset


DOWN_CASES = [
    DownCase("appended-while-down", _append, ["18:00", "3b:00"]),
    DownCase("rotated-while-down", _rotate_longer, ["18:00", "5e:00"]),
    DownCase("truncated-while-down", _truncate, ["18:00", "86:00"]),
]


@pytest.mark.parametrize("case", DOWN_CASES, ids=[c.name for c in DOWN_CASES])
def test_a_restarted_agent_reports_what_was_logged_while_it_was_down_once(
        server: FakeApiServer, tmp_path: Path, case: DownCase) -> None:
    log, state = tmp_path / "kern.log", tmp_path / "state" / "positions.json"
    log.write_text("boot ok\n")  # before the first start, no saved position: the first agent starts at the end
    first = file_agent(server, log, state)
    try:
        time.sleep(0.05)
        with log.open("a") as handle:
            handle.write(f"{xid_line('18:00')}\n")
        size = log.stat().st_size
        wait_until(lambda: saved_offset(state, log) == size, "the first Xid's position saved")
    finally:
        first.kill()
    assert reported_buses(server) == ["18:00"]  # "boot ok" was before the start: not read
    case.while_down(log)
    second = file_agent(server, log, state)
    try:
        size = log.stat().st_size
        wait_until(lambda: saved_offset(state, log) == size, "the log read to its end and saved")
    finally:
        second.kill()
    assert reported_buses(server) == case.expected  # nothing lost, nothing posted twice


def test_a_refused_post_holds_the_saved_position_until_it_is_posted(server: FakeApiServer, tmp_path: Path) -> None:
    log, state = tmp_path / "kern.log", tmp_path / "positions.json"
    log.write_text("")
    # refused 5 times: the first post and the idle flushes 0.2 s apart, so about a second before it is posted
    server.fail_next("POST", r"/events$", 503, "ServiceUnavailable", times=5)
    agent = file_agent(server, log, state)
    try:
        time.sleep(0.05)
        with log.open("a") as handle:
            handle.write(f"{xid_line('18:00')}\n")
        wait_until(lambda: len(agent.reporter.pending) == 1, "the refused post")
        assert saved_offset(state, log) is None  # not posted: not saved (a kill now re-reads it)
        wait_until(lambda: bool(events(server)), "the retry")  # the loop's idle flush retries it
        size = log.stat().st_size
        wait_until(lambda: saved_offset(state, log) == size, "the position saved once posted")
    finally:
        agent.kill()
    assert reported_buses(server) == ["18:00"]


@settings(max_examples=40, deadline=None)
@given(device=st.integers(0, 2**63), inode=st.integers(0, 2**63), offset=st.integers(0, 2**40))
def test_a_saved_position_reads_back_as_written(tmp_path_factory: pytest.TempPathFactory, device: int, inode: int,
                                                offset: int) -> None:
    state = tmp_path_factory.mktemp("s") / "positions.json"
    store = PositionStore(state)
    position = LogPosition(PositionStore.key(Path("kern.log")), device, inode, offset)
    store.advance(position)
    store.save()
    assert PositionStore(state).get(Path("kern.log")) == position
    assert [p.name for p in state.parent.iterdir()] == ["positions.json"]  # the temporary file renamed away


def test_an_unreadable_state_file_reads_as_no_positions(tmp_path: Path) -> None:
    state = tmp_path / "positions.json"
    state.write_text("{torn")
    assert PositionStore(state).positions == {}
