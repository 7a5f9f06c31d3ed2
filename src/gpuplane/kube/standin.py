"""A kube-scheduler stand-in: its filters, scoring and extender calls, to drive gpuplane's extender as a cluster would.

What it does, each taken from kube-scheduler (`pkg/scheduler/schedule_one.go` and the default plugins; upstream's
names in brackets) and nothing guessed:

- **Its own view** of nodes and pods from the API (two informers), with assumed binds held until the watch shows
  them, as kube-scheduler's cache does. Per node: allocatable, the sum of the requests of the pods bound there
  (`Requested`) and the same with 100m CPU / 200Mi memory for containers asking for none (`NonZeroRequested`).
- **Pod requests** as `resourcehelper.PodRequests` computes them: the containers' requests summed (limits stand in
  for a missing request, as the API server's defaulting writes them), native sidecars (init containers with
  `restartPolicy: Always`) added to the sum, the largest init container (plus the sidecars started before it),
  pod-level `spec.resources.requests` for CPU and memory, then `spec.overhead`.
- **Filters** in the default order: NodeUnschedulable, NodeName, TaintToleration (NoSchedule, NoExecute),
  NodeAffinity (nodeSelector and required terms), NodeResourcesFit (pod count, CPU, memory, ephemeral storage and
  every extended resource such as `gpuplane.io/gpu` against allocatable; not the resources its args'
  `ignoredResources`/`ignoredResourceGroups` name, or the extenders' `ignoredByScheduler` ones, which replace the
  former, as `buildExtenders` does). Nodes are searched from where the last cycle stopped until
  `numFeasibleNodesToFind` fit (`percentageOfNodesToScore`; 0 or absent: the adaptive default).
- **Extenders** over real HTTP: filter (only when `IsInterested`: no `managedResources`, or a container or init
  container names one; `NodeNames` when `nodeCacheCapable`, else a NodeList), its failures recorded, an error
  failing the pod unless `ignorable`. One feasible node left: it is the host, with no scoring (`schedulePod`).
- **Scoring** (`prioritizeNodes`): the default score plugins with their default weights
  (`default_plugins.go`: TaintToleration 3, NodeAffinity 2, NodeResourcesFit 1 (LeastAllocated over CPU and
  memory, weight 1 each, on `NonZeroRequested`), PodTopologySpread 2, InterPodAffinity 2,
  NodeResourcesBalancedAllocation 1 (on `Requested`; skipped for a pod requesting neither), ImageLocality 1),
  plus each interested extender's score × weight × (MaxNodeScore / MaxExtenderPriority) (× 10); a prioritize
  error gives no extender score. Ties: each node an extender scored gets a random `Randomizer` (seeded here), and
  the host is popped from Go's `container/heap` ordered by (score, randomizer), exactly as `sortedNodeScores`.
- **Bind** through the first interested binder extender, else the Binding subresource (DefaultBinder).

Not implemented, refused with `StandInError` naming the field rather than scored wrongly: pods with
`topologySpreadConstraints`, inter-pod (anti-)affinity, or a controlling owner (PodTopologySpread's system default
constraints would apply to them); nodes reporting `status.images` (ImageLocality); any pod already placed with
inter-pod affinity terms. Also not done: preemption (DefaultPreemption; a pod that fits nowhere fails its cycle),
the scheduling queue (one pod per `schedule_one` call), volumes and host ports (no pod here uses them).

`fill_through_extender` runs the fill protocol (one pod at a time, a failed pod deleted) through a local API server,
`KubeCluster`, gpuplane's extender over HTTP and this stand-in; the workload is already tuned by the caller.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from gpuplane.kube.api import ApiError, KubeApi, RestKubeApi, node_path, pod_path
from gpuplane.kube.cluster import KubeCluster, pod_manifest
from gpuplane.kube.extender import (
    MAX_EXTENDER_PRIORITY,
    Extender,
    ExtenderServer,
    FilterAnswers,
    scheduler_config,
)
from gpuplane.kube.informer import Informer
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import (
    ASSIGNMENT,
    INVENTORY,
    POOL_LABEL,
    RES_GPU,
    CardInventory,
    NodeInventory,
    decode_assignment,
    object_key,
    quantity,
    split_key,
    taints_json,
)
from gpuplane.model import MILLI_PER_CARD, Catalog, GpuplaneError, NodeSpec, PodRequest
from gpuplane.scheduler import Profile

MAX_NODE_SCORE = 100
DEFAULT_MILLI_CPU_REQUEST = 100
"""`DefaultMilliCPURequest`: a container asking for no CPU counts as 100m in scoring (never in filtering)."""
DEFAULT_MEMORY_REQUEST = 200 * 1024 * 1024
"""`DefaultMemoryRequest`: 200 MiB, the same for memory."""
DEFAULT_SCORE_WEIGHTS: dict[str, int] = {
    "TaintToleration": 3, "NodeAffinity": 2, "NodeResourcesFit": 1, "PodTopologySpread": 2, "InterPodAffinity": 2,
    "NodeResourcesBalancedAllocation": 1, "ImageLocality": 1,
}
"""The default score plugins and weights (`pkg/scheduler/apis/config/v1/default_plugins.go`)."""
MIN_FEASIBLE_NODES_TO_FIND = 100
MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND = 5
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
ERR_UNSCHEDULABLE = "node(s) were unschedulable"
ERR_NODE_NAME = "node(s) didn't match the requested node name"
ERR_AFFINITY = "node(s) didn't match Pod's node affinity/selector"
ERR_TOO_MANY_PODS = "Too many pods"
DEFAULT_MAX_PODS = 110
"""kubelet's default `maxPods`: the nodes' allocatable `pods`."""

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
JsonObject = dict[str, Any]


class StandInError(GpuplaneError):
    """A pod or node uses something the stand-in does not implement (the field is named)."""


# ------------------------------------------------------------------ pod accounting
def _amount(resource: str, raw: object, obj: str, where: str) -> int:
    """A quantity in kube-scheduler's units: CPU in millicores, the rest as `Value()` (both rounded up)."""
    value = quantity(raw, obj, where)
    return math.ceil(value * 1000) if resource == "cpu" else math.ceil(value)


