"""kube-scheduler's HTTP extender, backed by gpuplane's scheduler (`gpuplane extender`).

kube-scheduler keeps its own queue, filters and scoring and calls out to us (`POST <urlPrefix>/<verb>`,
wire types in `../shared/reference/protocols.md` §1): `filter` drops nodes whose cards cannot hold the pod,
`prioritize` scores the survivors by the configured gpuplane policy, `bind` chooses the cards on the node
kube-scheduler picked and binds through the cluster port (which records the card assignment on the pod
before the Binding), `preempt` vetoes or trims kube-scheduler's victims by our card-level view.

Answers, per verb:

- filter: always HTTP 200 with an `ExtenderFilterResult`; a body we cannot read (not JSON, wrong shape, a
  pod `gpuplane.kube.objects` rejects) comes back as `Error` set, which kube-scheduler reports as a filter
  error for that pod. A request that names nodes (`NodeNames`, nodeCacheCapable) is answered with names and
  `Nodes` null; one that sends `Nodes` objects is answered with the passing objects and `NodeNames` null;
  every rejected node is listed under `FailedNodes` (preemption may help) or `FailedAndUnresolvableNodes`
  (it cannot: wrong model, a topology rule, a node not in our cache) with the framework's reason.
  What passes depends on `FilterAnswers`:
  - `chosen` (the default): only the node gpuplane's scheduler picks among the nodes sent, exactly as the
    simulator decides (the same framework call, so the same random draws). kube-scheduler, left with one
    feasible node, skips scoring and binds there, so its own scorers cannot override the policy. The other
    nodes that fit are listed under `FailedAndUnresolvableNodes` ("gpuplane placed the pod on <node>"):
    preemption must never evict anything on a node where the pod fits as it is. The decision (node and cards)
    is kept per pod UID, resourceVersion, node set and cache generation: the same question gets the same
    answer without a second draw, prioritize scores the chosen node 10 and the rest 0, and bind takes the
    cards decided at filter if they still fit (else it decides again on that node). A pod with a nominated
    node is first filtered on that node alone; the pod is then placed there if it fits, as kube-scheduler
    does. With no node fitting, every node keeps its reason and preempt works as before.
  - `feasible`: every node that fits passes, and kube-scheduler's scorers weigh in beside ours.
- prioritize: HTTP 200 with a bare `HostPriorityList`, one entry per node sent, in the order sent. The
  framework's weighted score of each feasible node is mapped onto kube-scheduler's 0…10 by min-max over the
  feasible nodes of the request, `round(10 × (s − min) / (max − min))` (all 10 when they tie): the best node
  gets 10, the worst 0, so the policy's preference survives however narrow its spread (an absolute mapping
  would round FGD's small differences to one value). Infeasible and unknown nodes get 0. A body we cannot
  read: HTTP 400 with `{"Error": …}` (the type has no error field; kube-scheduler logs and ignores it).
  In `chosen` mode the decision of the filter is scored instead (chosen 10, others 0; no random draw).
- bind: HTTP 200 with `ExtenderBindingResult`; any failure (unknown pod or node, no longer fits, the port
  refused) is in `Error`, which fails the bind; kube-scheduler then retries the pod.
- preempt: HTTP 200 with `NodeNameToMetaVictims` (UIDs only). A candidate node is kept only if removing its
  victims from our view lets the pod fit there; then the victims we hold on that node are reprieved, most
  valuable first, while it still fits (kube-scheduler sees GPUs as a plain count and may ask for more than
  the cards need). Victims outside our view (no GPU, unknown) are passed through; a node with a victim UID we
  cannot name is passed through as sent (we cannot judge it). `NumPDBViolations` is passed through (an upper
  bound once trimmed). A body we cannot read: HTTP 400 with `{"Error": …}` (this candidate set fails).

Constraints the core does not implement (`PodRequest.unsupported`: inter-pod affinity, topology spread, volumes,
host ports, other resources) do not refuse a pod here: kube-scheduler's own plugins have already applied them to
the nodes it sends.

Anything else: 404 (unknown path), 405 (not POST), 411 (no Content-Length), 413 (body over the limit), 400 (a
bad Content-Length). A bug inside a verb is logged and answered 500 with `{"Error": …}`, never a traceback.
Go decodes JSON keys case-insensitively (the last matching key wins); we read them the same way and always
write the exact Go names.

Concurrency: the scheduler's cache is guarded by one lock (`state_lock`), taken by every verb and by the
port's watch events (delivered through a wrapper that takes it). Binds run under a second lock
(`port_lock`, serialising calls into the port) *outside* the state lock: the cards are decided and assumed
in the cache under the state lock, so filters never wait for an API round trip, and a failed bind gives
the reservation back. Holding the port lock, a bind first checks that its reservation still stands (a rebuild of
the cache drops those that no longer fit) and fails if not. Lock order is port, then state.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from gpuplane.controllers.observer import ClusterObserver, scheduler_counters
from gpuplane.kube.objects import MANAGED_RESOURCES, RES_GPU, SCHEDULER_NAME, ObjectError, object_key, pod_request
from gpuplane.kube.observed import OwnPods, PortView
from gpuplane.model import Assignment, Catalog, NodeSpec, PodRequest
from gpuplane.port import ClusterPort, PodPhase, Status
from gpuplane.port.metrics import NULL_RECORDER, PlaneMetrics, Recorder
from gpuplane.scheduler import CycleState, Decision, Diagnosis, Outcome, Profile, Scheduler, SchedulingRules

log = logging.getLogger(__name__)

MAX_EXTENDER_PRIORITY = 10
"""kube-scheduler's `MaxExtenderPriority`: prioritize scores run 0…10."""
VERBS = ("filter", "prioritize", "bind", "preempt")
DEFAULT_PREFIX = "/gpuplane"
DEFAULT_PORT = 8888
MAX_BODY = 256 << 20
"""Bytes a request body may have: a 5,000-node `NodeList` (nodeCacheCapable false) is about 50 MiB."""
UNKNOWN_NODE = "node is not in gpuplane's cache (unknown to the cluster port, or not synced yet)"
PLACED_ELSEWHERE = "gpuplane placed the pod on {node}"
"""The reason a node that fits is not passed in `chosen` mode (listed as unresolvable: never preempt there)."""


