"""The GPU scaler's gRPC service over a real loopback gRPC server, called as KEDA calls it, answering from the
stub HTTP Prometheus of `test_scaler_prometheus.py` (a real local HTTP server in Prometheus' JSON shapes).

Decision time is an injected clock the tests move; waits (streams, deadlines) are real.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.model import GpuplaneError
from gpuplane.scaler.prometheus import PrometheusClient
from gpuplane.scaler.service import (
    ExternalScalerClient,
    GpuScaler,
    MetricValueEntry,
    ScaledObjectConfig,
    ScalerConfig,
    ScalerConfigError,
    ScalerError,
    UnknownScaledObject,
    load_scaler_config,
    serve,
)
from test_scaler_prometheus import BAD_PROMQL, EMPTY, StubPrometheus, closed_port, scalar, vector

Q = "avg(DCGM_FI_DEV_GPU_UTIL)"
NS = "serving"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def obj(name: str = "llm", **fields: Any) -> ScaledObjectConfig:
    return ScaledObjectConfig.model_validate({"name": name, "namespace": NS, "query": Q, "target": 60.0} | fields)


class Harness:
    """A started scaler on a loopback port and a client acting as KEDA."""

    def __init__(self, scaler: GpuScaler, clock: FakeClock, client: ExternalScalerClient) -> None:
        self.scaler, self.clock, self.client = scaler, clock, client

    def metrics(self, name: str = "llm", namespace: str = NS) -> MetricValueEntry:
        values = self.client.get_metrics(namespace, name, f"gpu-{name}")
        assert len(values) == 1
        return values[0]

    def keda_poll(self, name: str = "llm", namespace: str = NS) -> tuple[float, bool]:
        """One KEDA poll: GetMetrics, then IsActive; the value as KEDA reads it."""
        value = self.metrics(name, namespace).keda_value
        return value, self.client.is_active(namespace, name)

    def sample(self, metric: str, name: str = "llm") -> float | None:
        return self.scaler.registry.get_sample_value(metric, {"namespace": NS, "name": name})


@pytest.fixture
def harness(stub: StubPrometheus) -> Iterator[Callable[..., Harness]]:
    started: list[Harness] = []

    def start(*objects: ScaledObjectConfig, url: str | None = None, **settings: Any) -> Harness:
        config = ScalerConfig.model_validate({"prometheus_url": url or stub.url, "min_query_interval_s": 0.0,
                                              "scaled_objects": list(objects or (obj(),))} | settings)
        clock = FakeClock()
        scaler = GpuScaler(config, PrometheusClient, clock)
        port = scaler.start(0, "127.0.0.1")
        started.append(Harness(scaler, clock, ExternalScalerClient(f"127.0.0.1:{port}")))
        return started[-1]

    try:
        yield start
    finally:
        for h in started:
            h.client.close()
            h.scaler.stop(0)


# -- GetMetricSpec and GetMetrics -----------------------------------------------------------------------------


def test_metric_spec_fills_both_the_int_and_the_float_target(harness: Callable[..., Harness]) -> None:
    h = harness(obj(target=62.5), obj("embed", target=40, metric_name="embed_gpu_util"))
    [spec] = h.client.get_metric_spec(NS, "llm", {"scalerAddress": "gpu-scaler:9091"})
    assert (spec.metric_name, spec.target_size, spec.target_size_float) == ("gpu-llm", 63, 62.5)
    [named] = h.client.get_metric_spec(NS, "embed")
    assert (named.metric_name, named.target_size, named.target_size_float) == ("embed_gpu_util", 40, 40.0)


def test_metrics_track_the_query_value_in_both_fields(harness: Callable[..., Harness],
                                                      stub: StubPrometheus) -> None:
    h = harness()
    for text, whole, exact in (("20", 20, 20.0), ("80.4", 80, 80.4), ("80.5", 81, 80.5), ("0.4", 0, 0.4)):
        stub.set(Q, vector(text))
        h.clock.advance(1)
        value = h.metrics()
        assert (value.metric_name, value.metric_value, value.metric_value_float) == ("gpu-llm", whole, exact)
        assert value.keda_value == exact  # the float is > 0, so KEDA reads it and 0.4 is not lost to rounding
    stub.set(Q, scalar("55"))  # more lenient than KEDA: a scalar result is a value
    assert h.metrics().keda_value == 55.0


def test_one_keda_poll_costs_one_query(harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    h = harness(min_query_interval_s=1.0)
    stub.set(Q, vector("30"))
    assert h.keda_poll() == (30.0, True)
    assert stub.queries(Q) == 1
    h.clock.advance(0.5)
    assert h.keda_poll() == (30.0, True)
    assert stub.queries(Q) == 1
    h.clock.advance(0.6)
    stub.set(Q, vector("31"))
    assert h.keda_poll() == (31.0, True)
    assert stub.queries(Q) == 2


def test_the_query_carries_the_objects_timeout(harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    h = harness(obj(query_timeout_s=0.75))
    stub.set(Q, vector("1"))
    h.metrics()
    assert stub.requests[-1][1]["timeout"] == ["0.750"]


# -- IsActive -----------------------------------------------------------------------------------------------


def test_a_production_object_is_always_active(harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    h = harness(obj(activation_threshold=10, idle_cooldown_s=60))
    stub.set(Q, vector("0"))
    for _ in range(5):
        assert h.keda_poll() == (0.0, True)
        h.clock.advance(3600)
    assert h.sample("gpuplane_scaler_active") == 1.0


def test_a_non_production_object_goes_idle_after_its_cooldown_and_wakes_on_activity(
        harness: Callable[..., Harness], stub: StubPrometheus, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpuplane.scaler")
    h = harness(obj("batch", production=False, min_replicas=0, activation_threshold=10, idle_cooldown_s=300))
    stub.set(Q, vector("50"))
    assert h.keda_poll("batch") == (50.0, True)
    stub.set(Q, vector("10"))  # not above the threshold (strictly, as KEDA compares)
    h.clock.advance(200)
    assert h.keda_poll("batch") == (10.0, True)
    h.clock.advance(99)
    assert h.keda_poll("batch") == (10.0, True)
    h.clock.advance(2)  # 301 s since the last activity
    assert h.keda_poll("batch") == (10.0, False)
    assert h.sample("gpuplane_scaler_active", "batch") == 0.0
    assert h.scaler.desired_replicas(NS, "batch") == 0
    stub.set(Q, vector("10.5"))
    h.clock.advance(1)
    assert h.keda_poll("batch") == (10.5, True)
    assert h.scaler.desired_replicas(NS, "batch") == 1
    changes = [r.getMessage() for r in caplog.records if re.search(r": (in)?active \(", r.getMessage())]
    assert changes == ["serving/batch: active (value 50, metric)", "serving/batch: inactive (value 10, metric)",
                       "serving/batch: active (value 10.5, metric)"]


def test_an_activation_query_decides_the_activity_of_a_non_production_object(
        harness: Callable[..., Harness], stub: StubPrometheus, caplog: pytest.LogCaptureFixture) -> None:
    rate = 'sum(rate(gateway_requests_total{service="batch"}[1m]))'
    h = harness(obj("batch", production=False, min_replicas=0, activation_threshold=0.5, idle_cooldown_s=60,
                    activation_query=rate))
    stub.set(Q, vector("0"))  # no replica runs, so no GPU is busy …
    stub.set(rate, vector("3.2"))  # … but requests are waiting at the gateway
    assert h.keda_poll("batch") == (0.0, True)  # the value is the GPU metric's, the activity the gateway's
    stub.set(rate, vector("0"))
    h.clock.advance(61)
    assert h.keda_poll("batch") == (0.0, False)
    stub.set(rate, BAD_PROMQL)  # an activation query that fails reads as activity, never as idleness
    h.clock.advance(1)
    assert h.keda_poll("batch") == (0.0, True)
    assert h.sample("gpuplane_scaler_errors_total", "batch") == 2.0  # GetMetrics and IsActive
    assert any("activation query failed" in r.getMessage() and "treated as activity" in r.getMessage()
               for r in caplog.records)


def test_the_activation_query_decides_while_the_gpu_query_has_no_data(
        harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    # at zero replicas a query over the service's own pods has no series; the gateway still counts requests
    rate = 'sum(rate(gateway_requests_total{service="batch"}[1m]))'
    h = harness(obj("batch", production=False, min_replicas=0, activation_threshold=0.5, idle_cooldown_s=60,
                    activation_query=rate))
    stub.set(Q, EMPTY)
    stub.set(rate, vector("0"))
    h.clock.advance(61)
    assert h.keda_poll("batch")[1] is False  # idle for 61 s by the gateway: inactive, though the GPU query fails
    stub.set(rate, vector("2"))
    h.clock.advance(1)
    assert h.keda_poll("batch")[1] is True


def test_a_demand_query_reports_a_crowd_the_saturated_gpus_cannot_show(
        harness: Callable[..., Harness], stub: StubPrometheus, caplog: pytest.LogCaptureFixture) -> None:
    rate = 'sum(rate(gateway_requests_total{service="llm"}[1m]))'
    h = harness(obj(demand_query=rate, max_replicas=40))
    stub.set(Q, vector("240"))  # 4 replicas at 60 % ...
    stub.set(rate, vector("30"))  # ... serving 30 requests/s: 8 per request/s
    assert h.metrics().keda_value == 240.0
    stub.set(Q, vector("400"))  # saturated at 4 × 100 %
    stub.set(rate, vector("90"))  # while 90 requests/s arrive
    h.clock.advance(15)
    assert h.metrics().keda_value == pytest.approx(720.0)  # 90 × 8: what 12 replicas at 60 % carry
    stub.set(rate, BAD_PROMQL)
    h.clock.advance(15)
    assert h.metrics().keda_value == 400.0  # a failed demand query: the GPU value alone, and said so
    assert any("demand query failed" in r.getMessage() for r in caplog.records)


def test_objects_with_a_rise_lead_learn_a_flash_crowd_together(harness: Callable[..., Harness],
                                                               stub: StubPrometheus) -> None:
    q_chat = 'sum(DCGM_FI_DEV_GPU_UTIL{pod=~"chat-.*"})'
    reserve: dict[str, Any] = {"rise_lead_s": 60.0, "replica_capacity": 100.0}
    h = harness(obj(**reserve), obj("chat", query=q_chat, **reserve), obj("solo", query=q_chat))
    stub.set(Q, vector("120"))
    stub.set(q_chat, vector("120"))
    assert [h.metrics(n).keda_value for n in ("llm", "chat", "solo")] == [120.0, 120.0, 120.0]
    stub.set(Q, vector("240"))  # llm's demand doubles within the lead
    h.clock.advance(60)
    # llm: 240 × 2 × 60 / 100 = 288 (5 replicas at 60 %, where 240 / 60 = 4 would be short while they start);
    # chat shares llm's reserve: 120 × 2 × 0.6 = 144; solo has no rise lead and reads its metric alone
    assert h.metrics("llm").keda_value == pytest.approx(288.0)
    assert h.metrics("chat").keda_value == pytest.approx(144.0)
    assert h.metrics("solo").keda_value == 120.0


def test_a_production_object_does_not_run_its_activation_query(harness: Callable[..., Harness],
                                                               stub: StubPrometheus) -> None:
    h = harness(obj(activation_query="sum(rate(gateway_requests_total[1m]))"))
    stub.set(Q, vector("12"))
    assert h.keda_poll() == (12.0, True)
    assert stub.queries("sum(rate(gateway_requests_total[1m]))") == 0


# -- failures: never a silent zero --------------------------------------------------------------------------


def test_a_dead_exporter_gives_the_last_good_value_then_the_fallback_and_stays_active(
        harness: Callable[..., Harness], stub: StubPrometheus, caplog: pytest.LogCaptureFixture) -> None:
    h = harness(obj(production=False, min_replicas=0, activation_threshold=5, idle_cooldown_s=10,
                    failure_threshold=3, fallback_replicas=2), min_query_interval_s=1.0)  # one reading a poll
    stub.set(Q, vector("42"))
    assert h.keda_poll() == (42.0, True)
    stub.set(Q, EMPTY)  # the exporter's series went stale
    seen = []
    for _ in range(5):
        h.clock.advance(30)  # far beyond the idle cooldown: a failure keeps the object active
        seen.append(h.keda_poll())
    # the last good value for failure_threshold failed readings, then the fallback (60 × 2), as KEDA's
    # fallback starts when the failures exceed its failureThreshold
    assert seen == [(42.0, True)] * 3 + [(120.0, True)] * 2
    assert h.sample("gpuplane_scaler_errors_total") == 5.0
    assert h.sample("gpuplane_scaler_fallback_total") == 2.0
    assert h.sample("gpuplane_scaler_metric_value") == 120.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5
    assert "no data: exporter down or query matches nothing" in warnings[0]
    assert "reporting the last-good value 42" in warnings[0]
    assert "reporting the fallback value 120" in warnings[-1]
    stub.set(Q, vector("7"))
    h.clock.advance(1)
    assert h.keda_poll() == (7.0, True)


def test_without_any_good_reading_the_fallback_is_reported_at_once(harness: Callable[..., Harness]) -> None:
    h = harness(obj(fallback_replicas=3), url=f"http://127.0.0.1:{closed_port()}")
    value = h.metrics()
    assert (value.metric_value, value.metric_value_float) == (180, 180.0)
    assert h.client.is_active(NS, "llm")
    assert h.sample("gpuplane_scaler_fallback_total") == 2.0  # GetMetrics and IsActive, each a fresh reading


def test_invalid_promql_is_logged_and_counted_and_the_last_good_value_kept(
        harness: Callable[..., Harness], stub: StubPrometheus, caplog: pytest.LogCaptureFixture) -> None:
    h = harness(obj(failure_threshold=5), min_query_interval_s=1.0)
    stub.set(Q, vector("33"))
    assert h.keda_poll() == (33.0, True)
    stub.set(Q, BAD_PROMQL)  # as if the query had been edited into an invalid one
    h.clock.advance(1)
    assert h.keda_poll() == (33.0, True)
    assert h.sample("gpuplane_scaler_errors_total") == 1.0
    assert h.sample("gpuplane_scaler_fallback_total") == 0.0
    [first, *_] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert first.name == "gpuplane.scaler.service"
    assert f"query {Q!r} failed: HTTP 400: bad_data" in first.getMessage()
    assert "unclosed left parenthesis" in first.getMessage()


def test_a_slow_prometheus_does_not_block_beyond_the_query_timeout(
        harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    from test_scaler_prometheus import Answer

    h = harness(obj(query_timeout_s=0.3))
    stub.set(Q, vector("12"))
    assert h.metrics().keda_value == 12.0
    stub.set(Q, Answer(200, b"{}", delay_s=5))
    started = time.monotonic()
    assert h.metrics().keda_value == 12.0
    assert time.monotonic() - started < 2


# -- HPA and metrics --------------------------------------------------------------------------------------


def test_the_desired_replicas_follow_the_hpa_algorithm(harness: Callable[..., Harness],
                                                       stub: StubPrometheus) -> None:
    h = harness(obj(max_replicas=10, target=0.5))
    stub.set(Q, vector("1.3"))
    h.metrics()
    assert h.sample("gpuplane_scaler_desired_replicas") == 3.0  # ceil(1.3 / 0.5)
    stub.set(Q, vector("0.2"))
    h.clock.advance(60)
    h.metrics()
    assert h.sample("gpuplane_scaler_desired_replicas") == 3.0  # scale-down stabilisation: 300 s
    h.clock.advance(241)
    h.metrics()
    assert h.sample("gpuplane_scaler_desired_replicas") == 1.0
    stub.set(Q, vector("100"))
    h.clock.advance(1)
    h.metrics()
    # scale-up policy: 4 pods per 15 s counted from the period's start, 3 replicas before the scale-down
    # 1 s ago (kubernetes#109058): 3 + 4
    assert h.sample("gpuplane_scaler_desired_replicas") == 7.0
    h.clock.advance(16)
    h.metrics()
    assert h.sample("gpuplane_scaler_desired_replicas") == 10.0  # 100 % per 15 s, capped at max_replicas
    stub.set(Q, vector("1.7e308"))  # finite, but 1.7e308 / 0.5 is not
    h.clock.advance(1)
    assert h.metrics().metric_value == 2**63 - 1  # the integer field is clamped to int64
    assert h.sample("gpuplane_scaler_desired_replicas") == 10.0


def test_metrics_are_served_over_http(harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    import urllib.request

    h = harness()
    stub.set(Q, vector("12"))
    h.metrics()
    server, _ = h.scaler.start_metrics_server(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'gpuplane_scaler_metric_value{name="llm",namespace="serving"} 12.0' in text
    assert 'gpuplane_scaler_errors_total{name="llm",namespace="serving"} 0.0' in text


# -- unknown objects ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["spec", "metrics", "active", "stream"])
def test_an_unknown_scaled_object_is_not_found(harness: Callable[..., Harness], call: str) -> None:
    h = harness(obj(), obj("embed"))
    with pytest.raises(grpc.RpcError) as caught:
        if call == "spec":
            h.client.get_metric_spec(NS, "nope")
        elif call == "metrics":
            h.client.get_metrics("other", "llm", "gpu-llm")
        elif call == "active":
            h.client.is_active(NS, "nope")
        else:
            next(iter(h.client.stream_is_active(NS, "nope", timeout_s=5)))
    error: Any = caught.value
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "known: serving/llm, serving/embed" in error.details()


def test_an_empty_namespace_means_default(harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    h = harness(ScaledObjectConfig(name="llm", query=Q, target=10))
    stub.set(Q, vector("5"))
    assert h.client.is_active("", "llm")
    with pytest.raises(UnknownScaledObject, match="no scaled object serving/llm is configured; known: default/llm"):
        h.scaler.poll(NS, "llm")


# -- StreamIsActive ----------------------------------------------------------------------------------------


def test_stream_is_active_delivers_a_change(harness: Callable[..., Harness], stub: StubPrometheus) -> None:
    h = harness(obj("batch", production=False, min_replicas=0, activation_threshold=10, idle_cooldown_s=60),
                stream_interval_s=30)
    stub.set(Q, vector("50"))
    stream = h.client.stream_is_active(NS, "batch", timeout_s=10)
    try:
        values = iter(stream)
        assert next(values) is True
        stub.set(Q, vector("0"))
        h.clock.advance(61)
        started = time.monotonic()
        assert next(values) is False
        assert time.monotonic() - started < 2  # a change is sent at once, not at the 30 s keep-alive
        stub.set(Q, vector("20"))
        h.clock.advance(1)
        assert next(values) is True
    finally:
        stream.cancel()


def test_stream_is_active_repeats_the_activity_every_interval(harness: Callable[..., Harness],
                                                              stub: StubPrometheus) -> None:
    h = harness(stream_interval_s=0.2)
    stub.set(Q, vector("50"))
    stream = h.client.stream_is_active(NS, "llm", timeout_s=10)
    started = time.monotonic()
    try:
        values = iter(stream)
        assert [next(values) for _ in range(4)] == [True] * 4
    finally:
        stream.cancel()
    assert 0.5 < time.monotonic() - started < 3


def test_stopping_the_scaler_ends_open_streams(stub: StubPrometheus) -> None:
    scaler = GpuScaler(ScalerConfig(prometheus_url=stub.url, stream_interval_s=30, scaled_objects=(obj(),)))
    stub.set(Q, vector("50"))
    port = scaler.start(0, "127.0.0.1")
    with ExternalScalerClient(f"127.0.0.1:{port}") as client:
        values = iter(client.stream_is_active(NS, "llm", timeout_s=10))
        assert next(values) is True
        started = time.monotonic()
        scaler.stop(grace_s=5)
        with pytest.raises(StopIteration):
            next(values)
        assert time.monotonic() - started < 2


# -- serving ------------------------------------------------------------------------------------------------


def test_a_taken_port_is_an_error(stub: StubPrometheus) -> None:
    scaler = GpuScaler(ScalerConfig(prometheus_url=stub.url, scaled_objects=(obj(),)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ScalerError, match=r"cannot listen on 127\.0\.0\.1:"):
            scaler.start(taken.getsockname()[1], "127.0.0.1")


def test_serve_starts_a_grpc_server(stub: StubPrometheus) -> None:
    port = closed_port()
    stub.set(Q, vector("21"))
    server = serve(ScalerConfig(prometheus_url=stub.url, scaled_objects=(obj(),)), port, "127.0.0.1")
    try:
        with ExternalScalerClient(f"127.0.0.1:{port}") as client:
            assert client.get_metrics(NS, "llm", "gpu-llm")[0].keda_value == 21.0
    finally:
        server.stop(0).wait()


# -- configuration ------------------------------------------------------------------------------------------

GOOD = """\
prometheus_url: http://prometheus.monitoring:9090
min_query_interval_s: 1
stream_interval_s: 5
scaled_objects:
  - name: llm
    namespace: serving
    query: avg(DCGM_FI_DEV_GPU_UTIL{namespace="serving", pod=~"llm-.*"})
    target: 60
    activation_threshold: 5
    min_replicas: 2
    max_replicas: 16
    fallback_replicas: 4
  - name: embed-batch
    namespace: batch
    query: max(DCGM_FI_DEV_GPU_UTIL{namespace="batch"})
    target: 70
    production: false
    min_replicas: 0
    idle_cooldown_s: 600
