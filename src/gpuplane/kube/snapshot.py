"""A cluster read into gpuplane's model at one moment: nodes with their cards, running pods where they are, pending
pods, and what was left out and why. The input of `gpuplane snapshot` and of the what-if replay
(`gpuplane.sim.whatif`).

Two sources, one reading: the API server (`load_api`: list nodes and pods) or `kubectl get nodes,pods -A -o json`
files (`load_files`: a List, a NodeList/PodList, a single Node or Pod, or a directory of such `.json` files).
Every object goes through the codec the scheduler uses (`gpuplane.kube.objects`: `node_spec`, `pod_info`).

- Running pods: a pod bound to a node (`spec.nodeName`) and not finished. Three kinds (`Stack`): gpuplane's, with
  the card assignment it recorded (`gpuplane.io/assignment`); another GPU stack's (`nvidia.com/gpu`, …), holding
  whole cards, which its node's `gpuplane.io/foreign-cards` report names (`gpuplane.kube.foreign`) and the node
  codec counts as taken; and pods asking no GPU, which hold CPU and memory.
- Pending pods: not bound, asking for one of gpuplane's resources (the pods gpuplane's policies place).
- Left out (`skipped`, each with its reason): finished pods (Succeeded, Failed: no capacity), pending pods gpuplane
  does not place (no gpuplane resource, or another stack's GPU), objects that are not nodes or pods, files that are
  not JSON dumps.

A dump is never half-read: every object is checked (required fields, the codec, then the running pods bound one by
one into a `ClusterState` exactly as the replay will bind them), and any problem, named by file, object and field,
makes `SnapshotError`, which lists them all.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuplane.kube.api import JsonObject, KubeApi, node_path
from gpuplane.kube.foreign import FOREIGN_CARDS, ForeignReport, foreign_gpu_resource
from gpuplane.kube.objects import (
    ASSIGNMENT,
    DOMAIN,
    INVENTORY,
    RES_GPU,
    ObjectError,
    annotations_of,
    assigned_at,
    node_spec,
    object_key,
    parse_time,
    pod_info,
    pod_resources,
    wants_gpu,
)
from gpuplane.model import Assignment, Catalog, ClusterState, GpuplaneError, NodeSpec, PodRequest
from gpuplane.port import PodPhase

__all__ = [
    "CLUSTER_FILE", "PendingPod", "Problem", "RunningPod", "Skipped", "Snapshot", "SnapshotError", "Stack",
    "load_api", "load_files", "load_snapshot", "read_objects", "trimmed",
]

CLUSTER_FILE = "cluster.json"
"""What `gpuplane snapshot --out DIR` writes the objects it read to (`trimmed`), and `load_snapshot(DIR)` reads."""
FINISHED = (PodPhase.SUCCEEDED, PodPhase.FAILED)


class Stack(enum.Enum):
    """Who placed a running pod's GPUs."""

    GPUPLANE = "gpuplane"
    """Asks gpuplane's resources; holds the cards of its recorded assignment."""
    FOREIGN = "foreign"
    """Asks another GPU stack's resource (`nvidia.com/gpu`, …); holds whole cards the node codec counts as taken."""
    NONE = "none"
    """Asks no GPU: holds CPU and memory only."""


@dataclass(frozen=True, slots=True)
class RunningPod:
    request: PodRequest
    assignment: Assignment
    """gpuplane's recorded assignment; for the other stacks, the node alone (no gpuplane cards)."""
    stack: Stack
    started_at: float | None = None
    """When it was bound (gpuplane's `assigned-at`), else `status.startTime`, else its creation; None: unknown."""
    foreign_cards: tuple[int, ...] = ()
    """Another stack's pod: the cards its node's report names it on (all the node's cards when the report is
    missing or has devices it could not map: the codec then counts all of them as held)."""
    terminating: bool = False

    @property
    def name(self) -> str:
        return self.request.name


@dataclass(frozen=True, slots=True)
class PendingPod:
    request: PodRequest
    created_at: float | None = None

    @property
    def name(self) -> str:
        return self.request.name


@dataclass(frozen=True, slots=True)
class Skipped:
    """An object left out of the snapshot, and why (`obj`: `pod ns/name`, `node name`, or a file)."""

    obj: str
    reason: str


@dataclass(frozen=True, slots=True)
class Problem:
    """Why a dump cannot be read: in `source` (a file, or the API path), `obj`'s `field`."""

    source: str
    obj: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.source}: {self.obj}: {self.field}: {self.message}"


