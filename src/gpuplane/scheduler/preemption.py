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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuplane.model import Binding, ClusterState, Fraction, MigSlice, PodRequest, WholeCards
from gpuplane.scheduler.framework import CycleState, Decision, Diagnosis, Framework

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Victim:
    pod: str
    priority: int
    work_lost_gpu_s: float
    """GPU-seconds since the victim's last checkpoint: what evicting it throws away."""


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """Evict `victims` on `node`; then `decision.assignment` fits there (the nominated placement)."""

    pod: PodRequest
    node: int
    decision: Decision
    victims: tuple[Victim, ...]

    @property
    def rank(self) -> tuple[int, int, int, float]:
        """Smaller is better: fewest victims, lowest top priority, lowest priority sum, least work lost."""
        priorities = [v.priority for v in self.victims]
        return (len(self.victims), max(priorities, default=-(2**62)), sum(priorities),
                sum(v.work_lost_gpu_s for v in self.victims))


@dataclass(frozen=True, slots=True)
class VictimRules:
    """What the scheduler allows preemption to take, supplied per preemptor.

    `eligible`: per row of `state.pod_table.pods`, whether that pod may be evicted for this preemptor
    (strictly lower priority, or borrowing quota the preemptor's queue is owed). `work_lost`: GPU-seconds
    a victim would lose. `refuse`: a reason a victim set may not be evicted together (a disruption budget
    or a queue's guaranteed minimum), or None.
    """

    eligible: BoolArray
    work_lost: Callable[[Binding], float]
    refuse: Callable[[Sequence[Binding]], str | None]


@dataclass(slots=True)
class PreemptionResult:
    plan: PreemptionPlan | None
    reason: str
    candidates: int = 0
    """Nodes that passed the screen; at most `max_candidates` of them were tried."""