"""


def test_a_good_config_loads(tmp_path: Path) -> None:
    path = tmp_path / "scaler.yaml"
    path.write_text(GOOD)
    config = load_scaler_config(path)
    assert [o.key for o in config.scaled_objects] == ["serving/llm", "batch/embed-batch"]
    assert config.scaled_objects[1].metric == "gpu-embed-batch"


@pytest.mark.parametrize(("edit", "where", "message"), [
    (("max_replicas: 16", "max_replicas: 1"), "scaled_objects.0", "min_replicas (2) is above max_replicas (1)"),
    (("name: embed-batch\n    namespace: batch", "name: llm\n    namespace: serving"), "scaled_objects",
     "names must be unique per namespace: serving/llm"),
    (("target: 60", "target: 60\n    targett: 1"), "scaled_objects.0.targett", "Extra inputs are not permitted"),
    (("stream_interval_s: 5", "stream_interval_s: 5\nprometheus: x"), "prometheus", "Extra inputs"),
    (("target: 60", "target: .inf"), "scaled_objects.0.target", "finite number"),
    (("target: 60", "target: 0"), "scaled_objects.0.target", "greater than 0"),
    (("http://prometheus.monitoring:9090", "prometheus:9090"), "prometheus_url", "give http(s)://host"),
    (("min_query_interval_s: 1", "min_query_interval_s: -1"), "min_query_interval_s", "greater than or equal"),
    (("    production: false\n", ""), "scaled_objects.1", "min_replicas 0 is for non-production services"),
])
def test_config_errors_name_the_file_and_the_field(tmp_path: Path, edit: tuple[str, str], where: str,
                                                    message: str) -> None:
    path = tmp_path / "scaler.yaml"
    assert edit[0] in GOOD
    path.write_text(GOOD.replace(edit[0], edit[1], 1))
    with pytest.raises(ScalerConfigError) as caught:
        load_scaler_config(path)
    assert str(caught.value).startswith(f"{path}: {where}: ")
    assert message in str(caught.value)
    assert isinstance(caught.value, GpuplaneError)


def test_an_unreadable_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ScalerConfigError, match=r"missing\.yaml"):
        load_scaler_config(tmp_path / "missing.yaml")


# -- command line -------------------------------------------------------------------------------------------

runner = CliRunner()


def test_gpuplane_scaler_with_a_bad_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "scaler.yaml"
    path.write_text(GOOD.replace("max_replicas: 16", "max_replicas: 1"))
    result = runner.invoke(app, ["scaler", "--config", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert f"{path}: scaled_objects.0" in result.output
    assert "min_replicas (2) is above max_replicas (1)" in result.output


def test_gpuplane_scaler_serves_until_sigterm(tmp_path: Path, stub: StubPrometheus) -> None:
    path = tmp_path / "scaler.yaml"
    path.write_text(GOOD.replace("http://prometheus.monitoring:9090", stub.url))
    stub.set_default(vector("48"))
    process = subprocess.Popen([sys.executable, "-m", "gpuplane.cli.main", "scaler", "--config", str(path),
                                "--port", "0", "--addr", "127.0.0.1", "--metrics-port", "0"],
                               stderr=subprocess.PIPE, text=True, env=os.environ | {"COLUMNS": "300"})
    try:
        assert process.stderr is not None
        lines = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            lines.append(line)
            found = re.search(r"GPU scaler serving serving/llm, batch/embed-batch on 127\.0\.0\.1:(\d+)", line)
            if found or not line:
                break
        assert found, "".join(lines)
        with ExternalScalerClient(f"127.0.0.1:{found.group(1)}") as client:
            assert client.get_metrics("serving", "llm", "gpu-llm")[0].keda_value == 48.0
            assert client.is_active("batch", "embed-batch")
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
