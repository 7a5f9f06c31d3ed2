"""`RestKubeApi` against the local API server over real HTTP, the server's API semantics, and the informer."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.kube.api import ApiError, KubeApi, RestKubeApi, dumps, loads, pod_path
from gpuplane.kube.informer import Informer
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json

PODS = "/api/v1/namespaces/default/pods"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def raw(server: FakeApiServer, method: str, path: str, body: Any = None,
        content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    """One request with the standard library, to see the status code the server answers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll until `check` holds (threads deliver asynchronously); a deadline, not a speed assertion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def test_rest_api_is_a_kube_api(server: FakeApiServer) -> None:
    assert isinstance(server.api, KubeApi)


# ------------------------------------------------------------------ status codes
def test_crud_status_codes_and_status_bodies(server: FakeApiServer) -> None:
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "gpuplane"},
             "spec": {"holderIdentity": "a"}}
    code, created = raw(server, "POST", LEASES, lease)
    assert code == 201
    assert created["metadata"]["uid"] and created["metadata"]["creationTimestamp"]
    assert created["metadata"]["namespace"] == "kube-system"
    code, body = raw(server, "POST", LEASES, lease)
    assert (code, body["kind"], body["reason"], body["code"], body["status"]) == \
        (409, "Status", "AlreadyExists", 409, "Failure")
    code, body = raw(server, "GET", f"{LEASES}/missing")
    assert (code, body["reason"]) == (404, "NotFound")
    code, _ = raw(server, "PUT", f"{LEASES}/missing", lease)
    assert code == 404
    stale = created["metadata"]["resourceVersion"]
    changed = {**created, "spec": {"holderIdentity": "b"}}
    code, replaced = raw(server, "PUT", f"{LEASES}/gpuplane", changed)
    assert code == 200 and int(replaced["metadata"]["resourceVersion"]) > int(stale)
    code, body = raw(server, "PUT", f"{LEASES}/gpuplane", {**changed, "spec": {"holderIdentity": "c"}})
    assert (code, body["reason"]) == (409, "Conflict")  # the resourceVersion it carries is stale now
    code, _ = raw(server, "DELETE", f"{LEASES}/gpuplane")
    assert code == 200
    code, _ = raw(server, "DELETE", f"{LEASES}/gpuplane")
    assert code == 404


def test_api_errors_carry_the_status(server: FakeApiServer) -> None:
    api = server.api
    api.create(PODS, pod_json("p"))
    with pytest.raises(ApiError) as exists:
        api.create(PODS, pod_json("p"))
    assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
    assert exists.value.body["kind"] == "Status"
    with pytest.raises(ApiError) as missing:
        api.get(pod_path("default", "nope"))
    assert (missing.value.status, missing.value.reason) == (404, "NotFound")
    current = api.get(pod_path("default", "p"))
    api.patch(pod_path("default", "p"), {"metadata": {"labels": {"x": "1"}}})
    with pytest.raises(ApiError) as conflict:
        api.replace(pod_path("default", "p"), current)
    assert (conflict.value.status, conflict.value.reason) == (409, "Conflict")


def test_no_answer_is_a_status_zero_error() -> None:
    with FakeApiServer() as fake:
        url = fake.url
    api = RestKubeApi.from_url(url, request_timeout_s=2.0)
    with pytest.raises(ApiError) as error:
        api.get("/api/v1/nodes")
    assert (error.value.status, error.value.reason) == (0, "ConnectionError")
    with pytest.raises(ApiError) as write:
        api.create(PODS, pod_json("p"))
    assert (write.value.status, write.value.reason) == (0, "ConnectionError")


