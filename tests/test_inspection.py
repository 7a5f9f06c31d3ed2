"""Scheduled node inspection: each check's verdicts, the per-node report, and the schedule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplane.controllers.health import CRITICAL_XIDS, HealthEvent
from gpuplane.node.gpu import FakeGpuBackend, GpuBackendError
from gpuplane.node.health_checks import AllReduceProbe, FakeHealthReader, NvmlSanityCheck, RunOutcome
from gpuplane.node.inspection import (
    DiskCheck,
    KubeletConditionsCheck,
    RemappedRowsCheck,
    ScheduledInspection,
    XidHistoryCheck,
    inspect_node,
    parse_xids,
)

XID = "[ 12.5] NVRM: Xid (PCI:0000:3B:00): {xid}, pid=1, name=python, something"
GIB = 1 << 30


@pytest.mark.parametrize(("counters", "max_rows", "passed", "critical", "says"), [
    ({}, None, True, False, "4 cards, 0 rows remapped, none pending or failed"),
    ({"remapped_rows_uncorrectable": 3}, None, True, False, "4 cards, 3 rows remapped"),  # report only
    ({"remapped_rows_uncorrectable": 3}, 2, False, False, "card 1: 3 rows remapped for uncorrectable errors (> 2)"),
    ({"remapped_rows_uncorrectable": 2}, 2, True, False, "2 rows remapped"),  # 2 is not > 2
    ({"remap_pending": True}, None, False, False, "card 1: row remap pending"),
    ({"remap_failure": True}, None, False, True, "card 1: row remapping failed"),
])
def test_remapped_rows(counters: dict[str, Any], max_rows: int | None, passed: bool, critical: bool,
                       says: str) -> None:
    reader = FakeHealthReader(4)
    reader.set(1, **counters)
    result = RemappedRowsCheck(reader, max_uncorrectable_rows=max_rows).run()
    assert (result.passed, result.critical) == (passed, critical) and says in result.details
    assert result.data["per_card"]["1"]["uncorrectable"] == counters.get("remapped_rows_uncorrectable", 0)


def test_remapped_rows_without_nvml_says_nothing() -> None:
    reader = FakeHealthReader(2)
    reader.error = GpuBackendError("no driver")
    assert RemappedRowsCheck(reader).run().passed is None


@pytest.mark.parametrize(("lines", "last", "passed", "critical", "says"), [
    ([], 0, True, False, "no Xid"),
    ([XID.format(xid=13), XID.format(xid=13), XID.format(xid=31)], 0, True, False, "none critical: 13, 31"),
    ([XID.format(xid=13), XID.format(xid=79)], 0, False, True, "critical Xid 79 on 0000:3b:00"),
    ([], 48, False, True, "critical Xid 48 on card 0"),  # from NVML's event stream alone
    (["kernel: unrelated line"], None, True, False, "no Xid"),
])
def test_xid_history(lines: list[str], last: int | None, passed: bool, critical: bool, says: str) -> None:
    backend = FakeGpuBackend(2)
    backend.set_xid(0, last)
    result = XidHistoryCheck(lambda: lines, backend).run()
    assert (result.passed, result.critical) == (passed, critical) and says in result.details


@given(st.lists(st.integers(1, 200), max_size=20))
def test_xid_history_is_critical_exactly_when_a_critical_xid_was_logged(xids: list[int]) -> None:
    result = XidHistoryCheck(lambda: [XID.format(xid=x) for x in xids]).run()
    assert result.critical is (not set(xids).isdisjoint(CRITICAL_XIDS))
    assert result.data["counts"] == {str(x): xids.count(x) for x in sorted(set(xids))}
    assert [x for _, x in parse_xids([XID.format(xid=x) for x in xids])] == xids


def node(conditions: list[tuple[str, str]]) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": t, "status": s, "reason": "KubeletNotReady" if t == "Ready" else ""}
                                      for t, s in conditions]}}


@pytest.mark.parametrize(("conditions", "passed", "says"), [
    ([("Ready", "True"), ("DiskPressure", "False")], True, "Ready, no pressure"),
    ([("Ready", "False")], False, "Ready is False (KubeletNotReady)"),
    ([("Ready", "Unknown")], False, "Ready is Unknown"),
    ([], False, "Ready is missing"),
    ([("Ready", "True"), ("MemoryPressure", "True"), ("PIDPressure", "True")], False,
     "MemoryPressure is True; PIDPressure is True"),
])
def test_kubelet_conditions(conditions: list[tuple[str, str]], passed: bool, says: str) -> None:
    result = KubeletConditionsCheck(lambda: node(conditions)).run()
    assert result.passed is passed and says in result.details


def test_kubelet_conditions_unreadable_says_nothing() -> None:
    def broken() -> dict[str, Any]:
        raise ConnectionError("refused")
    assert KubeletConditionsCheck(broken).run().passed is None
    assert KubeletConditionsCheck(lambda: None).run().passed is None


@pytest.mark.parametrize(("free_gib", "passed", "says"), [
    (50, True, "2 paths with at least 10% free"),
    (10, True, "2 paths"),        # 10 of 100 GiB = 10.0 %, not below 10 %
    (9, False, "/b: 9.0% free < 10%"),
])
def test_disk(free_gib: int, passed: bool, says: str) -> None:
    usage = {"/a": (100 * GIB, 50 * GIB, 50 * GIB), "/b": (100 * GIB, (100 - free_gib) * GIB, free_gib * GIB)}
    result = DiskCheck(["/a", "/b"], usage=lambda p: usage[p]).run()
    assert result.passed is passed and says in result.details


def test_disk_unreadable_paths_say_nothing() -> None:
    def missing(path: str) -> tuple[int, int, int]:
        raise FileNotFoundError(path)
    assert DiskCheck(["/nope"], usage=missing).run().passed is None


NCCL_OK = "#  size count type redop root time algbw busbw #wrong\n 8589934592 2147483648 float sum -1 2.0 40 350.00 0\n"


def full_inspection(reader: FakeHealthReader, backend: FakeGpuBackend, lines: list[str]) -> list[Any]:
    return [NvmlSanityCheck(reader, expected_count=4), RemappedRowsCheck(reader),
            XidHistoryCheck(lambda: lines, backend),
            AllReduceProbe(["all_reduce_perf"], runner=lambda argv, t: RunOutcome(0, NCCL_OK, ""),
                           locate=lambda name: "/usr/bin/" + name),
            KubeletConditionsCheck(lambda: node([("Ready", "True")])),
            DiskCheck(["/"], usage=lambda p: (100, 50, 50))]


def test_a_scheduled_inspection_writes_the_node_report_and_its_verdict(tmp_path: Path) -> None:
    reader, backend, lines = FakeHealthReader(4), FakeGpuBackend(4), [XID.format(xid=13)]
    inspection = ScheduledInspection("n7", full_inspection(reader, backend, lines), tmp_path, period_s=3600)
    first = inspection.tick(1000.0)
    assert first is not None and first.verdict.event is HealthEvent.CHECK_PASSED
    report = json.loads((tmp_path / "n7.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["nvml-sanity", "remapped-rows", "xid-history", "all-reduce",
                                                    "kubelet-conditions", "disk"]
    assert all(c["passed"] for c in report["checks"]) and report["t"] == 1000.0
    assert inspection.tick(1000.0 + 3599) is None  # not due: 3599 s < 3600 s
    lines.append(XID.format(xid=79))
    reader.set(2, ecc_uncorrected_volatile=1)
    second = inspection.tick(1000.0 + 3600)
    assert second is not None and second.verdict.event is HealthEvent.CRITICAL_FAILURE
    assert set(second.verdict.failed) == {"nvml-sanity", "xid-history"}
    report = json.loads((tmp_path / "n7.json").read_text())
    assert report["verdict"]["event"] == "critical-failure" and report["t"] == 4600.0
    assert len(inspection.reports) == 2


def test_an_inspection_with_every_tool_missing_has_no_verdict() -> None:
    reader = FakeHealthReader(1)
    reader.error = GpuBackendError("no NVML")
    checks = [RemappedRowsCheck(reader), AllReduceProbe(locate=lambda name: None)]
    assert inspect_node("n0", checks, 0.0).verdict.event is None