class FilterAnswers(enum.Enum):
    """What filter passes: the node gpuplane picks (`chosen`), or every node that fits (`feasible`)."""

    CHOSEN = "chosen"
    FEASIBLE = "feasible"
_INT64 = (-(2**63), 2**63 - 1)


# ------------------------------------------------------------------ wire types
class WireError(ValueError):
    """A request body that is not the message it should be; names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


_MISSING: Any = object()


def _get(obj: Mapping[str, Any], name: str) -> Any:
    """A struct field as Go's encoding/json finds it: any key equal to `name` ignoring case; the last wins."""
    folded = name.casefold()
    value = _MISSING
    for key, candidate in obj.items():
        if key == name or key.casefold() == folded:
            value = candidate
    return value


def _optional_object(value: Any, field: str) -> dict[str, Any] | None:
    if value is _MISSING or value is None:
        return None
    if not isinstance(value, dict):
        raise WireError(field, f"must be an object, got {type(value).__name__}")
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    found = _optional_object(value, field)
    if found is None:
        raise WireError(field, "missing")
    return found


def _string(value: Any, field: str, *, optional: bool = True) -> str:
    """Go leaves a missing or null string empty."""
    if value is _MISSING or value is None:
        if optional:
            return ""
        raise WireError(field, "missing")
    if not isinstance(value, str):
        raise WireError(field, f"must be a string, got {type(value).__name__}")
    return value


