"""Operator parity: `gpuplane operator` against the local API server through a compressed day, next to the
simulator's controllers on the same inputs, and the decisions both take, compared.

One world, built twice: a `FakeApiServer` (real HTTP, the operator's informers, `KubeCluster`, the node agents'
`NodeReporter` posting core/v1 Events) and a `SimCluster` (the same controllers called directly on the port).
The inputs are the same on both sides, at the same virtual times:

- the nodes (stable and tidal inference nodes, training nodes, a spare), their labels, the custom resources
  (GpuPools, one TidalPolicy, ColocationPolicies; a GpuPool and a ColocationPolicy arrive during the day);
- each service's load (a diurnal curve), read by the tidal controller's learnt forecaster (`SeasonalForecaster`;
  on the operator's side through its `LoadReader`, as from Prometheus);
- the pods: a training gang of two 8-card pods on the first healthy training nodes, re-created by its "owner"
  (the Job controller's part, played by the harness on both sides) once its pods are gone; and a borrowed
  training pod on each lent node while it is lent (evicted at reclaim);
- the node agents' findings: an Xid 79 on a gang node, a software fault in the gang, an Xid 79 on the spare
  with no gang, a failing then passing health-check tier on a stable node.

Every `tick_s` (300 s: 288 ticks for 24 h) the operator ticks once and the simulator's controllers run once in
the operator's order (recovery and health, the node lifecycle with the operator's default `AnnotatedRepair`,
pools, tidal, co-location), then both worlds are read back as decisions: a node's pool label, loan label, health
label and quarantine taint, lifecycle step and governing co-location policy;
each Deployment's replicas; pods gone (restarts, reclaim evictions); and the recovery controller's restarts.
A decision is (time, what, subject, value) when the value changes. Parity holds when both lists are equal.

Not modelled on either side: the scheduler and the kubelet. Each Deployment's pods exist (the harness plays the
Deployment controller on the API server's side: pending pods to match `spec.replicas`; the simulator's workloads
do the same), but none is placed or runs; the training owner places its own pods.

    python3 -m gpuplane.report.operator_parity [--hours 24] [--tick 300] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.forecast import SeasonalForecaster
from gpuplane.controllers.health import HEALTH_LABEL, QUARANTINE_TAINT, NodeHealthBook, NodeHealthController
from gpuplane.controllers.lifecycle import LIFECYCLE_ANNOTATION, NodeLifecycleController
from gpuplane.controllers.recovery import RecoveryController
from gpuplane.controllers.tidal import LOAN_LABEL, LOAN_TAINT, SUBSET_LABEL
from gpuplane.kube.api import RestKubeApi, pod_path
from gpuplane.kube.crds import ColocationPolicySpec, GpuPoolSpec, TidalPolicySpec, parse_resource
from gpuplane.kube.informer import Informer
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.node_reports import NodeReport
from gpuplane.kube.objects import GANG_LABEL, GANG_SIZE, POOL_LABEL, WORKLOAD_LABEL, object_key, resource_version
from gpuplane.kube.operator import AnnotatedRepair, Operator, tidal_controller
from gpuplane.kube.pools import PoolRule, plan_pools
from gpuplane.kube.reconcilers import COLOCATION_ANNOTATION, ColocationDistributor, RecoveryFeed, apply_pool_plan
from gpuplane.model import (
    Assignment,
    CardShare,
    NodeSpec,
    PodRequest,
    QoS,
    Taint,
    Toleration,
    WholeCards,
    default_catalog,
)
from gpuplane.model.failures import load_signature_library
from gpuplane.node.health_checks import CheckResult
from gpuplane.node.reporter import NodeReporter
from gpuplane.port import PodInfo, PodPhase, Status
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop

MIDNIGHT = 1_764_374_400.0  # 2025-11-29T00:00:00Z
HOUR = 3600.0
NAMESPACE = "ml"
CRS = "/apis/gpuplane.io/v1alpha1"
MODEL = "H100-80GB"
CARD_MEMORY_MIB = 81_559
XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2417, GPU has fallen off the bus."
ILLEGAL_ADDRESS = "RuntimeError: CUDA error: an illegal memory access was encountered"

Decision = tuple[float, str, str, str]
"""(hours after midnight, what, subject, value)"""


# ---------------------------------------------------------------------------------------------- the inputs
@dataclass(frozen=True, slots=True)
class NodeDef:
    name: str
    labels: Mapping[str, str]


def fleet() -> list[NodeDef]:
    """2 stable and 4 tidal inference nodes, 4 training nodes and a spare (8 × H100 each)."""
    nodes = [NodeDef(f"stable-{i}", {SUBSET_LABEL: "stable", "gpuplane.io/role": "inference",
                                     "gpuplane.io/colocation": "on"}) for i in range(2)]
    nodes += [NodeDef(f"tidal-{i}", {SUBSET_LABEL: "tidal", "gpuplane.io/role": "inference",
                                     "gpuplane.io/colocation": "on" if i % 2 else "off"}) for i in range(4)]
    nodes += [NodeDef(f"train-{i}", {"gpuplane.io/role": "training"}) for i in range(4)]
    nodes.append(NodeDef("spare-0", {"gpuplane.io/role": "spare"}))
    return nodes


def gpu_pool(name: str, selector: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": name, "generation": 1},
            "spec": {"models": [MODEL], "nodeSelector": dict(selector)}}


def tidal_policy() -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "TidalPolicy",
            "metadata": {"name": "night", "namespace": NAMESPACE, "generation": 1},
            "spec": {"services": [{"name": "chat", "minReplicas": 2, "maxReplicas": 40, "dayFloor": 4,
                                   "perReplicaCapacity": 50, "gpuMilliPerReplica": 1000}],
                     "windows": [{"name": "night", "shrinkAt": "22:30", "lendFrom": "23:30", "reclaimAt": "07:30",
                                  "nightReplicas": {"chat": 2}}]}}


def colocation_policy(name: str, selector: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "ColocationPolicy",
            "metadata": {"name": name, "namespace": NAMESPACE, "generation": 1},
            "spec": {"nodeSelector": dict(selector)}}


def load_at(t: float) -> float:
    """chat's load (requests/s): 60 at night, a day hump peaking at 1,260 at 14:00 (24 replicas' worth)."""
    hour = ((t - MIDNIGHT) / HOUR) % 24.0
    return 60.0 + 1200.0 * max(0.0, math.sin(math.pi * (hour - 7.0) / 14.0)) ** 2


@dataclass(frozen=True, slots=True)
class Arrival:
    """A custom resource that appears at `hour` (both worlds)."""

    hour: float
    path: str
    obj: Mapping[str, Any]


def arrivals() -> list[Arrival]:
    pools = f"{CRS}/gpupools"
    coloc = f"{CRS}/namespaces/{NAMESPACE}/colocationpolicies"
    return [
        Arrival(0.0, pools, gpu_pool("training", {"gpuplane.io/role": "training"})),
        Arrival(0.0, pools, gpu_pool("inference-stable", {SUBSET_LABEL: "stable"})),
        Arrival(0.0, pools, gpu_pool("inference-tidal", {SUBSET_LABEL: "tidal"})),
        Arrival(0.0, f"{CRS}/namespaces/{NAMESPACE}/tidalpolicies", tidal_policy()),
        Arrival(0.0, coloc, colocation_policy("near-line", {"gpuplane.io/colocation": "on"})),
        Arrival(12.0, pools, gpu_pool("spares", {"gpuplane.io/role": "spare"})),
        Arrival(18.0, coloc, colocation_policy("stable-only", {SUBSET_LABEL: "stable"})),
    ]


@dataclass(frozen=True, slots=True)
class Fault:
    """A node agent's finding at `hour`: on `node`, or (`node` None) on the node of the gang's member 1."""

    hour: float
    node: str | None
    line: str | None = None
    xid: int | None = None
    check_passed: bool | None = None


FAULTS = (
    Fault(3.0, None, line=XID_79),  # a gang node falls off the bus: isolated, the gang restarts elsewhere
    Fault(5.0, "stable-1", check_passed=False),  # a failed check tier: suspect
    Fault(5.5, "stable-1", check_passed=True),  # cleared
    Fault(10.0, None, line=ILLEGAL_ADDRESS),  # a software fault: restart in place, nobody isolated
    Fault(14.0, "spare-0", xid=79),  # no gang there: the node alone is isolated
)


# ---------------------------------------------------------------------------------------------- the worlds
@dataclass(slots=True)
class Snapshot:
    nodes: dict[str, dict[str, str]]
    """node → what → value (pool, loan, health, tainted, colocation, lifecycle step)"""
    replicas: dict[str, int]
    pods: set[str]


def _node_view(labels: Mapping[str, str], tainted: bool, annotations: Mapping[str, str]) -> dict[str, str]:
    return {"pool": labels.get(POOL_LABEL, ""), "loan": labels.get(LOAN_LABEL, ""),
            "health": labels.get(HEALTH_LABEL, ""), "tainted": str(tainted),
            "colocation": annotations.get(COLOCATION_ANNOTATION, ""),
            "lifecycle": json.loads(annotations.get(LIFECYCLE_ANNOTATION, "{}")).get("step", "")}


class KubeShaped(SimCluster):
    """`SimCluster` shaped as `KubeCluster` presents a cluster: pool moves also write the `gpuplane.io/pool`
    label (the simulator keeps the pool apart from the labels; GpuPool planning reads the label), and a
    replica of workload `ml/chat-tidal` (named `ml/chat-tidal-<i>`) reads as workload `chat-tidal`, as a
    pod's `gpuplane.io/workload` label says in its own namespace."""

    def list_pods(self) -> Sequence[PodInfo]:
        return [self._local(p) for p in super().list_pods()]

    @staticmethod
    def _local(pod: PodInfo) -> PodInfo:
        workload = pod.request.workload
        if workload is None or "/" not in workload:
            return pod
        return dataclasses.replace(pod, request=dataclasses.replace(pod.request, workload=workload.split("/", 1)[1]))

    def patch_node(self, node: str, *, labels: Mapping[str, str | None] | None = None,
                   taints: Sequence[Taint] | None = None, annotations: Mapping[str, str | None] | None = None,
                   unschedulable: bool | None = None, pool: str | None = None) -> Status:
        if pool is not None:
            labels = {**(labels or {}), POOL_LABEL: pool}
        elif labels is not None and POOL_LABEL in labels:
            pool = labels[POOL_LABEL] or "default"
        return super().patch_node(node, labels=labels, taints=taints, annotations=annotations,
                                  unschedulable=unschedulable, pool=pool)


