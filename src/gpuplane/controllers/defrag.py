"""The defragmentation controller (a descheduler): move a few fractional pods so a pending large pod gets cards.

Pods leave, and the fractional pods that stay are scattered: a cluster can hold enough free GPU for a
whole-card pod in total and still have no card free for it. Every `tick` the controller looks at the large
pending pods (whole cards, or a fraction of at least `large_milli` per card) that fit nowhere now, and plans
(`plan_moves`, a pure function over the scheduler's cache) the fewest moves of fractional pods that free the
cards one of them needs, each mover with a destination elsewhere. It never moves:

- a pod of higher priority than the pod it frees cards for;
- a pod annotated `gpuplane.io/no-move: "true"`, a pod no controller would re-create (no workload), a gang
  member, a pod already terminating, a reservation;
- more pods of a workload than its disruption budget allows (`min_available`, the PodDisruptionBudget's
  minAvailable that the scheduler's rules hold: the port has no PDB read of its own, and the Eviction API
  refuses an eviction that would break one, which the scheduler's nomination undoes);
- more than `max_moves_per_hour` pods in any hour.

A plan is carried out through the scheduler's own nomination (`Scheduler.nominate`, the mechanism preemption
uses while victims terminate): the freed cards are reserved for the pending pod in the cache at once, its
node is held for pods of its priority or lower, the movers are evicted through the port with their class's
grace, and the pod is bound when the last mover is gone, so no later arrival takes the freed cards. Each
mover's planned room is on cards already in use (a move never spends a free card) and is held in the cache
while the mover terminates (an assumed placeholder, `<pod>~room`). A moved pod is created again by its owner;
with `recreate` (a world with no owner controllers, the simulator) the controller creates it again itself,
under the same name, once the old pod is deleted, and binds it to its planned room if that is still free.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gpuplane.model import (
    MILLI_PER_CARD,
    Assignment,
    Binding,
    ClusterState,
    Fraction,
    PlacementError,
    PodRequest,
    WholeCards,
)
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, PodInfo, PodPhase, Status
from gpuplane.scheduler.framework import CycleState, Framework
from gpuplane.scheduler.scheduler import Scheduler

NO_MOVE_ANNOTATION = "gpuplane.io/no-move"
"""A pod annotated `"true"` is never moved."""
MOVE_REASON = "defragmentation"
"""The eviction reason of a moved pod."""
HOUR_S = 3600.0


@dataclass(frozen=True, slots=True)
class DefragPolicy:
    max_moves_per_hour: int = 12
    large_milli: int = MILLI_PER_CARD
    """A fractional pod asking for at least this much of each card counts as large."""
    max_nodes_tried: int = 8
    """Candidate nodes per pending pod given a full what-if (after a cheap count of movers), fewest first."""
    max_pods_planned: int = 4
    """Pending pods one tick frees cards for."""
    max_pods_tried: int = 32
    """Pending pods one tick tries to plan for (the rest wait for the next tick)."""


@dataclass(frozen=True, slots=True)
class Move:
    pod: str
    priority: int
    source: str
    destination: Assignment
    """Where the planner found room for it (the scheduler decides where its new pod goes)."""
    gpu_milli: int


@dataclass(frozen=True, slots=True)
class Freed:
    """Cards freed on one node for one pending pod, by moving `moves` away."""

    pod: str
    priority: int
    assignment: Assignment
    """The pending pod's cards once the movers are gone (what the nomination reserves)."""
    moves: tuple[Move, ...]
    why: str


