"""Scheduled node inspection: NVML and ECC, remapped rows, Xid history, an NCCL probe, kubelet conditions, disk.

An inspection is a list of `HealthCheck`s (`gpuplane.node.health_checks`) run together on one node; its result
is an `InspectionReport` (every check's result, the tier's verdict, when) written as `<out>/<node>.json`
(`write_report`) and graded by `health_checks.tier`, so the node agent can post the verdict as it posts its
other check tiers (`NodeReporter.checks`). `ScheduledInspection.tick(now)` runs one every `period_s`.

Checks added here (the NVML sanity check and the all-reduce probe are `health_checks`'):

- `RemappedRowsCheck`: remapped rows per card (uncorrectable-error remaps, pending remaps, failed remapping).
  A failed remapping is critical; a pending one is a finding (reset the card); rows remapped for uncorrectable
  errors are reported, and a finding only above `max_uncorrectable_rows` (None: report only — remapping is the
  card healing itself).
- `XidHistoryCheck`: Xids from the kernel log (`NVRM: Xid (PCI:…): N, …` lines) and each card's last Xid from
  the GPU backend (`gpu.GpuBackend`, NVML's event stream); a critical Xid (48, 64, 79, 95) fails it critically,
  others are listed.
- `KubeletConditionsCheck`: the Node's `status.conditions`: Ready must be True, and MemoryPressure,
  DiskPressure, PIDPressure and NetworkUnavailable False.
- `DiskCheck`: free space on each path (the container runtime's and the kubelet's folders) at least
  `min_free_fraction` of the disk.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuplane.controllers.health import CRITICAL_XIDS
from gpuplane.node.gpu import GpuBackend, GpuBackendError
from gpuplane.node.health_checks import CheckResult, HealthCheck, HealthReader, NodeVerdict, run_checks, tier

__all__ = [
    "DiskCheck", "InspectionReport", "KubeletConditionsCheck", "RemappedRowsCheck", "ScheduledInspection",
    "XidHistoryCheck", "inspect_node", "parse_xids", "write_report",
]

XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),")


def parse_xids(lines: Sequence[str]) -> list[tuple[str, int]]:
    """(PCI bus id, Xid) of every `NVRM: Xid` line, in order."""
    found = []
    for line in lines:
        match = XID_LINE.search(line)
        if match is not None:
            found.append((match.group(1).lower(), int(match.group(2))))
    return found


class RemappedRowsCheck:
    name = "remapped-rows"

    def __init__(self, reader: HealthReader, *, max_uncorrectable_rows: int | None = None) -> None:
        self.reader = reader
        self.max_uncorrectable_rows = max_uncorrectable_rows

    def run(self) -> CheckResult:
        try:
            cards = self.reader.cards()
        except GpuBackendError as exc:
            return CheckResult(self.name, None, f"NVML not available: {exc}")
        rows = {str(c.index): {"uncorrectable": c.remapped_rows_uncorrectable, "pending": c.remap_pending,
                               "failure": c.remap_failure} for c in cards}
        critical = [f"card {c.index}: row remapping failed" for c in cards if c.remap_failure]
        findings = [f"card {c.index}: row remap pending (reset the GPU)" for c in cards if c.remap_pending]
        limit = self.max_uncorrectable_rows
        if limit is not None:
            findings += [f"card {c.index}: {c.remapped_rows_uncorrectable} rows remapped for uncorrectable errors "
                         f"(> {limit})" for c in cards
                         if c.remapped_rows_uncorrectable is not None and c.remapped_rows_uncorrectable > limit]
        data = {"per_card": rows}
        if critical or findings:
            return CheckResult(self.name, False, "; ".join(critical + findings), data, critical=bool(critical))
        total = sum(c.remapped_rows_uncorrectable or 0 for c in cards)
        return CheckResult(self.name, True, f"{len(cards)} cards, {total} rows remapped, none pending or failed",
                           data)


class XidHistoryCheck:
    name = "xid-history"

    def __init__(self, log_lines: Callable[[], Sequence[str]], backend: GpuBackend | None = None, *,
                 critical_xids: frozenset[int] = CRITICAL_XIDS) -> None:
        self.log_lines = log_lines
        self.backend = backend
        self.critical_xids = critical_xids

    def run(self) -> CheckResult:
        try:
            logged = parse_xids(self.log_lines())
        except OSError as exc:
            logged = []
            log_error: str | None = str(exc)
        else:
            log_error = None
        last: dict[str, int | None] = {}
        if self.backend is not None:
            try:
                last = {str(c.index): c.xid_last for c in self.backend.cards()}
            except GpuBackendError as exc:
                log_error = (log_error + "; " if log_error else "") + f"GPU backend: {exc}"
        if log_error is not None and not logged and not last:
            return CheckResult(self.name, None, f"no Xid source could be read: {log_error}")
        counts = Counter(xid for _, xid in logged)
        seen = set(counts) | {x for x in last.values() if x}
        critical = sorted(x for x in seen if x in self.critical_xids)
        data: dict[str, Any] = {"logged": [{"bus": bus, "xid": xid} for bus, xid in logged],
                                "counts": {str(k): v for k, v in sorted(counts.items())}, "last_per_card": last}
        if critical:
            where = sorted({bus for bus, xid in logged if xid in self.critical_xids} |
                           {f"card {i}" for i, x in last.items() if x in self.critical_xids})
            return CheckResult(self.name, False, f"critical Xid {', '.join(map(str, critical))} on {', '.join(where)}",
                               data, critical=True)
        if seen:
            return CheckResult(self.name, True, f"Xids seen, none critical: {', '.join(map(str, sorted(seen)))}", data)
        return CheckResult(self.name, True, "no Xid", data)


_MUST_BE_FALSE = ("MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable")


class KubeletConditionsCheck:
    name = "kubelet-conditions"

    def __init__(self, node: Callable[[], Mapping[str, Any] | None]) -> None:
        self.node = node

    def run(self) -> CheckResult:
        try:
            obj = self.node()
        except Exception as exc:  # the API is unreachable: this check cannot say
            return CheckResult(self.name, None, f"cannot read the Node: {type(exc).__name__}: {exc}")
        if obj is None:
            return CheckResult(self.name, None, "the Node object does not exist")
        conditions = {c.get("type"): c for c in obj.get("status", {}).get("conditions", []) or []}
        data = {t: c.get("status") for t, c in conditions.items()}
        problems = []
        ready = conditions.get("Ready")
        if ready is None or ready.get("status") != "True":
            status = "missing" if ready is None else ready.get("status")
            why = f" ({ready.get('reason')})" if ready and ready.get("reason") else ""
            problems.append(f"Ready is {status}{why}")
        problems += [f"{t} is True" for t in _MUST_BE_FALSE if conditions.get(t, {}).get("status") == "True"]
        if problems:
            return CheckResult(self.name, False, "; ".join(problems), data)
        return CheckResult(self.name, True, "Ready, no pressure", data)


DiskUsage = Callable[[str], tuple[int, int, int]]
"""`shutil.disk_usage`'s shape: (total, used, free) bytes."""