class SnapshotError(GpuplaneError):
    """A dump that cannot be read whole: every problem found, in source order."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"the snapshot cannot be read ({len(self.problems)} problem"
                         f"{'' if len(self.problems) == 1 else 's'}):\n{lines}")


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[NodeSpec, ...]
    """By name."""
    running: tuple[RunningPod, ...]
    """By name."""
    pending: tuple[PendingPod, ...]
    """Oldest first (the order a queue of equal priorities takes them in), then by name."""
    skipped: tuple[Skipped, ...]
    """By object."""
    taken_at: float | None
    """The latest time the objects record (node heartbeats, pod creations, starts and binds): the dump's moment."""
    sources: tuple[str, ...] = field(default=(), compare=False)
    """Files or API paths read (not compared: the same cluster read two ways is the same snapshot)."""
    objects: tuple[JsonObject, ...] = field(default=(), compare=False, repr=False)
    """The nodes and pods read, as `trimmed` keeps them (what `gpuplane snapshot` writes to `CLUSTER_FILE`)."""

    def running_of(self, stack: Stack) -> tuple[RunningPod, ...]:
        return tuple(p for p in self.running if p.stack is stack)

    def age_s(self, pod: RunningPod) -> float | None:
        """How long `pod` has run at the snapshot's moment (None: unknown)."""
        if pod.started_at is None or self.taken_at is None:
            return None
        return max(0.0, self.taken_at - pod.started_at)


# ------------------------------------------------------------------ sources
Source = tuple[str, Sequence[tuple[str, Mapping[str, Any]]]]
"""(source name, [(kind, object)])."""


def load_api(api: KubeApi, catalog: Catalog) -> Snapshot:
    """List the cluster's nodes and pods (all namespaces) and read them."""
    nodes, _ = api.list(node_path())
    pods, _ = api.list("/api/v1/pods")
    return read_objects([(node_path(), [("Node", n) for n in nodes]), ("/api/v1/pods", [("Pod", p) for p in pods])],
                        catalog)


def load_files(path: Path | str, catalog: Catalog) -> Snapshot:
    """Read `kubectl get nodes,pods -A -o json` output: one file, or every `.json` file of a directory (others are
    listed in `skipped`)."""
    path = Path(path)
    problems: list[Problem] = []
    skipped: list[Skipped] = []
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".json")
        skipped += [Skipped(str(p), "not a .json file") for p in sorted(path.iterdir())
                    if p.suffix != ".json" or not p.is_file()]
        if not files:
            problems.append(Problem(str(path), "-", "-", "no .json files in the directory"))
    elif path.is_file():
        files = [path]
    else:
        raise SnapshotError([Problem(str(path), "-", "-", "no such file or directory")])
    sources: list[Source] = []
    for file in files:
        objects = _file_objects(file, problems)
        if objects is not None:
            sources.append((str(file), objects))
    return read_objects(sources, catalog, problems=problems, skipped=skipped)


def load_snapshot(path: Path | str, catalog: Catalog) -> Snapshot:
    """What `simulate --snapshot` reads: a directory `gpuplane snapshot --out` wrote (its `CLUSTER_FILE`), or any
    dump `load_files` reads."""
    path = Path(path)
    written = path / CLUSTER_FILE
    return load_files(written if path.is_dir() and written.is_file() else path, catalog)


