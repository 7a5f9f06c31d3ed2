"""A small Prometheus HTTP API client: one instant query, one number, or an error that says why.

It reads results as KEDA's Prometheus scaler does (`GET /api/v1/query?query=…&time=…`, exactly one element,
`result[0].value[1]` parsed as a float), but it never turns a missing reading into a number:

- a non-2xx answer (400 `bad_data` for invalid PromQL, 422 execution errors, 503 timeouts) is an error
  naming the query and Prometheus' own message;
- a refused connection, a timeout (the whole request and response, `timeout_s`) or a malformed body is an
  error naming the server;
- an empty result is an error ("no data: exporter down or query matches nothing"), never 0: a dead exporter's
  series go stale within seconds, and reading that as 0 is how a service gets scaled to zero (KEDA's
  `ignoreNullValues` defaults to true);
- more than one element, a range vector, a string, NaN or ±Inf are errors.

More lenient than KEDA in one respect: a `scalar` result (`"result": [ts, "v"]`, e.g. from `scalar(...)`)
is accepted, where KEDA's decoder expects a list of `{metric, value}` objects and fails.

`vector` reads a whole instant vector, every element with its labels (`{"metric": {...}, "value": [ts, "v"]}`,
the HTTP API's `resultType: "vector"`): one query for many series, such as one reading per pod. Its errors are the
same (HTTP 400/422/503 and `status: "error"` with Prometheus' `errorType` and `error`, a malformed body); an empty
vector is an answer (no series), not an error; values are read as the API writes them, `"NaN"`, `"+Inf"` and
`"-Inf"` included, for the caller to judge; a scalar, a matrix, a string or a native-histogram element is an error.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlencode, urlsplit

from gpuplane.model import GpuplaneError

MAX_BODY_BYTES = 16 * 1024 * 1024
"""A larger answer is an error: one element of an instant vector is a few hundred bytes."""


class PrometheusError(GpuplaneError):
    """A query that produced no usable number; the message says which query and why."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One instant-query answer: the value and the evaluation timestamp Prometheus reported."""

    value: float
    timestamp: float


@dataclass(frozen=True, slots=True)
class Series:
    """One element of an instant vector: its labels, its value (NaN and ±Inf as Prometheus wrote them) and the
    evaluation timestamp."""

    labels: Mapping[str, str]
    value: float
    timestamp: float