def _request(pod: str, *, gang: str | None, borrowed: bool) -> PodRequest:
    return PodRequest(pod, cpu_milli=8_000, memory_mib=64_000, gpu=WholeCards(8), qos=QoS.OFFLINE,
                      gang=gang, gang_size=2 if gang else 0,
                      pools=frozenset({"training"}) if borrowed else None,
                      tolerations=(Toleration(LOAN_TAINT.key, LOAN_TAINT.value, LOAN_TAINT.effect),)
                      if borrowed else ())


class SimWorld:
    """The simulator's controllers on a `SimCluster`, called in the operator's order."""

    def __init__(self) -> None:
        self.catalog = default_catalog()
        self.loop = EventLoop(start=MIDNIGHT)
        specs = [NodeSpec(n.name, 64_000, 262_144, MODEL, 8,
                          labels=(("kubernetes.io/hostname", n.name), *n.labels.items())) for n in fleet()]
        self.cluster = KubeShaped(self.catalog, specs, loop=self.loop)
        self.now = self.loop.now
        book = NodeHealthBook()
        self.health = NodeHealthController(self.cluster, book, self.now)
        self.recovery = RecoveryController(self.cluster, FailureClassifier(load_signature_library()), book, self.now,
                                           health=self.health)
        self.feed = RecoveryFeed(self.recovery, self.health)
        self.lifecycle = NodeLifecycleController(self.cluster, self.health, AnnotatedRepair(self.cluster))
        self.distributor = ColocationDistributor(self.cluster)
        self.forecast = SeasonalForecaster()
        self.pools: dict[str, GpuPoolSpec] = {}
        self.colocation: dict[str, ColocationPolicySpec] = {}
        self.tidal: Any = None
        self.reports: list[NodeReport] = []
        for workload in ("chat-stable", "chat-tidal"):
            template = PodRequest("chat", cpu_milli=4_000, memory_mib=16_000, gpu=WholeCards(1))
            self.cluster.create_workload(f"{NAMESPACE}/{workload}", template)

    def add(self, arrival: Arrival) -> None:
        resource = parse_resource(dict(arrival.obj), self.catalog)
        key = f"{resource.namespace}/{resource.name}" if resource.namespace else resource.name
        if isinstance(resource.spec, GpuPoolSpec):
            self.pools[resource.name] = resource.spec
        elif isinstance(resource.spec, ColocationPolicySpec):
            self.colocation[key] = resource.spec
        elif isinstance(resource.spec, TidalPolicySpec):
            assert resource.namespace is not None
            self.tidal = tidal_controller(self.cluster, resource.namespace, resource.spec, self.forecast, self.now,
                                          lambda service: load_at(self.now()))

    def tick(self) -> None:
        self.feed.adopt_gangs()
        if self.reports:
            self.feed.handle(sorted(self.reports, key=lambda r: (r.t, r.key)))
            self.reports.clear()
        self.lifecycle.step()
        rules = {name: PoolRule.of(spec, self.catalog) for name, spec in self.pools.items()}
        specs = {info.name: info.spec for info in self.cluster.list_nodes()}
        apply_pool_plan(self.cluster, plan_pools(rules, specs.values()), specs)
        if self.tidal is not None:
            self.tidal.reconcile()
        self.distributor.reconcile({key: spec.node_selector for key, spec in self.colocation.items()})

    def place(self, pod: str, node: str, *, gang: str | None, borrowed: bool) -> None:
        status = self.cluster.create_pod(_request(pod, gang=gang, borrowed=borrowed))
        assert status.ok, status.message
        cards = tuple(CardShare(i, 1000, CARD_MEMORY_MIB, whole=True) for i in range(8))
        status = self.cluster.bind(pod, Assignment(node, cards))
        assert status.ok, f"{pod} on {node}: {status.message}"

    def snapshot(self) -> Snapshot:
        nodes = {n.name: _node_view(dict(n.spec.labels), QUARANTINE_TAINT in n.spec.taints, dict(n.annotations))
                 for n in self.cluster.list_nodes()}
        live = [p for p in self.cluster.list_pods() if p.phase in (PodPhase.PENDING, PodPhase.RUNNING)]
        replicas = {f"{NAMESPACE}/{w}": sum(1 for p in live if p.request.workload == w)
                    for w in ("chat-stable", "chat-tidal")}
        return Snapshot(nodes, replicas, {p.name for p in live if p.request.workload is None})


