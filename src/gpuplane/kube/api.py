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


class KubeConfigError(GpuplaneError):
    """No usable way to reach an API server (not in a cluster, and no readable kubeconfig)."""


def _status_error(status: int, raw: bytes, fallback_reason: str = "") -> ApiError:
    """An `ApiError` from a non-2xx answer; the body is a Status when the API server wrote it."""
    body: dict[str, Any] = {}
    try:
        parsed = json.loads(raw) if raw else {}
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
                event = json.loads(line)
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
        self.client.close()  # type: ignore[no-untyped-call]

    # -- transport ---------------------------------------------------------------------------------------------

    def _call(self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (), body: Any = None,
              content_type: str | None = None, read_timeout_s: float | None = None) -> Any:
        """The unread urllib3 response of a 2xx answer; `ApiError` otherwise."""
        if method != "GET":
            return self._send(method, path, body, content_type)
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

    def _send(self, method: str, path: str, body: Any, content_type: str | None) -> Any:
        """A write, straight to the client's own urllib3 pool manager (its TLS, proxy and retry settings), with
        the headers `param_serialize` would build (the client's default headers and cookie, the bearer token as
        `update_params_for_auth` gives it, refresh hook included) and the body encoded once here: what
        `call_api` sends for a JSON body, without its per-request serialisation passes (about half of a bind
        lane's CPU per request, profiled under `gpuplane bench kube`). Reads keep the official path (the
        client's read retries apply to them)."""
        client = self.client
        headers = {"Accept": "application/json", **client.default_headers}
        if client.cookie:
            headers["Cookie"] = client.cookie
        client.update_params_for_auth(headers, None, ["BearerToken"], path, method, None)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
            data = json.dumps(body, separators=(",", ":")).encode()
        timeout = urllib3.Timeout(connect=self.request_timeout_s, read=self.request_timeout_s)
        manager = client.rest_client.pool_manager
        host = client.configuration.host
        try:
            if type(manager) is urllib3.PoolManager and _PLAIN_PATH.fullmatch(path):
                # No proxy, nothing to percent-encode: straight to the host's pool, where `urlopen` would go.
                if self._origin[0] != host:
                    url = urllib3.util.parse_url(host)
                    self._origin = (host, url.scheme or "http", url.host or "", url.port, url.path or "")
                _, scheme, hostname, port, base = self._origin
                pool = manager.connection_from_host(hostname, port, scheme)
                response = pool.urlopen(method, base + path, body=data, headers=headers, timeout=timeout,
                                        preload_content=False, assert_same_host=False, redirect=False)
            else:
                response = manager.request(method, host + path, body=data, headers=headers, timeout=timeout,
                                           preload_content=False)
        except Exception as exc:  # urllib3 errors (refused, reset, timed out, TLS)
            raise _transport_error(exc) from exc
        return _checked(response, response.status, response.reason)

    def _json(self, method: str, path: str, **kwargs: Any) -> JsonObject:
        response = self._call(method, path, **kwargs)
        try:
            raw = response.read()
        except Exception as exc:
            raise _transport_error(exc) from exc
        finally:
            response.release_conn()
        if not raw:
            return {}
        parsed = json.loads(raw)
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
