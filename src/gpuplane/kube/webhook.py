"""Admission safety: a validating admission webhook (`admission.k8s.io/v1` AdmissionReview) on `/validate`.

Rules:

- A pod CREATE carrying any of gpuplane's scheduler annotations (`SCHEDULER_ANNOTATIONS`: assignment,
  assigned-at, bind-phase, allocated-containers) is rejected: users must not forge their own card allocation.
- A pod UPDATE that adds, changes or removes one of them is rejected unless the requester is one of the
  scheduler's service accounts; the device plugin's accounts may change `bind-phase` and
  `allocated-containers` only.
- A pod CREATE that asks for gpuplane resources (`wants_gpu`) with a request that can never be valid is
  rejected, the message naming the field (`pod_request`).
- gpuplane's custom resources (`gpuplane.kube.crds`) are validated on CREATE and UPDATE, with the field path.

Everything else is allowed. A body that is not an AdmissionReview is answered HTTP 400 with a message.
Served over HTTPS (cert and key files) or, for tests, plain HTTP.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gpuplane.kube.crds import BY_KIND, GROUP, ResourceError, parse_resource
from gpuplane.kube.objects import (
    ALLOCATED_CONTAINERS,
    BIND_PHASE,
    SCHEDULER_ANNOTATIONS,
    ObjectError,
    annotations_of,
    pod_request,
    wants_gpu,
)
from gpuplane.model import Catalog, default_catalog

DEVICE_PLUGIN_ANNOTATIONS = frozenset({BIND_PHASE, ALLOCATED_CONTAINERS})
"""What the device plugin writes on a pod as it hands containers their cards."""

log = logging.getLogger(__name__)

REVIEW_API_VERSION = "admission.k8s.io/v1"
DEFAULT_SCHEDULER_ACCOUNT = "system:serviceaccount:gpuplane-system:gpuplane-scheduler"
DEFAULT_DEVICE_PLUGIN_ACCOUNT = "system:serviceaccount:gpuplane-system:gpuplane-node-agent"
MAX_BODY = 8 << 20


class ReviewError(ValueError):
    """A body that is not a well-formed AdmissionReview (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    message: str = ""


ALLOW = Verdict(True)


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """Who may write gpuplane's pod annotations, and the catalog pod requests are read against."""

    scheduler_accounts: frozenset[str] = frozenset({DEFAULT_SCHEDULER_ACCOUNT})
    device_plugin_accounts: frozenset[str] = frozenset({DEFAULT_DEVICE_PLUGIN_ACCOUNT})
    catalog: Catalog = field(default_factory=default_catalog)

    def review(self, body: object) -> dict[str, Any]:
        """Answer an AdmissionReview; raises `ReviewError` when `body` is not one."""
        request = _request(body)
        verdict = self.decide(request)
        response: dict[str, Any] = {"uid": request["uid"], "allowed": verdict.allowed}
        if not verdict.allowed:
            response["status"] = {"code": 403, "reason": "Forbidden", "message": verdict.message}
        return {"apiVersion": REVIEW_API_VERSION, "kind": "AdmissionReview", "response": response}

    def decide(self, request: Mapping[str, Any]) -> Verdict:
        kind = request["kind"]
        operation = request.get("operation")
        if operation not in ("CREATE", "UPDATE"):
            return ALLOW
        obj = request.get("object")
        if not isinstance(obj, Mapping):
            raise ReviewError(f"request.object: an {operation} needs the object")
        if kind.get("group") == "" and kind.get("kind") == "Pod":
            return self._pod(request, obj)
        if kind.get("group") == GROUP:
            return self._resource(request, obj)
        return ALLOW

    # ------------------------------------------------------------------ pods
    def _pod(self, request: Mapping[str, Any], pod: Mapping[str, Any]) -> Verdict:
        pod = _named(pod, request)
        label = f"pod {pod['metadata'].get('namespace', '')}/{pod['metadata']['name']}"
        if request["operation"] == "CREATE":
            forged = sorted(SCHEDULER_ANNOTATIONS & annotations_of(pod).keys())
            if forged:
                return Verdict(False, f"{label}: metadata.annotations[{forged[0]}]: only the gpuplane scheduler "
                                      f"sets {', '.join(forged)}; remove it from the pod")
            if wants_gpu(pod):
                try:
                    pod_request(pod, self.catalog)
                except ObjectError as exc:
                    reason = str(exc).removeprefix(f"{exc.obj}: {exc.field}: ")
                    return Verdict(False, f"{label}: {exc.field}: {reason}")
            return ALLOW
        old = request.get("oldObject")
        if not isinstance(old, Mapping):
            raise ReviewError("request.oldObject: an UPDATE needs the old object")
        new_notes, old_notes = annotations_of(pod), annotations_of(old)
        changed = sorted(k for k in SCHEDULER_ANNOTATIONS if new_notes.get(k) != old_notes.get(k))
        if not changed:
            return ALLOW
        user = _username(request)
        if user in self.scheduler_accounts:
            return ALLOW
        if user in self.device_plugin_accounts:
            beyond = [k for k in changed if k not in DEVICE_PLUGIN_ANNOTATIONS]
            if not beyond:
                return ALLOW
            return Verdict(False, f"{label}: metadata.annotations[{beyond[0]}]: the device plugin ({user}) may "
                                  f"change only {ALLOCATED_CONTAINERS}, {BIND_PHASE}")
        return Verdict(False, f"{label}: metadata.annotations[{changed[0]}]: only the gpuplane scheduler may "
                              f"change {', '.join(changed)} (requested by {user or 'an unnamed user'})")

    # ------------------------------------------------------------------ custom resources
    def _resource(self, request: Mapping[str, Any], obj: Mapping[str, Any]) -> Verdict:
        kind = BY_KIND.get(str(obj.get("kind")))
        obj = _named(obj, request, namespaced=kind is None or kind.scope == "Namespaced")
        try:
            parse_resource(obj, self.catalog)
        except ResourceError as exc:
            return Verdict(False, f"{exc.obj}: {exc}")
        return ALLOW


def _request(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ReviewError("the body is not a JSON object")
    if body.get("kind") != "AdmissionReview" or body.get("apiVersion") != REVIEW_API_VERSION:
        raise ReviewError(f"not an AdmissionReview {REVIEW_API_VERSION} (apiVersion {body.get('apiVersion')!r}, "
                          f"kind {body.get('kind')!r})")
    request = body.get("request")
    if not isinstance(request, Mapping):
        raise ReviewError("request: missing or not an object")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise ReviewError("request.uid: missing")
    kind = request.get("kind")
    if not isinstance(kind, Mapping) or not isinstance(kind.get("kind"), str):
        raise ReviewError("request.kind: missing or not a GroupVersionKind")
    if not isinstance(request.get("operation"), str):
        raise ReviewError("request.operation: missing")
    if "userInfo" in request and not isinstance(request["userInfo"], Mapping):
        raise ReviewError("request.userInfo: not an object")
    return request


def _named(obj: Mapping[str, Any], request: Mapping[str, Any], *, namespaced: bool = True) -> dict[str, Any]:
    """`obj` with a name and namespace: on CREATE they may live only in the request (`generateName`)."""
    meta = obj.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        raise ReviewError("request.object.metadata: not an object")
    meta = dict(meta or {})
    meta["name"] = meta.get("name") or request.get("name") or meta.get("generateName") or "(unnamed)"
    if namespaced and not meta.get("namespace") and request.get("namespace"):
        meta["namespace"] = request["namespace"]
    return {**obj, "metadata": meta}


def _username(request: Mapping[str, Any]) -> str:
    info = request.get("userInfo") or {}
    return str(info.get("username") or "")


# ------------------------------------------------------------------ HTTP
class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"
    timeout = 30.0

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, on the request's thread, not in the accept loop

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/validate":
            self._send(HTTPStatus.NOT_FOUND, {"message": f"no such path {self.path}; POST /validate"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 < length <= MAX_BODY:
            self._send(HTTPStatus.BAD_REQUEST, {"message": "a JSON AdmissionReview body is required (Content-Length)"})
            return
        raw = self.rfile.read(length)
        try:
            answer = self.server.policy.review(json.loads(raw))
        except (ReviewError, ValueError) as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"message": f"malformed AdmissionReview: {exc}"})
            return
        self._send(HTTPStatus.OK, answer)

    def do_GET(self) -> None:
        if self.path in ("/healthz", "/readyz"):
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"message": f"no such path {self.path}"})

    def _send(self, status: HTTPStatus, doc: Mapping[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class WebhookServer(ThreadingHTTPServer):
    """The webhook on `host:port` (0: any free port); HTTPS when `cert` and `key` are given."""

    daemon_threads = True

    def __init__(self, policy: AdmissionPolicy, host: str = "127.0.0.1", port: int = 0, *,
                 cert: str | Path | None = None, key: str | Path | None = None) -> None:
        super().__init__((host, port), _Handler)
        self.policy = policy
        self.tls = cert is not None
        if cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(cert), str(key) if key is not None else None)
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self._thread: threading.Thread | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("webhook connection from %s failed", client_address, exc_info=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"

    def start(self) -> WebhookServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="gpuplane-webhook", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()