def _file_objects(file: Path, problems: list[Problem]) -> list[tuple[str, Mapping[str, Any]]] | None:
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(Problem(str(file), "-", "-", f"cannot read: {exc}"))
        return None
    except json.JSONDecodeError as exc:
        problems.append(Problem(str(file), "-", "-", f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"))
        return None
    if not isinstance(doc, Mapping):
        problems.append(Problem(str(file), "-", "-", "not a Kubernetes object (a JSON object with a kind)"))
        return None
    kind = doc.get("kind")
    if kind in ("Node", "Pod"):
        return [(str(kind), doc)]
    if not (isinstance(kind, str) and kind.endswith("List")):
        problems.append(Problem(str(file), "-", "kind", f"not a List, Node or Pod: {kind!r}"))
        return None
    items = doc.get("items")
    if not isinstance(items, list):
        problems.append(Problem(str(file), "-", "items", "missing or not a list"))
        return None
    implied = kind.removesuffix("List") if kind in ("NodeList", "PodList") else None
    found: list[tuple[str, Mapping[str, Any]]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            problems.append(Problem(str(file), f"items[{i}]", "-", "not an object"))
            continue
        item_kind = item.get("kind") or implied
        if not isinstance(item_kind, str):
            problems.append(Problem(str(file), f"items[{i}] {object_key(item) or '(no name)'}", "kind", "missing"))
            continue
        found.append((item_kind, item))
    return found


# ------------------------------------------------------------------ reading
@dataclass(slots=True)
class _Reader:
    catalog: Catalog
    problems: list[Problem]
    skipped: list[Skipped]
    nodes: dict[str, tuple[str, NodeSpec, Mapping[str, Any]]] = field(default_factory=dict)
    bad_nodes: set[str] = field(default_factory=set)
    pods: dict[str, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    node_objects: dict[str, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    kept: list[JsonObject] = field(default_factory=list)
    flawed: set[tuple[str, str]] = field(default_factory=set)
    """(source, object) of every problem so far."""

    def problem(self, source: str, obj: str, field_name: str, message: str) -> None:
        self.problems.append(Problem(source, obj, field_name, message))
        self.flawed.add((source, obj))

    def codec(self, source: str, obj: str, exc: ObjectError) -> None:
        message = str(exc).removeprefix(f"{exc.obj}: {exc.field}: ")
        self.problem(source, obj, exc.field, message)

    def first_seen(self, store: dict[str, tuple[str, Mapping[str, Any]]], key: str, source: str,
                   obj: Mapping[str, Any], label: str) -> bool:
        """Whether this is the object's first listing (stored under `key`); a second, different listing is a
        problem."""
        seen = store.get(key)
        if seen is None:
            store[key] = (source, obj)
            return True
        if dict(seen[1]) != dict(obj):
            self.problem(source, label, "-", f"listed again with other contents (first in {seen[0]})")
        return False

    def node(self, source: str, obj: Mapping[str, Any]) -> None:
        name = object_key(obj)
        label = f"node {name or '(no name)'}"
        if not self.first_seen(self.node_objects, name or f"(no name {len(self.node_objects)})", source, obj, label):
            return
        self.kept.append(trimmed("Node", obj))
        before = len(self.problems)
        status = obj.get("status")
        allocatable = status.get("allocatable") if isinstance(status, Mapping) else None
        if not isinstance(allocatable, Mapping):
            self.problem(source, label, "status.allocatable", "missing (the node's capacity is unknown)")
        else:
            for resource in ("cpu", "memory"):
                if resource not in allocatable:
                    self.problem(source, label, f"status.allocatable[{resource}]", "missing")
            if str(allocatable.get(RES_GPU, "0")).strip() not in ("0", "") and INVENTORY not in annotations_of(obj):
                self.problem(source, label, f"metadata.annotations[{INVENTORY}]",
                             f"missing on a node offering {RES_GPU} (its cards are unknown: is the node agent up?)")
        for condition in _list(status.get("conditions")) if isinstance(status, Mapping) else []:
            if isinstance(condition, Mapping):
                self._time(condition.get("lastHeartbeatTime"))
        try:
            spec = node_spec(obj, self.catalog)
        except ObjectError as exc:
            self.codec(source, label, exc)
        if len(self.problems) > before:
            if name:
                self.bad_nodes.add(name)
            return
        self.nodes[name] = (source, spec, obj)

    def _time(self, raw: object) -> float | None:
        stamp = parse_time(raw)
        if stamp is not None:
            self.times.append(stamp)
        return stamp

    def pod(self, source: str, obj: Mapping[str, Any]) -> None:
        key = object_key(obj)
        label = f"pod {key or '(no name)'}"
        if not self.first_seen(self.pods, key or f"(no name {len(self.pods)})", source, obj, label):
            return
        self.kept.append(trimmed("Pod", obj))
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
        assert isinstance(meta, Mapping)
        if meta.get("name") and not meta.get("namespace"):
            self.problem(source, label, "metadata.namespace", "missing")
        spec = obj.get("spec")
        if isinstance(spec, Mapping) and not spec.get("containers"):
            self.problem(source, label, "spec.containers", "missing (a pod has at least one container)")
        status = obj.get("status")
        if not isinstance(status, Mapping) or not status.get("phase"):
            self.problem(source, label, "status.phase", "missing (running or pending is unknown)")

    def pod_entries(self) -> tuple[list[RunningPod], list[PendingPod]]:
        running: list[RunningPod] = []
        pending: list[PendingPod] = []
        for key, (source, obj) in self.pods.items():
            label = f"pod {object_key(obj) or '(no name)'}"
            if (source, label) in self.flawed:
                continue  # a required field is missing: the codec would read a guess
            try:
                info = pod_info(obj, self.catalog)
                stamp = assigned_at(obj)
            except ObjectError as exc:
                self.codec(source, label, exc)
                continue
            meta = obj.get("metadata")
            assert isinstance(meta, Mapping)
            created = self._time(meta.get("creationTimestamp"))
            status = obj.get("status")
            assert isinstance(status, Mapping)
            started = self._time(status.get("startTime"))
            if stamp is not None:
                self.times.append(stamp)
            foreign = sorted(name for name, value in pod_resources(obj).items()
                             if foreign_gpu_resource(name) and value > 0)
            ours = wants_gpu(obj)
            if info.phase in FINISHED:
                self.skipped.append(Skipped(label, f"finished ({info.phase.value}): holds no capacity"))
                continue
            if info.assignment is None:
                if ours:
                    pending.append(PendingPod(info.request, created))
                elif foreign:
                    self.skipped.append(Skipped(label, f"pending, asks {', '.join(foreign)}: another GPU stack "
                                                       "places it, not gpuplane"))
                else:
                    self.skipped.append(Skipped(label, "pending, asks no gpuplane.io GPU resource: kube-scheduler "
                                                       "places it, not gpuplane's policies"))
                continue
            node = info.assignment.node
            if node in self.bad_nodes:
                continue  # its node's problems are listed; its placement cannot be checked
            if node not in self.nodes:
                self.problem(source, label, "spec.nodeName", f"node {node!r} is not in the snapshot")
                continue
            if ours and ASSIGNMENT not in annotations_of(obj):
                self.problem(source, label, f"metadata.annotations[{ASSIGNMENT}]",
                             "missing on a bound pod asking gpuplane.io resources (its cards are unknown)")
                continue
            stack = Stack.GPUPLANE if ours else Stack.FOREIGN if foreign else Stack.NONE
            cards: tuple[int, ...] = ()
            if stack is Stack.FOREIGN:
                held = self._foreign_cards(source, label, key, node, foreign)
                if held is None:
                    continue
                cards = held
            begun = stamp if stamp is not None else started if started is not None else created
            running.append(RunningPod(info.request, info.assignment, stack, begun, cards,
                                      info.phase is PodPhase.TERMINATING))
        return running, pending

    def _foreign_cards(self, source: str, label: str, key: str, node: str,
                       resources: Sequence[str]) -> tuple[int, ...] | None:
        _, spec, node_obj = self.nodes[node]
        raw = annotations_of(node_obj).get(FOREIGN_CARDS)
        if raw is None or not spec.gpus:
            return tuple(sorted(spec.foreign_cards))  # unreported: the codec holds them all; or no gpuplane cards
        report = ForeignReport.decode(raw)  # the node codec read it already
        named = tuple(h.index for h in report.holds if key in h.pods)
        if named and not report.unmapped:
            return named
        if report.unmapped:
            return tuple(sorted(spec.foreign_cards))
        self.problem(source, label, "spec.nodeName",
                     f"holds {', '.join(resources)} on node {node}, whose {FOREIGN_CARDS} report names no card for it "
                     "(the report lags: dump again once the node agent has published it)")
        return None

    def check_placements(self, running: Sequence[RunningPod]) -> list[RunningPod]:
        """Bind the running pods one by one into a `ClusterState`, as the replay will: what does not fit now (a
        card the node lacks, a whole card held twice, CPU past allocatable) is a problem naming the pod."""
        state = ClusterState(self.catalog, [spec for _, spec, _ in self.nodes.values()])
        holders: dict[tuple[str, int], list[str]] = {}
        placed = []
        for pod in running:
            source = self.pods[pod.name][0]
            reason = state.check(pod.assignment, pod.request)
            if reason is not None:
                others = sorted({h for c in pod.assignment.card_indexes for h in holders.get((pod.assignment.node, c),
                                                                                                 [])})
                also = f" (already placed there: {', '.join(others)})" if others else ""
                field_name = f"metadata.annotations[{ASSIGNMENT}]" if pod.stack is Stack.GPUPLANE else "spec.nodeName"
                self.problem(source, f"pod {pod.name}", field_name,
                             f"does not fit on node {pod.assignment.node}: {reason}{also}")
                continue
            state.place(pod.request, pod.assignment)
            for c in pod.assignment.card_indexes:
                holders.setdefault((pod.assignment.node, c), []).append(pod.name)
            placed.append(pod)
        return placed


def read_objects(sources: Iterable[Source], catalog: Catalog, *, problems: list[Problem] | None = None,
                 skipped: list[Skipped] | None = None) -> Snapshot:
    """Read `(kind, object)` pairs from each source into a `Snapshot`, or raise `SnapshotError` with every
    problem (those already in `problems` first)."""
    reader = _Reader(catalog, problems if problems is not None else [], skipped if skipped is not None else [])
    names: list[str] = []
    for source, objects in sources:
        names.append(source)
        for kind, obj in objects:
            if kind == "Node":
                reader.node(source, obj)
            elif kind == "Pod":
                reader.pod(source, obj)
            else:
                reader.skipped.append(Skipped(f"{kind} {object_key(obj) or '(no name)'}",
                                              f"kind {kind}: the snapshot reads nodes and pods only"))
    running, pending = reader.pod_entries()
    running.sort(key=lambda p: p.name)
    placed = reader.check_placements(running)
    if reader.problems:
        raise SnapshotError(reader.problems)
    pending.sort(key=lambda p: (p.created_at if p.created_at is not None else float("inf"), p.name))
    return Snapshot(
        nodes=tuple(spec for _, spec, _ in sorted(reader.nodes.values(), key=lambda n: n[1].name)),
        running=tuple(placed), pending=tuple(pending), skipped=tuple(sorted(reader.skipped, key=lambda k: k.obj)),
        taken_at=max(reader.times) if reader.times else None, sources=tuple(names), objects=tuple(reader.kept))


# ------------------------------------------------------------------ what is kept
_NODE_SPEC_FIELDS = ("taints", "unschedulable")
_POD_SPEC_FIELDS = ("nodeName", "schedulerName", "priority", "priorityClassName", "preemptionPolicy", "nodeSelector",
                    "affinity", "tolerations", "topologySpreadConstraints", "resourceClaims", "schedulingGates",
                    "overhead", "resources")


def _list(value: object) -> list[Any]:
    """A list as it is; anything else (absent, or malformed: the codec names it) as no items."""
    return value if isinstance(value, list) else []


def _ours(annotations: object) -> dict[str, Any]:
    if not isinstance(annotations, Mapping):
        return {}
    return {k: v for k, v in annotations.items() if str(k).startswith(f"{DOMAIN}/")}


def _container(raw: Mapping[str, Any]) -> JsonObject:
    kept: JsonObject = {k: raw[k] for k in ("name", "resources", "restartPolicy") if k in raw}
    ports = raw.get("ports")
    if not isinstance(ports, list):
        if ports is not None:
            kept["ports"] = ports  # malformed: kept for the codec to name
    elif any(isinstance(p, Mapping) and p.get("hostPort") for p in ports):
        kept["ports"] = [{"hostPort": p["hostPort"]} for p in ports if isinstance(p, Mapping) and p.get("hostPort")]
    return kept


def trimmed(kind: str, obj: Mapping[str, Any]) -> JsonObject:
    """What the snapshot reads of a node or pod and nothing else (no environment, commands or images: a dump of a
    real cluster can hold secrets there); `read_objects` reads the trimmed object as it reads the original."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    status = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
    assert isinstance(meta, Mapping) and isinstance(spec, Mapping) and isinstance(status, Mapping)
    keep_meta = ("name", "namespace", "labels", "ownerReferences", "creationTimestamp", "deletionTimestamp")
    new_meta: JsonObject = {k: meta[k] for k in keep_meta if k in meta}
    new_meta["annotations"] = _ours(meta.get("annotations"))
    if kind == "Node":
        conditions = [{"type": c.get("type"), "lastHeartbeatTime": c.get("lastHeartbeatTime")}
                      for c in _list(status.get("conditions")) if isinstance(c, Mapping)]
        new_status: JsonObject = {k: status[k] for k in ("allocatable",) if k in status}
        if conditions:
            new_status["conditions"] = conditions
        return {"apiVersion": "v1", "kind": "Node", "metadata": new_meta,
                "spec": {k: spec[k] for k in _NODE_SPEC_FIELDS if k in spec}, "status": new_status}
    new_spec: JsonObject = {k: spec[k] for k in _POD_SPEC_FIELDS if k in spec}
    for name in ("initContainers", "containers"):
        if isinstance(spec.get(name), list):
            new_spec[name] = [_container(c) if isinstance(c, Mapping) else c for c in spec[name]]
    raw_volumes = spec.get("volumes")
    if raw_volumes is not None and not isinstance(raw_volumes, list):
        new_spec["volumes"] = raw_volumes  # malformed: kept for the codec to name
    volumes = [v if not isinstance(v, Mapping) else  # malformed: kept for the codec to name
               {"name": v.get("name"), **{k: v[k] for k in ("persistentVolumeClaim", "ephemeral") if k in v}}
               for v in _list(raw_volumes) if not isinstance(v, Mapping)
               or ("persistentVolumeClaim" in v or "ephemeral" in v)]
    if volumes:
        new_spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod", "metadata": new_meta, "spec": new_spec,
            "status": {k: status[k] for k in ("phase", "startTime") if k in status}}
