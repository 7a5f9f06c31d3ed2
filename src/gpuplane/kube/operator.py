"""The operator: gpuplane's controllers in the cluster, under leader election on a Lease.

`Operator.tick()` is one pass of a small loop: tick the `LeaseElector`; while leader, read the custom resources
(informers on `gpuplane.io/v1alpha1` GpuPools, TidalPolicies and ColocationPolicies), validate each
(`crds.parse_resource`), label the nodes of the valid GpuPools (`gpuplane.io/pool`, planned by
`pools.plan_pools`: one pool per node, nodes two pools select and pool labels set by others are left alone,
lent nodes are the tidal controller's), run one `TidalController` per valid TidalPolicy through `KubeCluster`,
and write each resource's `status` (observedGeneration; conditions `Valid`, `Applied` for GpuPools and
TidalPolicies, `Conflict` for GpuPools, with reasons; a GpuPool's labelled `nodes` and their `models`).
An invalid resource gets `Valid=False` with the field named and is not applied. A pass that finds everything
as it should be writes nothing. While not leader it does nothing: no informers, no cluster cache, no writes.
Losing the lease drops everything; the next leader (or this one, later) rebuilds its state from the API: the
resources, the nodes' pool labels, the loan labels and annotations the tidal controller wrote (its ledger),
and the pods.

Why a small loop rather than kopf: kopf's peering is a priority scheme on its own CRD, not a Lease lock, and
it owns the event loop and the clock; the controllers here are already clock-driven reconcilers, and this
loop runs them in virtual time against the local test API server, the same code path as in the cluster.

Every controller runs under the one Lease (`LeaseConfig.name`, default `gpuplane-operator`): one leader runs
them all, in this order each pass: recovery and node health (the node agents' Events, `gpuplane.kube.node_reports`,
read by an informer on core/v1 events labelled `gpuplane.io/report`; each gang the pods name is adopted by a
`RecoveryController`, restarted by deleting its pods for their owner to re-create; a health tier moves the node
in the `NodeHealthBook` and the `NodeHealthController` taints or untaints it; each Event acted on is annotated
`gpuplane.io/handled-at`, so a new leader does not act twice, and rebuilds the book from the nodes'
`gpuplane.io/health` labels), the node lifecycle (`NodeLifecycleController`: each node the book holds
quarantined is cordoned and drained, then repaired by the `Repairer` the operator is given, served its probation
and returned; every step in the node's `gpuplane.io/lifecycle` annotation), the GpuPools, each TidalPolicy,
the ColocationPolicies' distribution (each node annotated `gpuplane.io/colocation-policy` with the one that
governs it, `kube.reconcilers.ColocationDistributor`) and the Queues (validated, status written; their quotas
are applied by gpuplane-scheduler, `gpuplane.kube.declarations`).

Repairs: without a `repairer`, the operator's is an `AnnotatedRepair`. It asks for each drained node's
repair by writing `gpuplane.io/repair: requested` on the node, and waits for a person or a tool to write `done`
(the node passed admission) or `failed` there. Nothing repairs a node by itself, so a node stays `repairing`
until someone answers. The annotation is on the node, so a new leader picks the wait up where the last one was.

Times of day in TidalPolicies are UTC (the controller takes `now() mod 86400`). Load: with a `load` reader
(`gpuplane operator --prometheus URL --load-query Q` reads each service's load from Prometheus through the
scaler's client), every pass reads each service's load and feeds it to the policy's `SeasonalForecaster`,
the same forecaster the simulator runs; it learns the daily profile from those readings only, and keeps it
while the policy changes generation. A reading that fails is logged and skipped (the forecast keeps its
history). Without a reader the policy's floors alone set replicas (day floor by day, night replicas at night).
Workloads are the policy namespace's Deployments `<service>-stable` and `<service>-tidal`, whose pods carry
label `gpuplane.io/workload: <service>-stable|-tidal`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal, Protocol

from gpuplane.controllers.accounting import AccountingLedger, IdlePolicy, IdleRule, LedgerFile, UtilisationReader
from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.forecast import NO_FORECAST, LoadForecast, SeasonalForecaster
from gpuplane.controllers.health import HealthPolicy, NodeHealthBook, NodeHealthController
from gpuplane.controllers.lifecycle import NodeLifecycleController, Repairer
from gpuplane.controllers.recovery import RecoveryController
from gpuplane.controllers.tidal import SUBSET_LABEL, TidalController
from gpuplane.kube.api import ApiError, JsonObject, KubeApi
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.crds import (
    GPU_POOL,
    KINDS,
    TIDAL_POLICY,
    ColocationPolicySpec,
    GpuPoolSpec,
    Kind,
    QueueSpec,
    Resource,
    ResourceError,
    TidalPolicySpec,
    parse_resource,
)
from gpuplane.kube.informer import Informer
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.node_reports import EVENTS_PATH, REPORT_LABEL, NodeReport, parse_report
from gpuplane.kube.objects import format_time, object_key, selects
from gpuplane.kube.pools import PoolRule, conflict_message, plan_pools
from gpuplane.kube.reconcilers import ColocationDistributor, RecoveryFeed, apply_pool_plan
from gpuplane.model import Assignment, Catalog, GpuplaneError, PodRequest, Taint, default_catalog
from gpuplane.model.failures import SignatureLibrary, load_signature_library
from gpuplane.port import Clock, ClusterPort, EventType, Handler, NodeInfo, PodInfo, Status, Unsubscribe, WallClock
from gpuplane.port.metrics import PlaneMetrics

log = logging.getLogger(__name__)

HANDLED_ANNOTATION = "gpuplane.io/handled-at"
"""Written on a node agent's Event once the operator has acted on it, so that a new leader does not act twice."""
REPAIR_ANNOTATION = "gpuplane.io/repair"
"""A drained node's repair, for `AnnotatedRepair`: `requested` (by the operator), then `done` or `failed` (by
whoever repaired it)."""


