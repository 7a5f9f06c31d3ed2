"""gpuplane's own scheduler in Kubernetes (`gpuplane scheduler`): the simulator's `Scheduler` over `KubeCluster`.

Pods choose it with `spec.schedulerName` (default `gpuplane`). Only pending pods of that name are queued and
decided; bound pods hold their capacity whoever bound them. The `Scheduler` is built exactly as the fill and
timed replays build it (`gpuplane.sim.replay`): the same profile, seed, pools and rules give the same decisions.

One thread decides (`SchedulerMode.tick`): pump the informers' events into the scheduler, `run_pending()`, hand
the outcomes' writes to the bind lanes, and wait for the next change or tick (the quota, gang and parked-pod
timers run on the injected clock inside `run_pending`). What it writes, as kube-scheduler does:

- a bound pod: the card assignment (merge PATCH, guarded by the pod's resourceVersion), then the Binding (the
  API server sets `spec.nodeName` and PodScheduled=True), then a `Scheduled` event (events.k8s.io/v1, action
  `Binding`, "Successfully assigned ns/pod to node"): 3 writes, and no reads beyond the watch streams;
- a pod that does not fit: PodScheduled=False (reason `Unschedulable`, message kube-scheduler's `FitError`
  text, `fit_error_message`) through the pod's status subresource, and a `FailedScheduling` Warning event.
  Written once per distinct message: a pod that stays unschedulable for the same reason is not written again
  (kube-scheduler's event recorder folds repeats into a series instead; we write nothing);
- a preemptor: its victims go through the Eviction API (`KubeCluster.evict`, one attempt: a disruption budget's
  429 refuses the plan and the pod waits, parked, to retry); `status.nominatedNodeName` is written with its
  Unschedulable condition while its victims terminate, and cleared when it binds (one more status PATCH) or
  when a later attempt finds it no longer nominated;
- a bind that fails: PodScheduled=False with reason `SchedulerError` and a `FailedScheduling` event.

Binds are asynchronous, like kube-scheduler's binding cycle: the decision loop assumes the placement in the
cache and tells the scheduler the bind is done (as the simulated cluster does), and a lane thread makes the API
calls. A pod's writes all go to one lane, in order. The decision sequence does not depend on bind timing; only
a bind the API server refuses is seen late: the pod's reservation is released then and the pod queued again.
`bind_workers=0` binds inline on the decision thread (the parity experiment's `--sync-binds`).

Pods whose `scheduling.x-k8s.io/pod-group` names a PodGroup not known yet wait outside the queue (as
coscheduling's PreEnqueue keeps them out) and enter when it appears; gang sizes and queue quotas come from the
`Declarations` (`gpuplane.kube.declarations`), or, until that module exists, from the pods' own annotations.

Leader election on a Lease (`LeaseElector`): a follower runs no informer and writes nothing; a leader that loses
the lease drops its queued writes and stops deciding; a new leader rebuilds everything from the API.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import logging
import queue
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gpuplane.controllers.observer import ClusterObserver, scheduler_counters
from gpuplane.kube.api import ApiError, JsonObject, KubeApi, pod_path
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.lease import LeaseElector
from gpuplane.kube.objects import GANG_SIZE, format_time, split_key
from gpuplane.kube.observed import OwnPods, PortView
from gpuplane.model import Assignment, Catalog, PodRequest, PoolConfig, default_catalog
from gpuplane.model.quota import Quotas
from gpuplane.port import (
    Clock,
    ClusterEvent,
    EventKind,
    Handler,
    NodeInfo,
    PodInfo,
    PodPhase,
    Status,
    Unsubscribe,
    WallClock,
)
from gpuplane.port.metrics import PlaneMetrics
from gpuplane.port.status import Code
from gpuplane.scheduler import Decision, Outcome, Profile, Scheduler, SchedulingRules
from gpuplane.scheduler.framework import Diagnosis
from gpuplane.scheduler.preemption import Preemption, PreemptionResult, VictimRules

log = logging.getLogger(__name__)

DEFAULT_SCHEDULER_NAME = "gpuplane"
DEFAULT_LEASE_NAME = "gpuplane-scheduler"
DEFAULT_LEASE_NAMESPACE = "gpuplane-system"
EVENTS_GROUP_VERSION = "events.k8s.io/v1"
NO_VICTIMS = "No preemption victims found for incoming pod"
NOT_HELPFUL = "Preemption is not helpful for scheduling"
NOT_ELIGIBLE = "not eligible due to preemptionPolicy=Never."
MAX_NOTE = 1024
"""events.k8s.io/v1 `note` is at most 1 kB (client-go's recorder truncates it)."""


# ------------------------------------------------------------------ kube-scheduler's messages
def fit_error_message(total: int, counts: Mapping[str, int], *, prefilter: str = "", postfilter: str = "") -> str:
    """kube-scheduler's `FitError.Error()` (pkg/scheduler/framework/types.go): "0/N nodes are available:", then
    the PreFilter message, or else the per-node reasons as "count reason" strings sorted as strings (Go's
    `sort.Strings`: "10 x" sorts before "2 y"), then the PostFilter (preemption) message.

    >>> fit_error_message(3, {"Insufficient cpu": 2, "node(s) had untolerated taint(s)": 1},
    ...                   postfilter="preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling.")
    '0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 Insufficient cpu. preemption: 0/3 nodes are \
available: 3 Preemption is not helpful for scheduling.'
    """
    message = f"0/{total} nodes are available:"
    if prefilter:
        message += f" {prefilter}."
    else:
        ranked = sorted(f"{count} {reason}" for reason, count in counts.items() if count)
        if ranked:
            message += f" {', '.join(ranked)}."
    if postfilter:
        message += f" {postfilter}"
    return message


def preemption_message(diagnosis: Diagnosis) -> str:
    """DefaultPreemption's PostFilter message when no candidate was found: every node rejected for a reason
    preemption cannot fix is "not helpful", every other one had no victims to offer."""
    total = len(diagnosis.reason_of)
    unresolvable = sum(count for reason, count in diagnosis.counts().items()
                       if diagnosis.reasons.index(reason) in diagnosis.unresolvable)
    counts = {NOT_HELPFUL: unresolvable, NO_VICTIMS: total - unresolvable}
    return "preemption: " + fit_error_message(total, counts)


class _RecordingPreemption(Preemption):
    """The scheduler's preemption, noting for each preemptor the diagnosis it was planned from (so a nominated
    pod's condition carries the failed cycle's reasons, as kube-scheduler's does). Decides nothing differently."""

    def __init__(self, base: Preemption) -> None:
        super().__init__(base.framework, max_candidates=base.max_candidates, order=base.order)
        self.diagnoses: dict[str, Diagnosis] = {}

    def plan(self, pod: PodRequest, state: Any, rules: VictimRules, diagnosis: Diagnosis | None = None, *,
             within: Any = None) -> PreemptionResult:
        if diagnosis is not None:
            self.diagnoses[pod.name] = diagnosis
        return super().plan(pod, state, rules, diagnosis, within=within)


# ------------------------------------------------------------------ declarations (gangs, quotas)
class DeclarationSource(Protocol):
    """What `gpuplane.kube.declarations.Declarations(api, catalog)` offers: PodGroups and queue quotas."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def quotas(self) -> Quotas: ...

    def gang_size(self, namespace: str, group: str) -> int | None:
        """The PodGroup's `minMember`; None while the PodGroup is not known."""
        ...

    def on_change(self, callback: Callable[[], None]) -> None: ...


class NoDeclarations:
    """No PodGroups or queues read from the API: gangs are sized by the pods' `gpuplane.io/gang-size`
    annotation and the rules' own quotas apply."""

    def start(self) -> None:
        return

    def stop(self) -> None:
        return

    def quotas(self) -> Quotas:
        return Quotas()

    def gang_size(self, namespace: str, group: str) -> int | None:
        return None

    def on_change(self, callback: Callable[[], None]) -> None:
        return


DeclarationsFactory = Callable[[KubeApi, Catalog], DeclarationSource]


def default_declarations(api: KubeApi, catalog: Catalog) -> DeclarationSource:
    """`gpuplane.kube.declarations.Declarations` where that module exists, else `NoDeclarations`."""
    try:
        module = importlib.import_module("gpuplane.kube.declarations")
    except ImportError:
        return NoDeclarations()
    source: DeclarationSource = module.Declarations(api, catalog)
    return source


def _gang_timeouts(declarations: DeclarationSource) -> dict[str, float]:
    """Each PodGroup's own `scheduleTimeoutSeconds`, keyed `namespace/group` as the core names the gang (where the
    declarations say; the rules' one timeout otherwise)."""
    timeouts = getattr(declarations, "gang_timeouts", None)
    return dict(timeouts()) if timeouts is not None else {}


# ------------------------------------------------------------------ lanes
class Lanes:
    """Worker threads, each running its jobs in order. A pod's writes all go to one lane (by its name), so they
    land in the order they were decided: an Unschedulable condition never overtakes the pod's later bind."""

    def __init__(self, count: int, name: str = "scheduler lane") -> None:
        self._queues: list[queue.SimpleQueue[Callable[[], None] | None]] = [queue.SimpleQueue()
                                                                           for _ in range(count)]
        self._dropping = False
        self._outstanding = 0
        self._idle = threading.Condition()
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name} {i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    def submit(self, key: str, job: Callable[[], None]) -> None:
        with self._idle:
            self._outstanding += 1
        self._queues[zlib.crc32(key.encode()) % len(self._queues)].put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every submitted job has run; whether they all did within the timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout_s)

    def close(self, *, drop: bool, timeout_s: float = 10.0) -> None:
        """Stop the lanes after the jobs already queued (`drop`: skip those not started)."""
        self._dropping = drop
        for lane in self._queues:
            lane.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    def _run(self, lane: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while True:
            job = lane.get()
            if job is None:
                return
            try:
                if not self._dropping:
                    job()
            except Exception:  # one failed write must not stop the lane
                log.exception("a scheduler write failed")
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()


# ------------------------------------------------------------------ writes
class Recorder:
    """The status and event writes, kube-scheduler's way. Runs on whichever thread `submit` picks."""

    def __init__(self, cluster: KubeCluster, scheduler_name: str, identity: str, clock: Clock) -> None:
        self.cluster = cluster
        self.api = cluster.api
        self.controller = scheduler_name
        self.instance = f"{scheduler_name}-{identity}"
        self.clock = clock
        self._stamp_lock = threading.Lock()
        self._last_nanos = 0

    def _nanos(self) -> int:
        with self._stamp_lock:
            self._last_nanos = max(int(self.clock.now() * 1e9), self._last_nanos + 1)
            return self._last_nanos

    def event(self, pod: str, *, type_: str, reason: str, action: str, note: str) -> None:
        """Post an events.k8s.io/v1 Event regarding `pod` (as client-go's events recorder builds it)."""
        namespace, name = split_key(pod)
        cached = self.cluster.pods.get(f"{namespace}/{name}") or {}
        meta = cached.get("metadata") or {}
        nanos = self._nanos()
        body: JsonObject = {
            "apiVersion": EVENTS_GROUP_VERSION, "kind": "Event",
            "metadata": {"name": f"{name}.{nanos:x}", "namespace": namespace},
            "eventTime": format_time(nanos / 1e9, micro=True),
            "reportingController": self.controller, "reportingInstance": self.instance,
            "action": action, "reason": reason, "type": type_, "note": note[:MAX_NOTE],
            "regarding": {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": name,
                          "uid": meta.get("uid", ""), "resourceVersion": meta.get("resourceVersion", "")},
        }
        try:
            self.api.create(f"/apis/{EVENTS_GROUP_VERSION}/namespaces/{namespace}/events", body)
        except ApiError as exc:
            log.warning("could not post the %s event of %s: %s", reason, pod, exc)

    def condition(self, pod: str, *, reason: str, message: str, nominated: str | None, clear_nominated: bool) -> None:
        """PodScheduled=False with `reason` and `message` through the status subresource, and the nominated node
        (`nominated`; None with `clear_nominated`: remove it). Skipped for a pod already bound or gone."""
        namespace, name = split_key(pod)
        cached = self.cluster.pods.get(f"{namespace}/{name}")
        if cached is None or (cached.get("spec") or {}).get("nodeName"):
            return
        status = cached.get("status") or {}
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
        previous: Mapping[str, Any] = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {})
        stamp = format_time(self.clock.now())
        conditions.append({"type": "PodScheduled", "status": "False", "reason": reason, "message": message,
                           "lastProbeTime": None,
                           "lastTransitionTime": previous.get("lastTransitionTime", stamp)
                           if previous.get("status") == "False" else stamp})
        patch: JsonObject = {"status": {"conditions": conditions}}
        if nominated is not None:
            patch["status"]["nominatedNodeName"] = nominated
        elif clear_nominated:
            patch["status"]["nominatedNodeName"] = None
        try:
            self.cluster.pods.offer(self.api.patch(pod_path(namespace, name, "status"), patch,
                                                   patch_type="strategic"))
        except ApiError as exc:
            if exc.status != 404:
                log.warning("could not write the PodScheduled condition of %s: %s", pod, exc)

    def clear_nominated(self, pod: str) -> None:
        namespace, name = split_key(pod)
        try:
            self.api.patch(pod_path(namespace, name, "status"), {"status": {"nominatedNodeName": None}},
                           patch_type="strategic")
        except ApiError as exc:
            if exc.status != 404:
                log.warning("could not clear the nominated node of %s: %s", pod, exc)


