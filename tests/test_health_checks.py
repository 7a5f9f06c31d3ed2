"""The node agent's health checks: each with its fake, NVML against a monkeypatched pynvml, and real child
processes standing in for dcgmi and nccl-tests (timeouts, non-zero exits, garbage output)."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpuplane.controllers.health import HealthEvent, NodeHealth, NodeHealthBook
from gpuplane.node.gpu import GpuBackendError
from gpuplane.node.health_checks import (
    ALL_REDUCE_COMMAND,
    AllReduceProbe,
    CardHealth,
    CheckResult,
    DcgmDiagCheck,
    FakeHealthReader,
    HealthCheck,
    NvmlHealthReader,
    NvmlSanityCheck,
    NvmlUnavailable,
    RunOutcome,
    StepTimeStragglerCheck,
    parse_dcgm_diag,
    parse_nccl_tests,
    run_checks,
    run_command,
    tier,
)

# -- NVML sanity with the fake reader ------------------------------------------------------------------------


def test_clean_cards_pass() -> None:
    result = NvmlSanityCheck(FakeHealthReader(8), expected_count=8).run()
    assert (result.passed, result.details, result.critical) == (True, "8 cards clean", False)
    assert result.data["cards"] == 8 and result.data["findings"] == []


@pytest.mark.parametrize(("counters", "detail", "critical"), [
    ({"ecc_uncorrected_volatile": 2}, "card 3: 2 uncorrectable ECC errors since boot", True),
    ({"ecc_uncorrected_aggregate": 1}, "card 3: 1 uncorrectable ECC errors over its life", False),
    ({"retired_pages": 3}, "card 3: 3 retired pages", False),
    ({"retired_pages_pending": True}, "card 3: page retirement pending", False),
    ({"remap_pending": True}, "card 3: row remap pending (reset the GPU)", False),
    ({"remap_failure": True}, "card 3: row remapping failed", True),  # Xid 64
])
def test_each_finding_fails(counters: dict[str, Any], detail: str, critical: bool) -> None:
    reader = FakeHealthReader(8)
    reader.set(3, **counters)
    result = NvmlSanityCheck(reader, 8).run()
    assert (result.passed, result.details, result.critical) == (False, detail, critical)


def test_retired_pages_within_the_allowance_pass() -> None:
    reader = FakeHealthReader(2)
    reader.set(0, retired_pages=10)
    assert NvmlSanityCheck(reader, max_retired_pages=10).run().passed is True
    assert NvmlSanityCheck(reader, max_retired_pages=9).run().passed is False


def test_a_missing_or_silent_card_is_critical() -> None:
    result = NvmlSanityCheck(FakeHealthReader(7), expected_count=8).run()
    assert (result.passed, result.details, result.critical) == (False, "7 cards, expected 8", True)
    reader = FakeHealthReader(8)
    reader.silence(5, "GPU is lost")
    result = NvmlSanityCheck(reader, 8).run()
    assert (result.passed, result.details, result.critical) == (False, "card 5 does not answer: GPU is lost", True)


def test_unsupported_counters_are_unknown_not_failures() -> None:
    reader = FakeHealthReader(2)
    reader.set(1, retired_pages=None, retired_pages_pending=None)  # Ampere+: page retirement not supported
    result = NvmlSanityCheck(reader, 2).run()
    assert result.passed is True
    assert result.details == "2 cards clean (unknown: card 1 retired_pages, card 1 retired_pages_pending)"


def test_nvml_unusable_fails_and_nvml_absent_is_skipped() -> None:
    reader = FakeHealthReader(8)
    reader.error = GpuBackendError("nvmlInit: Driver Not Loaded")
    assert NvmlSanityCheck(reader, 8).run() == CheckResult("nvml-sanity", False,
                                                           "NVML failed: nvmlInit: Driver Not Loaded")
    reader.error = NvmlUnavailable("nvmlInit: NVML Shared Library Not Found")
    assert NvmlSanityCheck(reader, 8).run().passed is None


# -- NVML reader against a monkeypatched pynvml -------------------------------------------------------------


@dataclass
class FakeNvml:
    """Two cards; `errors` maps (function name, handle or None) to the error it raises."""

    errors: dict[tuple[str, str | None], pynvml.NVMLError] = field(default_factory=dict)
    shutdowns: int = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def fn(name: str, result: Callable[..., Any]) -> None:
            def call(*args: Any) -> Any:
                for key in ((name, None), (name, args[0] if args else None)):
                    if key in self.errors:
                        raise self.errors[key]
                return result(*args)

            monkeypatch.setattr(pynvml, name, call)

        fn("nvmlInit", lambda: None)
        fn("nvmlShutdown", self._shutdown)
        fn("nvmlDeviceGetCount", lambda: 2)
        fn("nvmlDeviceGetHandleByIndex", lambda index: f"h{index}")
        fn("nvmlDeviceGetUUID", lambda h: f"GPU-{h}".encode())
        fn("nvmlDeviceGetTotalEccErrors", self._ecc)
        fn("nvmlDeviceGetRetiredPages", self._pages)
        fn("nvmlDeviceGetRetiredPagesPendingStatus", lambda h: 1 if h == "h1" else 0)
        # (corrected rows, uncorrected rows, pending, failure occurred)
        fn("nvmlDeviceGetRemappedRows", lambda h: (5, 2, 1, 0) if h == "h1" else (0, 0, 0, 0))

    def _shutdown(self) -> None:
        self.shutdowns += 1

    @staticmethod
    def _ecc(handle: str, error_type: int, counter: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return {("h0", pynvml.NVML_VOLATILE_ECC): 0, ("h0", pynvml.NVML_AGGREGATE_ECC): 0,
                ("h1", pynvml.NVML_VOLATILE_ECC): 0, ("h1", pynvml.NVML_AGGREGATE_ECC): 3}[(handle, counter)]

    @staticmethod
    def _pages(handle: str, cause: int) -> list[int]:
        if handle == "h1" and cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            return [0x1000, 0x2000]
        return []


def test_nvml_reader_maps_every_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    assert NvmlHealthReader().cards() == [
        CardHealth(0, "GPU-h0", 0, 0, 0, False, 0, False, False),
        # aggregate 3 uncorrectable, 2 double-bit retired pages, pending retirement, 2 rows remapped, 1 pending
        CardHealth(1, "GPU-h1", 0, 3, 2, True, 2, True, False),
    ]
    assert nvml.shutdowns == 1
    result = NvmlSanityCheck(NvmlHealthReader(), 2).run()
    assert result.passed is False and not result.critical
    assert result.details == ("card 1: 3 uncorrectable ECC errors over its life; card 1: 2 retired pages; "
                              "card 1: page retirement pending; card 1: row remap pending (reset the GPU)")


def test_nvml_not_supported_reads_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(errors={(name, None): pynvml.NVMLError_NotSupported() for name in (
        "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows")}).install(monkeypatch)
    card = NvmlHealthReader().cards()[0]
    assert card == CardHealth(0, "GPU-h0", None, None, None, None, None, None, None)
    result = NvmlSanityCheck(NvmlHealthReader(), 2).run()
    assert result.passed is True and "unknown: card 0 ecc_uncorrected_volatile" in result.details


def test_nvml_lost_card_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(errors={("nvmlDeviceGetTotalEccErrors", "h1"): pynvml.NVMLError_GpuIsLost()})
    nvml.install(monkeypatch)
    cards = NvmlHealthReader().cards()
    assert cards[1].error is not None and cards[1].error.startswith("nvmlDeviceGetTotalEccErrors: ")
    result = NvmlSanityCheck(NvmlHealthReader(), 2).run()
    assert result.passed is False and result.critical and result.details.startswith("card 1 does not answer")


def test_nvml_without_a_library_or_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(errors={("nvmlInit", None): pynvml.NVMLError_LibraryNotFound()})
    nvml.install(monkeypatch)
    with pytest.raises(NvmlUnavailable):
        NvmlHealthReader().cards()
    assert NvmlSanityCheck(NvmlHealthReader()).run().passed is None
    nvml.errors = {("nvmlInit", None): pynvml.NVMLError_DriverNotLoaded()}
    result = NvmlSanityCheck(NvmlHealthReader()).run()
    assert result.passed is False and result.details.startswith("NVML failed: nvmlInit: ")
    nvml.errors = {("nvmlDeviceGetCount", None): pynvml.NVMLError_Unknown()}
    assert NvmlSanityCheck(NvmlHealthReader()).run().passed is False
    assert nvml.shutdowns == 1  # NVML is shut down after a reading that got past nvmlInit


# -- DCGM diagnostics with a fake runner ---------------------------------------------------------------------


def dcgm4(statuses: Mapping[str, str], runtime_error: str | None = None) -> str:
    """A DCGM 4.x document: one result per GPU 0 and 1, the given status on GPU 1."""
    tests = []
    for name, status in statuses.items():
        results: list[dict[str, Any]] = [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": status},
        ]
        if status in ("Fail", "Warn"):
            results[1]["warnings"] = [{"warning": f"{name} finding on GPU 1", "error_id": 95, "error_category": 1}]
        tests.append({"name": name, "results": results, "test_summary": {"status": status}})
    root: dict[str, Any] = {"test_categories": [{"category": "Deployment", "tests": tests}]}
    if runtime_error is not None:
        root["runtime_error"] = runtime_error
    return json.dumps({"DCGM Diagnostic": root, "metadata": {"version": "4.2.3"}}, indent=2)


DCGM3_FAIL = json.dumps({"DCGM GPU Diagnostic": {"version": "3.1.7", "test_categories": [
    {"category": "Deployment", "tests": [
        {"name": "Denylist", "results": [{"status": "Pass"}]},
        {"name": "Page Retirement/Row Remap", "results": [
            {"gpu_ids": "0", "status": "Pass"},
            {"gpu_ids": "3", "status": "Fail",
             "warnings": ["GPU 3 had uncorrectable memory errors and row remapping failed."]},
        ]},
        {"name": "Graphics Processes", "results": [{"status": "Skip", "info": ["not run"]}]},
    ]}]}})


@dataclass
class CannedRunner:
    outcome: RunOutcome
    calls: list[tuple[list[str], float]] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], timeout_s: float) -> RunOutcome:
        self.calls.append((list(argv), timeout_s))
        return self.outcome


def found(name: str) -> str | None:
    return f"/usr/bin/{name}"


def dcgm(outcome: RunOutcome, **options: Any) -> tuple[CheckResult, CannedRunner]:
    runner = CannedRunner(outcome)
    return DcgmDiagCheck(runner, locate=found, **options).run(), runner


def test_dcgm_all_pass() -> None:
    result, runner = dcgm(RunOutcome(0, dcgm4({"software": "Pass", "Memory": "Pass"}), ""))
    assert (result.name, result.passed, result.details) == ("dcgm-diag-r1", True, "2 tests passed")
    assert runner.calls == [(["dcgmi", "diag", "-r", "1", "-j"], 120.0)]
    assert [t["status"] for t in result.data["tests"]] == ["pass", "pass"]


def test_dcgm_failure_names_the_test_and_the_gpu() -> None:
    # dcgmi exits non-zero when a test fails; the failing test is what the detail reports
    result, _ = dcgm(RunOutcome(226, DCGM3_FAIL, ""), level=2)
    assert result.passed is False and result.name == "dcgm-diag-r2"
    assert result.details == ("failed: Page Retirement/Row Remap (GPU 3: GPU 3 had uncorrectable memory errors and "
                              "row remapping failed.)")
    result, _ = dcgm(RunOutcome(226, dcgm4({"software": "Pass", "Memory": "Fail"}), ""))
    assert result.details == "failed: Memory (GPU 1: Memory finding on GPU 1)"


def test_dcgm_warnings_pass_with_a_note() -> None:
    result, _ = dcgm(RunOutcome(0, dcgm4({"software": "Warn", "Memory": "Pass"}), ""))
    assert (result.passed, result.details) == (True, "2 tests passed; warnings: software")


@pytest.mark.parametrize(("outcome", "detail"), [
    (RunOutcome(0, dcgm4({"software": "Pass"}, "Unable to connect to the host engine"), ""),
     "dcgmi runtime error: Unable to connect to the host engine"),
    (RunOutcome(0, "hello, not JSON", ""),
     "unreadable dcgmi output (Expecting value: line 1 column 1 (char 0)): 'hello, not JSON'"),
    (RunOutcome(0, '{"something": "else"}', ""),
     "unreadable dcgmi output (no 'DCGM Diagnostic' or 'DCGM GPU Diagnostic' object): '{\"something\": \"else\"}'"),
    (RunOutcome(0, "[1, 2]", ""), "unreadable dcgmi output (not a JSON object): '[1, 2]'"),
    (RunOutcome(1, "", "Error: unable to establish a connection to the host engine\n"),
     "dcgmi exited with status 1: Error: unable to establish a connection to the host engine; "
     "unreadable dcgmi output (Expecting value: line 1 column 1 (char 0)): ''"),
    (RunOutcome(3, dcgm4({"software": "Pass"}), "odd"), "dcgmi exited with status 3: odd"),
    (RunOutcome(0, json.dumps({"DCGM Diagnostic": {"test_categories": []}}), ""), "dcgmi reported no tests"),
    (RunOutcome(None, "", "", timed_out=True), "dcgmi timed out after 120 s"),
    (RunOutcome(None, "", "", error="cannot start dcgmi: [Errno 13] Permission denied"),
     "cannot start dcgmi: [Errno 13] Permission denied"),
], ids=["runtime-error", "garbage", "other-json", "json-list", "exit-1-no-output", "exit-3-passing", "no-tests",
        "timeout", "cannot-start"])
def test_dcgm_everything_else_fails_with_a_clear_detail(outcome: RunOutcome, detail: str) -> None:
    result, _ = dcgm(outcome)
    assert (result.passed, result.details) == (False, detail)


def test_dcgm_not_installed_is_skipped_and_levels_are_checked() -> None:
    runner = CannedRunner(RunOutcome(0, "", ""))
    result = DcgmDiagCheck(runner, locate=lambda name: None).run()
    assert (result.passed, result.details, runner.calls) == (None, "dcgmi not installed", [])
    with pytest.raises(ValueError, match="level"):
        DcgmDiagCheck(runner, level=5)
    assert DcgmDiagCheck(runner, level=3).timeout_s == 1800.0


def test_dcgm_parser_is_lenient() -> None:
    text = json.dumps({"DCGM Diagnostic": {"test_categories": [
        "junk", {"category": "x", "tests": ["junk", {"name": "a", "results": "junk"},
                                            {"name": "b", "results": [3, {"status": 4}, {"status": " FAIL ",
                                                                                         "errors": "boom"}]}]}]}})
    tests, runtime_error = parse_dcgm_diag(text)
    assert runtime_error is None
    assert tests == [{"category": "x", "name": "a", "status": "unknown", "findings": []},
                     {"category": "x", "name": "b", "status": "fail", "findings": ["boom"]}]


# -- real child processes standing in for dcgmi and all_reduce_perf ---------------------------------------


def stand_in(tmp_path: Path, body: str) -> tuple[str, str]:
    """A command (the interpreter, a script) running `body`; the script records its arguments in args.json."""
    script = tmp_path / "stand_in.py"
    script.write_text("import json, sys, time, subprocess\n"
                      f"json.dump(sys.argv[1:], open({str(tmp_path / 'args.json')!r}, 'w'))\n"
                      + textwrap.dedent(body))
    return sys.executable, str(script)


def test_run_command_captures_and_reports() -> None:
    outcome = run_command([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                                                 "sys.exit(4)"], 10.0)
    assert outcome == RunOutcome(4, "out\n", "err\n")
    missing = run_command(["/nonexistent/dcgmi"], 10.0)
    assert missing.returncode is None and missing.error is not None
    assert missing.error.startswith("cannot start /nonexistent/dcgmi: ")


def test_dcgm_real_child_passes(tmp_path: Path) -> None:
    command = stand_in(tmp_path, f"print({dcgm4({'software': 'Pass'})!r})\n")
    result = DcgmDiagCheck(command=command, level=1).run()
    assert (result.passed, result.details) == (True, "1 tests passed")
    assert json.loads((tmp_path / "args.json").read_text()) == ["diag", "-r", "1", "-j"]


def test_dcgm_real_child_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    # the stand-in starts a grandchild that holds the output pipe open, then hangs
    command = stand_in(tmp_path, """
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("partial", flush=True)
        time.sleep(60)
    """)
    start = time.monotonic()
    result = DcgmDiagCheck(command=command, timeout_s=1.0).run()
    assert time.monotonic() - start < 10
    assert (result.passed, result.details) == (False, "dcgmi timed out after 1 s")


def test_dcgm_real_child_non_zero_exit_and_garbage(tmp_path: Path) -> None:
    command = stand_in(tmp_path, """
        print("Error: unable to establish a connection to the host engine", file=sys.stderr)
        sys.exit(255)
    """)
    result = DcgmDiagCheck(command=command).run()
    assert result.passed is False and result.data["returncode"] == 255
    assert result.details.startswith("dcgmi exited with status 255: Error: unable to establish a connection")
    command = stand_in(tmp_path, "print('\\x00garbage {{{')\n")
    result = DcgmDiagCheck(command=command).run()
    assert result.passed is False and result.details.startswith("unreadable dcgmi output (")


NCCL_OUTPUT = """\
# nThread 1 nGpus 8 minBytes 1073741824 maxBytes 1073741824 step: 1048576(bytes) warmup iters: 5 iters: 20 \
agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  41234 on    node-07 device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  41234 on    node-07 device  1 [0x2a] NVIDIA H100 80GB HBM3
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
  1073741824     268435456     float     sum      -1   4512.3  237.96  416.43      0   4498.1  238.71  417.75      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 417.088