def test_writes_carry_the_clients_headers_token_and_base_path() -> None:
    """Writes skip `call_api` (the lean path): they must still send what the official client sends, the bearer
    token through the refresh hook included, under the configuration's base path."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[str, str, dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                         self.rfile.read(length)))
            status = 409 if "conflict" in self.path else 200
            body = json.dumps({"kind": "Status", "reason": "Conflict", "message": "no"} if status == 409
                              else {"ok": self.command}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        api = RestKubeApi.from_url(f"http://127.0.0.1:{httpd.server_address[1]}/base", token="first")
        refreshed: list[str] = []

        def refresh(configuration: Any) -> None:
            refreshed.append("x")
            configuration.api_key["BearerToken"] = f"Bearer t{len(refreshed)}"

        api.client.configuration.refresh_api_key_hook = refresh
        assert api.get(pod_path("default", "p")) == {"ok": "GET"}
        assert api.create(PODS, {"a": 1}) == {"ok": "POST"}
        assert api.patch(pod_path("default", "p"), [{"op": "remove", "path": "/x"}], patch_type="json") == \
            {"ok": "PATCH"}
        assert api.delete(pod_path("default", "p")) == {"ok": "DELETE"}
        assert api.create("/api/v1/namespaces/default/pods/a b", {}) == {"ok": "POST"}  # percent-encoded
        with pytest.raises(ApiError) as conflict:
            api.replace(pod_path("default", "conflict"), {"b": 2})
        assert (conflict.value.status, conflict.value.reason, conflict.value.message) == (409, "Conflict", "no")
    finally:
        httpd.shutdown()
        httpd.server_close()
    read, post, patch, delete, _, put = seen
    assert [(m, p) for m, p, _, _ in seen] == [
        ("GET", "/base/api/v1/namespaces/default/pods/p"), ("POST", "/base" + PODS),
        ("PATCH", "/base/api/v1/namespaces/default/pods/p"), ("DELETE", "/base/api/v1/namespaces/default/pods/p"),
        ("POST", "/base/api/v1/namespaces/default/pods/a%20b"),
        ("PUT", "/base/api/v1/namespaces/default/pods/conflict")]
    assert [h["authorization"] for _, _, h, _ in seen] == [f"Bearer t{i}" for i in range(1, 7)]
    assert all(h["user-agent"] == read[2]["user-agent"] and h["accept"] == "application/json" for _, _, h, _ in seen)
    assert (post[2]["content-type"], json.loads(post[3])) == ("application/json", {"a": 1})
    assert (patch[2]["content-type"], json.loads(patch[3])) == ("application/json-patch+json",
                                                                [{"op": "remove", "path": "/x"}])
    assert "content-type" not in delete[2] and delete[3] == b""
    assert json.loads(put[3]) == {"b": 2}


def test_injected_failures_answer_once(server: FakeApiServer) -> None:
    server.add_node(node_json("n1"))
    server.fail_next("GET", r"^/api/v1/nodes/n1$", 503, "ServiceUnavailable")
    with pytest.raises(ApiError) as error:
        server.api.get("/api/v1/nodes/n1")
    assert (error.value.status, error.value.reason) == (503, "ServiceUnavailable")
    assert server.api.get("/api/v1/nodes/n1")["metadata"]["name"] == "n1"


# ------------------------------------------------------------------ lists
def test_list_follows_continue_tokens_and_filters(server: FakeApiServer) -> None:
    # 120 pods, pages of 50 (the fixture's client): 50 + 50 + 20 = three requests, one resourceVersion.
    for i in range(120):
        server.add_pod(pod_json(f"p{i:03d}", node="n1" if i % 3 == 0 else None, labels={"team": f"t{i % 2}"}))
    rv_before = server.resource_version
    items, rv = server.api.list("/api/v1/pods")
    assert [i["metadata"]["name"] for i in items] == [f"p{i:03d}" for i in range(120)]
    assert rv == str(rv_before)
    pages = server.requests_to(r"^/api/v1/pods$")
    assert len(pages) == 3
    on_n1, _ = server.api.list("/api/v1/pods", field_selector="spec.nodeName=n1")
    assert len(on_n1) == 40  # i % 3 == 0 for i in 0..119
    both, _ = server.api.list(PODS, label_selector="team=t0", field_selector="spec.nodeName=n1")
    assert len(both) == 20  # i % 6 == 0
    unbound, _ = server.api.list("/api/v1/pods", field_selector="spec.nodeName=")
    assert len(unbound) == 80


def test_a_compacted_continue_token_is_410(server: FakeApiServer) -> None:
    for i in range(60):
        server.add_pod(pod_json(f"p{i}"))
    code, first = raw(server, "GET", "/api/v1/pods?limit=50")
    assert code == 200 and first["metadata"]["remainingItemCount"] == 10
    server.compact()
    code, body = raw(server, "GET", f"/api/v1/pods?limit=50&continue={first['metadata']['continue']}")
    assert (code, body["reason"]) == (410, "Expired")


@pytest.mark.parametrize(("selector", "names"), [
    ("gpu=yes", ["a"]),
    ("gpu!=yes", ["b", "c"]),
    ("gpu", ["a", "b"]),
    ("!gpu", ["c"]),
    ("tier in (x, y)", ["a", "c"]),
    ("tier notin (x)", ["b", "c"]),
    ("gpu,tier=x", ["a"]),
])
def test_label_selectors(server: FakeApiServer, selector: str, names: list[str]) -> None:
    server.add_pod(pod_json("a", labels={"gpu": "yes", "tier": "x"}))
    server.add_pod(pod_json("b", labels={"gpu": "no"}))
    server.add_pod(pod_json("c", labels={"tier": "y"}))
    items, _ = server.api.list(PODS, label_selector=selector)
    assert [i["metadata"]["name"] for i in items] == names


# ------------------------------------------------------------------ patches
def test_patch_types(server: FakeApiServer) -> None:
    api = server.api
    server.add_pod(pod_json("p", labels={"a": "1", "b": "2"}))
    path = pod_path("default", "p")
    merged = api.patch(path, {"metadata": {"labels": {"a": None, "c": "3"}}})
    assert merged["metadata"]["labels"] == {"b": "2", "c": "3"}  # null removes, maps merge
    tolerations = [{"key": "gpu", "operator": "Exists"}]
    api.patch(path, {"spec": {"tolerations": tolerations}}, patch_type="strategic")
    strategic = api.patch(path, {"spec": {"tolerations": [{"key": "x", "operator": "Exists"}]}},
                          patch_type="strategic")
    assert strategic["spec"]["tolerations"] == [{"key": "x", "operator": "Exists"}]  # lists replaced (documented)
    jsonpatched = api.patch(path, [{"op": "add", "path": "/metadata/labels/d", "value": "4"},
                                   {"op": "remove", "path": "/metadata/labels/b"}], patch_type="json")
    assert jsonpatched["metadata"]["labels"] == {"c": "3", "d": "4"}
    content_types = [body for method, p, body in server.requests if method == "PATCH"]
    assert len(content_types) == 4
    with pytest.raises(ApiError) as failed:
        api.patch(path, [{"op": "test", "path": "/metadata/labels/c", "value": "nope"}], patch_type="json")
    assert failed.value.status == 422
    with pytest.raises(TypeError):
        api.patch(path, {"not": "a list"}, patch_type="json")


def test_the_main_resource_never_writes_status(server: FakeApiServer) -> None:
    server.add_pod(pod_json("p"))
    server.api.patch(pod_path("default", "p"), {"status": {"phase": "Running"}})
    assert server.get("pods", "default/p")["status"]["phase"] == "Pending"  # type: ignore[index]
    server.api.patch(pod_path("default", "p", "status"), {"status": {"phase": "Failed"}})
    assert server.get("pods", "default/p")["status"]["phase"] == "Failed"  # type: ignore[index]


# ------------------------------------------------------------------ binding, eviction, scale
def test_binding(server: FakeApiServer) -> None:
    server.add_pod(pod_json("p"))
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}
    code, body = raw(server, "POST", f"{PODS}/p/binding", binding)
    assert (code, body["status"]) == (201, "Success")
    assert server.get("pods", "default/p")["spec"]["nodeName"] == "n1"  # type: ignore[index]
    code, body = raw(server, "POST", f"{PODS}/p/binding", binding)
    assert (code, body["reason"]) == (409, "Conflict")
    code, _ = raw(server, "POST", f"{PODS}/ghost/binding", {**binding, "metadata": {"name": "ghost"}})
    assert code == 404


def eviction(name: str, grace: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}}
    if grace is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace}
    return body


def test_eviction_answers(server: FakeApiServer) -> None:
    for name in ("ok", "blocked", "multi"):
        server.add_pod(pod_json(name, node="n1", phase="Running"))
    code, _ = raw(server, "POST", f"{PODS}/ok/eviction", eviction("other"))
    assert code == 400  # metadata.name must equal the URL's
    server.block_eviction("default/blocked", times=1)
    code, body = raw(server, "POST", f"{PODS}/blocked/eviction", eviction("blocked"))
    assert (code, body["reason"], body["details"]["causes"][0]["reason"]) == \
        (429, "TooManyRequests", "DisruptionBudget")
    code, _ = raw(server, "POST", f"{PODS}/blocked/eviction", eviction("blocked"))
    assert code == 201  # blocked once only
    server.several_pdbs("default/multi")
    code, body = raw(server, "POST", f"{PODS}/multi/eviction", eviction("multi"))
    assert (code, body["reason"]) == (500, "InternalError")
    code, _ = raw(server, "POST", f"{PODS}/ok/eviction", eviction("ok"))
    assert code == 201
    assert server.get("pods", "default/ok") is None
    code, _ = raw(server, "POST", f"{PODS}/ok/eviction", eviction("ok"))
    assert code == 404


def test_an_evicted_pod_terminates_before_it_goes() -> None:
    with FakeApiServer(pod_deletion_delay_s=None) as server:
        server.add_pod(pod_json("p", node="n1", phase="Running"))
        server.api.create(f"{PODS}/p/eviction", eviction("p", grace=7))
        pod = server.get("pods", "default/p")
        assert pod is not None and pod["metadata"]["deletionTimestamp"]
        assert pod["metadata"]["deletionGracePeriodSeconds"] == 7
        server.finish_deletion("default/p")
        assert server.get("pods", "default/p") is None


def test_scale_subresource(server: FakeApiServer) -> None:
    server.add_object(DEPLOYMENTS, {"metadata": {"name": "web"}, "spec": {"replicas": 2}})
    scale = server.api.get(f"{DEPLOYMENTS}/web/scale")
    assert (scale["kind"], scale["apiVersion"], scale["spec"]["replicas"]) == ("Scale", "autoscaling/v1", 2)
    answer = server.api.patch(f"{DEPLOYMENTS}/web/scale", {"spec": {"replicas": 5}})
    assert answer["spec"] == {"replicas": 5}
    assert server.get("deployments", "default/web")["spec"]["replicas"] == 5  # type: ignore[index]


def test_scale_put_checks_the_resource_version(server: FakeApiServer) -> None:
    server.add_object(DEPLOYMENTS, {"metadata": {"name": "web"}, "spec": {"replicas": 2}})
    scale = server.api.get(f"{DEPLOYMENTS}/web/scale")
    server.api.patch(f"{DEPLOYMENTS}/web/scale", {"spec": {"replicas": 5}})
    with pytest.raises(ApiError) as stale:
        server.api.replace(f"{DEPLOYMENTS}/web/scale", {**scale, "spec": {"replicas": 1}})
    assert stale.value.status == 409
    fresh = server.api.get(f"{DEPLOYMENTS}/web/scale")
    assert server.api.replace(f"{DEPLOYMENTS}/web/scale", {**fresh, "spec": {"replicas": 1}})["spec"] == \
        {"replicas": 1}
    with pytest.raises(ApiError) as negative:
        server.api.patch(f"{DEPLOYMENTS}/web/scale", {"spec": {"replicas": -1}})
    assert negative.value.status == 422


def test_custom_resources_namespaced_and_cluster_scoped(server: FakeApiServer) -> None:
    api = server.api
    namespaced = "/apis/gpuplane.io/v1alpha1/namespaces/ml/trainingjobs"
    cluster = "/apis/gpuplane.io/v1alpha1/gpupools"
    job = api.create(namespaced, {"apiVersion": "gpuplane.io/v1alpha1", "kind": "TrainingJob",
                                  "metadata": {"name": "j"}, "spec": {"workers": 2}})
    assert job["kind"] == "TrainingJob" and job["metadata"]["namespace"] == "ml"
    api.create(cluster, {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": "dev"}})
    assert api.get(f"{cluster}/dev")["metadata"].get("namespace") is None
    api.patch(f"{namespaced}/j/status", {"status": {"phase": "Running"}})
    assert api.get(f"{namespaced}/j")["status"] == {"phase": "Running"}
    assert [i["metadata"]["name"] for i in api.list(namespaced)[0]] == ["j"]
    api.delete(f"{namespaced}/j")
    assert api.list(namespaced)[0] == []


# ------------------------------------------------------------------ watch
def collect(stream: Iterator[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    return [(kind, obj["metadata"].get("name", "")) for kind, obj in stream]


def test_watch_resumes_from_a_resource_version(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    _, rv = server.api.list(PODS)
    server.add_pod(pod_json("b"))
    server.api.patch(pod_path("default", "a"), {"metadata": {"labels": {"x": "1"}}})
    server.api.delete(pod_path("default", "b"))
    events = collect(server.api.watch(PODS, rv, timeout_s=1))
    # Three changes after the list, then the bookmark the server sends as the watch times out.
    assert events == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b"), ("BOOKMARK", "")]


def test_watch_from_nothing_starts_with_the_current_objects(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    assert collect(server.api.watch(PODS, "", timeout_s=1))[:1] == [("ADDED", "a")]


def test_watch_with_a_field_selector_sees_objects_enter_and_leave(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    _, rv = server.api.list(PODS)
    server.api.create(f"{PODS}/a/binding", {"metadata": {"name": "a"}, "target": {"name": "n1"}})
    server.api.delete(pod_path("default", "a"))
    events = collect(server.api.watch("/api/v1/pods", rv, timeout_s=1, field_selector="spec.nodeName=n1"))
    # Bound: it enters the selection; deleted: it terminates (deletionTimestamp), then goes.
    assert events[:3] == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]


def test_a_compacted_resource_version_is_410(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    _, rv = server.api.list(PODS)
    server.add_pod(pod_json("b"))
    server.compact()
    with pytest.raises(ApiError) as gone:
        server.api.watch(PODS, rv, timeout_s=1)
    assert gone.value.status == 410


def test_an_open_watch_gets_an_error_event_when_compacted(server: FakeApiServer) -> None:
    _, rv = server.api.list(PODS)
    stream = server.api.watch(PODS, rv, timeout_s=30)
    assert wait_until(lambda: server.open_watches == 1)
    server.compact()
    with pytest.raises(ApiError) as gone:
        collect(stream)
    assert (gone.value.status, gone.value.reason) == (410, "Expired")


def test_a_dropped_watch_raises_a_transport_error(server: FakeApiServer) -> None:
    _, rv = server.api.list(PODS)
    stream = server.api.watch(PODS, rv, timeout_s=30)
    assert wait_until(lambda: server.open_watches == 1)
    server.drop_watches()
    with pytest.raises(ApiError) as dropped:
        collect(stream)
    assert dropped.value.status == 0


def test_closing_a_watch_from_another_thread_ends_it(server: FakeApiServer) -> None:
    _, rv = server.api.list(PODS)
    stream = server.api.watch(PODS, rv, timeout_s=30)
    seen: list[tuple[str, str]] = []
    def read() -> None:
        for kind, obj in stream:
            seen.append((kind, obj["metadata"]["name"]))

    reader = threading.Thread(target=read)
    reader.start()
    server.add_pod(pod_json("a"))
    assert wait_until(lambda: seen == [("ADDED", "a")])
    stream.close()
    reader.join(5)
    assert not reader.is_alive()


# ------------------------------------------------------------------ informer
class Gate:
    """An injected `sleep`: records each back-off and holds the informer until the test opens the gate."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.opened = threading.Event()
        self.waiting = threading.Event()

    def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.waiting.set()
        self.opened.wait(10)


