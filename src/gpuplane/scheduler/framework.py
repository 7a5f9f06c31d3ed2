"""The scheduling framework: filter → score → pick card(s) → reserve, run over a `ClusterState`.

Modelled on the Kubernetes scheduling framework, vectorised: a filter plugin yields checks that each
pass or fail a whole array of nodes (`NodeCheck`) or of cards (`CardCheck`), so one cycle costs a few
numpy operations however many nodes there are. Every rejected node keeps the reason of the first check
it failed. Binding is not part of the framework: the `Scheduler` does it through the cluster port.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from gpuplane.model import (
    Assignment,
    CardShare,
    ClusterState,
    PodRequest,
    RdmaShare,
)
from gpuplane.model.cluster import row_any, row_count
from gpuplane.port import Status, aggregate_reasons

T = TypeVar("T")
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class StateKey(Generic[T]):
    """A typed key into `CycleState`: reads need no casts."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name})"


class CycleState:
    """Per-cycle scratch space shared by the plugins: written once (pre-filter), read many times."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StateKey[Any], Any] = {}

    def write(self, key: StateKey[T], value: T) -> None:
        self._data[key] = value

    def read(self, key: StateKey[T]) -> T:
        value: T = self._data[key]
        return value

    def find(self, key: StateKey[T]) -> T | None:
        value: T | None = self._data.get(key)
        return value

    def get(self, key: StateKey[T], default: T) -> T:
        value: T = self._data.get(key, default)
        return value


OUTSIDE = "outside the nodes considered"

NEAR_CARDS: StateKey[dict[int, frozenset[int]]] = StateKey("framework/near-cards")
"""Per node, cards the pod should sit close to (its gang's placed members): pickers prefer their NVLink group."""

CARD_OK: StateKey[BoolArray] = StateKey("framework/card-ok")
"""Cards (nodes × card slots) that every card check so far has passed."""


class NodeCheck(NamedTuple):
    reason: str
    passed: BoolArray
    resolvable: bool = True
    """False when preemption cannot help (wrong model, a topology rule)."""


class CardCheck(NamedTuple):
    reason: str
    passed: BoolArray
    resolvable: bool = True


Check = NodeCheck | CardCheck


@runtime_checkable
class FilterPlugin(Protocol):
    name: str

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        """Yield checks in order; the framework stops asking a node once it failed one.

        A plugin may read `CARD_OK` to see which cards earlier checks left.
        """
        ...


@runtime_checkable
class ScorePlugin(Protocol):
    name: str

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        """Scores in 0…100 for the feasible `nodes`; higher is better. Must not change `state`."""
        ...


@runtime_checkable
class NeutralScore(Protocol):
    """A score plugin that can tell, before scoring, that it would give every node 0 (no preference for the pod).

    The framework then skips it: adding 0 leaves the weighted sum bit for bit, so the ties and every random draw
    are exactly as if it had been scored."""

    def neutral(self, pod: PodRequest, state: ClusterState) -> bool:
        """True when `score` would return 0 for every node."""
        ...


@dataclass(frozen=True, slots=True)
class CardPick:
    cards: tuple[CardShare, ...]
    rdma: RdmaShare | None = None


@runtime_checkable
class CardPicker(Protocol):
    name: str

    def pick(self, cycle: CycleState, pod: PodRequest, state: ClusterState, node: int,
             eligible: BoolArray) -> CardPick | None:
        """Choose the cards on `node` among `eligible` (one flag per card slot). None if nothing fits."""
        ...


@dataclass(frozen=True, slots=True)
class WeightedScore:
    plugin: ScorePlugin
    weight: float = 1.0


class TieBreak(enum.Enum):
    """How equal best scores are settled.

    RANDOM: uniformly at random (kube-scheduler's selectHost). ORDERED: the first node in a seeded
    random permutation of the nodes, the same order for every decision, as the FGD paper's simulator
    does (it prefixes node names with a seeded permutation and takes the first); it reproduces the
    paper's figures, and packs ties onto the same nodes.
    """

    RANDOM = "random"
    ORDERED = "ordered"


@dataclass(frozen=True, slots=True)
class Profile:
    """One scheduler configuration: the filters in order, weighted scores and the card picker."""

    name: str
    filters: tuple[FilterPlugin, ...]
    scores: tuple[WeightedScore, ...]
    picker: CardPicker
    tie_break: TieBreak = TieBreak.RANDOM


@dataclass(slots=True)
class Diagnosis:
    """Why nodes were rejected: `reason_of[i]` indexes `reasons` (-1: node was feasible)."""

    reasons: list[str]
    reason_of: IntArray
    unresolvable: set[int] = field(default_factory=set)

    def node_reason(self, node: int) -> str | None:
        idx = int(self.reason_of[node])
        return self.reasons[idx] if idx >= 0 else None

    def counts(self) -> dict[str, int]:
        """Nodes rejected per reason."""
        rejected = self.reason_of[self.reason_of >= 0]
        if not len(rejected):
            return {}
        counts = np.bincount(rejected, minlength=len(self.reasons))
        return {self.reasons[i]: int(c) for i, c in enumerate(counts) if c}

    def dominant(self) -> str:
        """The reason that rejected the most nodes (ties: the earlier check)."""
        counts = self.counts()
        return max(counts, key=lambda r: (counts[r], -self.reasons.index(r))) if counts else "no nodes"

    def message(self) -> str:
        return aggregate_reasons(len(self.reason_of), self.counts())


@dataclass(frozen=True, slots=True)
class Decision:
    status: Status
    assignment: Assignment | None = None
    node: int = -1
    diagnosis: Diagnosis | None = None


class Framework:
    """Runs one profile's plugins. Pure with respect to the state except for `rng` draws."""

    def __init__(self, profile: Profile, rng: np.random.Generator) -> None:
        self.profile = profile
        self.rng = rng
        self._rank = np.zeros(0, np.int64)
        self._scores = tuple((w, w.plugin.neutral if isinstance(w.plugin, NeutralScore) else None)
                             for w in profile.scores)

    def find_nodes(self, cycle: CycleState, pod: PodRequest, state: ClusterState, *, diagnose: bool = True,
                   within: BoolArray | None = None, within_reason: str = OUTSIDE,
                   within_resolvable: bool = False) -> tuple[BoolArray, Diagnosis | None]:
        """Run every filter. Returns the feasible-node mask and, if asked, why the others failed.

        `within` limits the search to some nodes (a gang's network block, a preemption candidate); the
        others are rejected as "outside the nodes considered", a reason preemption cannot fix.
        """
        n = state.size
        alive = np.ones(n, np.bool_) if within is None else within[:n].copy()
        card_ok = state.card_valid[:n].copy()
        cycle.write(CARD_OK, card_ok)
        reasons: list[str] = []
        reason_of = np.full(n, -1, np.int64) if diagnose else None
        unresolvable: set[int] = set()
        if within is not None and reason_of is not None and not alive.all():
            reasons.append(within_reason)
            reason_of[~alive] = 0
            if not within_resolvable:
                unresolvable.add(0)
        gpu = pod.gpu
        need = pod.gpu_cards or 1
        for plugin in self.profile.filters:
            for check in plugin.checks(cycle, pod, state):
                if isinstance(check, CardCheck):
                    if gpu is None:
                        continue
                    np.logical_and(card_ok, check.passed, out=card_ok)
                    passed = row_count(card_ok) >= need if need > 1 else row_any(card_ok)
                else:
                    passed = check.passed
                if reason_of is None:
                    alive &= passed
                    continue
                failed = alive & ~passed
                if failed.any():
                    if check.reason not in reasons:
                        reasons.append(check.reason)
                    idx = reasons.index(check.reason)
                    reason_of[failed] = idx
                    if not check.resolvable:
                        unresolvable.add(idx)
                    alive ^= failed  # failed ⊆ alive
            if not alive.any():
                break
        diagnosis = Diagnosis(reasons, reason_of, unresolvable) if reason_of is not None else None
        return alive, diagnosis

    def score_nodes(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        """The weighted sum of the scores, in the profile's order. Plugins neutral for the pod (`NeutralScore`) are
        left out: x + 0.0 is x, so the sum is the same (a zero's sign aside, which no comparison sees)."""
        total: FloatArray | None = None
        for weighted, neutral in self._scores:
            if neutral is not None and neutral(pod, state):
                continue
            scores = weighted.plugin.score(cycle, pod, state, nodes)
            if total is None:
                total = weighted.weight * scores  # 0.0 + w·s; a new array (`scores` may be a plugin's cache)
            else:
                total += weighted.weight * scores
        return total if total is not None else np.zeros(len(nodes), np.float64)

    def select(self, nodes: IntArray, scores: FloatArray, size: int = 0) -> int:
        """The highest-scoring node; ties settled per the profile's `TieBreak` (`size`: nodes in the state)."""
        best = scores.max()
        top = nodes[scores >= best - 1e-9]
        if len(top) == 1:
            return int(top[0])
        if self.profile.tie_break is TieBreak.ORDERED:
            if len(self._rank) <= int(top.max()):
                grown = max(int(top.max()) + 1, size, 2 * len(self._rank))
                # Nodes added later rank after the existing ones, in a seeded order of their own.
                extra = len(self._rank) + self.rng.permutation(grown - len(self._rank))
                self._rank = np.concatenate([self._rank, extra])
            return int(top[np.argmin(self._rank[top])])
        return int(top[self.rng.integers(len(top))])

    def schedule(self, pod: PodRequest, state: ClusterState, *, within: BoolArray | None = None,
                 cycle: CycleState | None = None, within_reason: str = OUTSIDE,
                 within_resolvable: bool = False) -> Decision:
        """Decide where `pod` goes. Does not change `state`; the caller reserves and binds.

        `cycle` may carry keys a caller seeds for score plugins (a gang's placed members).
        """
        cycle = cycle if cycle is not None else CycleState()
        # Why nodes were rejected matters only when the pod goes nowhere: the filters run without the diagnosis
        # first, and again with it (they are pure: the same nodes pass) only then.
        alive, _ = self.find_nodes(cycle, pod, state, diagnose=False, within=within)
        card_ok = cycle.read(CARD_OK)
        candidates = np.flatnonzero(alive)
        refused: list[int] = []
        while len(candidates):
            scores = self.score_nodes(cycle, pod, state, candidates)
            node = self.select(candidates, scores, state.size)
            pick = self.profile.picker.pick(cycle, pod, state, node, card_ok[node])
            if pick is not None:
                assignment = Assignment(state.nodes[node].name, pick.cards, pick.rdma,
                                        oversubscribed=_oversubscribed(state, node, pick.cards))
                return Decision(Status.success(), assignment, node)
            # The filters promised a fit the picker could not honour: reject the node, try the next.
            refused.append(node)
            candidates = candidates[candidates != node]
        _, diagnosis = self.find_nodes(cycle, pod, state, within=within, within_reason=within_reason,
                                       within_resolvable=within_resolvable)
        assert diagnosis is not None
        if refused:
            reason = f"no card combination satisfies {self.profile.picker.name}"
            if reason not in diagnosis.reasons:
                diagnosis.reasons.append(reason)
            diagnosis.reason_of[refused] = diagnosis.reasons.index(reason)
        # Preemption can help only if some node was rejected for a reason that freeing capacity fixes.
        rejected = {int(i) for i in np.unique(diagnosis.reason_of) if i >= 0}
        resolvable = not rejected or bool(rejected - diagnosis.unresolvable)
        return Decision(Status.unschedulable(diagnosis.message(), resolvable=resolvable), diagnosis=diagnosis)


def _oversubscribed(state: ClusterState, node: int, cards: Sequence[CardShare]) -> bool:
    for share in cards:
        if share.whole:
            continue
        used = state.card_mem_cap[node, share.card] - state.card_mem_free[node, share.card] + share.memory_mib
        if used > state.card_mem_phys[node, share.card]:
            return True
    return False
