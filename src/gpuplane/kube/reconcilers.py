"""The operator's reconcilers that act through any cluster port: the operator runs them on `KubeCluster`, the
operator-parity run (`gpuplane.report.operator_parity`) on `SimCluster` too, so both worlds take one decision path.

- `apply_pool_plan`: label the nodes a `pools.plan_pools` plan moves (`gpuplane.io/pool`).
- `ColocationDistributor`: which ColocationPolicy governs each node, written on the node as annotation
  `gpuplane.io/colocation-policy` (`namespace/name`; `conflict: a, b` when several select it; absent when none).
  The node guard reads the policies themselves (`gpuplane.node.node_policy`, with the same selection rule); the
  annotation is the cluster-wide view of what each guard applies, and what `kubectl get node -o yaml` shows.
- `RecoveryFeed`: adopts every gang it sees (`PodRequest.gang`: the pod-group label) into the
  `RecoveryController`, restarting by deleting the gang's pods (its owner, the Job/JobSet controller,
  re-creates them), and hands the node agents' reports to it (failures) and to the `NodeHealthController`
  (health-check tiers).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from gpuplane.controllers.health import NodeHealthController
from gpuplane.controllers.recovery import AdoptedGang, CheckpointPlanner, Evidence, RecoveryController, RecoveryOutcome
from gpuplane.kube.node_reports import NodeReport
from gpuplane.kube.objects import POOL_LABEL, selects
from gpuplane.kube.pools import PoolPlan
from gpuplane.model import NodeSpec
from gpuplane.port import ClusterPort, PodPhase

log = logging.getLogger(__name__)

COLOCATION_ANNOTATION = "gpuplane.io/colocation-policy"


def apply_pool_plan(port: ClusterPort, plan: PoolPlan, specs: Mapping[str, NodeSpec]) -> dict[str, dict[str, str]]:
    """Write the plan's label changes; returns pool → node → why its label could not be written."""
    failed: dict[str, dict[str, str]] = {}
    for node, target in plan.changes.items():
        if target is not None:
            status = port.patch_node(node, pool=target)
        else:
            status = port.patch_node(node, labels={POOL_LABEL: None})
        if not status.ok:
            pool = target if target is not None else dict(specs[node].labels).get(POOL_LABEL, "")
            log.warning("GpuPool %s: %s node %s failed: %s", pool, "labelling" if target else "unlabelling",
                        node, status.message)
            failed.setdefault(pool, {})[node] = status.message
    return failed


def plan_colocation(policies: Mapping[str, Mapping[str, str]], nodes: Sequence[NodeSpec]) -> dict[str, str | None]:
    """Per node, the one policy (key → its node selector) that selects it, `conflict: a, b` when several do,
    None when none does."""
    plan: dict[str, str | None] = {}
    for spec in nodes:
        labels = dict(spec.labels)
        chosen = sorted(key for key, selector in policies.items() if selects(selector, labels))
        plan[spec.name] = None if not chosen else chosen[0] if len(chosen) == 1 else "conflict: " + ", ".join(chosen)
    return plan


class ColocationDistributor:
    """Writes `plan_colocation` on the nodes, only where the annotation differs."""

    def __init__(self, port: ClusterPort) -> None:
        self.port = port

    def reconcile(self, policies: Mapping[str, Mapping[str, str]]) -> dict[str, str | None]:
        nodes = list(self.port.list_nodes())
        plan = plan_colocation(policies, [n.spec for n in nodes])
        for info in nodes:
            target = plan[info.name]
            if dict(info.annotations).get(COLOCATION_ANNOTATION) != target:
                status = self.port.patch_node(info.name, annotations={COLOCATION_ANNOTATION: target})
                if not status.ok:
                    log.warning("node %s: writing its co-location policy failed: %s", info.name, status.message)
        return plan


class RecoveryFeed:
    """The recovery and node-health controllers, fed from the cluster and the node agents' reports."""

    def __init__(self, recovery: RecoveryController, health: NodeHealthController, *,
                 prior_rate_per_node_day: float = 0.004) -> None:
        self.recovery = recovery
        self.health = health
        self.prior_rate_per_node_day = prior_rate_per_node_day

    def adopt_gangs(self) -> list[str]:
        """Adopt every gang a live pod names that is not watched yet; returns the new ones."""
        new: dict[str, int] = {}
        for pod in self.recovery.port.list_pods():
            gang = pod.request.gang
            if gang is None or gang in self.recovery.adopted or gang in self.recovery.jobs:
                continue
            if pod.phase in (PodPhase.PENDING, PodPhase.RUNNING):
                new[gang] = max(new.get(gang, 0), pod.request.gang_size)
        for gang, size in sorted(new.items()):
            self.recovery.adopt(AdoptedGang(gang, CheckpointPlanner(size, self.prior_rate_per_node_day), gang=gang))
        return sorted(new)

    def handle(self, reports: Sequence[NodeReport]) -> dict[str, RecoveryOutcome]:
        """Health tiers to the health controller, in order; then every failure report's evidence at once to
        the recovery controller (one incident per gang). Returns the recovery outcomes per gang."""
        evidence: list[Evidence] = []
        for report in reports:
            if report.kind == "health" and report.health_event is not None:
                self.health.apply(report.node, report.health_event, f"{report.reason}: {report.message}")
            elif report.kind == "failure":
                evidence.extend(report.evidence)
        return self.recovery.on_node_evidence(evidence) if evidence else {}
