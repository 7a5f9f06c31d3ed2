"""Preemption: when a pod fits nowhere, find one node and the fewest, cheapest victims that make it fit.

Like kube-scheduler's DefaultPreemption, victims are found by what-if: on each candidate node every
eligible pod is removed, the pod's filters are run, and then the victims are given back one by one
("reprieved"), most valuable first, as long as the pod still fits. Two things are our own:

- a vectorised screen over the pod table (`ClusterState.pod_table`) keeps only nodes where removing every
  eligible pod could make room (per-card compute and memory, idle cards, CPU, memory), and ranks them;
- the what-if runs on the scheduler's own state, in place, for all candidates at once (one filter pass per
  reprieve round), and puts every pod back exactly (`release` restores exactly).

Victims on fractional cards are reprieved smallest first within a priority, so a preemptor frees what it
needs on one card and not a whole card. Nodes are ranked by fewest victims, then the lowest highest victim
priority, then the least work lost.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuplane.model import Binding, ClusterState, Fraction, MigSlice, PodRequest, WholeCards
from gpuplane.scheduler.framework import CycleState, Decision, Diagnosis, Framework

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]
NO_VICTIMS = "no pod may be preempted for it"


@dataclass(frozen=True, slots=True)
class Victim:
    pod: str
    priority: int
    work_lost_gpu_s: float
    """GPU-seconds since the victim's last checkpoint: what evicting it throws away."""


class VictimOrder(enum.Enum):
    """How candidate nodes are ranked by their victims (smaller first).

    FEWEST_FIRST: fewest victims, then the lowest highest-victim priority, then the lowest priority sum,
    then the least work lost. LOWEST_PRIORITY_FIRST (kube-scheduler's order): the lowest highest-victim
    priority, then fewest victims, then the priority sum, then work lost; it spends low-priority backfill
    before it touches a pod of a higher class, even if that takes more victims.
    """

    FEWEST_FIRST = "fewest-first"
    LOWEST_PRIORITY_FIRST = "lowest-priority-first"


def victim_rank(victims: Sequence[Victim], order: VictimOrder) -> tuple[int, int, int, float]:
    priorities = [v.priority for v in victims]
    top = max(priorities, default=-(2**62))
    lost = sum(v.work_lost_gpu_s for v in victims)
    if order is VictimOrder.FEWEST_FIRST:
        return (len(victims), top, sum(priorities), lost)
    return (top, len(victims), sum(priorities), lost)


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """Evict `victims` on `node`; then `decision.assignment` fits there (the nominated placement)."""

    pod: PodRequest
    node: int
    decision: Decision
    victims: tuple[Victim, ...]


@dataclass(frozen=True, slots=True)
class VictimRules:
    """What the scheduler allows preemption to take, supplied per preemptor.

    `eligible`: per row of `state.pod_table.pods`, whether that pod may be evicted for this preemptor
    (strictly lower priority, or borrowing quota the preemptor's queue is owed). `work_lost`: GPU-seconds
    a victim would lose. `refuse`: a reason a victim set may not be evicted together (a disruption budget
    or a queue's guaranteed minimum), or None. `protected`: victims that a budget guards; they are given
    back first in the reprieve, so a node keeps them whenever other victims will do.
    """

    eligible: BoolArray
    work_lost: Callable[[Binding], float]
    refuse: Callable[[Sequence[Binding]], str | None]
    protected: Callable[[Binding], bool] = lambda binding: False


@dataclass(slots=True)
class PreemptionResult:
    plan: PreemptionPlan | None
    reason: str
    candidates: int = 0
    """Nodes that passed the screen; at most `max_candidates` of them were tried."""


