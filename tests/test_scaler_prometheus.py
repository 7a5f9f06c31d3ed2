"""The Prometheus client against a real local HTTP server that answers in Prometheus' exact JSON shapes.

`StubPrometheus` is also the Prometheus of `test_scaler_service.py`: a stdlib `ThreadingHTTPServer` on a
loopback port that answers `/api/v1/query` from a table of canned answers (per query, or a default one),
with optional delays, and records every request it got.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from gpuplane.model import GpuplaneError
from gpuplane.scaler.prometheus import PrometheusClient, PrometheusError, Sample, Series

TS = 1795937014.555


# -- the stub ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    delay_s: float = 0.0
    """Wait this long before answering."""
    drip_s: float = 0.0
    """Send the headers at once, then the body one byte per `drip_s`."""


def _ok(result_type: str, result: object) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": result_type, "result": result}}).encode()


def vector(*values: str, metric: dict[str, str] | None = None) -> Answer:
    """An instant vector, one element per value (Prometheus sends values as strings)."""
    labels = metric if metric is not None else {}
    return Answer(200, _ok("vector", [{"metric": labels | ({"gpu": str(i)} if len(values) > 1 else {}),
                                       "value": [TS, v]} for i, v in enumerate(values)]))


def scalar(value: str) -> Answer:
    return Answer(200, _ok("scalar", [TS, value]))


def error(status: int, kind: str, message: str) -> Answer:
    return Answer(status, json.dumps({"status": "error", "errorType": kind, "error": message}).encode())


EMPTY = Answer(200, _ok("vector", []))
BAD_PROMQL = error(400, "bad_data", 'invalid parameter "query": 1:6: parse error: unclosed left parenthesis')


class StubPrometheus:
    """A loopback HTTP server answering `/api/v1/query` with canned answers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answers: dict[str, Answer] = {}
        self._default = EMPTY
        self.requests: list[tuple[str, dict[str, list[str]]]] = []
        """(path, query parameters) of every request, in order."""
        self._stopped = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                params = parse_qs(parts.query)
                with stub._lock:
                    stub.requests.append((parts.path, params))
                    answer = stub._answers.get(params.get("query", [""])[0], stub._default)
                if not parts.path.endswith("/api/v1/query"):
                    answer = Answer(404, b"404 page not found\n")
                if stub._stopped.wait(answer.delay_s):
                    return
                try:
                    self.send_response(answer.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    if answer.drip_s:
                        for i in range(len(answer.body)):
                            self.wfile.write(answer.body[i:i + 1])
                            self.wfile.flush()
                            if stub._stopped.wait(answer.drip_s):
                                return
                    else:
                        self.wfile.write(answer.body)
                except OSError:
                    pass  # the client gave up (a timeout test)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def set(self, query: str, answer: Answer) -> None:
        with self._lock:
            self._answers[query] = answer

    def set_default(self, answer: Answer) -> None:
        with self._lock:
            self._default = answer

    def queries(self, query: str) -> int:
        """How many times `query` was asked."""
        with self._lock:
            return sum(1 for _, params in self.requests if params.get("query") == [query])

    def close(self) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# -- answers ----------------------------------------------------------------------------------------------


def test_an_instant_vector_of_one_element_is_its_value(stub: StubPrometheus) -> None:
    stub.set("DCGM_FI_DEV_GPU_UTIL", vector("10", metric={"__name__": "DCGM_FI_DEV_GPU_UTIL", "UUID": "GPU-1",
                                                          "gpu": "1", "Hostname": "node-a", "pod": "svc-1"}))
    client = PrometheusClient(stub.url, wall_clock=lambda: 1795937014.5)
    assert client.sample("DCGM_FI_DEV_GPU_UTIL") == Sample(10.0, TS)
    path, params = stub.requests[-1]
    assert path == "/api/v1/query"
    assert params["query"] == ["DCGM_FI_DEV_GPU_UTIL"]
    # `time` is RFC 3339 UTC, as KEDA sends it; Prometheus' own evaluation timeout is the client's
    assert params["time"] == ["2026-11-29T07:23:34.500Z"]
    assert datetime.fromisoformat(params["time"][0]).timestamp() == 1795937014.5
    assert params["timeout"] == ["2.000"]


def test_an_aggregation_is_its_value(stub: StubPrometheus) -> None:
    stub.set("avg(DCGM_FI_DEV_GPU_UTIL)", vector("41.5"))
    assert PrometheusClient(stub.url).query("avg(DCGM_FI_DEV_GPU_UTIL)") == 41.5


def test_a_scalar_result_is_accepted_unlike_keda(stub: StubPrometheus) -> None:
    stub.set("scalar(sum(up))", scalar("40001"))
    assert PrometheusClient(stub.url).query("scalar(sum(up))") == 40001.0


def test_an_empty_result_is_an_error_never_zero(stub: StubPrometheus) -> None:
    stub.set("avg(DCGM_FI_DEV_GPU_UTIL)", EMPTY)
    with pytest.raises(PrometheusError, match="no data: exporter down or query matches nothing") as caught:
        PrometheusClient(stub.url).query("avg(DCGM_FI_DEV_GPU_UTIL)")
    assert "avg(DCGM_FI_DEV_GPU_UTIL)" in str(caught.value)
    assert isinstance(caught.value, GpuplaneError)


def test_more_than_one_element_is_an_error(stub: StubPrometheus) -> None:
    stub.set("DCGM_FI_DEV_GPU_UTIL", vector("10", "90"))
    with pytest.raises(PrometheusError, match=r"returned 2 elements, not one; aggregate it"):
        PrometheusClient(stub.url).query("DCGM_FI_DEV_GPU_UTIL")


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_value_is_an_error(stub: StubPrometheus, value: str) -> None:
    stub.set("q", vector(value))
    with pytest.raises(PrometheusError, match=f"returned {value.replace('+', '[+]')}, not a finite number"):
        PrometheusClient(stub.url).query("q")


def test_a_non_finite_scalar_is_an_error(stub: StubPrometheus) -> None:
    stub.set("scalar(x)", scalar("NaN"))
    with pytest.raises(PrometheusError, match="not a finite number"):
        PrometheusClient(stub.url).query("scalar(x)")


def test_invalid_promql_is_an_error_with_prometheus_message(stub: StubPrometheus) -> None:
    stub.set("avg(DCGM_FI_DEV_GPU_UTIL", BAD_PROMQL)
    with pytest.raises(PrometheusError) as caught:
        PrometheusClient(stub.url).query("avg(DCGM_FI_DEV_GPU_UTIL")
    message = str(caught.value)
    assert "'avg(DCGM_FI_DEV_GPU_UTIL'" in message
    assert "HTTP 400: bad_data: invalid parameter \"query\": 1:6: parse error: unclosed left parenthesis" in message


def test_an_execution_error_names_its_type(stub: StubPrometheus) -> None:
    stub.set("q", error(422, "execution", "query processing would load too many samples into memory"))
    with pytest.raises(PrometheusError, match="HTTP 422: execution: query processing would load too many"):
        PrometheusClient(stub.url).query("q")


def test_a_non_json_error_body_is_quoted(stub: StubPrometheus) -> None:
    stub.set("q", Answer(502, b"Bad Gateway\n"))
    with pytest.raises(PrometheusError, match="query 'q' failed: HTTP 502: Bad Gateway"):
        PrometheusClient(stub.url).query("q")


@pytest.mark.parametrize(("answer", "message"), [
    (Answer(200, _ok("matrix", [{"metric": {}, "values": [[TS, "39"]]}])), "returned a matrix result"),
    (Answer(200, _ok("string", [TS, "x"])), "returned a string result"),
    (Answer(200, b"<html>not prometheus</html>"), "not a JSON object"),
    (Answer(200, _ok("vector", [{"metric": {}, "value": [TS, 41]}])), "malformed sample"),
    (Answer(200, _ok("vector", [{"metric": {}, "value": [TS, "forty"]}])), "'forty' is not a number"),
    (Answer(200, _ok("vector", [{"metric": {}}])), "malformed sample None"),
    (Answer(200, json.dumps({"status": "error", "errorType": "timeout", "error": "took too long"}).encode()),
     "failed: timeout: took too long"),
])
def test_malformed_or_unsupported_answers_are_errors(stub: StubPrometheus, answer: Answer, message: str) -> None:
    stub.set("q", answer)
    with pytest.raises(PrometheusError, match=message):
        PrometheusClient(stub.url).query("q")


# -- vector reads -----------------------------------------------------------------------------------------


def _element(value: str, **labels: str) -> dict[str, object]:
    return {"metric": labels, "value": [TS, value]}


VECTOR_CASES = [
    # (case, the elements Prometheus sends, the series read)
    ("one element per series, labels kept",
     [_element("45", namespace="ml", pod="a"), _element("20.5", namespace="dev", pod="b")],
     [Series({"namespace": "ml", "pod": "a"}, 45.0, TS), Series({"namespace": "dev", "pod": "b"}, 20.5, TS)]),
    ("an empty vector is no series, not an error", [], []),
    ("an element without labels (an aggregation without by)", [_element("7")], [Series({}, 7.0, TS)]),
    ("an integer timestamp", [{"metric": {}, "value": [1795937014, "1"]}], [Series({}, 1.0, 1795937014.0)]),
]


@pytest.mark.parametrize(("case", "elements", "expected"), VECTOR_CASES, ids=[c for c, _, _ in VECTOR_CASES])
def test_a_vector_read_is_every_element_with_its_labels(stub: StubPrometheus, case: str, elements: list[object],
                                                        expected: list[Series]) -> None:
    stub.set("avg by (pod) (x)", Answer(200, _ok("vector", elements)))
    assert PrometheusClient(stub.url).vector("avg by (pod) (x)") == expected
    [(path, params)] = stub.requests
    assert path == "/api/v1/query" and params["query"] == ["avg by (pod) (x)"]


@pytest.mark.parametrize(("value", "check"), [("NaN", math.isnan), ("+Inf", lambda v: v == math.inf),
                                              ("-Inf", lambda v: v == -math.inf)])
def test_a_vector_read_keeps_non_finite_values_as_prometheus_wrote_them(
        stub: StubPrometheus, value: str, check: Callable[[float], bool]) -> None:
    stub.set("q", Answer(200, _ok("vector", [_element(value, pod="a")])))
    [series] = PrometheusClient(stub.url).vector("q")
    assert series.labels == {"pod": "a"} and check(series.value)


@pytest.mark.parametrize(("answer", "message"), [
    (BAD_PROMQL, "query 'q' failed: HTTP 400: bad_data: invalid parameter"),
    (error(422, "execution", "found duplicate series for the match group"),
     "query 'q' failed: HTTP 422: execution: found duplicate series"),
    (error(503, "timeout", "query timed out in expression evaluation"),
     "query 'q' failed: HTTP 503: timeout: query timed out"),
    (Answer(200, json.dumps({"status": "error", "errorType": "canceled", "error": "stopped"}).encode()),
     "query 'q' failed: canceled: stopped"),
    (scalar("1"), "query 'q' returned a scalar result, not an instant vector"),
    (Answer(200, _ok("matrix", [{"metric": {}, "values": [[TS, "39"]]}])), "returned a matrix result"),
    (Answer(200, _ok("vector", {"metric": {}})), "the vector result is not a list"),
    (Answer(200, _ok("vector", ["x"])), "the vector element 'x' is not an object"),
    (Answer(200, _ok("vector", [{"metric": {"pod": 1}, "value": [TS, "1"]}])), "malformed labels"),
    (Answer(200, _ok("vector", [{"metric": {}, "histogram": [TS, {"count": "1", "sum": "2"}]}])),
     "is a native histogram, not a float sample"),
    (Answer(200, _ok("vector", [_element("forty")])), "'forty' is not a number"),
    (Answer(200, _ok("vector", [{"metric": {}, "value": [TS, 41]}])), "malformed sample"),
])
def test_a_vector_read_error_names_the_query(stub: StubPrometheus, answer: Answer, message: str) -> None:
    stub.set("q", answer)
    with pytest.raises(PrometheusError, match=message):
        PrometheusClient(stub.url).vector("q")


def test_a_path_prefix_is_kept(stub: StubPrometheus) -> None:
    stub.set("q", vector("3"))
    assert PrometheusClient(stub.url + "/prometheus/").query("q") == 3.0
    assert stub.requests[-1][0] == "/prometheus/api/v1/query"


# -- failures to reach it ------------------------------------------------------------------------------------


def test_a_slow_answer_times_out(stub: StubPrometheus) -> None:
    stub.set("q", Answer(200, _ok("vector", [{"metric": {}, "value": [TS, "1"]}]), delay_s=5.0))
    client = PrometheusClient(stub.url, timeout_s=5.0)
    started = time.monotonic()
    with pytest.raises(PrometheusError, match=r"Prometheus at http://127\.0\.0\.1:\d+ unreachable: no answer to "
                                              r"query 'q' within 0\.3 s"):
        client.query("q", timeout_s=0.3)
    assert time.monotonic() - started < 2.0


def test_the_timeout_bounds_the_whole_answer_not_each_read(stub: StubPrometheus) -> None:
    # every byte arrives well within the timeout, the whole body does not
    stub.set("q", Answer(200, _ok("vector", [{"metric": {}, "value": [TS, "1"]}]), drip_s=0.05))
    started = time.monotonic()
    with pytest.raises(PrometheusError, match=r"within 0\.5 s"):
        PrometheusClient(stub.url, timeout_s=0.5).query("q")
    assert time.monotonic() - started < 2.0


def test_a_closed_port_is_unreachable() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(PrometheusError, match=f"Prometheus at {url} unreachable: .*Connection refused"):
        PrometheusClient(url).query("q")


@pytest.mark.parametrize("url", ["prometheus:9090", "ftp://prometheus", "http://", "http://host:99999"])
def test_a_bad_url_is_refused(url: str) -> None:
    with pytest.raises(PrometheusError, match="Prometheus URL"):
        PrometheusClient(url)