class KubeWorld:
    """`gpuplane operator` (one replica, leading) against a `FakeApiServer`, and a node agent per node."""

    def __init__(self, server: FakeApiServer, load_factor: float = 1.0) -> None:
        self.server = server
        self.load_factor = load_factor
        self.t = MIDNIGHT
        for n in fleet():
            server.add_node(node_json(n.name, model=MODEL, labels=dict(n.labels)))
        for workload in ("chat-stable", "chat-tidal"):
            server.add_object(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
                              {"apiVersion": "apps/v1", "kind": "Deployment",
                               "metadata": {"name": workload, "namespace": NAMESPACE},
                               "spec": {"replicas": 0, "selector": {"matchLabels": {"app": workload}}}})
        api = RestKubeApi.from_url(server.url, request_timeout_s=30)
        config = LeaseConfig("gpuplane-system", "gpuplane-operator", "parity", lease_duration_s=48 * HOUR,
                             renew_deadline_s=40 * HOUR, retry_period_s=60)
        self.operator = Operator(api, LeaseElector(api, config, self.now), self, load=self._load)
        self.agents: dict[str, NodeReporter] = {}
        self.posted = 0
        self.expected: dict[str, int] = {}
        """informer name → objects it must hold before the next tick"""
        self.placed: set[str] = set()
        self.gone: set[str] = set()
        self.replicas: dict[str, list[str]] = {}
        """Deployment → its pods, oldest first"""
        self.next_index = 0

    # the operator's clock (`port.Clock`)
    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        raise AssertionError("the operator schedules nothing")

    def _load(self, namespace: str, service: str) -> float:
        return load_at(self.t) * self.load_factor

    def add(self, arrival: Arrival) -> None:
        self.server.add_object(arrival.path, dict(arrival.obj))
        kind = str(arrival.obj["kind"])
        self.expected[kind] = self.expected.get(kind, 0) + 1

    def report(self, fault: Fault, node: str) -> NodeReport | None:
        agent = self.agents.get(node)
        if agent is None:
            agent = self.agents[node] = NodeReporter(self.server.api, node,
                                                     FailureClassifier(load_signature_library()), self.now)
        if fault.check_passed is not None:
            report = agent.checks([CheckResult("dcgm", fault.check_passed,
                                               "passed" if fault.check_passed else "diag level 1: PCIe replays")])
        elif fault.xid is not None:
            report = agent.xid(fault.xid)
        else:
            assert fault.line is not None
            report = agent.line(fault.line)
        if report is not None:
            self.posted += 1
        return report

    def _caught_up(self) -> None:
        """Wait until the operator's caches hold what the harness wrote behind its back."""
        deadline = time.monotonic() + 30
        while True:
            op = self.operator
            ready = op.cluster is not None and all(
                len(op.informers[kind].objects()) >= count for kind, count in self.expected.items()) and (
                len(op.informers["Event"].objects()) >= self.posted) and all(
                op.cluster.pods.get(pod) is not None for pod in self.placed) and all(
                op.cluster.pods.get(pod) is None for pod in self.gone) and (
                self._in_step(op.cluster.nodes, "nodes")) and self._in_step(op.cluster.pods, "pods")
            if ready or not op.informers:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the operator's informers did not catch up")
            time.sleep(0.005)

    def _in_step(self, informer: Informer, kind: str) -> bool:
        """Whether `informer` holds the server's objects of `kind` at their current versions: the operator's own
        writes of the last tick (a taint, an eviction) included, which it must see before it decides again."""
        held = {object_key(obj): resource_version(obj) for obj in informer.objects()}
        stored = {}
        for key in self.server.keys(kind):
            obj = self.server.get(kind, key)
            if obj is not None:
                stored[key] = resource_version(obj)
        return held == stored

    def tick(self) -> None:
        if self.operator.informers:
            self._caught_up()
        self.operator.tick()
        self.placed.clear()
        self.gone.clear()
        self._replicate()

    def _replicate(self) -> None:
        """The Deployment controller's part: as many (pending) pods as each Deployment's replicas; a scale-down
        removes the newest first (all are pending: no scheduler runs), as the simulator's workloads do."""
        for workload in ("chat-stable", "chat-tidal"):
            obj = self.server.get("deployments", f"{NAMESPACE}/{workload}")
            assert obj is not None
            want = int(obj["spec"].get("replicas") or 0)
            have = self.replicas.setdefault(workload, [])
            while len(have) < want:
                name = f"{workload}-{self.next_index}"
                self.next_index += 1
                self.server.add_pod(pod_json(name, namespace=NAMESPACE, limits={"nvidia.com/gpu": "1"},
                                             labels={WORKLOAD_LABEL: workload}))
                have.append(name)
                self.placed.add(f"{NAMESPACE}/{name}")
            while len(have) > want:
                name = have.pop()
                self.server.api.delete(pod_path(NAMESPACE, name))
                self.gone.add(f"{NAMESPACE}/{name}")

    def place(self, pod: str, node: str, *, gang: str | None, borrowed: bool) -> None:
        namespace, name = pod.split("/", 1)
        labels = {GANG_LABEL: gang} if gang else {}
        spec: dict[str, Any] = {"schedulerName": "gpuplane-scheduler", "nodeName": node,
                                "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}
        if borrowed:
            spec["nodeSelector"] = {POOL_LABEL: "training"}
            spec["tolerations"] = [{"key": LOAN_TAINT.key, "operator": "Equal", "value": LOAN_TAINT.value,
                                    "effect": LOAN_TAINT.effect}]
        self.server.add_pod({"apiVersion": "v1", "kind": "Pod",
                             "metadata": {"name": name, "namespace": namespace, "labels": labels,
                                          "annotations": {GANG_SIZE: "2"} if gang else {}},
                             "spec": spec, "status": {"phase": "Running"}})
        self.placed.add(pod)

    def snapshot(self) -> Snapshot:
        nodes: dict[str, dict[str, str]] = {}
        for key in self.server.keys("nodes"):
            obj = self.server.get("nodes", key)
            assert obj is not None
            meta = obj["metadata"]
            tainted = any(t.get("key") == QUARANTINE_TAINT.key for t in obj.get("spec", {}).get("taints") or [])
            nodes[key] = _node_view(meta.get("labels") or {}, tainted, meta.get("annotations") or {})
        replicas = {}
        for workload in ("chat-stable", "chat-tidal"):
            obj = self.server.get("deployments", f"{NAMESPACE}/{workload}")
            assert obj is not None
            replicas[f"{NAMESPACE}/{workload}"] = int(obj["spec"].get("replicas") or 0)
        pods = set()
        for key in self.server.keys("pods"):
            obj = self.server.get("pods", key)
            if obj is None or obj["metadata"].get("deletionTimestamp"):
                continue
            if WORKLOAD_LABEL not in (obj["metadata"].get("labels") or {}):
                pods.add(key)
        return Snapshot(nodes, replicas, pods)


# ---------------------------------------------------------------------------------------------- the owner
@dataclass(slots=True)
class Owner:
    """The training jobs' owner, the same on both sides: the gang (re-created as the next attempt on the first
    two healthy training nodes once its pods are gone) and a borrowed pod on each lent node while it is lent."""

    attempt: int = -1
    borrowed: set[str] = field(default_factory=set)

    def gang_pods(self) -> list[str]:
        return [f"{NAMESPACE}/train-a{self.attempt}-{i}" for i in range(2)]

    def act(self, snap: Snapshot) -> list[tuple[str, str, str | None, bool]]:
        """(pod, node, gang, borrowed) to place now, decided from the world's state only."""
        out: list[tuple[str, str, str | None, bool]] = []
        if not any(p in snap.pods for p in self.gang_pods()):
            healthy = sorted(n for n, v in snap.nodes.items()
                             if v["pool"] == "training" and v["tainted"] == "False" and not v["loan"])
            if len(healthy) >= 2:
                self.attempt += 1
                out += [(pod, node, "train", False) for pod, node in zip(self.gang_pods(), healthy, strict=False)]
        for node, view in sorted(snap.nodes.items()):
            if view["loan"] != "lent":
                self.borrowed.discard(node)
            elif node not in self.borrowed:
                self.borrowed.add(node)
                out.append((f"{NAMESPACE}/borrow-{node}", node, None, True))
        return out


# ---------------------------------------------------------------------------------------------- the run
def decisions(before: Snapshot, after: Snapshot, hour: float) -> list[Decision]:
    """What changed from `before` to `after` (the controllers' doing: the owner acts after the snapshot)."""
    out: list[Decision] = []
    for node, view in sorted(after.nodes.items()):
        old = before.nodes.get(node, {})
        out += [(hour, what, node, value) for what, value in sorted(view.items()) if old.get(what) != value]
    for workload, count in sorted(after.replicas.items()):
        if before.replicas.get(workload) != count:
            out.append((hour, "replicas", workload, str(count)))
    out += [(hour, "pod-gone", pod, "") for pod in sorted(before.pods - after.pods)]
    return out


@dataclass(frozen=True, slots=True)
class ParityResult:
    hours: float
    ticks: int
    sim: tuple[Decision, ...]
    kube: tuple[Decision, ...]
    wall_s: float

    @property
    def compared(self) -> int:
        return len(set(self.sim) | set(self.kube))

    @property
    def differences(self) -> tuple[tuple[str, Decision], ...]:
        return (tuple(("simulator only", d) for d in self.sim if d not in set(self.kube))
                + tuple(("operator only", d) for d in self.kube if d not in set(self.sim)))

    def counts(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for _, what, _, _ in self.sim:
            kinds[what] = kinds.get(what, 0) + 1
        return dict(sorted(kinds.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"hours": self.hours, "ticks": self.ticks, "decisions_compared": self.compared,
                "simulator_decisions": len(self.sim), "operator_decisions": len(self.kube),
                "differences": [{"side": side, "hour": d[0], "what": d[1], "subject": d[2], "value": d[3]}
                                for side, d in self.differences],
                "by_kind": self.counts(), "wall_s": round(self.wall_s, 2)}


@contextmanager
def _server() -> Iterator[FakeApiServer]:
    with FakeApiServer(bookmark_interval_s=0.05, keep_requests=False) as server:
        yield server


def _restarts(recovery: RecoveryController | None) -> list[Decision]:
    if recovery is None:
        return []
    return [(round((r.t - MIDNIGHT) / HOUR, 4), "restart", r.job, f"{r.cause} isolated={','.join(r.isolated)}")
            for r in recovery.history]


def run_parity(hours: float = 24.0, tick_s: float = 300.0, *, operator_load_factor: float = 1.0) -> ParityResult:
    """Run both worlds through `hours` of virtual time in ticks of `tick_s`; the decisions of each.
    `operator_load_factor` scales the load the operator reads (1: the same inputs; anything else is the check
    that the comparison sees a difference)."""
    started = time.perf_counter()
    ticks = round(hours * HOUR / tick_s)
    pending = sorted(arrivals(), key=lambda a: a.hour)
    faults = sorted(FAULTS, key=lambda f: f.hour)
    sim_log: list[Decision] = []
    kube_log: list[Decision] = []
    with _server() as server:
        sim, kube = SimWorld(), KubeWorld(server, operator_load_factor)
        owner_sim, owner_kube = Owner(), Owner()
        before_sim, before_kube = sim.snapshot(), kube.snapshot()
        try:
            for step in range(ticks + 1):
                t = MIDNIGHT + step * tick_s
                hour = round(step * tick_s / HOUR, 4)
                sim.loop.run(until=t)
                kube.t = t
                while pending and pending[0].hour * HOUR <= step * tick_s:
                    arrival = pending.pop(0)
                    sim.add(arrival)
                    kube.add(arrival)
                while faults and faults[0].hour * HOUR <= step * tick_s:
                    fault = faults.pop(0)
                    node = fault.node or _gang_node(sim, owner_sim)
                    if node is None:
                        continue
                    report = kube.report(fault, node)
                    if report is not None:
                        sim.reports.append(report)
                sim.tick()
                kube.tick()
                snap_sim, snap_kube = sim.snapshot(), kube.snapshot()
                sim_log += decisions(before_sim, snap_sim, hour)
                kube_log += decisions(before_kube, snap_kube, hour)
                for world, owner, snap in ((sim, owner_sim, snap_sim), (kube, owner_kube, snap_kube)):
                    for pod, node, gang, borrowed in owner.act(snap):
                        world.place(pod, node, gang=gang, borrowed=borrowed)
                before_sim, before_kube = sim.snapshot(), kube.snapshot()
            sim_log += _restarts(sim.recovery)
            kube_log += _restarts(kube.operator.recovery)
        finally:
            kube.operator.shutdown()
    return ParityResult(hours, ticks, tuple(sim_log), tuple(kube_log), time.perf_counter() - started)


def _gang_node(sim: SimWorld, owner: Owner) -> str | None:
    pod = sim.cluster.get_pod(owner.gang_pods()[1])
    return pod.assignment.node if pod is not None and pod.assignment is not None else None


def render(result: ParityResult) -> str:
    lines = [f"operator parity: {result.hours:g} h in {result.ticks} ticks ({result.wall_s:.1f} s wall)",
             f"  decisions compared: {result.compared} (simulator {len(result.sim)}, operator {len(result.kube)})",
             "  by kind (simulator): " + ", ".join(f"{k} {v}" for k, v in result.counts().items()),
             f"  differences: {len(result.differences)}"]
    lines += [f"    {side}: {d[0]:g} h {d[1]} {d[2]} = {d[3]!r}" for side, d in result.differences]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gpuplane.report.operator_parity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--tick", type=float, default=300.0, help="virtual seconds per tick")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run_parity(args.hours, args.tick)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    return 0 if not result.differences else 1


if __name__ == "__main__":
    raise SystemExit(main())

