"""The scheduler: a cache of the cluster fed by the port's watch, the framework, and bind through the port.

Like kube-scheduler it *assumes* a pod in its cache before binding and forgets it when the bind fails,
so the next decision already sees the capacity as taken. On top of the framework it runs:

- quotas: a pod whose queue would exceed its maximum waits (no polling: its queue's next release wakes it);
- preemption: a pod that fits nowhere evicts the fewest, cheapest eligible pods on one node
  (`gpuplane.scheduler.preemption`); the freed capacity is reserved for it in the cache at once (its
  nominated placement), and it is bound when the last victim is gone;
- gangs: members wait until all have arrived (up to a timeout), then are placed all or nothing in one
  trial (preempting if they may), so two gangs that each half-fit never hold capacity against each other.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gpuplane.model import (
    MILLI_PER_CARD,
    Assignment,
    Binding,
    Catalog,
    ClusterState,
    NodeSpecError,
    PlacementError,
    PodRequest,
    PoolConfig,
)
from gpuplane.model.priority import PriorityClasses, default_priority_classes
from gpuplane.model.quota import QueueQuota, Quotas
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, PodInfo, PodPhase, Status
from gpuplane.port.status import Code
from gpuplane.scheduler.framework import NEAR_CARDS, OUTSIDE, CycleState, Decision, Framework, Profile
from gpuplane.scheduler.preemption import (
    NO_VICTIMS,
    Preemption,
    PreemptionPlan,
    PreemptionResult,
    Victim,
    VictimOrder,
    VictimRules,
    room_after_evictions,
)
from gpuplane.scheduler.queue import QueuedPod, SchedulingQueue, shape_key, static_nodes

log = logging.getLogger(__name__)

NETWORK_BLOCK_LABEL = "gpuplane.io/network-block"
HELD_FOR_NOMINATION = "node(s) held for a nominated pod whose victims are still terminating"
BESIDE_HIGHER_PODS = "node(s) where a pod above the backfill holds a GPU and the backfill headroom must stay free"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One scheduling attempt, as the driver of a replay records it."""

    request: PodRequest
    decision: Decision
    attempt: int
    waited: float


@dataclass(frozen=True, slots=True)
class SchedulingRules:
    """Priorities, preemption, quotas, disruption budgets and gangs."""

    classes: PriorityClasses = field(default_factory=default_priority_classes)
    quotas: Quotas = field(default_factory=Quotas)
    min_available: Mapping[str, int] = field(default_factory=dict)
    """Per workload, the running pods preemption must leave (a PodDisruptionBudget's minAvailable)."""
    preemption: bool = True
    max_candidates: int = 16
    """Candidate nodes a preemption tries in full, after the vectorised screen."""
    victim_order: VictimOrder = VictimOrder.FEWEST_FIRST
    queueing_hints: bool = True
    """Skip retries that cannot succeed, as kube-scheduler's QueueingHints do: a freed node wakes only the parked
    pods its unresolvable filters admit; a backfill pod leaving does not wake the pods above the backfill
    through the shadow (the capacity was theirs to take already); a gang is trial-placed only when an upper
    bound on its room after every eviction it may make holds all its members (`Scheduler._gang_short`).
    False: every wake-up retries (the flush, below, retries everything either way)."""
    flush_parked_every_s: float = 300.0
    """Every parked pod is tried again this often, whatever woke it or not (kube-scheduler's
    podMaxInUnschedulablePodsDuration): a safety net for capacity changes the wake-ups miss."""
    retry_preemptors_every_s: float = 60.0
    """Parked pods that may preempt are tried again this often: capacity that lower-priority pods took
    after they were parked frees no node, so no capacity event would wake them (kube-scheduler flushes
    its unschedulable pods every 5 minutes for the same reason)."""
    default_victim_grace_s: float = 30.0
    """Grace period of a victim whose pod names no priority class."""
    gang_timeout_s: float = 600.0
    """How long the first member of a gang waits for the others before the gang is failed."""
    gang_timeouts: Mapping[str, float] = field(default_factory=dict)
    """Per gang, its own timeout in place of `gang_timeout_s` (a PodGroup's scheduleTimeoutSeconds)."""
    network_block_label: str = NETWORK_BLOCK_LABEL
    max_blocks_tried: int = 4
    """Network blocks a gang tries to fit into alone, biggest free first, before it may span blocks."""
    nomination_timeout_s: float = 3600.0
    """A nominated pod whose victims have not gone by then is put back in the queue."""
    backfill_headroom_milli: int = 0
    """On a node where a pod above the backfill holds a GPU, a backfill pod goes only if it leaves this much
    GPU (milli) free; nodes without such pods take backfill freely. The headroom beside those pods is there
    for the pods that pack there next: they start at once instead of waiting for backfill victims to
    terminate (their grace, their save, the container's stop); the cost is the allocation it would have
    added. 0: backfill fills everything; more than any node's GPUs: backfill on idle nodes only."""


@dataclass(slots=True)
class Nomination:
    """Pods whose placement is reserved in the cache until their victims are gone."""

    members: list[tuple[QueuedPod, Assignment]]
    waiting_for: set[str]
    deadline: float


@dataclass(slots=True)
class _GangWait:
    first_seen: float
    members: dict[str, QueuedPod] = field(default_factory=dict)


@dataclass(slots=True)
class PreemptionStats:
    attempts: int = 0
    plans: int = 0
    victims: int = 0
    work_lost_gpu_s: float = 0.0
    gangs_placed: int = 0
    gangs_failed: int = 0
    attempts_skipped: int = 0
    """Attempts answered by the failure of a pod asking the same, nothing gained since (`_attempt_once`)."""
    gangs_screened: int = 0
    """Gang attempts refused by the capacity bound (`Scheduler._gang_short`) without a trial placement."""