class Preemption:
    def __init__(self, framework: Framework, *, max_candidates: int = 16) -> None:
        self.framework = framework
        self.max_candidates = max_candidates

    def plan(self, pod: PodRequest, state: ClusterState, rules: VictimRules,
             diagnosis: Diagnosis | None = None, *, within: BoolArray | None = None) -> PreemptionResult:
        """The best plan for `pod`, or None with the reason. `state` is left exactly as it was."""
        if not pod.preempts:
            return PreemptionResult(None, "preemption policy is Never")
        table = state.pod_table.pods
        eligible = rules.eligible[: table.count] & table.live[: table.count]
        if not eligible.any():
            return PreemptionResult(None, "no pod may be preempted for it")
        screened = self._screen(pod, state, eligible, diagnosis, within)
        candidates = np.flatnonzero(screened)
        if not len(candidates):
            return PreemptionResult(None, "no node would fit it even with every eligible pod evicted")
        order = self._rank(pod, state, eligible, candidates)
        tried = candidates[order[: self.max_candidates]]
        plans, refusals = self._what_if(pod, state, eligible, tried, rules)
        if not plans:
            reason = refusals[0] if refusals else "no candidate node fits it after evictions"
            return PreemptionResult(None, reason, len(candidates))
        plans.sort(key=lambda p: (p.rank, p.node))
        return PreemptionResult(plans[0], "", len(candidates))

    # ------------------------------------------------------------------ screen
    def _screen(self, pod: PodRequest, state: ClusterState, eligible: BoolArray, diagnosis: Diagnosis | None,
                within: BoolArray | None) -> BoolArray:
        """Nodes where evicting every eligible pod could make room: an upper bound, vectorised."""
        n, width = state.size, state.width
        pods, shares = state.pod_table.pods, state.pod_table.shares
        rows = np.flatnonzero(eligible)
        nodes_of = pods.node[rows]
        ok = np.bincount(nodes_of, minlength=n)[:n] > 0
        if within is not None:
            ok &= within[:n]
        if diagnosis is not None and diagnosis.unresolvable:
            ok &= ~np.isin(diagnosis.reason_of, list(diagnosis.unresolvable))
        cpu = state.cpu_free[:n] + np.bincount(nodes_of, pods.cpu[rows], minlength=n)[:n]
        mem = state.mem_free[:n] + np.bincount(nodes_of, pods.mem[rows], minlength=n)[:n]
        ok &= (cpu >= pod.cpu_milli) & (mem >= pod.memory_mib)
        gpu = pod.gpu
        if gpu is None or not ok.any():
            return ok
        srows = np.flatnonzero(shares.live[: shares.count] & eligible[shares.pod[: shares.count]]
                               if shares.count else np.zeros(0, np.bool_))
        cells = shares.node[srows] * width + shares.card[srows]
        size = n * width
        freed_holders = np.bincount(cells, minlength=size)[:size].reshape(n, width)
        kept = state.card_holders[:n] - freed_holders
        valid = state.card_valid[:n]
        if isinstance(gpu, WholeCards):
            usable = valid & (kept == 0) & ~state.card_mig_pinned[:n]
            ok &= usable.sum(axis=1) >= gpu.count
        elif isinstance(gpu, Fraction):
            milli = state.card_milli_free[:n] + \
                np.bincount(cells, shares.milli[srows], minlength=size)[:size].reshape(n, width)
            memory = state.card_mem_free[:n] + \
                np.bincount(cells, shares.mem[srows], minlength=size)[:size].reshape(n, width)
            need_mem = state.card_mem_phys[:n] * gpu.memory_pct // 100 if gpu.memory_pct else gpu.memory_mib
            plain = valid & ~state.card_mig_pinned[:n] & ~((state.card_mig[:n] | state.card_whole[:n]) & (kept > 0))
            ok &= (plain & (milli >= gpu.compute_milli) & (memory >= need_mem)).any(axis=1)
        elif isinstance(gpu, MigSlice):
            ok &= state.card_mig_allowed[:n].any(axis=1)
        return ok

    @staticmethod
    def _rank(pod: PodRequest, state: ClusterState, eligible: BoolArray, candidates: IntArray) -> IntArray:
        """Order candidates by a cheap guess of the victims they need: eligible pods on the node, then
        the highest eligible priority there, then node index."""
        pods = state.pod_table.pods
        rows = np.flatnonzero(eligible)
        n = state.size
        count = np.bincount(pods.node[rows], minlength=n)[:n]
        top = np.full(n, np.iinfo(np.int64).min, np.int64)
        np.maximum.at(top, pods.node[rows], pods.priority[rows])
        order: IntArray = np.lexsort((candidates, top[candidates], count[candidates]))
        return order

    # ------------------------------------------------------------------ what-if
    def _what_if(self, pod: PodRequest, state: ClusterState, eligible: BoolArray, nodes: IntArray,
                 rules: VictimRules) -> tuple[list[PreemptionPlan], list[str]]:
        table = state.pod_table
        removed: dict[int, list[Binding]] = {}
        for node in nodes.tolist():
            names = [name for name in state.node_pods[node] if eligible[table.row_of[name][0]]]
            removed[node] = [state.release(name) for name in names]
        plans: list[PreemptionPlan] = []
        refusals: list[str] = []
        try:
            fits = self._fits(pod, state)
            live = [node for node in removed if fits[node]]
            # Reprieve order: keep the most valuable first (higher priority, then smaller so that fewer
            # victims go, then more work at stake).
            queues: dict[int, list[Binding]] = {}
            for node in live:
                queues[node] = sorted(removed[node], key=lambda b: (-b.request.priority, b.request.gpu_milli_total,
                                                                    -rules.work_lost(b), b.request.name))
            victims: dict[int, list[Binding]] = {node: [] for node in live}
            kept: dict[int, list[Binding]] = {node: [] for node in live}
            while any(queues.values()):
                trial: dict[int, Binding] = {}
                for node, pending in queues.items():
                    if pending:
                        binding = pending.pop(0)
                        state.place(binding.request, binding.assignment)
                        trial[node] = binding
                fits = self._fits(pod, state)
                for node, binding in trial.items():
                    if fits[node]:
                        kept[node].append(binding)
                    else:
                        state.release(binding.request.name)
                        victims[node].append(binding)
            for node in live:
                refusal = rules.refuse(victims[node])
                if refusal is not None:
                    refusals.append(refusal)
                    continue
                decision = self.framework.schedule(pod, state, within=_only(state.size, node))
                if decision.assignment is None:
                    continue
                plans.append(PreemptionPlan(pod, node, decision, tuple(
                    Victim(b.request.name, b.request.priority, rules.work_lost(b)) for b in victims[node])))
        finally:
            # Put back what is still out: victims of live nodes and every pod of the others.
            for bindings in removed.values():
                for binding in bindings:
                    if binding.request.name not in state.bindings:
                        state.place(binding.request, binding.assignment)
        return plans, refusals

    def _fits(self, pod: PodRequest, state: ClusterState) -> BoolArray:
        alive, _ = self.framework.find_nodes(CycleState(), pod, state, diagnose=False)
        return alive


def _only(size: int, node: int) -> BoolArray:
    mask = np.zeros(size, np.bool_)
    mask[node] = True
    return mask


def evict_in_place(state: ClusterState, plan: PreemptionPlan) -> list[Binding]:
    """Release a plan's victims from `state` (a trial); returns their bindings to put back."""
    return [state.release(v.pod) for v in plan.victims]