class Preemption:
    def __init__(self, framework: Framework, *, max_candidates: int = 16,
                 order: VictimOrder = VictimOrder.FEWEST_FIRST) -> None:
        self.framework = framework
        self.max_candidates = max_candidates
        self.order = order

    def rank(self, victims: Sequence[Victim]) -> tuple[int, int, int, float]:
        return victim_rank(victims, self.order)

    def plan(self, pod: PodRequest, state: ClusterState, rules: VictimRules,
             diagnosis: Diagnosis | None = None, *, within: BoolArray | None = None) -> PreemptionResult:
        """The best plan for `pod`, or None with the reason. `state` is left exactly as it was."""
        if not pod.preempts:
            return PreemptionResult(None, "preemption policy is Never")
        table = state.pod_table.pods
        eligible = rules.eligible[: table.count] & table.live[: table.count]
        if not eligible.any():
            return PreemptionResult(None, NO_VICTIMS)
        levels: list[tuple[BoolArray, BoolArray | None]] = [(eligible, None)]
        if self.order is VictimOrder.LOWEST_PRIORITY_FIRST:
            # Try the lowest priorities alone first: a plan found with victims up to priority p beats any
            # plan that needs a victim above p, however few victims it takes. A level only tries nodes that
            # hold a pod of that very priority: the others were tried, with the same victims, a level below.
            priority = table.priority[: table.count]
            distinct = np.unique(priority[eligible]).tolist()
            levels = []
            for k, level in enumerate(distinct):
                fresh = None
                if k:
                    rows = np.flatnonzero(eligible & (priority == level))
                    fresh = np.bincount(table.node[rows], minlength=state.size)[: state.size] > 0
                levels.append((eligible & (priority <= level), fresh))
        reason = "no node would fit it even with every eligible pod evicted"
        screened_total = 0
        for allowed, fresh in levels:
            screened = self._screen(pod, state, allowed, diagnosis, within)
            if fresh is not None:
                screened &= fresh
            candidates = np.flatnonzero(screened)
            if not len(candidates):
                continue
            screened_total = max(screened_total, len(candidates))
            order = self._order_candidates(state, allowed, candidates)
            tried = candidates[order[: self.max_candidates]]
            plans, refusals = self._what_if(pod, state, allowed, tried, rules)
            if plans:
                return PreemptionResult(plans[0], "", len(candidates))
            reason = refusals[0] if refusals else "no candidate node fits it after evictions"
        return PreemptionResult(None, reason, screened_total)

    # ------------------------------------------------------------------ screen
    def _screen(self, pod: PodRequest, state: ClusterState, eligible: BoolArray, diagnosis: Diagnosis | None,
                within: BoolArray | None) -> BoolArray:
        """Nodes where evicting every eligible pod could make room: an upper bound, vectorised."""
        n = state.size
        freed = _Freed(state, eligible)
        ok = freed.holders > 0
        if within is not None:
            ok &= within[:n]
        if diagnosis is not None and diagnosis.unresolvable:
            ok &= ~np.isin(diagnosis.reason_of, list(diagnosis.unresolvable))
        ok &= (freed.cpu >= pod.cpu_milli) & (freed.mem >= pod.memory_mib)
        gpu = pod.gpu
        if gpu is None or not ok.any():
            return ok
        if isinstance(gpu, WholeCards):
            ok &= freed.idle_cards().sum(axis=1) >= gpu.count
        elif isinstance(gpu, Fraction):
            ok &= freed.card_fits(gpu)[0].sum(axis=1) >= gpu.count
        elif isinstance(gpu, MigSlice):
            ok &= state.card_mig_allowed[:n].any(axis=1)
        return ok

    def _order_candidates(self, state: ClusterState, eligible: BoolArray, candidates: IntArray) -> IntArray:
        """Order candidates by a cheap guess of their victims (eligible pods on the node and the highest
        eligible priority there, in the victim order's precedence), then node index."""
        pods = state.pod_table.pods
        rows = np.flatnonzero(eligible)
        n = state.size
        count = np.bincount(pods.node[rows], minlength=n)[:n]
        top = np.full(n, np.iinfo(np.int64).min, np.int64)
        np.maximum.at(top, pods.node[rows], pods.priority[rows])
        if self.order is VictimOrder.FEWEST_FIRST:
            keys = (candidates, top[candidates], count[candidates])
        else:
            keys = (candidates, count[candidates], top[candidates])
        order: IntArray = np.lexsort(keys)
        return order

    # ------------------------------------------------------------------ what-if
    def _what_if(self, pod: PodRequest, state: ClusterState, eligible: BoolArray, nodes: IntArray,
                 rules: VictimRules) -> tuple[list[PreemptionPlan], list[str]]:
        """Victims per candidate node by remove-all-then-reprieve, all nodes at once; the best plan."""
        table = state.pod_table
        removed: dict[int, list[Binding]] = {}
        for node in nodes.tolist():
            names = sorted(name for name in state.node_pods[node] if eligible[table.row_of[name][0]])
            removed[node] = [state.release(name) for name in names]
        refusals: list[str] = []
        ranked: list[tuple[tuple[int, int, int, float], int, tuple[Victim, ...], list[Binding]]] = []
        try:
            fits = self._fits(pod, state)
            live = [node for node in removed if fits[node]]
            # Reprieve order: keep the most valuable first (higher priority, then smaller so that fewer
            # victims go, then more work at stake).
            queues = {node: sorted(removed[node], key=lambda b: (not rules.protected(b), -b.request.priority,
                                                                 b.assignment.gpu_milli, -rules.work_lost(b),
                                                                 b.request.name))
                      for node in live}
            victims: dict[int, list[Binding]] = {node: [] for node in live}
            while any(queues.values()):
                trial: dict[int, Binding] = {}
                for node, pending in queues.items():
                    if pending:
                        binding = pending.pop(0)
                        state.place(binding.request, binding.assignment, check=False)
                        trial[node] = binding
                fits = self._fits(pod, state)
                for node, binding in trial.items():
                    if not fits[node]:
                        state.release(binding.request.name)
                        victims[node].append(binding)
            for node in live:
                refusal = rules.refuse(victims[node])
                if refusal is not None:
                    refusals.append(refusal)
                    continue
                chosen = tuple(Victim(b.request.name, b.request.priority, rules.work_lost(b)) for b in victims[node])
                ranked.append((self.rank(chosen), node, chosen, victims[node]))
            ranked.sort(key=lambda item: (item[0], item[1]))
            # Victims of the other nodes go back first, so each final check sees one node's evictions.
            for bindings in removed.values():
                for binding in bindings:
                    if binding.request.name not in state.bindings:
                        state.place(binding.request, binding.assignment, check=False)
            for _, node, chosen, gone in ranked:
                for binding in gone:
                    state.release(binding.request.name)
                try:
                    decision = self.framework.schedule(pod, state, within=_only(state.size, node))
                finally:
                    for binding in gone:
                        state.place(binding.request, binding.assignment, check=False)
                if decision.assignment is not None:
                    return [PreemptionPlan(pod, node, decision, chosen)], refusals
        finally:
            for bindings in removed.values():
                for binding in bindings:
                    if binding.request.name not in state.bindings:
                        state.place(binding.request, binding.assignment, check=False)
        return [], refusals

    def _fits(self, pod: PodRequest, state: ClusterState) -> BoolArray:
        alive, _ = self.framework.find_nodes(CycleState(), pod, state, diagnose=False)
        return alive