class Scheduler:
    def __init__(self, port: ClusterPort, catalog: Catalog, profile: Profile, *, seed: int,
                 pools: Mapping[str, PoolConfig] | None = None, now: Callable[[], float] | None = None,
                 rules: SchedulingRules | None = None, queue_pods: bool = True) -> None:
        self.port = port
        self.queue_pods = queue_pods
        """False: pending pods are not queued (a scheduler behind kube-scheduler's extender decides per request
        and never runs its own queue)."""
        self.now = now or (lambda: 0.0)
        self.catalog = catalog
        self.pools = pools
        self.rules = rules or SchedulingRules()
        self.framework = Framework(profile, np.random.default_rng(seed))
        self._backfill_framework = Framework(profile, np.random.default_rng([seed, 1]))
        """Backfill pods draw their tie-breaks from their own stream, so the pods above them decide exactly as
        they would without any backfill (the same random draws on the same shadow state)."""
        self.preemption = Preemption(self.framework, max_candidates=self.rules.max_candidates,
                                     order=self.rules.victim_order)
        self._last_retry = -math.inf
        self._last_flush = -math.inf
        self.queue = SchedulingQueue()
        self.stats = PreemptionStats()
        self.on_deferred: Callable[[Outcome], object] | None = None
        """Called for outcomes decided outside `run_pending` (a nominated pod bound when its victims left)."""
        self._assumed: dict[str, Assignment] = {}
        """Pods reserved in the cache whose bind has not been confirmed yet."""
        self._started: dict[str, float] = {}
        self._nominations: list[Nomination] = []
        self._victim_of: dict[str, Nomination] = {}
        self.unplaced: list[tuple[str, str]] = []
        """Running pods whose recorded assignment did not fit the cache when it was last built, with why."""
        self._nominated: dict[str, Nomination] = {}
        self._gangs: dict[str, _GangWait] = {}
        self._quota_waiting: dict[str, dict[str, QueuedPod]] = {}
        self._committing: Nomination | None = None
        self._terminating: set[str] = set()
        """Pods the world is already terminating: never victims (they are leaving; their capacity is not)."""
        self._gone: set[str] = set()
        """Pods deleted or failed during the current attempt (a world's callback may delete pods while the
        scheduler evicts or binds): the attempt must not queue them again."""
        self._backfill_classes = frozenset(c.name for c in self.rules.classes if c.backfill)
        self._backfill_priority = max((c.value for c in self.rules.classes if c.backfill), default=None)
        self._gained = 0
        """Counts the changes after which a pod that failed might fit (a pod released, a node added or changed, a
        nomination's hold ended, a pod placed that changes what quotas or disruption budgets allow)."""
        self._memo: dict[PodRequest, Decision] = {}
        self._memo_epoch = 0
        self._exact = True
        self._gang_cached: dict[str, int] = {}
        """Pods per gang in the cache (bound, assumed, nominated or trial-placed)."""
        self.shadow: ClusterState | None = None
        """The cache without backfill pods: pods above the backfill classes are placed as if backfill were
        not there (so they pack as they would on their own), then evict the backfill in their way."""
        self.state = self._build_cache(enqueue=True)
        self._unsubscribe = port.watch(self._on_event)

    def _build_cache(self, *, enqueue: bool) -> ClusterState:
        specs = [info.spec for info in self.port.list_nodes()]
        state = ClusterState(self.catalog, specs, self.pools)
        self._gang_cached = {}
        self.shadow = ClusterState(self.catalog, specs, self.pools) if self._backfill_classes else None
        self._terminating = set()
        self.unplaced = []
        for pod in self.port.list_pods():
            if pod.assignment is not None and pod.phase in (PodPhase.RUNNING, PodPhase.TERMINATING):
                try:
                    state.place(pod.request, pod.assignment)
                except PlacementError as exc:
                    # A recorded assignment the cache cannot hold (an edited annotation, a node that shrank):
                    # report it and go on; one torn pod must not keep the scheduler from starting.
                    self.unplaced.append((pod.name, str(exc)))
                    log.warning("running pod %s left out of the scheduler's cache: %s", pod.name, exc)
                    continue
                if pod.request.gang is not None:
                    self._gang_cached[pod.request.gang] = self._gang_cached.get(pod.request.gang, 0) + 1
                if pod.phase is PodPhase.TERMINATING:
                    self._terminating.add(pod.name)
                if self.shadow is not None and not self.is_backfill(pod.request):
                    self.shadow.place(pod.request, pod.assignment)
                self._started[pod.name] = pod.bound_at if pod.bound_at is not None else self.now()
            elif pod.phase is PodPhase.PENDING and enqueue and self.queue_pods:
                self.queue.add(pod.request, pod.created_at)
        return state

    def resync(self) -> None:
        """Rebuild the cache from the port's lists (the world's truth). Nominations are dropped (their pods go
        back to the queue); the reservations of binds in flight (`assume`d, not nominated) are held again
        where they still fit, since the lists show those pods pending until their binds land. One that no
        longer fits is dropped and logged: `reserved` then no longer names it, and its bind must not go on."""
        in_flight = [(self.state.bindings[name].request, assignment) for name, assignment in self._assumed.items()
                     if name not in self._nominated and name in self.state.bindings]
        self._assumed.clear()
        dropped = [entry for nomination in self._nominations for entry, _ in nomination.members]
        self._nominations.clear()
        self._victim_of.clear()
        self._nominated.clear()
        self.state = self._build_cache(enqueue=False)
        self._gained += 1
        for request, assignment in in_flight:
            held = self.state.bindings.get(request.name)
            if held is not None:  # the lists show it bound already: the world's binding stands
                if held.assignment == assignment:
                    self._assumed[request.name] = assignment
                continue
            try:
                self.assume(request, assignment)
            except PlacementError as exc:
                log.warning("the reservation of %s on %s no longer fits the rebuilt cache (%s): dropped, its bind "
                            "is refused unless already sent", request.name, assignment.node, exc)
        for entry in dropped:
            self.queue.requeue(entry)
        for waiting in self._quota_waiting.values():
            for entry in waiting.values():
                self.queue.requeue(entry)
        self._quota_waiting.clear()
        self.queue.activate_all()

    def close(self) -> None:
        self._unsubscribe()

    def _wake(self, node: int, *, shadow: bool = True, budgeted: bool = True) -> None:
        """Capacity freed on `node`: move back the parked pods it could now hold. Pods above the backfill
        see the node as if backfill were not there (the shadow), so they are woken against it too, unless
        `shadow` is False (a backfill pod left: the shadow did not change, and for the pods above the backfill
        the capacity it held was theirs to take already; what it freed in the cache wakes them as any pod)."""
        hints = self.rules.queueing_hints
        self.queue.activate_for_node(self.state, node, filtered=hints, budgeted=budgeted)
        if (shadow or not hints) and self.shadow is not None and self._backfill_priority is not None:
            self.queue.activate_for_node(self.shadow, node, above_priority=self._backfill_priority, filtered=hints,
                                         budgeted=budgeted)

    def _node_changed(self, name: str) -> None:
        """A node was added or changed (labels, taints, pool, cordon, capacity): with the hints, wake the parked
        pods that node now admits and could hold (other nodes did not change); without, every parked pod."""
        self._gained += 1
        if self.rules.queueing_hints:
            self._wake(self.state.node_index[name], budgeted=False)
        else:
            self.queue.activate_all()

    def is_backfill(self, request: PodRequest) -> bool:
        return request.priority_class is not None and request.priority_class in self._backfill_classes

    def _place(self, request: PodRequest, assignment: Assignment, *, check: bool = True) -> Binding:
        binding = self.state.place(request, assignment, check=check)
        if self.shadow is not None and not self.is_backfill(request):
            self.shadow.place(request, assignment, check=False)
        if request.gang is not None:
            self._gang_cached[request.gang] = self._gang_cached.get(request.gang, 0) + 1
        if (request.queue is not None and request.queue in self.rules.quotas) or (
                request.workload is not None and request.workload in self.rules.min_available):
            self._gained += 1  # other queues may borrow less or more; a budget may allow more evictions
        return binding

    def _release(self, name: str) -> Binding:
        binding = self.state.release(name)
        self._gained += 1
        if self.shadow is not None and name in self.shadow.bindings:
            self.shadow.release(name)
        gang = binding.request.gang
        if gang is not None:
            left = self._gang_cached[gang] - 1
            if left:
                self._gang_cached[gang] = left
            else:
                del self._gang_cached[gang]
        return binding

    # ------------------------------------------------------------------ cache
    def _on_event(self, event: ClusterEvent) -> None:
        kind = event.kind
        if kind is EventKind.POD_ADDED and event.pod is not None:
            if event.pod.phase is PodPhase.PENDING and self.queue_pods:
                self._on_added(event.pod.request, event.time)
        elif kind is EventKind.POD_BOUND and event.pod is not None:
            self._started[event.pod.name] = event.time
            self._on_bound(event.pod)
        elif kind is EventKind.POD_TERMINATING and event.pod is not None:
            self._terminating.add(event.pod.name)
        elif kind in (EventKind.POD_DELETED, EventKind.POD_FAILED) and event.pod is not None:
            self._terminating.discard(event.pod.name)
            self._on_gone(event.pod)
        elif kind is EventKind.NODE_ADDED and event.node is not None:
            self.state.add_node(event.node.spec)
            if self.shadow is not None:
                self.shadow.add_node(event.node.spec)
            self._node_changed(event.node.spec.name)
        elif kind is EventKind.NODE_UPDATED and event.node is not None:
            spec = event.node.spec
            if spec.name not in self.state.node_index:
                self.resync()
                return
            try:
                self.state.update_node(spec)
                if self.shadow is not None:
                    self.shadow.update_node(spec)
            except NodeSpecError:
                self.resync()  # cards published or changed (the node agent's inventory): the lists show it now
                return
            self._node_changed(spec.name)
        elif (kind is EventKind.NODE_REMOVED and event.node is not None
              and event.node.name in self.state.node_index):
            self.resync()

    def _on_added(self, request: PodRequest, now: float) -> None:
        self._gone.discard(request.name)
        self.queue.add(request, now)
        gang = request.gang
        if gang is not None and gang in self._gangs:
            # A new member: the waiting ones go back to the queue to assemble again.
            for entry in self._gangs[gang].members.values():
                self.queue.requeue(entry)
            self._gangs[gang].members.clear()

    def _on_gone(self, pod: PodInfo) -> None:
        name = pod.name
        self._gone.add(name)
        self.queue.remove(name)
        self._started.pop(name, None)
        request = pod.request
        if request.gang is not None and request.gang in self._gangs:
            self._gangs[request.gang].members.pop(name, None)
        if request.queue is not None:
            self._quota_waiting.get(request.queue, {}).pop(name, None)
        nomination = self._nominated.pop(name, None)
        if nomination is not None:  # a nominated pod itself went away: drop its reservation
            nomination.members = [(e, a) for e, a in nomination.members if e.request.name != name]
        self._assumed.pop(name, None)
        binding = self.state.bindings.get(name)
        if binding is not None:
            self._release(name)
            self._wake(binding.node, shadow=not self.is_backfill(request))
            if request.queue is not None:
                self._wake_queue(request.queue)
        waiting = self._victim_of.pop(name, None)
        if waiting is not None:
            waiting.waiting_for.discard(name)
            if not waiting.waiting_for and waiting is not self._committing:
                self._bind_nomination(waiting)
            # A victim leaves only now: what it held beyond the preemptor's need is free in the world too,
            # and a pod that tried it while the victim was terminating got a bind conflict and was parked.
            node = self.state.node_index.get(pod.assignment.node) if pod.assignment is not None else None
            if node is not None:
                self._wake(node)

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
            self._release(pod.name)  # bound by someone else, or bound differently
        try:
            self._place(pod.request, assignment)
        except PlacementError:
            # The world put a pod where we reserved capacity for others: the world wins. Drop the
            # reservations on that node, then retry. A bind not sent yet then fails (an extender checks
            # `reserved` first); one already in the port is the world's to decide (the sim refuses the
            # overlap, an API server does not check cards).
            node = self.state.node_index.get(assignment.node)
            for name in [n for n, a in self._assumed.items() if a.node == assignment.node]:
                del self._assumed[name]
                self._release(name)
            try:
                self._place(pod.request, assignment)
            except PlacementError:
                self.resync()
                return
            if node is not None:
                self._wake(node)

    # ------------------------------------------------------------------ decisions
    def decide(self, pod: PodRequest) -> Decision:
        """Where `pod` would go now; changes nothing."""
        return self.framework.schedule(pod, self.state)

    def schedule_one(self, pod: PodRequest) -> Decision:
        """Decide, reserve in the cache, bind through the port; forget the reservation if bind fails."""
        decision = self.decide(pod)
        if decision.assignment is None:
            return decision
        return self._reserve_and_bind(pod, decision)

    def assume(self, pod: PodRequest, assignment: Assignment) -> None:
        """Reserve `assignment` in the cache ahead of a bind; `settle` ends the reservation.

        For callers that bind through the port themselves (an extender binds outside its state lock).
        """
        if pod.name not in self.state.bindings:
            self._place(pod, assignment)
        self._assumed[pod.name] = assignment

    def reserved(self, pod: str) -> Assignment | None:
        """The cards `assume` holds for `pod`'s bind, or None once that reservation is gone (settled, replaced by
        the world's binding, or dropped by a rebuild of the cache it no longer fits)."""
        if pod in self._nominated:
            return None
        assignment = self._assumed.get(pod)
        binding = self.state.bindings.get(pod)
        return assignment if binding is not None and binding.assignment == assignment else None

    def settle(self, pod: str, status: Status) -> None:
        """The bind of an assumed pod returned `status`: forget the reservation if it failed (unless the
        world's watch already replaced it)."""
        still_assumed = self._assumed.pop(pod, None) is not None
        if not status.ok and still_assumed and pod in self.state.bindings:
            self._release(pod)

    def nominate(self, pod: str, assignment: Assignment, victims: Sequence[str], *, reason: str) -> Decision:
        """Reserve `assignment` for the queued pod `pod` and evict `victims` (running pods in its way) through
        the port: the nomination preemption makes, for a caller that chose the victims itself (the
        descheduler). The cards are held in the cache at once and the pod is bound when the last victim is
        gone; meanwhile its node is held for pods of its priority or lower. Refused, with nothing changed,
        when the pod is not queued, a victim is not a running pod of the cache, or the assignment does not
        fit once the victims are gone; an eviction the world refuses undoes the nomination (the pod is
        queued again)."""
        entry = self.queue.take(pod)
        if entry is None:
            return Decision(Status.error(f"{pod} is not queued"))
        stray = [name for name in victims if name not in self.state.bindings or name in self._nominated
                 or name in self._terminating or name in self._assumed]
        if stray:
            self.queue.requeue(entry)
            return Decision(Status.error(f"not running pods of the cache: {', '.join(stray)}"))
        released = [self._release(name) for name in victims]
        why = self.state.check(assignment, entry.request)
        if why is not None:
            for binding in reversed(released):
                self._place(binding.request, binding.assignment, check=False)
            self.queue.requeue(entry)
            return Decision(Status.error(f"conflict: {why}"))
        self._place(entry.request, assignment)
        decision = Decision(Status.success(), assignment, self.state.node_index[assignment.node])
        outcome = self._commit([(entry, decision)], [], released, reason=reason)
        if not outcome.status.ok and outcome.status.code is not Code.WAIT:
            self.queue.requeue(entry)
        return outcome

    def _reserve_and_bind(self, pod: PodRequest, decision: Decision) -> Decision:
        assert decision.assignment is not None
        self.assume(pod, decision.assignment)
        status = self.port.bind(pod.name, decision.assignment)
        self.settle(pod.name, status)
        if not status.ok:
            return Decision(status, None, -1, decision.diagnosis)
        return decision

    def run_pending(self, on_outcome: Callable[[Outcome], bool] | None = None) -> list[Outcome]:
        """Try every active pod once, highest priority first. Unschedulable pods are parked.

        `on_outcome` may return False to drop a failed pod instead of parking it (fill replays).
        """
        outcomes: list[Outcome] = []
        self._expire()
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
                        self._wake(node)
                continue
            hint, entry.hint_node = entry.hint_node, -1
            self._gone.clear()
            known = self._known_failure(entry) if entry.request.gang is None else None
            draws = self._draws() if known is None else None  # a known failure draws nothing
            if entry.request.gang is not None:
                gang_outcomes = self._attempt_gang(entry)
                if draws is not None and gang_outcomes and _failed(gang_outcomes[0].decision):
                    self._undraw(draws)
                for outcome in gang_outcomes:
                    outcomes.append(outcome)
                    if on_outcome is not None:
                        on_outcome(outcome)
                continue
            decision = known if known is not None else self._attempt_once(entry)
            if draws is not None and _failed(decision):
                self._undraw(draws)
            if hint >= 0 and decision.node != hint:
                recheck.add(hint)
            outcome = Outcome(entry.request, decision, entry.attempts, self.now() - entry.enqueued_at)
            outcomes.append(outcome)
            keep = on_outcome(outcome) if on_outcome is not None else True
            if decision.status.code is Code.WAIT:
                continue  # held for its quota, or nominated and waiting for its victims
            if (not decision.status.ok and keep and entry.request.name not in self.state.bindings
                    and entry.request.name not in self._gone):
                self.queue.park(entry)

    def _draws(self) -> tuple[Mapping[str, object], Mapping[str, object]]:
        return self.framework.rng.bit_generator.state, self._backfill_framework.rng.bit_generator.state

    def _undraw(self, draws: tuple[Mapping[str, object], Mapping[str, object]]) -> None:
        """Give back the tie-break draws of an attempt that failed: a failed attempt changes nothing, so an
        attempt skipped because it could not succeed (a queueing hint, the gang bound) decides the same."""
        self.framework.rng.bit_generator.state, self._backfill_framework.rng.bit_generator.state = draws

    def _attempt_once(self, entry: QueuedPod) -> Decision:
        """`_attempt`, unless a pod asking exactly the same (all but its name) failed since the cache last gained
        anything that could help (`_gained`): then that failure, without a second search (with the hints on).
        Only failures the cache alone decided count: not a bind or eviction the world refused, nor a preemption
        search that tried only its `max_candidates` best nodes (adding pods reorders them)."""
        if not self.rules.queueing_hints:
            return self._attempt(entry)
        known = self._known_failure(entry)
        if known is not None:
            return known
        key = entry.alike
        assert key is not None
        self._exact = True
        decision = self._attempt(entry)
        if self._exact and decision.status.code is Code.UNSCHEDULABLE and entry.request.name not in self.state.bindings:
            # The cache is as it was (a trial releasing backfill put it back): nothing was gained.
            self._gained = self._memo_epoch
            self._memo[key] = decision
        return decision

    def _known_failure(self, entry: QueuedPod) -> Decision | None:
        """The failure memo's answer for a pod asking exactly what a pod that failed since the cache last gained
        anything asked (with the hints on), counted as a skipped attempt; None: it must be tried."""
        if not self.rules.queueing_hints:
            return None
        if self._memo_epoch != self._gained:
            self._memo.clear()
            self._memo_epoch = self._gained
        key = entry.alike
        if key is None:
            key = entry.alike = replace(entry.request, name=_ANY_NAME)
        known = self._memo.get(key)
        if known is not None:
            self.stats.attempts_skipped += 1
        return known

    def _note_truncation(self, candidates: int) -> None:
        if candidates > self.preemption.max_candidates:
            self._exact = False

    def _attempt(self, entry: QueuedPod) -> Decision:
        pod = entry.request
        refusal = self._quota_refusal(pod, pod.gpu_milli_total)
        if refusal is not None:
            self._quota_waiting.setdefault(pod.queue or "", {})[pod.name] = entry
            return Decision(Status(Code.WAIT, (refusal,)))
        models, kept = self._quota_scope(pod, pod.gpu_milli_total)
        if kept is not None:
            return Decision(Status.unschedulable(kept))
        scoped = _within_models(pod, models)
        decision, cleared = self._decide(scoped)
        if decision.assignment is not None:
            if not cleared:
                return self._reserve_and_bind(pod, decision)
            self._place(pod, decision.assignment)
            return self._commit([(entry, decision)], [self._plan(pod, decision, cleared)], cleared)
        if not self._may_preempt(pod, decision):
            return decision
        self.stats.attempts += 1
        if self._past_backfill(pod):
            done = self._preempt_past_backfill(entry, decision, scoped)
            if done is not None:
                return done
        if self._nobody_below(pod):  # what `plan` would find, without building the victim rules
            return Decision(Status.unschedulable(f"{decision.status.message} Preemption: {NO_VICTIMS}."), None, -1,
                            decision.diagnosis)
        result = self.preemption.plan(scoped, self.state, self._victim_rules(pod, []), decision.diagnosis,
                                      within=self._held(pod))
        self._note_truncation(result.candidates)
        if result.plan is None:
            message = f"{decision.status.message} Preemption: {result.reason}."
            return Decision(Status.unschedulable(message), None, -1, decision.diagnosis)
        victims = [self._release(v.pod) for v in result.plan.victims]
        self._place(pod, result.plan.decision.assignment)  # type: ignore[arg-type]
        return self._commit([(entry, result.plan.decision)], [result.plan], victims)

    def _decide(self, pod: PodRequest, within: np.ndarray | None = None,
                near: dict[int, frozenset[int]] | None = None) -> tuple[Decision, list[Binding]]:
        """Where `pod` goes. A pod above the backfill classes is placed on the cache without backfill pods
        (the shadow), and the backfill pods in the way of that placement are released from the cache and
        returned as victims (the caller evicts them or puts them back). `near`: cards to sit close to."""
        cycle = CycleState()
        if near:
            cycle.write(NEAR_CARDS, near)
        held = self._held(pod)
        reason, resolvable = OUTSIDE, False
        if held is not None:
            if within is None:
                within, reason, resolvable = held, HELD_FOR_NOMINATION, True
            else:
                within = within & held
        shadow = self.shadow
        if self.is_backfill(pod):
            headroom = self.rules.backfill_headroom_milli
            if shadow is not None and headroom > 0:
                n, state = self.state.size, self.state
                allowed = (shadow.gpu_milli_used[:n] == 0) | (
                    state.gpu_milli_cap[:n] - state.gpu_milli_used[:n] - pod.gpu_milli_total >= headroom)
                if within is None:
                    within, reason, resolvable = allowed, BESIDE_HIGHER_PODS, True
                else:
                    within = within & allowed
            return self._backfill_framework.schedule(pod, self.state, within=within, cycle=cycle,
                                                     within_reason=reason, within_resolvable=resolvable), []
        if shadow is None or not self._past_backfill(pod):
            return self.framework.schedule(pod, self.state, within=within, cycle=cycle, within_reason=reason,
                                           within_resolvable=resolvable), []
        decision = self.framework.schedule(pod, shadow, within=within, cycle=cycle, within_reason=reason,
                                           within_resolvable=resolvable)
        assignment = decision.assignment
        if assignment is None:
            return decision, []
        if self.state.check(assignment, pod) is None:
            return decision, []
        cleared = self._clear_backfill(pod, decision.node, assignment)
        if cleared is None:
            return self.framework.schedule(pod, self.state, within=within, cycle=CycleState()), []
        return decision, cleared

    def _nobody_below(self, pod: PodRequest) -> bool:
        """Whether no pod of the cache may be preempted for `pod`: none has a lower priority, and its queue is not
        owed its minimum (which lets it take what other queues borrow at its own priority)."""
        rows = self.state.pod_table.pods
        live = rows.live[: rows.count]
        if live.any() and int(rows.priority[: rows.count][live].min()) < pod.priority:
            return False
        return not (self.rules.quotas and self._owed(pod, self.quota_usage()))

    def _past_backfill(self, pod: PodRequest) -> bool:
        """Whether `pod` decides on the shadow (the cache without backfill) and pushes backfill aside."""
        shadow = self.shadow
        return (shadow is not None and self._backfill_priority is not None and pod.priority > self._backfill_priority
                and pod.preempts and self.rules.preemption and not self.is_backfill(pod)
                and len(shadow.bindings) != len(self.state.bindings))

    def _preempt_past_backfill(self, entry: QueuedPod, decision: Decision,
                               scoped: PodRequest | None = None) -> Decision | None:
        """Preempt as if backfill were not there: victims chosen on the shadow among the pods above the
        backfill, then the backfill in the way of the placement. None: no such plan (try the whole cache).
        `scoped`: the pod as its queue quota leaves it (`_within_models`), for the search."""
        pod = entry.request
        assert self.shadow is not None
        result = self.preemption.plan(pod if scoped is None else scoped, self.shadow,
                                      self._victim_rules(pod, [], self.shadow), decision.diagnosis,
                                      within=self._held(pod))
        self._note_truncation(result.candidates)
        plan = result.plan
        if plan is None or plan.decision.assignment is None:
            return None
        victims = [self._release(v.pod) for v in plan.victims]
        assignment = plan.decision.assignment
        cleared = [] if self.state.check(assignment, pod) is None else self._clear_backfill(pod, plan.node,
                                                                                            assignment)
        if cleared is None:
            for binding in reversed(victims):
                self._place(binding.request, binding.assignment, check=False)
            return None
        self._place(pod, assignment)
        return self._commit([(entry, plan.decision)], [plan, self._plan(pod, plan.decision, cleared)],
                            victims + cleared)

    def _clear_backfill(self, pod: PodRequest, node: int, assignment: Assignment) -> list[Binding] | None:
        """Release the fewest backfill pods on `node` that let `assignment` fit; None if they cannot."""
        state = self.state
        cards = {share.card for share in assignment.cards}
        names = [n for n in state.node_pods[node]
                 if self.is_backfill(state.bindings[n].request) and n not in self._terminating]

        def order(name: str) -> tuple[bool, int, str]:
            binding = state.bindings[name]
            touches = any(share.card in cards for share in binding.assignment.cards)
            return (not touches, binding.assignment.gpu_milli, name)

        released: list[Binding] = []
        for name in sorted(names, key=order):
            if state.check(assignment, pod) is None:
                break
            released.append(self._release(name))
        if state.check(assignment, pod) is not None:
            for binding in reversed(released):
                self._place(binding.request, binding.assignment, check=False)
            return None
        victims: list[Binding] = []
        for binding in reversed(released):  # reprieve the ones not needed after all
            self._place(binding.request, binding.assignment, check=False)
            if state.check(assignment, pod) is not None:
                self._release(binding.request.name)
                victims.append(binding)
        if self.rules.min_available and self._victim_rules(pod, []).refuse(victims) is not None:
            for binding in victims:
                self._place(binding.request, binding.assignment, check=False)
            return None
        return victims

    def _plan(self, pod: PodRequest, decision: Decision, victims: Sequence[Binding]) -> PreemptionPlan:
        return PreemptionPlan(pod, decision.node, decision,
                              tuple(Victim(b.request.name, b.request.priority, self._work_lost(b)) for b in victims))

    def _work_lost(self, binding: Binding) -> float:
        """GPU-seconds a pod would lose if evicted now: the time since its last checkpoint."""
        now = self.now()
        started = self._started.get(binding.request.name, now)
        ran = max(0.0, now - started)
        every = binding.request.checkpoint_every_s
        since = math.fmod(ran, every) if every > 0 else ran
        return since * binding.assignment.gpu_milli / MILLI_PER_CARD

    def _may_preempt(self, pod: PodRequest, decision: Decision) -> bool:
        return (self.rules.preemption and pod.preempts and decision.status.code is Code.UNSCHEDULABLE
                and len(self.state.bindings) > 0)

    # ------------------------------------------------------------------ preemption
    def _victim_rules(self, pod: PodRequest, chosen: Sequence[Binding],
                      state: ClusterState | None = None) -> VictimRules:
        """Who `pod` may evict in `state` (the cache by default). `chosen`: victims already picked in the same
        trial (a gang's others)."""
        state = self.state if state is None else state
        table = state.pod_table
        rows = table.pods
        count = rows.count
        priority = rows.priority[:count]
        queue_of = rows.queue[:count]
        own = table.queue_id(pod.queue)
        lower = priority < pod.priority
        quotas = self.rules.quotas
        if not quotas:
            eligible = lower
            spare: dict[str, int] = {}
        else:
            used = self.quota_usage()
            spare = {}
            borrowing = np.zeros(max(len(table.queue_ids), 1), np.bool_)
            for queue in quotas:
                qid = table.queue_id(queue.name)
                if qid >= len(borrowing):
                    borrowing = np.resize(borrowing, qid + 1)
                    borrowing[qid] = False
                over = used.get(queue.name, 0) - queue.min_milli
                spare[queue.name] = over
                borrowing[qid] = over > 0 and queue.name != pod.queue
            quota = quotas.get(pod.queue) if pod.queue is not None else None
            owed = quota is not None and used.get(quota.name, 0) + pod.gpu_milli_total <= quota.min_milli
            in_quota = np.isin(queue_of, [table.queue_id(q.name) for q in quotas])
            other_quota = in_quota & (queue_of != own)
            # Another queue's pods: only what it borrows, taken by priority, or by a queue owed its minimum.
            eligible = np.where(other_quota, borrowing[queue_of] & (lower | owed), lower)
        leaving = [table.row_of[name][0] for name in self._terminating if name in table.row_of]
        if leaving:
            eligible = eligible.copy()
            eligible[leaving] = False
        budgets = self.rules.min_available
        available: dict[str, int] = {}
        if budgets:
            for binding in state.bindings.values():
                workload = binding.request.workload
                if workload is not None and workload in budgets:
                    available[workload] = available.get(workload, 0) + 1
        work_lost = self._work_lost

        def refuse(victims: Sequence[Binding]) -> str | None:
            taken: dict[str, int] = {}
            gone: dict[str, int] = {}
            for binding in (*chosen, *victims):
                workload, queue = binding.request.workload, binding.request.queue
                if workload is not None and workload in budgets:
                    gone[workload] = gone.get(workload, 0) + 1
                if queue is not None and queue in spare and queue != pod.queue:
                    taken[queue] = taken.get(queue, 0) + binding.assignment.gpu_milli
            for workload, count in gone.items():
                if available.get(workload, 0) - count < budgets[workload]:
                    return f"evicting {count} pod(s) of {workload} would leave fewer than its minimum " \
                           f"available {budgets[workload]}"
            for queue, milli in taken.items():
                if milli > spare[queue]:
                    return f"queue {queue} would drop below its guaranteed minimum"
            return None

        def protected(binding: Binding) -> bool:
            """Budget-guarded pods and gang members (evicting one stops its whole gang) are kept if possible."""
            request = binding.request
            return request.gang is not None or (request.workload is not None and request.workload in budgets)

        return VictimRules(eligible, work_lost, refuse, protected)

    def _commit(self, placed: list[tuple[QueuedPod, Decision]], plans: Sequence[PreemptionPlan],
                victims: list[Binding], *, reason: str | None = None) -> Decision:
        """Evict a trial's victims through the port; bind its pods now or when the last victim is gone.

        On entry the cache already holds the trial: victims released, pods placed. Returns the first
        pod's decision: success (bound now), WAIT (nominated), or unschedulable (the world refused an
        eviction: the trial is undone and the caller parks the pods).
        """
        members = [(entry, decision.assignment) for entry, decision in placed if decision.assignment is not None]
        collateral = self._gang_collateral(victims)
        kept = {b.request.name for b in collateral}
        victims = victims + collateral
        nomination = Nomination(members, set(), self.now() + self.rules.nomination_timeout_s)
        for entry, assignment in members:
            self._assumed[entry.request.name] = assignment
            self._nominated[entry.request.name] = nomination
        refused: list[Binding] = []
        self._committing = nomination
        try:
            for binding in victims:
                name = binding.request.name
                if name in self._nominated:
                    # A reservation, not a running pod: it loses its nomination and waits again; the
                    # victims it was waiting for are now this nomination's to wait for.
                    self._cancel_nomination(self._nominated[name], heir=nomination)
                    continue
                grace = self.rules.classes.victim_grace_s(binding.request, self.rules.default_victim_grace_s)
                self._victim_of[name] = nomination
                nomination.waiting_for.add(name)
                status = self.port.evict(name, grace_s=grace,
                                         reason=reason or f"preempted by {members[0][0].request.name}")
                if not status.ok:
                    refused.append(binding)
                    self._victim_of.pop(name, None)
                    nomination.waiting_for.discard(name)
                else:
                    self.stats.victims += 1
        finally:
            self._committing = None
        self.stats.plans += len(plans)
        self.stats.work_lost_gpu_s += sum(v.work_lost_gpu_s for plan in plans for v in plan.victims)
        first = placed[0][1]
        if refused:
            self._exact = False  # the world's refusal, not the cache's
            # The world kept some victims (a disruption budget): undo the reservation; the pods retry later.
            for entry, _ in members:
                name = entry.request.name
                self._assumed.pop(name, None)
                self._nominated.pop(name, None)
                if name in self.state.bindings:
                    self._release(name)
            for binding in refused:
                if binding.request.name not in kept:
                    self._place(binding.request, binding.assignment)
            for name in nomination.waiting_for:
                self._victim_of.pop(name, None)
            message = f"eviction refused for {', '.join(b.request.name for b in refused)}"
            return Decision(Status.unschedulable(message), None, -1, first.diagnosis)
        if not nomination.waiting_for:
            return self._bind_nomination(nomination, immediate=True)
        self._nominations.append(nomination)
        node = first.assignment.node if first.assignment is not None else "?"
        return Decision(Status(Code.WAIT, (f"nominated to {node}; waiting for {len(nomination.waiting_for)} "
                                           f"victim(s) to terminate",)), first.assignment, first.node)

    def _gang_collateral(self, victims: Sequence[Binding]) -> list[Binding]:
        """The running members of the victims' gangs that are not victims yet: a gang never runs in part, so
        they go too (the caller evicts them). They stay in the cache until they are gone: the preemptor does not
        need their cards, and while they terminate those cards are not free in the world."""
        gangs = {b.request.gang for b in victims if b.request.gang is not None}
        if not gangs:
            return []
        chosen = {b.request.name for b in victims}
        return [b for name, b in self.state.bindings.items() if b.request.gang in gangs and name not in chosen
                and name not in self._nominated and name not in self._terminating]

    def _cancel_nomination(self, nomination: Nomination, heir: Nomination | None = None) -> None:
        """Undo a nomination: its pods' reservations leave the cache and the pods go back to the queue.
        `heir` inherits the victims still terminating (their capacity is what the heir was given)."""
        if nomination in self._nominations:
            self._nominations.remove(nomination)
        for entry, assignment in nomination.members:
            name = entry.request.name
            self._nominated.pop(name, None)
            self._assumed.pop(name, None)
            binding = self.state.bindings.get(name)
            if binding is not None and binding.assignment == assignment:
                self._release(name)
            self.queue.requeue(entry)
        self._release_hold(nomination)
        nomination.members = []
        for victim in nomination.waiting_for:
            if heir is not None:
                heir.waiting_for.add(victim)
                self._victim_of[victim] = heir
            else:
                self._victim_of.pop(victim, None)
        nomination.waiting_for = set()

    def held_nodes(self, pod: PodRequest) -> np.ndarray | None:
        """The nodes `pod` may use while nominations wait for their victims (None: every node)."""
        return self._held(pod)

    def _held(self, pod: PodRequest) -> np.ndarray | None:
        """Nodes a pod may not use now: a nomination of equal or higher priority waits there for its victims
        to leave (the capacity they still hold is not free in the world yet)."""
        if not self._nominations:
            return None
        mask = np.ones(self.state.size, np.bool_)
        for nomination in self._nominations:
            for entry, assignment in nomination.members:
                if entry.request.priority >= pod.priority:
                    node = self.state.node_index.get(assignment.node)
                    if node is not None:
                        mask[node] = False
        return None if mask.all() else mask

    def _bind_nomination(self, nomination: Nomination, *, immediate: bool = False) -> Decision:
        """Bind every member of a nomination; a gang that cannot bind whole is rolled back."""
        if nomination in self._nominations:
            self._nominations.remove(nomination)
        if not nomination.members:  # every nominated pod went away meanwhile
            return Decision(Status.error("nominated pods are gone"))
        bound: list[str] = []
        failure: Status | None = None
        for entry, assignment in nomination.members:
            name = entry.request.name
            self._nominated.pop(name, None)
            self._assumed[name] = assignment
            status = self.port.bind(name, assignment)
            self._assumed.pop(name, None)
            if status.ok:
                bound.append(name)
            else:
                failure = status
                binding = self.state.bindings.get(name)
                if binding is not None and binding.assignment == assignment:
                    self._release(name)
        if failure is not None:
            if not immediate:  # an immediate bind's caller parks (or requeues) the pods that did not bind
                for entry, _ in nomination.members:
                    if entry.request.name not in bound:
                        self.queue.requeue(entry)
            if len(nomination.members) > 1:
                for name in bound:  # never leave a gang partly running
                    self.port.evict(name, grace_s=0.0, reason="gang could not start whole")
        if not immediate and self.on_deferred is not None:
            for entry, assignment in nomination.members:
                ok = entry.request.name in bound and failure is None
                decision = Decision(Status.success() if ok else (failure or Status.error("bind failed")),
                                    assignment if ok else None, self.state.node_index.get(assignment.node, -1))
                self.on_deferred(Outcome(entry.request, decision, entry.attempts, self.now() - entry.enqueued_at))
        self._release_hold(nomination)
        if failure is not None:
            return Decision(failure)
        entry, assignment = nomination.members[0]
        return Decision(Status.success(), assignment, self.state.node_index.get(assignment.node, -1))

    def _release_hold(self, nomination: Nomination) -> None:
        """The nodes a nomination held are open again: wake the pods parked while they were held."""
        self._gained += 1
        for node in sorted({self.state.node_index.get(a.node, -1) for _, a in nomination.members} - {-1}):
            self._wake(node)

    def _expire(self) -> None:
        """Fail gangs that waited too long for members; requeue nominations whose victims never left;
        every `retry_preemptors_every_s`, put parked pods that could preempt someone back in the queue."""
        now = self.now()
        if now - self._last_flush >= self.rules.flush_parked_every_s:
            self._last_flush = now
            self._last_retry = now
            for entry in self.queue.parked:
                taken = self.queue.take(entry.request.name)
                if taken is not None:
                    self.queue.requeue(taken)
        elif self.rules.preemption and now - self._last_retry >= self.rules.retry_preemptors_every_s:
            self._last_retry = now
            # Backfill does not count: pods above it decide on the shadow, where preempting it gains nothing.
            rows = (self.shadow if self.shadow is not None else self.state).pod_table.pods
            live = rows.live[: rows.count]
            if live.any():
                lowest = int(rows.priority[: rows.count][live].min())
                usage = self.quota_usage() if self.rules.quotas else {}
                for entry in self.queue.parked:
                    if entry.request.preempts and (entry.request.priority > lowest or self._owed(entry.request, usage)):
                        taken = self.queue.take(entry.request.name)
                        if taken is not None:
                            self.queue.requeue(taken)
        for gang, wait in list(self._gangs.items()):
            timeout = self.rules.gang_timeouts.get(gang, self.rules.gang_timeout_s)
            if now - wait.first_seen <= timeout:
                continue
            members = list(wait.members.values())
            present = len(members)
            if not present:
                continue
            del self._gangs[gang]
            size = members[0].request.gang_size
            reason = (f"gang {gang} timed out after {timeout:g} s with {present} of {size} "
                      f"members submitted")
            self.stats.gangs_failed += 1
            for entry in members:
                self.port.fail_pod(entry.request.name, reason)
        for nomination in list(self._nominations):
            if now <= nomination.deadline:
                continue
            self._nominations.remove(nomination)
            for name in nomination.waiting_for:
                self._victim_of.pop(name, None)
            for entry, _ in nomination.members:
                name = entry.request.name
                self._nominated.pop(name, None)
                self._assumed.pop(name, None)
                if name in self.state.bindings:
                    self._release(name)
                self.queue.requeue(entry)

    # ------------------------------------------------------------------ quotas
    def quota_usage(self) -> dict[str, int]:
        """GPU milli held per queue in the cache (bound, assumed and nominated pods); queues holding none are
        left out."""
        table = self.state.pod_table
        rows = table.pods
        live = rows.live[: rows.count]
        sums = np.bincount(rows.queue[: rows.count][live], rows.gpu_milli[: rows.count][live],
                           minlength=len(table.queue_ids))
        return {name: int(sums[qid]) for name, qid in table.queue_ids.items() if name is not None and sums[qid]}


    def quota_model_usage(self) -> dict[tuple[str, str], int]:
        """GPU milli held per (queue, card model) in the cache (bound, assumed and nominated pods)."""
        state = self.state
        table = state.pod_table
        rows = table.pods
        count = rows.count
        live = rows.live[:count]
        width = len(state.models) + 1  # column 0: nodes without a card model
        key = rows.queue[:count][live] * width + state.model_idx[rows.node[:count][live]] + 1
        sums = np.bincount(key, rows.gpu_milli[:count][live], minlength=len(table.queue_ids) * width)
        return {(name, model.name): int(sums[qid * width + m + 1])
                for name, qid in table.queue_ids.items() if name is not None
                for m, model in enumerate(state.models) if sums[qid * width + m + 1]}

    def _quota_refusal(self, pod: PodRequest, need_milli: int) -> str | None:
        """Why `pod`'s queue may not take `need_milli` more now (its maximum, or its minimum when it does not
        borrow); None when it may. The pod waits until a pod of its queue leaves."""
        if pod.queue is None or not self.rules.quotas:
            return None
        quota = self.rules.quotas.get(pod.queue)
        cap = quota.cap_milli if quota is not None else None
        if quota is None or cap is None:
            return None
        used = self.quota_usage().get(pod.queue, 0)
        if used + need_milli <= cap:
            return None
        return (f"queue {pod.queue} at its {_cap_name(quota)}: {used / MILLI_PER_CARD:g} of "
                f"{cap / MILLI_PER_CARD:g} GPUs in use, {need_milli / MILLI_PER_CARD:g} more asked")

    def _quota_scope(self, pod: PodRequest, need_milli: int) -> tuple[frozenset[str] | None, str | None]:
        """The card models `pod` may use under the per-model quotas and the idle shares kept by queues that do
        not lend: (models, None), models None when nothing is excluded; or (None, reason) when nothing is left,
        and the pod is parked (capacity freed on a node, or a pod of its queue leaving, wakes it)."""
        quotas = self.rules.quotas
        if not quotas.per_model or need_milli <= 0:
            return None, None
        own = quotas.get(pod.queue) if pod.queue is not None else None
        keepers = [q for q in quotas if not q.lend and q.name != pod.queue]
        usage = self.quota_usage()
        state = self.state
        n = state.size
        free = (state.gpu_milli_cap[:n] - state.gpu_milli_used[:n]) * state.schedulable[:n]
        kept_total = sum(max(0, q.min_milli - usage.get(q.name, 0)) for q in keepers)
        if kept_total and int(free.sum()) - need_milli < kept_total:
            return None, (f"the idle guaranteed share of queue(s) {', '.join(sorted(q.name for q in keepers))} "
                          f"({kept_total / MILLI_PER_CARD:g} GPUs) is kept for them (they do not lend)")
        if (own is None or not own.models) and not any(q.models for q in keepers):
            return None, None
        by_model = self.quota_model_usage()
        model_free = np.bincount(state.model_idx[:n] + 1, free, minlength=len(state.models) + 1)
        allowed: dict[str, int] = {}
        reasons: list[str] = []
        for m, model in enumerate(state.models):
            if pod.models is not None and model.name not in pod.models:
                continue
            share = own.model(model.name) if own is not None else None
            cap = own.model_cap_milli(share) if own is not None and share is not None else None
            used = by_model.get((pod.queue or "", model.name), 0)
            if own is not None and cap is not None and used + need_milli > cap:
                reasons.append(f"{model.name}: queue {pod.queue} at its {_cap_name(own)} there "
                               f"({used / MILLI_PER_CARD:g} of {cap / MILLI_PER_CARD:g} GPUs)")
                continue
            kept = sum(max(0, s.min_milli - by_model.get((q.name, model.name), 0))
                       for q in keepers for s in q.models if s.model == model.name)
            if kept and int(model_free[m + 1]) - need_milli < kept:
                reasons.append(f"{model.name}: {kept / MILLI_PER_CARD:g} idle GPUs kept for queues that do not lend")
                continue
            allowed[model.name] = m
        if not reasons:
            return None, None
        present = np.bincount(state.model_idx[:n] + 1, state.gpu_milli_cap[:n] * state.schedulable[:n],
                              minlength=len(state.models) + 1)
        if not any(present[m + 1] for m in allowed.values()):
            return None, "no card model left within the queue quotas: " + "; ".join(reasons)
        return frozenset(allowed), None

    def _wake_queue(self, queue: str) -> None:
        """A pod of `queue` left: its pods held at the maximum may go, and parked ones may now be owed their
        minimum (and so may reclaim what other queues borrow)."""
        waiting = self._quota_waiting.pop(queue, None)
        if waiting:
            for entry in waiting.values():
                self.queue.requeue(entry)
        if queue in self.rules.quotas:
            for entry in self.queue.parked:
                if entry.request.queue == queue:
                    taken = self.queue.take(entry.request.name)
                    if taken is not None:
                        self.queue.requeue(taken)

    def _owed(self, pod: PodRequest, usage: Mapping[str, int]) -> bool:
        """Whether `pod` fits within its queue's guaranteed minimum (so it may reclaim borrowed capacity)."""
        quota = self.rules.quotas.get(pod.queue) if pod.queue is not None else None
        return quota is not None and usage.get(quota.name, 0) + pod.gpu_milli_total <= quota.min_milli

    # ------------------------------------------------------------------ gangs
    def _attempt_gang(self, entry: QueuedPod) -> list[Outcome]:
        """Assemble the gang of `entry` from the queue; place it whole or not at all."""
        gang = entry.request.gang
        assert gang is not None
        now = self.now()
        wait = self._gangs.setdefault(gang, _GangWait(now))
        wait.members[entry.request.name] = entry
        for name in list(self._gang_siblings(gang)):
            sibling = self.queue.take(name)
            if sibling is not None:
                sibling.attempts += 1
                wait.members[name] = sibling
        members = sorted(wait.members.values(), key=lambda e: (-e.request.gpu_milli_total, e.order))
        size = max(e.request.gang_size for e in members)
        running = self._gang_cached.get(gang, 0)
        if len(members) + running < size:
            status = Status(Code.WAIT, (f"gang {gang}: {len(members) + running} of {size} members submitted",))
            return [Outcome(e.request, Decision(status), e.attempts, now - e.enqueued_at) for e in members]
        need = sum(e.request.gpu_milli_total for e in members)
        capacity = self.state.total_gpu_milli()
        if need > capacity:
            return self._fail_gang(gang, members, f"gang {gang} needs {need / MILLI_PER_CARD:g} GPUs, more than "
                                                  f"the whole cluster's {capacity / MILLI_PER_CARD:g}")
        queue = self.rules.quotas.get(members[0].request.queue) if members[0].request.queue is not None else None
        cap = queue.cap_milli if queue is not None else None
        if queue is not None and cap is not None and need > cap:
            return self._fail_gang(gang, members, f"gang {gang} needs {need / MILLI_PER_CARD:g} GPUs, more than "
                                                  f"queue {queue.name}'s {_cap_name(queue)} of "
                                                  f"{cap / MILLI_PER_CARD:g}")
        refusal = self._quota_refusal(members[0].request, need)
        if refusal is not None:
            del self._gangs[gang]
            for member in members:
                self._quota_waiting.setdefault(member.request.queue or "", {})[member.request.name] = member
            return [Outcome(e.request, Decision(Status(Code.WAIT, (refusal,))), e.attempts, now - e.enqueued_at)
                    for e in members]
        del self._gangs[gang]
        models, kept = self._quota_scope(members[0].request, need)
        short = self._gang_short(members, models) if kept is None and self.rules.queueing_hints else None
        if kept is not None:
            decision = Decision(Status.unschedulable(f"gang {gang}: {kept}"))
        elif short is not None:
            self.stats.gangs_screened += 1
            decision = Decision(Status.unschedulable(f"gang {gang} does not fit whole: {short}"))
        else:
            decision = self._place_gang(members, models)
        if decision.status.ok or decision.status.code is Code.WAIT:
            self.stats.gangs_placed += 1
            outcomes = []
            for member in members:
                binding = self.state.bindings.get(member.request.name)
                member_decision = Decision(decision.status, binding.assignment if binding else None,
                                           binding.node if binding else -1)
                outcomes.append(Outcome(member.request, member_decision, member.attempts, now - member.enqueued_at))
            return outcomes
        for member in members:
            # A member bound and then rolled back (the gang could not start whole) is the world's until it is
            # gone; one deleted meanwhile is gone for good: neither is queued again.
            name = member.request.name
            if name not in self.state.bindings and name not in self._gone:
                self.queue.park(member)
        return [Outcome(e.request, decision, e.attempts, now - e.enqueued_at) for e in members]

    def _fail_gang(self, gang: str, members: Sequence[QueuedPod], reason: str) -> list[Outcome]:
        """A gang that can never run: every member fails through the port with `reason`."""
        del self._gangs[gang]
        self.stats.gangs_failed += 1
        now = self.now()
        for member in members:
            self.port.fail_pod(member.request.name, reason)
        return [Outcome(e.request, Decision(Status.unschedulable(reason, resolvable=False)), e.attempts,
                        now - e.enqueued_at) for e in members]

    def _gang_siblings(self, gang: str) -> list[str]:
        return [e.request.name for e in self.queue.entries() if e.request.gang == gang]

    def _blocks(self) -> list[np.ndarray | None]:
        """Node masks of the network blocks with the most idle GPUs first, then None (anywhere)."""
        label = self.rules.network_block_label
        state = self.state
        names = [dict(spec.labels).get(label) for spec in state.nodes]
        if not any(names):
            return [None]
        idle = state.idle_cards[: state.size]
        free: dict[str, int] = {}
        for index, name in enumerate(names):
            if name is not None:
                free[name] = free.get(name, 0) + int(idle[index])
        ranked = sorted(free, key=lambda b: (-free[b], b))[: self.rules.max_blocks_tried]
        labels = np.array([n or "" for n in names])
        return [labels == block for block in ranked] + [None]

    def _decide_member(self, pod: PodRequest, within: np.ndarray | None,
                       placed: list[tuple[QueuedPod, Decision]]) -> tuple[Decision, list[Binding]]:
        """A gang member goes beside the members placed so far (their nodes, their NVLink groups) if it
        can, else anywhere in `within`."""
        near: dict[int, frozenset[int]] = {}
        for _, decision in placed:
            if decision.assignment is not None and decision.node >= 0:
                cards = frozenset(share.card for share in decision.assignment.cards)
                near[decision.node] = near.get(decision.node, frozenset()) | cards
        if near and pod.gpu is not None:
            beside = np.zeros(self.state.size, np.bool_)
            beside[list(near)] = True
            if within is not None:
                beside &= within
            if beside.any():
                decision, cleared = self._decide(pod, beside, near)
                if decision.assignment is not None:
                    return decision, cleared
        return self._decide(pod, within, near)

    def _gang_short(self, members: Sequence[QueuedPod], models: frozenset[str] | None) -> str | None:
        """Why the gang cannot fit whole even if every pod it may preempt were gone, or None when it might (so
        the trial placement is worth running). An upper bound per node on the members it could hold (CPU,
        memory, cards; `preemption.room_after_evictions`) over the nodes the unresolvable filters and the
        nominations leave the gang: when those rooms add up to fewer than its members, no trial can place it.
        Sound because a trial only places members where a node's free capacity, or what its victims (eligible
        pods, or the backfill past-backfill pods clear) free, holds them; members placed earlier in the trial
        take room, never add it."""
        requests = [_within_models(m.request, models) for m in members]
        first = max(requests, key=lambda r: r.priority)
        if any(r.queue != first.queue for r in requests):
            return None
        rows = self.state.pod_table.pods
        if self.rules.preemption and first.preempts and rows.count:
            eligible = self._victim_rules(first, []).eligible
        else:
            eligible = np.zeros(rows.count, np.bool_)
        room = self._gang_room(requests, first, eligible, self._held(first))
        if room is None or room[0] >= len(requests):
            return None
        return (f"{len(requests)} members, room for at most {room[0]} on the {room[1]} node(s) its filters "
                f"leave it, even with every pod it may preempt gone")

    def _gang_room(self, requests: Sequence[PodRequest], first: PodRequest, eligible: np.ndarray,
                   scope: np.ndarray | None) -> tuple[int, int] | None:
        """(an upper bound on how many of `requests` fit at once, the nodes their filters leave) if every pod
        `eligible` marks (rows of the cache's pod table; for `first`, the member that may evict the most) and,
        past the backfill, every backfill pod were gone; only nodes in `scope` (None: all). None: no bound for
        their GPU form."""
        state = self.state
        n = state.size
        rows = state.pod_table.pods
        eligible = eligible[: rows.count] & rows.live[: rows.count]
        if self._past_backfill(first) and self._backfill_priority is not None:  # the backfill it clears
            eligible = eligible | (rows.live[: rows.count] & (rows.priority[: rows.count] <= self._backfill_priority))
        room = np.zeros(n, np.int64)
        usable = np.zeros(n, np.bool_)
        seen: set[object] = set()
        for request in requests:
            key = shape_key(request)
            if key in seen:
                continue
            seen.add(key)
            bound = room_after_evictions(state, eligible, request)
            if bound is None:
                return None
            nodes = static_nodes(state, request)
            np.maximum(room, np.where(nodes, bound, 0), out=room)
            usable |= nodes
        if scope is not None:
            room[~scope[:n]] = 0
        return int(np.minimum(room, len(requests)).sum()), int(usable.sum())

    def _members_short(self, pod: PodRequest, left: Sequence[QueuedPod], models: frozenset[str] | None,
                       rules: VictimRules, scope: np.ndarray | None) -> str | None:
        """Mid-trial, before `pod` (the first of the members `left`) searches for victims: why the members left
        cannot all fit now (the room bound of `_gang_room` on the trial's cache, with `pod`'s victim rules), or
        None. Only for members asking alike at one priority and queue: then the later members may evict no
        more than `pod` (their queue's usage only grows in the trial, so what it may reclaim only shrinks)."""
        if not self.rules.queueing_hints or len(left) < 2:
            return None
        requests = [_within_models(m.request, models) for m in left]
        if any((r.priority, r.queue, r.gpu_milli_total) != (pod.priority, pod.queue, pod.gpu_milli_total)
               for r in requests):
            return None
        room = self._gang_room(requests, pod, rules.eligible, scope)
        if room is None or room[0] >= len(requests):
            return None
        return f"room for at most {room[0]} of the {len(requests)} members left, even with every pod they may " \
               "evict gone"

    def _place_gang(self, members: list[QueuedPod], models: frozenset[str] | None = None) -> Decision:
        """Trial-place every member in the cache (preempting if allowed); commit all or undo all. `models`:
        the card models the gang's queue quota leaves it (None: any)."""
        last = Decision(Status.unschedulable("no members"))
        for within in self._blocks():
            placed: list[tuple[QueuedPod, Decision]] = []
            plans: list[PreemptionPlan] = []
            victims: list[Binding] = []
            failed = False
            for member in members:
                pod = _within_models(member.request, models)
                decision, cleared = self._decide_member(pod, within, placed)
                if cleared:
                    victims.extend(cleared)
                    plans.append(self._plan(pod, decision, cleared))
                if decision.assignment is None and self._may_preempt(pod, decision):
                    self.stats.attempts += 1
                    held = self._held(pod)
                    scope = held if within is None else within if held is None else within & held
                    rules = self._victim_rules(pod, victims)
                    short = self._members_short(pod, members[len(placed):], models, rules, scope)
                    result = PreemptionResult(None, short) if short is not None else \
                        self.preemption.plan(pod, self.state, rules, decision.diagnosis, within=scope)
                    if result.plan is not None:
                        victims.extend(self._release(v.pod) for v in result.plan.victims)
                        plans.append(result.plan)
                        decision = result.plan.decision
                    else:
                        decision = Decision(Status.unschedulable(
                            f"{decision.status.message} Preemption: {result.reason}."), None, -1, decision.diagnosis)
                if decision.assignment is None:
                    last = Decision(Status.unschedulable(f"gang {pod.gang} does not fit whole: member {pod.name}: "
                                                         f"{decision.status.message}"), None, -1, decision.diagnosis)
                    failed = True
                    break
                self._place(member.request, decision.assignment)
                placed.append((member, decision))
            if not failed:
                return self._commit(placed, plans, victims)
            for member, _ in reversed(placed):  # release partial reservations, put victims back
                self._release(member.request.name)
            for binding in reversed(victims):
                self._place(binding.request, binding.assignment)
        return last


_NO_MODEL_LEFT = "(no model within the queue quota)"
_ANY_NAME = "*"
"""The name of every memoised request (`Scheduler._attempt_once`): pods differing in name only decide alike."""


def _failed(decision: Decision) -> bool:
    """Whether an attempt ended with nothing reserved or bound (not placed, not nominated, not held)."""
    return not decision.status.ok and decision.status.code is not Code.WAIT


def _cap_name(quota: QueueQuota) -> str:
    return "maximum" if quota.borrow else "minimum (it does not borrow)"


def _within_models(request: PodRequest, models: frozenset[str] | None) -> PodRequest:
    """`request` allowed only `models` (None: unchanged), as the framework sees it; never what is bound. A gang
    member whose own models are all outside them gets a model no card has, so it is refused a model mismatch."""
    if models is None:
        return request
    if request.models is not None:
        models = models & request.models or frozenset({_NO_MODEL_LEFT})
    return replace(request, models=models)
