"""The tidal controller: shrink inference at night, lend its emptied nodes to training, take them back in time.

It acts only through the cluster port and reads time from an injected clock, so the same code runs in
virtual time in the simulator and, later, against Kubernetes.

- Each service runs as two workloads, its stable subset (`<svc>-stable`, pinned to the stable nodes, always
  `min_replicas`) and its tidal subset (`<svc>-tidal`, on loanable nodes, the rest), as OpenKruise
  WorkloadSpread does; so scale-down always takes tidal replicas.
- Replicas = max(the window plan's floor, what the load forecast needs), within [min, max]. Each pass first
  shows the forecast every service's load from the load source (`gpuplane.controllers.forecast`: in the
  simulator a 1-minute rate, in a cluster Prometheus through the operator); the forecast learns from that
  history only.
- Before a scale-down it writes `pod-deletion-cost` on the tidal replicas so that pods on the nodes with
  the fewest pods go first (`DrainOrder.FEWEST_INSTANCES`): whole nodes empty fastest.
- From `lend_from`, an emptied tidal node is lent: its pool becomes the training pool, it is labelled and
  tainted for training (inference pods cannot go there), and the loan is written on the node (annotation)
  and in the ledger. The planned reclaim time is annotated too, so training checkpoints ahead of it.
  Offline work co-located on a tidal node (a pod whose QoS is not online, e.g. near-line batch on the cards
  the services left) does not keep it from emptying: drain costs count online pods only, and when the node
  is lent its offline pods are evicted (`LEND_REASON`, the reclaim grace, for a final checkpoint). One a
  disruption budget held back is evicted again each pass while the node is lent.
- At `reclaim_at`, or at once when the forecast needs more than the unlent nodes hold, training pods on lent
  nodes are evicted with a grace period for a final checkpoint and the nodes return to inference. A node
  reclaimed now serves only after that grace, so lending and reclaiming look `forecast_horizon_s +
  reclaim_grace_s` ahead (scaling looks `forecast_horizon_s` ahead).
- After a restart the ledger is rebuilt from the nodes' annotations: no node is lent twice or forgotten.

Sharing the services with another scaler (`replicas=`, e.g. the GPU scaler's `ScaledObjectScaler.desired`
per service): that scaler decides each service's replica count, as an HPA on the service's one workload
would, and this controller does what WorkloadSpread and CronHPA do around it:
- it splits the count between the stable and the tidal workload (stable `min(min_replicas, count)`, the
  rest tidal): the other scaler scales no subset itself;
- the policy's floor wins: the count is raised to the phase's floor (`day_floor` by day, the window's
  `night_replicas` at night, never below `min_replicas`) and capped at `max_replicas`, so the scaler cannot
  take a service under its night floor while its nodes are lent, nor above the policy's maximum;
- lending and reclaiming look at the larger of that count and the forecast's (`forecast_horizon_s +
  reclaim_grace_s` ahead): a scaler that scales up at night reclaims lent nodes early, and so does a rise
  the forecast sees coming before the scaler does;
- a service whose count is unknown (the reader answers None: not read yet) is scaled from the forecast,
  as without a reader.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gpuplane.controllers.forecast import LoadForecast, LoadSource
from gpuplane.model import MILLI_PER_CARD, QoS, Taint
from gpuplane.model.tidal import Loan, TidalPolicy, TidalService, TidalWindow
from gpuplane.port import DELETION_COST, ClusterPort, Code, NodeInfo, PodInfo, PodPhase

SUBSET_LABEL = "gpuplane.io/tidal-subset"
"""Node label set by the operator: `stable` (never lent) or `tidal` (loanable)."""
LOAN_LABEL = "gpuplane.io/tidal-loan"
LOAN_ANNOTATION = "gpuplane.io/tidal-loan"
RECLAIM_ANNOTATION = "gpuplane.io/tidal-reclaim-at"
LOAN_TAINT = Taint("gpuplane.io/tidal", "lent", "NoSchedule")
"""On lent nodes: inference pods do not tolerate it, training pods do."""
RECLAIM_REASON = "tidal reclaim"
"""The eviction reason of training pods on a lent node taken back at the window's end."""
EARLY_RECLAIM_REASON = "tidal early reclaim"
"""The eviction reason when the forecast needs a lent node back before the window ends."""
LEND_REASON = "tidal lend"
"""The eviction reason of offline work co-located on a tidal node when the node is lent."""


