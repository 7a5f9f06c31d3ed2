"""The classifier's reasoning beyond one line: across nodes, repeats per job, named Xids, NVLink5 verdicts,
timestamps behind logger prefixes, and the corpus scorer's settled action."""

from __future__ import annotations

import calendar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.classifier import FailureClassifier, _normalise_by_word, line_timestamp, normalise_line
from gpuplane.controllers.diagnosis_corpus import settled_action
from gpuplane.model.failures import FailureAction, line_events, load_signature_library

LIBRARY = load_signature_library()
IB = "h{n}:1:2 [0] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.0.{n}<1> with error 12"
WORKER = "h{n}:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/IB/0"


def test_the_same_blaming_error_on_every_node_blames_none() -> None:
    # three nodes, each logs the IB completion error at start-up: the fabric, not a node
    c = FailureClassifier(LIBRARY)
    for n in range(3):
        c.feed_line(f"node{n}", IB.format(n=n), t=10.0 + n)
    verdict = c.verdict()
    assert verdict.signature is not None and verdict.signature.id == "net-ib-completion-error"
    assert verdict.action is FailureAction.RESTART_JOB and verdict.blamed_nodes == ()


def test_the_same_error_on_some_nodes_still_blames_them() -> None:
    # node2 logs only an INFO line: the error is not everywhere, so node0 and node1 stay blamed
    c = FailureClassifier(LIBRARY)
    for n in range(2):
        c.feed_line(f"node{n}", IB.format(n=n), t=10.0 + n)
    c.feed_line("node2", WORKER.format(n=2), t=10.0)
    verdict = c.verdict()
    assert verdict.action is FailureAction.ISOLATE_NODE and verdict.blamed_nodes == ("node0", "node1")


def test_one_node_alone_is_not_every_node() -> None:
    c = FailureClassifier(LIBRARY)
    c.feed_line("node0", IB.format(n=0), t=1.0)
    assert c.verdict().action is FailureAction.ISOLATE_NODE


SEGV = "Process finished with exit code 139 (interrupted by signal 11: SIGSEGV)"


def test_a_deterministic_fault_restarts_once_then_stops_wherever_the_job_reruns() -> None:
    # attempt 1 on node-a restarts; attempt 2 lands on node-b and fails the same way: stop (not per node)
    c = FailureClassifier(LIBRARY)
    c.reset(scope="job-1")
    c.feed_line("node-a", SEGV, t=100.0)
    assert c.verdict().action is FailureAction.RESTART_JOB
    c.reset(scope="job-1")
    c.feed_line("node-b", SEGV, t=200.0)
    assert c.verdict().action is FailureAction.DO_NOT_RETRY


def test_repeats_count_per_job() -> None:
    # another job's segfault is that job's first: it restarts
    c = FailureClassifier(LIBRARY)
    c.reset(scope="job-1")
    c.feed_line("node-a", SEGV, t=100.0)
    c.reset(scope="job-2")
    c.feed_line("node-a", SEGV, t=200.0)
    assert c.verdict().action is FailureAction.RESTART_JOB


def test_the_scorer_compares_the_settled_action() -> None:
    # the first verdict restarts; the label's "a restart does not help" is what it settles at
    c = FailureClassifier(LIBRARY)
    c.feed_line("n", SEGV, t=1.0)
    verdict = c.verdict()
    assert verdict.action is FailureAction.RESTART_JOB
    assert settled_action(verdict) is FailureAction.DO_NOT_RETRY


@pytest.mark.parametrize(("line", "xid"), [
    # an Xid 45 names its cause: the cause is read, not the echo's own code
    ("kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=18, name=python3, Ch 00000001 caused by previous Xid 149", 149),
    ("NVRM: Xid (PCI:0000:dc:00): 45, pid=18, name=python3, Ch 00000001", 45),
    # the device plugin's health line
    ("2024/01/02 03:04:05 XidCriticalError: Xid=48 on Device=GPU-1a2b, the device will go unhealthy.", 48),
    # NVLink5 with a fatal status is read; a Nonfatal status is IGNORE in NVIDIA's decode table
    ("NVRM: Xid (PCI:0018:01:00): 149, NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000)", 149),
    ("NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008)", None),
    # "Nonfatal" only qualifies the NVLink5 range
    ("NVRM: Xid (PCI:0018:01:00): 79, GPU has fallen off the bus. Nonfatal", 79),
])
def test_xid_readings(line: str, xid: int | None) -> None:
    xids = [v for k, v in line_events(line) if k == "xid"]
    assert xids == ([] if xid is None else [xid])



@pytest.mark.parametrize(("line", "code"), [
    # a launcher's summary in words: negative codes are torchrun's "killed by signal n"
    ("run 12: launcher failed with exit code -9 (pid 4242)", -9),
    ("worker 3 exited with exit code -11", -11),
    # a positive code in words is not read (exit-N signatures and segfault-spellings read their own)
    ("worker 3 exited with exit code 139", None),
    ("  exitcode  : -6 (pid: 4242)", -6),
])
def test_exit_readings(line: str, code: int | None) -> None:
    codes = [v for k, v in line_events(line) if k == "exit"]
    assert codes == ([] if code is None else [code])


T = calendar.timegm((2026, 12, 1, 12, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(("line", "seconds"), [
    ("[rank0]:[W1201 12:00:00.250000 ProcessGroupNCCL.cpp:1] x", T + 0.25),
    ("I1201 12:00:00.500000  4242 socket.cpp:1] x", T + 0.5),
    ("[E1201 12:00:03.000000000 socket.cpp:957] [c10d] x", T + 3.0),
    ("Dec  1 12:00:07 gpu-node-3 kernel: NVRM: Xid", T + 7.0),
    ("vllm-1  | ERROR 12-01 12:00:09 engine.py:366] x", T + 9.0),
    ("(EngineCore_DP0 pid=7) INFO 12-01 12:00:11 [core.py:1] x", T + 11.0),
    ("node2: 2026-12-01T12:00:13Z x", T + 13.0),
    ("[2026-12-01 12:00:15,500] [INFO] x", T + 15.5),
    ("plain text without a time", None),
])
def test_timestamps_behind_prefixes(line: str, seconds: float | None) -> None:
    assert line_timestamp(line, year=2026) == seconds


def test_lines_of_two_nodes_order_by_their_own_clocks() -> None:
    # node-b's glog line is 5 s before node-a's syslog line though fed after it: node-b's error is first
    c = FailureClassifier(LIBRARY, line_time=lambda text: line_timestamp(text, year=2026), cause_window_s=0.0)
    c.feed_line("node-a", "Dec  1 12:00:10 node-a kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, fallen off the bus")
    c.feed_line("node-b", "E1201 12:00:05.000000 7 ProcessGroupNCCL.cpp:1] ncclRemoteError: remote process exited")
    verdict = c.verdict()
    assert verdict.cause is not None and verdict.cause.node == "node-b"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(alphabet="0123456789abcdefxXABCDEFghz _.:-\t/", max_size=120).map(str.encode))
def test_the_fast_template_is_the_word_by_word_rule(line: bytes) -> None:
    # five substitutions without callbacks give the template the word-by-word rule gives
    assert normalise_line(line) == _normalise_by_word(line)