class AnnotatedRepair:
    """The operator's default `Repairer`: it asks for the repair on the node and waits for an answer.

    `start` writes `gpuplane.io/repair: requested` on the node. `poll` reads the annotation: `done` means
    repaired and passed admission (True), `failed` means not repaired (False), and anything else means still
    waiting (None). It never repairs anything itself. A person (`kubectl annotate node N gpuplane.io/repair=done
    --overwrite`) or an RMA tool answers."""

    def __init__(self, port: ClusterPort) -> None:
        self.port = port

    def start(self, node: str) -> None:
        if self._answer(node) != "requested":
            self.port.patch_node(node, annotations={REPAIR_ANNOTATION: "requested"})

    def poll(self, node: str) -> bool | None:
        answer = self._answer(node)
        return True if answer == "done" else False if answer == "failed" else None

    def _answer(self, node: str) -> str | None:
        info = next((n for n in self.port.list_nodes() if n.name == node), None)
        return None if info is None else dict(info.annotations).get(REPAIR_ANNOTATION)


class LoadReader(Protocol):
    """Reads one service's load now (requests/s); raises (a `GpuplaneError`, `OSError` or `ValueError`) when
    it cannot. The CLI gives one that queries Prometheus through the scaler's client."""

    def __call__(self, namespace: str, service: str) -> float: ...


ForecastFactory = Callable[[], LoadForecast]


