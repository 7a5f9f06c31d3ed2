"""A local Kubernetes API server: real HTTP, the real API's paths, JSON shapes and status codes.

The tests, the parity experiment and `gpuplane bench kube` run against it (no API server can run here).

Only what gpuplane uses: pods (with binding, eviction and status subresources), nodes, leases, events.k8s.io/v1
events, core/v1 events, deployments, replica sets and stateful sets (with their scale subresource), scheduler-plugins'
PodGroups (scheduling.x-k8s.io/v1alpha1), and gpuplane.io/v1alpha1
custom resources (namespaced or cluster-scoped; their status subresource assumed enabled). One global integer
resourceVersion counter; every write is recorded as a watch event.

    with FakeApiServer() as server:
        server.add_node(node_json)
        pods, rv = server.api.list("/api/v1/pods")

Deliberate simplifications (each marked where it lives): strategic-merge patches are applied as JSON merge
patches (maps merge, lists are replaced; no `$patch` directives, no merge keys); a blocked eviction
(`block_eviction`) answers 429 whatever the pod's phase, while the real server skips PDB checks for pods that
are Pending, Succeeded, Failed or already terminating; there are no controllers (a scale changes `spec.replicas`
and nothing else) and no kubelet (pod phases change only through the API or `set_pod_phase`).
"""

from __future__ import annotations

import bisect
import copy
import itertools
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonpatch

from gpuplane.kube.api import RestKubeApi

JsonObject = dict[str, Any]

# (group, plural) -> (kind, apiVersion) for the built-in resources; custom resources keep the client's kind.
BUILTIN: dict[tuple[str, str], tuple[str, str]] = {
    ("", "pods"): ("Pod", "v1"),
    ("", "nodes"): ("Node", "v1"),
    ("", "events"): ("Event", "v1"),
    ("coordination.k8s.io", "leases"): ("Lease", "coordination.k8s.io/v1"),
    ("apps", "deployments"): ("Deployment", "apps/v1"),
    ("apps", "replicasets"): ("ReplicaSet", "apps/v1"),
    ("apps", "statefulsets"): ("StatefulSet", "apps/v1"),
    ("events.k8s.io", "events"): ("Event", "events.k8s.io/v1"),
    ("scheduling.x-k8s.io", "podgroups"): ("PodGroup", "scheduling.x-k8s.io/v1alpha1"),
    ("resource.k8s.io", "resourceslices"): ("ResourceSlice", "resource.k8s.io/v1"),
    ("resource.k8s.io", "resourceclaims"): ("ResourceClaim", "resource.k8s.io/v1"),
    ("resource.k8s.io", "resourceclaimtemplates"): ("ResourceClaimTemplate", "resource.k8s.io/v1"),
    ("resource.k8s.io", "deviceclasses"): ("DeviceClass", "resource.k8s.io/v1"),
}
SCALABLE = frozenset({"deployments", "replicasets", "statefulsets"})
KIND_ALIASES = {"pod": "pods", "node": "nodes", "lease": "leases", "deployment": "deployments",
                "replicaset": "replicasets", "statefulset": "statefulsets", "event": "events",
                "podgroup": "podgroups"}
CUSTOM_GROUP = "gpuplane.io"


def status_body(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> JsonObject:
    body: JsonObject = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": message, "reason": reason, "code": code}
    if code < 400:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": code}
    if details:
        body["details"] = dict(details)
    return body


class HttpAnswer(Exception):
    """Raised inside request handling to answer with a Status body."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.body = status_body(code, reason, message, details)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


POD_UPDATE_RULE = ("pod updates may not change fields other than `spec.containers[*].image`,"
                   "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions "
                   "to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it "
                   "was previously negative)")
"""The API server's refusal of a pod update that changes other fields (the part this server checks: resources)."""


def _resources(pod: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    return [(c.get("name"), c.get("resources")) for key in ("containers", "initContainers")
            for c in spec.get(key) or [] if isinstance(c, Mapping)]


def _dig(obj: Mapping[str, Any], dotted: str) -> str:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses (`a in (x,y),b=c`)."""
    parts, depth, current = [], 0, ""
    for char in selector:
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += char == "("
        depth -= char == ")"
        current += char
    if current.strip():
        parts.append(current.strip())
    return parts


_SET_RE = re.compile(r"^([^\s!=]+)\s+(in|notin)\s+\((.*)\)$")


def label_matches(labels: Mapping[str, str], selector: str) -> bool:
    for term in _split_selector(selector):
        set_match = _SET_RE.match(term)
        if set_match:
            key, op, values = set_match.groups()
            allowed = {v.strip() for v in values.split(",")}
            if (labels.get(key) in allowed) != (op == "in") or (op == "in" and key not in labels):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_matches(obj: Mapping[str, Any], selector: str) -> bool:
    for term in _split_selector(selector):
        if "!=" in term:
            path, value = term.split("!=", 1)
            if _dig(obj, path.strip()) == value.strip():
                return False
        else:
            path, value = term.replace("==", "=").split("=", 1)
            if _dig(obj, path.strip()) != value.strip():
                return False
    return True


def write_kubeconfig(url: str, path: Path) -> Path:
    """A kubeconfig pointing at the API server at `url` (no credentials)."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{url}"}}}}]
