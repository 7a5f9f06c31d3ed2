"""The node agent's health checks: NVML sanity, DCGM diagnostics, an all-reduce probe, step-time stragglers.

Each check is an object with a `name` and a `run()` that returns a `CheckResult`: passed True, False, or
None when the check could not say (the tool is not installed, the card does not support the query). A
check never raises for an expected outcome: a missing tool, a timeout, a non-zero exit or output it cannot
parse is a result with a detail that says so. `run_checks` runs a list of them and `tier` turns the results
into the health event for the node (`gpuplane.controllers.health`).

External tools run as real child processes through a `Runner` (`run_command`: its own session, killed
with its whole process group on timeout); tests substitute a runner returning canned output, or point the
command at a stand-in script.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol, TypeVar

import pynvml

from gpuplane.controllers.health import HealthEvent, stragglers
from gpuplane.node.gpu import GpuBackendError

__all__ = [
    "ALL_REDUCE_COMMAND", "DCGM_TIMEOUT_S", "AllReduceProbe", "CardHealth", "CheckResult", "DcgmDiagCheck",
    "FakeHealthReader", "HealthCheck", "HealthReader", "NcclReport", "NodeVerdict", "NvmlHealthReader",
    "NvmlSanityCheck", "NvmlUnavailable", "RunOutcome", "Runner", "StepTimeStragglerCheck", "parse_dcgm_diag",
    "parse_nccl_tests", "run_checks", "run_command", "tier",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    passed: bool | None
    """True: healthy; False: a finding; None: skipped or not available (says nothing about the node)."""
    details: str
    data: dict[str, Any] = field(default_factory=dict)
    """What the check measured, JSON-friendly."""
    critical: bool = False
    """A failure that quarantines at once (§8.4): a missing or silent card, an uncorrectable ECC error since
    boot, a row-remapping failure. Only meaningful when passed is False."""


class HealthCheck(Protocol):
    name: str

    def run(self) -> CheckResult:
        """Run the check; never raises for an expected outcome."""
        ...


# -- running tools ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a child process ended. `returncode` is None when it did not end by itself (timed out) or never
    started (`error` says why)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    error: str | None = None


Runner = Callable[[Sequence[str], float], RunOutcome]
"""(argv, timeout in seconds) -> how it ended."""


def run_command(argv: Sequence[str], timeout_s: float) -> RunOutcome:
    """Run `argv` as a child process in its own session, capturing its output as text; on timeout the whole
    process group is killed (a tool's own children included) and what it printed so far is kept."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        return RunOutcome(None, "", "", error=f"cannot start {argv[0]}: {exc}")
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return RunOutcome(None, out, err, timed_out=True)
    return RunOutcome(proc.returncode, out, err)


def _tail(text: str, limit: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= limit else "…" + text[-limit:]


def _ended_badly(tool: str, outcome: RunOutcome, timeout_s: float) -> str | None:
    """Why the run gave nothing usable (did not start, timed out), or None."""
    if outcome.error is not None:
        return outcome.error
    if outcome.timed_out:
        return f"{tool} timed out after {timeout_s:g} s" + (f": {_tail(outcome.stderr)}" if outcome.stderr.strip()
                                                             else "")
    return None


def _exit_detail(tool: str, outcome: RunOutcome) -> str:
    detail = _tail(outcome.stderr) or _tail(outcome.stdout)
    return f"{tool} exited with status {outcome.returncode}" + (f": {detail}" if detail else "")


# -- NVML sanity --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CardHealth:
    """One card's health counters; None where the card does not support the query (unknown, not a failure).
    `error` is set when the card did not answer at all (its counters are then None)."""

    index: int
    uuid: str | None = None
    ecc_uncorrected_volatile: int | None = 0
    """Uncorrectable ECC errors since the last driver load."""
    ecc_uncorrected_aggregate: int | None = 0
    """Uncorrectable ECC errors over the card's life."""
    retired_pages: int | None = 0
    """Pages retired for single-bit (multiple) and double-bit ECC errors (pre-Ampere page retirement)."""
    retired_pages_pending: bool | None = False
    remapped_rows_uncorrectable: int | None = 0
    """Rows remapped after an uncorrectable error (Ampere and later); informative, remapping worked."""
    remap_pending: bool | None = False
    """A remap waits for a GPU reset."""
    remap_failure: bool | None = False
    """A row could not be remapped (Xid 64)."""
    error: str | None = None


class HealthReader(Protocol):
    def cards(self) -> list[CardHealth]:
        """Every card's counters, in index order; raises `GpuBackendError` when NVML cannot be used at all
        (`NvmlUnavailable` when there is no NVML library on the machine)."""
        ...


class NvmlUnavailable(GpuBackendError):
    """No NVML library on this machine: not a GPU node, or no driver installed."""


def _optional(fn: Callable[..., T], *args: Any) -> T | None:
    """None where the card cannot tell: the query is not supported, not permitted, or unknown to the driver."""
    try:
        return fn(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_NoPermission, pynvml.NVMLError_FunctionNotFound):
        return None


class NvmlHealthReader:
    """Health counters read through NVML (pynvml's functions are looked up at each call, so tests can
    replace them). Initialises and shuts NVML down around each reading."""

    def cards(self) -> list[CardHealth]:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise NvmlUnavailable(f"nvmlInit: {exc}") from exc
        except pynvml.NVMLError as exc:
            raise GpuBackendError(f"nvmlInit: {exc}") from exc
        try:
            try:
                count = int(pynvml.nvmlDeviceGetCount())
            except pynvml.NVMLError as exc:
                raise GpuBackendError(f"nvmlDeviceGetCount: {exc}") from exc
            return [self._card(index) for index in range(count)]
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def _card(self, index: int) -> CardHealth:
        call = "nvmlDeviceGetHandleByIndex"
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            call = "nvmlDeviceGetUUID"
            uuid = _optional(pynvml.nvmlDeviceGetUUID, handle)
            call = "nvmlDeviceGetTotalEccErrors"
            volatile = _optional(pynvml.nvmlDeviceGetTotalEccErrors, handle,
                                 pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            aggregate = _optional(pynvml.nvmlDeviceGetTotalEccErrors, handle,
                                  pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC)
            call = "nvmlDeviceGetRetiredPages"
            single = _optional(pynvml.nvmlDeviceGetRetiredPages, handle,
                               pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
            double = _optional(pynvml.nvmlDeviceGetRetiredPages, handle,
                               pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            call = "nvmlDeviceGetRetiredPagesPendingStatus"
            pages_pending = _optional(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            call = "nvmlDeviceGetRemappedRows"
            remapped = _optional(pynvml.nvmlDeviceGetRemappedRows, handle)
        except pynvml.NVMLError as exc:
            return CardHealth(index, None, None, None, None, None, None, None, None, error=f"{call}: {exc}")
        retired = None if single is None or double is None else len(single) + len(double)
        return CardHealth(
            index=index,
            uuid=None if uuid is None else _text(uuid),
            ecc_uncorrected_volatile=None if volatile is None else int(volatile),
            ecc_uncorrected_aggregate=None if aggregate is None else int(aggregate),
            retired_pages=retired,
            retired_pages_pending=None if pages_pending is None else bool(int(pages_pending)),
            # (corrected rows, uncorrected rows, remap pending, remap failure occurred)
            remapped_rows_uncorrectable=None if remapped is None else int(remapped[1]),
            remap_pending=None if remapped is None else bool(int(remapped[2])),
            remap_failure=None if remapped is None else bool(int(remapped[3])),
        )


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


class FakeHealthReader:
    """Cards whose counters a test sets: all clean to begin with."""

    def __init__(self, cards: int = 8) -> None:
        self.readings = [CardHealth(i, f"GPU-fake-{i}") for i in range(cards)]
        self.error: GpuBackendError | None = None
        """Raised by `cards()` when set."""

    def set(self, index: int, **counters: Any) -> None:
        """Replace some of a card's counters, e.g. `set(3, ecc_uncorrected_volatile=2)`."""
        self.readings[index] = replace(self.readings[index], **counters)

    def silence(self, index: int, error: str = "GPU is lost") -> None:
        """Make a card stop answering."""
        self.readings[index] = CardHealth(index, None, None, None, None, None, None, None, None, error=error)

    def cards(self) -> list[CardHealth]:
        if self.error is not None:
            raise self.error
        return list(self.readings)


class NvmlSanityCheck:
    """The prolog's card sanity (reference §5.3): the expected number of cards, every card answering, no
    uncorrectable ECC errors (volatile or aggregate), at most `max_retired_pages` retired pages and none
    pending, no row remap pending or failed. A counter the card does not support is listed as unknown."""

    name = "nvml-sanity"

    def __init__(self, reader: HealthReader, expected_count: int | None = None, *, max_retired_pages: int = 0) -> None:
        self.reader = reader
        self.expected_count = expected_count
        self.max_retired_pages = max_retired_pages

    def run(self) -> CheckResult:
        try:
            cards = self.reader.cards()
        except NvmlUnavailable as exc:
            return CheckResult(self.name, None, f"NVML not available: {exc}")
        except GpuBackendError as exc:
            return CheckResult(self.name, False, f"NVML failed: {exc}")
        findings: list[str] = []
        critical: list[str] = []
        unknown: list[str] = []
        if self.expected_count is not None and len(cards) != self.expected_count:
            critical.append(f"{len(cards)} cards, expected {self.expected_count}")
        per_card: dict[str, dict[str, Any]] = {}
        for card in cards:
            per_card[str(card.index)] = {f.name: getattr(card, f.name) for f in fields(card) if f.name != "index"}
            if card.error is not None:
                critical.append(f"card {card.index} does not answer: {card.error}")
                continue
            self._inspect(card, findings, critical, unknown)
        data = {"cards": len(cards), "expected": self.expected_count, "per_card": per_card,
                "findings": critical + findings, "unknown": unknown}
        if critical or findings:
            return CheckResult(self.name, False, "; ".join(critical + findings), data, critical=bool(critical))
        detail = f"{len(cards)} cards clean" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        return CheckResult(self.name, True, detail, data)

    def _inspect(self, card: CardHealth, findings: list[str], critical: list[str], unknown: list[str]) -> None:
        i = card.index

        def count(field_name: str, value: int | None, limit: int, what: str, into: list[str]) -> None:
            if value is None:
                unknown.append(f"card {i} {field_name}")
            elif value > limit:
                into.append(f"card {i}: {value} {what}")

        def flag(field_name: str, value: bool | None, what: str, into: list[str]) -> None:
            if value is None:
                unknown.append(f"card {i} {field_name}")
            elif value:
                into.append(f"card {i}: {what}")

        count("ecc_uncorrected_volatile", card.ecc_uncorrected_volatile, 0,
              "uncorrectable ECC errors since boot", critical)
        count("ecc_uncorrected_aggregate", card.ecc_uncorrected_aggregate, 0,
              "uncorrectable ECC errors over its life", findings)
        count("retired_pages", card.retired_pages, self.max_retired_pages, "retired pages", findings)
        flag("retired_pages_pending", card.retired_pages_pending, "page retirement pending", findings)
        flag("remap_pending", card.remap_pending, "row remap pending (reset the GPU)", findings)
        flag("remap_failure", card.remap_failure, "row remapping failed", critical)


# -- DCGM diagnostics ---------------------------------------------------------------------------------------

DCGM_TIMEOUT_S: dict[int, float] = {1: 120.0, 2: 600.0, 3: 1800.0, 4: 7200.0}
"""Default timeout per `dcgmi diag -r` level: quick (seconds), medium (~2 min), long (~15 min), xlong (> 1 h)."""

_DCGM_ROOTS = ("DCGM Diagnostic", "DCGM GPU Diagnostic")
_DCGM_FAIL = "fail"
_DCGM_WARN = "warn"


def _dcgm_messages(result: Mapping[str, Any]) -> list[str]:
    """The warning/error texts of one result entry, in any of the shapes DCGM versions use."""
    texts: list[str] = []
    for key in ("warnings", "errors", "warning", "error"):
        items = result.get(key)
        for item in items if isinstance(items, list) else [items]:
            if isinstance(item, str) and item.strip():
                texts.append(item.strip())
            elif isinstance(item, Mapping):
                text = item.get("warning") or item.get("error") or item.get("message")
                if isinstance(text, str) and text.strip():
                    texts.append(text.strip())
    return texts


def _dcgm_entity(result: Mapping[str, Any]) -> str:
    for key in ("entity_id", "gpu_ids", "gpu_id"):
        if key in result:
            return f"GPU {result[key]}"
    return ""


def parse_dcgm_diag(text: str) -> tuple[list[dict[str, Any]], str | None]:
    """The tests of a `dcgmi diag -j` document as [{category, name, status, findings}], and a runtime error.

    Fields relied on (DCGM 3.x keys its document "DCGM GPU Diagnostic", 4.x "DCGM Diagnostic"):
    `<root>.test_categories[].category`, `.tests[].name`, `.tests[].results[].status` ("Pass", "Fail",
    "Warn", "Skip", ...; case ignored), `.tests[].test_summary.status` when present (4.x), the result's
    `warnings`/`errors` (strings or objects with a `warning`/`error`/`message` text) and its GPU
    (`entity_id` in 4.x, `gpu_ids` in 3.x), and `<root>.runtime_error`. Anything else is ignored. Raises
    ValueError when the text is not such a document."""
    doc = json.loads(text)
    if not isinstance(doc, Mapping):
        raise ValueError("not a JSON object")
    root = next((doc[key] for key in _DCGM_ROOTS if isinstance(doc.get(key), Mapping)), None)
    if root is None:
        raise ValueError(f"no {' or '.join(repr(k) for k in _DCGM_ROOTS)} object")
    runtime_error = root.get("runtime_error")
    categories = root.get("test_categories")
    if not isinstance(categories, list):
        categories = []
    tests: list[dict[str, Any]] = []
    for category in categories:
        if not isinstance(category, Mapping):
            continue
        for test in category.get("tests") or []:
            if not isinstance(test, Mapping):
                continue
            statuses: list[str] = []
            findings: list[str] = []
            summary = test.get("test_summary")
            if isinstance(summary, Mapping) and isinstance(summary.get("status"), str):
                statuses.append(summary["status"].strip().lower())
            results = test.get("results")
            for result in results if isinstance(results, list) else []:
                if not isinstance(result, Mapping):
                    continue
                status = result.get("status")
                status = status.strip().lower() if isinstance(status, str) else ""
                statuses.append(status)
                if status in (_DCGM_FAIL, _DCGM_WARN):
                    entity = _dcgm_entity(result)
                    findings += [f"{entity}: {m}" if entity else m for m in _dcgm_messages(result)]
            worst = (_DCGM_FAIL if _DCGM_FAIL in statuses else _DCGM_WARN if _DCGM_WARN in statuses
                     else "pass" if "pass" in statuses else statuses[0] if statuses else "unknown")
            tests.append({"category": str(category.get("category", "")), "name": str(test.get("name", "?")),
                          "status": worst, "findings": findings})
    return tests, runtime_error if isinstance(runtime_error, str) and runtime_error else None


class DcgmDiagCheck:
    """`dcgmi diag -r <level> -j` (reference §5.1; level 1 for the job prolog, 2 after a failure, 3/4 for
    admission and repair). Fails on any test with status Fail, on a runtime error, a timeout, output that is
    not a diagnostic document, or a non-zero exit; warnings are reported but pass. Skipped (None) when the
    command is not installed."""

    def __init__(self, runner: Runner = run_command, *, level: int = 1, command: Sequence[str] = ("dcgmi",),
                 timeout_s: float | None = None, locate: Callable[[str], str | None] = shutil.which) -> None:
        if level not in DCGM_TIMEOUT_S:
            raise ValueError(f"level: must be one of {sorted(DCGM_TIMEOUT_S)}, got {level!r}")
        self.name = f"dcgm-diag-r{level}"
        self.runner = runner
        self.level = level
        self.command = tuple(command)
        self.timeout_s = DCGM_TIMEOUT_S[level] if timeout_s is None else timeout_s
        self.locate = locate

    def argv(self) -> list[str]:
        return [*self.command, "diag", "-r", str(self.level), "-j"]

    def run(self) -> CheckResult:
        if not self.command or self.locate(self.command[0]) is None:
            return CheckResult(self.name, None, "dcgmi not installed")
        outcome = self.runner(self.argv(), self.timeout_s)
        data: dict[str, Any] = {"returncode": outcome.returncode, "level": self.level}
        bad = _ended_badly("dcgmi", outcome, self.timeout_s)
        if bad is not None:
            return CheckResult(self.name, False, bad, data)
        try:
            tests, runtime_error = parse_dcgm_diag(outcome.stdout)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            detail = f"unreadable dcgmi output ({exc}): {_tail(outcome.stdout, 200)!r}"
            if outcome.returncode != 0:
                detail = f"{_exit_detail('dcgmi', outcome)}; {detail}"
            return CheckResult(self.name, False, detail, data)
        data["tests"] = tests
        failed = [t for t in tests if t["status"] == _DCGM_FAIL]
        warned = [t for t in tests if t["status"] == _DCGM_WARN]
        if runtime_error is not None:
            return CheckResult(self.name, False, f"dcgmi runtime error: {runtime_error}", data)
        if failed:
            parts = [t["name"] + (f" ({'; '.join(t['findings'])})" if t["findings"] else "") for t in failed]
            return CheckResult(self.name, False, "failed: " + ", ".join(parts), data)
        if outcome.returncode != 0:
            return CheckResult(self.name, False, _exit_detail("dcgmi", outcome), data)
        if not tests:
            return CheckResult(self.name, False, "dcgmi reported no tests", data)
        detail = f"{len(tests)} tests passed"
        if warned:
            detail += "; warnings: " + ", ".join(t["name"] for t in warned)
        return CheckResult(self.name, True, detail, data)


# -- all-reduce probe ---------------------------------------------------------------------------------------

ALL_REDUCE_COMMAND: tuple[str, ...] = ("all_reduce_perf", "-b", "1G", "-e", "1G", "-g", "8")
"""nccl-tests' all-reduce over the node's 8 GPUs, one 1 GiB message."""

_AVG_BUSBW = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)", re.MULTILINE)
_OUT_OF_BOUNDS = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class NcclReport:
    avg_busbw_gbps: float | None
    """The "# Avg bus bandwidth" line, else the mean of the table's busbw columns; None when neither."""
    rows: int
    wrong: int
    """Sum of the table's #wrong columns and the "Out of bounds values" count: data corruption when > 0."""


def parse_nccl_tests(text: str) -> NcclReport:
    """Read nccl-tests output: the table (its header line, starting "#" and naming `busbw` and `#wrong`,
    gives the columns; rows are the lines that start with a number and have as many fields), the
    "# Out of bounds values : N" and "# Avg bus bandwidth : X" lines. Lines it does not know are ignored."""
    busbw_cols: list[int] = []
    wrong_cols: list[int] = []
    width = 0
    busbw: list[float] = []
    wrong = 0
    rows = 0
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            names = stripped.lstrip("#").split()
            if "busbw" in names and "size" in names:
                busbw_cols = [i for i, n in enumerate(names) if n == "busbw"]
                wrong_cols = [i for i, n in enumerate(names) if n == "#wrong"]
                width = len(names)
            continue
        fields = stripped.split()
        if not busbw_cols or len(fields) != width or not fields[0].isdigit():
            continue
        try:
            values = [float(fields[i]) for i in busbw_cols]
            wrongs = [float(fields[i]) for i in wrong_cols if fields[i].upper() != "N/A"]
        except ValueError:
            continue
        rows += 1
        busbw += values
        wrong += sum(1 for w in wrongs if w > 0)
    out_of_bounds = _OUT_OF_BOUNDS.search(text)
    if out_of_bounds is not None:
        wrong += int(out_of_bounds.group(1))
    avg: float | None = None
    match = _AVG_BUSBW.search(text)
    if match is not None:
        with contextlib.suppress(ValueError):
            avg = float(match.group(1))
    if avg is None and busbw:
        avg = sum(busbw) / len(busbw)
    if avg is not None and not math.isfinite(avg):
        avg = None
    return NcclReport(avg, rows, wrong)


class AllReduceProbe:
    """An nccl-tests all-reduce on the node (reference §5.2); fails below `min_busbw_gbps` bus bandwidth,
    on wrong results, a timeout, a non-zero exit or output without a bandwidth. Skipped (None) when the
    command is not installed.

    The default threshold, 300 GB/s, is ~80 % of 8×H100/H200 ring all-reduce (360–370 GB/s; ~475 GB/s with
    NVLS); set it per SKU, ideally at 80–85 % of the fleet median."""

    name = "all-reduce"

    def __init__(self, command: Sequence[str] = ALL_REDUCE_COMMAND, min_busbw_gbps: float = 300.0, *,
                 runner: Runner = run_command, timeout_s: float = 300.0,
                 locate: Callable[[str], str | None] = shutil.which) -> None:
        if not (math.isfinite(min_busbw_gbps) and min_busbw_gbps >= 0):
            raise ValueError(f"min_busbw_gbps: must be a finite number >= 0, got {min_busbw_gbps!r}")
        self.command = tuple(command)
        self.min_busbw_gbps = min_busbw_gbps
        self.runner = runner
        self.timeout_s = timeout_s
        self.locate = locate

    def run(self) -> CheckResult:
        tool = os.path.basename(self.command[0]) if self.command else "all_reduce_perf"
        if not self.command or self.locate(self.command[0]) is None:
            return CheckResult(self.name, None, f"{tool} not installed")
        outcome = self.runner(self.command, self.timeout_s)
        data: dict[str, Any] = {"returncode": outcome.returncode, "min_busbw_gbps": self.min_busbw_gbps}
        bad = _ended_badly(tool, outcome, self.timeout_s)
        if bad is not None:
            return CheckResult(self.name, False, bad, data)
        report = parse_nccl_tests(outcome.stdout)
        data.update(busbw_gbps=report.avg_busbw_gbps, rows=report.rows, wrong=report.wrong)
        if outcome.returncode != 0:
            return CheckResult(self.name, False, _exit_detail(tool, outcome), data)
        if report.avg_busbw_gbps is None:
            return CheckResult(self.name, False, f"no bus bandwidth in the output: {_tail(outcome.stdout, 200)!r}",
                               data)
        if report.wrong:
            return CheckResult(self.name, False, f"{report.wrong} wrong results (data corruption)", data)
        measured = report.avg_busbw_gbps
        if measured < self.min_busbw_gbps:
            return CheckResult(self.name, False,
                               f"bus bandwidth {measured:.1f} GB/s < {self.min_busbw_gbps:g} GB/s", data)
        return CheckResult(self.name, True, f"bus bandwidth {measured:.1f} GB/s >= {self.min_busbw_gbps:g} GB/s",
                           data)


# -- stragglers ---------------------------------------------------------------------------------------------


class StepTimeStragglerCheck:
    """Compares recent per-node step times (`controllers.health.stragglers`). With `node` set, fails when that
    node is a straggler; without, fails when any node is. Skipped (None) with fewer than two nodes reporting."""

    name = "step-time-stragglers"

    def __init__(self, step_times: Callable[[], Mapping[str, Sequence[float]]], node: str | None = None, *,
                 threshold: float = 1.10, last_k: int = 50) -> None:
        self.step_times = step_times
        self.node = node
        self.threshold = threshold
        self.last_k = last_k

    def run(self) -> CheckResult:
        times = self.step_times()
        reporting = [n for n, ts in times.items() if len(ts)]
        if len(reporting) < 2:
            return CheckResult(self.name, None, f"{len(reporting)} node(s) reporting step times: nothing to compare")
        slow = stragglers(times, self.threshold, last_k=self.last_k)
        data: dict[str, Any] = {"stragglers": {s.node: round(s.slowdown, 4) for s in slow},
                                "nodes": len(reporting), "threshold": self.threshold}
        if self.node is not None:
            if self.node not in reporting:
                return CheckResult(self.name, None, f"{self.node}: no step times", data)
            mine = next((s for s in slow if s.node == self.node), None)
            if mine is None:
                return CheckResult(self.name, True, f"{self.node}: within {self.threshold:g}× the fleet median", data)
            return CheckResult(self.name, False, f"{self.node}: {mine.slowdown:.2f}× the fleet median step time", data)
        if slow:
            listed = ", ".join(f"{s.node} {s.slowdown:.2f}×" for s in slow)
            return CheckResult(self.name, False, f"stragglers: {listed}", data)
        return CheckResult(self.name, True, f"{len(reporting)} nodes within {self.threshold:g}× the median", data)


# -- running and grading ------------------------------------------------------------------------------------


def run_checks(checks: Sequence[HealthCheck]) -> list[CheckResult]:
    """Run each check in order. A check that raises (a bug, never an expected outcome) is reported as
    unknown (None) with the exception, and logged: a broken check must not quarantine the fleet."""
    results: list[CheckResult] = []
    for check in checks:
        try:
            results.append(check.run())
        except Exception as exc:
            log.exception("health check %s raised", check.name)
            results.append(CheckResult(check.name, None, f"check raised {type(exc).__name__}: {exc}"))
    return results


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """The health event a tier of checks yields for a node; `event` None when every check was skipped."""

    node: str
    event: HealthEvent | None
    reason: str
    failed: tuple[str, ...] = ()
    """Names of the failed checks."""


def tier(node: str, results: Sequence[CheckResult]) -> NodeVerdict:
    """Grade a tier of check results for `node`: CRITICAL_FAILURE when a failed check is critical,
    CHECK_FAILED when any check failed, CHECK_PASSED when at least one passed and none failed, no event when
    all were skipped. Apply it with `NodeHealthBook.apply(v.node, v.event, now, v.reason)`."""
    failed = [r for r in results if r.passed is False]
    if failed:
        event = HealthEvent.CRITICAL_FAILURE if any(r.critical for r in failed) else HealthEvent.CHECK_FAILED
        reason = "; ".join(f"{r.name}: {r.details}" for r in failed)
        return NodeVerdict(node, event, reason, tuple(r.name for r in failed))
    passed = [r.name for r in results if r.passed is True]
    if passed:
        return NodeVerdict(node, HealthEvent.CHECK_PASSED, "passed: " + ", ".join(passed))
    return NodeVerdict(node, None, "no check could run" + (": " + "; ".join(f"{r.name}: {r.details}" for r in results)
                                                           if results else ""))