def recorder() -> tuple[list[tuple[str, str]], Callable[[str, Any, Any], None]]:
    seen: list[tuple[str, str]] = []

    def handler(kind: str, old: Any, new: Any) -> None:
        obj = new if new is not None else old
        seen.append((kind, obj["metadata"]["name"]))

    return seen, handler


@contextmanager
def held_watch(server: FakeApiServer) -> Iterator[tuple[Informer, Gate, list[tuple[str, str]]]]:
    """A started informer on pods whose watch connection has just been dropped: it waits at `gate` (closed)
    before it watches again, and `seen` records what its handler was told."""
    gate = Gate()
    informer = Informer(server.api, "/api/v1/pods", watch_timeout_s=30, sleep=gate)
    seen, handler = recorder()
    informer.add_handler(handler)
    informer.start()
    try:
        assert informer.wait_synced(5) and wait_until(lambda: server.open_watches == 1)
        server.drop_watches()
        assert gate.waiting.wait(5)
        yield informer, gate, seen
    finally:
        informer.stop()


def test_informer_lists_then_watches(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    informer = Informer(server.api, "/api/v1/pods", watch_timeout_s=5)
    seen, handler = recorder()
    informer.add_handler(handler)
    informer.start()
    try:
        assert informer.wait_synced(5) and informer.has_synced
        server.add_pod(pod_json("b"))
        server.api.patch(pod_path("default", "a"), {"metadata": {"labels": {"x": "1"}}})
        server.api.delete(pod_path("default", "b"))
        assert wait_until(lambda: len(seen) == 4)
        assert seen == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
        assert informer.keys() == ["default/a"]
    finally:
        informer.stop()


def test_informer_rewatches_a_dropped_connection_from_where_it_was(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    with held_watch(server) as (informer, gate, seen):
        server.add_pod(pod_json("b"))  # made while no watch is open
        gate.opened.set()
        assert wait_until(lambda: ("ADDED", "b") in seen)
        assert gate.delays == [0.5]
        assert (informer.rewatches, informer.relists) == (1, 0)  # resumed, no relist needed
        lists = server.requests_to(r"^/api/v1/pods$")
        assert len(lists) == 3  # list, watch, watch again


def test_informer_relists_on_410_and_reports_the_difference(server: FakeApiServer) -> None:
    for name in ("keep", "change", "drop"):
        server.add_pod(pod_json(name))
    with held_watch(server) as (informer, gate, seen):
        server.add_pod(pod_json("new"))
        server.api.patch(pod_path("default", "change"), {"metadata": {"labels": {"x": "1"}}})
        server.api.delete(pod_path("default", "drop"))
        server.compact()  # the history the informer would resume from is gone: 410, relist
        seen.clear()
        gate.opened.set()
        assert wait_until(lambda: len(seen) == 3)
        assert sorted(seen) == [("ADDED", "new"), ("DELETED", "drop"), ("MODIFIED", "change")]
        assert informer.relists == 1
        assert informer.keys() == ["default/change", "default/keep", "default/new"]


def test_informer_assumed_write_skips_older_events(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    informer = Informer(server.api, "/api/v1/pods", watch_timeout_s=30)
    informer.start()
    try:
        assert informer.wait_synced(5)
        patched = server.api.patch(pod_path("default", "a"), {"metadata": {"labels": {"step": "1"}}})
        assumed = json.loads(json.dumps(patched))
        assumed["spec"]["nodeName"] = "n1"
        informer.assume(assumed, int(patched["metadata"]["resourceVersion"]))
        # The watch brings the patch (not newer than the assumed write: skipped), then the binding.
        server.api.create(f"{PODS}/a/binding", {"metadata": {"name": "a"}, "target": {"name": "n1"}})
        assert wait_until(lambda: (informer.get("default/a") or {}).get("status", {}).get("conditions"))
        cached = informer.get("default/a")
        assert cached is not None and cached["spec"]["nodeName"] == "n1"
    finally:
        informer.stop()


def test_informer_forgets_its_own_deletion_and_skips_the_older_events(server: FakeApiServer) -> None:
    server.add_pod(pod_json("a"))
    with held_watch(server) as (informer, gate, seen):  # behind: it has not seen the deletion when the answer comes
        informer.forget(server.api.delete(pod_path("default", "a"), {"gracePeriodSeconds": 0}))
        assert informer.keys() == [] and seen == [("ADDED", "a"), ("DELETED", "a")]
        server.add_pod(pod_json("a"))  # made again, after the deletion: a new object
        gate.opened.set()
        # the watch brings DELETED (the deletion's own version: skipped), then the new pod's ADDED
        assert wait_until(lambda: len(seen) == 3)
        assert seen == [("ADDED", "a"), ("DELETED", "a"), ("ADDED", "a")] and informer.keys() == ["default/a"]
        # an answer the watch has gone past already changes nothing
        old = server.api.delete(pod_path("default", "a"), {"gracePeriodSeconds": 0})
        assert wait_until(lambda: len(seen) == 4)
        informer.forget(old)
        assert seen[-1] == ("DELETED", "a") and len(seen) == 4


# ------------------------------------------------------------------ the write path's own connections
class ScriptedServer:
    """A raw HTTP server answering each request with what `answer(connection, method, path)` returns: the bytes
    to write (then the connection stays open), a pair (bytes, True: close the connection after them, saying
    nothing), or None (close it without answering). Records, per request, which connection it came on (0, 1, …
    in accept order)."""

    def __init__(self, answer: Callable[[int, str, str], bytes | tuple[bytes, bool] | None], tls: Any = None) -> None:
        import socket as socket_module

        self.answer = answer
        self.seen: list[tuple[int, str, str, bytes]] = []
        self._listener = socket_module.create_server(("127.0.0.1", 0))
        self._tls = tls
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        index = 0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, index), daemon=True).start()
            index += 1

    def _serve(self, sock: Any, index: int) -> None:
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            reader = sock.makefile("rb")
            while True:
                line = reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                length = 0
                while (header := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                self.seen.append((index, method, path, reader.read(length)))
                out = self.answer(index, method, path)
                if out is None:
                    return
                data, close = out if isinstance(out, tuple) else (out, False)
                sock.sendall(data)
                if close:
                    return
        except OSError:
            return
        finally:
            sock.close()

    def close(self) -> None:
        self._listener.close()


def http_answer(status: int, body: bytes, *extra: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", "Content-Type: application/json", *extra]
    if not any(h.lower().startswith("transfer-encoding") for h in extra):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(*parts: bytes) -> bytes:
    """`parts` as chunks (the first with a chunk extension), then the last chunk and a trailer."""
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";x=1" if i == 0 else b"", p) for i, p in enumerate(parts))
    return out + b"0\r\nTrailer-X: 1\r\n\r\n"


def test_writes_share_one_kept_alive_connection_and_read_every_answer_form() -> None:
    """Content-Length, chunked (with an extension and a trailer), 100 Continue before the answer, 204 with no
    body: each read whole, so the next write on the same connection starts clean."""
    answers = {
        ("POST", "/a"): http_answer(201, b'{"n": 1}'),
        ("PATCH", "/b"): http_answer(200, chunked(b'{"n"', b": 2}"), "Transfer-Encoding: chunked"),
        ("PUT", "/c"): b"HTTP/1.1 100 Continue\r\n\r\n" + http_answer(200, b'{"n": 3}'),
        ("DELETE", "/d"): b"HTTP/1.1 204 No Content\r\n\r\n",
        ("POST", "/e"): http_answer(409, b'{"kind": "Status", "reason": "Conflict", "message": "taken"}'),
    }
    server = ScriptedServer(lambda _, method, path: answers[(method, path)])
    try:
        api = RestKubeApi.from_url(f"http://127.0.0.1:{server.port}", request_timeout_s=5.0)
        assert api.create("/a", {"x": 1}) == {"n": 1}
        assert api.patch("/b", {"x": 2}) == {"n": 2}
        assert api.replace("/c", {"x": 3}) == {"n": 3}
        assert api.delete("/d") == {}
        with pytest.raises(ApiError) as conflict:
            api.create("/e", {})
        assert (conflict.value.status, conflict.value.reason, conflict.value.message) == (409, "Conflict", "taken")
        assert api.create("/a", {"x": 4}) == {"n": 1}  # the 409 was read whole too
        api.close()
    finally:
        server.close()
    assert [(c, m, p) for c, m, p, _ in server.seen] == [
        (0, "POST", "/a"), (0, "PATCH", "/b"), (0, "PUT", "/c"), (0, "DELETE", "/d"), (0, "POST", "/e"),
        (0, "POST", "/a")]
    assert [json.loads(b) if b else None for _, _, _, b in server.seen] == [
        {"x": 1}, {"x": 2}, {"x": 3}, None, {}, {"x": 4}]


def test_a_connection_the_answer_closes_is_not_used_again() -> None:
    """`Connection: close`, or an HTTP/1.0 answer, ends the connection: the next write opens another."""
    def answer(connection: int, method: str, path: str) -> bytes:
        if connection == 0:
            return http_answer(200, b"{}", "Connection: close")
        return http_answer(200, b"{}").replace(b"HTTP/1.1", b"HTTP/1.0") if connection == 1 else \
            http_answer(200, b"{}")

    server = ScriptedServer(answer)
    try:
        api = RestKubeApi.from_url(f"http://127.0.0.1:{server.port}", request_timeout_s=5.0)
        for _ in range(4):
            assert api.create("/x", {}) == {}
    finally:
        server.close()
    assert [c for c, _, _, _ in server.seen] == [0, 1, 2, 2]


@pytest.mark.parametrize(("method", "sent_again"), [("PUT", True), ("DELETE", True), ("POST", False),
                                                    ("PATCH", False)])
def test_a_kept_alive_connection_closed_before_answering(method: str, sent_again: bool) -> None:
    """The server takes the second request on a kept-alive connection and closes without answering. PUT and
    DELETE are idempotent: sent once more on a new connection. POST and PATCH may have been applied: status 0
    (urllib3 does not resend them either), and the next write opens a new connection."""
    def answer(connection: int, _method: str, path: str) -> bytes | None:
        return None if (connection, path) == (0, "/second") else http_answer(200, b'{"ok": true}')

    server = ScriptedServer(answer)
    try:
        api = RestKubeApi.from_url(f"http://127.0.0.1:{server.port}", request_timeout_s=5.0)
        call = {"PUT": api.replace, "POST": api.create, "PATCH": api.patch,
                "DELETE": lambda path, body: api.delete(path)}[method]
        assert call("/first", {}) == {"ok": True}
        if sent_again:
            assert call("/second", {}) == {"ok": True}
        else:
            with pytest.raises(ApiError) as lost:
                call("/second", {})
            assert (lost.value.status, lost.value.reason) == (0, "ConnectionError")
        assert call("/third", {}) == {"ok": True}
    finally:
        server.close()
    expected = [(0, "/first"), (0, "/second")] + ([(1, "/second")] if sent_again else []) + [(1, "/third")]
    assert [(c, p) for c, _, p, _ in server.seen] == expected


def test_writes_over_tls_verify_the_server_as_the_client_is_configured(tmp_path: Any) -> None:
    """The write path's connections are set up by the client's urllib3 pool: a configured CA is trusted, and a
    server the configuration does not trust is refused (status 0), never written to."""
    import shutil
    import ssl
    import subprocess

    from kubernetes.client import Configuration

    assert shutil.which("openssl"), "the openssl CLI makes the test certificate"
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=gpuplane-test", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    server = ScriptedServer(lambda *_: http_answer(201, b'{"ok": 1}'), tls=context)
    try:
        trusting = Configuration(host=f"https://127.0.0.1:{server.port}")
        trusting.ssl_ca_cert = str(cert)
        api = RestKubeApi.from_configuration(trusting, request_timeout_s=5.0)
        assert api.create("/a", {}) == {"ok": 1}
        assert api.create("/b", {}) == {"ok": 1}
        stranger = RestKubeApi.from_configuration(Configuration(host=f"https://127.0.0.1:{server.port}"),
                                                  request_timeout_s=5.0)
        with pytest.raises(ApiError) as refused:
            stranger.create("/c", {})
        assert refused.value.status == 0
    finally:
        server.close()
    assert [(c, p) for c, _, p, _ in server.seen] == [(0, "/a"), (0, "/b")]


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1) |
    st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_JSON_VALUES)