users: [{{name: nobody, user: {{}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: nobody}}}}]
current-context: fake
""")
    return path


def _request_label(method: str, path: str, watch: bool) -> str:
    """`request_counts`' key of a request: the verb and what it is on, without names or namespaces."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(rest) >= 2 and rest[0] == "namespaces":
        rest = rest[2:]
    what = rest[0] if rest else "?"
    if len(rest) >= 3:
        what = f"{what}/{rest[2]}"
    if method == "GET" and (watch or len(rest) == 1):
        what = f"{what} ({'watch' if watch else 'list'})"
    return f"{method} {what}"


@dataclass(frozen=True)
class Route:
    group: str
    version: str
    plural: str
    namespace: str | None  # None: cluster-scoped or all namespaces
    name: str
    sub: str

    @property
    def resource(self) -> tuple[str, str]:
        return self.group, self.plural

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace is not None else self.name


def parse_route(path: str) -> Route:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise HttpAnswer(404, "NotFound", f"the server could not find the requested resource ({path})")
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise HttpAnswer(404, "NotFound", f"the server could not find the requested resource ({path})")
    plural = rest[0]
    known = (group, plural) in BUILTIN or group == CUSTOM_GROUP
    if not known:
        raise HttpAnswer(404, "NotFound", f"the server could not find the requested resource ({path})")
    return Route(group, version, plural, namespace, rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else "")


@dataclass
class Event:
    rv: int
    resource: tuple[str, str]
    type: str
    obj: JsonObject
    old: JsonObject | None
    raw: bytes
    """`obj` encoded (it was decoded from this: the snapshot and every watcher's line share one encoding)."""

    def line(self, type_: str) -> bytes:
        """The watch line of this event as `type_` (ADDED, MODIFIED, DELETED)."""
        return b'{"type": "%s", "object": %s}\n' % (type_.encode(), self.raw)


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    reason: str
    times: int


@dataclass
class _Stream:
    dropped: bool = False
    expired: bool = False


@dataclass
class _ListSnapshot:
    items: list[JsonObject]
    rv: int
    offset: int = 0
    created: float = field(default_factory=time.monotonic)


class FakeApiServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 (a free port) with test hooks.

    `pod_deletion_delay_s`: how long a bound pod stays terminating after a DELETE or an eviction (0: deleted at
    once, though watchers still see the MODIFIED event with `deletionTimestamp` first; None: until
    `finish_deletion`). Unbound pods are deleted at once, as on a real cluster.
    """

    def __init__(self, *, pod_deletion_delay_s: float | None = 0.0, bookmark_interval_s: float | None = None,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC), keep_requests: bool = True) -> None:
        self.pod_deletion_delay_s = pod_deletion_delay_s
        self.keep_requests = keep_requests
        """Log every request with its body in `requests` (tests); counts (`request_counts`) are always kept."""
        self.bookmark_interval_s = bookmark_interval_s
        self._now = now
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        """Notified on every write (`wait_for`) and on whatever ends watches."""
        self._resource_changed: dict[tuple[str, str], threading.Condition] = {}
        """Per resource, notified on its writes: a watch waits on its own resource's, so a pod write wakes the
        pod watchers only."""
        self._stamp: tuple[datetime, str] | None = None
        self._rv = 0
        self._uids = itertools.count(1)
        self._store: dict[tuple[str, str], dict[str, JsonObject]] = {}
        self._history: list[Event] = []
        self._compacted_rv = 0
        self._streams: list[_Stream] = []
        self._faults: list[_Fault] = []
        self._blocked: dict[str, int | None] = {}
        self._multi_pdb: set[str] = set()
        self._snapshots: dict[str, _ListSnapshot] = {}
        self._snapshot_ids = itertools.count(1)
        self._stopping = False
        self.requests: list[tuple[str, str, Any]] = []
        self._counts: Counter[str] = Counter()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._api: RestKubeApi | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        server = self

        class Handler(_Handler):
            fake = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-apiserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._api is not None:
            self._api.close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "start the server first"
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig pointing at this server (no credentials), for commands run as a user would."""
        return write_kubeconfig(self.url, path)

    @property
    def api(self) -> RestKubeApi:
        if self._api is None:
            self._api = RestKubeApi.from_url(self.url, request_timeout_s=10.0, page_size=50)
        return self._api

    # -- test hooks --------------------------------------------------------------------------------------------

    def add_node(self, obj: Mapping[str, Any]) -> JsonObject:
        return copy.deepcopy(self._write_new(("", "nodes"), None, obj))

    def add_pod(self, obj: Mapping[str, Any]) -> JsonObject:
        """Stores the pod as given (status included); namespace defaults to `default`."""
        return copy.deepcopy(self._write_new(("", "pods"), obj.get("metadata", {}).get("namespace") or "default",
                                             obj))

    def add_object(self, path: str, obj: Mapping[str, Any]) -> JsonObject:
        """Stores any object under its collection path (e.g. `/apis/apps/v1/namespaces/ns/deployments`)."""
        route = parse_route(path)
        return copy.deepcopy(self._write_new(route.resource, route.namespace, obj))

    def get(self, kind: str, key: str) -> JsonObject | None:
        """A copy of the stored object: kind `pods`/`Pod`/`nodes`/a custom plural, key `ns/name` or `name`."""
        plural = KIND_ALIASES.get(kind.lower(), kind.lower())
        with self._lock:
            for (_, stored_plural), objects in self._store.items():
                if stored_plural == plural and key in objects:
                    return copy.deepcopy(objects[key])
        return None

    def wait_for(self, kind: str, key: str, predicate: Callable[[JsonObject | None], bool],
                 timeout_s: float) -> JsonObject | None:
        """Block until the stored object (None while absent) satisfies `predicate`, checked after every write;
        a copy of it then. TimeoutError after `timeout_s`."""
        plural = KIND_ALIASES.get(kind.lower(), kind.lower())
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                obj = next((objects[key] for (_, p), objects in self._store.items() if p == plural and key in objects),
                           None)
                if predicate(obj):
                    return copy.deepcopy(obj)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{kind} {key}: not there within {timeout_s:g} s")
                self._changed.wait(left)

    def keys(self, kind: str) -> list[str]:
        plural = KIND_ALIASES.get(kind.lower(), kind.lower())
        with self._lock:
            return sorted(k for (_, p), objects in self._store.items() if p == plural for k in objects)

    def set_pod_phase(self, key: str, phase: str, reason: str = "") -> JsonObject:
        def change(pod: JsonObject) -> None:
            pod.setdefault("status", {})["phase"] = phase
            if reason:
                pod["status"]["reason"] = reason

        return self.mutate("pods", key, change)

    def mutate(self, kind: str, key: str, change: Callable[[JsonObject], None]) -> JsonObject:
        """Change a stored object in place as a controller would (a MODIFIED event, a new resourceVersion)."""
        plural = KIND_ALIASES.get(kind.lower(), kind.lower())
        with self._lock:
            for resource, objects in self._store.items():
                if resource[1] == plural and key in objects:
                    new = copy.deepcopy(objects[key])
                    change(new)
                    return copy.deepcopy(self._commit(resource, key, "MODIFIED", new))
        raise KeyError(f"{kind} {key}")

    def fail_next(self, method: str, path_regex: str, status: int, reason: str, times: int = 1) -> None:
        """The next `times` requests whose method and path (no query) match answer `status` with a Status."""
        with self._lock:
            self._faults.append(_Fault(method.upper(), re.compile(path_regex), status, reason, times))

    def block_eviction(self, key: str, times: int | None = None) -> None:
        """Evictions of pod `ns/name` answer 429 (cause DisruptionBudget) `times` times, or always (None)."""
        with self._lock:
            self._blocked[key] = times

    def unblock_eviction(self, key: str) -> None:
        with self._lock:
            self._blocked.pop(key, None)

    def several_pdbs(self, key: str) -> None:
        """Evictions of pod `ns/name` answer 500: more than one PodDisruptionBudget matches it."""
        with self._lock:
            self._multi_pdb.add(key)

    def finish_deletion(self, key: str) -> None:
        with self._lock:
            if key in self._store.get(("", "pods"), {}):
                self._remove(("", "pods"), key)

    def compact(self) -> None:
        """Drop the event history: resuming from any older resourceVersion now answers 410 Gone, and open
        watches get an ERROR event with code 410."""
        with self._lock:
            self._compacted_rv = self._rv
            self._history.clear()
            self._snapshots.clear()
            for stream in self._streams:
                stream.expired = True
            self._wake_all()

    def drop_watches(self) -> None:
        """Break every open watch connection (no terminating chunk), as a failing load balancer would."""
        with self._lock:
            for stream in self._streams:
                stream.dropped = True
            self._wake_all()

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    @property
    def open_watches(self) -> int:
        with self._lock:
            return len(self._streams)

    def request_counts(self) -> dict[str, int]:
        """Requests so far by `VERB resource[/subresource]`, GETs marked `(list)` or `(watch)` unless of one
        object: e.g. `{"POST pods": 3, "PATCH pods": 3, "POST pods/binding": 3, "GET pods (watch)": 1}`."""
        with self._lock:
            return dict(self._counts)

    def requests_to(self, path_regex: str, method: str | None = None) -> list[tuple[str, str, Any]]:
        pattern = re.compile(path_regex)
        with self._lock:
            return [r for r in self.requests if pattern.search(r[1]) and (method is None or r[0] == method)]

    # -- store -------------------------------------------------------------------------------------------------

    def _timestamp(self) -> str:
        now = self._now().replace(microsecond=0)
        if self._stamp is None or self._stamp[0] != now:
            self._stamp = (now, now.strftime("%Y-%m-%dT%H:%M:%SZ"))
        return self._stamp[1]

    def _changed_of(self, resource: tuple[str, str]) -> threading.Condition:
        condition = self._resource_changed.get(resource)
        if condition is None:
            condition = self._resource_changed[resource] = threading.Condition(self._lock)
        return condition

    def _wake(self, resource: tuple[str, str]) -> None:
        self._changed.notify_all()
        condition = self._resource_changed.get(resource)
        if condition is not None:
            condition.notify_all()

    def _wake_all(self) -> None:
        self._changed.notify_all()
        for condition in self._resource_changed.values():
            condition.notify_all()

    def _write_new(self, resource: tuple[str, str], namespace: str | None, obj: Mapping[str, Any], *,
                   owned: bool = False) -> JsonObject:
        """Create `obj` (`owned`: the caller's to give away, a request body just parsed; else copied)."""
        new = dict(obj) if owned else copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{next(self._uids):05x}"
        if not meta.get("name"):
            raise HttpAnswer(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        if namespace is not None:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise HttpAnswer(400, "BadRequest", "the namespace of the provided object does not match the "
                                                    "namespace sent on the request")
            meta["namespace"] = namespace
        key = f"{namespace}/{meta['name']}" if namespace is not None else str(meta["name"])
        with self._lock:
            if key in self._store.get(resource, {}):
                raise HttpAnswer(409, "AlreadyExists", f'{resource[1]} "{meta["name"]}" already exists',
                                 {"name": meta["name"], "kind": resource[1]})
            kind_version = BUILTIN.get(resource)
            if kind_version:
                new["kind"], new["apiVersion"] = kind_version
            meta["uid"] = str(meta.get("uid") or f"00000000-0000-4000-8000-{next(self._uids):012d}")
            meta["creationTimestamp"] = meta.get("creationTimestamp") or self._timestamp()
            meta["generation"] = 1
            meta.pop("deletionTimestamp", None)
            return self._commit(resource, key, "ADDED", new)

    def _commit(self, resource: tuple[str, str], key: str, event_type: str, new: JsonObject) -> JsonObject:
        """Store `new` under a fresh resourceVersion and record the event (lock held). Returns the event's
        snapshot of the object, which nothing may change (it is what watchers are sent): answer with it, or copy
        it before handing it out."""
        self._rv += 1
        new.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        objects = self._store.setdefault(resource, {})
        old = objects.get(key)
        objects[key] = new
        raw = json.dumps(new).encode()
        snapshot: JsonObject = json.loads(raw)  # a deep copy, and the encoding every watcher is sent
        self._history.append(Event(self._rv, resource, event_type, snapshot, old, raw))
        self._wake(resource)
        return snapshot

    def _remove(self, resource: tuple[str, str], key: str) -> JsonObject:
        """Delete an object; the DELETED event carries the last state with a fresh resourceVersion."""
        old = self._store[resource].pop(key)
        self._rv += 1
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self._rv)
        raw = json.dumps(final).encode()
        self._history.append(Event(self._rv, resource, "DELETED", json.loads(raw), old, raw))
        self._wake(resource)
        return final

    def _lookup(self, route: Route) -> JsonObject:
        obj = self._store.get(route.resource, {}).get(route.key)
        if obj is None:
            raise HttpAnswer(404, "NotFound", f'{route.plural} "{route.name}" not found',
                             {"name": route.name, "kind": route.plural})
        return obj

    # -- request handling (called by the handler thread) -------------------------------------------------------

    def record(self, method: str, path: str, body: Any, *, watch: bool = False) -> None:
        """Log and count a request and answer an injected failure if one matches."""
        with self._lock:
            self._counts[_request_label(method, path, watch)] += 1
            if self.keep_requests:
                self.requests.append((method, path, copy.deepcopy(body)))
            for fault in self._faults:
                if fault.times > 0 and fault.method == method and fault.path.search(path):
                    fault.times -= 1
                    raise HttpAnswer(fault.status, fault.reason, f"injected failure for {method} {path}")

    def handle(self, method: str, path: str, query: Mapping[str, str], body: Any,
               content_type: str) -> tuple[int, Any]:
        self.record(method, path, body)
        route = parse_route(path)
        with self._lock:
            if method == "GET" and not route.name:
                return 200, self._list(route, query)
            if method == "GET":
                obj = self._lookup(route)
                return 200, self._scale_of(obj) if route.sub == "scale" else copy.deepcopy(obj)
            if method == "POST" and route.sub == "binding":
                return self._bind(route, body)
            if method == "POST" and route.sub == "eviction":
                return self._evict(route, body)
            if method == "POST" and not route.name:
                if not isinstance(body, dict):
                    raise HttpAnswer(400, "BadRequest", "the request body is not an object")
                body.get("metadata", {}).pop("resourceVersion", None)
                if route.plural == "pods":
                    body["status"] = {"phase": "Pending"}
                return 201, self._encoded(self._write_new(route.resource, route.namespace, body, owned=True))
            if method in ("PUT", "PATCH") and route.name:
                return 200, self._encoded(self._update(route, method, body, content_type))
            if method == "DELETE" and route.name and not route.sub:
                return 200, self._delete(route, body)
        raise HttpAnswer(405, "MethodNotAllowed", f"{method} is not supported on {path}")

    def _encoded(self, answer: JsonObject) -> JsonObject | bytes:
        """The last event's encoding when `answer` is its snapshot (a write's answer: not encoded twice)."""
        last = self._history[-1] if self._history else None
        return last.raw if last is not None and last.obj is answer else answer

    def _list(self, route: Route, query: Mapping[str, str]) -> JsonObject:
        token = query.get("continue", "")
        limit = int(query.get("limit") or 0)
        if token:
            snapshot = self._snapshots.get(token)
            if snapshot is None:
                raise HttpAnswer(410, "Expired", "The provided continue parameter is too old to display a "
                                                 "consistent list result. You can start a new list without the "
                                                 "continue parameter.")
        else:
            items = [copy.deepcopy(o) for k, o in sorted(self._store.get(route.resource, {}).items())
                     if self._matches(route, o, query)]
            snapshot = _ListSnapshot(items, self._rv)
        page = snapshot.items[snapshot.offset:snapshot.offset + limit] if limit else snapshot.items[snapshot.offset:]
        snapshot.offset += len(page)
        meta: JsonObject = {"resourceVersion": str(snapshot.rv)}
        self._snapshots.pop(token, None)
        if snapshot.offset < len(snapshot.items):
            next_token = f"c{next(self._snapshot_ids)}"
            self._snapshots[next_token] = snapshot
            meta["continue"] = next_token
            meta["remainingItemCount"] = len(snapshot.items) - snapshot.offset
        kind = BUILTIN.get(route.resource, (route.plural.capitalize(), f"{route.group}/{route.version}"))
        return {"kind": f"{kind[0]}List", "apiVersion": kind[1], "metadata": meta, "items": page}

    @staticmethod
    def _matches(route: Route, obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
        meta = obj.get("metadata", {})
        if route.namespace is not None and meta.get("namespace") != route.namespace:
            return False
        if query.get("labelSelector") and not label_matches(meta.get("labels") or {}, query["labelSelector"]):
            return False
        return not (query.get("fieldSelector") and not field_matches(obj, query["fieldSelector"]))

    def _update(self, route: Route, method: str, body: Any, content_type: str) -> JsonObject:
        current = self._lookup(route)
        if route.sub == "scale":
            return self._update_scale(route, current, method, body, content_type)
        if route.sub not in ("", "status"):
            raise HttpAnswer(404, "NotFound", f"no subresource {route.sub}")
        if method == "PUT":
            if not isinstance(body, dict):
                raise HttpAnswer(400, "BadRequest", "the request body is not an object")
            candidate = copy.deepcopy(body)
        else:
            candidate = self._apply_patch(current, body, content_type)
        meta = candidate.setdefault("metadata", {})
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv and str(wanted_rv) != current["metadata"]["resourceVersion"]:
            raise HttpAnswer(409, "Conflict", f'Operation cannot be fulfilled on {route.plural} "{route.name}": the '
                                              "object has been modified; please apply your changes to the latest "
                                              "version and try again", {"name": route.name, "kind": route.plural})
        if meta.get("name", route.name) != route.name:
            raise HttpAnswer(400, "BadRequest", "the name of the object does not match the name on the URL")
        for fixed in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if fixed in current["metadata"]:
                meta[fixed] = current["metadata"][fixed]
            else:
                meta.pop(fixed, None)
        if route.sub == "status":  # the status subresource changes status only
            new = copy.deepcopy(current)
            new["status"] = candidate.get("status", {})
        else:  # the main resource never changes status (status subresource on every type served here)
            new = candidate
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
            else:
                new.pop("status", None)
        if route.resource == ("", "pods") and route.sub == "" and _resources(new) != _resources(current):
            # ValidatePodUpdate: a pod's containers keep their resources (only the resize subresource changes
            # them, and only cpu and memory), so no scheduler can add a device request after creation.
            raise HttpAnswer(422, "Invalid", f'Pod "{route.name}" is invalid: spec: Forbidden: {POD_UPDATE_RULE}')
        # metadata.generation counts changes of the desired state (spec) only, as the API server does.
        generation = int(current["metadata"].get("generation", 1))
        new["metadata"]["generation"] = generation + 1 if new.get("spec") != current.get("spec") else generation
        kind_version = BUILTIN.get(route.resource)
        if kind_version:
            new["kind"], new["apiVersion"] = kind_version
        return self._commit(route.resource, route.key, "MODIFIED", new)

    @staticmethod
    def _apply_patch(current: JsonObject, body: Any, content_type: str) -> JsonObject:
        if content_type.startswith("application/json-patch+json"):
            try:
                patched = jsonpatch.apply_patch(current, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise HttpAnswer(422, "Invalid", f"the JSON patch could not be applied: {exc}") from exc
            return patched if isinstance(patched, dict) else {}
        if content_type.startswith(("application/merge-patch+json", "application/strategic-merge-patch+json")):
            # Strategic merge is applied as a merge patch: maps merge, lists are replaced whole.
            patched = merge_patch(current, body)
            patched.setdefault("metadata", {}).pop("resourceVersion", None)
            if isinstance(body, dict) and "resourceVersion" in (body.get("metadata") or {}):
                patched["metadata"]["resourceVersion"] = body["metadata"]["resourceVersion"]
            return dict(patched)
        raise HttpAnswer(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                      f"accepted media types include: application/json-patch+json, "
                                                      f"application/merge-patch+json ({content_type})")

    def _scale_of(self, deployment: JsonObject) -> JsonObject:
        meta = deployment["metadata"]
        replicas = int(deployment.get("spec", {}).get("replicas", 1))
        status = deployment.get("status", {})
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp") if k in meta},
                "spec": {"replicas": replicas},
                "status": {"replicas": int(status.get("replicas", 0))}}

    def _update_scale(self, route: Route, current: JsonObject, method: str, body: Any,
                      content_type: str) -> JsonObject:
        if route.plural not in SCALABLE:
            raise HttpAnswer(404, "NotFound", f"{route.plural} have no scale subresource")
        scale = self._scale_of(current)
        if method == "PUT":
            candidate = body if isinstance(body, dict) else {}
            wanted_rv = candidate.get("metadata", {}).get("resourceVersion")
            if wanted_rv and str(wanted_rv) != current["metadata"]["resourceVersion"]:
                raise HttpAnswer(409, "Conflict", f'Operation cannot be fulfilled on deployments.apps "{route.name}"'
                                                  ": the object has been modified; please apply your changes to the "
                                                  "latest version and try again")
        else:
            candidate = self._apply_patch(scale, body, content_type)
        replicas = candidate.get("spec", {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise HttpAnswer(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}: must be greater than or "
                                             "equal to 0")
        new = copy.deepcopy(current)
        new.setdefault("spec", {})["replicas"] = replicas
        new["metadata"]["generation"] = int(new["metadata"].get("generation", 1)) + 1
        return self._scale_of(self._commit(route.resource, route.key, "MODIFIED", new))

    def _bind(self, route: Route, body: Any) -> tuple[int, Any]:
        if route.plural != "pods":
            raise HttpAnswer(404, "NotFound", f"{route.plural} have no binding subresource")
        pod = self._lookup(route)
        target = (body or {}).get("target", {}) if isinstance(body, dict) else {}
        node = target.get("name")
        if not node:
            raise HttpAnswer(400, "BadRequest", "Binding target.name: Required value")
        if (body.get("metadata") or {}).get("name", route.name) != route.name:
            raise HttpAnswer(400, "BadRequest", "the name of the binding does not match the pod")
        bound = pod.get("spec", {}).get("nodeName")
        if bound:
            raise HttpAnswer(409, "Conflict", f'Operation cannot be fulfilled on pods/binding "{route.name}": pod '
                                              f"{route.name} is already assigned to node \"{bound}\"")
        if pod["metadata"].get("deletionTimestamp"):
            raise HttpAnswer(409, "Conflict", f"pod {route.name} is being deleted, cannot be assigned to a host")
        new = copy.deepcopy(pod)
        new.setdefault("spec", {})["nodeName"] = node
        conditions = [c for c in new.setdefault("status", {}).get("conditions", []) if c.get("type") != "PodScheduled"]
        new["status"]["conditions"] = [*conditions, {"type": "PodScheduled", "status": "True",
                                                     "lastTransitionTime": self._timestamp()}]
        self._commit(route.resource, route.key, "MODIFIED", new)
        return 201, status_body(201, "", "")

    def _evict(self, route: Route, body: Any) -> tuple[int, Any]:
        if route.plural != "pods":
            raise HttpAnswer(404, "NotFound", f"{route.plural} have no eviction subresource")
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != route.name:
            raise HttpAnswer(400, "BadRequest", "name in URL does not match name in Eviction object")
        pod = self._lookup(route)
        terminating = bool(pod["metadata"].get("deletionTimestamp"))
        if route.key in self._multi_pdb and not terminating:
            raise HttpAnswer(500, "InternalError", "This pod has more than one PodDisruptionBudget, which the "
                                                   "eviction subresource does not support.")
        if route.key in self._blocked and not terminating:
            left = self._blocked[route.key]
            if left is None or left > 0:
                if left is not None:
                    self._blocked[route.key] = left - 1
                raise HttpAnswer(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption "
                                                         "budget.",
                                 {"causes": [{"reason": "DisruptionBudget",
                                              "message": "The disruption budget gpuplane-pdb needs 1 healthy pods "
                                                         "and has 1 currently"}]})
        grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
        self._delete(route, {"gracePeriodSeconds": grace} if grace is not None else None)
        return 201, status_body(201, "", "")

    def _delete(self, route: Route, body: Any) -> JsonObject:
        obj = self._lookup(route)
        if route.plural != "pods":
            return self._remove(route.resource, route.key)
        grace = (body or {}).get("gracePeriodSeconds") if isinstance(body, dict) else None
        if obj["metadata"].get("deletionTimestamp") and grace != 0:  # 0 cuts a running grace short, as upstream
            return copy.deepcopy(obj)
        if not obj.get("spec", {}).get("nodeName") or grace == 0:
            return self._remove(route.resource, route.key)
        new = copy.deepcopy(obj)
        new["metadata"]["deletionTimestamp"] = self._timestamp()
        new["metadata"]["deletionGracePeriodSeconds"] = 30 if grace is None else int(grace)
        terminating = self._commit(route.resource, route.key, "MODIFIED", new)
        delay = self.pod_deletion_delay_s
        if delay == 0:
            self._remove(route.resource, route.key)
        elif delay is not None:
            timer = threading.Timer(delay, self.finish_deletion, args=(route.key,))
            timer.daemon = True
            timer.start()
        return terminating

    # -- watch -------------------------------------------------------------------------------------------------

    def open_watch(self, route: Route, query: Mapping[str, str]) -> tuple[bytes, int]:
        """The events a new watch starts with (encoded) and the resourceVersion it continues from;
        HttpAnswer(410) when the requested resourceVersion is older than the retained history (HTTP 410)."""
        requested = query.get("resourceVersion", "")
        with self._lock:
            if requested in ("", "0"):
                return b"".join(json.dumps({"type": "ADDED", "object": o}).encode() + b"\n"
                                for _, o in sorted(self._store.get(route.resource, {}).items())
                                if self._matches(route, o, query)), self._rv
            position = int(requested)
            if position < self._compacted_rv:
                raise HttpAnswer(410, "Expired", f"too old resource version: {position} ({self._compacted_rv})")
            return b"", position

    def follow(self, route: Route, query: Mapping[str, str], stream: _Stream,
               position: int) -> Iterator[bytes | None]:
        """Batches of watch events after `position`, as encoded lines; None means 'break the connection'."""
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        last_bookmark = time.monotonic()
        while True:
            out, position, finished, bookmarked = self._next_events(route, query, stream, position, deadline,
                                                                    bookmarks, last_bookmark)
            if bookmarked:
                last_bookmark = time.monotonic()
            if out:
                yield out
            if finished:
                if out is not None:
                    return
                yield None
                return

    def _next_events(self, route: Route, query: Mapping[str, str], stream: _Stream, position: int, deadline: float,
                     bookmarks: bool, last_bookmark: float) -> tuple[bytes | None, int, bool, bool]:
        """The next events for a watcher at `position`, encoded (waiting for some; never written under the lock),
        its new position, whether the stream ends after them, and whether they are a bookmark. None for the
        events means 'break the connection'."""
        with self._lock:
            while True:
                if stream.dropped:
                    return None, position, True, False
                if stream.expired:
                    error = {"type": "ERROR", "object": status_body(
                        410, "Expired", f"The resourceVersion for the provided watch is too old ({position}).")}
                    return json.dumps(error).encode() + b"\n", position, True, False
                if self._stopping:
                    return b"", position, True, False
                batch = self._events_after(position)
                if batch:
                    out = b"".join(line for line in (self._translate(route, query, e) for e in batch) if line)
                    position = batch[-1].rv
                    if out:
                        return out, position, False, False
                    continue  # nothing for this watcher in the batch
                now = time.monotonic()
                if now >= deadline:
                    return (self._bookmark(route, self._rv) if bookmarks else b""), self._rv, True, bookmarks
                interval = self.bookmark_interval_s
                if bookmarks and interval is not None and now - last_bookmark >= interval:
                    return self._bookmark(route, self._rv), self._rv, False, True
                self._changed_of(route.resource).wait(0.05)

    def _events_after(self, position: int) -> list[Event]:
        index = bisect.bisect_right(self._history, position, key=lambda e: e.rv)
        return self._history[index:]

    @staticmethod
    def _bookmark(route: Route, position: int) -> bytes:
        kind, version = BUILTIN.get(route.resource, (route.plural, f"{route.group}/{route.version}"))
        return json.dumps({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": version,
                                                          "metadata": {"resourceVersion": str(position)}}}).encode() \
            + b"\n"

    def _translate(self, route: Route, query: Mapping[str, str], event: Event) -> bytes | None:
        """An event as this watcher sees it (its encoded line): objects entering or leaving its selectors are
        ADDED or DELETED."""
        if event.resource != route.resource:
            return None
        now_in = self._matches(route, event.obj, query)
        was_in = event.old is not None and self._matches(route, event.old, query)
        if event.type == "MODIFIED" and now_in != was_in:
            return event.line("ADDED" if now_in else "DELETED")
        if event.type == "DELETED":
            return event.line("DELETED") if was_in else None
        return event.line(event.type) if now_in else None

    def open_stream(self) -> _Stream:
        stream = _Stream()
        with self._lock:
            self._streams.append(stream)
        return stream

    def close_stream(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.remove(stream)


_PHRASES = {status.value: status.phrase for status in HTTPStatus}
_MAX_LINE = 65536
_MAX_HEADERS = 100


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeApiServer
    raw_requestline: bytes  # set by handle_one_request before parse_request

    def setup(self) -> None:
        super().setup()
        # Headers and body leave in separate writes: without this, Nagle + delayed ACK cost 40 ms a request.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        return

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):  # the client went away between requests
            self.close_connection = True

    def parse_request(self) -> bool:
        """HTTP/1.1 requests with a plain header reader (the stdlib's email parser costs more than most of the
        requests served here); anything else as the stdlib parses it."""
        words = self.raw_requestline.decode("iso-8859-1").rstrip("\r\n").split()
        if len(words) != 3 or words[2] != "HTTP/1.1":
            return super().parse_request()
        self.command, self.path, self.request_version = words
        self.requestline = " ".join(words)
        headers = Message()
        while True:
            line = self.rfile.readline(_MAX_LINE + 1)
            if len(line) > _MAX_LINE or len(headers) >= _MAX_HEADERS:
                self.send_error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long or too many headers")
                return False
            if line in (b"\r\n", b"\n", b""):
                break
            name, colon, value = line.decode("iso-8859-1").partition(":")
            if not colon:
                self.send_error(HTTPStatus.BAD_REQUEST, f"Bad header line {line[:80]!r}")
                return False
            headers[name.strip()] = value.strip()
        self.headers = headers
        self.close_connection = headers.get("Connection", "").lower() == "close"
        if headers.get("Expect", "").lower() == "100-continue":
            return self.handle_expect_100()
        return True

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return None
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise HttpAnswer(400, "BadRequest", f"the request body is not JSON: {exc}") from exc

    def _send(self, code: int, body: Any) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        # Status line, headers and body in one write (send_response + end_headers would make two).
        head = f"{self.protocol_version} {code} {_PHRASES.get(code, '')}\r\nContent-Type: application/json\r\n" \
               f"Content-Length: {len(payload)}\r\n\r\n"
        self.wfile.write(head.encode() + payload)

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        try:
            body = self._body()
            if method == "GET" and query.get("watch") in ("1", "true"):
                self._watch(parts.path, query)
                return
            code, answer = self.fake.handle(method, parts.path, query, body, self.headers.get("Content-Type") or "")
        except HttpAnswer as answer_error:
            self._send(answer_error.code, answer_error.body)
            return
        self._send(code, answer)

    def _watch(self, path: str, query: Mapping[str, str]) -> None:
        self.fake.record("GET", path, None, watch=True)
        route = parse_route(path)
        stream = self.fake.open_stream()
        try:
            initial, position = self.fake.open_watch(route, query)
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            for lines in itertools.chain([initial] if initial else [], self.fake.follow(route, query, stream,
                                                                                        position)):
                if lines is None:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(lines), lines))  # one chunk per batch of events
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            self.fake.close_stream(stream)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")


