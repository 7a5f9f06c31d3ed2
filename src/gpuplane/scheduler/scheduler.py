"""The scheduler: a cache of the cluster fed by the port's watch, the framework, and bind through the port.

Like kube-scheduler it *assumes* a pod in its cache before binding and forgets it when the bind fails,
so the next decision already sees the capacity as taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from gpuplane.model import Assignment, Catalog, ClusterState, PlacementError, PodRequest, PoolConfig
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, PodInfo, PodPhase, Status
from gpuplane.scheduler.framework import Decision, Framework, Profile
from gpuplane.scheduler.queue import QueuedPod, SchedulingQueue


@dataclass(frozen=True, slots=True)
class Outcome:
    """One scheduling attempt, as the driver of a replay records it."""

    request: PodRequest
    decision: Decision
    attempt: int
    waited: float


class Scheduler:
    def __init__(self, port: ClusterPort, catalog: Catalog, profile: Profile, *, seed: int,
                 pools: Mapping[str, PoolConfig] | None = None, now: Callable[[], float] | None = None) -> None:
        self.port = port
        self.now = now or (lambda: 0.0)
        self.catalog = catalog
        self.pools = pools
        self.framework = Framework(profile, np.random.default_rng(seed))
        self.queue = SchedulingQueue()
        self._assumed: dict[str, Assignment] = {}
        """Pods reserved in the cache whose bind has not been confirmed yet."""
        self.state = self._build_cache(enqueue=True)
        self._unsubscribe = port.watch(self._on_event)

    def _build_cache(self, *, enqueue: bool) -> ClusterState:
        state = ClusterState(self.catalog, [info.spec for info in self.port.list_nodes()], self.pools)
        for pod in self.port.list_pods():
            if pod.assignment is not None and pod.phase in (PodPhase.RUNNING, PodPhase.TERMINATING):
                state.place(pod.request, pod.assignment)
            elif pod.phase is PodPhase.PENDING and enqueue:
                self.queue.add(pod.request, pod.created_at)
        return state

    def resync(self) -> None:
        """Rebuild the cache from the port's lists (the world's truth), dropping every reservation."""
        self._assumed.clear()
        self.state = self._build_cache(enqueue=False)
        self.queue.activate_all()

    def close(self) -> None:
        self._unsubscribe()

    # ------------------------------------------------------------------ cache
    def _on_event(self, event: ClusterEvent) -> None:
        kind = event.kind
        if kind is EventKind.POD_ADDED and event.pod is not None:
            if event.pod.phase is PodPhase.PENDING:
                self.queue.add(event.pod.request, event.time)
        elif kind is EventKind.POD_BOUND and event.pod is not None:
            self._on_bound(event.pod)
        elif kind is EventKind.POD_DELETED and event.pod is not None:
            name = event.pod.name
            self.queue.remove(name)
            binding = self.state.bindings.get(name)
            if binding is not None:
                self.state.release(name)
                self.queue.activate_for_node(self.state, binding.node)
        elif kind is EventKind.NODE_ADDED and event.node is not None:
            self.state.add_node(event.node.spec)
            self.queue.activate_all()
        elif kind is EventKind.NODE_UPDATED and event.node is not None:
            self.state.update_node(event.node.spec)
            self.queue.activate_all()

    def _on_bound(self, pod: PodInfo) -> None:
        """The world bound a pod: confirm our reservation, or let the world's binding replace it."""
        self.queue.remove(pod.name)
        assignment = pod.assignment
        if assignment is None:
            return
        assumed = self._assumed.pop(pod.name, None)
        if assumed == assignment:
            return  # our own bind, confirmed
        if assumed is not None or pod.name in self.state.bindings:
            self.state.release(pod.name)  # bound by someone else, or bound differently
        try:
            self.state.place(pod.request, assignment)
        except PlacementError:
            # The world put a pod where we reserved capacity for others: the world wins. Drop the
            # reservations on that node (their binds will fail and they will be retried), then retry.
            node = self.state.node_index.get(assignment.node)
            for name in [n for n, a in self._assumed.items() if a.node == assignment.node]:
                del self._assumed[name]
                self.state.release(name)
            try:
                self.state.place(pod.request, assignment)
            except PlacementError:
                self.resync()
                return
            if node is not None:
                self.queue.activate_for_node(self.state, node)

    # ------------------------------------------------------------------ decisions
    def decide(self, pod: PodRequest) -> Decision:
        """Where `pod` would go now; changes nothing."""
        return self.framework.schedule(pod, self.state)

    def schedule_one(self, pod: PodRequest) -> Decision:
        """Decide, reserve in the cache, bind through the port; forget the reservation if bind fails."""
        decision = self.decide(pod)
        if decision.assignment is None:
            return decision
        self.state.place(pod, decision.assignment)
        self._assumed[pod.name] = decision.assignment
        status = self.port.bind(pod.name, decision.assignment)
        still_assumed = self._assumed.pop(pod.name, None) is not None
        if not status.ok:
            if still_assumed:
                self.state.release(pod.name)
            return Decision(status, None, -1, decision.diagnosis)
        return decision

    def run_pending(self, on_outcome: Callable[[Outcome], bool] | None = None) -> list[Outcome]:
        """Try every active pod once, highest priority first. Unschedulable pods are parked.

        `on_outcome` may return False to drop a failed pod instead of parking it (fill replays).
        """
        outcomes: list[Outcome] = []
        # Nodes whose freed capacity reactivated a pod that then went elsewhere (or nowhere): the
        # reactivation budget assumed that pod would use the node, so look at the node once more.
        recheck: set[int] = set()
        rechecked: set[int] = set()
        while True:
            entry: QueuedPod | None = self.queue.pop()
            if entry is None:
                pending = recheck - rechecked
                if not pending:
                    return outcomes
                rechecked |= pending
                recheck.clear()
                for node in sorted(pending):
                    if node < self.state.size:
                        self.queue.activate_for_node(self.state, node)
                continue
            hint, entry.hint_node = entry.hint_node, -1
            decision = self.schedule_one(entry.request)
            if hint >= 0 and decision.node != hint:
                recheck.add(hint)
            outcome = Outcome(entry.request, decision, entry.attempts, self.now() - entry.enqueued_at)
            outcomes.append(outcome)
            keep = on_outcome(outcome) if on_outcome is not None else True
            if not decision.status.ok and keep and entry.request.name not in self.state.bindings:
                self.queue.park(entry)

    def status_of(self, pod: str) -> Status:
        return Status.success() if pod in self.state.bindings else Status.unschedulable("not placed")
