"""The co-location guard's containers, taken from the pods on this node.

Each running pod bound to the node that holds gpuplane cards (annotation `gpuplane.io/assignment`) becomes one
guard container per card it holds: QoS from its label `gpuplane.io/qos` (online by default, as the scheduler reads
it; offline and best-effort are both the guard's offline), its processes the members of its pod cgroup (v2) under
the kubelet's layout, its memory quota the MiB the assignment gives it on that card. MIG slices are left out
(the hardware isolates them: nothing to arbitrate). A pod that is deleted, terminating or finished drops out, and
the guard continues its processes if it had stopped them, so that they handle the kubelet's SIGTERM.

The pods come from an `Informer` on `/api/v1/pods` with `fieldSelector=spec.nodeName=<node>`: a change reaches the
guard as soon as the watch brings it, and the list is rebuilt every `refresh_s` as well.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpuplane.kube.api import PODS_ALL, KubeApi
from gpuplane.kube.informer import Informer
from gpuplane.kube.objects import (
    ASSIGNMENT,
    ObjectError,
    annotations_of,
    decode_assignment,
    object_key,
    pod_phase,
    pod_qos,
    quantity,
)
from gpuplane.model import QoS
from gpuplane.node.guard import ColocationGuard, ContainerSpec
from gpuplane.port import PodPhase

log = logging.getLogger(__name__)

CgroupDriver = Literal["systemd", "cgroupfs"]
MIB = 1 << 20
GUARANTEED, BURSTABLE, BEST_EFFORT = "Guaranteed", "Burstable", "BestEffort"
_COMPUTE = ("cpu", "memory")
"""The resources Kubernetes derives a pod's QoS class from."""


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Where the kubelet puts a pod's cgroup (cgroup v2, `--cgroups-per-qos`, the default cgroup root).

    systemd driver: `kubepods.slice/kubepods-pod<uid>.slice` for Guaranteed pods,
    `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice` (and `besteffort`) for the others,
    with the uid's dashes as underscores (a dash is systemd's slice separator). cgroupfs driver:
    `kubepods/pod<uid>`, `kubepods/burstable/pod<uid>`, `kubepods/besteffort/pod<uid>`."""

    driver: CgroupDriver = "systemd"
    root: Path = Path("/sys/fs/cgroup")

    def pod_dir(self, uid: str, qos_class: str) -> Path:
        tier = {GUARANTEED: "", BURSTABLE: "burstable", BEST_EFFORT: "besteffort"}[qos_class]
        if self.driver == "cgroupfs":
            return self.root / "kubepods" / tier / f"pod{uid}" if tier else self.root / "kubepods" / f"pod{uid}"
        escaped = uid.replace("-", "_")
        top = self.root / "kubepods.slice"
        if not tier:
            return top / f"kubepods-pod{escaped}.slice"
        return top / f"kubepods-{tier}.slice" / f"kubepods-{tier}-pod{escaped}.slice"


def kube_qos_class(pod: Mapping[str, Any]) -> str:
    """The pod's Kubernetes QoS class: `status.qosClass` (the API server sets it at creation), else derived as the
    kubelet does from the containers' CPU and memory requests and limits (a request left out is its limit)."""
    status = pod.get("status")
    given = status.get("qosClass") if isinstance(status, Mapping) else None
    if given in (GUARANTEED, BURSTABLE, BEST_EFFORT):
        return str(given)
    obj = object_key(pod)
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    containers = [(f"spec.{kind}[{i}]", c) for kind in ("initContainers", "containers")
                  for i, c in enumerate(spec.get(kind) or []) if isinstance(c, Mapping)]
    any_set, guaranteed = False, bool(containers)
    for where, container in containers:
        limits = _compute(container, "limits", obj, where)
        requests = {**limits, **_compute(container, "requests", obj, where)}  # a request left out is its limit
        any_set |= bool(limits or requests)
        guaranteed &= set(limits) == set(_COMPUTE) and requests == limits
    if not any_set:
        return BEST_EFFORT
    return GUARANTEED if guaranteed else BURSTABLE


def _compute(container: Mapping[str, Any], kind: str, obj: str, where: str) -> dict[str, Decimal]:
    """The container's non-zero CPU and memory `limits` or `requests`."""
    resources = container.get("resources")
    raw = resources.get(kind) if isinstance(resources, Mapping) else None
    raw = raw if isinstance(raw, Mapping) else {}
    read = {name: quantity(raw[name], obj, f"{where}.resources.{kind}.{name}") for name in _COMPUTE if name in raw}
    return {name: value for name, value in read.items() if value > 0}


def _uid(pod: Mapping[str, Any], obj: str) -> str:
    meta = pod.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    if not isinstance(uid, str) or not uid or "/" in uid:
        raise ObjectError(obj, "metadata.uid", f"missing or not a uid: {uid!r}")
    return uid


def _running(pod: Mapping[str, Any]) -> bool:
    """Running its containers now: not terminating (its processes must be free to handle SIGTERM), and with
    `status.phase` Running (`pod_phase` also counts a bound pod still pulling images, or one in phase Unknown)."""
    status = pod.get("status")
    return (pod_phase(pod) is PodPhase.RUNNING
            and isinstance(status, Mapping) and status.get("phase") == "Running")


