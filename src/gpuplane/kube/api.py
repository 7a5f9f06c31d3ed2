"""The Kubernetes API as gpuplane uses it: a small REST interface over raw JSON objects.

Everything in `gpuplane.kube` (the cluster port, the extender's bind, the operator's Lease and custom
resources) and the node agent's device plugin talk to the API server through `KubeApi`. Objects stay
plain dicts (the API's own JSON): `gpuplane.kube.objects` reads them into the model. The real
implementation rides on the official `kubernetes` client's transport (config loading, auth, TLS);
tests run it against a local HTTP server that answers with the real API's paths and status codes.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import orjson
import urllib3
from kubernetes import config as kube_config
from kubernetes.client import ApiClient, Configuration

from gpuplane.model import GpuplaneError

JsonObject = dict[str, Any]
PatchType = Literal["merge", "strategic", "json"]

PATCH_CONTENT_TYPES: Mapping[PatchType, str] = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
}


class ApiError(Exception):
    """A non-2xx answer from the API server: `status` (409, 410, 429, …), `reason` and the Status body."""

    def __init__(self, status: int, reason: str = "", message: str = "", body: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.body: Mapping[str, Any] = body or {}


@runtime_checkable
class KubeApi(Protocol):
    """Paths are API paths (`/api/v1/nodes`, `/api/v1/namespaces/ns/pods/p/binding`)."""

    def get(self, path: str) -> JsonObject: ...

    def list(self, path: str, *, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[JsonObject], str]:
        """All items (following `continue`), and the list's resourceVersion to watch from."""
        ...

    def watch(self, path: str, resource_version: str, *, timeout_s: int = 300,
              label_selector: str | None = None, field_selector: str | None = None) -> Iterator[tuple[str, JsonObject]]:
        """(type, object) pairs: ADDED, MODIFIED, DELETED, BOOKMARK. An expired resourceVersion raises
        `ApiError(410)` (as an HTTP answer or an ERROR event): relist and watch again."""
        ...

    def create(self, path: str, body: Mapping[str, Any]) -> JsonObject: ...

    def replace(self, path: str, body: Mapping[str, Any]) -> JsonObject: ...

    def patch(self, path: str, body: Any, *, patch_type: PatchType = "merge") -> JsonObject: ...

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> JsonObject: ...


