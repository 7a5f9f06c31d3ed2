"""Node lifecycle through the cluster port: cordon → drain (honouring disruption budgets) → repair → probation → return.

Driven by the health state machine (`gpuplane.controllers.health`): a node the book holds QUARANTINED is
cordoned and drained; once no pod runs on it the book moves it to REPAIRING and the `Repairer` is started;
a repair that succeeds moves it to PROBATION (uncordoned, the quarantine taint lifted, `gpuplane.io/health=
probation` kept, so large jobs stay off it), one that fails sends it back to QUARANTINED (and round again);
a probation served moves it to HEALTHY (the label removed). Every step is written on the node as the
`gpuplane.io/lifecycle` annotation (`{"step", "t", "detail"}`) and appended to `gpuplane.io/lifecycle-history`
(the last `HISTORY_KEEP` steps), so a dashboard or `kubectl describe node` shows where each node stands.

Drain evicts through the port. An eviction the port answers PENDING (a PodDisruptionBudget forbids it now) is
not an error: the node stays in `drain-blocked` with the pods named, and the next `step` tries again. The
controller keeps no state of its own beyond the book: a new leader rebuilds the book from the nodes' health
labels (`NodeHealthController.rebuild`) and carries on from there. A leader killed between two writes of one
pass leaves the book's state (the health label) ahead of the node's step; the next leader finishes what that step
had left (the cordon's step, the repair request, the taint lifted and the uncordon of probation, the return's
step), so each step is written once and none is skipped.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuplane.controllers.health import HEALTH_LABEL, HealthEvent, NodeHealth, NodeHealthController
from gpuplane.port import ClusterPort, NodeInfo, PodPhase
from gpuplane.port.status import Code

__all__ = [
    "HISTORY_KEEP", "LIFECYCLE_ANNOTATION", "LIFECYCLE_HISTORY", "InstantRepair", "LifecycleRecord",
    "LifecycleStep", "NodeLifecycleController", "Repairer", "lifecycle_of",
]

LIFECYCLE_ANNOTATION = "gpuplane.io/lifecycle"
"""The node's current lifecycle step: JSON `{"step": ..., "t": seconds, "detail": ...}`."""
LIFECYCLE_HISTORY = "gpuplane.io/lifecycle-history"
"""The node's last `HISTORY_KEEP` steps, oldest first: a JSON list of the same objects."""
HISTORY_KEEP = 20


class LifecycleStep(enum.Enum):
    CORDONED = "cordoned"
    """Marked unschedulable: nothing new lands on it."""
    DRAINING = "draining"
    """Evictions sent for the pods still on it."""
    DRAIN_BLOCKED = "drain-blocked"
    """A disruption budget refused some evictions; retried on the next pass."""
    DRAINED = "drained"
    REPAIRING = "repairing"
    REPAIR_FAILED = "repair-failed"
    """Back to quarantine; the next pass starts another repair."""
    PROBATION = "probation"
    """Uncordoned, small jobs only, until the policy's probation is served."""
    RETURNED = "returned"
    """Healthy and in service."""


@dataclass(frozen=True, slots=True)
class LifecycleRecord:
    t: float
    node: str
    step: LifecycleStep
    detail: str = ""

    def json(self) -> dict[str, object]:
        return {"step": self.step.value, "t": self.t, "detail": self.detail}


class Repairer(Protocol):
    """What repairs a node (a reset, a reboot, an RMA ticket and the admission suite after it)."""

    def start(self, node: str) -> None:
        """Begin repairing `node` (idempotent: a repair under way carries on)."""
        ...

    def poll(self, node: str) -> bool | None:
        """None while the repair runs; True when it is done and the node passed admission; False when it failed."""
        ...


class InstantRepair:
    """A `Repairer` that finishes on the first poll; `fail` names nodes whose next repair fails (once each)."""

    def __init__(self, fail: Sequence[str] = ()) -> None:
        self.fail = list(fail)
        self.started: list[str] = []

    def start(self, node: str) -> None:
        self.started.append(node)

    def poll(self, node: str) -> bool | None:
        if node in self.fail:
            self.fail.remove(node)
            return False
        return True


def lifecycle_of(node: NodeInfo) -> LifecycleRecord | None:
    """The step a node carries in its annotation (None: never through the lifecycle, or unreadable)."""
    raw = dict(node.annotations).get(LIFECYCLE_ANNOTATION)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        return LifecycleRecord(float(doc["t"]), node.name, LifecycleStep(doc["step"]), str(doc.get("detail", "")))
    except (ValueError, KeyError, TypeError):
        return None


