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
from gpuplane.node.reporter import Finding, NodeReporter, follow_command, follow_file

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


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


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