def container_requests(container: Mapping[str, Any], obj: str = "pod", where: str = "container") -> dict[str, int]:
    """A container's requests, a limit standing in for each request not given (the API server's defaulting)."""
    resources = container.get("resources") or {}
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    merged = {**limits, **requests}
    return {name: _amount(name, raw, obj, f"{where}.resources[{name}]") for name, raw in merged.items()}


def _with_defaults(requests: dict[str, int], defaults: Mapping[str, int]) -> dict[str, int]:
    """`NonMissingContainerRequests`: defaults for the resources the container does not name at all."""
    return {**{k: v for k, v in defaults.items() if k not in requests}, **requests}


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for name, value in more.items():
        into[name] = into.get(name, 0) + value


def _max_into(into: dict[str, int], other: Mapping[str, int]) -> None:
    for name, value in other.items():
        if value > into.get(name, 0):
            into[name] = value


def pod_requests(pod: Mapping[str, Any], *, non_missing: Mapping[str, int] | None = None) -> dict[str, int]:
    """What the pod requests, as `resourcehelper.PodRequests` computes it (module docstring).

    `non_missing`: the amounts given to containers that name no request for a resource (scoring's 100m/200Mi).
    """
    obj = object_key(pod) or "pod"
    spec = pod.get("spec") or {}
    defaults = non_missing or {}
    total: dict[str, int] = {}
    for i, container in enumerate(spec.get("containers") or []):
        _add(total, _with_defaults(container_requests(container, obj, f"spec.containers[{i}]"), defaults))
    sidecars: dict[str, int] = {}
    init_max: dict[str, int] = {}
    for i, container in enumerate(spec.get("initContainers") or []):
        requests = _with_defaults(container_requests(container, obj, f"spec.initContainers[{i}]"), defaults)
        if container.get("restartPolicy") == "Always":
            _add(total, requests)
            _add(sidecars, requests)
            during = dict(sidecars)
        else:
            during = dict(requests)
            _add(during, sidecars)
        _max_into(init_max, during)
    _max_into(total, init_max)
    pod_level = ((spec.get("resources") or {}).get("requests")) or {}
    for name in ("cpu", "memory"):
        if name in pod_level:
            total[name] = _amount(name, pod_level[name], obj, f"spec.resources.requests[{name}]")
    for name, raw in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, 0) + _amount(name, raw, obj, f"spec.overhead[{name}]")
    return total


NON_ZERO = {"cpu": DEFAULT_MILLI_CPU_REQUEST, "memory": DEFAULT_MEMORY_REQUEST}


def managed_by(pod: Mapping[str, Any], managed: frozenset[str]) -> bool:
    """`HTTPExtender.IsInterested`: some container or init container names a managed resource (requests or limits)."""
    if not managed:
        return True
    spec = pod.get("spec") or {}
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            if any(name in managed for name in resources.get(kind) or {}):
                return True
    return False


# ------------------------------------------------------------------ taints, tolerations, node affinity
def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """`Toleration.ToleratesTaint`: effect empty or equal; an empty key with `Exists` matches every key."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key != (taint.get("key") or "") and (key or toleration.get("operator") != "Exists"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated(taints: Sequence[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]],
                effects: frozenset[str]) -> list[Mapping[str, Any]]:
    return [t for t in taints if t.get("effect") in effects and not any(tolerates(x, t) for x in tolerations)]


def _requirement(requirement: Mapping[str, Any], value: str | None) -> bool:
    """One `NodeSelectorRequirement` against a label's value (None: the label is absent)."""
    operator = requirement.get("operator")
    values = requirement.get("values") or []
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt"):
        if value is None or len(values) != 1:
            return False
        try:
            have, want = int(value), int(values[0])
        except ValueError:
            return False
        return have > want if operator == "Gt" else have < want
    return False