class NamespacedWorkloads:
    """The cluster port as a TidalPolicy in `namespace` sees it: its services' workloads are that namespace's
    Deployments (`scale("chat-tidal")` scales `namespace/chat-tidal`), and pods of other namespaces never
    count as its services' replicas. Nodes, and every pod's placement, stay cluster-wide."""

    def __init__(self, port: ClusterPort, namespace: str) -> None:
        self.port = port
        self.namespace = namespace

    def _local(self, pod: PodInfo) -> PodInfo:
        workload = pod.request.workload
        if workload is None or "/" in workload or pod.name.startswith(f"{self.namespace}/"):
            return pod
        foreign = f"{pod.name.split('/', 1)[0]}/{workload}"
        return dataclasses.replace(pod, request=dataclasses.replace(pod.request, workload=foreign))

    def list_nodes(self) -> Sequence[NodeInfo]:
        return self.port.list_nodes()

    def list_pods(self) -> Sequence[PodInfo]:
        return [self._local(p) for p in self.port.list_pods()]

    def watch(self, handler: Handler) -> Unsubscribe:
        return self.port.watch(handler)

    def create_pod(self, request: PodRequest) -> Status:
        return self.port.create_pod(request)

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        return self.port.bind(pod, assignment, node_version=node_version)

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        return self.port.evict(pod, grace_s=grace_s, reason=reason)

    def delete_pod(self, pod: str) -> Status:
        return self.port.delete_pod(pod)

    def fail_pod(self, pod: str, reason: str) -> Status:
        return self.port.fail_pod(pod, reason)

    def scale(self, workload: str, replicas: int) -> Status:
        return self.port.scale(workload if "/" in workload else f"{self.namespace}/{workload}", replicas)

    def patch_pod(self, pod: str, *, annotations: Mapping[str, str | None]) -> Status:
        return self.port.patch_pod(pod, annotations=annotations)

    def patch_node(self, node: str, *, labels: Mapping[str, str | None] | None = None,
                   taints: Sequence[Taint] | None = None, annotations: Mapping[str, str | None] | None = None,
                   unschedulable: bool | None = None, pool: str | None = None) -> Status:
        return self.port.patch_node(node, labels=labels, taints=taints, annotations=annotations,
                                    unschedulable=unschedulable, pool=pool)

    def record_event(self, kind: Literal["Pod", "Node"], name: str, *, type_: EventType, reason: str,
                     message: str) -> Status:
        return self.port.record_event(kind, name, type_=type_, reason=reason, message=message)


def tidal_controller(port: ClusterPort, namespace: str, spec: TidalPolicySpec, forecast: LoadForecast,
                     now: Callable[[], float], load: Callable[[str], float | None] | None) -> TidalController:
    """The tidal controller of one TidalPolicy in `namespace`, as the operator runs it (the parity run builds
    the simulator's the same way)."""
    return TidalController(NamespacedWorkloads(port, namespace), spec, spec.bindings(), forecast, now, load=load,
                           lend=spec.lend, drain_order=spec.order, training_pool=spec.training_pool,
                           tidal_pool=spec.tidal_pool, forecast_horizon_s=spec.forecast_horizon_s)


@dataclass(slots=True)
class _Tidal:
    generation: int
    spec: TidalPolicySpec
    controller: TidalController


ClusterFactory = Callable[[], KubeCluster]


@dataclass(frozen=True, slots=True)
class LedgerSettings:
    """The accounting ledger, run by the leader only: bookings appended to `path` (a volume every replica
    mounts), utilisation read from `reader` every `sample_s`."""

    path: Path
    reader: UtilisationReader
    sample_s: float = 60.0
    idle_rules: tuple[IdleRule, ...] = ()
    """the idle policy's rules, judged on the ledger's readings after each sample (none: no policy runs)"""

    def __post_init__(self) -> None:
        if self.sample_s <= 0:
            raise ValueError(f"ledger sample_s must be positive, got {self.sample_s}")