def test_the_codec_reads_and_writes_what_the_standard_library_does(value: Any) -> None:
    """`loads`/`dumps` (orjson where installed) agree with `json` on every JSON value the API server can send
    (its integers are int64)."""
    text = json.dumps(value)
    assert loads(text) == json.loads(text)
    assert loads(text.encode()) == json.loads(text)
    assert json.loads(dumps(value)) == value


@pytest.mark.parametrize("raw", [b"NaN", b"[Infinity, -Infinity]", b"1e400", b'{"a": 1, "a": 2}'])
def test_what_orjson_refuses_is_read_as_json_reads_it(raw: bytes) -> None:
    """orjson refuses NaN and 1e400 (json reads them); duplicate keys: the last wins in both."""
    expected = json.loads(raw)
    got = loads(raw)
    assert repr(got) == repr(expected)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,]", b"\xff"])
def test_undecodable_input_raises_jsons_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        loads(raw)


def test_a_new_host_in_the_configuration_gets_new_connections() -> None:
    """Connections kept for the server the configuration named are not used for the one it names now."""
    first = ScriptedServer(lambda *_: http_answer(200, b'{"from": 1}'))
    second = ScriptedServer(lambda *_: http_answer(200, b'{"from": 2}'))
    try:
        api = RestKubeApi.from_url(f"http://127.0.0.1:{first.port}", request_timeout_s=5.0)
        assert api.create("/a", {}) == {"from": 1}
        api.client.configuration.host = f"http://127.0.0.1:{second.port}"
        assert api.create("/b", {}) == {"from": 2}
    finally:
        first.close()
        second.close()
    assert [p for _, _, p, _ in first.seen] == ["/a"] and [p for _, _, p, _ in second.seen] == ["/b"]


def test_a_connection_the_server_closed_while_idle_is_not_used() -> None:
    """The server answers, then closes the connection without saying so (an idle timeout): the next write sees
    the close before sending (urllib3's check) and opens a new connection, so even a POST is not lost."""
    server = ScriptedServer(lambda connection, _m, _p: (http_answer(201, b'{"ok": 1}'), connection == 0))
    try:
        api = RestKubeApi.from_url(f"http://127.0.0.1:{server.port}", request_timeout_s=5.0)
        assert api.create("/a", {}) == {"ok": 1}
        assert wait_until(lambda: bool(api._wires) and not api._wires[-1].usable())
        assert api.create("/b", {}) == {"ok": 1}
    finally:
        server.close()
    assert [(c, p) for c, _, p, _ in server.seen] == [(0, "/a"), (1, "/b")]