class DrainOrder(enum.Enum):
    """Which replicas a scale-down removes first."""

    FEWEST_INSTANCES = "fewest-instances"
    """Pods on the nodes that hold the fewest pods (pod-deletion-cost = pods on the node)."""
    NEWEST = "newest"
    """Kubernetes' default: the newest pods."""
    RANDOM = "random"


def drain_costs(pods_by_node: Mapping[str, Sequence[str]], removable: Iterable[str], order: DrainOrder,
                rng: np.random.Generator | None = None) -> dict[str, int]:
    """pod-deletion-cost per removable pod (lower goes first) for `order`; NEWEST writes no costs.

    FEWEST_INSTANCES gives every pod of a node the node's rank by (pods on the node, node name)."""
    candidates = set(removable)
    if order is DrainOrder.NEWEST:
        return {}
    if order is DrainOrder.RANDOM:
        generator = rng if rng is not None else np.random.default_rng(0)
        names = sorted(candidates)
        return {name: int(v) for name, v in zip(names, generator.permutation(len(names)), strict=True)}
    # One cost per node, by (pods on it, name): pods of a node go together, fewest-pod nodes first, and
    # nodes with equal counts do not interleave (they would empty none).
    holding = [node for node, pods in pods_by_node.items() if candidates.intersection(pods)]
    ranked = sorted(holding, key=lambda node: (len(pods_by_node[node]), node))
    return {pod: rank for rank, node in enumerate(ranked) for pod in pods_by_node[node] if pod in candidates}


def nodes_emptied(pods_by_node: Mapping[str, Sequence[str]], removal_order: Sequence[str], count: int) -> int:
    """How many nodes hold no pod after removing the first `count` pods of `removal_order`."""
    gone = set(removal_order[:count])
    return sum(1 for pods in pods_by_node.values() if pods and all(p in gone for p in pods))


def removal_order(pods_by_node: Mapping[str, Sequence[str]], removable: Sequence[str], order: DrainOrder,
                  rng: np.random.Generator | None = None) -> list[str]:
    """The order a scale-down takes `removable` (given newest last) under `order`: ascending cost, then newest."""
    costs = drain_costs(pods_by_node, removable, order, rng)
    position = {pod: i for i, pod in enumerate(removable)}
    return sorted(removable, key=lambda p: (costs.get(p, 0), -position[p]))


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    """How a policy's service maps onto the world: its two workloads and the load one replica serves."""

    name: str
    per_replica_capacity: float
    gpu_milli_per_replica: int

    @property
    def stable_workload(self) -> str:
        return f"{self.name}-stable"

    @property
    def tidal_workload(self) -> str:
        return f"{self.name}-tidal"


@dataclass(slots=True)
class DrainRecord:
    """One scale-down: nodes the chosen order emptied against the naive orders (same pods, same count)."""

    time: float
    removed: int
    emptied: dict[str, int]


@dataclass(slots=True)
class TidalStats:
    loans: int = 0
    reclaims: int = 0
    early_reclaims: int = 0
    training_pods_evicted: int = 0
    evictions_held: int = 0
    """Reclaim evictions a disruption budget held back (answered PENDING); they are retried every pass."""
    offline_pods_displaced: int = 0
    """Co-located offline pods evicted from nodes as they were lent."""
    load_misses: int = 0
    """Load readings the load source could not give (the forecast kept its history)."""
    drains: list[DrainRecord] = field(default_factory=list)