# ------------------------------------------------------------------ the port
class SchedulerPort(PortView):
    """`KubeCluster` as gpuplane's own scheduler sees it (a `ClusterPort`; the calls not below go to the cluster).

    - Pending pods of other schedulers are not there (neither listed nor announced); bound pods all are.
    - A pending pod of ours whose PodGroup is not known yet waits outside (`waiting_for_group`); gang names are
      namespaced (`ns/group`) and sized by the declarations.
    - `bind` is asynchronous when `lanes` are given: the pod is reported bound at once (the scheduler confirms
      its reservation, as in the simulated cluster) and listed as bound until the watch shows the Binding; a
      bind the API refuses comes back through `drain()`, which releases the pod and queues it again.
    """

    def __init__(self, cluster: KubeCluster, scheduler_name: str, declarations: DeclarationSource, *,
                 lanes: Lanes | None, recorder: Recorder, on_bind_failed: Callable[[str, Status, str | None], None],
                 on_gone: Callable[[str], None]) -> None:
        super().__init__(cluster)
        self.cluster = cluster
        self.scheduler_name = scheduler_name
        self.declarations = declarations
        self.lanes = lanes
        self.recorder = recorder
        self._on_bind_failed = on_bind_failed
        self._on_gone = on_gone
        self._handlers: list[Handler] = []
        self._ours: dict[str, bool] = {}
        self._inflight: dict[str, Assignment] = {}
        """Binds sent (or queued on a lane) whose Binding the watch has not shown yet."""
        self._confirmed: dict[str, Assignment] = {}
        """Our binds the scheduler was told about when sent: their watch event is not delivered again."""
        self.nominated: dict[str, str] = {}
        """Pods whose `status.nominatedNodeName` we wrote → that node."""
        self.waiting_for_group: dict[str, PodInfo] = {}
        self._results: queue.SimpleQueue[tuple[str, Assignment, Status]] = queue.SimpleQueue()
        self._unsubscribe = cluster.watch(self._on_cluster_event)

    def close(self) -> None:
        self._unsubscribe()

    # -------------------------------------------------------------- whose pods
    def is_ours(self, pod: str) -> bool:
        known = self._ours.get(pod)
        if known is None:
            raw = self.cluster.pods.get(pod)
            if raw is None:
                return False
            known = ((raw.get("spec") or {}).get("schedulerName") or "default-scheduler") == self.scheduler_name
            self._ours[pod] = known
        return known

    def _view(self, info: PodInfo, *, admit: bool) -> PodInfo | None:
        """`info` as the declarations say: counted against its pool's queue (a GpuPool quota), its gang namespaced
        and sized by its PodGroup; None (with `admit`) while that PodGroup is not known and the pod does not size
        its gang itself (annotation `gpuplane.io/gang-size`)."""
        request = info.request
        pool_queue = getattr(self.declarations, "with_pool_queue", None)
        enriched = pool_queue(request) if pool_queue is not None else request
        if request.gang is not None:
            namespace, _ = split_key(info.name)
            size = self.declarations.gang_size(namespace, request.gang)
            if size is None:
                if admit and not isinstance(self.declarations, NoDeclarations) and not self._sizes_itself(info):
                    return None
                size = request.gang_size
            gang = request.gang if "/" in request.gang else f"{namespace}/{request.gang}"
            enriched = dataclasses.replace(enriched, gang=gang, gang_size=size)
        return info if enriched is request else dataclasses.replace(info, request=enriched)

    def _sizes_itself(self, info: PodInfo) -> bool:
        return any(key == GANG_SIZE for key, _ in info.annotations)

    def _deliver(self, event: ClusterEvent) -> None:
        for handler in list(self._handlers):
            handler(event)

    def _on_cluster_event(self, event: ClusterEvent) -> None:
        pod = event.pod
        if pod is None:
            self._deliver(event)
            return
        name = pod.name
        kind = event.kind
        if kind is EventKind.POD_ADDED and pod.phase is PodPhase.PENDING:
            if not self.is_ours(name):
                return
            view = self._view(pod, admit=True)
            if view is None:
                self.waiting_for_group[name] = pod
                return
            self._deliver(dataclasses.replace(event, pod=view))
            return
        if kind is EventKind.POD_BOUND:
            self.waiting_for_group.pop(name, None)
            self._inflight.pop(name, None)
            if self._confirmed.pop(name, None) == pod.assignment:
                return  # our own bind: the scheduler was told when it was sent
        elif kind in (EventKind.POD_DELETED, EventKind.POD_FAILED):
            self.waiting_for_group.pop(name, None)
            self._inflight.pop(name, None)
            self._confirmed.pop(name, None)
            self._ours.pop(name, None)
            self.nominated.pop(name, None)
            self._on_gone(name)
        view = self._view(pod, admit=False)
        assert view is not None
        self._deliver(dataclasses.replace(event, pod=view))

    def admit_waiting(self) -> int:
        """Queue the pods whose PodGroup has appeared since; returns how many."""
        admitted = 0
        for name, info in list(self.waiting_for_group.items()):
            view = self._view(info, admit=True)
            if view is not None:
                del self.waiting_for_group[name]
                self._deliver(ClusterEvent(EventKind.POD_ADDED, self.cluster.clock.now(), pod=view))
                admitted += 1
        return admitted

    # -------------------------------------------------------------- reads
    def list_nodes(self) -> Sequence[NodeInfo]:
        return self.cluster.list_nodes()

    def list_pods(self) -> Sequence[PodInfo]:
        out: list[PodInfo] = []
        now = self.cluster.clock.now()
        for info in self.cluster.list_pods():
            name = info.name
            if info.phase is PodPhase.PENDING:
                sent = self._inflight.get(name)
                if sent is not None:  # bound as far as the scheduler knows
                    view = self._view(info, admit=False)
                    assert view is not None
                    out.append(dataclasses.replace(view, phase=PodPhase.RUNNING, assignment=sent, bound_at=now))
                    continue
                if not self.is_ours(name):
                    continue
                view = self._view(info, admit=True)
                if view is None:
                    self.waiting_for_group[name] = info
                    continue
                out.append(view)
            else:
                view = self._view(info, admit=False)
                assert view is not None
                out.append(view)
        return out

    def watch(self, handler: Handler) -> Unsubscribe:
        self._handlers.append(handler)

        def unsubscribe() -> None:
            if handler in self._handlers:
                self._handlers.remove(handler)

        return unsubscribe

    # -------------------------------------------------------------- binds
    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        info = self.cluster.get_pod(pod)
        if info is None:
            return Status.error(f"pod {pod} not found")
        if info.phase is not PodPhase.PENDING:
            return Status.error(f"conflict: pod {pod} is {info.phase.value}, not Pending")
        clear = self.nominated.pop(pod, None) is not None
        if self.lanes is None:
            status = self._send(pod, assignment, clear)
            if not status.ok:
                return status
        else:
            self.lanes.submit(pod, functools.partial(self._bind_job, pod, assignment, clear))
        self._inflight[pod] = assignment  # listed as bound (a rebuilt cache keeps it) until the watch shows it
        self._confirmed[pod] = assignment
        view = self._view(info, admit=False)
        assert view is not None
        now = self.cluster.clock.now()
        self._deliver(ClusterEvent(EventKind.POD_BOUND, now, pod=dataclasses.replace(
            view, phase=PodPhase.RUNNING, assignment=assignment, bound_at=now)))
        return Status.success()

    def _send(self, pod: str, assignment: Assignment, clear_nominated: bool) -> Status:
        status = self.cluster.send_bind(pod, assignment)
        if status.ok:
            namespace, name = split_key(pod)
            self.recorder.event(pod, type_="Normal", reason="Scheduled", action="Binding",
                                note=f"Successfully assigned {namespace}/{name} to {assignment.node}")
            if clear_nominated:
                self.recorder.clear_nominated(pod)
        return status

    def _bind_job(self, pod: str, assignment: Assignment, clear_nominated: bool) -> None:
        self._results.put((pod, assignment, self._send(pod, assignment, clear_nominated)))

    def drain(self) -> int:
        """Take in the lanes' bind results: a refused bind releases its pod and queues it again (if it is still
        pending). Returns the refusals handled."""
        refused = 0
        while True:
            try:
                pod, assignment, status = self._results.get_nowait()
            except queue.Empty:
                return refused
            if status.ok or self._inflight.get(pod) != assignment:
                continue  # done, or the world moved on (the pod went, or someone else bound it)
            refused += 1
            del self._inflight[pod]
            self._confirmed.pop(pod, None)
            log.warning("bind of %s to %s failed: %s", pod, assignment.node, status.message)
            info = self.cluster.get_pod(pod)
            now = self.cluster.clock.now()
            if info is not None:
                view = self._view(info, admit=False)
                assert view is not None
                self._deliver(ClusterEvent(EventKind.POD_DELETED, now, pod=dataclasses.replace(
                    view, phase=PodPhase.RUNNING, assignment=assignment)))  # releases the reservation
                if info.phase is PodPhase.PENDING:
                    admitted = self._view(info, admit=True)
                    if admitted is None:
                        self.waiting_for_group[pod] = info
                    else:
                        self._deliver(ClusterEvent(EventKind.POD_ADDED, now, pod=admitted))
                self._on_bind_failed(pod, status, view.request.gang)


