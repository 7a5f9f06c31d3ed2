"""The embedded simulated cluster: an in-process world that implements the cluster port.

It plays the API server and the kubelets: it stores nodes and pods, validates binds against its own
authoritative accounting (a bind that no longer fits fails with a conflict, as a kubelet admission
would), runs graceful evictions in virtual time and delivers watch events synchronously, in order.

Termination takes a kubelet's time: an evicted pod stays Terminating until its container exits (the
workload says so with `container_exited`) or its grace runs out (SIGKILL), then for `stop_s` more while
the runtime stops the container and its devices are released; only then is it deleted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from gpuplane.model import Assignment, Catalog, ClusterState, NodeSpec, NodeSpecError, PodRequest, PoolConfig, Taint
from gpuplane.port import (
    DELETION_COST,
    ClusterEvent,
    EventKind,
    EventType,
    Handler,
    NodeInfo,
    ObjectEvent,
    PodInfo,
    PodPhase,
    Status,
    Unsubscribe,
)
from gpuplane.sim.engine import EventLoop

Admit = Callable[[PodRequest], "PodRequest | str"]
"""An admission check: the (possibly completed) request, or the reason it is rejected."""


@dataclass(slots=True)
class Workload:
    """A replicated set of pods (a Deployment in miniature) that `scale` resizes."""

    name: str
    template: PodRequest
    replicas: int
    next_index: int = 0


def _deletion_cost(info: PodInfo) -> int:
    value = dict(info.annotations).get(DELETION_COST)
    return int(value) if value is not None else 0


def _merge(pairs: tuple[tuple[str, str], ...], changes: Mapping[str, str | None]) -> tuple[tuple[str, str], ...]:
    """Apply a Kubernetes-style map patch: a None value removes the key. Result sorted by key."""
    merged = dict(pairs)
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return tuple(sorted(merged.items()))


class SimCluster:
    def __init__(self, catalog: Catalog, nodes: Sequence[NodeSpec], *, loop: EventLoop | None = None,
                 pools: Mapping[str, PoolConfig] | None = None, stop_s: float = 0.0) -> None:
        if stop_s < 0:
            raise ValueError(f"stop_s must not be negative, got {stop_s}")
        self.loop = loop if loop is not None else EventLoop()  # an empty EventLoop is falsy (__len__)
        self.stop_s = stop_s
        """seconds from a container's exit (or kill) until its pod is gone and its cards are free"""
        self._stopping: set[str] = set()
        self.catalog = catalog
        self.state = ClusterState(catalog, nodes, pools)
        self._nodes: dict[str, NodeInfo] = {spec.name: NodeInfo(spec, 1) for spec in self.state.nodes}
        self._pods: dict[str, PodInfo] = {}
        self._handlers: list[Handler] = []
        self._outbox: deque[ClusterEvent] = deque()
        self._delivering = False
        self.workloads: dict[str, Workload] = {}
        self._workload_pods: dict[str, list[str]] = {}
        self.admission: list[Admit] = []
        """Checks every `create_pod` passes through, in order (the API server's admission chain)."""
        self.failed: dict[str, str] = {}
        """Pods that ended FAILED, with their reason."""
        self.events: list[ObjectEvent] = []
        """Every Event `record_event` recorded, in order (Kubernetes keeps them as core/v1 Events)."""

    # ------------------------------------------------------------------ reads
    def list_nodes(self) -> Sequence[NodeInfo]:
        return list(self._nodes.values())

    def list_pods(self) -> Sequence[PodInfo]:
        return list(self._pods.values())

    def get_pod(self, name: str) -> PodInfo | None:
        return self._pods.get(name)

    def watch(self, handler: Handler) -> Unsubscribe:
        self._handlers.append(handler)

        def unsubscribe() -> None:
            if handler in self._handlers:
                self._handlers.remove(handler)

        return unsubscribe

    def _emit(self, kind: EventKind, *, pod: PodInfo | None = None, node: NodeInfo | None = None) -> None:
        # Events a handler causes (it calls the port) queue behind the event being delivered, so every
        # subscriber sees the same order; delivery stays synchronous with the outermost call.
        self._outbox.append(ClusterEvent(kind, self.loop.now(), pod, node))
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._outbox:
                event = self._outbox.popleft()
                for handler in list(self._handlers):
                    if handler in self._handlers:  # unsubscribed by an earlier handler: stop at once
                        handler(event)
        finally:
            self._delivering = False

    # ------------------------------------------------------------------ pods
    def create_pod(self, request: PodRequest) -> Status:
        if request.name in self._pods:
            return Status.error(f"conflict: pod {request.name} already exists")
        for admit in self.admission:
            verdict = admit(request)
            if isinstance(verdict, str):
                return Status.error(f"rejected: pod {request.name}: {verdict}")
            request = verdict
        info = PodInfo(request, PodPhase.PENDING, created_at=self.loop.now())
        self._pods[request.name] = info
        self._emit(EventKind.POD_ADDED, pod=info)
        return Status.success()

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        info = self._pods.get(pod)
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is not PodPhase.PENDING:
            return Status.error(f"conflict: pod {pod} is {info.phase.value}, not Pending")
        node = self._nodes.get(assignment.node)
        if node is None:
            return Status.error(f"conflict: node {assignment.node} not found")
        if node_version is not None and node.resource_version != node_version:
            return Status.error(f"conflict: node {assignment.node} changed "
                                f"(version {node.resource_version}, expected {node_version})")
        reason = self.state.check(assignment, info.request)
        if reason is not None:
            return Status.error(f"conflict: {reason}")
        self.state.place(info.request, assignment, check=False)  # just checked
        bound = replace(info, phase=PodPhase.RUNNING, assignment=assignment, bound_at=self.loop.now())
        self._pods[pod] = bound
        self._emit(EventKind.POD_BOUND, pod=bound)
        return Status.success()

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        info = self._pods.get(pod)
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is PodPhase.TERMINATING:
            return Status.success()
        if info.phase is PodPhase.PENDING or (grace_s <= 0 and self.stop_s <= 0):
            return self.delete_pod(pod)
        terminating = replace(info, phase=PodPhase.TERMINATING,
                              annotations=(*info.annotations, ("gpuplane.io/eviction-reason", reason)))
        self._pods[pod] = terminating
        self._emit(EventKind.POD_TERMINATING, pod=terminating)
        self.loop.call_later(max(0.0, grace_s), lambda: self._stop_container(pod, terminating))
        return Status.success()

    def container_exited(self, pod: str) -> Status:
        """The Terminating pod's process exited before its grace ran out: the kubelet stops it now."""
        info = self._pods.get(pod)
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is not PodPhase.TERMINATING:
            return Status.error(f"conflict: pod {pod} is {info.phase.value}, not Terminating")
        self._stop_container(pod, info)
        return Status.success()

    def _stop_container(self, pod: str, terminating: PodInfo) -> None:
        # Only the eviction that made this pod object Terminating may delete it: a pod deleted and
        # created again under the same name must not be cut short by an older eviction's timer.
        if self._pods.get(pod) is not terminating or pod in self._stopping:
            return
        if self.stop_s <= 0:
            self.delete_pod(pod)
            return
        self._stopping.add(pod)
        self.loop.call_later(self.stop_s, lambda: self._finish_eviction(pod, terminating))

    def _finish_eviction(self, pod: str, terminating: PodInfo) -> None:
        self._stopping.discard(pod)
        if self._pods.get(pod) is terminating:
            self.delete_pod(pod)

    def delete_pod(self, pod: str) -> Status:
        info = self._pods.pop(pod, None)
        if info is None:
            return Status.error(f"pod {pod} not found")
        self._stopping.discard(pod)
        if pod in self.state.bindings:
            self.state.release(pod)
        workload = info.request.workload
        if workload is not None and workload in self._workload_pods:
            members = self._workload_pods[workload]
            if pod in members:
                members.remove(pod)
        self._emit(EventKind.POD_DELETED, pod=info)
        return Status.success()

    def fail_pod(self, pod: str, reason: str) -> Status:
        info = self._pods.get(pod)
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is not PodPhase.PENDING:
            return Status.error(f"conflict: pod {pod} is {info.phase.value}, not Pending")
        failed = replace(info, phase=PodPhase.FAILED,
                         annotations=(*info.annotations, ("gpuplane.io/failure-reason", reason)))
        del self._pods[pod]
        self.failed[pod] = reason
        members = self._workload_pods.get(info.request.workload or "")
        if members is not None and pod in members:
            members.remove(pod)
        self._emit(EventKind.POD_FAILED, pod=failed)
        return Status.success()

    # ------------------------------------------------------------------ workloads
    def create_workload(self, name: str, template: PodRequest, replicas: int = 0) -> Status:
        if name in self.workloads:
            return Status.error(f"conflict: workload {name} already exists")
        self.workloads[name] = Workload(name, template, 0)
        self._workload_pods[name] = []
        return self.scale(name, replicas)

    def scale(self, workload: str, replicas: int) -> Status:
        spec = self.workloads.get(workload)
        if spec is None:
            return Status.error(f"workload {workload} not found")
        if replicas < 0:
            return Status.error(f"replicas must not be negative, got {replicas}")
        members = self._workload_pods[workload]
        while len(members) < replicas:
            index = spec.next_index
            spec.next_index += 1
            name = f"{workload}-{index}"
            request = replace(spec.template, name=name, workload=workload, instance=index)
            members.append(name)
            self.create_pod(request)
        # Scale down removes pending pods first, then the lowest deletion cost, then the newest (Kubernetes'
        # ReplicaSet ranking, in short).
        if len(members) > replicas:
            ranked = sorted(range(len(members)), key=lambda i: (
                self._pods[members[i]].phase is not PodPhase.PENDING, _deletion_cost(self._pods[members[i]]), -i))
            for victim in [members[i] for i in ranked[: len(members) - replicas]]:
                self.delete_pod(victim)
        spec.replicas = replicas
        return Status.success()

    def patch_pod(self, pod: str, *, annotations: Mapping[str, str | None]) -> Status:
        info = self._pods.get(pod)
        if info is None:
            return Status.error(f"pod {pod} not found")
        cost = annotations.get(DELETION_COST)
        if cost is not None:
            try:
                int(cost)
            except ValueError:
                return Status.error(f"invalid: {DELETION_COST} must be an int32, got {cost!r}")
        self._pods[pod] = replace(info, annotations=_merge(info.annotations, annotations))
        return Status.success()

    def record_event(self, kind: Literal["Pod", "Node"], name: str, *, type_: EventType, reason: str,
                     message: str) -> Status:
        self.events.append(ObjectEvent(kind, name, type_, reason, message, self.loop.now()))
        return Status.success()

    # ------------------------------------------------------------------ nodes
    def add_node(self, spec: NodeSpec) -> Status:
        if spec.name in self._nodes:
            return Status.error(f"conflict: node {spec.name} already exists")
        self.state.add_node(spec)
        info = NodeInfo(self.state.nodes[self.state.node_index[spec.name]], 1)
        self._nodes[spec.name] = info
        self._emit(EventKind.NODE_ADDED, node=info)
        return Status.success()

    def patch_node(self, node: str, *, labels: Mapping[str, str | None] | None = None,
                   taints: Sequence[Taint] | None = None, annotations: Mapping[str, str | None] | None = None,
                   unschedulable: bool | None = None, pool: str | None = None) -> Status:
        info = self._nodes.get(node)
        if info is None:
            return Status.error(f"node {node} not found")
        spec = info.spec
        if labels is not None:
            spec = spec.with_changes(labels=_merge(spec.labels, labels))
        if taints is not None:
            spec = spec.with_changes(taints=tuple(taints))
        if unschedulable is not None:
            spec = spec.with_changes(schedulable=not unschedulable)
        if pool is not None:
            spec = spec.with_changes(pool=pool)
        notes = _merge(info.annotations, annotations or {})
        try:
            self.state.update_node(spec)
        except NodeSpecError as exc:
            return Status.error(f"invalid: {exc}")
        updated = NodeInfo(spec, info.resource_version + 1, notes)
        self._nodes[node] = updated
        self._emit(EventKind.NODE_UPDATED, node=updated)
        return Status.success()