def pod_containers(pod: Mapping[str, Any], node: str, layout: CgroupLayout) -> tuple[ContainerSpec, ...]:
    """The guard's containers for one pod of `node`: none for a pod that is not running or holds no gpuplane
    card. Raises `ObjectError` (naming the field) for a GPU pod that cannot be read."""
    raw = annotations_of(pod).get(ASSIGNMENT)
    if not raw or not _running(pod):
        return ()
    obj = object_key(pod)
    assignment = decode_assignment(raw, obj)
    if assignment.node != node:
        raise ObjectError(obj, f"metadata.annotations[{ASSIGNMENT}]",
                          f"names node {assignment.node!r}, but the pod runs on {node!r}")
    shares = [s for s in assignment.cards if s.mig_profile is None]
    if not shares:
        return ()
    qos = pod_qos(pod)
    cgroup = layout.pod_dir(_uid(pod, obj), kube_qos_class(pod))
    several = len(shares) > 1
    return tuple(
        ContainerSpec(name=f"{obj}#{share.card}" if several else obj, card=share.card,
                      qos="online" if qos is QoS.ONLINE else "offline", cgroup=cgroup,
                      memory_quota_bytes=share.memory_mib * MIB if share.memory_mib > 0 and not share.whole else None)
        for share in shares)


@dataclass(frozen=True, slots=True)
class PodScan:
    containers: tuple[ContainerSpec, ...]
    """Sorted by name."""
    unreadable: dict[str, str]
    """Pod key -> why it was skipped."""


def scan_pods(pods: Sequence[Mapping[str, Any]], node: str, layout: CgroupLayout) -> PodScan:
    """Every guard container of these pods; a pod that cannot be read is skipped (and named), never fatal."""
    containers: list[ContainerSpec] = []
    unreadable: dict[str, str] = {}
    for pod in pods:
        try:
            containers.extend(pod_containers(pod, node, layout))
        except ObjectError as exc:
            unreadable[object_key(pod) or "pod"] = str(exc)
    return PodScan(tuple(sorted(containers, key=lambda c: c.name)), unreadable)


class PodContainerSource:
    """Feeds a guard the containers of the pods on `node` (plus `static` ones, which win a name clash).

    `start()` starts the informer; `run(guard, stop)` pushes the containers to the guard (`update_containers`)
    once the first list is in, then on every change the watch brings and every `refresh_s`. Metrics go to
    `registry` (the guard's, so they are served with its own)."""

    def __init__(self, api: KubeApi, node: str, layout: CgroupLayout, *, static: Sequence[ContainerSpec] = (),
                 refresh_s: float = 5.0, registry: CollectorRegistry | None = None,
                 informer: Informer | None = None) -> None:
        self.node = node
        self.layout = layout
        self.static = tuple(static)
        self.refresh_s = refresh_s
        self.informer = informer or Informer(api, PODS_ALL, field_selector=f"spec.nodeName={node}",
                                             name=f"pods on {node}")
        self.informer.add_handler(lambda *_: self._changed.set())
        self._changed = threading.Event()
        self._unreadable: dict[str, str] = {}
        registry = registry if registry is not None else CollectorRegistry()
        self.skipped = Counter("gpuplane_guard_pods_unreadable",
                               "GPU pods on the node that could not be read (each once while it stays so).",
                               registry=registry)
        self.guarded = Gauge("gpuplane_guard_pod_containers", "Guard containers taken from the node's pods.",
                             registry=registry)

    def start(self) -> None:
        self.informer.start()

    def stop(self) -> None:
        self._changed.set()
        self.informer.stop()

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        return self.informer.wait_synced(timeout_s)

    def containers(self) -> tuple[ContainerSpec, ...]:
        """The static containers and those of the pods in the cache now. An unreadable pod is logged and
        counted when it becomes so, and skipped."""
        scan = scan_pods(self.informer.objects(), self.node, self.layout)
        for key, reason in scan.unreadable.items():
            if self._unreadable.get(key) != reason:
                self.skipped.inc()
                log.warning("pod %s skipped, the guard cannot read it: %s", key, reason)
        self._unreadable = scan.unreadable
        names = {c.name for c in self.static}
        for clash in (c.name for c in scan.containers if c.name in names):
            log.warning("pod container %s skipped: a configured container has that name", clash)
        from_pods = [c for c in scan.containers if c.name not in names]
        self.guarded.set(len(from_pods))
        return (*self.static, *from_pods)

    def run(self, guard: ColocationGuard, stop: threading.Event) -> None:
        """Until `stop` is set (and `stop()` called, to wake it): push the containers to `guard`."""
        while not stop.is_set():
            if not self.informer.has_synced:
                self.informer.wait_synced(self.refresh_s)
                continue
            self._changed.clear()
            try:
                guard.update_containers(self.containers())
            except ValueError as exc:  # a PID in two containers: keep guarding the last good list
                log.error("the node's containers were not taken: %s", exc)
            self._changed.wait(self.refresh_s)