class NodeLifecycleController:
    """Moves every node the health book holds out of service through the lifecycle, one `step` at a time.

    `step()` is one pass (call it every few seconds, on the leader only); it returns the records it wrote.
    Drain evicts with `grace_s` and the reason `node drain: <health reason>`; evictions are sent once per pass
    for the pods not already terminating."""

    def __init__(self, port: ClusterPort, health: NodeHealthController, repairer: Repairer,
                 now: Callable[[], float] | None = None, *, grace_s: float = 30.0) -> None:
        self.port = port
        self.health = health
        self.repairer = repairer
        self.now = now if now is not None else health.now
        self.grace_s = grace_s
        self.records: list[LifecycleRecord] = []
        """Every step written, in order."""

    def step(self) -> list[LifecycleRecord]:
        written: list[LifecycleRecord] = []
        nodes = {n.name: n for n in self.port.list_nodes()}
        for name in sorted(nodes):
            state = self.health.book.state(name)
            if state is NodeHealth.QUARANTINED:
                self._quarantined(nodes[name], written)
            elif state is NodeHealth.REPAIRING:
                self._repairing(nodes[name], written)
            elif state is NodeHealth.PROBATION:
                self._probation(nodes[name], written)
            elif state is NodeHealth.HEALTHY:
                self._healthy(nodes[name], written)
        return written

    # -- the steps ------------------------------------------------------------------------------------------

    def _quarantined(self, node: NodeInfo, written: list[LifecycleRecord]) -> None:
        name = node.name
        current = lifecycle_of(node)
        if node.spec.schedulable:
            if self.port.patch_node(name, unschedulable=True).ok:
                self._record(node, LifecycleStep.CORDONED, "unschedulable", written)
        elif current is None or current.step in (LifecycleStep.PROBATION, LifecycleStep.RETURNED):
            # cordoned, by a leader that died before it wrote the step (or by hand): this round's first step
            self._record(node, LifecycleStep.CORDONED, "unschedulable", written)
        on_node = [p for p in self.port.list_pods()
                   if p.assignment is not None and p.assignment.node == name
                   and p.phase in (PodPhase.RUNNING, PodPhase.PENDING, PodPhase.TERMINATING)]
        if not on_node:
            self._record(node, LifecycleStep.DRAINED, "no pods left", written)
            result = self.health.apply(name, HealthEvent.REPAIR_STARTED, "lifecycle: drained")
            if result.ok:
                self.repairer.start(name)
                self._record(node, LifecycleStep.REPAIRING, "repair started", written)
            return
        blocked: list[str] = []
        failed: list[str] = []
        sent = 0
        reason = f"node drain: {dict(node.spec.labels).get(HEALTH_LABEL, 'quarantined')}"
        for pod in sorted(on_node, key=lambda p: p.name):
            if pod.phase is PodPhase.TERMINATING:
                continue
            status = self.port.evict(pod.name, grace_s=self.grace_s, reason=reason)
            if status.code is Code.PENDING:
                blocked.append(pod.name)
            elif not status.ok:
                failed.append(pod.name)
            else:
                sent += 1
        if blocked or failed:
            detail = "; ".join(part for part in (
                f"budget refused {', '.join(blocked)}" if blocked else "",
                f"eviction failed {', '.join(failed)}" if failed else "") if part)
            self._record(node, LifecycleStep.DRAIN_BLOCKED, detail, written)
        else:
            waiting = len(on_node) - sent
            self._record(node, LifecycleStep.DRAINING, f"{sent} evicted, {waiting} terminating", written)

    def _repairing(self, node: NodeInfo, written: list[LifecycleRecord]) -> None:
        name = node.name
        current = lifecycle_of(node)
        if current is None or current.step is not LifecycleStep.REPAIRING:
            # the book moved, but the leader died before it asked for the repair or wrote the step
            self.repairer.start(name)
            self._record(node, LifecycleStep.REPAIRING, "repair started", written)
            return
        done = self.repairer.poll(name)
        if done is None:
            return
        if not done:
            self.health.apply(name, HealthEvent.CHECK_FAILED, "lifecycle: repair failed")
            self._record(node, LifecycleStep.REPAIR_FAILED, "back to quarantine", written)
            return
        result = self.health.apply(name, HealthEvent.REPAIR_DONE, "lifecycle: repaired")
        if result.ok:
            self._to_probation(node, written)

    def _to_probation(self, node: NodeInfo, written: list[LifecycleRecord]) -> None:
        self.health.release(node.name, label=NodeHealth.PROBATION.value)
        self.port.patch_node(node.name, unschedulable=False)
        self._record(node, LifecycleStep.PROBATION, "uncordoned, small jobs only", written)

    def _probation(self, node: NodeInfo, written: list[LifecycleRecord]) -> None:
        name = node.name
        current = lifecycle_of(node)
        if current is not None and current.step is not LifecycleStep.PROBATION:
            # the book moved, but the leader died before it lifted the taint, uncordoned or wrote the step
            self._to_probation(node, written)
            return
        if not node.spec.schedulable and current is not None:
            self.port.patch_node(name, unschedulable=False)  # cordoned again by hand: probation takes small jobs
        if not self.health.book.probation_over(name, self.now()):
            return
        result = self.health.apply(name, HealthEvent.PROBATION_PASSED, "lifecycle: probation served")
        if result.ok:
            self._record(node, LifecycleStep.RETURNED, "in service", written)

    def _healthy(self, node: NodeInfo, written: list[LifecycleRecord]) -> None:
        current = lifecycle_of(node)
        if current is not None and current.step is LifecycleStep.PROBATION:
            # probation served and the label removed by a leader that died before it wrote the step
            self._record(node, LifecycleStep.RETURNED, "in service", written)

    # -- the annotation -------------------------------------------------------------------------------------

    def _record(self, node: NodeInfo, step: LifecycleStep, detail: str, written: list[LifecycleRecord]) -> None:
        """Write the step on the node unless it already carries that step with that detail."""
        current = lifecycle_of(node)
        if current is not None and current.step is step and current.detail == detail:
            return
        record = LifecycleRecord(self.now(), node.name, step, detail)
        fresh = next((n for n in self.port.list_nodes() if n.name == node.name), node)
        try:
            history = json.loads(dict(fresh.annotations).get(LIFECYCLE_HISTORY, "[]"))
            if not isinstance(history, list):
                history = []
        except ValueError:
            history = []
        history = [*history, record.json()][-HISTORY_KEEP:]
        status = self.port.patch_node(node.name, annotations={
            LIFECYCLE_ANNOTATION: json.dumps(record.json(), sort_keys=True),
            LIFECYCLE_HISTORY: json.dumps(history, sort_keys=True)})
        if status.ok:
            self.records.append(record)
            written.append(record)