def _int64(value: Any, field: str) -> int:
    if value is _MISSING or value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(field, f"must be an integer, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise WireError(field, "out of the int64 range")
    return value


def _strings(value: Any, field: str) -> list[str] | None:
    if value is _MISSING or value is None:
        return None
    if not isinstance(value, list):
        raise WireError(field, f"must be a list of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise WireError(f"{field}[{i}]", f"must be a string, got {type(item).__name__}")
    return value


def _node_items(nodes: Mapping[str, Any], field: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A `v1.NodeList`'s items and their names."""
    raw = _get(nodes, "items")
    if raw is _MISSING or raw is None:
        return [], []
    if not isinstance(raw, list):
        raise WireError(f"{field}.items", f"must be a list, got {type(raw).__name__}")
    names: list[str] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise WireError(f"{field}.items[{i}]", "must be a Node object")
        meta = item.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            raise WireError(f"{field}.items[{i}].metadata.name", "missing")
        names.append(name)
    return raw, names


def dumps(doc: Any) -> bytes:
    """Compact JSON, as Go's encoding/json writes it (no spaces)."""
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """The filter and prioritize request: the pod and either node names (nodeCacheCapable) or a NodeList."""

    pod: dict[str, Any]
    nodes: dict[str, Any] | None = None
    node_names: list[str] | None = None
    listed: tuple[list[dict[str, Any]], list[str]] | None = field(default=None, compare=False, repr=False)
    """`Nodes`' items and their names as `decode` read them (a NodeList is walked once per request)."""

    @staticmethod
    def decode(doc: Any) -> ExtenderArgs:
        top = _object(doc, "ExtenderArgs")
        pod = _object(_get(top, "Pod"), "Pod")
        nodes = _optional_object(_get(top, "Nodes"), "Nodes")
        listed = _node_items(nodes, "Nodes") if nodes is not None else None
        return ExtenderArgs(pod, nodes, _strings(_get(top, "NodeNames"), "NodeNames"), listed)

    def node_items(self) -> tuple[list[dict[str, Any]], list[str]]:
        """`Nodes`' items and their names (empty when no objects were sent)."""
        if self.listed is not None:
            return self.listed
        return _node_items(self.nodes, "Nodes") if self.nodes is not None else ([], [])

    def names(self) -> list[str]:
        """The nodes asked about, in the order sent (from `Nodes` when objects were sent)."""
        if self.nodes is not None:
            return self.node_items()[1]
        return self.node_names or []

    def encode(self) -> dict[str, Any]:
        return {"Pod": self.pod, "Nodes": self.nodes, "NodeNames": self.node_names}


@dataclass(frozen=True, slots=True)
class ExtenderFilterResult:
    nodes: dict[str, Any] | None = None
    node_names: list[str] | None = None
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""

    def encode(self) -> dict[str, Any]:
        return {"Nodes": self.nodes, "NodeNames": self.node_names, "FailedNodes": self.failed,
                "FailedAndUnresolvableNodes": self.unresolvable, "Error": self.error}


@dataclass(frozen=True, slots=True)
class HostPriority:
    host: str
    score: int

    def encode(self) -> dict[str, Any]:
        return {"Host": self.host, "Score": self.score}


@dataclass(frozen=True, slots=True)
class ExtenderBindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    @property
    def pod_key(self) -> str:
        """`namespace/name`, as the model names pods; an empty namespace is `default` (as `split_key` reads a key)."""
        return f"{self.pod_namespace or 'default'}/{self.pod_name}"

    @staticmethod
    def decode(doc: Any) -> ExtenderBindingArgs:
        top = _object(doc, "ExtenderBindingArgs")
        args = ExtenderBindingArgs(_string(_get(top, "PodName"), "PodName"),
                                   _string(_get(top, "PodNamespace"), "PodNamespace"),
                                   _string(_get(top, "PodUID"), "PodUID"), _string(_get(top, "Node"), "Node"))
        if not args.pod_name:
            raise WireError("PodName", "missing")
        if not args.node:
            raise WireError("Node", "missing")
        return args

    def encode(self) -> dict[str, Any]:
        return {"PodName": self.pod_name, "PodNamespace": self.pod_namespace, "PodUID": self.pod_uid,
                "Node": self.node}


@dataclass(frozen=True, slots=True)
class ExtenderBindingResult:
    error: str = ""

    def encode(self) -> dict[str, Any]:
        return {"Error": self.error}


@dataclass(frozen=True, slots=True)
class VictimPod:
    uid: str
    key: str | None = None
    """`namespace/name`, when kube-scheduler sent the whole pod (not cache-capable)."""


@dataclass(frozen=True, slots=True)
class Victims:
    pods: tuple[VictimPod, ...]
    num_pdb_violations: int = 0

    def encode(self) -> dict[str, Any]:
        """As `MetaVictims`: UIDs only."""
        return {"Pods": [{"UID": pod.uid} for pod in self.pods], "NumPDBViolations": self.num_pdb_violations}


@dataclass(frozen=True, slots=True)
class ExtenderPreemptionArgs:
    """`NodeNameToVictims` (whole pods) when not cache-capable, else `NodeNameToMetaVictims` (UIDs); the
    whole pods win when both are sent."""

    pod: dict[str, Any]
    victims: dict[str, Victims]

    @staticmethod
    def decode(doc: Any) -> ExtenderPreemptionArgs:
        top = _object(doc, "ExtenderPreemptionArgs")
        pod = _object(_get(top, "Pod"), "Pod")
        full = _optional_object(_get(top, "NodeNameToVictims"), "NodeNameToVictims")
        if full is not None:
            return ExtenderPreemptionArgs(pod, _victims(full, "NodeNameToVictims", whole=True))
        meta = _optional_object(_get(top, "NodeNameToMetaVictims"), "NodeNameToMetaVictims")
        return ExtenderPreemptionArgs(pod, _victims(meta or {}, "NodeNameToMetaVictims", whole=False))

    def encode(self) -> dict[str, Any]:
        return {"Pod": self.pod, "NodeNameToVictims": None,
                "NodeNameToMetaVictims": {node: v.encode() for node, v in self.victims.items()}}


def _victims(doc: Mapping[str, Any], field: str, *, whole: bool) -> dict[str, Victims]:
    result: dict[str, Victims] = {}
    for node, raw in doc.items():
        where = f"{field}[{node}]"
        entry = _optional_object(raw, where)
        if entry is None:
            result[node] = Victims(())
            continue
        pods_raw = _get(entry, "Pods")
        if pods_raw is _MISSING or pods_raw is None:
            pods_raw = []
        if not isinstance(pods_raw, list):
            raise WireError(f"{where}.Pods", f"must be a list, got {type(pods_raw).__name__}")
        pods: list[VictimPod] = []
        for i, item in enumerate(pods_raw):
            obj = _object(item, f"{where}.Pods[{i}]")
            if whole:
                meta = obj.get("metadata")
                uid = meta.get("uid") if isinstance(meta, dict) else None
                pods.append(VictimPod(_string(uid, f"{where}.Pods[{i}].metadata.uid", optional=False),
                                      object_key(obj) or None))
            else:
                pods.append(VictimPod(_string(_get(obj, "UID"), f"{where}.Pods[{i}].UID", optional=False)))
        result[node] = Victims(tuple(pods), _int64(_get(entry, "NumPDBViolations"), f"{where}.NumPDBViolations"))
    return result


@dataclass(frozen=True, slots=True)
class ExtenderPreemptionResult:
    victims: dict[str, Victims]

    def encode(self) -> dict[str, Any]:
        return {"NodeNameToMetaVictims": {node: v.encode() for node, v in self.victims.items()}}


class _Lru:
    """A small thread-safe LRU map."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._data: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)

    def drop(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)


# ------------------------------------------------------------------ the verbs
BoolArray = npt.NDArray[np.bool_]


def _only(size: int, node: int) -> BoolArray:
    mask = np.zeros(size, np.bool_)
    mask[node] = True
    return mask


def extender_scores(scores: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Framework scores of the feasible nodes → 0…10 by min-max: best 10, worst 0, all 10 on a tie."""
    if not len(scores):
        return np.zeros(0, np.int64)
    low, high = float(scores.min()), float(scores.max())
    if high - low < 1e-9:
        return np.full(len(scores), MAX_EXTENDER_PRIORITY, np.int64)
    scaled = MAX_EXTENDER_PRIORITY * (scores - low) / (high - low)
    return np.clip(np.floor(scaled + 0.5), 0, MAX_EXTENDER_PRIORITY).astype(np.int64)


@dataclass(frozen=True, slots=True)
class _Chosen:
    """A `chosen`-mode filter's decision, kept for the same pod's repeated filter, its prioritize and its bind."""

    version: object
    """The pod's resourceVersion when decided."""
    nodes: tuple[str, ...]
    generation: tuple[int, int, int]
    decision: Decision
    answer: tuple[list[int], dict[str, str], dict[str, str]]
    """Indexes of the names that passed, FailedNodes, FailedAndUnresolvableNodes."""


def _identity(pod: Mapping[str, Any]) -> tuple[str, object]:
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return "", None
    uid = meta.get("uid")
    return (uid if isinstance(uid, str) else ""), meta.get("resourceVersion")


class Extender:
    """The four verbs over a `Scheduler` on `port`, transport-free (the HTTP server is `ExtenderServer`).

    `uid_names` maps a pod UID to `namespace/name` for UID-only preemption victims the extender has not seen
    (a port that knows UIDs can supply it); UIDs seen in filter, prioritize and bind are remembered.
    `subscribe_lock` is held while the scheduler lists the port and subscribes to it, so no event falls in
    between (`KubeCluster.lock`; its event delivery holds it, then takes the state lock: the same order).
    `filter_answers`: what filter passes (module docstring).

    `metrics`: where the HTTP server records each request (`extender_request`) and where `observe` exports the
    cluster's figures; with `observe` (the default when `metrics` is given) the observer starts at once. Run
    one observer per cluster: of two extender replicas, only the one whose kube-scheduler leads should
    observe (`gpuplane.kube.observed.KubeSchedulerLease`; `start_observing`, `stop_observing`). `own_pods`
    names the pods the observer counts as gpuplane's when pending (`OwnPods`; None: all of them).
    """

    def __init__(self, port: ClusterPort, catalog: Catalog, profile: Profile, *, seed: int = 0,
                 rules: SchedulingRules | None = None, now: Callable[[], float] | None = None,
                 uid_names: Callable[[str], str | None] | None = None, cache_size: int = 4096,
                 subscribe_lock: AbstractContextManager[Any] | None = None,
                 filter_answers: FilterAnswers = FilterAnswers.CHOSEN, metrics: PlaneMetrics | None = None,
                 observe: bool | None = None, own_pods: Callable[[str], bool] | None = None) -> None:
        self.catalog = catalog
        self.filter_answers = filter_answers
        self._chosen = _Lru(cache_size)
        """Pod UID → `_Chosen`: the decision of its last `chosen`-mode filter."""
        self.port = port
        self.state_lock = threading.RLock()
        self.port_lock = threading.Lock()
        self._uid_names = uid_names
        self._requests = _Lru(cache_size)
        """Pod UID → (resourceVersion, PodRequest): filter parses, prioritize and bind reuse."""
        self._names = _Lru(16 * cache_size)
        """Pod UID → `namespace/name`, for preemption victims named by UID only."""
        with self.port_lock, subscribe_lock or nullcontext(), self.state_lock:
            self.scheduler = Scheduler(PortView(port, self.state_lock), catalog, profile, seed=seed,
                                       rules=rules, now=now, queue_pods=False)
        self.plane = metrics
        self.metrics: Recorder = metrics if metrics is not None else NULL_RECORDER
        """What the HTTP server records each request into."""
        self._subscribe_lock = subscribe_lock
        self._observed_port: ClusterPort = port if own_pods is None else OwnPods(port, own_pods)
        self._wall = now if now is not None else time.time
        self._observer_lock = threading.Lock()
        self.observer: ClusterObserver | None = None
        """The cluster's observer while this extender observes."""
        if metrics is not None and (observe is None or observe):
            self.start_observing()

    # -------------------------------------------------------------- metrics
    def start_observing(self) -> bool:
        """Export the cluster's figures and the scheduler's counts into `metrics` (a fresh observer, listed
        and subscribed under the subscribe lock); False when already observing or no metrics were given."""
        plane = self.plane
        if plane is None:
            return False
        with self._observer_lock:
            if self.observer is not None:
                return False
            with self._subscribe_lock or nullcontext():
                self.observer = ClusterObserver(self._observed_port, plane, now=self._wall,
                                                quotas=self.scheduler.rules.quotas)
            plane.counters(scheduler_counters(self.scheduler))
            return True

    def stop_observing(self) -> bool:
        """Stop exporting the cluster's figures (the recorded counters keep their counts); False when not
        observing."""
        with self._observer_lock:
            observer, self.observer = self.observer, None
            if observer is None or self.plane is None:
                return False
            observer.close()
            self.plane.drop("scheduler")
            return True

    def _record(self, pod: PodRequest, decision: Decision) -> None:
        observer = self.observer
        if observer is not None:
            observer.record_outcomes([Outcome(pod, decision, 0, 0.0)])

    def close(self) -> None:
        self.stop_observing()
        self.scheduler.close()  # not under the state lock: a port delivering an event holds its own, then ours

    # -------------------------------------------------------------- pods
    def request(self, pod: Mapping[str, Any]) -> PodRequest:
        """The pod's request, parsed once per UID and resourceVersion. Raises `ObjectError`."""
        meta = pod.get("metadata")
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        version = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
        if isinstance(uid, str) and uid:
            cached = self._requests.get(uid)
            if cached is not None and cached[0] == version:
                request: PodRequest = cached[1]
                return request
        request = pod_request(pod, self.catalog)
        if request.unsupported:
            # kube-scheduler has already applied these (inter-pod affinity, topology spread, volumes, host ports,
            # other resources) to the nodes it sends: gpuplane decides among them on the rest.
            request = replace(request, unsupported=())
        if isinstance(uid, str) and uid:
            self._requests.put(uid, (version, request))
            self._names.put(uid, request.name)
        return request

    def _indexes(self, names: Sequence[str]) -> npt.NDArray[np.int64]:
        index = self.scheduler.state.node_index
        return np.fromiter((index.get(name, -1) for name in names), np.int64, len(names))

    # -------------------------------------------------------------- filter
    def _generation(self) -> tuple[int, int, int]:
        """Changes whenever the cache does (a pod placed or released anywhere, a rebuild)."""
        state = self.scheduler.state
        return id(state), state.size, int(state.node_version.sum())

    def _sent(self, names: Sequence[str]) -> tuple[npt.NDArray[np.int64], BoolArray, BoolArray]:
        """Rows of the names sent (-1: unknown), which are known, and the mask of their rows."""
        rows = self._indexes(names)
        known = rows >= 0
        mask = np.zeros(self.scheduler.state.size, np.bool_)
        mask[rows[known]] = True
        return rows, known, mask

    def _reasons(self, names: Sequence[str], rows: npt.NDArray[np.int64], known: BoolArray, skip: BoolArray,
                 diagnosis: Diagnosis, *, placed_on: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
        """FailedNodes and FailedAndUnresolvableNodes of the names not in `skip`; with `placed_on`, a node the
        diagnosis found feasible is reported as placed elsewhere (unresolvable)."""
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        safe = np.where(known, rows, 0)
        reason_of = diagnosis.reason_of[safe]
        for i in np.flatnonzero(~skip).tolist():
            name = names[i]
            if not known[i]:
                unresolvable[name] = UNKNOWN_NODE
                continue
            idx = int(reason_of[i])
            if idx < 0 and placed_on is not None:
                unresolvable[name] = PLACED_ELSEWHERE.format(node=placed_on)
                continue
            target = unresolvable if idx in diagnosis.unresolvable else failed
            target[name] = diagnosis.reasons[idx] if idx >= 0 else "rejected"
        return failed, unresolvable

    def _filter_feasible(self, pod: PodRequest, names: Sequence[str]) -> tuple[list[int], dict[str, str],
                                                                                dict[str, str]]:
        with self.state_lock:
            state = self.scheduler.state
            rows, known, mask = self._sent(names)
            alive, diagnosis = self.scheduler.framework.find_nodes(CycleState(), pod, state, within=mask)
            assert diagnosis is not None
            passed = known & alive[np.where(known, rows, 0)]
            failed, unresolvable = self._reasons(names, rows, known, passed, diagnosis)
        return np.flatnonzero(passed).tolist(), failed, unresolvable

    def _decide(self, raw: Mapping[str, Any], pod: PodRequest, names: Sequence[str]) -> _Chosen:
        """gpuplane's decision among `names`, as the simulator makes it; the same question is answered once."""
        uid, version = _identity(raw)
        with self.state_lock:
            generation = self._generation()
            key = tuple(names)
            held: _Chosen | None = self._chosen.get(uid) if uid else None
            if held is not None and held.version == version and held.generation == generation and held.nodes == key:
                return held
            state = self.scheduler.state
            framework = self.scheduler.framework
            rows, known, mask = self._sent(names)
            decision = framework.schedule(pod, state, within=mask)
            if decision.assignment is not None:
                # The reasons of the others (schedule keeps none on success; the filters draw nothing).
                _, diagnosis = framework.find_nodes(CycleState(), pod, state, within=mask)
                first = int(np.flatnonzero(known & (rows == decision.node))[0])
                passed = np.zeros(len(names), np.bool_)
                passed[first] = True
                placed_on: str | None = decision.assignment.node
            else:
                diagnosis = decision.diagnosis
                passed = np.zeros(len(names), np.bool_)
                placed_on = None
            assert diagnosis is not None
            failed, unresolvable = self._reasons(names, rows, known, passed, diagnosis, placed_on=placed_on)
            chosen = _Chosen(version, key, generation, decision, (np.flatnonzero(passed).tolist(), failed,
                                                                   unresolvable))
            if uid:
                self._chosen.put(uid, chosen)
            return chosen

    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        try:
            pod = self.request(args.pod)
        except ObjectError as exc:
            return ExtenderFilterResult(error=str(exc))
        names = args.names()
        if self.filter_answers is FilterAnswers.CHOSEN:
            chosen = self._decide(args.pod, pod, names)
            keep, failed, unresolvable = chosen.answer
            self._record(pod, chosen.decision)
        else:
            keep, failed, unresolvable = self._filter_feasible(pod, names)
            self._record(pod, _feasible_decision(keep, failed, unresolvable))
        if args.nodes is not None:
            items = args.node_items()[0]
            rest = {k: v for k, v in args.nodes.items() if k.casefold() != "items"}
            return ExtenderFilterResult({**rest, "items": [items[i] for i in keep]}, None, dict(failed),
                                        dict(unresolvable))
        return ExtenderFilterResult(None, [names[i] for i in keep], dict(failed), dict(unresolvable))

    # -------------------------------------------------------------- prioritize
    def prioritize(self, args: ExtenderArgs) -> list[HostPriority]:
        """Raises `ObjectError` for a pod we cannot read."""
        pod = self.request(args.pod)
        names = args.names()
        if self.filter_answers is FilterAnswers.CHOSEN:
            return self._prioritize_chosen(args.pod, pod, names)
        with self.state_lock:
            state = self.scheduler.state
            framework = self.scheduler.framework
            rows, known, mask = self._sent(names)
            cycle = CycleState()
            alive, _ = framework.find_nodes(cycle, pod, state, diagnose=False, within=mask)
            feasible = np.flatnonzero(alive)
            scores = framework.score_nodes(cycle, pod, state, feasible) if len(feasible) else np.zeros(0)
            size = state.size
        by_node = np.zeros(max(size, 1), np.int64)
        by_node[feasible] = extender_scores(scores)
        result = np.where(known, by_node[np.where(known, rows, 0)], 0).tolist()
        return [HostPriority(name, score) for name, score in zip(names, result, strict=True)]

    def _prioritize_chosen(self, raw: Mapping[str, Any], pod: PodRequest, names: Sequence[str]) -> list[HostPriority]:
        """The filter's decision scored: its node 10, the others 0 (decided now among `names` if there is none
        for this pod at this cache generation, or its node is not among them)."""
        uid, version = _identity(raw)
        with self.state_lock:
            held: _Chosen | None = self._chosen.get(uid) if uid else None
            assignment = held.decision.assignment if held is not None else None
            if (held is None or held.version != version or held.generation != self._generation()
                    or assignment is None or assignment.node not in names):
                assignment = self._decide(raw, pod, names).decision.assignment
        top = assignment.node if assignment is not None else None
        return [HostPriority(name, MAX_EXTENDER_PRIORITY if name == top else 0) for name in names]

    # -------------------------------------------------------------- bind
    def _bind_request(self, args: ExtenderBindingArgs) -> PodRequest | None:
        cached = self._requests.get(args.pod_uid) if args.pod_uid else None
        if cached is not None and cached[1].name == args.pod_key:
            request: PodRequest = cached[1]
            return request
        # Not seen since a restart: the port knows every pending pod.
        with self.port_lock:
            pods = self.port.list_pods()
        for info in pods:
            if info.name == args.pod_key and info.phase is PodPhase.PENDING:
                return info.request
        return None

    def placement(self, pod: PodRequest, node_name: str) -> Decision:
        """The cards `pod` would get on `node_name` now (what `bind` binds), or why it cannot go there."""
        with self.state_lock:
            scheduler = self.scheduler
            state = scheduler.state
            node = state.node_index.get(node_name)
            if node is None:
                return Decision(Status.unschedulable(f"node {node_name}: {UNKNOWN_NODE}", resolvable=False))
            held = state.bindings.get(pod.name)
            if held is not None:
                return Decision(Status.error(f"pod {pod.name} is already placed on {held.assignment.node}"))
            decision = scheduler.framework.schedule(pod, state, within=_only(state.size, node))
            if decision.assignment is None:
                reason = decision.diagnosis.node_reason(node) if decision.diagnosis is not None else None
                return Decision(Status.unschedulable(f"pod {pod.name} no longer fits on node {node_name}: "
                                                     f"{reason or decision.status.message}"))
            return decision

    def _decided(self, args: ExtenderBindingArgs, pod: PodRequest) -> Assignment | None:
        """The cards a `chosen`-mode filter decided for this pod on `args.node`, if they still fit (taken: a
        later filter of the pod decides again)."""
        held: _Chosen | None = self._chosen.get(args.pod_uid) if args.pod_uid else None
        if held is None:
            return None
        self._chosen.drop(args.pod_uid)
        assignment = held.decision.assignment
        if assignment is None or assignment.node != args.node:
            return None
        return assignment if self.scheduler.state.check(assignment, pod) is None else None

    def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        key = args.pod_key
        if args.pod_uid:
            self._names.put(args.pod_uid, key)
        pod = self._bind_request(args)
        if pod is None:
            return ExtenderBindingResult(f"pod {key} is not pending in gpuplane's view of the cluster")
        with self.state_lock:
            assignment = self._decided(args, pod)
            if assignment is None:
                decision = self.placement(pod, args.node)
                assignment = decision.assignment
                if assignment is None:
                    return ExtenderBindingResult(decision.status.message)
            self.scheduler.assume(pod, assignment)
        with self.port_lock:
            with self.state_lock:
                # While this bind waited for the port, the cards may have been given up (a rebuilt cache they
                # no longer fit, the world placing a pod there); the port does not check cards: do not bind.
                if self.scheduler.reserved(key) != assignment:
                    return ExtenderBindingResult(f"bind {key} to {args.node}: no longer reserved (its cards were "
                                                 "released while the bind waited)")
            status = Status.error("bind raised")
            try:
                status = self.port.bind(key, assignment)
            finally:
                with self.state_lock:
                    self.scheduler.settle(key, status)
        return ExtenderBindingResult("" if status.ok else f"bind {key} to {args.node}: {status.message}")

    # -------------------------------------------------------------- preempt
    def _victim_key(self, victim: VictimPod) -> str | None:
        if victim.key is not None:
            return victim.key
        name: str | None = self._names.get(victim.uid)
        if name is None and self._uid_names is not None:
            name = self._uid_names(victim.uid)
        return name

    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        """Raises `ObjectError` for a preemptor we cannot read."""
        pod = self.request(args.pod)
        answer: dict[str, Victims] = {}
        for victims in args.victims.values():
            for victim in victims.pods:
                if victim.key is not None:
                    self._names.put(victim.uid, victim.key)
        with self.state_lock:
            for node_name, victims in args.victims.items():
                kept = self._judge(pod, node_name, victims)
                if kept is not None:
                    answer[node_name] = kept
        return ExtenderPreemptionResult(answer)

    def _judge(self, pod: PodRequest, node_name: str, victims: Victims) -> Victims | None:
        """The victims on `node_name` the pod needs gone (None: even all of them are not enough)."""
        state = self.scheduler.state
        node = state.node_index.get(node_name)
        if node is None:
            return None
        keys = [self._victim_key(v) for v in victims.pods]
        if any(key is None for key in keys):
            return victims
        ours = {key: victim for key, victim in zip(keys, victims.pods, strict=True)
                if key is not None and key in state.bindings and state.bindings[key].node == node}
        removed = [state.release(key) for key in sorted(ours)]
        needed: list[str] = []
        try:
            if not self._fits(pod, node):
                return None
            # Give back the most valuable first (higher priority, then the smaller), while the pod still fits.
            for binding in sorted(removed, key=lambda b: (-b.request.priority, b.assignment.gpu_milli,
                                                          b.request.name)):
                state.place(binding.request, binding.assignment, check=False)
                if not self._fits(pod, node):
                    state.release(binding.request.name)
                    needed.append(binding.request.name)
        finally:
            for binding in removed:
                if binding.request.name not in state.bindings:
                    state.place(binding.request, binding.assignment, check=False)
        pods = tuple(victim for key, victim in zip(keys, victims.pods, strict=True)
                     if key not in ours or key in needed)
        return Victims(pods, victims.num_pdb_violations)

    def _fits(self, pod: PodRequest, node: int) -> bool:
        state = self.scheduler.state
        decision = self.scheduler.framework.schedule(pod, state, within=_only(state.size, node))
        return decision.assignment is not None


def _feasible_decision(keep: Sequence[int], failed: Mapping[str, str], unresolvable: Mapping[str, str]) -> Decision:
    """A `feasible`-mode filter as one scheduling attempt: some node passed, or the reason most nodes failed for."""
    if keep:
        return Decision(Status.success())
    reasons = [*failed.values(), *unresolvable.values()]
    if not reasons:
        return Decision(Status.unschedulable("no nodes sent"))
    return Decision(Status.unschedulable(max(set(reasons), key=lambda r: (reasons.count(r), r))))


# ------------------------------------------------------------------ HTTP
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256
    extender: Extender
    routes: dict[str, str]
    prefix: str
    max_body: int

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    timeout = 300
    """Idle keep-alive connections close after this long (longer than Go's 90 s idle timeout: the client
    closes first, so a POST never meets a connection we are closing)."""
    server: _Server
    server_version = "gpuplane-extender"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _answer(self, code: int, body: bytes, *, close: bool = False,
                content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's answer to a request it cannot parse, in JSON, always with a status line."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        self._error(code, message or HTTPStatus(code).phrase, close=True)

    def _error(self, code: int, message: str, *, close: bool = False) -> None:
        self._answer(code, dumps({"Error": message}), close=close)

    def _route(self) -> str | None:
        return self.server.routes.get(self.path.split("?", 1)[0])

    def _body(self) -> bytes | None:
        """The request body; None after answering a request whose body cannot be read (and closing)."""
        if self.headers.get("Transfer-Encoding"):
            self._error(411, "send the body with a Content-Length", close=True)
            return None
        raw = self.headers.get("Content-Length")
        if raw is None:
            if self.command == "POST":
                self._error(411, "Content-Length required", close=True)
                return None
            return b""
        try:
            length = int(raw)
            if length < 0:
                raise ValueError(raw)
        except ValueError:
            self._error(400, f"bad Content-Length {raw!r}", close=True)
            return None
        if length > self.server.max_body:
            self._error(413, f"body of {length} bytes is over the {self.server.max_body} limit", close=True)
            return None
        return self.rfile.read(length)

    def do_POST(self) -> None:
        body = self._body()
        if body is None:
            return
        verb = self._route()
        if verb is None:
            self._error(404, f"nothing at {self.path}; POST {self.server.prefix}/<{'|'.join(VERBS)}>")
            return
        if verb == "healthz":
            self._not_allowed()
            return
        extender = self.server.extender
        started = time.perf_counter()
        reply = handle(extender, verb, body)
        extender.metrics.extender_request(verb, ok=reply.ok, seconds=time.perf_counter() - started)
        self._answer(reply.code, reply.body)

    def do_GET(self) -> None:
        if self._body() is None:
            return
        verb = self._route()
        if verb == "healthz":
            self._answer(200, b"ok", content_type="text/plain")
        elif verb is None:
            self._error(404, f"nothing at {self.path}")
        else:
            self._not_allowed()

    def _refuse_method(self) -> None:
        if self._body() is not None:
            self._not_allowed()

    def _not_allowed(self) -> None:
        verb = self._route()
        if verb is None:
            self._error(404, f"nothing at {self.path}")
            return
        allowed = "GET" if verb == "healthz" else "POST"
        body = b"" if self.command == "HEAD" else dumps({"Error": f"{self.command} not allowed; {allowed}"})
        self.send_response(405)
        self.send_header("Allow", allowed)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _refuse_method


class Reply(NamedTuple):
    """One verb's answer: the HTTP status, the JSON body, and whether it succeeded (HTTP 200 and no `Error`:
    what `gpuplane_extender_requests_total`'s result counts)."""

    code: int
    body: bytes
    ok: bool


def _reject(verb: str, message: str) -> Reply:
    """A request we cannot read, answered the way kube-scheduler understands for that verb."""
    if verb == "filter":
        return Reply(200, dumps(ExtenderFilterResult(error=message).encode()), False)
    if verb == "bind":
        return Reply(200, dumps(ExtenderBindingResult(message).encode()), False)
    return Reply(400, dumps({"Error": message}), False)


def handle(extender: Extender, verb: str, body: bytes) -> Reply:
    """One verb. Never raises."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return _reject(verb, f"body is not JSON: {exc}")
    try:
        if verb == "filter":
            filtered = extender.filter(ExtenderArgs.decode(doc))
            return Reply(200, dumps(filtered.encode()), not filtered.error)
        if verb == "prioritize":
            priorities = extender.prioritize(ExtenderArgs.decode(doc))
            return Reply(200, dumps([p.encode() for p in priorities]), True)
        if verb == "bind":
            bound = extender.bind(ExtenderBindingArgs.decode(doc))
            return Reply(200, dumps(bound.encode()), not bound.error)
        return Reply(200, dumps(extender.preempt(ExtenderPreemptionArgs.decode(doc)).encode()), True)
    except (WireError, ObjectError) as exc:
        return _reject(verb, str(exc))
    except RecursionError:
        return _reject(verb, "body nested too deeply")
    except Exception as exc:  # a bug: log it, answer without a traceback, keep serving
        log.exception("extender %s failed", verb)
        return Reply(500, dumps({"Error": f"internal error in {verb}: {type(exc).__name__}"}), False)


def normalise_prefix(prefix: str) -> str:
    """`gpuplane/` → `/gpuplane`; `/` or empty → `` (verbs at the root)."""
    stripped = prefix.strip().strip("/")
    return f"/{stripped}" if stripped else ""


class ExtenderServer:
    """The extender over HTTP/1.1 with keep-alive, one thread per connection. `port=0` picks a free port."""

    def __init__(self, extender: Extender, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 prefix: str = DEFAULT_PREFIX, max_body: int = MAX_BODY) -> None:
        self.prefix = normalise_prefix(prefix)
        self.extender = extender
        self._server = _Server((host, port), _Handler)
        self._server.extender = extender
        self._server.routes = {f"{self.prefix}/{verb}": verb for verb in (*VERBS, "healthz")}
        self._server.routes["/healthz"] = "healthz"
        self._server.max_body = max_body
        self._server.prefix = self.prefix
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}{self.prefix}"

    def start(self) -> ExtenderServer:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="gpuplane-extender",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ExtenderServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ kube-scheduler configuration
def scheduler_config(url_prefix: str = f"http://127.0.0.1:{DEFAULT_PORT}{DEFAULT_PREFIX}", *,
                     scheduler_name: str = SCHEDULER_NAME, http_timeout: str = "5s", weight: int = 1,
                     lease_namespace: str = "gpuplane-system") -> dict[str, Any]:
    """A `KubeSchedulerConfiguration` running a second scheduler (`schedulerName`) that calls this extender.

    `weight` multiplies our 0…10 scores (×10 on kube-scheduler's 0…100 scale) and must be > 0. `httpTimeout`
    is per call: a filter answers in milliseconds, a bind makes two API calls (the assignment annotation,
    then the Binding); 5 s is kube-scheduler's default. No `managedResources`: kube-scheduler then calls us
    for every pod of the profile (`IsInterested`), so the pods that chose gpuplane without asking for a GPU
    are placed by gpuplane too (with `managedResources`, kube-scheduler's own scorers would place them, and
    spread their CPU over every node). NodeResourcesFit's `ignoredResources` names gpuplane's resources but
    `gpuplane.io/gpu` (which the device plugin advertises, and kube-scheduler counts against allocatable):
    no node advertises the others, so counting them would refuse every pod asking for them. Its own Lease, so
    it never contends with the default scheduler (in `lease_namespace`, where the scheduler's RBAC allows
    Leases).
    `percentageOfNodesToScore: 100`: kube-scheduler's default stops filtering once it has found
    max(100, n × (50 − n/125) %) feasible nodes (5 % at least), so on a large cluster the extender would see
    only a sample of them (`numFeasibleNodesToFind`); 100 sends every node.
    """
    if weight <= 0:
        raise ValueError(f"weight must be > 0, got {weight}")
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": True, "resourceLock": "leases", "resourceName": scheduler_name,
                           "resourceNamespace": lease_namespace},
        "percentageOfNodesToScore": 100,
        "profiles": [{"schedulerName": scheduler_name, "pluginConfig": [
            {"name": "NodeResourcesFit", "args": {"ignoredResources": [r for r in MANAGED_RESOURCES if r != RES_GPU]}},
        ]}],
        "extenders": [{
            "urlPrefix": url_prefix,
            "filterVerb": "filter",
            "prioritizeVerb": "prioritize",
            "bindVerb": "bind",
            "preemptVerb": "preempt",
            "weight": weight,
            "enableHTTPS": False,
            "httpTimeout": http_timeout,
            "nodeCacheCapable": True,
            "ignorable": False,
        }],
    }


def describe_nodes(specs: Sequence[NodeSpec]) -> str:
    """`3 nodes, 24 GPUs (A100-40GB×16, T4×8)`: what a started extender serves, for its log line."""
    models: dict[str, int] = {}
    for spec in specs:
        if spec.gpu_model is not None and spec.gpus:
            models[spec.gpu_model] = models.get(spec.gpu_model, 0) + spec.gpus
    gpus = sum(models.values())
    parts = ", ".join(f"{m}×{c}" for m, c in sorted(models.items()))
    return f"{len(specs)} nodes, {gpus} GPUs" + (f" ({parts})" if parts else "")


__all__ = [
    "DEFAULT_PORT", "DEFAULT_PREFIX", "MAX_EXTENDER_PRIORITY", "PLACED_ELSEWHERE", "VERBS", "Extender", "ExtenderArgs",
    "ExtenderBindingArgs", "ExtenderBindingResult", "ExtenderFilterResult", "ExtenderPreemptionArgs",
    "ExtenderPreemptionResult", "ExtenderServer", "FilterAnswers", "HostPriority", "Reply", "VictimPod", "Victims",
    "WireError", "dumps", "extender_scores", "handle", "normalise_prefix", "scheduler_config",
]