class TidalController:
    def __init__(self, port: ClusterPort, policy: TidalPolicy, services: Sequence[ServiceBinding],
                 forecast: LoadForecast, now: Callable[[], float], *, load: LoadSource | None = None,
                 lend: bool = True, drain_order: DrainOrder = DrainOrder.FEWEST_INSTANCES,
                 training_pool: str = "training", tidal_pool: str = "inference-tidal",
                 forecast_horizon_s: float = 1800.0, seed: int = 0,
                 replicas: Callable[[str], int | None] | None = None) -> None:
        """`replicas`: another scaler's replica count per service (the whole service's; None: unknown); without
        it this controller scales every service from its forecast."""
        self.port = port
        self.policy = policy
        self.services = {s.name: s for s in services}
        policy.check_services(self.services)
        self.forecast = forecast
        self.load = load
        self.now = now
        self.lend = lend
        self.drain_order = drain_order
        self.training_pool = training_pool
        self.tidal_pool = tidal_pool
        self.forecast_horizon_s = forecast_horizon_s
        self.replicas = replicas
        self.rng = np.random.default_rng(seed)
        self.stats = TidalStats()
        self.history: list[Loan] = []
        self.ledger: dict[str, Loan] = self._rebuild_ledger()

    # ------------------------------------------------------------------ ledger
    def _rebuild_ledger(self) -> dict[str, Loan]:
        """The loans the nodes carry: the ledger survives a controller restart through the world."""
        ledger: dict[str, Loan] = {}
        for node in self.port.list_nodes():
            note = dict(node.annotations).get(LOAN_ANNOTATION)
            if note is None:
                continue
            record = json.loads(note)
            ledger[node.name] = Loan(node.name, float(record["since"]), str(record["window"]))
        return ledger

    # ------------------------------------------------------------------ loop
    def reconcile(self) -> None:
        """One pass: scale every service (from the other scaler's count where there is one), lend empty nodes in
        the window, reclaim when due."""
        t = self.now()
        self._observe(t)
        window, phase = self.policy.window_at(t)
        nodes = list(self.port.list_nodes())
        pods = list(self.port.list_pods())
        for name in self._strays(nodes, pods):  # reclaim evictions a disruption budget held back
            self._evict(name, RECLAIM_REASON)
        for name in self._lodgers(pods):  # offline pods on lent nodes whose lending eviction was held back
            self._evict(name, LEND_REASON)
        by_workload: dict[str, list[PodInfo]] = {}
        for pod in pods:
            if pod.request.workload is not None:
                by_workload.setdefault(pod.request.workload, []).append(pod)
        targets = {spec.name: self._target(spec, t, window, phase) for spec in self.policy.services}
        for spec in self.policy.services:
            self._scale(spec, targets[spec.name], by_workload, pods)
        if not self.lend:
            return
        # A reclaimed node serves only after its training pods' grace: look that much further ahead for it.
        # Shared with another scaler: its count now counts too (it may be above what the forecast sees).
        ahead = {spec.name: max(self._target(spec, t, window, phase,
                                             self.forecast_horizon_s + self.policy.reclaim_grace_s, own=True),
                                targets[spec.name] if self.replicas is not None else 0)
                 for spec in self.policy.services}
        short = self._shortfall_milli(ahead, nodes)
        if self.ledger and phase == "day":
            self._reclaim(list(self.ledger), early=False)
        elif self.ledger and short > 0:
            self._reclaim(self._cheapest_loans(short, nodes), early=True)
        elif phase == "lend" and window is not None and short < 0:
            self._lend_empty(window, t, -short)

    def target_replicas(self, name: str, t: float | None = None) -> int:
        t = self.now() if t is None else t
        window, phase = self.policy.window_at(t)
        return self._target(self.policy.service(name), t, window, phase)

    def _observe(self, t: float) -> None:
        """Feed the forecast each service's load now, from the load source (when there is one)."""
        if self.load is None:
            return
        for name in self.services:
            value = self.load(name)
            if value is None:
                self.stats.load_misses += 1
            else:
                self.forecast.observe(name, t, value)

    def _need(self, spec: TidalService, t: float, horizon_s: float) -> int:
        binding = self.services[spec.name]
        peak = self.forecast.peak_over(spec.name, t, horizon_s)
        return math.ceil(peak / binding.per_replica_capacity) if peak > 0 else 0

    def _target(self, spec: TidalService, t: float, window: TidalWindow | None, phase: str,
                horizon_s: float | None = None, *, own: bool = False) -> int:
        """The phase's floor raised to the other scaler's count (unless `own`, or the count is unknown), else to
        what the forecast needs over `horizon_s`; within the maximum."""
        if window is None or phase == "day":
            floor = max(spec.min_replicas, spec.day_floor)
        else:
            floor = max(spec.min_replicas, window.night_replicas.get(spec.name, spec.min_replicas))
        given = None if own or self.replicas is None else self.replicas(spec.name)
        if given is None:
            horizon = self.forecast_horizon_s if horizon_s is None else horizon_s
            given = self._need(spec, t, horizon)
        return min(spec.max_replicas, max(floor, given))

    # ------------------------------------------------------------------ scaling
    def _scale(self, spec: TidalService, target: int, by_workload: Mapping[str, Sequence[PodInfo]],
               pods: Sequence[PodInfo]) -> None:
        binding = self.services[spec.name]
        stable = min(spec.min_replicas, target)
        self.port.scale(binding.stable_workload, stable)
        tidal = target - stable
        members = [p for p in by_workload.get(binding.tidal_workload, ())
                   if p.phase in (PodPhase.PENDING, PodPhase.RUNNING)]
        if len(members) == tidal:
            return
        running = [p for p in members if p.phase is PodPhase.RUNNING and p.assignment is not None]
        pending = len(members) - len(running)
        removed = len(members) - tidal
        if removed > pending and running:
            self._mark_for_drain(running, removed - pending, pods)
        self.port.scale(binding.tidal_workload, tidal)

    def _mark_for_drain(self, running: Sequence[PodInfo], count: int, pods: Sequence[PodInfo]) -> None:
        by_node: dict[str, list[str]] = {}
        for pod in pods:  # offline work co-located there leaves when the node is lent: it does not count
            if pod.assignment is not None and pod.phase is PodPhase.RUNNING and pod.request.qos is QoS.ONLINE:
                by_node.setdefault(pod.assignment.node, []).append(pod.name)
        # Oldest first, as created: NEWEST removes from the end.
        names = [p.name for p in sorted(running, key=lambda p: (p.created_at, p.request.instance or 0))]
        emptied = {order.value: nodes_emptied(by_node, removal_order(by_node, names, order, self.rng), count)
                   for order in DrainOrder}
        self.stats.drains.append(DrainRecord(self.now(), count, emptied))
        costs = drain_costs(by_node, names, self.drain_order, self.rng)
        for name in names:
            self.port.patch_pod(name, annotations={DELETION_COST: str(costs[name]) if name in costs else None})

    # ------------------------------------------------------------------ lending
    def _lend_empty(self, window: TidalWindow, t: float, room_milli: int) -> None:
        """Lend empty tidal nodes while the unlent ones still hold what the forecast needs (with headroom)."""
        busy: set[str] = set()
        offline: dict[str, list[str]] = {}
        for p in self.port.list_pods():
            if p.assignment is None or p.phase not in (PodPhase.RUNNING, PodPhase.TERMINATING):
                continue
            if p.request.qos is QoS.ONLINE:
                busy.add(p.assignment.node)
            elif p.phase is PodPhase.RUNNING:
                offline.setdefault(p.assignment.node, []).append(p.name)
        reclaim_at = window.next_reclaim(t)
        keep = 1.0 - self.policy.reclaim_headroom
        for node in self.port.list_nodes():
            size = node.spec.gpus * MILLI_PER_CARD
            if size * keep > room_milli:
                continue
            labels = dict(node.spec.labels)
            if labels.get(SUBSET_LABEL) != "tidal" or node.name in self.ledger or node.name in busy:
                continue
            if LOAN_LABEL in labels or node.spec.pool == self.training_pool:
                continue  # lent already (by a controller whose ledger we have not seen): never lend twice
            loan = Loan(node.name, t, window.name)
            note = json.dumps({"since": t, "window": window.name, "home_pool": node.spec.pool})
            status = self.port.patch_node(
                node.name, labels={LOAN_LABEL: "lent"}, taints=(*node.spec.taints, LOAN_TAINT),
                annotations={LOAN_ANNOTATION: note, RECLAIM_ANNOTATION: f"{reclaim_at:.0f}"}, pool=self.training_pool)
            if status.ok:
                self.ledger[node.name] = loan
                self.stats.loans += 1
                room_milli -= int(size * keep)
                for pod in offline.get(node.name, ()):  # tainted first, so nothing offline lands there again
                    self._evict(pod, LEND_REASON)

    def _reclaim(self, names: Sequence[str], *, early: bool) -> None:
        if not names:
            return
        targets = set(names)
        for pod in self.port.list_pods():
            if pod.assignment is not None and pod.assignment.node in targets and pod.phase is PodPhase.RUNNING:
                self._evict(pod.name, EARLY_RECLAIM_REASON if early else RECLAIM_REASON)
        by_name = {n.name: n for n in self.port.list_nodes()}
        for name in names:
            node = by_name.get(name)
            loan = self.ledger.pop(name, None)
            if node is None or loan is None:
                continue
            taints = tuple(t for t in node.spec.taints if t != LOAN_TAINT)
            self.port.patch_node(name, labels={LOAN_LABEL: None}, taints=taints,
                                 annotations={LOAN_ANNOTATION: None, RECLAIM_ANNOTATION: None}, pool=self.tidal_pool)
            self.history.append(replace(loan, returned=self.now(), early=early))
            self.stats.reclaims += 1
            self.stats.early_reclaims += early

    def _evict(self, pod: str, reason: str) -> None:
        status = self.port.evict(pod, grace_s=self.policy.reclaim_grace_s, reason=reason)
        if status.ok and reason == LEND_REASON:
            self.stats.offline_pods_displaced += 1
        elif status.ok:
            self.stats.training_pods_evicted += 1
        elif status.code is Code.PENDING:  # a disruption budget forbids it now: `_strays` finds it next pass
            self.stats.evictions_held += 1

    def _lodgers(self, pods: Sequence[PodInfo]) -> list[str]:
        """Offline pods still running on lent nodes that do not tolerate the loan's taint (co-located work whose
        lending eviction was held back). Derived from the world, as `_strays` is."""
        return [p.name for p in pods
                if p.phase is PodPhase.RUNNING and p.assignment is not None and p.assignment.node in self.ledger
                and p.request.qos is not QoS.ONLINE
                and not p.request.tolerates(LOAN_TAINT.key, LOAN_TAINT.value, LOAN_TAINT.effect)]

    def _strays(self, nodes: Sequence[NodeInfo], pods: Sequence[PodInfo]) -> list[str]:
        """Training pods still running on tidal nodes that are home again (their eviction was held back).

        Derived from the world, not remembered, so a restarted controller finds them too."""
        home = {n.name for n in nodes
                if dict(n.spec.labels).get(SUBSET_LABEL) == "tidal" and n.name not in self.ledger}
        return [p.name for p in pods
                if p.phase is PodPhase.RUNNING and p.assignment is not None and p.assignment.node in home
                and p.request.pools is not None and self.training_pool in p.request.pools
                and self.tidal_pool not in p.request.pools]

    # ------------------------------------------------------------------ early reclaim
    def _shortfall_milli(self, targets: Mapping[str, int], nodes: Sequence[NodeInfo]) -> int:
        """GPU milli the tidal subsets need at their `targets` beyond what unlent tidal nodes hold, with the
        policy's headroom (positive: reclaim now)."""
        need = sum(max(0, targets[spec.name] - spec.min_replicas) * self.services[spec.name].gpu_milli_per_replica
                   for spec in self.policy.services)
        have = sum(n.spec.gpus * MILLI_PER_CARD for n in nodes
                   if dict(n.spec.labels).get(SUBSET_LABEL) == "tidal" and n.name not in self.ledger)
        return math.ceil(need - have * (1.0 - self.policy.reclaim_headroom))

    def _cheapest_loans(self, short_milli: int, nodes: Sequence[NodeInfo]) -> list[str]:
        """Lent nodes to take back for `short_milli`, cheapest to preempt first (fewest training pods)."""
        load: dict[str, int] = {}
        for pod in self.port.list_pods():
            if pod.assignment is not None and pod.assignment.node in self.ledger:
                load[pod.assignment.node] = load.get(pod.assignment.node, 0) + 1
        gpus = {n.name: n.spec.gpus * MILLI_PER_CARD for n in nodes}
        chosen: list[str] = []
        freed = 0
        for name in sorted(self.ledger, key=lambda n: (load.get(n, 0), n)):
            if freed >= short_milli / (1.0 - self.policy.reclaim_headroom):
                break
            chosen.append(name)
            freed += gpus.get(name, 0)
        return chosen
