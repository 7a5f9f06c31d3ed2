"""Offline upper bounds on the GPU any policy can allocate in the fill protocol (the limit).

**The quantity bounded.** A fill replay (`replay.run_fill`) shuffles and tunes the workload with the seed
and submits it one pod at a time, with no departures. "Unallocated GPU % at 100 % arrived" is measured
after the last pod whose arrival keeps the arrived GPU demand ≤ 100 % of capacity: the *arrived set* A.
Whatever a policy did, the pods it has placed by then are a subset S ⊆ A that sits on the cluster at once,
every node within its CPU and memory, every card within 1000 milli (and its card memory), each
whole-card pod on idle cards of one node, each pod on a card model it allows. So

    allocation of any policy  ≤  OPT(A) = max { GPU milli of S : S ⊆ A packs on the nodes },

and this module bounds OPT(A) from above. It is the limit of *any* placement of the arrived pods, online or
offline, with or without admission control; no policy of the fill protocol can exceed it. Pods without GPU
demand add nothing to the objective and are dropped (leaving a pod out never breaks a packing).

Two bounds, both LPs on pod types × node types solved with HiGHS through SciPy (`bound_lp`):

- **fluid** (the LP relaxation): how many pods of each type go to each node type, within the type's summed
  CPU, memory, GPU milli and cards, at most as many per node as fit one empty node, and no two pods that need
  more than half a card sharing one.
- **cards** (the card-configuration LP, ours): the same, but GPU milli is no longer fluid: each card of a
  node type is filled with one *card pattern*, a maximal multiset of shares that fits one card (Gilmore–Gomory
  on the cards). It sees what the fluid LP cannot: slivers left on cards that no arrived share fits (an 810-milli
  share leaves 190 that only the few shares ≤ 190 can use). It never exceeds the fluid bound.

The configuration LP over whole nodes (card patterns, CPU and memory of one node together) would be tighter
still, but its pricing problem is a MILP per node type that took 1–2 s each here, times dozens of rounds:
minutes per trace, so it is left out.

Constraints the bound does not model (node selectors, taints, topology, RDMA, codec units, pool oversell)
are relaxed, i.e. left out; leaving a constraint out can only raise an upper bound, so it stays valid. MIG
requests are refused: their compute share depends on the profile chosen at placement.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog  # type: ignore[import-untyped]
from scipy.sparse import coo_matrix  # type: ignore[import-untyped]

from gpuplane.model import (
    MILLI_PER_CARD,
    Catalog,
    ClusterState,
    Fraction,
    GpuplaneError,
    MigSlice,
    NodeSpec,
    PodRequest,
    WholeCards,
)
from gpuplane.sim.replay import tune_workload


@dataclass(frozen=True, slots=True)
class PodType:
    """Arrived pods with identical requests (CPU, memory, GPU form, allowed models and pools)."""

    cpu_milli: int
    memory_mib: int
    gpu: WholeCards | Fraction
    models: frozenset[str] | None
    pools: frozenset[str] | None
    count: int

    @property
    def value(self) -> int:
        """GPU milli one pod of this type allocates."""
        if isinstance(self.gpu, WholeCards):
            return self.gpu.count * MILLI_PER_CARD
        return self.gpu.count * self.gpu.compute_milli


@dataclass(frozen=True, slots=True)
class NodeType:
    """Schedulable nodes with identical specs; `cards` counts the cards gpuplane may use (not another stack's)."""

    cpu_milli: int
    memory_mib: int
    model: str
    cards: int
    card_memory_mib: int
    pool: str
    count: int


@dataclass(frozen=True, slots=True)
class Instance:
    """The arrived set of one trace and seed, aggregated into types, and the cluster's GPU capacity."""

    pods: tuple[PodType, ...]
    nodes: tuple[NodeType, ...]
    capacity_milli: int
    arrived_milli: int
    """GPU demand of the arrived set (≤ capacity at 100 % arrived)."""

    def pct(self, milli: float) -> float:
        return milli * 100.0 / self.capacity_milli if self.capacity_milli else 0.0


def arrived_set(pods: Sequence[PodRequest], capacity_milli: int, seed: int, *, arrived_pct: float = 100.0,
                tune: float = 1.3) -> list[PodRequest]:
    """The pods a fill replay with `seed` has submitted when `allocation_at(arrived_pct)` is read.

    `run_fill` records arrived % after each pod and `allocation_at` takes the last pod with arrived % within
    `arrived_pct` (+1e-9), so the set is the longest prefix of the tuned workload whose GPU demand stays there.
    """
    workload = tune_workload(pods, capacity_milli, seed, tune)
    arrived = 0
    taken = 0
    for index, request in enumerate(workload):
        arrived += request.gpu_milli_total
        if arrived * 100.0 / capacity_milli > arrived_pct + 1e-9:
            break
        taken = index + 1
    return workload[:taken]


def build_instance(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest]) -> Instance:
    """Aggregate `pods` (those that count: with GPU demand) and `nodes` into types.

    Raises GpuplaneError for a MIG request: the bound does not model MIG slices.
    """
    capacity = ClusterState(catalog, nodes).total_gpu_milli()
    pod_counts: Counter[tuple[int, int, WholeCards | Fraction, frozenset[str] | None, frozenset[str] | None]] = \
        Counter()
    arrived = 0
    for request in pods:
        gpu = request.gpu
        if isinstance(gpu, MigSlice):
            raise GpuplaneError(f"pod {request.name}: the bound does not model MIG slices")
        arrived += request.gpu_milli_total
        if gpu is None or request.gpu_milli_total == 0:
            continue
        if isinstance(gpu, Fraction):
            # Codec units are relaxed (left out), so fractions differing only there are one type.
            gpu = Fraction(compute_milli=gpu.compute_milli, memory_mib=gpu.memory_mib, memory_pct=gpu.memory_pct,
                           count=gpu.count)
        pod_counts[(request.cpu_milli, request.memory_mib, gpu, request.models, request.pools)] += 1
    node_counts: Counter[tuple[int, int, str, int, int, str]] = Counter()
    for spec in nodes:
        cards = spec.gpus - len(spec.foreign_cards)
        if not spec.schedulable or spec.gpu_model is None or cards <= 0:
            continue
        card_memory = catalog.get(spec.gpu_model).memory_mib
        node_counts[(spec.cpu_milli, spec.memory_mib, spec.gpu_model, cards, card_memory, spec.pool)] += 1
    pod_types = tuple(PodType(cpu, mem, gpu, models, pools, n)
                      for (cpu, mem, gpu, models, pools), n in sorted(pod_counts.items(), key=lambda kv: repr(kv[0])))
    node_types = tuple(NodeType(*key, count=n) for key, n in sorted(node_counts.items()))
    return Instance(pod_types, node_types, capacity, arrived)