def loads(raw: bytes | str) -> Any:
    """`json.loads` through orjson (a third of the CPU on a watch event or an answer).
    What orjson refuses (NaN, infinities, bad input) goes to `json`, so those answers and errors are json's.
    One difference: an integer past 64 bits is read as a float, as the API server's own decoder reads it
    (apimachinery's JSON numbers are int64, else float64), so no API server sends one."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(body: Any) -> bytes:
    """A request body as compact JSON (UTF-8) through orjson; what it cannot encode
    (keys that are not strings, integers past 64 bits, other types) is encoded by `json` as before. One
    difference: a NaN or infinite float, which no API server accepts, is written null rather than `NaN`."""
    try:
        encoded: bytes = orjson.dumps(body)
        return encoded
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(body, separators=(",", ":")).encode()


def pod_path(namespace: str, name: str = "", sub: str = "") -> str:
    path = f"/api/v1/namespaces/{namespace}/pods"
    if name:
        path += f"/{name}"
        if sub:
            path += f"/{sub}"
    return path


def node_path(name: str = "") -> str:
    return f"/api/v1/nodes/{name}" if name else "/api/v1/nodes"


PODS_ALL = "/api/v1/pods"


# ---------------------------------------------------------------------------------------------------------------
# The real implementation: the official client's transport, raw JSON.

DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_PAGE_SIZE = 500
_WATCH_READ_SLACK_S = 30.0
_PLAIN_PATH = re.compile(r"[A-Za-z0-9/._~:@!$&'()*+,;=%-]*")
"""A path urllib3 sends as it is (nothing in it to percent-encode)."""
_MAX_LINE = 65537
"""Longest status or header line read (http.client's limit)."""


class KubeConfigError(GpuplaneError):
    """No usable way to reach an API server (not in a cluster, and no readable kubeconfig)."""


def _status_error(status: int, raw: bytes, fallback_reason: str = "") -> ApiError:
    """An `ApiError` from a non-2xx answer; the body is a Status when the API server wrote it."""
    body: dict[str, Any] = {}
    try:
        parsed = loads(raw) if raw else {}
        if isinstance(parsed, dict):
            body = parsed
    except ValueError:
        body = {}
    message = str(body.get("message") or raw[:200].decode("utf-8", "replace"))
    return ApiError(status, str(body.get("reason") or fallback_reason), message, body)


def _checked(response: Any, status: int, reason: str | None) -> Any:
    """`response` for a 2xx answer; otherwise it is read and released, and the `ApiError` raised."""
    if 200 <= status <= 299:
        return response
    try:
        raw = response.read()
    except Exception:  # the status line is what matters
        raw = b""
    finally:
        response.release_conn()
    raise _status_error(status, raw, str(reason or ""))


def _transport_error(exc: Exception) -> ApiError:
    """A request that got no HTTP answer (refused, reset, timed out): status 0, reason `ConnectionError`."""
    return ApiError(0, "ConnectionError", f"{type(exc).__name__}: {exc}")


class WatchStream:
    """The (type, object) events of one watch request; `close()` ends it from any thread.

    Iteration ends when the server ends the stream (its `timeoutSeconds`) or after `close()`. An ERROR event
    or a broken connection raises `ApiError` (410 for an expired resourceVersion, 0 for the transport).
    """

    def __init__(self, response: Any) -> None:
        self._response = response
        self._lines: Iterator[bytes] = iter(response)
        self._closed = False

    def __iter__(self) -> WatchStream:
        return self

    def __next__(self) -> tuple[str, JsonObject]:
        while True:
            if self._closed:
                raise StopIteration
            try:
                line = next(self._lines)
            except StopIteration:
                self.close()
                raise
            except Exception as exc:  # urllib3 ProtocolError / ReadTimeoutError / OSError mid-stream
                if self._closed:
                    raise StopIteration from None
                self.close()
                raise _transport_error(exc) from exc
            line = line.strip()
            if not line:
                continue
            try:
                event = loads(line)
            except ValueError as exc:
                self.close()
                raise ApiError(0, "BadWatchEvent", f"undecodable watch line: {line[:200]!r}") from exc
            kind = str(event.get("type", ""))
            obj = event.get("object") or {}
            if kind == "ERROR":
                self.close()
                code = int(obj.get("code") or 500)
                raise ApiError(code, str(obj.get("reason") or ""), str(obj.get("message") or ""), obj)
            return kind, obj

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Shut the socket down first: a plain close() does not wake a read blocked in another thread.
        sock = getattr(getattr(self._response, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):  # closing a dead connection may fail in many ways
            self._response.close()
            self._response.release_conn()


class _Unanswered(ConnectionError):
    """The connection failed or was closed before any byte of an answer."""


class _Wire:
    """One keep-alive HTTP/1.1 connection of the write path: the socket urllib3 connected (TCP_NODELAY and TLS
    as the client's pool sets them up) and a buffered reader. One request at a time; the answer is read whole,
    by its Content-Length or chunked, so the next request starts clean.

    The answer is read here rather than by a library because the libraries measured cost two to three times the
    client CPU per write, and the write path is gpuplane-scheduler's limit (`python3 scripts/bench-wire.py`,
    1,000 merge PATCHes against the local API server, median of 5, 2026-12-02: this reader 0.066-0.093 ms,
    `http.client.HTTPResponse` 0.146 ms, httptools 0.19 ms). Only what an API server sends is read: a status
    line, headers, then a Content-Length, chunked or to-the-end body; 1xx answers are skipped."""

    __slots__ = ("conn", "origin", "reader", "sock")

    def __init__(self, conn: Any, sock: socket.socket, origin: tuple[str, str, str, int | None, str]) -> None:
        self.conn = conn
        self.sock = sock
        self.origin = origin
        """The configuration's host it was connected for."""
        self.reader = sock.makefile("rb")

    def usable(self) -> bool:
        """Not closed by the server while idle (nothing to read on an idle connection but its end)."""
        try:
            return not urllib3.util.wait.wait_for_read(self.sock, timeout=0.0)
        except (OSError, ValueError):
            return False

    def exchange(self, request: bytes) -> tuple[int, str, bytes, bool]:
        """Send `request`; (status, reason, body, whether the connection can be kept) of its answer."""
        try:
            self.sock.sendall(request)
        except OSError as exc:  # reset or closed: nothing was answered
            raise _Unanswered(f"the connection failed while sending: {exc}") from exc
        reader = self.reader
        while True:
            line = reader.readline(_MAX_LINE)
            if not line:
                raise _Unanswered("the server closed the connection without an answer")
            version, _, rest = line.decode("latin-1").rstrip("\r\n").partition(" ")
            code, _, reason = rest.partition(" ")
            status = int(code)
            length: int | None = None
            chunked = False
            close = version == "HTTP/1.0"
            while True:
                header = reader.readline(_MAX_LINE)
                if header in (b"\r\n", b"\n"):
                    break
                if not header:
                    raise ConnectionError("the answer's headers ended early")
                name, _, value = header.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    close = b"close" in value.lower() or (close and b"keep-alive" not in value.lower())
            if status >= 200:
                break  # 1xx (100 Continue, 103 Early Hints) are followed by the real answer
        if status in (204, 304):
            body = b""
        elif chunked:
            body = self._chunks()
        elif length is not None:
            body = reader.read(length)
            if len(body) < length:
                raise ConnectionError(f"the answer ended after {len(body)} of {length} bytes")
        else:
            body = reader.read()  # the body runs to the end of the connection
            close = True
        return status, reason, body, not close

    def _chunks(self) -> bytes:
        reader = self.reader
        parts: list[bytes] = []
        while True:
            size = int(reader.readline(_MAX_LINE).split(b";", 1)[0].strip() or b"x", 16)
            if size == 0:
                while reader.readline(_MAX_LINE) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            chunk = reader.read(size + 2)
            if len(chunk) < size + 2:
                raise ConnectionError("the answer ended inside a chunk")
            parts.append(chunk[:size])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.reader.close()
        with contextlib.suppress(Exception):
            self.conn.close()


def _host_header(scheme: str, hostname: str, port: int | None) -> str:
    """The Host header http.client writes: the port only when it is not the scheme's default; IPv6 bracketed."""
    name = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") else hostname
    default = 443 if scheme == "https" else 80
    return name if port is None or port == default else f"{name}:{port}"


class RestKubeApi:
    """`KubeApi` over the official client's `ApiClient` (config, auth, TLS, connection pool).

    Requests go through `ApiClient.param_serialize` + `call_api`, whose answers are unread urllib3 responses;
    bodies are parsed here, so objects stay dicts and large lists are never turned into models. A request
    that gets no HTTP answer raises `ApiError(0, "ConnectionError")`.
    """

    def __init__(self, client: ApiClient, *, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 page_size: int = DEFAULT_PAGE_SIZE) -> None:
        self.client = client
        self.request_timeout_s = request_timeout_s
        self.page_size = page_size
        self._origin: tuple[str, str, str, int | None, str] = ("", "", "", None, "")
        """The configuration's host, and its scheme, name, port and path as urllib3 parses them."""
        self._wires: list[_Wire] = []
        """The write path's idle keep-alive connections (taken and given back whole: list pop and append)."""

    @classmethod
    def from_url(cls, url: str, *, token: str | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 page_size: int = DEFAULT_PAGE_SIZE) -> RestKubeApi:
        """A client for `url` (e.g. `http://127.0.0.1:8080`), with an optional bearer token."""
        configuration = Configuration(host=url.rstrip("/"))
        if token:
            configuration.api_key["BearerToken"] = f"Bearer {token}"
        return cls(ApiClient(configuration), request_timeout_s=request_timeout_s, page_size=page_size)

    @classmethod
    def from_configuration(cls, configuration: Configuration, **kwargs: Any) -> RestKubeApi:
        return cls(ApiClient(configuration), **kwargs)

    def close(self) -> None:
        while self._wires:
            self._wires.pop().close()
        self.client.close()  # type: ignore[no-untyped-call]

    # -- transport ---------------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (),
              read_timeout_s: float | None = None) -> Any:
        """The unread urllib3 response of a 2xx answer to a read; `ApiError` otherwise."""
        headers = {"Accept": "application/json"}
        method, url, headers, _, _ = self.client.param_serialize(
            method, path, query_params=list(query), header_params=headers, auth_settings=["BearerToken"])
        timeout = (self.request_timeout_s, read_timeout_s or self.request_timeout_s)
        try:
            answer = self.client.call_api(method, url, headers, None, None, _request_timeout=timeout)
        except ApiError:
            raise
        except Exception as exc:  # urllib3 errors and the client's ApiException(status=0) for TLS
            raise _transport_error(exc) from exc
        return _checked(answer.response, answer.status, answer.reason)

    def _send(self, method: str, path: str, body: Any, content_type: str | None) -> bytes:
        """A write: the body of its 2xx answer, `ApiError` otherwise.

        Sent with the headers `param_serialize` would build (the client's default headers and cookie, the bearer
        token as `update_params_for_auth` gives it, refresh hook included) and the body encoded once here. With
        no proxy and nothing in the path to percent-encode, it goes over one of this client's own keep-alive
        connections (`_Wire`: the socket the client's urllib3 pool connects, its TLS settings included; the
        request written and the answer read directly), which costs a fifth of the client CPU of urllib3's
        request path (`gpuplane bench kube`'s bind lanes make three writes a pod). Otherwise, or when a new
        connection cannot be made (urllib3 then retries as configured), urllib3's pool sends it. Reads keep the
        official path (the client's read retries apply to them)."""
        client = self.client
        headers = {"Accept": "application/json", **client.default_headers}
        if client.cookie:
            headers["Cookie"] = client.cookie
        client.update_params_for_auth(headers, None, ["BearerToken"], path, method, None)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            data = dumps(body)
        manager = client.rest_client.pool_manager
        host = client.configuration.host
        plain = type(manager) is urllib3.PoolManager and _PLAIN_PATH.fullmatch(path) is not None
        if plain:
            if self._origin[0] != host:  # the first write, or the configuration names another server now
                url = urllib3.util.parse_url(host)
                self._origin = (host, url.scheme or "http", url.host or "", url.port, url.path or "")
            answer = self._over_wire(manager, method, self._origin[4] + path, data, headers)
            if answer is not None:
                status, reason, raw = answer
                if 200 <= status <= 299:
                    return raw
                raise _status_error(status, raw, reason)
        timeout = urllib3.Timeout(connect=self.request_timeout_s, read=self.request_timeout_s)
        try:
            if plain:  # no proxy: straight to the host's pool, where `urlopen` would go
                _, scheme, hostname, port, base = self._origin
                pool = manager.connection_from_host(hostname, port, scheme)
                response = pool.urlopen(method, base + path, body=data, headers=headers, timeout=timeout,
                                        preload_content=False, assert_same_host=False, redirect=False)
            else:
                response = manager.request(method, host + path, body=data, headers=headers, timeout=timeout,
                                           preload_content=False)
        except Exception as exc:  # urllib3 errors (refused, reset, timed out, TLS)
            raise _transport_error(exc) from exc
        response = _checked(response, response.status, response.reason)
        try:
            raw = response.read()
        except Exception as exc:
            raise _transport_error(exc) from exc
        finally:
            response.release_conn()
        return bytes(raw)

    def _over_wire(self, manager: urllib3.PoolManager, method: str, target: str, data: bytes | None,
                   headers: Mapping[str, str]) -> tuple[int, str, bytes] | None:
        """(status, reason, body) of one request over an idle `_Wire` (or a new one); None when no connection
        could be made (the caller falls back to urllib3's pool, whose retries apply). A request that was sent
        and got no whole answer is `ApiError(0)`, as urllib3 reports it for a write; PUT and DELETE (idempotent)
        are sent once more on a new connection when a kept-alive one turns out closed before any answer."""
        _, scheme, hostname, port, _ = self._origin
        lines = [f"{method} {target} HTTP/1.1", f"Host: {_host_header(scheme, hostname, port)}",
                 "Accept-Encoding: identity", *(f"{k}: {v}" for k, v in headers.items())]
        if data is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(data) if data is not None else 0}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (data or b"")
        for attempt in range(2):
            wire = self._idle_wire()
            reused = wire is not None
            if wire is None:
                wire = self._new_wire(manager)
                if wire is None:
                    return None
            try:
                status, reason, raw, keep = wire.exchange(request)
            except _Unanswered as exc:
                wire.close()
                if reused and attempt == 0 and method in ("PUT", "DELETE"):
                    continue
                raise _transport_error(exc) from exc
            except Exception as exc:  # reset, timed out, a malformed answer
                wire.close()
                raise _transport_error(exc) from exc
            if keep:
                self._wires.append(wire)
            else:
                wire.close()
            return status, reason, raw
        raise AssertionError("unreachable")  # pragma: no cover

    def _idle_wire(self) -> _Wire | None:
        """A kept-alive connection to the server the configuration names now, which the server has not closed
        meanwhile (urllib3's own check before reuse)."""
        while True:
            try:
                wire = self._wires.pop()
            except IndexError:
                return None
            if wire.origin == self._origin and wire.usable():
                return wire
            wire.close()

    def _new_wire(self, manager: urllib3.PoolManager) -> _Wire | None:
        _, scheme, hostname, port, _ = self._origin
        try:
            conn: Any = manager.connection_from_host(hostname, port, scheme)._new_conn()
            conn.timeout = self.request_timeout_s
            conn.connect()
            sock = conn.sock
            if sock is None:
                conn.close()
                return None
            sock.settimeout(self.request_timeout_s)
            return _Wire(conn, sock, self._origin)
        except Exception:  # refused, TLS, …: urllib3's own path retries and reports it
            return None

    def _json(self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (), body: Any = None,
              content_type: str | None = None) -> JsonObject:
        if method != "GET":
            raw = self._send(method, path, body, content_type)
        else:
            response = self._call(method, path, query=query)
            try:
                raw = response.read()
            except Exception as exc:
                raise _transport_error(exc) from exc
            finally:
                response.release_conn()
        if not raw:
            return {}
        parsed = loads(raw)
        return parsed if isinstance(parsed, dict) else {"items": parsed}

    # -- KubeApi -----------------------------------------------------------------------------------------------

    def get(self, path: str) -> JsonObject:
        return self._json("GET", path)

    def list(self, path: str, *, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[JsonObject], str]:
        items: list[JsonObject] = []
        token = ""
        while True:
            query = _selectors(label_selector, field_selector)
            query.append(("limit", str(self.page_size)))
            if token:
                query.append(("continue", token))
            page = self._json("GET", path, query=query)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def watch(self, path: str, resource_version: str, *, timeout_s: int = 300,
              label_selector: str | None = None, field_selector: str | None = None) -> WatchStream:
        query = [("watch", "1"), ("allowWatchBookmarks", "true"), ("timeoutSeconds", str(timeout_s))]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        query.extend(_selectors(label_selector, field_selector))
        response = self._call("GET", path, query=query, read_timeout_s=timeout_s + _WATCH_READ_SLACK_S)
        return WatchStream(response)

    def create(self, path: str, body: Mapping[str, Any]) -> JsonObject:
        return self._json("POST", path, body=dict(body))

    def replace(self, path: str, body: Mapping[str, Any]) -> JsonObject:
        return self._json("PUT", path, body=dict(body))

    def patch(self, path: str, body: Any, *, patch_type: PatchType = "merge") -> JsonObject:
        if patch_type == "json" and not isinstance(body, list):
            raise TypeError("a JSON patch is a list of operations")  # the client would send it as strategic merge
        return self._json("PATCH", path, body=body, content_type=PATCH_CONTENT_TYPES[patch_type])

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> JsonObject:
        return self._json("DELETE", path, body=None if body is None else dict(body))


def _selectors(label_selector: str | None, field_selector: str | None) -> list[tuple[str, str]]:
    query: list[tuple[str, str]] = []
    if label_selector:
        query.append(("labelSelector", label_selector))
    if field_selector:
        query.append(("fieldSelector", field_selector))
    return query


def connect_api(kubeconfig: str | None = None, context: str | None = None, **kwargs: Any) -> RestKubeApi:
    """In-cluster config when running in a pod (and no kubeconfig or context is named), else the kubeconfig file
    (`$KUBECONFIG` or `~/.kube/config`). Raises `KubeConfigError` when neither gives a usable configuration."""
    configuration = Configuration()
    if kubeconfig is None and context is None:
        try:
            kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            return RestKubeApi.from_configuration(configuration, **kwargs)
        except kube_config.ConfigException:
            configuration = Configuration()
    try:
        kube_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=configuration)
    except (kube_config.ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
        where = kubeconfig or "the default kubeconfig ($KUBECONFIG or ~/.kube/config)"
        raise KubeConfigError(f"kubeconfig {where}: not in a cluster and cannot load it: {exc}") from exc
    return RestKubeApi.from_configuration(configuration, **kwargs)


if TYPE_CHECKING:
    _: KubeApi = RestKubeApi(ApiClient())