def _only(size: int, node: int) -> BoolArray:
    mask = np.zeros(size, np.bool_)
    mask[node] = True
    return mask



UNBOUNDED = np.iinfo(np.int64).max // 4


class _Freed:
    """A node's resources if every eligible pod were evicted (free now plus what the eligible pods hold)."""

    def __init__(self, state: ClusterState, eligible: BoolArray) -> None:
        n, width = state.size, state.width
        pods, shares = state.pod_table.pods, state.pod_table.shares
        self.state = state
        rows = np.flatnonzero(eligible)
        nodes_of = pods.node[rows]
        self.holders = np.bincount(nodes_of, minlength=n)[:n]
        """Eligible pods per node."""
        self.cpu = state.cpu_free[:n] + np.bincount(nodes_of, pods.cpu[rows], minlength=n)[:n].astype(np.int64)
        self.mem = state.mem_free[:n] + np.bincount(nodes_of, pods.mem[rows], minlength=n)[:n].astype(np.int64)
        self._srows = np.flatnonzero(shares.live[: shares.count] & eligible[shares.pod[: shares.count]]
                                     if shares.count else np.zeros(0, np.bool_))
        self._cells = shares.node[self._srows] * width + shares.card[self._srows]
        size = n * width
        self.kept = state.card_holders[:n] - np.bincount(self._cells, minlength=size)[:size].reshape(n, width)
        """Holders per card that would stay."""

    def idle_cards(self) -> BoolArray:
        """Cards a whole-card pod could take."""
        n = self.state.size
        result: BoolArray = self.state.card_valid[:n] & (self.kept == 0) & ~self.state.card_mig_pinned[:n]
        return result

    def _per_card(self, weights: IntArray) -> IntArray:
        n, width = self.state.size, self.state.width
        summed = np.bincount(self._cells, weights, minlength=n * width)[: n * width].reshape(n, width)
        result: IntArray = summed.astype(np.int64)
        return result

    def card_fits(self, gpu: Fraction) -> tuple[BoolArray, IntArray, IntArray, IntArray]:
        """(cards that could take one share of `gpu`, their compute milli, memory and the memory it needs)."""
        state, shares = self.state, self.state.pod_table.shares
        n, width = state.size, state.width
        # compute of `card_milli_free` (the table holds 0 for an offline-oversold share, which frees none of it):
        # an offline preemptor on an offline-oversold node is screened against it too, a conservative screen
        milli = state.card_milli_free[:n] + self._per_card(shares.milli[self._srows])
        memory = state.card_mem_free[:n] + self._per_card(shares.mem[self._srows])
        need_mem = state.card_mem_phys[:n] * gpu.memory_pct // 100 if gpu.memory_pct else \
            np.full((n, width), gpu.memory_mib, np.int64)
        plain = state.card_valid[:n] & ~state.card_mig_pinned[:n] & ~state.card_foreign[:n] \
            & ~((state.card_mig[:n] | state.card_whole[:n]) & (self.kept > 0))
        fits: BoolArray = plain & (milli >= gpu.compute_milli) & (memory >= need_mem)
        return fits, milli, memory, need_mem

    def card_slots(self, gpu: Fraction) -> IntArray:
        """Per card, how many shares of `gpu` it could hold (capped at 1,024 a card); 0 where none fits."""
        fits, milli, memory, need_mem = self.card_fits(gpu)
        slots = np.full(fits.shape, 1024, np.int64)
        if gpu.compute_milli:
            np.minimum(slots, milli // gpu.compute_milli, out=slots)
        np.minimum(slots, np.where(need_mem > 0, memory // np.maximum(need_mem, 1), 1024), out=slots)
        slots[~fits] = 0
        return slots


def room_after_evictions(state: ClusterState, eligible: BoolArray, pod: PodRequest) -> IntArray | None:
    """Per node, an upper bound on how many pods of `pod`'s shape would fit if every `eligible` pod (a row mask
    of `state.pod_table.pods`) were evicted: CPU, memory and cards only (the other filters only take nodes
    away). None when no bound is known for the pod's GPU form (a MIG slice)."""
    freed = _Freed(state, eligible)
    room = np.full(state.size, UNBOUNDED, np.int64)
    if pod.cpu_milli:
        np.minimum(room, np.maximum(freed.cpu, 0) // pod.cpu_milli, out=room)
    if pod.memory_mib:
        np.minimum(room, np.maximum(freed.mem, 0) // pod.memory_mib, out=room)
    gpu = pod.gpu
    if isinstance(gpu, WholeCards):
        if gpu.count:
            np.minimum(room, freed.idle_cards().sum(axis=1) // gpu.count, out=room)
    elif isinstance(gpu, Fraction):
        np.minimum(room, freed.card_slots(gpu).sum(axis=1) // max(gpu.count, 1), out=room)
    elif gpu is not None:
        return None
    return room
