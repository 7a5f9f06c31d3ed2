"""The Kubernetes API as gpuplane uses it: a small REST interface over raw JSON objects.

Everything in `gpuplane.kube` (the cluster port, the extender's bind, the operator's Lease and custom
resources) and the node agent's device plugin talk to the API server through `KubeApi`. Objects stay
plain dicts (the API's own JSON): `gpuplane.kube.objects` reads them into the model. The real
implementation rides on the official `kubernetes` client's transport (config loading, auth, TLS);
tests run it against a local HTTP server that answers with the real API's paths and status codes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

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