class Operator:
    """Runs the controllers while `elector` leads. `cluster_factory` builds the cluster port (started) when
    leadership begins; `namespace` limits the namespaced resources watched (None: all namespaces)."""

    def __init__(self, api: KubeApi, elector: LeaseElector, clock: Clock, *, catalog: Catalog | None = None,
                 cluster_factory: ClusterFactory | None = None, namespace: str | None = None,
                 load: LoadReader | None = None, forecast: ForecastFactory = SeasonalForecaster,
                 library: SignatureLibrary | None = None, health_policy: HealthPolicy | None = None,
                 metrics: PlaneMetrics | None = None, repairer: Repairer | None = None,
                 ledger: LedgerSettings | None = None) -> None:
        """`ledger`: also book every pod's cards while leading (one ledger per cluster, whichever replica leads;
        a new leader books the pods it finds from when it took over, so a handover loses at most the time
        without a leader and books nothing twice)."""
        self.api = api
        self.ledger_settings = ledger
        self.ledger: AccountingLedger | None = None
        self.idle: IdlePolicy | None = None
        """the idle policy on the ledger's readings, while leading (`LedgerSettings.idle_rules`)"""
        self._ledger_sink: LedgerFile | None = None
        self._ledger_sampled_at = 0.0
        self.metrics = metrics
        """the leader gauge only: the scheduling process's observer counts the cluster (docs/monitoring.md)"""
        self.library = library if library is not None else load_signature_library()
        self.health_policy = health_policy or HealthPolicy()
        self.recovery: RecoveryController | None = None
        self.health: NodeHealthController | None = None
        self.feed: RecoveryFeed | None = None
        self.repairer = repairer
        """None: an `AnnotatedRepair` on the cluster, made when leadership begins"""
        self.lifecycle: NodeLifecycleController | None = None
        self.colocation: ColocationDistributor | None = None
        self._handled: set[str] = set()
        """Keys of the node agents' Events acted on while leading (the annotation may not have reached the
        informer yet)."""
        self.elector = elector
        self.clock = clock
        self.catalog = catalog if catalog is not None else default_catalog()
        self.namespace = namespace
        self.load = load
        self.new_forecast = forecast
        self.forecasts: dict[str, LoadForecast] = {}
        """Per TidalPolicy key, what its forecaster has learnt (kept across generations of the policy)."""
        # One eviction attempt, no back-off sleep: the controllers' next pass is the retry, and a sleeping
        # tick would outlast the lease.
        self._cluster_factory = cluster_factory or (
            lambda: KubeCluster(api, self.catalog, clock=clock, dispatch="manual", eviction_attempts=1))
        self.cluster: KubeCluster | None = None
        self.informers: dict[str, Informer] = {}
        self.tidal: dict[str, _Tidal] = {}
        self.resources: dict[str, Resource | ResourceError] = {}
        """Per `Kind/key`, the last reading: the validated resource or why it is invalid."""

    @property
    def leading(self) -> bool:
        return self.cluster is not None

    def tick(self) -> None:
        """One pass: the election, then (while leader) every resource."""
        leader = self.elector.tick()
        if self.metrics is not None:
            self.metrics.set_leader("operator", leader)
        if not leader:
            if self.leading:
                self._stand_down()
            return
        if not self.leading and not self._take_over():
            return
        assert self.cluster is not None
        self.cluster.pump()
        self._recover()
        assert self.lifecycle is not None
        self.lifecycle.step()
        self.cluster.pump()
        seen: set[str] = set()
        colocation: dict[str, Mapping[str, str]] = {}
        for kind in KINDS:
            pools: list[tuple[Resource, GpuPoolSpec, JsonObject]] = []
            for obj in self.informers[kind.kind].objects():
                key = f"{kind.kind}/{object_key(obj)}"
                seen.add(key)
                resource = self._reconcile(kind, key, obj)
                if resource is not None and isinstance(resource.spec, GpuPoolSpec):
                    pools.append((resource, resource.spec, obj))
                elif resource is not None and isinstance(resource.spec, ColocationPolicySpec):
                    colocation[object_key(obj)] = resource.spec.node_selector
            if kind is GPU_POOL:
                self._apply_pools(pools)
        assert self.colocation is not None
        self.colocation.reconcile(colocation)
        settings = self.ledger_settings
        if self.ledger is not None and settings is not None \
                and self.clock.now() - self._ledger_sampled_at >= settings.sample_s:
            self.ledger.sample()
            self._ledger_sampled_at = self.clock.now()
            if self.idle is not None:
                self.idle.reconcile()
        for key in set(self.tidal) - seen:
            del self.tidal[key]
        for key in set(self.forecasts) - seen:
            del self.forecasts[key]
        for key in set(self.resources) - seen:
            del self.resources[key]

    def shutdown(self) -> None:
        """Stop the controllers and release the lease, so that another replica takes over at once."""
        self.tidal.clear()
        self._stand_down()  # the ledger's last bookings before another replica may lead
        self.elector.release()
        if self.metrics is not None:
            self.metrics.set_leader("operator", False)

    # ------------------------------------------------------------------ leadership
    def _take_over(self) -> bool:
        """Start the cluster cache and the resource informers; False (retried next tick) if the API does not answer."""
        log.info("leading: starting the controllers")
        try:
            self.cluster = self._cluster_factory()
        except (TimeoutError, ApiError) as exc:
            log.warning("leading, but the cluster cannot be read yet: %s", exc)
            return False
        for kind in KINDS:
            informer = Informer(self.api, kind.path(self.namespace), name=kind.plural)
            informer.start()
            self.informers[kind.kind] = informer
        reports = Informer(self.api, EVENTS_PATH, label_selector=REPORT_LABEL, name="node reports")
        reports.start()
        self.informers["Event"] = reports
        book = NodeHealthBook(self.health_policy)
        self.health = NodeHealthController(self.cluster, book, self.clock.now)
        self.health.rebuild()
        self.recovery = RecoveryController(self.cluster, FailureClassifier(self.library), book, self.clock.now,
                                           health=self.health)
        self.feed = RecoveryFeed(self.recovery, self.health)
        self.lifecycle = NodeLifecycleController(self.cluster, self.health,
                                                 self.repairer or AnnotatedRepair(self.cluster))
        self.colocation = ColocationDistributor(self.cluster)
        if self.ledger_settings is not None:
            self._ledger_sink = LedgerFile(self.ledger_settings.path)
            self.ledger = AccountingLedger(self.cluster, self.clock, self.ledger_settings.reader, sample_s=0.0,
                                           sink=self._ledger_sink, keep_bookings=False)
            self._ledger_sampled_at = self.clock.now()
            if self.ledger_settings.idle_rules:
                self.idle = IdlePolicy(self.cluster, self.ledger, self.clock, self.ledger_settings.idle_rules)
        for informer in self.informers.values():
            if not informer.wait_synced(30.0):
                log.warning("%s: the first list has not answered yet", informer.name)
        return True

    def _stand_down(self) -> None:
        self.idle = None
        if self.ledger is not None:  # every open interval booked up to now, before another replica books on
            self.ledger.close()
            self.ledger = None
        if self._ledger_sink is not None:
            self._ledger_sink.close()
            self._ledger_sink = None
        if self.cluster is not None:
            log.info("not leading: stopping the controllers")
            self.cluster.close()
        for informer in self.informers.values():
            informer.stop(timeout_s=0)  # its thread ends at its next read; nothing waits for it
        if self.recovery is not None:
            self.recovery.close()
        self.cluster = None
        self.recovery = self.health = self.feed = self.colocation = self.lifecycle = None
        self._handled.clear()
        self.informers.clear()
        self.tidal.clear()
        self.resources.clear()

    # ------------------------------------------------------------------ recovery and node health
    def _recover(self) -> None:
        """Adopt the gangs the cluster runs, then act on the node agents' Events not acted on yet (oldest
        first) and mark each handled."""
        assert self.feed is not None and self.cluster is not None
        self.feed.adopt_gangs()
        fresh: list[NodeReport] = []
        for obj in self.informers["Event"].objects():
            meta = obj.get("metadata") or {}
            key = object_key(obj)
            if key in self._handled or HANDLED_ANNOTATION in (meta.get("annotations") or {}):
                continue
            report = parse_report(obj)
            if report is not None:
                fresh.append(report)
        if not fresh:
            return
        fresh.sort(key=lambda r: (r.t, r.key))
        self.feed.handle(fresh)
        self.cluster.pump()
        stamp = format_time(self.clock.now())
        for report in fresh:
            self._handled.add(report.key)
            namespace, name = report.key.split("/", 1)
            try:
                self.api.patch(f"/api/v1/namespaces/{namespace}/events/{name}",
                               {"metadata": {"annotations": {HANDLED_ANNOTATION: stamp}}})
            except ApiError as exc:
                log.warning("event %s: marking it handled failed: %s", report.key, exc)

    # ------------------------------------------------------------------ resources
    def _reconcile(self, kind: Kind, key: str, obj: JsonObject) -> Resource | None:
        """Validate one resource and apply it; a valid GpuPool is returned, not applied (`_apply_pools` takes
        them all at once: a node's pool depends on every pool)."""
        generation = int((obj.get("metadata") or {}).get("generation") or 0)
        try:
            resource = parse_resource(obj, self.catalog)
        except ResourceError as exc:
            self.resources[key] = exc
            self.tidal.pop(key, None)
            conditions = [("Valid", False, "InvalidSpec", str(exc))]
            if kind in (TIDAL_POLICY, GPU_POOL):
                conditions.append(("Applied", False, "InvalidSpec", "not applied: the spec is invalid"))
            self._write_status(kind, obj, {"observedGeneration": generation}, conditions)
            return None
        self.resources[key] = resource
        valid = ("Valid", True, "Valid", "")
        if isinstance(resource.spec, TidalPolicySpec):
            self._run_tidal(key, resource, resource.spec, obj, valid)
        elif isinstance(resource.spec, ColocationPolicySpec):
            nodes = self._nodes_matching(resource.spec.node_selector)
            self._write_status(kind, obj, {"observedGeneration": generation, "nodes": nodes}, [valid])
        elif isinstance(resource.spec, QueueSpec):  # applied by gpuplane-scheduler (gpuplane.kube.declarations)
            self._write_status(kind, obj, {"observedGeneration": generation}, [valid])
        return resource

    def _apply_pools(self, pools: Sequence[tuple[Resource, GpuPoolSpec, JsonObject]]) -> None:
        """Label the valid GpuPools' nodes (`plan_pools`) and write each pool's status."""
        assert self.cluster is not None
        rules = {resource.name: PoolRule.of(spec, self.catalog) for resource, spec, _ in pools}
        specs = {info.name: info.spec for info in self.cluster.list_nodes()}
        plan = plan_pools(rules, specs.values())
        failed = apply_pool_plan(self.cluster, plan, specs)
        valid = ("Valid", True, "Valid", "")
        for resource, _, obj in pools:
            report = plan.reports[resource.name]
            problems = failed.get(resource.name, {})
            nodes = [n for n in report.nodes if n not in problems]
            applied = (("Applied", False, "PatchFailed", "; ".join(f"{n}: {why}" for n, why in problems.items()))
                       if problems else ("Applied", True, "Labelled", ""))
            message = conflict_message(report)
            reason = "OverlappingPools" if report.overlapping else "ForeignPoolLabel"
            conflict = ("Conflict", True, reason, message) if message else ("Conflict", False, "NoConflict", "")
            models = sorted({model for n in nodes if (model := specs[n].gpu_model) is not None})
            self._write_status(GPU_POOL, obj, {"observedGeneration": resource.generation, "nodes": len(nodes),
                                               "models": models}, [valid, applied, conflict])

    def _run_tidal(self, key: str, resource: Resource, spec: TidalPolicySpec, obj: JsonObject,
                   valid: tuple[str, bool, str, str]) -> None:
        assert self.cluster is not None and resource.namespace is not None
        entry = self.tidal.get(key)
        if entry is None or entry.generation != resource.generation or entry.spec != spec:
            forecast: LoadForecast = NO_FORECAST
            load = None
            if self.load is not None:
                if key not in self.forecasts:
                    self.forecasts[key] = self.new_forecast()
                forecast = self.forecasts[key]
                load = functools.partial(self._read_load, key, resource.namespace)
            controller = tidal_controller(self.cluster, resource.namespace, spec, forecast, self.clock.now, load)
            entry = self.tidal[key] = _Tidal(resource.generation, spec, controller)
        try:
            entry.controller.reconcile()
            applied = ("Applied", True, "Reconciled", "")
        except (ApiError, ValueError) as exc:
            log.warning("%s: reconcile failed: %s", key, exc)
            applied = ("Applied", False, "ReconcileFailed", str(exc))
        self.cluster.pump()
        _, phase = spec.window_at(self.clock.now())
        tidal_nodes = sum(1 for n in self.cluster.list_nodes() if dict(n.spec.labels).get(SUBSET_LABEL) == "tidal")
        status = {"observedGeneration": resource.generation, "nodes": tidal_nodes, "phase": phase,
                  "lentNodes": len(entry.controller.ledger)}
        self._write_status(TIDAL_POLICY, obj, status, [valid, applied])

    def _read_load(self, key: str, namespace: str, service: str) -> float | None:
        assert self.load is not None
        try:
            return self.load(namespace, service)
        except (GpuplaneError, OSError, ValueError) as exc:
            log.warning("%s: the load of %s/%s could not be read: %s", key, namespace, service, exc)
            return None

    def _nodes_matching(self, selector: Mapping[str, str]) -> int:
        assert self.cluster is not None
        return sum(1 for n in self.cluster.list_nodes() if selects(selector, dict(n.spec.labels)))

    def _write_status(self, kind: Kind, obj: JsonObject, fields: Mapping[str, Any],
                      conditions: Sequence[tuple[str, bool, str, str]]) -> None:
        """Merge-patch `status` when it differs from what the object carries (lastTransitionTime kept while a
        condition's status stays)."""
        current = obj.get("status") or {}
        before = {c.get("type"): c for c in current.get("conditions") or [] if isinstance(c, Mapping)}
        generation = int(fields.get("observedGeneration") or 0)
        stamp = format_time(self.clock.now())
        rendered = []
        for type_, ok, reason, message in conditions:
            status = "True" if ok else "False"
            old = before.get(type_) or {}
            rendered.append({"type": type_, "status": status, "reason": reason, "message": message,
                             "lastTransitionTime": old.get("lastTransitionTime", stamp)
                             if old.get("status") == status else stamp,
                             "observedGeneration": generation})
        status_doc = {**fields, "conditions": rendered}
        if all(current.get(k) == v for k, v in status_doc.items()):
            return
        meta = obj.get("metadata") or {}
        path = kind.path(meta.get("namespace"), str(meta.get("name")), "status")
        try:
            self.api.patch(path, {"status": status_doc})
        except ApiError as exc:
            log.warning("%s: writing the status failed: %s", path, exc)


# ------------------------------------------------------------------ running it
class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path in ("/healthz", "/readyz")
        body = json.dumps({"status": "ok"} if ok else {"message": "not found"}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class HealthServer(ThreadingHTTPServer):
    """`/healthz` for the kubelet's probes: every replica answers, leader or not (a standby is healthy)."""

    daemon_threads = True

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        super().__init__((host, port), _Health)
        self._thread: threading.Thread | None = None

    def start(self) -> HealthServer:
        self._thread = threading.Thread(target=self.serve_forever, name="operator health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def run_operator(api: KubeApi, config: LeaseConfig, stop: threading.Event, *, namespace: str | None = None,
                 clock: Clock | None = None, load: LoadReader | None = None,
                 metrics: PlaneMetrics | None = None, ledger: LedgerSettings | None = None) -> None:
    """Tick an operator every half retry period until `stop` is set; then release the lease."""
    world: Clock = clock if clock is not None else WallClock()
    elector = LeaseElector(api, config, world.now)
    operator = Operator(api, elector, world, namespace=namespace, load=load, metrics=metrics, ledger=ledger)
    try:
        while not stop.is_set():
            operator.tick()
            stop.wait(config.retry_period_s / 2)
    finally:
        operator.shutdown()
