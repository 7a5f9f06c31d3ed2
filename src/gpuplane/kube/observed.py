"""What the metrics of a scheduling process over Kubernetes are computed from (`docs/monitoring.md`).

The one `ClusterObserver` of a cluster runs in the process that schedules: gpuplane-scheduler's leader
(`SchedulerMode`), or, in extender mode, the extender beside the kube-scheduler that holds its Lease. Two
things here keep its figures gpuplane's own and counted once:

* `OwnPods`: the port as that observer sees it. Pending pods of other schedulers are not gpuplane's queue, and
  their binds are not gpuplane's latency; they still hold cards, so their binds come through as plain pod
  updates (the observer keeps them for the card gauges and records no latency).
* `KubeSchedulerLease`: whether the kube-scheduler in this pod leads, read from its Lease. Both replicas'
  extenders see every event; only the leader's may count them (`gpuplane extender --metrics-port`).

`PortView` passes every port call through; `OwnPods` and the extender's serialised port build on it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

from gpuplane.kube.api import ApiError, KubeApi
from gpuplane.model import Assignment, PodRequest, Taint
from gpuplane.port import (
    ClusterEvent,
    ClusterPort,
    EventKind,
    EventType,
    Handler,
    NodeInfo,
    PodInfo,
    PodPhase,
    Status,
    Unsubscribe,
)

log = logging.getLogger(__name__)


class PortView:
    """`port`, every call passed through; each watch event delivered while holding `lock` (None: no lock)."""

    def __init__(self, port: ClusterPort, lock: AbstractContextManager[Any] | None = None) -> None:
        self._port = port
        self._lock = lock

    def list_nodes(self) -> Sequence[NodeInfo]:
        return self._port.list_nodes()

    def list_pods(self) -> Sequence[PodInfo]:
        return self._port.list_pods()

    def watch(self, handler: Handler) -> Unsubscribe:
        lock = self._lock
        if lock is None:
            return self._port.watch(handler)

        def locked(event: ClusterEvent) -> None:
            with lock:
                handler(event)

        return self._port.watch(locked)

    def create_pod(self, request: PodRequest) -> Status:
        return self._port.create_pod(request)

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        return self._port.bind(pod, assignment, node_version=node_version)

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        return self._port.evict(pod, grace_s=grace_s, reason=reason)

    def delete_pod(self, pod: str) -> Status:
        return self._port.delete_pod(pod)

    def fail_pod(self, pod: str, reason: str) -> Status:
        return self._port.fail_pod(pod, reason)

    def scale(self, workload: str, replicas: int) -> Status:
        return self._port.scale(workload, replicas)

    def patch_pod(self, pod: str, *, annotations: Mapping[str, str | None]) -> Status:
        return self._port.patch_pod(pod, annotations=annotations)

    def patch_node(self, node: str, *, labels: Mapping[str, str | None] | None = None,
                   taints: Sequence[Taint] | None = None, annotations: Mapping[str, str | None] | None = None,
                   unschedulable: bool | None = None, pool: str | None = None) -> Status:
        return self._port.patch_node(node, labels=labels, taints=taints, annotations=annotations,
                                     unschedulable=unschedulable, pool=pool)

    def record_event(self, kind: Literal["Pod", "Node"], name: str, *, type_: EventType, reason: str,
                     message: str) -> Status:
        return self._port.record_event(kind, name, type_=type_, reason=reason, message=message)


class OwnPods(PortView):
    """`port` without the pending pods that `ours(name)` disowns, and with their binds as `POD_ADDED` (the
    observer keeps the bound pod on its cards and records no scheduling latency for it). `ours` is asked
    only about pods the port shows (bound, or pending as the event arrives)."""

    def __init__(self, port: ClusterPort, ours: Callable[[str], bool]) -> None:
        super().__init__(port)
        self._ours = ours

    def list_pods(self) -> Sequence[PodInfo]:
        ours = self._ours
        return [p for p in self._port.list_pods() if p.phase is not PodPhase.PENDING or ours(p.name)]

    def watch(self, handler: Handler) -> Unsubscribe:
        ours = self._ours

        def own(event: ClusterEvent) -> None:
            pod = event.pod
            if pod is not None and event.kind in (EventKind.POD_ADDED, EventKind.POD_BOUND) and not ours(pod.name):
                if pod.phase is PodPhase.PENDING:
                    return
                if event.kind is EventKind.POD_BOUND:
                    event = dataclasses.replace(event, kind=EventKind.POD_ADDED)
            handler(event)

        return self._port.watch(own)


def scheduled_by(pods: Callable[[str], Mapping[str, Any] | None], scheduler_name: str) -> Callable[[str], bool]:
    """`OwnPods`' `ours` for pods whose `spec.schedulerName` is `scheduler_name`; `pods` reads a pod
    (`namespace/name`) from an informer cache (`KubeCluster.pods.get`)."""

    def ours(name: str) -> bool:
        raw = pods(name)
        return raw is not None and ((raw.get("spec") or {}).get("schedulerName") or "default-scheduler") == \
            scheduler_name

    return ours


class KubeSchedulerLease:
    """Whether the kube-scheduler in this pod holds the Lease `namespace/name`.

    kube-scheduler's holder identity is `<hostname>_<uuid>` and the containers of one pod share the hostname,
    so the holder's prefix names the pod. As client-go does, the holder's timestamps are never compared with
    our clock: the lease counts as held while its record was seen to change within its `leaseDurationSeconds`
    on `now` (a holder that died stops counting one lease duration after its last renewal we saw). An API
    error keeps the last answer."""

    def __init__(self, api: KubeApi, namespace: str, name: str, *, now: Callable[[], float],
                 hostname: str | None = None) -> None:
        self.api = api
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.now = now
        self._record: tuple[str, str] | None = None
        self._seen_at = float("-inf")
        self._leads = False

    def leads(self) -> bool:
        """Read the Lease once; whether this pod's kube-scheduler holds it now."""
        try:
            lease = self.api.get(self.path)
        except ApiError as exc:
            if exc.status == 404:
                self._leads = False
            else:
                log.warning("cannot read %s: %s", self.path, exc)
            return self._leads
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        record = (holder, str(spec.get("renewTime") or ""))
        now = self.now()
        if record != self._record:
            self._record, self._seen_at = record, now
        duration = float(spec.get("leaseDurationSeconds") or 15)
        self._leads = holder.startswith(f"{self.hostname}_") and now - self._seen_at < duration
        return self._leads


__all__ = ["KubeSchedulerLease", "OwnPods", "PortView", "scheduled_by"]
