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