#
"""


def nccl_stand_in(tmp_path: Path, text: str, code: int = 0) -> tuple[str, ...]:
    return stand_in(tmp_path, f"sys.stdout.write({text!r})\nsys.exit({code})\n")


def test_nccl_parser_reads_the_average_or_the_table() -> None:
    report = parse_nccl_tests(NCCL_OUTPUT)
    assert (report.avg_busbw_gbps, report.rows, report.wrong) == (417.088, 1, 0)
    # no summary line: the mean of the busbw columns, (416.43 + 417.75) / 2 = 417.09
    table_only = "\n".join(line for line in NCCL_OUTPUT.splitlines() if "Avg bus" not in line)
    assert parse_nccl_tests(table_only).avg_busbw_gbps == pytest.approx(417.09)
    assert parse_nccl_tests("garbage\n1 2 3\n").avg_busbw_gbps is None


def test_all_reduce_real_child_passes_and_fails_below_the_threshold(tmp_path: Path) -> None:
    command = (*nccl_stand_in(tmp_path, NCCL_OUTPUT), "-b", "1G", "-e", "1G", "-g", "8")
    result = AllReduceProbe(command, 300.0).run()
    assert (result.passed, result.details) == (True, "bus bandwidth 417.1 GB/s >= 300 GB/s")
    assert json.loads((tmp_path / "args.json").read_text()) == ["-b", "1G", "-e", "1G", "-g", "8"]
    result = AllReduceProbe(command, 450.0).run()
    assert (result.passed, result.details) == (False, "bus bandwidth 417.1 GB/s < 450 GB/s")
    assert result.data["busbw_gbps"] == 417.088


@pytest.mark.parametrize(("text", "code", "detail"), [
    (NCCL_OUTPUT.replace("417.75      0", "417.75      3"), 0, "1 wrong results (data corruption)"),
    (NCCL_OUTPUT.replace("values : 0 OK", "values : 2 FAILED"), 0, "2 wrong results (data corruption)"),
    ("node-07: Test NCCL failure common.cu:1005 'unhandled system error'\n", 3,
     "exited with status 3: node-07: Test NCCL failure common.cu:1005 'unhandled system error'"),
    ("garbage\n", 0, "no bus bandwidth in the output: 'garbage'"),
], ids=["wrong-in-table", "out-of-bounds", "nccl-failure", "garbage"])
def test_all_reduce_real_child_failures(tmp_path: Path, text: str, code: int, detail: str) -> None:
    result = AllReduceProbe(nccl_stand_in(tmp_path, text, code), 300.0).run()
    assert result.passed is False and result.details.endswith(detail)


def test_all_reduce_real_child_timeout_and_not_installed(tmp_path: Path) -> None:
    command = stand_in(tmp_path, "time.sleep(60)\n")
    result = AllReduceProbe(command, 300.0, timeout_s=0.5).run()
    assert result.passed is False and result.details.endswith("timed out after 0.5 s")
    result = AllReduceProbe(ALL_REDUCE_COMMAND, locate=lambda name: None).run()
    assert (result.passed, result.details) == (None, "all_reduce_perf not installed")
    with pytest.raises(ValueError, match="min_busbw_gbps"):
        AllReduceProbe(min_busbw_gbps=float("nan"))


# -- stragglers, running and grading ------------------------------------------------------------------------

STEPS = {"n1": [1.0] * 10, "n2": [1.0] * 10, "n3": [1.02] * 10, "n4": [1.15] * 10}


@pytest.mark.parametrize(("node", "passed", "detail"), [
    ("n4", False, "n4: 1.14× the fleet median step time"),  # medians 1.0, 1.0, 1.02, 1.15 -> fleet 1.01
    ("n3", True, "n3: within 1.1× the fleet median"),
    ("n9", None, "n9: no step times"),
    (None, False, "stragglers: n4 1.14×"),  # 1.15 / 1.01 = 1.139
])
def test_step_time_check(node: str | None, passed: bool | None, detail: str) -> None:
    result = StepTimeStragglerCheck(lambda: STEPS, node).run()
    assert (result.passed, result.details) == (passed, detail)


def test_step_time_check_needs_a_fleet() -> None:
    result = StepTimeStragglerCheck(lambda: {"n1": [1.0], "n2": []}).run()
    assert (result.passed, result.details) == (None, "1 node(s) reporting step times: nothing to compare")
    assert StepTimeStragglerCheck(lambda: {"n1": [1.0], "n2": [1.05]}).run().passed is True


@dataclass
class Fixed:
    name: str
    result: CheckResult | None = None

    def run(self) -> CheckResult:
        if self.result is None:
            raise RuntimeError("bug")
        return self.result


def ok(name: str) -> CheckResult:
    return CheckResult(name, True, "fine")


def test_run_checks_keeps_order_and_survives_a_broken_check() -> None:
    checks: list[HealthCheck] = [Fixed("a", ok("a")), Fixed("broken"), Fixed("c", ok("c"))]
    assert run_checks(checks) == [ok("a"), CheckResult("broken", None, "check raised RuntimeError: bug"), ok("c")]


@pytest.mark.parametrize(("results", "event", "failed"), [
    ([], None, ()),
    ([CheckResult("a", None, "not installed")], None, ()),
    ([ok("a"), CheckResult("b", None, "skipped")], HealthEvent.CHECK_PASSED, ()),
    ([ok("a"), CheckResult("b", False, "bad")], HealthEvent.CHECK_FAILED, ("b",)),
    ([CheckResult("a", False, "ecc", critical=True), CheckResult("b", False, "bad")], HealthEvent.CRITICAL_FAILURE,
     ("a", "b")),
])
def test_tier_grades_results(results: list[CheckResult], event: HealthEvent | None, failed: tuple[str, ...]) -> None:
    verdict = tier("node-07", results)
    assert (verdict.node, verdict.event, verdict.failed) == ("node-07", event, failed)


def test_a_prolog_tier_feeds_the_health_book() -> None:
    reader = FakeHealthReader(8)
    reader.set(2, remap_pending=True)
    checks: list[HealthCheck] = [
        NvmlSanityCheck(reader, 8),
        DcgmDiagCheck(locate=lambda name: None),
        StepTimeStragglerCheck(lambda: STEPS, "n1"),
    ]
    verdict = tier("n1", run_checks(checks))
    assert verdict.event is HealthEvent.CHECK_FAILED
    assert verdict.reason == "nvml-sanity: card 2: row remap pending (reset the GPU)"
    book = NodeHealthBook(nodes=["n1"])
    assert verdict.event is not None
    assert book.apply(verdict.node, verdict.event, 0.0, verdict.reason).state is NodeHealth.SUSPECT
    reader.set(2, remap_pending=False)
    verdict = tier("n1", run_checks(checks))
    assert (verdict.event, verdict.reason) == (HealthEvent.CHECK_PASSED, "passed: nvml-sanity, step-time-stragglers")
