"""The streaming failure classifier: first-error-wins cascades, exit codes, escalation, bad input, the
unmatched report, timestamps, and the `classify` / `bench classify` commands."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpuplane.cli.bench import classify_bench_log
from gpuplane.cli.main import app
from gpuplane.controllers.classifier import FailureClassifier, Prefilter, line_timestamp, normalise_line
from gpuplane.model.failures import FailureAction, FailureClass, load_signature_library

LIBRARY = load_signature_library()
runner = CliRunner()

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_63 = "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate."
WATCHDOG = ("[rank{r}]:[E501 12:03:11.2 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=38121, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
            "600012 milliseconds before timing out.")
ABORTED = "[rank{r}]:[E501 12:03:12.0 ProcessGroupNCCL.cpp:1896] NCCL communicator was aborted on rank {r}."
IB_DOWN = "mlx5_core 0000:5e:00.0 ens1f0np0: Link down"
NODES = [f"gpu-node-{i:03d}" for i in range(8)]


@pytest.fixture
def classifier() -> FailureClassifier:
    return FailureClassifier(LIBRARY)


# ----------------------------------------------------------------------------------------- first error wins

def _cascade(c: FailureClassifier, culprit: str, t0: float) -> None:
    """Xid 79 on the culprit; 600 s later every rank's watchdog fires, communicators abort, torchrun exits -6."""
    for rank, node in enumerate(NODES):
        c.feed_line(node, WATCHDOG.format(r=rank), t=t0 + 600 + rank * 0.01)
        c.feed_line(node, ABORTED.format(r=rank), t=t0 + 601)
        c.feed_line(node, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", t=t0 + 602)
        c.feed_exit(node, -6, t=t0 + 602)
    c.feed_line(culprit, XID_79, t=t0)  # the kernel log arrives last; its time is what counts


def test_xid_79_then_nccl_timeouts_everywhere_blames_the_xid_node(classifier: FailureClassifier) -> None:
    _cascade(classifier, "gpu-node-005", t0=1000.0)
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["xid-79"]
    assert verdict.action is FailureAction.ISOLATE_NODE
    assert verdict.failure_class is FailureClass.GPU_HARDWARE
    assert verdict.blamed_nodes == ("gpu-node-005",)
    assert verdict.cause is not None and verdict.cause.node == "gpu-node-005" and verdict.cause.t == 1000.0
    assert len(verdict.matches) == 4 * len(NODES) + 1
    assert not verdict.unknown


def test_an_echo_logged_earlier_does_not_beat_the_cause(classifier: FailureClassifier) -> None:
    # clock skew: a peer's watchdog timestamp precedes the culprit's Xid; echoes only decide when alone
    classifier.feed_line("gpu-node-001", WATCHDOG.format(r=1), t=50.0)
    classifier.feed_line("gpu-node-000", XID_79, t=60.0)
    assert classifier.verdict().signature is LIBRARY["xid-79"]


def test_timeouts_alone_restart_without_blame(classifier: FailureClassifier) -> None:
    for rank, node in enumerate(NODES):
        classifier.feed_line(node, WATCHDOG.format(r=rank), t=600.0 + rank)
        classifier.feed_exit(node, -6, t=700.0)
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["nccl-watchdog-timeout"]
    assert verdict.action is FailureAction.RESTART_JOB and verdict.blamed_nodes == ()
    assert verdict.cause is not None and verdict.cause.node == NODES[0]


def test_software_error_on_every_rank_is_not_retried(classifier: FailureClassifier) -> None:
    for rank, node in enumerate(NODES):
        classifier.feed_line(node, f"[rank{rank}]: Traceback (most recent call last):", t=10.0)
        classifier.feed_line(node, "ModuleNotFoundError: No module named 'flash_attn'", t=10.0 + rank * 0.1)
        classifier.feed_exit(node, 1, t=11.0)
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["py-import-error"]
    assert verdict.action is FailureAction.DO_NOT_RETRY
    assert verdict.failure_class is FailureClass.SOFTWARE
    assert verdict.blamed_nodes == ()


def test_a_tie_goes_to_the_more_severe_action(classifier: FailureClassifier) -> None:
    classifier.feed_line("gpu-node-002", "RuntimeError: CUDA error: device-side assert triggered", t=5.0)
    classifier.feed_line("gpu-node-003", "RuntimeError: CUDA error: uncorrectable ECC error encountered", t=5.0)
    verdict = classifier.verdict()
    assert verdict.action is FailureAction.ISOLATE_NODE and verdict.blamed_nodes == ("gpu-node-003",)


# (Xid 48 at, cause): an OOM at t = 1; the Xids come later. Within the 120 s window of the earliest match
# the most severe is the cause (isolate-node outranks do-not-retry); past it the earlier error wins.
@pytest.mark.parametrize(("xid_at", "cause"), [
    (2.0, "xid-48"),      # 1 s later: inside the window
    (121.0, "xid-48"),    # 1 + 120: the window's edge is inside
    (121.5, "cuda-oom"),  # past the window: the OOM came first
    (500.0, "cuda-oom"),
])
def test_the_most_severe_error_within_the_window_of_the_first_is_the_cause(
        classifier: FailureClassifier, xid_at: float, cause: str) -> None:
    classifier.feed_line("a", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", t=1.0)
    classifier.feed_xid("b", 48, t=xid_at)
    classifier.feed_xid("c", 74, t=xid_at + 1.0)
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY[cause]
    assert verdict.blamed_nodes == ("b", "c")  # every blaming match is listed, the earliest first


def test_a_window_of_zero_is_the_earliest_match() -> None:
    classifier = FailureClassifier(LIBRARY, cause_window_s=0.0)
    classifier.feed_line("a", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", t=1.0)
    classifier.feed_xid("b", 48, t=1.5)
    assert classifier.verdict().signature is LIBRARY["cuda-oom"]
    with pytest.raises(ValueError, match="cause_window_s"):
        FailureClassifier(LIBRARY, cause_window_s=float("nan"))


def test_untimed_matches_rank_after_dated_ones_and_inherit_the_nodes_time(classifier: FailureClassifier) -> None:
    classifier.feed_line("a", "RuntimeError: CUDA error: an illegal memory access was encountered")
    classifier.feed_line("b", "[2024-05-01 12:00:00] step 12", t=300.0)
    classifier.feed_line("b", "ModuleNotFoundError: No module named 'apex'")  # a traceback line: inherits 300
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["py-import-error"] and verdict.cause is not None
    assert verdict.cause.t == 300.0
    assert verdict.matches[0].t is None


def test_no_match_restarts_and_counts_unknown_once_per_incident(classifier: FailureClassifier) -> None:
    classifier.feed_line("a", "[rank0] step 1200 | loss 2.31")
    classifier.feed_line("a", XID_63, t=1.0)  # tolerated: no cause
    for _ in range(2):
        verdict = classifier.verdict()
        assert verdict.unknown and verdict.signature is None and verdict.failure_class is None
        assert verdict.action is FailureAction.RESTART_JOB and verdict.blamed_nodes == ()
        assert [m.signature.id for m in verdict.matches] == ["xid-63"]
    assert classifier.unknown_failures == 1
    classifier.reset()
    assert classifier.verdict().matches == () and classifier.unknown_failures == 2
    classifier.reset()
    classifier.feed_xid("a", 79)
    assert not classifier.verdict().unknown and classifier.unknown_failures == 2
    assert classifier.stats().incidents == 3


def test_reset_keeps_counters_and_report(classifier: FailureClassifier) -> None:
    classifier.feed_line("a", "step 1")
    classifier.feed_xid("a", 79)
    classifier.reset()
    stats = classifier.stats()
    assert stats.lines == 1 and stats.events == 1 and stats.matched_events == 1
    assert classifier.verdict().matches == ()
    assert classifier.unmatched_report()[0].template == "step N"


# -------------------------------------------------------------------------------------------------- exit codes

@pytest.mark.parametrize(("code", "action"), [
    (1, FailureAction.DO_NOT_RETRY), (2, FailureAction.DO_NOT_RETRY), (126, FailureAction.DO_NOT_RETRY),
    (127, FailureAction.DO_NOT_RETRY), (128, FailureAction.DO_NOT_RETRY), (139, FailureAction.DO_NOT_RETRY),
    (130, FailureAction.RESTART_JOB), (137, FailureAction.RESTART_JOB), (138, FailureAction.RESTART_JOB),
    (143, FailureAction.RESTART_JOB),  # Kubeflow: permanent vs retryable
    (-6, FailureAction.RESTART_JOB), (-9, FailureAction.DO_NOT_RETRY), (-11, FailureAction.RESTART_JOB),
    (-15, FailureAction.RESTART_JOB),  # torchrun's signal codes (-9 alone: the OOM killer's mark)
    (134, FailureAction.RESTART_JOB), (135, FailureAction.DO_NOT_RETRY), (-7, FailureAction.DO_NOT_RETRY),
])
def test_exit_codes(classifier: FailureClassifier, code: int, action: FailureAction) -> None:
    match = classifier.feed_exit("a", code, t=1.0)
    assert match is not None and match.action is action
    verdict = classifier.verdict()
    assert verdict.action is action and verdict.blamed_nodes == ()


def test_exit_code_specifics(classifier: FailureClassifier) -> None:
    assert classifier.feed_exit("a", 0) is None and classifier.feed_exit("a", None) is None
    kill = classifier.feed_exit("a", None, "SIGKILL")
    assert kill is not None and kill.signature.id == "exit-137"
    assert kill.signature.failure_class is FailureClass.INFRASTRUCTURE
    segv = classifier.feed_exit("a", 139)
    assert segv is not None and segv.signature.failure_class is FailureClass.SOFTWARE
    abort = classifier.feed_exit("a", -6)
    assert abort is not None and abort.signature.id == "torchrun-sigabrt" and abort.signature.echo
    assert classifier.feed_exit("a", 3) is None
    assert "exit code 3: no signature" in {u.template for u in classifier.unmatched_report()}


def test_the_logged_reason_beats_the_exit_code(classifier: FailureClassifier) -> None:
    classifier.feed_exit("a", 137, t=10.0)  # exit codes are echoes
    classifier.feed_line("a", "      Reason:       OOMKilled", t=10.0)
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["k8s-oomkilled"] and verdict.action is FailureAction.DO_NOT_RETRY


def test_exit_lines_in_logs_are_read(classifier: FailureClassifier) -> None:
    match = classifier.feed_line("a", "  exitcode  : -9 (pid: 4242)")
    assert match is not None and match.signature.id == "torchrun-sigkill"
    match = classifier.feed_line("a", "Signal 7 (SIGBUS) received by PID 28731")
    assert match is not None and match.signature.id == "signal-sigbus"


def test_xid_events(classifier: FailureClassifier) -> None:
    match = classifier.feed_xid("gpu-node-001", 79, t=3.0)
    assert match is not None and match.evidence == "Xid 79" and match.blames_node
    # Xid 1 is unused in NVIDIA's catalogue: no signature
    assert classifier.feed_xid("gpu-node-001", 1) is None
    assert {u.template for u in classifier.unmatched_report()} == {"Xid 1: no signature"}
    # a dmesg Xid without a signature is an unmatched line
    assert classifier.feed_line("a", "NVRM: Xid (PCI:0000:3b:00): 1, pid=1, something new") is None


# -------------------------------------------------------------------------------------------------- escalation

def test_link_flaps_twice_within_five_minutes_isolate(classifier: FailureClassifier) -> None:
    first = classifier.feed_line("n1", IB_DOWN, t=0.0)
    other = classifier.feed_line("n2", IB_DOWN, t=10.0)
    assert first is not None and first.action is FailureAction.LOG_ONLY
    assert other is not None and other.action is FailureAction.LOG_ONLY
    assert classifier.verdict().unknown
    second = classifier.feed_line("n1", IB_DOWN, t=200.0)
    assert second is not None and second.escalated and second.action is FailureAction.ISOLATE_NODE
    verdict = classifier.verdict()
    assert verdict.cause is second and verdict.blamed_nodes == ("n1",)


def test_link_flaps_far_apart_stay_tolerated(classifier: FailureClassifier) -> None:
    for t in (0.0, 400.0, 800.0):
        match = classifier.feed_line("n1", IB_DOWN, t=t)
        assert match is not None and match.action is FailureAction.LOG_ONLY


def test_per_incident_escalation_counts_incidents_not_lines(classifier: FailureClassifier) -> None:
    line = "RuntimeError: CUDA error: an illegal memory access was encountered"
    for rank in range(4):  # every rank of the node logs it: still one incident
        match = classifier.feed_line("n1", line, t=100.0 + rank)
        assert match is not None and match.action is FailureAction.RESTART_JOB
    classifier.reset()
    match = classifier.feed_line("n1", line, t=5000.0)
    assert match is not None and match.escalated and match.action is FailureAction.DO_NOT_RETRY
    assert classifier.verdict().action is FailureAction.DO_NOT_RETRY
    classifier.reset(forget_history=True)
    match = classifier.feed_line("n1", line, t=9000.0)
    assert match is not None and match.action is FailureAction.RESTART_JOB


# --------------------------------------------------------------------------------------------------- bad input

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_never_raise(data: bytes) -> None:
    classifier = FailureClassifier(LIBRARY)
    for line in (data, data.split(b"\n")[0], b"NVRM: Xid (PCI:" + data, b"Exit Code: " + data):
        classifier.feed_line("n", line, t=1.0)
    classifier.verdict()
    classifier.unmatched_report()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_random_text_never_raises(text: str) -> None:
    classifier = FailureClassifier(LIBRARY)
    classifier.feed_line("n", text)
    classifier.feed_line("n", "RuntimeError: CUDA error: unspecified launch failure " + text)
    assert classifier.verdict().signature is LIBRARY["cuda-launch-failure"]


def test_invalid_utf8_and_nul_bytes(classifier: FailureClassifier) -> None:
    line = b"\xff\xfe\x00 RuntimeError: CUDA error: an illegal memory access was encountered \xc3\x28\x00"
    match = classifier.feed_line("a", line)
    assert match is not None and match.signature.id == "cuda-illegal-address"
    assert "\ufffd" in match.evidence
    assert classifier.feed_line("a", b"\x00" * 100) is None
    assert classifier.feed_line("a", "surrogate \udcff here") is None
    # other buffers are taken too (the annotation promises bytes | str)
    assert classifier.feed_line("a", bytearray(b"No devices were found")) is not None  # type: ignore[arg-type]
    assert classifier.feed_line("a", memoryview(b"No devices were found")) is not None  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes or str"):
        classifier.feed_line("a", 42)  # type: ignore[arg-type]


def test_a_10_mb_line_is_cut_and_counted(classifier: FailureClassifier) -> None:
    head = b"RuntimeError: CUDA error: device-side assert triggered "
    match = classifier.feed_line("a", head + b"x" * 10_000_000)
    assert match is not None and match.signature.id == "cuda-device-assert"
    assert len(match.evidence) <= 512
    assert classifier.feed_line("a", b"y" * 10_000_000 + head) is None  # beyond the inspected 4 KiB
    assert classifier.feed_line("a", "z" * 10_000_000) is None
    assert classifier.stats().truncated_lines == 3


def test_nan_times_are_no_times(classifier: FailureClassifier) -> None:
    match = classifier.feed_xid("a", 79, t=float("nan"))
    assert match is not None and match.t is None
    assert classifier.verdict().signature is LIBRARY["xid-79"]


# ------------------------------------------------------------------------------------------ unmatched report

def test_unmatched_lines_are_normalised_and_counted(classifier: FailureClassifier) -> None:
    classifier.feed_line("a", b"step 1 loss 0.5 comm 0x7f3a uuid GPU-3f2a1b0c\n")
    classifier.feed_line("b", "step 22 loss 12.25 comm 0xdeadbeef uuid GPU-99aa11ff")
    classifier.feed_line("c", "step 333  loss 1.5e-04 comm 0x1 uuid GPU-0000abcd")
    classifier.feed_line("c", "something else")
    report = classifier.unmatched_report()
    assert [(u.template, u.count) for u in report] == [("step N loss N comm X uuid GPU-X", 3),
                                                         ("something else", 1)]
    stats = classifier.stats()
    assert stats.unmatched_lines == 4 and stats.matched_lines == 0 and stats.unmatched_templates == 2


def test_normalise_line() -> None:
    assert normalise_line(b"[2024-05-01 12:03:11,201] rank12 lr 2.9E-04 ens1f0 cali0a1b2c3d4e") == (
        b"[N-N-N N:N:N,N] rankN lr N ensNfN caliX")


def test_unmatched_report_is_bounded_and_keeps_the_frequent() -> None:
    classifier = FailureClassifier(LIBRARY, max_templates=10)
    for _ in range(50):
        classifier.feed_line("a", "the usual line")
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo"]
    for first in words:
        for second in words:
            classifier.feed_line("a", f"rare {first} {second}")
    report = classifier.unmatched_report()
    assert len(report) <= 10 and report[0].template == "the usual line" and report[0].count == 50
    assert len(classifier.unmatched_report(top=3)) == 3
    stats = classifier.stats()
    assert stats.dropped_templates > 0 and stats.dropped_template_lines > 0
    assert stats.unmatched_templates <= 20 and stats.unmatched_lines == 50 + len(words) ** 2


def test_matches_are_bounded_but_the_cause_is_kept() -> None:
    classifier = FailureClassifier(LIBRARY, max_matches=5)
    for i in range(20):
        classifier.feed_line("a", WATCHDOG.format(r=i), t=100.0 + i)
    classifier.feed_xid("z", 79, t=1.0)
    verdict = classifier.verdict()
    assert len(verdict.matches) == 5 and classifier.stats().dropped_matches == 16
    assert verdict.signature is LIBRARY["xid-79"] and verdict.blamed_nodes == ("z",)


def test_prefilter_finds_overlapping_literals() -> None:
    prefilter = Prefilter([("abcdefgh", False, 1), ("efghijkl", False, 2), ("zzzzzz", False, 3)])
    hit = prefilter.regex.search(b"..abcdefghijkl..")
    assert hit is not None and prefilter.owners_of(b"..abcdefghijkl..", hit) == {1, 2}


# ---------------------------------------------------------------------------------------------- timestamps

@pytest.mark.parametrize(("line", "expected"), [
    ("2024-05-01T12:00:00Z NVRM: Xid", 1714564800.0),
    ("2024-05-01T12:00:00.250+02:00 x", 1714564800.25 - 7200),
    ("[2024-05-01 12:00:00,500] [INFO] x", 1714564800.5),
    ("[Wed May  1 12:00:00 2024] NVRM: Xid", 1714564800.0),
    ("[ 812.123456] NVRM: Xid", None),
    ("step 12", None),
    ("2024-13-45T99:00:00Z bad", None),
])
def test_line_timestamp(line: str, expected: float | None) -> None:
    assert line_timestamp(line) == expected


def test_times_read_from_lines_order_the_cascade() -> None:
    classifier = FailureClassifier(LIBRARY, line_time=line_timestamp)
    classifier.feed_line("b", "[2024-05-01 12:10:00,000] " + WATCHDOG.format(r=3))
    classifier.feed_line("a", "2024-05-01T12:00:00Z RuntimeError: CUDA error: unspecified launch failure")
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["cuda-launch-failure"] and verdict.blamed_nodes == ("a",)


# ------------------------------------------------------------------------------------------------ commands

def test_bench_log_is_deterministic_and_exact() -> None:
    lines, nodes, expected = classify_bench_log(5000, seed=7)
    again = classify_bench_log(5000, seed=7)
    assert (lines, nodes, expected) == again and len(lines) == len(nodes) == 5000
    classifier = FailureClassifier(LIBRARY)
    matched = sum(classifier.feed_line(n, line) is not None for n, line in zip(nodes, lines, strict=True))
    assert matched == expected > 0


def test_bench_classify_json() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuplane.cli.main", "bench", "classify", "--lines", "20000",
                             "--json"], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(result.stdout)
    assert figures["lines"] == 20000 and figures["lines_per_s"] > 0 and figures["repeats"] == 3
    assert figures["matched_lines"] == figures["matching_lines"] > 100
    assert figures["signatures"] == len(LIBRARY)


def test_classify_command(tmp_path: Path) -> None:
    culprit = tmp_path / "gpu-node-001.log"
    culprit.write_text("[2024-05-01 12:00:00,000] [INFO] step 10 loss 2.5\n"
                       f"2024-05-01T12:00:01Z {XID_79}\n", encoding="utf-8")
    peer = tmp_path / "gpu-node-002.log.gz"
    with gzip.open(peer, "wt", encoding="utf-8") as handle:
        handle.write(f"[2024-05-01 12:10:01,000] {WATCHDOG.format(r=9)}\n  exitcode  : -6 (pid: 4242)\n")
        handle.write("[2024-05-01 12:00:00,000] [INFO] step 11 loss 2.4\n")
    result = runner.invoke(app, ["classify", str(culprit), str(peer), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verdict"]["signature"] == "xid-79" and data["verdict"]["action"] == "isolate-node"
    assert data["verdict"]["blamed_nodes"] == ["gpu-node-001"] and data["verdict"]["critical"]
    assert data["matches_by_signature"] == {"xid-79": 1, "nccl-watchdog-timeout": 1, "torchrun-sigabrt": 1}
    assert data["unmatched"] == [{"template": "[N-N-N N:N:N,N] [INFO] step N loss N", "count": 2}]
    assert data["stats"]["lines"] == 5
    table = runner.invoke(app, ["classify", str(culprit), "--node", "n7"])
    assert table.exit_code == 0 and "xid-79" in table.stdout and "n7" in table.stdout
    assert "[INFO] step N" in table.stdout  # templates are printed as text, not rich markup


def test_classify_command_with_operator_signatures(tmp_path: Path) -> None:
    log = tmp_path / "n1.log"
    log.write_text("widget exploded at step 12\n", encoding="utf-8")
    ours = tmp_path / "ours.yaml"
    ours.write_text(
        "signatures:\n"
        "  - id: widget\n"
        "    description: the widget exploded\n"
        "    pattern: 'widget exploded at step \\d+'\n"
        "    failure_class: software\n"
        "    blame_node: false\n"
        "    action: do-not-retry\n"
        "    examples: ['widget exploded at step 3']\n"
        "    near_misses: ['widget fine at step 3']\n", encoding="utf-8")
    result = runner.invoke(app, ["classify", str(log), "--signatures", str(ours), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verdict"]["signature"] == "widget"
    unknown = runner.invoke(app, ["classify", str(log), "--json"])
    assert json.loads(unknown.stdout)["verdict"]["unknown"] is True
    ours.write_text("signatures:\n  - id: widget\n    pattern: '('\n", encoding="utf-8")
    bad = runner.invoke(app, ["classify", str(log), "--signatures", str(ours)])
    assert bad.exit_code == 2 and "ours.yaml" in bad.output and "signatures.0 (id widget)" in bad.output
    missing = runner.invoke(app, ["classify", str(tmp_path / "nope.log")])
    assert missing.exit_code == 2 and "nope.log" in missing.output


# ------------------------------------------------------------------------------------- echoes and fallbacks

XID_13 = ("NVRM: Xid (PCI:0000:cb:00): 13, pid=4242, name=python, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): "
          "Illegal Instruction Parameter")
XID_109 = "NVRM: Xid (PCI:0000:cb:00): 109, pid=4242, name=python, Ch 00000008, errorString CTX SWITCH TIMEOUT"


def test_a_context_switch_timeout_after_the_applications_xid_13_is_its_echo(classifier: FailureClassifier) -> None:
    classifier.feed_line("a", XID_13, t=10.0)
    echo = classifier.feed_line("a", XID_109, t=15.0)
    assert echo is not None and echo.echo and not echo.blames_node
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["xid-13"] and verdict.blamed_nodes == ()
    # on another node, or alone, the Xid 109 is the node's fault
    classifier.reset(forget_history=True)
    classifier.feed_line("a", XID_13, t=10.0)
    alone = classifier.feed_line("b", XID_109, t=15.0)
    assert alone is not None and not alone.echo
    assert classifier.verdict().signature is LIBRARY["xid-109"] and classifier.verdict().blamed_nodes == ("b",)


def test_a_bare_traceback_decides_only_when_nothing_else_matched(classifier: FailureClassifier) -> None:
    frame = '  File "/opt/conda/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 1103, in _configure'
    classifier.feed_line("a", "Traceback (most recent call last):", t=10.0)
    classifier.feed_line("a", frame, t=10.0)
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["py-traceback"] and verdict.failure_class is FailureClass.SOFTWARE
    assert verdict.blamed_nodes == ()
    classifier.feed_line("b", WATCHDOG.format(r=1), t=30.0)  # an echo outranks the fallback
    assert classifier.verdict().signature is LIBRARY["nccl-watchdog-timeout"]
    classifier.feed_line("a", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", t=40.0)
    assert classifier.verdict().signature is LIBRARY["cuda-oom"]


def test_a_store_on_loopback_restarts_and_a_remote_one_stops_on_a_repeat(classifier: FailureClassifier) -> None:
    remote = "[c10d] The client socket has timed out after 900s while trying to connect to (10.1.2.3, 29500)."
    loopback = "[c10d] The client socket has timed out after 1800s while trying to connect to (127.0.0.1, 48391)."
    classifier.feed_line("a", loopback, t=1.0)
    assert classifier.verdict().signature is LIBRARY["c10d-store-loopback"]
    for attempt in range(2):
        classifier.reset(scope="job")
        classifier.feed_line("a", remote, t=100.0 + attempt)
        verdict = classifier.verdict()
        assert verdict.signature is LIBRARY["c10d-store"]
        assert verdict.action is (FailureAction.RESTART_JOB if attempt == 0 else FailureAction.DO_NOT_RETRY)


def test_a_virtual_bootstrap_interface_turns_a_socket_failure_into_a_configuration_fault(
        classifier: FailureClassifier) -> None:
    bootstrap = "h1:10:10 [0] NCCL INFO Bootstrap : Using docker0:172.17.0.1<0>"
    connect = ("h1:10:20 [0] misc/socket.cc:483 NCCL WARN socketStartConnect: Connect to 10.0.0.2<41000> failed : "
               "Software caused connection abort")
    assert classifier.feed_line("a", bootstrap) is not None
    assert classifier.verdict().unknown  # alone it is tolerated: one host runs fine on a bridge
    classifier.feed_line("b", connect)  # a peer's connect to the node on the bridge fails too
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["nccl-socket"] and verdict.action is FailureAction.DO_NOT_RETRY
    classifier.reset(forget_history=True)
    classifier.feed_line("a", connect)
    assert classifier.verdict().action is FailureAction.RESTART_JOB


def test_xid_31_from_three_processes_on_one_gpu_is_the_gpu(classifier: FailureClassifier) -> None:
    line = ("NVRM: Xid (PCI:0000:{gpu}:00): 31, pid={pid}, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS "
            "GPCCLIENT_T1_10 faulted @ 0x7fd7_90743000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ")
    for pid in (100, 200):  # two processes: still the application's
        classifier.feed_line("a", line.format(gpu="db", pid=pid), t=float(pid))
    classifier.feed_line("a", line.format(gpu="1a", pid=300), t=300.0)  # another GPU does not count
    assert classifier.verdict().failure_class is FailureClass.SOFTWARE
    third = classifier.feed_line("a", line.format(gpu="db", pid=400), t=3000.0)
    assert third is not None and third.escalated and third.failure_class is FailureClass.GPU_HARDWARE
    verdict = classifier.verdict()  # the repeat, long after the first fault, speaks for it
    assert verdict.cause is third and verdict.action is FailureAction.ISOLATE_NODE
    assert verdict.failure_class is FailureClass.GPU_HARDWARE and verdict.blamed_nodes == ("a",)
    classifier.reset(scope="other-job")  # counted across jobs: the device is what repeats
    classifier.feed_line("a", line.format(gpu="db", pid=500), t=4000.0)
    assert classifier.verdict().action is FailureAction.ISOLATE_NODE
    classifier.reset(forget_history=True)
    classifier.feed_line("a", line.format(gpu="db", pid=600), t=5000.0)
    assert classifier.verdict().failure_class is FailureClass.SOFTWARE


def test_the_message_that_says_why_explains_the_generic_admission_error(classifier: FailureClassifier) -> None:
    classifier.feed_line("a", "Reason:         UnexpectedAdmissionError")
    assert classifier.verdict().action is FailureAction.ISOLATE_NODE
    classifier.feed_line("a", "Message:  Pod Allocate failed due to rpc error: code = Unknown desc = candidate pod not "
                              "found for request &AllocateRequest{ContainerRequests:[&ContainerAllocateRequest{")
    verdict = classifier.verdict()
    assert verdict.signature is LIBRARY["kubelet-admission-request"] and verdict.blamed_nodes == ()
    assert verdict.failure_class is FailureClass.SOFTWARE and verdict.action is FailureAction.RESTART_JOB