class PrometheusClient:
    """Instant queries against one Prometheus (`url`: scheme, host, port and an optional path prefix).

    `wall_clock` gives the `time` parameter (seconds since the epoch; sent as RFC 3339 UTC, as KEDA does).
    Safe to share between threads: every query opens its own connection. `timeout_s` bounds connecting,
    sending and receiving together; resolving a host name is left to the system resolver's own timeouts."""

    def __init__(self, url: str, *, timeout_s: float = 2.0, wall_clock: Callable[[], float] = time.time) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PrometheusError(f"Prometheus URL {url!r}: give http(s)://host[:port][/prefix]")
        if timeout_s <= 0:
            raise PrometheusError(f"timeout_s must be positive, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._wall_clock = wall_clock
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        try:
            self._port = parts.port or (443 if self._https else 80)
        except ValueError as exc:
            raise PrometheusError(f"Prometheus URL {url!r}: {exc}") from None
        self._prefix = parts.path.rstrip("/")

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        """The value of `query` now; raises `PrometheusError` for anything but exactly one finite number."""
        return self.sample(query, timeout_s=timeout_s).value

    def sample(self, query: str, *, timeout_s: float | None = None) -> Sample:
        """Like `query`, with the evaluation timestamp."""
        return _parse(query, *self._instant(query, timeout_s))

    def vector(self, query: str, *, timeout_s: float | None = None) -> list[Series]:
        """Every element of the instant vector `query` evaluates to now (none: an empty list); raises
        `PrometheusError` naming the query for an error answer or any result but a vector."""
        return _parse_vector(query, *self._instant(query, timeout_s))

    def _instant(self, query: str, timeout_s: float | None) -> tuple[int, bytes]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        at = datetime.fromtimestamp(self._wall_clock(), UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        # Prometheus' own `timeout` bounds the evaluation; ours bounds the whole exchange.
        params = urlencode({"query": query, "time": at, "timeout": f"{timeout:.3f}"})
        return self._get(f"{self._prefix}/api/v1/query?{params}", timeout, query)

    # -- HTTP -------------------------------------------------------------------------------------------

    def _get(self, target: str, timeout_s: float, query: str) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout_s
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            conn.request("GET", target, headers={"Accept": "application/json"})
            sock = conn.sock  # the response keeps reading from it after the connection lets go of it
            _tighten(sock, deadline)
            response = conn.getresponse()
            chunks: list[bytes] = []
            size = 0
            while True:
                _tighten(sock, deadline)
                chunk = response.read1(64 * 1024)  # one receive at most: the deadline is checked between them
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise PrometheusError(f"Prometheus at {self.url}: answer to query {query!r} is larger than "
                                          f"{MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
            return response.status, b"".join(chunks)
        except TimeoutError:  # socket.timeout is its alias
            raise PrometheusError(f"Prometheus at {self.url} unreachable: no answer to query {query!r} within "
                                  f"{timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise PrometheusError(f"Prometheus at {self.url} unreachable: {_describe(exc)}") from None
        finally:
            conn.close()


def _tighten(sock: socket.socket | None, deadline: float) -> None:
    """Bound the next socket operation by what is left of the whole request's time."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if sock is not None:
        sock.settimeout(left)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{text} ({type(exc).__name__})" if text else type(exc).__name__


# -- the answer -------------------------------------------------------------------------------------------


def _payload(query: str, status: int, body: bytes) -> tuple[object, object]:
    """The `(resultType, result)` of a successful answer; an error answer or a malformed body raises."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        data = None
    if not 200 <= status < 300:
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            kind = data.get("errorType")
            message = f"{kind}: {data['error']}" if isinstance(kind, str) and kind else data["error"]
        else:
            message = body[:300].decode("utf-8", "replace").strip() or "no body"
        raise PrometheusError(f"query {query!r} failed: HTTP {status}: {message}")
    if not isinstance(data, dict):
        raise PrometheusError(f"query {query!r}: the answer is not a JSON object")
    if data.get("status") != "success":
        raise PrometheusError(f"query {query!r} failed: {data.get('errorType', 'error')}: {data.get('error')}")
    payload = data.get("data")
    if not isinstance(payload, dict):
        raise PrometheusError(f"query {query!r}: the answer has no data object")
    return payload.get("resultType"), payload.get("result")


def _parse(query: str, status: int, body: bytes) -> Sample:
    kind, result = _payload(query, status, body)
    if kind == "scalar":
        return _pair(query, result)
    if kind != "vector":
        raise PrometheusError(f"query {query!r} returned a {kind} result; give an instant vector of one element "
                              "(e.g. sum(...)) or a scalar")
    if not isinstance(result, list):
        raise PrometheusError(f"query {query!r}: the vector result is not a list")
    if not result:
        raise PrometheusError(f"query {query!r}: no data: exporter down or query matches nothing")
    if len(result) > 1:
        raise PrometheusError(f"query {query!r} returned {len(result)} elements, not one; aggregate it "
                              "(e.g. sum(...) or avg(...))")
    element = result[0]
    if not isinstance(element, dict):
        raise PrometheusError(f"query {query!r}: the vector element is not an object")
    return _pair(query, element.get("value"))


def _parse_vector(query: str, status: int, body: bytes) -> list[Series]:
    kind, result = _payload(query, status, body)
    if kind != "vector":
        raise PrometheusError(f"query {query!r} returned a {kind} result, not an instant vector")
    if not isinstance(result, list):
        raise PrometheusError(f"query {query!r}: the vector result is not a list")
    series: list[Series] = []
    for element in result:
        if not isinstance(element, dict):
            raise PrometheusError(f"query {query!r}: the vector element {element!r} is not an object")
        labels = element.get("metric", {})
        if not (isinstance(labels, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in labels.items())):
            raise PrometheusError(f"query {query!r}: malformed labels {labels!r}, expected {{\"name\": \"value\"}}")
        if "value" not in element and "histogram" in element:
            raise PrometheusError(f"query {query!r}: the series {labels} is a native histogram, not a float sample")
        timestamp, value = _timestamped(query, element.get("value"))
        series.append(Series(labels, value, timestamp))
    return series


def _timestamped(query: str, pair: object) -> tuple[float, float]:
    """`[timestamp, "value"]` to (timestamp, value), NaN and ±Inf included."""
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int | float)
            and not isinstance(pair[0], bool) and isinstance(pair[1], str)):
        raise PrometheusError(f"query {query!r}: malformed sample {pair!r}, expected [timestamp, \"value\"]")
    try:
        return float(pair[0]), float(pair[1])
    except ValueError:
        raise PrometheusError(f"query {query!r}: sample value {pair[1]!r} is not a number") from None


def _pair(query: str, pair: object) -> Sample:
    """`[timestamp, "value"]` to a sample; non-finite values are errors."""
    timestamp, value = _timestamped(query, pair)
    if not math.isfinite(value):
        raise PrometheusError(f"query {query!r} returned {pair[1] if isinstance(pair, list) else value}, "
                              "not a finite number")
    return Sample(value, timestamp)