def term_matches(term: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    """A `NodeSelectorTerm`: all its expressions and fields hold; an empty term matches nothing."""
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    if not all(_requirement(r, labels.get(str(r.get("key")))) for r in expressions):
        return False
    return all(_requirement(r, name if r.get("key") == "metadata.name" else None) for r in fields)


def _node_affinity(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}


def matches_node(pod: Mapping[str, Any], labels: Mapping[str, str], name: str) -> bool:
    """NodeAffinity's filter: `nodeSelector` and the required terms (any term)."""
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    required = _node_affinity(pod).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    return any(term_matches(term, labels, name) for term in required.get("nodeSelectorTerms") or [])


# ------------------------------------------------------------------ scores (pure)
def least_requested_score(requested: int, capacity: int) -> int:
    """`leastRequestedScore`: the unused share of `capacity` on 0…100 (integer division)."""
    if capacity == 0 or requested > capacity:
        return 0
    return ((capacity - requested) * MAX_NODE_SCORE) // capacity


def least_allocated(requested: Sequence[int], allocatable: Sequence[int], weights: Sequence[int]) -> int:
    """`leastResourceScorer`: the weighted mean of `least_requested_score` over resources with allocatable."""
    score = weight_sum = 0
    for req, alloc, weight in zip(requested, allocatable, weights, strict=True):
        if alloc == 0:
            continue
        score += least_requested_score(req, alloc) * weight
        weight_sum += weight
    return score // weight_sum if weight_sum else 0


def balanced_allocation(requested: Sequence[int], allocatable: Sequence[int]) -> int:
    """`balancedResourceScorer`: (1 − standard deviation of the requested fractions, each capped at 1) × 100."""
    fractions = [min(1.0, float(req) / float(alloc)) for req, alloc in zip(requested, allocatable, strict=True)
                 if alloc != 0]
    std = 0.0
    if len(fractions) == 2:
        std = abs((fractions[0] - fractions[1]) / 2)
    elif len(fractions) > 2:
        mean = sum(fractions) / len(fractions)
        std = math.sqrt(sum((f - mean) * (f - mean) for f in fractions) / len(fractions))
    return int((1 - std) * float(MAX_NODE_SCORE))


def default_normalize(scores: Sequence[int], *, reverse: bool) -> list[int]:
    """`helper.DefaultNormalizeScore`: scale to 0…100 by the maximum (reversed: 100 minus that)."""
    top = max(scores, default=0)
    if top == 0:
        return [MAX_NODE_SCORE if reverse else 0 for _ in scores]
    scaled = [MAX_NODE_SCORE * s // top for s in scores]
    return [MAX_NODE_SCORE - s for s in scaled] if reverse else scaled


def extender_weighted(score: int, weight: int) -> int:
    """An extender's 0…10 score on kube-scheduler's scale: `score * weight * (MaxNodeScore / MaxExtenderPriority)`."""
    return score * weight * (MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)


def pop_best(totals: Sequence[int], randomizers: Sequence[int]) -> int:
    """The index `sortedNodeScores.Pop()` returns: Go's `container/heap` Init then Pop, ordered by score then
    randomizer (greater first), so among equal keys the heap's own order decides, as upstream."""
    order = list(range(len(totals)))

    def less(i: int, j: int) -> bool:
        a, b = order[i], order[j]
        return totals[a] > totals[b] or (totals[a] == totals[b] and randomizers[a] > randomizers[b])

    def down(i0: int, n: int) -> None:
        i = i0
        while True:
            j1 = 2 * i + 1
            if j1 >= n or j1 < 0:
                break
            j = j1
            j2 = j1 + 1
            if j2 < n and less(j2, j1):
                j = j2
            if not less(j, i):
                break
            order[i], order[j] = order[j], order[i]
            i = j

    n = len(order)
    for i in range(n // 2 - 1, -1, -1):
        down(i, n)
    order[0], order[n - 1] = order[n - 1], order[0]
    down(0, n - 1)
    return order[n - 1]


def num_feasible_nodes_to_find(percentage: int, nodes: int) -> int:
    """`numFeasibleNodesToFind`: how many feasible nodes end the search (0: the adaptive default)."""
    if nodes < MIN_FEASIBLE_NODES_TO_FIND:
        return nodes
    if percentage == 0:
        percentage = max(50 - nodes // 125, MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND)
    found = nodes * percentage // 100
    return max(found, MIN_FEASIBLE_NODES_TO_FIND)


# ------------------------------------------------------------------ the view
@dataclass(slots=True)
class _Node:
    name: str
    obj: JsonObject
    allocatable: dict[str, int]
    labels: dict[str, str]
    taints: list[dict[str, Any]]
    unschedulable: bool
    requested: dict[str, int] = field(default_factory=dict)
    non_zero: dict[str, int] = field(default_factory=dict)
    pods: int = 0


@dataclass(frozen=True, slots=True)
class _Placed:
    node: str
    requested: dict[str, int]
    non_zero: dict[str, int]
    affinity: bool


def _node_entry(obj: JsonObject) -> _Node:
    name = object_key(obj)
    status = obj.get("status") or {}
    spec = obj.get("spec") or {}
    allocatable = {k: _amount(k, v, name, f"status.allocatable[{k}]")
                   for k, v in (status.get("allocatable") or {}).items()}
    if status.get("images"):
        raise StandInError(f"node {name}: status.images: ImageLocality scoring is not implemented")
    return _Node(name, obj, allocatable, dict((obj.get("metadata") or {}).get("labels") or {}),
                 list(spec.get("taints") or []), bool(spec.get("unschedulable")))


class ClusterView:
    """kube-scheduler's cache: nodes and the pods bound (or assumed) on them, from two informers."""

    def __init__(self, api: KubeApi) -> None:
        self.lock = threading.RLock()
        self.nodes: dict[str, _Node] = {}
        self._placed: dict[str, _Placed] = {}
        self._assumed: set[str] = set()
        self._affinity_pods = 0
        self._node_informer = Informer(api, node_path(), name="standin nodes")
        self._pod_informer = Informer(api, "/api/v1/pods", name="standin pods")
        self._on_node: dict[str, set[str]] = {}
        """Node name → keys of the pods placed there."""
        self._node_informer.add_handler(self._node_changed)
        self._pod_informer.add_handler(self._on_pod)

    def start(self, timeout_s: float = 30.0) -> None:
        self._node_informer.start()
        self._pod_informer.start()
        if not (self._node_informer.wait_synced(timeout_s) and self._pod_informer.wait_synced(timeout_s)):
            raise TimeoutError("the stand-in's informers did not sync")

    def close(self) -> None:
        self._node_informer.stop()
        self._pod_informer.stop()

    def _node_changed(self, kind: str, old: JsonObject | None, new: JsonObject | None) -> None:
        with self.lock:
            if new is None or kind == "DELETED":
                if old is not None:
                    self.nodes.pop(object_key(old), None)
                return
            entry = _node_entry(new)
            for key in self._on_node.get(entry.name, ()):  # pods seen before their node, or a changed node
                placed = self._placed[key]
                _add(entry.requested, placed.requested)
                _add(entry.non_zero, placed.non_zero)
                entry.pods += 1
            self.nodes[entry.name] = entry

    def _on_pod(self, kind: str, old: JsonObject | None, new: JsonObject | None) -> None:
        with self.lock:
            if new is None or kind == "DELETED":
                if old is not None:
                    self._remove(object_key(old))
                return
            key = object_key(new)
            node = (new.get("spec") or {}).get("nodeName")
            phase = (new.get("status") or {}).get("phase")
            if not node or phase in ("Succeeded", "Failed"):
                if key not in self._assumed:
                    self._remove(key)
                return
            self._assumed.discard(key)
            self._remove(key)
            self._add(key, new, str(node))

    def _add(self, key: str, pod: Mapping[str, Any], node: str) -> None:
        affinity = bool({"podAffinity", "podAntiAffinity"} & set((pod.get("spec") or {}).get("affinity") or {}))
        placed = _Placed(node, pod_requests(pod), pod_requests(pod, non_missing=NON_ZERO), affinity)
        self._placed[key] = placed
        self._on_node.setdefault(node, set()).add(key)
        self._affinity_pods += affinity
        entry = self.nodes.get(node)
        if entry is not None:
            _add(entry.requested, placed.requested)
            _add(entry.non_zero, placed.non_zero)
            entry.pods += 1

    def _remove(self, key: str) -> None:
        placed = self._placed.pop(key, None)
        if placed is None:
            return
        self._on_node[placed.node].discard(key)
        self._affinity_pods -= placed.affinity
        entry = self.nodes.get(placed.node)
        if entry is not None:
            _add(entry.requested, {k: -v for k, v in placed.requested.items()})
            _add(entry.non_zero, {k: -v for k, v in placed.non_zero.items()})
            entry.pods -= 1

    def assume(self, pod: Mapping[str, Any], node: str) -> None:
        """Count the pod on `node` before its bind is seen (`Cache.AssumePod`)."""
        key = object_key(pod)
        with self.lock:
            self._remove(key)
            self._assumed.add(key)
            self._add(key, pod, node)

    def forget(self, pod: Mapping[str, Any]) -> None:
        """A failed bind (`Cache.ForgetPod`)."""
        key = object_key(pod)
        with self.lock:
            if key in self._assumed:
                self._assumed.discard(key)
                self._remove(key)

    def has_affinity_pods(self) -> bool:
        return self._affinity_pods > 0

    def node_count(self) -> int:
        with self.lock:
            return len(self.nodes)


# ------------------------------------------------------------------ extender client
@dataclass(frozen=True, slots=True)
class ExtenderConfig:
    """One entry of a KubeSchedulerConfiguration's `extenders`."""

    url_prefix: str
    filter_verb: str = ""
    prioritize_verb: str = ""
    bind_verb: str = ""
    weight: int = 1
    node_cache_capable: bool = False
    ignorable: bool = False
    managed: frozenset[str] = frozenset()
    ignored: frozenset[str] = frozenset()
    """Managed resources with `ignoredByScheduler`: NodeResourcesFit does not count them."""

    @staticmethod
    def from_config(entry: Mapping[str, Any]) -> ExtenderConfig:
        managed = entry.get("managedResources") or []
        return ExtenderConfig(str(entry["urlPrefix"]), str(entry.get("filterVerb") or ""),
                              str(entry.get("prioritizeVerb") or ""), str(entry.get("bindVerb") or ""),
                              int(entry.get("weight") or 1), bool(entry.get("nodeCacheCapable")),
                              bool(entry.get("ignorable")), frozenset(str(m["name"]) for m in managed),
                              frozenset(str(m["name"]) for m in managed if m.get("ignoredByScheduler")))


class ExtenderError(Exception):
    """An extender call failed (transport, HTTP status, or `Error` in its answer)."""


class ExtenderClient:
    """kube-scheduler's `HTTPExtender`: one keep-alive HTTP/1.1 connection, the config's verbs and node shape."""

    def __init__(self, config: ExtenderConfig, *, timeout_s: float = 30.0) -> None:
        self.config = config
        url = urllib.parse.urlsplit(config.url_prefix)
        self._path = url.path.rstrip("/")
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 80
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def post(self, verb: str, body: Mapping[str, Any]) -> Any:
        """POST `body` to `verb`; the decoded answer (ExtenderError on a transport error or a status not 200)."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        while True:
            reused = self._conn is not None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            try:
                self._conn.request("POST", f"{self._path}/{verb}", payload, {"Content-Type": "application/json"})
                response = self._conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                # An idle keep-alive connection the server closed: sent again once on a new one, as Go's
                # transport does; any other failure is the call's.
                if reused and isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                               ConnectionResetError)):
                    continue
                raise ExtenderError(f"{verb}: {exc}") from exc
            if response.status != 200:
                raise ExtenderError(f"{verb}: HTTP {response.status}: {raw[:300]!r}")
            return json.loads(raw)

    def interested(self, pod: Mapping[str, Any]) -> bool:
        return managed_by(pod, self.config.managed)

    def _args(self, pod: Mapping[str, Any], nodes: Sequence[_Node]) -> dict[str, Any]:
        if self.config.node_cache_capable:
            return {"Pod": pod, "Nodes": None, "NodeNames": [n.name for n in nodes]}
        return {"Pod": pod, "Nodes": {"items": [n.obj for n in nodes]}, "NodeNames": None}

    def filter(self, pod: Mapping[str, Any], nodes: Sequence[_Node]) -> tuple[list[_Node], dict[str, str],
                                                                               dict[str, str]]:
        """`HTTPExtender.Filter`: the nodes it passed (of those sent), FailedNodes, FailedAndUnresolvableNodes."""
        if not self.config.filter_verb:
            return list(nodes), {}, {}
        result = self.post(self.config.filter_verb, self._args(pod, nodes))
        if result.get("Error"):
            raise ExtenderError(str(result["Error"]))
        by_name = {n.name: n for n in nodes}
        if self.config.node_cache_capable and result.get("NodeNames") is not None:
            passed = [by_name[name] for name in result["NodeNames"] if name in by_name]
        else:
            items = (result.get("Nodes") or {}).get("items") or []
            passed = [by_name[object_key(item)] for item in items if object_key(item) in by_name]
        return passed, dict(result.get("FailedNodes") or {}), dict(result.get("FailedAndUnresolvableNodes") or {})

    def prioritize(self, pod: Mapping[str, Any], nodes: Sequence[_Node]) -> dict[str, int]:
        """`HTTPExtender.Prioritize`: host → 0…10 (empty when there is no prioritize verb)."""
        if not self.config.prioritize_verb:
            return {}
        result = self.post(self.config.prioritize_verb, self._args(pod, nodes))
        if not isinstance(result, list):
            raise ExtenderError(f"prioritize: not a HostPriorityList: {str(result)[:200]}")
        return {str(entry["Host"]): int(entry["Score"]) for entry in result}

    def bind(self, pod: Mapping[str, Any], node: str) -> str:
        """`HTTPExtender.Bind`: the error, empty on success."""
        meta = pod.get("metadata") or {}
        result = self.post(self.config.bind_verb, {"PodName": meta.get("name"), "PodNamespace": meta.get("namespace"),
                                                    "PodUID": meta.get("uid"), "Node": node})
        return str(result.get("Error") or "")


# ------------------------------------------------------------------ the scheduling cycle
@dataclass(frozen=True, slots=True)
class CycleResult:
    """One `ScheduleOne`: the node bound (None: not scheduled) and why not."""

    pod: str
    node: str | None
    message: str = ""
    feasible: int = 0
    evaluated: int = 0
    scores: dict[str, int] = field(default_factory=dict)
    """Total score per node when prioritizeNodes ran (empty with one feasible node)."""


class StandInScheduler:
    """kube-scheduler's scheduling and binding cycle over `view`, with the extenders of `config`
    (a KubeSchedulerConfiguration as `scheduler_config` writes it). `seed` seeds the tie-break randomizers."""

    def __init__(self, api: KubeApi, config: Mapping[str, Any], *, seed: int = 0,
                 view: ClusterView | None = None, weights: Mapping[str, int] | None = None) -> None:
        self.api = api
        self.view = view if view is not None else ClusterView(api)
        self._owns_view = view is None
        self.extenders = [ExtenderClient(ExtenderConfig.from_config(e)) for e in config.get("extenders") or []]
        self.percentage = int(config.get("percentageOfNodesToScore") or 0)
        profile = (config.get("profiles") or [{}])[0]
        if profile.get("percentageOfNodesToScore") is not None:
            self.percentage = int(profile["percentageOfNodesToScore"])
        if profile.get("plugins"):
            raise StandInError("profiles[0].plugins: only the default plugins are implemented")
        self.weights = dict(weights or DEFAULT_SCORE_WEIGHTS)
        self.ignored, self.ignored_groups = _fit_ignored(profile.get("pluginConfig") or [], self.extenders)
        self.rng = random.Random(seed)
        self.next_start = 0

    def start(self) -> StandInScheduler:
        if self._owns_view:
            self.view.start()
        return self

    def close(self) -> None:
        for extender in self.extenders:
            extender.close()
        if self._owns_view:
            self.view.close()

    # -------------------------------------------------------------- filters
    def _filter(self, pod: Mapping[str, Any], requests: Mapping[str, int], node: _Node) -> str | None:
        """The first default filter `node` fails, or None."""
        spec = pod.get("spec") or {}
        tolerations = spec.get("tolerations") or []
        if node.unschedulable and not any(tolerates(t, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
                                          for t in tolerations):
            return ERR_UNSCHEDULABLE
        if spec.get("nodeName") and spec["nodeName"] != node.name:
            return ERR_NODE_NAME
        if node.taints:
            bad = untolerated(node.taints, tolerations, frozenset({"NoSchedule", "NoExecute"}))
            if bad:
                return f"node(s) had untolerated taint {{{bad[0].get('key')}: {bad[0].get('value') or ''}}}"
        if not matches_node(pod, node.labels, node.name):
            return ERR_AFFINITY
        if node.pods + 1 > node.allocatable.get("pods", 0):
            return ERR_TOO_MANY_PODS
        short = [name for name, want in requests.items()
                 if want > 0 and name != "pods" and not self._ignores(name)
                 and want > node.allocatable.get(name, 0) - node.requested.get(name, 0)]
        if short:
            return ", ".join(f"Insufficient {name}" for name in sorted(short))
        return None

    def _ignores(self, resource: str) -> bool:
        """NodeResourcesFit's `ignoredResources` and `ignoredResourceGroups` (extended resources only)."""
        if resource in ("cpu", "memory", "ephemeral-storage") or resource.startswith("hugepages-"):
            return False
        return resource in self.ignored or resource.split("/", 1)[0] in self.ignored_groups

    def _find_feasible(self, pod: Mapping[str, Any], nodes: Sequence[_Node],
                       failures: dict[str, str]) -> list[_Node]:
        requests = pod_requests(pod)
        count = len(nodes)
        wanted = num_feasible_nodes_to_find(self.percentage, count)
        feasible: list[_Node] = []
        processed = 0
        for i in range(count):
            node = nodes[(self.next_start + i) % count]
            processed += 1
            reason = self._filter(pod, requests, node)
            if reason is None:
                feasible.append(node)
                if len(feasible) >= wanted:
                    break
            else:
                failures[node.name] = reason
        self.next_start = (self.next_start + processed) % count if count else 0
        return feasible

    def _run_extender_filters(self, pod: Mapping[str, Any], feasible: list[_Node], failures: dict[str, str]
                              ) -> list[_Node]:
        for extender in self.extenders:
            if not feasible:
                break
            if not extender.interested(pod):
                continue
            try:
                feasible, failed, unresolvable = extender.filter(pod, feasible)
            except ExtenderError:
                if extender.config.ignorable:
                    continue
                raise
            failures.update(failed)
            failures.update(unresolvable)
        return feasible

    # -------------------------------------------------------------- scores
    def _refuse_unscored(self, pod: Mapping[str, Any]) -> None:
        """StandInError for what PodTopologySpread and InterPodAffinity would filter or score (not implemented)."""
        obj = object_key(pod)
        spec = pod.get("spec") or {}
        if spec.get("topologySpreadConstraints"):
            raise StandInError(f"pod {obj}: spec.topologySpreadConstraints: PodTopologySpread is not implemented")
        affinity = spec.get("affinity") or {}
        for kind in ("podAffinity", "podAntiAffinity"):
            if affinity.get(kind):
                raise StandInError(f"pod {obj}: spec.affinity.{kind}: InterPodAffinity is not implemented")
        if any(ref.get("controller") for ref in (pod.get("metadata") or {}).get("ownerReferences") or []):
            raise StandInError(f"pod {obj}: metadata.ownerReferences: PodTopologySpread's system default constraints "
                               "are not implemented")
        if self.view.has_affinity_pods():
            raise StandInError("a placed pod has inter-pod affinity terms: InterPodAffinity is not implemented")

    def plugin_scores(self, pod: Mapping[str, Any], nodes: Sequence[_Node]) -> dict[str, list[int]]:
        """Each default score plugin's normalised 0…100 scores of `nodes` (unweighted; 0 where it skips)."""
        spec = pod.get("spec") or {}
        zero = [0] * len(nodes)
        tolerations = [t for t in spec.get("tolerations") or [] if (t.get("effect") or "") in ("", "PreferNoSchedule")]
        prefer = [len(untolerated(n.taints, tolerations, frozenset({"PreferNoSchedule"}))) for n in nodes]
        preferred = _node_affinity(pod).get("preferredDuringSchedulingIgnoredDuringExecution") or []
        affinity = [sum(int(term.get("weight") or 0) for term in preferred
                        if term_matches(term.get("preference") or {}, n.labels, n.name)) for n in nodes]
        wanted = pod_requests(pod, non_missing=NON_ZERO)
        actual = pod_requests(pod)
        resources = ("cpu", "memory")
        least = [least_allocated([n.non_zero.get(r, 0) + wanted.get(r, 0) for r in resources],
                                 [n.allocatable.get(r, 0) for r in resources], (1, 1)) for n in nodes]
        if all(actual.get(r, 0) == 0 for r in resources):
            balanced = zero  # PreScore: Skip for a best-effort pod
        else:
            balanced = [balanced_allocation([n.requested.get(r, 0) + actual.get(r, 0) for r in resources],
                                            [n.allocatable.get(r, 0) for r in resources]) for n in nodes]
        return {
            "TaintToleration": default_normalize(prefer, reverse=True),
            "NodeAffinity": default_normalize(affinity, reverse=False) if preferred else zero,
            "NodeResourcesFit": least,
            "PodTopologySpread": zero,  # no constraints (refused above): PreScore skips
            "InterPodAffinity": zero,  # no terms anywhere (refused above): PreScore skips
            "NodeResourcesBalancedAllocation": balanced,
            "ImageLocality": zero,  # no node reports images (refused in the view): every score is 0
        }

    def prioritize(self, pod: Mapping[str, Any], nodes: Sequence[_Node]) -> tuple[list[int], list[int]]:
        """`prioritizeNodes`: total scores and randomizers of `nodes`."""
        totals = [0] * len(nodes)
        for name, scores in self.plugin_scores(pod, nodes).items():
            weight = self.weights.get(name, 0)
            for i, score in enumerate(scores):
                totals[i] += weight * score
        randomizers = [0] * len(nodes)
        index = {n.name: i for i, n in enumerate(nodes)}
        extra: dict[str, int] = {}
        for extender in self.extenders:
            if not extender.interested(pod):
                continue
            try:
                answer = extender.prioritize(pod, nodes)
            except ExtenderError:
                continue  # "Prioritization errors from extender can be ignored"
            for host, score in answer.items():
                extra[host] = extra.get(host, 0) + extender_weighted(score, extender.config.weight)
        for host, score in extra.items():
            at = index.get(host)
            if at is not None:
                totals[at] += score
                randomizers[at] = self.rng.getrandbits(63)
        return totals, randomizers

    # -------------------------------------------------------------- one pod
    def schedule_one(self, pod: Mapping[str, Any]) -> CycleResult:
        """Schedule `pod` (as the API returned it) and bind it; the result says where, or why not."""
        key = object_key(pod)
        self._refuse_unscored(pod)
        with self.view.lock:
            nodes = list(self.view.nodes.values())
            if not nodes:
                return CycleResult(key, None, "no nodes available to schedule pods")
            failures: dict[str, str] = {}
            feasible: list[_Node] = []
            nominated = (pod.get("status") or {}).get("nominatedNodeName")
            try:
                if nominated and nominated in self.view.nodes:
                    node = self.view.nodes[nominated]
                    reason = self._filter(pod, pod_requests(pod), node)
                    if reason is None:
                        feasible = self._run_extender_filters(pod, [node], {})
                if not feasible:
                    feasible = self._run_extender_filters(pod, self._find_feasible(pod, nodes, failures), failures)
            except ExtenderError as exc:
                return CycleResult(key, None, f"extender: {exc}")
            evaluated = len(feasible) + len(failures)
            if not feasible:
                return CycleResult(key, None, _fit_message(len(nodes), failures), 0, evaluated)
            scores: dict[str, int] = {}
            if len(feasible) == 1:
                host = feasible[0].name
            else:
                totals, randomizers = self.prioritize(pod, feasible)
                host = feasible[pop_best(totals, randomizers)].name
                scores = {n.name: t for n, t in zip(feasible, totals, strict=True)}
            self.view.assume(pod, host)
        error = self._bind(pod, host)
        if error:
            self.view.forget(pod)
            return CycleResult(key, None, f"binding rejected: {error}", len(feasible), evaluated, scores)
        return CycleResult(key, host, "", len(feasible), evaluated, scores)

    def _bind(self, pod: Mapping[str, Any], node: str) -> str:
        for extender in self.extenders:
            if not extender.config.bind_verb or not extender.interested(pod):
                continue
            try:
                error = extender.bind(pod, node)
            except ExtenderError as exc:
                error = str(exc)
            if error and extender.config.ignorable:
                continue
            return error
        namespace, name = split_key(object_key(pod))
        meta = pod.get("metadata") or {}
        try:
            self.api.create(pod_path(namespace, name, "binding"), {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace,
                                                                    "uid": meta.get("uid")},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}})
        except ApiError as exc:
            return str(exc)
        return ""


def _fit_ignored(plugin_config: Sequence[Mapping[str, Any]], extenders: Sequence[ExtenderClient]
                 ) -> tuple[frozenset[str], frozenset[str]]:
    """The resources and resource groups NodeResourcesFit ignores: its args' `ignoredResources` and
    `ignoredResourceGroups`, the extenders' `ignoredByScheduler` resources replacing the former when there are any
    (`buildExtenders`). StandInError for any other plugin configuration."""
    resources: frozenset[str] = frozenset()
    groups: frozenset[str] = frozenset()
    for i, entry in enumerate(plugin_config):
        args = entry.get("args") or {}
        other = set(args) - {"ignoredResources", "ignoredResourceGroups"}
        if entry.get("name") != "NodeResourcesFit" or other:
            raise StandInError(f"profiles[0].pluginConfig[{i}]: only NodeResourcesFit's ignoredResources and "
                               "ignoredResourceGroups are implemented")
        resources = frozenset(str(r) for r in args.get("ignoredResources") or [])
        groups = frozenset(str(g) for g in args.get("ignoredResourceGroups") or [])
    from_extenders = frozenset(name for e in extenders for name in e.config.ignored)
    return (from_extenders or resources), groups


def _fit_message(total: int, failures: Mapping[str, str]) -> str:
    """`FitError.Error()`: "0/N nodes are available: k reason, …." (reasons sorted)."""
    counts: dict[str, int] = {}
    for reason in failures.values():
        for part in reason.split(", "):
            counts[part] = counts.get(part, 0) + 1
    parts = sorted(f"{c} {r}" for r, c in counts.items())
    return f"0/{total} nodes are available: {', '.join(parts)}." if parts else f"0/{total} nodes are available."


# ------------------------------------------------------------------ the fill protocol through the extender
def node_manifest(spec: NodeSpec, *, split: int = 10, max_pods: int = DEFAULT_MAX_PODS) -> JsonObject:
    """A node as kubelet and gpuplane's node agent leave it: allocatable CPU, memory, pods and `gpuplane.io/gpu`
    (cards × split, as the device plugin advertises), labels, taints, cordon, and the GPU inventory annotation that
    `objects.node_spec` reads back as `spec`."""
    allocatable = {"cpu": f"{spec.cpu_milli}m", "memory": f"{spec.memory_mib}Mi", "pods": str(max_pods)}
    annotations: dict[str, str] = {}
    if spec.gpus and spec.gpu_model is not None:
        allocatable[RES_GPU] = str(spec.gpus * split)
        topo = spec.topology
        cards = tuple(CardInventory(i, f"GPU-{spec.name}-{i}", topo.numa[i], topo.pcie_switch[i])
                      for i in range(spec.gpus))
        annotations[INVENTORY] = NodeInventory(spec.gpu_model, cards, topo.nvlink_groups, topo.nics, spec.mig_mode,
                                               split).encode()
    labels = {"kubernetes.io/hostname": spec.name, **dict(spec.labels)}
    if spec.pool != "default":
        labels[POOL_LABEL] = spec.pool
    body: JsonObject = {}
    if spec.taints:
        body["taints"] = taints_json(spec.taints)
    if not spec.schedulable:
        body["unschedulable"] = True
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": spec.name, "labels": labels, "annotations": annotations},
            "spec": body, "status": {"allocatable": allocatable, "capacity": dict(allocatable)}}


@dataclass(frozen=True, slots=True)
class FillPlacement:
    seq: int
    pod: str
    node: str
    cards: tuple[int, ...]
    gpu_milli: int
    """Milli-cards the placement holds (0 when not placed)."""


@dataclass(frozen=True, slots=True)
class ExtenderFillResult:
    """A fill replay through the extender: what was arrived and allocated after each pod, and where each went."""

    filter_answers: str
    capacity_milli: int
    arrived_pct: tuple[float, ...]
    allocation_pct: tuple[float, ...]
    placements: tuple[FillPlacement, ...]
    wall_s: float

    @property
    def pods(self) -> int:
        return len(self.placements)

    @property
    def placed(self) -> int:
        return sum(1 for p in self.placements if p.node)

    def allocation_at(self, arrived: float) -> float:
        """Allocation % after the last pod whose arrival kept the arrived workload ≤ `arrived` % (as the
        simulator's `SimulationResult.allocation_at`)."""
        index = -1
        for i, value in enumerate(self.arrived_pct):
            if value <= arrived + 1e-9:
                index = i
            else:
                break
        return self.allocation_pct[index] if index >= 0 else 0.0

    def unallocated_at(self, arrived: float) -> float:
        return 100.0 - self.allocation_at(arrived)

    @property
    def unallocated_at_end(self) -> float:
        return 100.0 - (self.allocation_pct[-1] if self.allocation_pct else 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"filter_answers": self.filter_answers, "pods": self.pods, "placed": self.placed,
                "unallocated_pct_at_100": round(self.unallocated_at(100.0), 4),
                "unallocated_pct_at_end": round(self.unallocated_at_end, 4), "wall_s": round(self.wall_s, 2)}


def _seen(cluster: KubeCluster, key: str) -> bool:
    return cluster.get_pod(key) is not None


def _eventually(check: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.0005)


@dataclass(slots=True)
class _World:
    server: FakeApiServer
    apis: list[RestKubeApi]
    cluster: KubeCluster
    extender: Extender
    http: ExtenderServer
    standin: StandInScheduler

    def close(self) -> None:
        self.standin.close()
        self.http.close()
        self.extender.close()
        self.cluster.close()
        for api in self.apis:
            api.close()
        self.server.stop()


def _world(catalog: Catalog, nodes: Sequence[NodeSpec], profile: Profile, *, seed: int,
           filter_answers: FilterAnswers, split: int, max_pods: int) -> _World:
    server = FakeApiServer().start()
    apis: list[RestKubeApi] = []

    def client() -> RestKubeApi:
        api = RestKubeApi.from_url(server.url, request_timeout_s=60.0)
        apis.append(api)
        return api

    for spec in nodes:
        server.add_node(node_manifest(spec, split=split, max_pods=max_pods))
    cluster = KubeCluster(client(), catalog)
    core = Extender(cluster, catalog, profile, seed=seed, subscribe_lock=cluster.lock, filter_answers=filter_answers)
    http_server = ExtenderServer(core, port=0).start()
    standin = StandInScheduler(client(), scheduler_config(http_server.url), seed=seed).start()
    _eventually(lambda: standin.view.node_count() == len(nodes), "the stand-in's node view", 60.0)
    return _World(server, apis, cluster, core, http_server, standin)


def fill_through_extender(catalog: Catalog, nodes: Sequence[NodeSpec], workload: Sequence[PodRequest],
                          profile: Profile, *, seed: int = 42, filter_answers: FilterAnswers = FilterAnswers.CHOSEN,
                          split: int = 10, max_pods: int = DEFAULT_MAX_PODS,
                          progress: Callable[[int, int], None] | None = None) -> ExtenderFillResult:
    """The fill protocol through Kubernetes' protocols: every pod of `workload` (already tuned: `sim.replay.
    tune_workload`) is created in a local API server, scheduled by the stand-in calling gpuplane's extender (its
    scheduler built from `profile`, a fresh one, with `seed`) over HTTP, and deleted if it was not bound.

    `split`: units of `gpuplane.io/gpu` each card advertises; `max_pods`: the nodes' allocatable pods.
    """
    world = _world(catalog, nodes, profile, seed=seed, filter_answers=filter_answers, split=split, max_pods=max_pods)
    user = world.apis[0]
    capacity = sum(spec.gpus for spec in nodes if spec.gpu_model is not None) * MILLI_PER_CARD
    arrived: list[float] = []
    allocated: list[float] = []
    placements: list[FillPlacement] = []
    arrived_milli = used_milli = 0
    started = time.perf_counter()
    try:
        for seq, request in enumerate(workload):
            namespace, name = split_key(request.name)
            created = user.create(pod_path(namespace), pod_manifest(request))
            key = object_key(created)
            _eventually(functools.partial(_seen, world.cluster, key), f"pod {key} in the extender's view", 60.0)
            result = world.standin.schedule_one(created)
            arrived_milli += request.gpu_milli_total
            if result.node is not None:
                stored = world.server.get("pods", key) or {}
                raw = ((stored.get("metadata") or {}).get("annotations") or {}).get(ASSIGNMENT)
                cards: tuple[int, ...] = ()
                milli = 0
                if raw:
                    assignment = decode_assignment(raw, key)
                    cards, milli = assignment.card_indexes, assignment.gpu_milli
                used_milli += milli
                placements.append(FillPlacement(seq, request.name, result.node, cards, milli))
            else:
                user.delete(pod_path(namespace, name))
                placements.append(FillPlacement(seq, request.name, "", (), 0))
            arrived.append(arrived_milli * 100.0 / capacity if capacity else 0.0)
            allocated.append(used_milli * 100.0 / capacity if capacity else 0.0)
            if progress is not None and (seq % 256 == 0 or seq == len(workload) - 1):
                progress(seq + 1, len(workload))
    finally:
        world.close()
    return ExtenderFillResult(filter_answers.value, capacity, tuple(arrived), tuple(allocated), tuple(placements),
                              time.perf_counter() - started)


__all__ = [
    "DEFAULT_SCORE_WEIGHTS", "MAX_NODE_SCORE", "ClusterView", "CycleResult", "ExtenderClient", "ExtenderConfig",
    "ExtenderError", "ExtenderFillResult", "FillPlacement", "StandInError", "StandInScheduler", "balanced_allocation",
    "container_requests", "default_normalize", "extender_weighted", "fill_through_extender", "least_allocated",
    "least_requested_score", "managed_by", "matches_node", "node_manifest", "num_feasible_nodes_to_find",
    "pod_requests", "pop_best", "term_matches", "tolerates",
]