@dataclass(frozen=True, slots=True)
class DefragPlan:
    freed: tuple[Freed, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    """(pending pod, why no plan frees cards for it)"""

    @property
    def moves(self) -> int:
        return sum(len(f.moves) for f in self.freed)


@dataclass(frozen=True, slots=True)
class Movable:
    """Which running pods may move: `pods` (names) and their workloads' remaining disruption allowance."""

    pods: frozenset[str]
    allowance: Mapping[str, int] = field(default_factory=dict)
    """Per workload with a budget: how many of its pods may be disrupted now (running minus minAvailable)."""
    at_stake: Mapping[str, float] = field(default_factory=dict)
    """Per pod, the GPU-seconds a move would lose (work since its last checkpoint); absent: 0."""


def is_large(request: PodRequest, large_milli: int = MILLI_PER_CARD) -> bool:
    gpu = request.gpu
    return isinstance(gpu, WholeCards) or (isinstance(gpu, Fraction) and gpu.compute_milli >= large_milli)


def movable_pods(pods: Sequence[PodInfo], min_available: Mapping[str, int], now: float = 0.0) -> Movable:
    """The running fractional pods that a descheduler may move, read from the port's pod list, and what a
    move of each would lose (the time since its last checkpoint, by its `checkpoint_every_s`, as the
    scheduler's preemption counts it)."""
    running: dict[str, int] = {}
    names: set[str] = set()
    at_stake: dict[str, float] = {}
    for info in pods:
        request = info.request
        if info.phase is not PodPhase.RUNNING:
            continue
        if request.workload is not None:
            running[request.workload] = running.get(request.workload, 0) + 1
        if (isinstance(request.gpu, Fraction) and request.workload is not None and request.gang is None
                and dict(info.annotations).get(NO_MOVE_ANNOTATION, "").lower() != "true"):
            names.add(info.name)
            ran = max(0.0, now - (info.bound_at if info.bound_at is not None else now))
            every = request.checkpoint_every_s
            since = math.fmod(ran, every) if every > 0 else ran
            at_stake[info.name] = since * request.gpu_milli_total / MILLI_PER_CARD
    allowance = {w: max(0, running.get(w, 0) - need) for w, need in min_available.items()}
    return Movable(frozenset(names), allowance, at_stake)


def _only(size: int, node: int, *, invert: bool = False) -> np.ndarray:
    mask = np.zeros(size, np.bool_)
    mask[node] = True
    return ~mask if invert else mask


def _card_cost(state: ClusterState, node: int, need_milli: int, whole: bool, holders: Mapping[int, list[Binding]],
               movable: Callable[[Binding], bool]) -> list[tuple[int, list[Binding]]]:
    """Per usable card of `node`: the fewest movers that leave what the pod needs on it. A whole card needs
    every holder gone; a fraction needs `need_milli` free, the largest movable holders going first. A card
    where a holder that must stay is in the way is left out."""
    out: list[tuple[int, list[Binding]]] = []
    for card in range(min(state.width, len(state.card_valid[node]))):
        if not state.card_valid[node][card] or state.card_mig_pinned[node][card]:
            continue
        here = holders.get(card, [])
        if whole:
            if all(movable(b) for b in here):
                out.append((card, list(here)))
            continue
        free = int(state.card_milli_free[node][card])
        movers: list[Binding] = []
        for binding in sorted((b for b in here if movable(b)),
                              key=lambda b: (-_milli_on(b, card), b.request.name)):
            if free >= need_milli:
                break
            movers.append(binding)
            free += _milli_on(binding, card)
        if free >= need_milli:
            out.append((card, movers))
    return out


def _milli_on(binding: Binding, card: int) -> int:
    return sum(share.compute_milli for share in binding.assignment.cards if share.card == card)


def plan_moves(state: ClusterState, pending: Sequence[PodRequest], movable: Movable, framework: Framework,
               *, budget: int, policy: DefragPolicy = DefragPolicy(),
               held: np.ndarray | None = None) -> DefragPlan:
    """The fewest moves that free cards for each of `pending` (in the order given), within `budget` moves.

    Per pending pod, nodes are ranked by the movers they would need (per card, the fewest holders to move;
    the pod's cards the cheapest ones), then the highest mover priority, then the work the moves would lose
    (`movable.at_stake`), and the cheapest are given a full what-if: the movers are released,
    each must fit on another node (the framework's filters), then the pod must fit on the node. The first
    node that passes, fewest movers first, is the plan; it is kept in the state while the next pending pod
    plans, so two plans never count on the same room. `state` is left exactly as it was. `held`: nodes the
    pending pods may use (False: held for another nomination)."""
    freed: list[Freed] = []
    skipped: list[tuple[str, str]] = []
    applied: list[tuple[list[Binding], list[Binding]]] = []
    allowance = dict(movable.allowance)
    moved: set[str] = set()
    failed: dict[object, str] = {}
    left = budget
    try:
        for pod in pending[: policy.max_pods_tried]:
            if left <= 0 or len(freed) >= policy.max_pods_planned:
                skipped.append((pod.name, "move budget spent" if left <= 0 else "enough plans this tick"))
                continue
            shape = (pod.cpu_milli, pod.memory_mib, pod.gpu, pod.models, pod.priority, pod.node_selector,
                     pod.required_terms, pod.tolerations, pod.pools)
            if shape in failed:  # the same ask failed on the same state: it fails again
                skipped.append((pod.name, failed[shape]))
                continue
            result = _plan_one(state, pod, movable, moved, allowance, framework, left, policy, held)
            if isinstance(result, str):
                failed[shape] = result
                skipped.append((pod.name, result))
                continue
            failed.clear()
            plan, released, placed = result
            applied.append((released, placed))
            freed.append(plan)
            left -= len(plan.moves)
            for move in plan.moves:
                moved.add(move.pod)
                workload = state.bindings[move.pod].request.workload if move.pod in state.bindings else None
                if workload is not None and workload in allowance:
                    allowance[workload] -= 1
    finally:
        for released, placed in reversed(applied):
            for binding in reversed(placed):
                state.release(binding.request.name)
            for binding in reversed(released):
                state.place(binding.request, binding.assignment, check=False)
    return DefragPlan(tuple(freed), tuple(skipped))


def _plan_one(state: ClusterState, pod: PodRequest, movable: Movable, moved: set[str], allowance: dict[str, int],
              framework: Framework, budget: int, policy: DefragPolicy,
              held: np.ndarray | None) -> tuple[Freed, list[Binding], list[Binding]] | str:
    gpu = pod.gpu
    if isinstance(gpu, WholeCards):
        count, need, whole = gpu.count, MILLI_PER_CARD, True
    elif isinstance(gpu, Fraction):
        count, need, whole = gpu.count, gpu.compute_milli, False
    else:
        return "not a whole-card or fractional pod"
    if pod.gang is not None:
        return "a gang member (gangs are placed whole by the scheduler)"

    def may_move(binding: Binding) -> bool:
        request = binding.request
        if request.name not in movable.pods or request.name in moved or request.priority > pod.priority:
            return False
        workload = request.workload
        return workload is None or workload not in allowance or allowance[workload] > 0

    def stake(binding: Binding) -> float:
        return movable.at_stake.get(binding.request.name, 0.0)

    ranked: list[tuple[int, int, float, int, list[Binding]]] = []
    for node in range(state.size):
        if held is not None and not held[node]:
            continue
        holders: dict[int, list[Binding]] = {}
        for name in state.node_pods[node]:
            binding = state.bindings[name]
            for share in binding.assignment.cards:
                holders.setdefault(share.card, []).append(binding)
        costs = sorted(_card_cost(state, node, need, whole, holders, may_move),
                       key=lambda item: (len(item[1]), sum(stake(b) for b in item[1]), item[0]))
        if len(costs) < count:
            continue
        chosen: dict[str, Binding] = {}
        for _, movers in costs[:count]:
            for binding in movers:
                chosen[binding.request.name] = binding
        if not chosen:
            continue  # nothing to move: it fits as it is (the scheduler's job) or not for want of cards
        # The pod needs the node's CPU and memory too (most of the trace's unplaced pods fail on CPU): movable
        # pods the cards' movers leave behind go too, the largest CPU first, until both suffice.
        cpu = int(state.cpu_free[node]) + sum(b.request.cpu_milli for b in chosen.values())
        mem = int(state.mem_free[node]) + sum(b.request.memory_mib for b in chosen.values())
        extra = sorted((state.bindings[name] for name in state.node_pods[node] if name not in chosen
                        and isinstance(state.bindings[name].request.gpu, Fraction)
                        and may_move(state.bindings[name])),
                       key=lambda b: (-b.request.cpu_milli, -b.request.memory_mib, b.request.name))
        for binding in extra:
            if cpu >= pod.cpu_milli and mem >= pod.memory_mib:
                break
            chosen[binding.request.name] = binding
            cpu += binding.request.cpu_milli
            mem += binding.request.memory_mib
        if cpu < pod.cpu_milli or mem < pod.memory_mib:
            continue
        movers = sorted(chosen.values(), key=lambda b: b.request.name)
        if len(movers) > budget:
            continue  # nothing to move (it fits as it is, the scheduler's job) or over the budget
        by_workload: dict[str, int] = {}
        for binding in movers:
            workload = binding.request.workload
            if workload is not None and workload in allowance:
                by_workload[workload] = by_workload.get(workload, 0) + 1
        if any(allowance[w] < k for w, k in by_workload.items()):
            continue
        top = max(b.request.priority for b in movers)
        ranked.append((len(movers), top, sum(stake(b) for b in movers), node, movers))
    if not ranked:
        return "no node where movable pods free enough cards within the budget"
    ranked.sort(key=lambda item: item[:4])
    n = state.size
    roomiest = np.where(state.card_valid[:n] & ~state.card_mig_pinned[:n], state.card_milli_free[:n], -1).max(axis=1)
    tried = 0
    for _, _, _, node, movers in ranked:
        if tried >= policy.max_nodes_tried:
            break
        if not all(_room_elsewhere(state, roomiest, node, b.request) for b in movers):
            continue  # a screen: some mover has no card with its share free on any other node
        tried += 1
        result = _what_if(state, pod, node, movers, framework)
        if result is not None:
            assignment, placed = result
            moves = tuple(Move(b.request.name, b.request.priority, b.assignment.node, p.assignment,
                               b.assignment.gpu_milli) for b, p in zip(movers, placed, strict=True))
            why = (f"{len(moves)} fractional pod(s) moved off {state.nodes[node].name} free "
                   f"{len(assignment.cards)} card(s) for {pod.name}")
            return Freed(pod.name, pod.priority, assignment, moves, why), movers, [*placed, state.bindings[pod.name]]
    return "no candidate node whose movers all fit elsewhere"


def _room_elsewhere(state: ClusterState, roomiest: np.ndarray, node: int, request: PodRequest) -> bool:
    gpu = request.gpu
    milli = gpu.compute_milli if isinstance(gpu, Fraction) else MILLI_PER_CARD
    n = state.size
    ok = (roomiest >= milli) & (state.cpu_free[:n] >= request.cpu_milli) & (state.mem_free[:n] >= request.memory_mib)
    ok[node] = False
    return bool(ok.any())


def _destination(state: ClusterState, request: PodRequest, within: np.ndarray, framework: Framework,
                 tries: int = 4) -> Assignment | None:
    """Where a mover goes: the framework's choice among the allowed nodes, on cards already in use. A move
    that took a free card would spend the very thing it frees (a node the framework answers with a free
    card is left out and it chooses again)."""
    allowed = within.copy()
    for _ in range(tries):
        decision = framework.schedule(request, state, within=allowed)
        assignment = decision.assignment
        if assignment is None:
            return None
        node = state.node_index[assignment.node]
        if all(state.card_holders[node][share.card] > 0 for share in assignment.cards):
            return assignment
        allowed[node] = False
    return None


def _what_if(state: ClusterState, pod: PodRequest, node: int, movers: Sequence[Binding],
             framework: Framework) -> tuple[Assignment, list[Binding]] | None:
    """Release `movers`, find each a place off `node`, then place `pod` on `node`. On success the state keeps
    all of it (the caller restores); on failure the state is as it was."""
    for binding in movers:
        state.release(binding.request.name)
    placed: list[Binding] = []
    elsewhere = _only(state.size, node, invert=True)
    ok = False
    try:
        for binding in movers:
            assignment = _destination(state, binding.request, elsewhere, framework)
            if assignment is None:
                return None
            placed.append(state.place(binding.request, assignment))
        decision = framework.schedule(pod, state, within=_only(state.size, node))
        if decision.assignment is None:
            return None
        state.place(pod, decision.assignment)
        ok = True
        return decision.assignment, placed
    finally:
        if not ok:
            for binding in reversed(placed):
                state.release(binding.request.name)
            for binding in reversed(movers):
                state.place(binding.request, binding.assignment, check=False)


@dataclass(slots=True)
class DefragStats:
    ticks: int = 0
    plans: int = 0
    moves: int = 0
    refused: int = 0
    """Nominations the scheduler or the world refused (an eviction a budget forbade, say)."""
    move_times: list[float] = field(default_factory=list)


class DefragController:
    """Plan and carry out moves every `tick`; reads pods from the port, reserves through the scheduler."""

    def __init__(self, port: ClusterPort, scheduler: Scheduler, *, now: Callable[[], float],
                 policy: DefragPolicy = DefragPolicy(), min_available: Mapping[str, int] | None = None,
                 recreate: bool = False, seed: int = 0) -> None:
        self.port = port
        self.scheduler = scheduler
        self.now = now
        self.policy = policy
        self.min_available = scheduler.rules.min_available if min_available is None else min_available
        self.recreate = recreate
        self.framework = Framework(scheduler.framework.profile, np.random.default_rng([seed, 7]))
        """The planner's own framework: its tie-break draws never disturb the scheduler's."""
        self.stats = DefragStats()
        self._recent: deque[float] = deque()
        self._moving: dict[str, tuple[PodRequest, Assignment]] = {}
        """Moved pods not deleted yet, with their planned room (held until they are; with `recreate`, they are
        then created again)."""
        self._rooms: set[str] = set()
        """Moved pods whose planned room is held for them in the scheduler's cache."""
        self._placing: dict[str, Assignment] = {}
        """Moved pods created again, to be bound to their planned room if it is still free."""
        self.moved: set[str] = set()
        """Every pod the controller has moved (names)."""
        self.on_moved: Callable[[str], object] | None = None
        self._unsubscribe = port.watch(self._on_event)

    def close(self) -> None:
        self._unsubscribe()

    def budget_left(self) -> int:
        now = self.now()
        while self._recent and self._recent[0] <= now - HOUR_S:
            self._recent.popleft()
        return max(0, self.policy.max_moves_per_hour - len(self._recent))

    def pending_large(self, pods: Sequence[PodInfo]) -> list[PodRequest]:
        """Large pending pods that fit nowhere now and are not nominated already: highest priority first, then
        the fewest cards (they take the fewest moves, so the hour's budget starts the most pods), then oldest."""
        state = self.scheduler.state
        out: list[tuple[int, int, float, str, PodRequest]] = []
        for info in pods:
            request = info.request
            if info.phase is not PodPhase.PENDING or not is_large(request, self.policy.large_milli):
                continue
            if request.name in state.bindings or request.gang is not None:
                continue  # nominated (its cards held) or a gang
            alive, _ = self.framework.find_nodes(CycleState(), request, state, diagnose=False)
            if alive.any():
                continue  # it fits as it is: the scheduler's job
            gpu = request.gpu
            cards = gpu.count if isinstance(gpu, (WholeCards, Fraction)) else 0
            out.append((-request.priority, cards, info.created_at, request.name, request))
        return [item[4] for item in sorted(out, key=lambda item: item[:4])]

    def plan(self) -> DefragPlan:
        pods = self.port.list_pods()
        pending = self.pending_large(pods)
        budget = self.budget_left()
        if not pending or budget <= 0:
            return DefragPlan()
        movable = movable_pods(pods, self.min_available, self.now())
        return plan_moves(self.scheduler.state, pending, movable, self.framework, budget=budget,
                          policy=self.policy, held=_held_mask(self.scheduler, pending))

    def tick(self) -> DefragPlan:
        """Plan, then nominate each pending pod to its freed cards (which evicts its movers)."""
        self.stats.ticks += 1
        plan = self.plan()
        now = self.now()
        for freed in plan.freed:
            requests = {m.pod: (self.scheduler.state.bindings[m.pod].request, m.destination) for m in freed.moves}
            decision = self.scheduler.nominate(freed.pod, freed.assignment, [m.pod for m in freed.moves],
                                               reason=f"{MOVE_REASON}: {freed.why}")
            if not decision.status.ok and decision.assignment is None:
                self.stats.refused += 1
                continue
            self.stats.plans += 1
            for name, (request, destination) in requests.items():
                self._hold_room(name, request, destination)
                self.stats.moves += 1
                self.stats.move_times.append(now)
                self._recent.append(now)
                self.moved.add(name)
                self._moving[name] = (request, destination)
                if self.on_moved is not None:
                    self.on_moved(name)
        return plan

    def _hold_room(self, name: str, request: PodRequest, destination: Assignment) -> None:
        """Hold the planned room of a moved pod in the scheduler's cache while it terminates (an assumed
        placeholder, `<pod>~room`), so that its new pod finds it free."""
        try:
            self.scheduler.assume(replace(request, name=_room(name)), destination)
        except PlacementError:
            return
        self._rooms.add(name)

    def _free_room(self, name: str) -> None:
        if name in self._rooms:
            self._rooms.discard(name)
            self.scheduler.settle(_room(name), Status.error("the moved pod is back"))

    def _on_event(self, event: ClusterEvent) -> None:
        if event.pod is None:
            return
        name = event.pod.name
        if event.kind is EventKind.POD_DELETED and name in self._moving:
            request, destination = self._moving.pop(name)
            self._free_room(name)
            if self.recreate:
                self._placing[name] = destination
                if not self.port.create_pod(request).ok:
                    self._placing.pop(name, None)
        elif event.kind is EventKind.POD_ADDED and name in self._placing:
            # The scheduler (subscribed first) has queued it: bind it to the room the plan found, on cards
            # already in use, if that room is still free; else the scheduler places it as any pod.
            destination = self._placing.pop(name)
            if self.scheduler.state.check(destination, event.pod.request) is None:
                self.scheduler.nominate(name, destination, [], reason=MOVE_REASON)


def _room(pod: str) -> str:
    return f"{pod}~room"


def _held_mask(scheduler: Scheduler, pending: Sequence[PodRequest]) -> np.ndarray | None:
    """Nodes none of the pending pods may take: those held for an earlier nomination of equal or higher
    priority (the scheduler's own hold, for the lowest pending priority)."""
    if not pending:
        return None
    lowest = min(pending, key=lambda r: r.priority)
    return scheduler.held_nodes(lowest)


def moves_per_hour(times: Sequence[float], window: tuple[float, float]) -> float:
    start, end = window
    hours = (end - start) / HOUR_S
    return sum(1 for t in times if start <= t < end) / hours if hours > 0 and math.isfinite(hours) else 0.0


__all__ = [
    "MOVE_REASON",
    "NO_MOVE_ANNOTATION",
    "DefragController",
    "DefragPlan",
    "DefragPolicy",
    "DefragStats",
    "Freed",
    "Movable",
    "Move",
    "is_large",
    "movable_pods",
    "moves_per_hour",
    "plan_moves",
]