def _card_demand(pod: PodType, node: NodeType) -> tuple[int, int]:
    """(milli, MiB) a fraction takes on each of its cards of this node type."""
    assert isinstance(pod.gpu, Fraction)
    return pod.gpu.compute_milli, pod.gpu.memory_on(node.card_memory_mib)


def per_node_fit(pod: PodType, node: NodeType) -> int:
    """How many pods of `pod`'s type fit on one empty node of `node`'s type (0: none, or not allowed)."""
    if pod.models is not None and node.model not in pod.models:
        return 0
    if pod.pools is not None and node.pool not in pod.pools:
        return 0
    if pod.cpu_milli > node.cpu_milli or pod.memory_mib > node.memory_mib:
        return 0
    limit = node.cards * MILLI_PER_CARD  # no pod type has zero GPU value, so this bounds any count
    if pod.cpu_milli:
        limit = min(limit, node.cpu_milli // pod.cpu_milli)
    if pod.memory_mib:
        limit = min(limit, node.memory_mib // pod.memory_mib)
    if isinstance(pod.gpu, WholeCards):
        return min(limit, node.cards // pod.gpu.count)
    milli, memory = _card_demand(pod, node)
    if pod.gpu.count > node.cards or memory > node.card_memory_mib:
        return 0
    per_card = MILLI_PER_CARD // milli if milli else MILLI_PER_CARD
    if memory:
        per_card = min(per_card, node.card_memory_mib // memory)
    return min(limit, node.cards * per_card // pod.gpu.count)


@dataclass(frozen=True, slots=True)
class LpBound:
    upper_milli: float
    """An upper bound on OPT(A), GPU milli (never above the arrived set's demand)."""
    variables: int
    wall_s: float


PATTERN_LIMIT = 20_000
"""Most card patterns enumerated per node type; beyond it that node type keeps the fluid rows."""


def card_patterns(classes: Sequence[tuple[int, int]], card_memory_mib: int,
                  limit: int = PATTERN_LIMIT) -> list[tuple[int, ...]] | None:
    """Every maximal card pattern over share classes (milli, MiB): how many shares of each class one card
    holds, such that no further share of any class fits. None if there are more than `limit`."""
    order = sorted(range(len(classes)), key=lambda q: classes[q], reverse=True)
    patterns: list[tuple[int, ...]] = []
    counts = [0] * len(classes)

    def walk(position: int, milli: int, memory: int) -> bool:
        if position == len(order):
            if not any(need_milli <= milli and need_memory <= memory for need_milli, need_memory in classes):
                patterns.append(tuple(counts))
            return len(patterns) <= limit
        q = order[position]
        need_milli, need_memory = classes[q]
        most = milli // need_milli if need_milli else MILLI_PER_CARD
        if need_memory:
            most = min(most, memory // need_memory)
        for take in range(most, -1, -1):
            counts[q] = take
            if not walk(position + 1, milli - take * need_milli, memory - take * need_memory):
                return False
        counts[q] = 0
        return True

    if not walk(0, MILLI_PER_CARD, card_memory_mib):
        return None
    return patterns


def _takes_card_alone(pod: PodType, node: NodeType) -> int:
    """Cards of which this pod needs one each, no two such pods sharing: whole cards, or shares above half."""
    if isinstance(pod.gpu, WholeCards):
        return pod.gpu.count
    milli, memory = _card_demand(pod, node)
    if 2 * milli > MILLI_PER_CARD or 2 * memory > node.card_memory_mib:
        return pod.gpu.count
    return 0


class _Lp:
    """max c·x s.t. A x ≤ b, 0 ≤ x ≤ u, built column by column."""

    def __init__(self, rhs: Sequence[float]) -> None:
        self.rhs = list(rhs)
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.worth: list[float] = []
        self.upper: list[float] = []

    def row(self, rhs: float) -> int:
        self.rhs.append(rhs)
        return len(self.rhs) - 1

    def column(self, worth: float, upper: float, entries: Sequence[tuple[int, float]]) -> None:
        col = len(self.worth)
        for row, val in entries:
            if val:
                self.rows.append(row)
                self.cols.append(col)
                self.vals.append(val)
        self.worth.append(worth)
        self.upper.append(upper)

    def maximise(self) -> float:
        if not self.worth:
            return 0.0
        matrix = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.rhs), len(self.worth))).tocsr()
        bounds = np.column_stack([np.zeros(len(self.upper)), np.array(self.upper)])
        result = linprog(-np.array(self.worth), A_ub=matrix, b_ub=np.array(self.rhs), bounds=bounds, method="highs")
        if result.status != 0:
            raise GpuplaneError(f"the bound's LP did not solve: {result.message}")
        return float(-result.fun)


def bound_lp(instance: Instance, *, cards: bool = True) -> LpBound:
    """The fluid LP (`cards=False`) or the card-configuration LP (`cards=True`); see the module docstring.

    Variables: x[t,j] ≥ 0, pods of type t on nodes of type j (m_j nodes of C_j CPU, M_j memory, G_j cards), at
    most m_j·fit(t,j) (fit: how many fit one empty node) and Σ_j x[t,j] ≤ n_t. Per node type: Σ_t cpu_t·x ≤ m_j·C_j,
    Σ_t mem_t·x ≤ m_j·M_j; no node holds two pods that each take over half its CPU (or memory, or whole cards),
    so Σ x over such types ≤ m_j, once for each of the three; and

    - fluid: Σ_t value_t·x ≤ 1000·m_j·G_j, and Σ_t alone_t·x ≤ m_j·G_j (alone_t: the cards a pod needs to itself,
      whole cards or shares over half a card, of which no card holds two);
    - cards: z[j,p] ≥ 0 cards filled with maximal pattern p; Σ_p z[j,p] + Σ_t whole_t·x ≤ m_j·G_j, and per share
      class q: Σ_t∈q cards_t·x[t,j] ≤ Σ_p p_q·z[j,p].

    **Validity.** Take any packing of S ⊆ A and set x[t,j] to its pods of type t on nodes of type j. Each fluid
    row is the sum over the m_j nodes of a limit every node respects. For the card rows, extend each card's
    shares to a maximal pattern (add shares until none fits) and let z[j,p] count the cards so extended: every
    card counts once, whole or patterned, and every share has a slot. So (x, z) is feasible, with objective the
    packing's GPU milli, and the LP optimum is at least OPT(A), hence at least what any policy allocates.
    """
    started = time.perf_counter()
    pods = instance.pods
    lp = _Lp([float(pod.count) for pod in pods])
    patterns_of: dict[tuple[tuple[tuple[int, int], ...], int], list[tuple[int, ...]] | None] = {}
    for node in instance.nodes:
        m = node.count
        types = [t for t, pod in enumerate(pods) if per_node_fit(pod, node) > 0]
        classes: dict[tuple[int, int], int] = {}
        for t in types:
            if isinstance(pods[t].gpu, Fraction):
                classes.setdefault(_card_demand(pods[t], node), len(classes))
        keys = tuple(classes)
        patterns: list[tuple[int, ...]] | None = None
        if cards:
            cache_key = (keys, node.card_memory_mib)
            if cache_key not in patterns_of:
                patterns_of[cache_key] = card_patterns(keys, node.card_memory_mib)
            patterns = patterns_of[cache_key]
        cpu, memory = lp.row(float(m * node.cpu_milli)), lp.row(float(m * node.memory_mib))
        card_row = lp.row(float(m * node.cards))
        halves = [lp.row(float(m)) for _ in range(3)]
        if patterns is None:
            milli_row = lp.row(float(m * node.cards * MILLI_PER_CARD))
        else:
            slot_rows = [lp.row(0.0) for _ in keys]
        for t in types:
            pod = pods[t]
            entries = [(t, 1.0), (cpu, float(pod.cpu_milli)), (memory, float(pod.memory_mib))]
            over_half = (2 * pod.cpu_milli > node.cpu_milli, 2 * pod.memory_mib > node.memory_mib,
                         isinstance(pod.gpu, WholeCards) and 2 * pod.gpu.count > node.cards)
            entries += [(row, 1.0) for row, over in zip(halves, over_half, strict=True) if over]
            if patterns is None:
                entries += [(milli_row, float(pod.value)), (card_row, float(_takes_card_alone(pod, node)))]
            elif isinstance(pod.gpu, WholeCards):
                entries.append((card_row, float(pod.gpu.count)))
            else:
                entries.append((slot_rows[classes[_card_demand(pod, node)]], float(pod.gpu.count)))
            lp.column(float(pod.value), float(m * per_node_fit(pod, node)), entries)
        for pattern in patterns or ():
            lp.column(0.0, float(m * node.cards),
                      [(card_row, 1.0)] + [(slot_rows[q], -float(c)) for q, c in enumerate(pattern) if c])
    upper = min(lp.maximise(), float(instance.arrived_milli))
    return LpBound(upper, len(lp.worth), time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class Limit:
    """The bounds for one trace and seed, as unallocated GPU % at `arrived_pct` arrived: no policy's unallocated
    GPU % there can be lower."""

    trace: str
    seed: int
    arrived_pct: float
    demand_pct: float
    """The arrived set's GPU demand, % of capacity: unallocated is at least 100 − this."""
    fluid_pct: float
    cards_pct: float
    pod_types: int
    node_types: int
    wall_s: float

    @property
    def bound_pct(self) -> float:
        """The tightest of the valid lower bounds on unallocated GPU %."""
        return max(100.0 - self.demand_pct, self.fluid_pct, self.cards_pct)


def limit(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest], *, seed: int, trace: str = "",
          arrived_pct: float = 100.0, tune: float = 1.3) -> Limit:
    """Lower bounds on unallocated GPU % at `arrived_pct` arrived for a fill replay of `pods` with `seed`."""
    started = time.perf_counter()
    capacity = ClusterState(catalog, nodes).total_gpu_milli()
    if capacity <= 0:
        raise GpuplaneError("the cluster has no GPU capacity: nothing to bound")
    instance = build_instance(catalog, nodes, arrived_set(pods, capacity, seed, arrived_pct=arrived_pct, tune=tune))
    fluid = bound_lp(instance, cards=False)
    card = bound_lp(instance, cards=True)
    return Limit(trace, seed, arrived_pct, instance.pct(instance.arrived_milli),
                 100.0 - instance.pct(fluid.upper_milli), 100.0 - instance.pct(card.upper_milli),
                 len(instance.pods), len(instance.nodes), time.perf_counter() - started)
