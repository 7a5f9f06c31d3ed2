"""`KubeCluster`: the cluster port over the Kubernetes API.

Reads come from informers on nodes and pods (`gpuplane.kube.informer`), converted with `gpuplane.kube.objects`;
writes are API calls. The port's semantics follow the simulated cluster, with the differences the API imposes:

- Events. Informer changes are queued and turned into `ClusterEvent`s by `pump()`, which also updates the
  view `list_nodes`/`list_pods` read, so a list and the events after it never disagree. With
  `dispatch="thread"` (the default) a dispatcher thread pumps, delivering under `lock`; a subscriber that also
  lists (a scheduler building its cache) should do both under `with cluster.lock:`. With `dispatch="manual"`
  the owner calls `pump()` (a single-threaded scheduler loop). The port's own writes (bind, patches) pump at
  once, so, as in the simulated cluster, their events have been delivered when the call returns.
- Pods. A pod that ended (Failed, Succeeded) leaves `list_pods` (POD_FAILED, or POD_DELETED for a success).
  A pod or node that cannot be read is logged and listed in `unreadable()`, never silently dropped; a pod that
  was readable and turns unreadable keeps its last readable state in the view. `pending_reasons()` says why each
  pending pod waits, as its scheduler wrote it (`PodScheduled=False`, `gpuplane.kube.pending`).
- Nodes. NODE_UPDATED is sent when a node's spec (as gpuplane reads it) or annotations change, not for every
  status heartbeat; `NodeInfo.resource_version` is the node's resourceVersion at that change.
- `bind` records the card assignment on the pod (a merge patch guarded by the pod's resourceVersion), then
  posts the Binding; a Binding refused outright takes the assignment back off the pod (bind-phase `failed`).
  It does not re-check card fit: the API server has no card accounting; the scheduler's cache is the check.
- `evict` posts a policy/v1 Eviction. 429 (a PodDisruptionBudget forbids it now) is retried with back-off;
  when the retries run out the answer is `Status(Code.PENDING, ("blocked: …",))`: not done, not failed, try
  again later. 404 is success (already gone).
- `record_event` posts a core/v1 Event about the pod or node, shaped as client-go's legacy recorder does
  (`gpuplane.kube.events`), from `event_component` on `event_instance` (default: the host name).
- `scale(workload)`: `namespace/Kind/name` with Kind Deployment, ReplicaSet or StatefulSet, or
  `namespace/name` for a Deployment. A ReplicaSet controlled by a Deployment scales the Deployment (the
  Deployment controller would undo a change to its ReplicaSet). Pod removal order is the controllers' business.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from gpuplane.kube.api import ApiError, JsonObject, KubeApi, node_path, pod_path
from gpuplane.kube.events import core_event, events_path
from gpuplane.kube.informer import DELETED, Informer
from gpuplane.kube.network import RdmaNetworks, rdma_annotations
from gpuplane.kube.objects import (
    ASSIGNED_AT,
    ASSIGNMENT,
    BIND_PHASE,
    CHECKPOINT_EVERY,
    GANG_LABEL,
    GANG_SIZE,
    GPU_MODELS,
    INSTANCE_LABEL,
    MIG_PROFILE,
    PHASE_FAILED,
    POOL_LABEL,
    QOS_LABEL,
    QUEUE_LABEL,
    RES_CORES,
    RES_DECODERS,
    RES_ENCODERS,
    RES_GPU,
    RES_MEM,
    RES_MEM_PCT,
    RES_RDMA,
    SCHEDULER_ANNOTATIONS,
    SCHEDULER_NAME,
    WORKLOAD_LABEL,
    ObjectError,
    annotations_of,
    assignment_annotations,
    node_affinity_json,
    node_info,
    object_key,
    pod_info,
    resource_version,
    split_key,
    taints_json,
    tolerations_json,
)
from gpuplane.kube.pending import pending_reason
from gpuplane.model import Assignment, Catalog, Fraction, MigSlice, PodRequest, Taint, WholeCards
from gpuplane.port import (
    Clock,
    ClusterEvent,
    EventKind,
    EventType,
    Handler,
    NodeInfo,
    PodInfo,
    PodPhase,
    Status,
    Unsubscribe,
    WallClock,
)
from gpuplane.port.status import Code

log = logging.getLogger(__name__)

EVICTION_REASON = "gpuplane.io/eviction-reason"
FAILED_REASON = "GpuplaneFailed"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
SCALABLE = {"Deployment": "deployments", "ReplicaSet": "replicasets", "StatefulSet": "statefulsets"}

_Change = tuple[str, str, JsonObject | None, JsonObject | None]  # (resource, type, old, new)


class KubeCluster:
    """The `ClusterPort` of a Kubernetes cluster.

    `api`: how to reach the API server. `clock`: event times and `assigned-at` stamps. `sleep`: the eviction
    back-off (default: real time, cut short by `close()`); the informers wait on real time. `namespace`: watch
    one namespace's pods only (None: all). `scheduler_name`: the `spec.schedulerName` of the pods `create_pod`
    makes. `event_component`/`event_instance`: who `record_event`'s Events say reported them (`source`,
    `reportingComponent`, `reportingInstance`; the instance defaults to the host name). `start=False` leaves the
    informers stopped until `start()`.
    """

    def __init__(self, api: KubeApi, catalog: Catalog, *, clock: Clock | None = None,
                 sleep: Callable[[float], None] | None = None, namespace: str | None = None,
                 pod_label_selector: str | None = None, dispatch: Literal["thread", "manual"] = "thread",
                 eviction_attempts: int = 4, eviction_backoff_s: float = 1.0, watch_timeout_s: int = 300,
                 sync_timeout_s: float = 30.0, scheduler_name: str = SCHEDULER_NAME, event_component: str = "gpuplane",
                 event_instance: str | None = None, start: bool = True) -> None:
        self.api = api
        self.event_component = event_component
        self.event_instance = event_instance if event_instance is not None else socket.gethostname()
        self._event_nanos = 0
        self._event_lock = threading.Lock()
        self.scheduler_name = scheduler_name
        """`spec.schedulerName` of the pods `create_pod` makes (the scheduler that is to place them)."""
        self.catalog = catalog
        self.clock: Clock = clock if clock is not None else WallClock()
        self._sleep = sleep
        self.eviction_attempts = max(1, eviction_attempts)
        self.eviction_backoff_s = eviction_backoff_s
        self.sync_timeout_s = sync_timeout_s
        self.dispatch = dispatch
        self.lock = threading.RLock()
        """Held while events are delivered and the view changes."""
        self._changes: deque[_Change] = deque()
        self._pending = threading.Condition(threading.Lock())
        self._handlers: list[Handler] = []
        self._delivering = False
        self._nodes: dict[str, NodeInfo] = {}
        self._pods: dict[str, PodInfo] = {}
        self._unreadable: dict[str, str] = {}
        self._waiting: dict[str, str] = {}
        """Pod → why it waits, from its `PodScheduled=False` condition (`kube.pending.pending_reason`)."""
        self._stopping = threading.Event()
        self._dispatcher: threading.Thread | None = None
        pods = pod_path(namespace) if namespace else "/api/v1/pods"
        self.nodes = Informer(api, node_path(), watch_timeout_s=watch_timeout_s, name="nodes")
        self.pods = Informer(api, pods, label_selector=pod_label_selector, watch_timeout_s=watch_timeout_s,
                             name="pods")
        self.nodes.add_handler(lambda t, old, new: self._queue("node", t, old, new))
        self.pods.add_handler(lambda t, old, new: self._queue("pod", t, old, new))
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the informers and wait for their first lists (TimeoutError after `sync_timeout_s`)."""
        self.nodes.start()
        self.pods.start()
        if not (self.nodes.wait_synced(self.sync_timeout_s) and self.pods.wait_synced(self.sync_timeout_s)):
            raise TimeoutError(f"the API server did not answer the first lists within {self.sync_timeout_s}s "
                               f"({self.nodes.last_error or self.pods.last_error or 'no answer'})")
        self.pump()
        if self.dispatch == "thread" and self._dispatcher is None:
            self._dispatcher = threading.Thread(target=self._dispatch_loop, name="kubecluster events", daemon=True)
            self._dispatcher.start()

    def close(self) -> None:
        self._stopping.set()
        self.nodes.stop()
        self.pods.stop()
        with self._pending:
            self._pending.notify_all()
        if self._dispatcher is not None:
            self._dispatcher.join(5.0)

    def __enter__(self) -> KubeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ events
    def _queue(self, resource: str, event_type: str, old: JsonObject | None, new: JsonObject | None) -> None:
        with self._pending:
            self._changes.append((resource, event_type, old, new))
            self._pending.notify_all()

    def _dispatch_loop(self) -> None:
        while not self._stopping.is_set():
            with self._pending:
                if not self._changes:
                    self._pending.wait(0.5)
            self.pump()

    def wait_for_changes(self, timeout_s: float) -> bool:
        """Block until informer changes wait to be pumped (manual dispatch); whether any do."""
        with self._pending:
            if not self._changes:
                self._pending.wait(timeout_s)
            return bool(self._changes)

    def pump(self) -> int:
        """Apply queued informer changes to the view and deliver their events, in order, on this thread.

        Returns the number of events delivered. Reentrant calls (from a handler) return 0 at once: the
        outer call delivers what they would have.
        """
        delivered = 0
        with self.lock:
            if self._delivering:
                return 0
            self._delivering = True
            try:
                while True:
                    with self._pending:
                        if not self._changes:
                            break
                        resource, event_type, old, new = self._changes.popleft()
                    events = (self._node_change(event_type, new or old) if resource == "node"
                              else self._pod_change(event_type, new or old, old if new is not None else None))
                    for event, handlers in events:
                        for handler in handlers:
                            if handler in self._handlers:
                                try:
                                    handler(event)
                                except Exception:  # one subscriber's bug must not end delivery to all
                                    log.exception("%s: a handler failed on %s", self, event.kind.value)
                        delivered += 1
            finally:
                self._delivering = False
        return delivered

    def _report(self, key: str, exc: ObjectError) -> None:
        if self._unreadable.get(key) != str(exc):
            log.warning("cannot read %s: %s", key, exc)
        self._unreadable[key] = str(exc)

    def _event(self, kind: EventKind, *, pod: PodInfo | None = None,
               node: NodeInfo | None = None) -> tuple[ClusterEvent, tuple[Handler, ...]]:
        return ClusterEvent(kind, self.clock.now(), pod, node), tuple(self._handlers)

    def _node_change(self, event_type: str, obj: JsonObject | None) -> list[tuple[ClusterEvent, tuple[Handler, ...]]]:
        assert obj is not None
        key = f"node {object_key(obj)}"
        name = object_key(obj)
        prev = self._nodes.get(name)
        if event_type == DELETED:
            self._unreadable.pop(key, None)
            if prev is None:
                return []
            del self._nodes[name]
            return [self._event(EventKind.NODE_REMOVED, node=prev)]
        try:
            info = self._read_node(obj)
        except ObjectError as exc:
            self._report(key, exc)
            return []
        self._unreadable.pop(key, None)
        if prev is None:
            self._nodes[name] = info
            return [self._event(EventKind.NODE_ADDED, node=info)]
        if prev.spec == info.spec and prev.annotations == info.annotations:
            return []
        self._nodes[name] = info
        return [self._event(EventKind.NODE_UPDATED, node=info)]

    def _read_node(self, obj: JsonObject) -> NodeInfo:
        """A node as the view holds it (`objects.node_info`; a subclass may read more, as the DRA world does)."""
        return node_info(obj, self.catalog)

    def _read_pod(self, obj: JsonObject, request: PodRequest | None) -> PodInfo:
        """A pod as the view holds it (`objects.pod_info`; `request`: unchanged since last read, else None)."""
        return pod_info(obj, self.catalog, request=request)

    def _pod_change(self, event_type: str, obj: JsonObject | None,
                    before: JsonObject | None = None) -> list[tuple[ClusterEvent, tuple[Handler, ...]]]:
        """`before`: the object as the informer held it before this change (None: not known)."""
        assert obj is not None
        name = object_key(obj)
        key = f"pod {name}"
        prev = self._pods.get(name)
        if event_type == DELETED:
            self._unreadable.pop(key, None)
            if prev is None:
                return []
            del self._pods[name]
            self._waiting.pop(name, None)
            return [self._event(EventKind.POD_DELETED, pod=prev)]
        # A change that leaves what the pod asks for as it was (the scheduler's annotations, the Binding, status)
        # keeps the request read before: most changes of a pod are those, and reading a request is the costly part.
        same = prev is not None and before is not None and key not in self._unreadable and \
            _asks_the_same(before, obj)
        try:
            info = self._read_pod(obj, prev.request if same and prev is not None else None)
        except ObjectError as exc:
            self._report(key, exc)
            return []
        self._unreadable.pop(key, None)
        finished = info.phase in (PodPhase.FAILED, PodPhase.SUCCEEDED)
        if prev is None and finished:
            return []  # ended before we saw it: it holds nothing
        events = []
        if prev is None:
            events.append(self._event(EventKind.POD_ADDED, pod=info))
        if info.assignment is not None and (prev is None or prev.assignment is None):
            events.append(self._event(EventKind.POD_BOUND, pod=info))
        if info.phase is PodPhase.TERMINATING and (prev is None or prev.phase is not PodPhase.TERMINATING):
            events.append(self._event(EventKind.POD_TERMINATING, pod=info))
        reason = pending_reason(obj) if info.phase is PodPhase.PENDING and info.assignment is None else None
        if reason is None:
            self._waiting.pop(name, None)
        else:
            self._waiting[name] = reason
        if finished:
            del self._pods[name]
            kind = EventKind.POD_FAILED if info.phase is PodPhase.FAILED else EventKind.POD_DELETED
            events.append(self._event(kind, pod=info))
        else:
            self._pods[name] = info
        return events

    # ------------------------------------------------------------------ reads
    def list_nodes(self) -> Sequence[NodeInfo]:
        with self.lock:
            return list(self._nodes.values())

    def list_pods(self) -> Sequence[PodInfo]:
        with self.lock:
            return list(self._pods.values())

    def get_pod(self, name: str) -> PodInfo | None:
        with self.lock:
            return self._pods.get(name)

    def pending_reasons(self) -> dict[str, str]:
        """Pending pod → why it waits, as its scheduler wrote it (`PodScheduled=False`, `kube.pending`); a pod
        no scheduler has judged yet is absent."""
        with self.lock:
            return dict(self._waiting)

    def unreadable(self) -> list[tuple[str, str]]:
        """Objects the codec refused, as (`pod ns/name` or `node name`, error); they are in no list."""
        with self.lock:
            return sorted(self._unreadable.items())

    def watch(self, handler: Handler) -> Unsubscribe:
        with self.lock:
            self._handlers.append(handler)

        def unsubscribe() -> None:
            with self.lock:
                if handler in self._handlers:
                    self._handlers.remove(handler)

        return unsubscribe

    # ------------------------------------------------------------------ writes
    def _absorb(self, informer: Informer, obj: JsonObject) -> None:
        """The answer to our own write is the freshest object there is: into the cache and the view now."""
        informer.offer(obj)
        self.pump()

    def create_pod(self, request: PodRequest) -> Status:
        try:
            body = pod_manifest(request, scheduler_name=self.scheduler_name)
        except ValueError as exc:
            return Status.error(f"rejected: pod {request.name}: {exc}")
        namespace, _ = split_key(request.name)
        try:
            created = self.api.create(pod_path(namespace), body)
        except ApiError as exc:
            if exc.status == 409:
                return Status.error(f"conflict: pod {request.name} already exists")
            return Status.error(f"rejected: pod {request.name}: {exc}")
        self._absorb(self.pods, created)
        return Status.success()

    rdma_networks = RdmaNetworks()
    """How a bind names the network of its RDMA NIC (`gpuplane.kube.network`; set another to change the namespace)."""

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        namespace, name = split_key(pod)
        key = f"{namespace}/{name}"
        with self.lock:
            info = self._pods.get(key)
            node = self._nodes.get(assignment.node)
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is not PodPhase.PENDING:
            return Status.error(f"conflict: pod {pod} is {info.phase.value}, not Pending")
        if node is None:
            return Status.error(f"conflict: node {assignment.node} not found")
        if node_version is not None and node.resource_version != node_version:
            return Status.error(f"conflict: node {assignment.node} changed "
                                f"(version {node.resource_version}, expected {node_version})")
        status, recorded = self._record_and_bind(namespace, name, assignment)
        if recorded is None:
            return status
        bound = copy.deepcopy(recorded)
        bound.setdefault("spec", {})["nodeName"] = assignment.node
        self.pods.assume(bound, resource_version(recorded))
        self.pump()
        return status

    def send_bind(self, pod: str, assignment: Assignment) -> Status:
        """`bind`'s API calls alone (record the assignment, post the Binding; a refused Binding takes the
        assignment back), without the checks against the view and without touching it: the watch brings the
        result. Safe from any thread (a scheduler's bind workers); the caller has checked the pod and node."""
        namespace, name = split_key(pod)
        return self._record_and_bind(namespace, name, assignment, offer=False)[0]

    def _record_and_bind(self, namespace: str, name: str, assignment: Assignment, *,
                         offer: bool = True) -> tuple[Status, JsonObject | None]:
        """Record the assignment (guarded by the cached resourceVersion), then post the Binding. Returns the
        status and, on success, the recorded pod (before the Binding)."""
        pod = f"{namespace}/{name}"
        cached = self.pods.get(pod)
        annotations = assignment_annotations(assignment, self.clock.now())
        if assignment.rdma is not None:  # the chosen NIC's network, in the same patch (gpuplane.kube.network)
            node, seen = self._nodes.get(assignment.node), self._pods.get(pod)
            current = annotations_of(cached) if cached is not None else dict(seen.annotations if seen else ())
            try:
                annotations.update(rdma_annotations(self.rdma_networks, current, pod,
                                                    node.spec.topology.nics if node else (), assignment.rdma))
            except ValueError as exc:
                return Status.error(f"bind of {pod} failed: {exc}"), None
        meta: dict[str, Any] = {"annotations": annotations}
        if cached is not None and cached.get("metadata", {}).get("resourceVersion"):
            meta["resourceVersion"] = cached["metadata"]["resourceVersion"]
        try:
            recorded = self.api.patch(pod_path(namespace, name), {"metadata": meta})
        except ApiError as exc:
            if exc.status == 409:
                return Status.error(f"conflict: pod {pod} changed before its assignment was recorded"), None
            if exc.status == 404:
                return Status.error(f"pod {pod} not found"), None
            return Status.error(f"bind of {pod} failed recording the assignment: {exc}"), None
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": assignment.node}}
        try:
            self.api.create(pod_path(namespace, name, "binding"), binding)
        except ApiError as exc:
            if exc.status != 0:  # refused: take the assignment back (0: unknown, the watch will tell)
                self._unrecord(namespace, name, offer=offer)
            prefix = "conflict: " if exc.status == 409 else ""
            return Status.error(f"{prefix}binding {pod} to {assignment.node} refused: {exc}"), None
        return Status.success(), recorded

    def _unrecord(self, namespace: str, name: str, *, offer: bool = True) -> None:
        """Take a refused bind's assignment back off the pod, unless the pod got bound meanwhile (`offer`: put
        the answer in the view now; else the watch brings it)."""
        try:
            current = self.api.get(pod_path(namespace, name))
            if current.get("spec", {}).get("nodeName"):
                return
            patch = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"],
                                  "annotations": {ASSIGNMENT: None, ASSIGNED_AT: None, BIND_PHASE: PHASE_FAILED}}}
            answer = self.api.patch(pod_path(namespace, name), patch)
            if offer:
                self._absorb(self.pods, answer)
        except ApiError as exc:
            log.warning("could not take the assignment back off %s/%s: %s", namespace, name, exc)

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        namespace, name = split_key(pod)
        cached = self.pods.get(pod)
        if reason and (cached is None or annotations_of(cached).get(EVICTION_REASON) != reason):
            try:
                self._absorb(self.pods, self.api.patch(pod_path(namespace, name),
                                                       {"metadata": {"annotations": {EVICTION_REASON: reason}}}))
            except ApiError as exc:
                if exc.status == 404:
                    return Status.success()
                log.warning("could not record the eviction reason on %s: %s", pod, exc)
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"gracePeriodSeconds": max(0, int(grace_s))}}
        blocked = ""
        for attempt in range(self.eviction_attempts):
            if attempt:
                self._wait(self.eviction_backoff_s * 2 ** (attempt - 1))
            try:
                self.api.create(pod_path(namespace, name, "eviction"), body)
                return Status.success()
            except ApiError as exc:
                if exc.status == 404:
                    return Status.success()  # already gone
                if exc.status == 429:
                    blocked = exc.message
                    continue
                if exc.status == 500:
                    return Status.error(f"eviction of {pod} refused: more than one PodDisruptionBudget may match "
                                        f"it ({exc})")
                return Status.error(f"eviction of {pod} failed: {exc}")
        return Status(Code.PENDING, (f"blocked: disruption budget forbids evicting {pod} now "
                                     f"({self.eviction_attempts} attempts): {blocked}",))

    def _wait(self, delay_s: float) -> None:
        if self._sleep is not None:
            self._sleep(delay_s)
        else:
            self._stopping.wait(delay_s)

    def delete_pod(self, pod: str) -> Status:
        """Delete now, without a grace period (`gracePeriodSeconds: 0`, as `kubectl delete --force
        --grace-period=0`): the pod is gone from the API, and from this view, when this returns (unless a
        finalizer holds it: then it is terminating). `evict` is the graceful way."""
        namespace, name = split_key(pod)
        try:
            answer = self.api.delete(pod_path(namespace, name), {"gracePeriodSeconds": 0})
            if (answer.get("metadata") or {}).get("finalizers"):
                self._absorb(self.pods, answer)
            else:
                self.pods.forget(answer)
                self.pump()
        except ApiError as exc:
            if exc.status == 404:
                return Status.error(f"pod {pod} not found")
            return Status.error(f"delete of {pod} failed: {exc}")
        return Status.success()

    def fail_pod(self, pod: str, reason: str) -> Status:
        namespace, name = split_key(pod)
        info = self.get_pod(f"{namespace}/{name}")
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is not PodPhase.PENDING:
            return Status.error(f"conflict: pod {pod} is {info.phase.value}, not Pending")
        patch = {"status": {"phase": "Failed", "reason": FAILED_REASON, "message": reason}}
        try:
            self._absorb(self.pods, self.api.patch(pod_path(namespace, name, "status"), patch))
        except ApiError as exc:
            if exc.status == 404:
                return Status.error(f"pod {pod} not found")
            return Status.error(f"failing {pod} failed: {exc}")
        return Status.success()

    def scale(self, workload: str, replicas: int) -> Status:
        if replicas < 0:
            return Status.error(f"replicas must not be negative, got {replicas}")
        parts = workload.split("/")
        if len(parts) == 2:
            namespace, kind, name = parts[0], "Deployment", parts[1]
        elif len(parts) == 3:
            namespace, kind, name = parts
        else:
            return Status.error(f"workload {workload!r} is not namespace/Kind/name or namespace/name")
        if kind not in SCALABLE:
            return Status.error(f"workload {workload}: cannot scale a {kind} (only {', '.join(sorted(SCALABLE))})")
        path = f"/apis/apps/v1/namespaces/{namespace}/{SCALABLE[kind]}/{name}"
        try:
            if kind == "ReplicaSet":
                owner = next((ref for ref in self.api.get(path).get("metadata", {}).get("ownerReferences") or []
                              if ref.get("controller") and ref.get("kind") == "Deployment"), None)
                if owner is not None:
                    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{owner['name']}"
            self.api.patch(f"{path}/scale", {"spec": {"replicas": replicas}})
        except ApiError as exc:
            if exc.status == 404:
                return Status.error(f"workload {workload} not found")
            return Status.error(f"scaling {workload} failed: {exc}")
        return Status.success()

    def patch_pod(self, pod: str, *, annotations: Mapping[str, str | None]) -> Status:
        namespace, name = split_key(pod)
        try:
            self._absorb(self.pods, self.api.patch(pod_path(namespace, name),
                                                   {"metadata": {"annotations": dict(annotations)}}))
        except ApiError as exc:
            if exc.status == 404:
                return Status.error(f"pod {pod} not found")
            if exc.status == 422:
                return Status.error(f"invalid: {exc.message}")
            return Status.error(f"patching {pod} failed: {exc}")
        return Status.success()

    def record_event(self, kind: Literal["Pod", "Node"], name: str, *, type_: EventType, reason: str,
                     message: str) -> Status:
        if kind == "Pod":
            namespace, short = split_key(name)
            raw = self.pods.get(f"{namespace}/{short}")
            involved: JsonObject = {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": short}
        else:
            raw = self.nodes.get(name)
            involved = {"kind": "Node", "apiVersion": "v1", "name": name}
        meta = (raw or {}).get("metadata") or {}
        involved |= {k: meta[k] for k in ("uid", "resourceVersion") if meta.get(k)}
        now = self.clock.now()
        with self._event_lock:  # two Events of one nanosecond get two names
            self._event_nanos = max(int(now * 1e9), self._event_nanos + 1)
            nanos = self._event_nanos
        body = core_event(involved, reason=reason, message=message, warning=type_ is EventType.WARNING,
                          component=self.event_component, instance=self.event_instance, host=self.event_instance,
                          t=now, nanos=nanos)
        try:
            self.api.create(events_path(body["metadata"]["namespace"]), body)
        except ApiError as exc:
            return Status.error(f"recording the {reason} event of {kind} {name} failed: {exc}")
        return Status.success()

    def patch_node(self, node: str, *, labels: Mapping[str, str | None] | None = None,
                   taints: Sequence[Taint] | None = None, annotations: Mapping[str, str | None] | None = None,
                   unschedulable: bool | None = None, pool: str | None = None) -> Status:
        metadata: dict[str, Any] = {}
        spec: dict[str, Any] = {}
        all_labels = dict(labels or {})
        if pool is not None:
            all_labels[POOL_LABEL] = pool
        if all_labels:
            metadata["labels"] = all_labels
        if annotations:
            metadata["annotations"] = dict(annotations)
        if taints is not None:
            spec["taints"] = taints_json(taints)  # a merge patch replaces the whole list
        if unschedulable is not None:
            spec["unschedulable"] = unschedulable
        patch = {k: v for k, v in (("metadata", metadata), ("spec", spec)) if v}
        if not patch:
            return Status.success()
        try:
            self._absorb(self.nodes, self.api.patch(node_path(node), patch))
        except ApiError as exc:
            if exc.status == 404:
                return Status.error(f"node {node} not found")
            if exc.status == 422:
                return Status.error(f"invalid: {exc.message}")
            return Status.error(f"patching node {node} failed: {exc}")
        return Status.success()


def _asks_the_same(before: JsonObject, after: JsonObject) -> bool:
    """Whether `after` asks for what `before` did (`objects.pod_request` reads the spec, labels, owner references
    and annotations): only the scheduler's annotations, `spec.nodeName`, status or bookkeeping differ."""
    old_meta, new_meta = before.get("metadata") or {}, after.get("metadata") or {}
    if old_meta.get("labels") != new_meta.get("labels") or \
            old_meta.get("ownerReferences") != new_meta.get("ownerReferences"):
        return False
    old_notes, new_notes = old_meta.get("annotations") or {}, new_meta.get("annotations") or {}
    if {k: v for k, v in old_notes.items() if k not in SCHEDULER_ANNOTATIONS} != \
            {k: v for k, v in new_notes.items() if k not in SCHEDULER_ANNOTATIONS}:
        return False
    old_spec, new_spec = before.get("spec") or {}, after.get("spec") or {}
    return {k: v for k, v in old_spec.items() if k != "nodeName"} == \
        {k: v for k, v in new_spec.items() if k != "nodeName"}


def pod_manifest(request: PodRequest, *, scheduler_name: str = SCHEDULER_NAME) -> JsonObject:
    """A minimal pod (one pause container) that `objects.pod_request` reads back as `request`, for the scheduler
    `scheduler_name`.

    Raises ValueError for what a pod cannot say: a fraction of compute that is not whole percent, or more than
    one pool. A vGPU package is written as its compute and memory (the package name is not kept).
    """
    namespace, name = split_key(request.name)
    limits: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if request.cpu_milli:
        limits["cpu"] = f"{request.cpu_milli}m"
    if request.memory_mib:
        limits["memory"] = f"{request.memory_mib}Mi"
    gpu = request.gpu
    if isinstance(gpu, WholeCards):
        limits[RES_GPU] = str(gpu.count)
    elif isinstance(gpu, Fraction):
        if gpu.compute_milli % 10:
            raise ValueError(f"{RES_CORES} is in whole percent; {gpu.compute_milli} milli-cards is not")
        limits[RES_GPU] = str(gpu.count)
        for resource, value in ((RES_CORES, gpu.compute_milli // 10), (RES_MEM, gpu.memory_mib),
                                (RES_MEM_PCT, gpu.memory_pct), (RES_ENCODERS, gpu.encoders),
                                (RES_DECODERS, gpu.decoders)):
            if value:
                limits[resource] = str(value)
    elif isinstance(gpu, MigSlice):
        limits[RES_GPU] = "1"
        annotations[MIG_PROFILE] = str(gpu.profile)
    if request.rdma_vfs:
        limits[RES_RDMA] = str(request.rdma_vfs)
    labels = dict(request.labels)
    labels[QOS_LABEL] = request.qos.value
    if request.queue is not None:
        labels[QUEUE_LABEL] = request.queue
    if request.workload is not None:
        labels[WORKLOAD_LABEL] = request.workload
    if request.instance is not None:
        labels[INSTANCE_LABEL] = str(request.instance)
    if request.gang is not None:
        labels[GANG_LABEL] = request.gang
        annotations[GANG_SIZE] = str(request.gang_size)
    if request.models is not None:
        annotations[GPU_MODELS] = ",".join(sorted(request.models))
    if request.checkpoint_every_s:
        annotations[CHECKPOINT_EVERY] = repr(request.checkpoint_every_s)
    spec: dict[str, Any] = {
        "schedulerName": scheduler_name,
        "containers": [{"name": "main", "image": PAUSE_IMAGE, "resources": {"limits": limits, "requests": limits}}],
    }
    if request.priority_class is not None:
        spec["priorityClassName"] = request.priority_class
    if request.priority:
        spec["priority"] = request.priority  # admission refuses it unless it equals the class's value
    if request.preempt is not None:
        spec["preemptionPolicy"] = "PreemptLowerPriority" if request.preempt else "Never"
    if request.unsupported:
        raise ValueError(f"a pod using {', '.join(request.unsupported)} cannot be written from its request")
    selector = dict(request.node_selector)
    if request.pools is not None:
        if len(request.pools) != 1:
            raise ValueError(f"a pod's node selector names one pool, not {sorted(request.pools)}")
        selector[POOL_LABEL] = next(iter(request.pools))
    if selector:
        spec["nodeSelector"] = selector
    node_affinity = node_affinity_json(request.required_terms, request.preferred_terms)
    if node_affinity:
        spec["affinity"] = {"nodeAffinity": node_affinity}
    if request.tolerations:
        spec["tolerations"] = tolerations_json(request.tolerations)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
            "spec": spec}