# ------------------------------------------------------------------ the scheduler
ClusterFactory = Callable[[], KubeCluster]


@dataclasses.dataclass(slots=True)
class _Term:
    """What a leader holds while it leads: all rebuilt from the API when leadership begins."""

    cluster: KubeCluster
    declarations: DeclarationSource
    lanes: Lanes | None
    port: SchedulerPort
    scheduler: Scheduler
    preemption: _RecordingPreemption
    observer: ClusterObserver | None


class SchedulerMode:
    """gpuplane's scheduler over the API at `api`, leading while `elector` does (None: always).

    `profile`, `seed`, `pools` and `rules` build the `Scheduler` as the replays do. `bind_workers`: lanes that
    make the API calls of binds, conditions and events (0: all inline on the deciding thread). `clock`: the
    scheduler's time (timers, event stamps). `cluster_factory` builds the started `KubeCluster` (default: manual
    dispatch, one eviction attempt, pods created for `scheduler_name`).

    `metrics`: where the scheduler's metrics go (`docs/monitoring.md`): the leader gauge
    (`gpuplane_leader{component="scheduler"}`) at every tick; while leading, the cluster's observer (over
    the scheduler's own pods, `OwnPods`; `clock` is its clock, epoch seconds as the API's timestamps), the
    scheduler's preemption and gang counts, and every decision, timed per pass. None: no metrics.

    `freeze_gc`: once a term's first lists are read and its scheduler built, collect once and move every object
    then alive out of the cycle collector's reach (`gc.freeze`), until the term ends (`gc.unfreeze`). The caches
    of a large cluster (a thousand DRA nodes' ResourceSlices are millions of objects) live as long as the term;
    left in, every full collection walks them all, a pause of seconds on the deciding thread at a thousand DRA
    nodes. Leave it off where the process is shared (tests run several schedulers in one process).
    """

    def __init__(self, api: KubeApi, profile: Profile, *, catalog: Catalog | None = None, seed: int = 0,
                 pools: Mapping[str, PoolConfig] | None = None, rules: SchedulingRules | None = None,
                 scheduler_name: str = DEFAULT_SCHEDULER_NAME, elector: LeaseElector | None = None,
                 clock: Clock | None = None, bind_workers: int = 4, identity: str = "gpuplane",
                 declarations: DeclarationsFactory = default_declarations,
                 cluster_factory: ClusterFactory | None = None, metrics: PlaneMetrics | None = None,
                 freeze_gc: bool = False) -> None:
        self.api = api
        self.freeze_gc = freeze_gc
        self.metrics = metrics
        self.profile = profile
        self.catalog = catalog if catalog is not None else default_catalog()
        self.seed = seed
        self.pools = dict(pools) if pools is not None else None
        self.rules = rules or SchedulingRules()
        self.scheduler_name = scheduler_name
        self.elector = elector
        self.clock: Clock = clock if clock is not None else WallClock()
        self.bind_workers = max(0, bind_workers)
        self.identity = identity
        self._declarations_factory = declarations
        self._cluster_factory = cluster_factory or (lambda: KubeCluster(
            api, self.catalog, clock=self.clock, dispatch="manual", eviction_attempts=1,
            scheduler_name=scheduler_name))
        self._term: _Term | None = None
        self._declarations_changed = threading.Event()
        self._written: dict[str, tuple[str, str, str | None]] = {}
        """Per pod, the (reason, message, nominated node) last written: the same is not written again."""
        self.outcomes = 0
        """Scheduling attempts decided while leading (all terms)."""

    # -------------------------------------------------------------- state
    @property
    def leading(self) -> bool:
        return self._term is not None

    @property
    def scheduler(self) -> Scheduler | None:
        return self._term.scheduler if self._term is not None else None

    @property
    def cluster(self) -> KubeCluster | None:
        return self._term.cluster if self._term is not None else None

    @property
    def port(self) -> SchedulerPort | None:
        return self._term.port if self._term is not None else None

    # -------------------------------------------------------------- the loop
    def tick(self) -> int:
        """One pass: the election, then (while leading) the events, the decisions and their writes. Returns the
        scheduling attempts decided in it."""
        leading = self.elector is None or self.elector.tick()
        if self.metrics is not None:
            self.metrics.set_leader("scheduler", leading)
        if not leading:
            if self.leading:
                self._stand_down()
            return 0
        if self._term is None and not self._take_over():
            return 0
        term = self._term
        assert term is not None
        term.cluster.pump()
        term.port.drain()
        if self._declarations_changed.is_set():
            self._declarations_changed.clear()
            self._apply_declarations(term)
        if term.observer is not None:
            outcomes = term.observer.run_pending(term.scheduler, self._on_outcome)
        else:
            outcomes = term.scheduler.run_pending(self._on_outcome)
        self._report_unreadable(term)
        self.outcomes += len(outcomes)
        return len(outcomes)

    def run(self, stop: threading.Event, *, idle_wait_s: float = 0.2) -> None:
        """Tick until `stop` is set, waiting for informer changes (at most `idle_wait_s`) between ticks."""
        try:
            while not stop.is_set():
                self.tick()
                term = self._term
                if term is not None:
                    term.cluster.wait_for_changes(idle_wait_s)
                else:
                    retry = self.elector.config.retry_period_s if self.elector is not None else 1.0
                    stop.wait(min(retry / 2, 1.0))
        finally:
            self.shutdown()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the lanes have made every write handed to them so far (tests, the parity driver)."""
        term = self._term
        return term is None or term.lanes is None or term.lanes.wait_idle(timeout_s)

    def shutdown(self) -> None:
        """Stop deciding, finish the writes already decided, release the lease."""
        term = self._term
        if term is not None and term.lanes is not None:
            term.lanes.wait_idle(10.0)
        if self.elector is not None:
            self.elector.release()
        self._stand_down()
        if self.metrics is not None:
            self.metrics.set_leader("scheduler", False)

    # -------------------------------------------------------------- leadership
    def _take_over(self) -> bool:
        """Build the cluster cache, the declarations and the scheduler from the API; False (retried next tick)
        when the API does not answer."""
        log.info("%s: leading, building the scheduler from the API", self.identity)
        try:
            cluster = self._cluster_factory()
        except (TimeoutError, ApiError) as exc:
            log.warning("leading, but the cluster cannot be read yet: %s", exc)
            return False
        declarations = self._declarations_factory(self.api, self.catalog)
        declarations.on_change(self._declarations_changed.set)
        declarations.start()
        self._declarations_changed.clear()
        lanes = Lanes(self.bind_workers) if self.bind_workers else None
        recorder = Recorder(cluster, self.scheduler_name, self.identity, self.clock)
        port = SchedulerPort(cluster, self.scheduler_name, declarations, lanes=lanes, recorder=recorder,
                             on_bind_failed=self._on_bind_failed,
                             on_gone=lambda pod: self._forget(pod))
        rules = self.rules if isinstance(declarations, NoDeclarations) else dataclasses.replace(
            self.rules, quotas=declarations.quotas(), gang_timeouts=_gang_timeouts(declarations))
        scheduler = Scheduler(port, self.catalog, self.profile, seed=self.seed, pools=self.pools,
                              now=self.clock.now, rules=rules)
        preemption = _RecordingPreemption(scheduler.preemption)
        scheduler.preemption = preemption
        observer = None
        if self.metrics is not None:
            # Built before any event is pumped (dispatch is manual): it lists what the scheduler listed.
            observer = ClusterObserver(OwnPods(port, port.is_ours), self.metrics, now=self.clock.now,
                                       quotas=rules.quotas)
            self.metrics.counters(scheduler_counters(scheduler))
        scheduler.on_deferred = self._on_outcome if observer is None else functools.partial(
            self._on_deferred, observer)
        self._written.clear()
        self._term = _Term(cluster, declarations, lanes, port, scheduler, preemption, observer)
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        log.info("scheduler %s: %d nodes, %d pods queued, %d waiting for their PodGroup", self.scheduler_name,
                 scheduler.state.size, len(scheduler.queue), len(port.waiting_for_group))
        return True

    def _stand_down(self) -> None:
        term, self._term = self._term, None
        if term is None:
            return
        log.info("%s: not leading, stopping the scheduler", self.identity)
        if term.lanes is not None:
            term.lanes.close(drop=True)  # a follower writes nothing: queued writes are the next leader's
        if term.observer is not None:
            term.observer.close()
        term.scheduler.close()
        term.port.close()
        term.declarations.stop()
        term.cluster.close()
        if self.freeze_gc:
            gc.unfreeze()  # the term's caches are garbage now: let the collector see them

    def _apply_declarations(self, term: _Term) -> None:
        quotas = term.declarations.quotas()
        scheduler = term.scheduler
        timeouts = _gang_timeouts(term.declarations)
        if timeouts != dict(scheduler.rules.gang_timeouts):
            scheduler.rules = dataclasses.replace(scheduler.rules, gang_timeouts=timeouts)
        if quotas != scheduler.rules.quotas:
            scheduler.rules = dataclasses.replace(scheduler.rules, quotas=quotas)
            if term.observer is not None:
                term.observer.quotas = quotas
            scheduler.resync()  # wakes the pods held at a quota
        term.port.admit_waiting()

    # -------------------------------------------------------------- outcomes
    def _on_deferred(self, observer: ClusterObserver, outcome: Outcome) -> bool:
        """A decision made outside a pass (a nominated pod bound once its victims are gone): counted too."""
        observer.record_outcomes([outcome])
        return self._on_outcome(outcome)

    def _on_outcome(self, outcome: Outcome) -> bool:
        term = self._term
        if term is None:
            return True
        name = outcome.request.name
        decision = outcome.decision
        planned_from = term.preemption.diagnoses.pop(name, None)  # kept no longer than this outcome
        if decision.status.ok:
            self._written.pop(name, None)
            return True
        nominated = decision.assignment.node if (decision.status.code is Code.WAIT
                                                 and decision.assignment is not None) else None
        message = self._message(term, outcome.request, decision, planned_from if nominated else None)
        self._write_failure(term, name, "Unschedulable", message, nominated)
        return True

    def _message(self, term: _Term, request: PodRequest, decision: Decision,
                 planned_from: Diagnosis | None) -> str:
        """kube-scheduler's message for `decision`; `planned_from`: a nominated pod's failed cycle."""
        total = term.scheduler.state.size
        nominated = planned_from is not None
        diagnosis = planned_from if nominated else decision.diagnosis
        if decision.status.code is Code.WAIT and decision.assignment is None and request.gang is not None \
                and decision.status.message.startswith(f"gang {request.gang}: "):
            # Assembling: one message for the whole wait (a count in it would rewrite every member at each arrival).
            return fit_error_message(total, {}, prefilter=f"gang {request.gang} is waiting for its members "
                                                          f"(minMember {request.gang_size})")
        if diagnosis is None:  # a prefilter-like refusal (a gang assembling, a queue at its quota, a refusal)
            return fit_error_message(total, {}, prefilter=decision.status.message.rstrip("."))
        postfilter = ""
        if term.scheduler.rules.preemption and not nominated:
            postfilter = preemption_message(diagnosis) if request.preempts else f"preemption: {NOT_ELIGIBLE}"
        return fit_error_message(len(diagnosis.reason_of), diagnosis.counts(), postfilter=postfilter)

    def _write_failure(self, term: _Term, pod: str, reason: str, message: str, nominated: str | None) -> None:
        key = (reason, message, nominated)
        if self._written.get(pod) == key:
            return
        self._written[pod] = key
        port = term.port
        clear = nominated is None and port.nominated.pop(pod, None) is not None
        if nominated is not None:
            port.nominated[pod] = nominated
        recorder = port.recorder

        def write() -> None:
            recorder.condition(pod, reason=reason, message=message, nominated=nominated, clear_nominated=clear)
            recorder.event(pod, type_="Warning", reason="FailedScheduling", action="Scheduling", note=message)

        if term.lanes is None:
            write()
        else:
            term.lanes.submit(pod, write)

    def _forget(self, pod: str) -> None:
        self._written.pop(pod, None)

    def _on_bind_failed(self, pod: str, status: Status, gang: str | None) -> None:
        """An asynchronous bind the API refused (its reservation is released already): say so on the pod, and
        never leave its gang running in part (the members bound already are evicted, as the core does when a
        gang's synchronous bind fails)."""
        term = self._term
        if term is None:
            return
        if term.cluster.get_pod(pod) is not None:
            self._write_failure(term, pod, "SchedulerError", status.message, None)
        if gang is None:
            return
        for name, binding in list(term.scheduler.state.bindings.items()):
            if binding.request.gang == gang and name != pod:
                term.port.evict(name, grace_s=0.0, reason="gang could not start whole")

    def _report_unreadable(self, term: _Term) -> None:
        """Our pending pods the codec cannot read (a field it refuses, a constraint not implemented) get the
        error, naming the field, as their FailedScheduling message."""
        for key, error in term.cluster.unreadable():
            if not key.startswith("pod "):
                continue
            pod = key[4:]
            raw = term.cluster.pods.get(pod)
            if raw is None or (raw.get("spec") or {}).get("nodeName") or not term.port.is_ours(pod):
                continue
            message = fit_error_message(term.scheduler.state.size, {}, prefilter=error.rstrip("."))
            self._write_failure(term, pod, "Unschedulable", message, None)
