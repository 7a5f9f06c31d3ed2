"""Fixtures shared by several test files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from test_scaler_prometheus import StubPrometheus


@pytest.fixture
def stub() -> Iterator[StubPrometheus]:
    """A local HTTP server answering in Prometheus' API shapes (see `StubPrometheus`)."""
    server = StubPrometheus()
    try:
        yield server
    finally:
        server.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A skipped test is a failure of the setup (a missing tool, an artefact the repository ships): it is
    reported as failed, with the skip's reason, so that no run passes with part of the suite left out."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, which this suite counts as a failure of the setup: {reason}"