class DiskCheck:
    name = "disk"

    def __init__(self, paths: Sequence[str] = ("/var/lib/kubelet", "/var/lib/containerd"), *,
                 min_free_fraction: float = 0.10, usage: DiskUsage = shutil.disk_usage) -> None:
        if not 0 <= min_free_fraction < 1:
            raise ValueError(f"min_free_fraction: must be in [0, 1), got {min_free_fraction!r}")
        self.paths = tuple(paths)
        self.min_free_fraction = min_free_fraction
        self.usage = usage

    def run(self) -> CheckResult:
        data: dict[str, Any] = {}
        low = []
        for path in self.paths:
            try:
                total, _used, free = self.usage(path)
            except OSError as exc:
                data[path] = {"error": str(exc)}
                continue
            fraction = free / total if total else 0.0
            data[path] = {"total_bytes": total, "free_bytes": free, "free_fraction": round(fraction, 4)}
            if fraction < self.min_free_fraction:
                low.append(f"{path}: {fraction:.1%} free < {self.min_free_fraction:.0%}")
        readable = [p for p in self.paths if "error" not in data[p]]
        if not readable:
            return CheckResult(self.name, None, "no path could be measured", data)
        if low:
            return CheckResult(self.name, False, "; ".join(low), data)
        return CheckResult(self.name, True, f"{len(readable)} paths with at least {self.min_free_fraction:.0%} free",
                           data)


# -- the report --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InspectionReport:
    node: str
    t: float
    results: tuple[CheckResult, ...]
    verdict: NodeVerdict

    def json(self) -> dict[str, Any]:
        return {"node": self.node, "t": self.t,
                "verdict": {"event": self.verdict.event.value if self.verdict.event else None,
                            "reason": self.verdict.reason, "failed": list(self.verdict.failed)},
                "checks": [{"name": r.name, "passed": r.passed, "critical": r.critical, "details": r.details,
                            "data": r.data} for r in self.results]}


def inspect_node(node: str, checks: Sequence[HealthCheck], now: float) -> InspectionReport:
    results = tuple(run_checks(checks))
    return InspectionReport(node, now, results, tier(node, results))


def write_report(report: InspectionReport, out: Path) -> Path:
    """`<out>/<node>.json`, written whole (a temporary file renamed over it)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{report.node}.json"
    scratch = path.with_suffix(".json.tmp")
    scratch.write_text(json.dumps(report.json(), indent=2, sort_keys=True, default=str) + "\n")
    scratch.replace(path)
    return path


@dataclass
class ScheduledInspection:
    """Run `checks` on `node` every `period_s` (the first at the first tick), writing each report under `out`."""

    node: str
    checks: Sequence[HealthCheck]
    out: Path
    period_s: float = 6 * 3600.0
    last: float | None = None
    reports: list[InspectionReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.period_s > 0:
            raise ValueError(f"period_s: must be > 0, got {self.period_s!r}")

    def due(self, now: float) -> bool:
        return self.last is None or now - self.last >= self.period_s

    def tick(self, now: float) -> InspectionReport | None:
        """One inspection when due (written, kept in `reports`), else None."""
        if not self.due(now):
            return None
        self.last = now
        report = inspect_node(self.node, self.checks, now)
        write_report(report, self.out)
        self.reports.append(report)
        return report