# ------------------------------------------------------------------ fixture objects
def node_json(name: str, *, model: str | None = "A100-40GB", cards: int = 8, cpu: str = "64",
              memory: str = "256Gi", labels: Mapping[str, str] | None = None,
              taints: list[dict[str, str]] | None = None, unschedulable: bool = False,
              mig_mode: str = "dynamic") -> JsonObject:
    """A node as the node agent leaves it: allocatable CPU/memory and the `gpuplane.io/gpu-inventory` annotation."""
    annotations: dict[str, str] = {}
    if model is not None and cards:
        doc = {"model": model, "migMode": mig_mode, "split": 10,
               "cards": [{"index": i, "uuid": f"GPU-{name}-{i}", "numa": i * 2 // cards, "pcieSwitch": i // 2}
                         for i in range(cards)]}
        annotations["gpuplane.io/gpu-inventory"] = json.dumps(doc, separators=(",", ":"), sort_keys=True)
    spec: JsonObject = {}
    if taints:
        spec["taints"] = taints
    if unschedulable:
        spec["unschedulable"] = True
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                         "annotations": annotations},
            "spec": spec,
            "status": {"allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
                       "capacity": {"cpu": cpu, "memory": memory, "pods": "110"}}}


def pod_json(name: str, *, namespace: str = "default", limits: Mapping[str, str] | None = None,
             annotations: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None,
             node: str | None = None, phase: str = "Pending") -> JsonObject:
    """A pod with one container asking for `limits` (e.g. `{"gpuplane.io/gpu": "1"}`)."""
    spec: JsonObject = {"schedulerName": "gpuplane-scheduler",
                        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                        "resources": {"limits": dict(limits or {})}}]}
    if node is not None:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {}),
                         "annotations": dict(annotations or {})},
            "spec": spec, "status": {"phase": phase}}
