"""Cluster state: free capacity of every node and card in dense numpy arrays.

Rows are nodes, columns card indexes (padded to the widest node; padding is `card_valid == False`).
Scoring and filtering read these arrays vectorised across nodes and cards; `place` and `release`
touch one node's row, so they cost O(cards of one node).

Invariants, checked by `check_invariants` and by the property tests:
- no dimension of any node or card is ever below zero or above its capacity;
- MIG instances on a card never overlap on the memory-slice axis and start on legal slots;
- a card in MIG mode holds only MIG instances; a card with fractional or whole holders holds none;
- a card another stack holds (`NodeSpec.foreign_cards`) has nothing free: it counts one phantom holder, and what
  gpuplane's own holders leave there is held in the `card_foreign_*` arrays, not offered.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from gpuplane.model.assignment import Assignment, CardShare
from gpuplane.model.catalog import MILLI_PER_CARD, CardModel, Catalog, MigProfile
from gpuplane.model.errors import NodeSpecError, PlacementError
from gpuplane.model.node import MigMode, NodeSpec
from gpuplane.model.podtable import PodTable
from gpuplane.model.request import (
    FILTER_EFFECTS,
    NODE_NAME_FIELD,
    MigSlice,
    NodeSelectorTerm,
    PodRequest,
    PreferredTerm,
    QoS,
    Requirement,
    SelectorOp,
    Toleration,
    WholeCards,
    parse_int64,
)

BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

CARD_ROW_ALIGN = 8
_STATE_UIDS = itertools.count(1)
"""Distinct for every ClusterState and copy: caches key on it (`id()` can be reused after a free)."""
RowIndex = slice | npt.NDArray[np.int64]
"""The node rows a `ClusterState.node_mask` (or `node_values`) computation is asked for: all of them (a slice)
or some (indexes)."""
_BYTE_SUM = np.uint64(0x0101010101010101)
_TOP_BYTE = np.uint64(56)


def row_any(mask: BoolArray) -> BoolArray:
    """Per row, whether any flag is set. `mask` is C-contiguous with a width that is a multiple of 8."""
    words = mask.view(np.uint64)
    if words.shape[1] == 1:
        single: BoolArray = words[:, 0] != 0
        return single
    out: BoolArray = (words != 0).any(axis=1)
    return out


def row_count(mask: BoolArray) -> IntArray:
    """Per row, how many flags are set (same layout rule as `row_any`)."""
    words = mask.view(np.uint64)
    # Each byte is 0 or 1: multiplying by 0x0101…01 sums the eight bytes into the top byte.
    counts = (words * _BYTE_SUM) >> _TOP_BYTE
    out: IntArray = counts.sum(axis=1, dtype=np.int64) if words.shape[1] > 1 else counts[:, 0].astype(np.int64)
    return out


@dataclass(slots=True)
class _KeptRows:
    """One `ClusterState.node_mask` or `node_values`: its rows (capacity rows, like the node arrays), the
    `node_version` each node's row was computed at (−1: never) and how many changes (`ClusterState._changed`) it
    has seen."""

    rows: npt.NDArray[Any]
    version: IntArray
    seen: int


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Per-pool settings. `memory_oversell` > 1 lets dev pools promise more card memory than exists.

    `offline_compute_oversell`: fractional shares of offline pods (`QoS.OFFLINE`) count against a second
    compute budget of one card per card, not against what online pods hold, so offline work is placed on the
    compute online shares leave idle and runs only when the node's co-location guard lets it (online first);
    card memory is never oversold this way."""

    memory_oversell: float = 1.0
    offline_compute_oversell: bool = False

    def __post_init__(self) -> None:
        if not 1.0 <= self.memory_oversell <= 16.0:
            raise NodeSpecError(f"memory_oversell must be within 1..16, got {self.memory_oversell}")


@dataclass(frozen=True, slots=True)
class _LabelColumn:
    """One label key across the nodes: `codes[i]` indexes `index`'s values (-1: node i lacks the label);
    `numbers[i]` is the value as an int64 where `numeric[i]` (for Gt/Lt)."""

    codes: IntArray
    index: dict[str, int]
    numbers: IntArray
    numeric: BoolArray


AffinityKey = tuple[tuple[tuple[str, str], ...], tuple[NodeSelectorTerm, ...] | None]


@dataclass(frozen=True, slots=True)
class MigInstance:
    pod: str
    profile_id: int
    start: int


@dataclass(frozen=True, slots=True)
class Binding:
    """A pod placed in the state: its request, node row and assignment."""

    request: PodRequest
    node: int
    assignment: Assignment
    oversold: bool = False
    """its fractional shares count against the cards' offline budget (`PoolConfig.offline_compute_oversell`
    at placement), not against `card_milli_free`"""


def _form_mismatch(request: PodRequest, assignment: Assignment, model: CardModel | None) -> str | None:
    """Why the assignment's shape does not answer the request's GPU form and RDMA ask, or None."""
    gpu, cards = request.gpu, assignment.cards
    if request.rdma_vfs != (assignment.rdma.vfs if assignment.rdma is not None else 0):
        return "assignment's RDMA functions differ from the request"
    if gpu is None:
        return "a CPU-only pod was given cards" if cards else None
    if isinstance(gpu, WholeCards):
        if len(cards) != gpu.count or not all(s.whole and s.compute_milli == MILLI_PER_CARD for s in cards):
            return f"assignment does not hold {gpu.count} whole card(s)"
        return None
    if isinstance(gpu, MigSlice):
        if len(cards) != 1:
            return "a fraction or MIG slice takes exactly one card"
        share = cards[0]
        profile = model.mig_profile(gpu.profile) if model is not None else None
        if model is None or profile is None:
            return f"GPU model {model.name if model else 'none'} has no MIG profile {gpu.profile!r}"
        if share.mig_profile != profile.profile_id or share.compute_milli != model.mig_compute_milli(profile) \
                or share.memory_mib != profile.memory_mib:
            return f"assignment does not hold MIG profile {gpu.profile!r}"
        return None
    if len(cards) != gpu.count:
        return "a fraction or MIG slice takes exactly one card" if gpu.count == 1 else \
            f"a share on {gpu.count} cards was given {len(cards)}"
    memory = gpu.memory_on(model.memory_mib) if model is not None else gpu.memory_mib
    for share in cards:
        if share.whole or share.mig_profile is not None or share.compute_milli != gpu.compute_milli \
                or (share.encoders, share.decoders) != (gpu.encoders, gpu.decoders):
            return "assignment does not match the requested fraction"
        if (gpu.memory_mib or gpu.memory_pct) and share.memory_mib != memory:
            return "assignment does not match the requested GPU memory"
    return None


class ClusterState:
    """Mutable, authoritative-for-its-owner accounting of a cluster's free capacity."""

    def __init__(self, catalog: Catalog, nodes: Sequence[NodeSpec],
                 pools: Mapping[str, PoolConfig] | None = None) -> None:
        self.uid = next(_STATE_UIDS)
        self.catalog = catalog
        self.pools: dict[str, PoolConfig] = dict(pools or {})
        self.models: list[CardModel] = list(catalog)
        self._model_index = {m.name: i for i, m in enumerate(self.models)}
        self.nodes: list[NodeSpec] = []
        self.node_index: dict[str, int] = {}
        self.bindings: dict[str, Binding] = {}
        self.mig_instances: dict[tuple[int, int], list[MigInstance]] = {}
        self.workload_cards: dict[str, Counter[tuple[int, int]]] = {}
        self.nic_free: list[list[int]] = []
        self.node_pods: list[set[str]] = []
        """Names of the pods placed on each node."""
        self._allowed_cache: dict[frozenset[str] | None, BoolArray] = {}
        self.tainted: set[int] = set()
        self._reset_label_caches()
        self.pod_table = PodTable()
        """Every placed pod and card share as numpy rows (for preemption's vectorised screens)."""
        self._kept: dict[Hashable, _KeptRows] = {}
        self._changed: list[int] = []
        """The nodes whose `node_version` moved (or that were added), in order, since `_changed_base` changes."""
        self._changed_base = 0
        self._alloc(0, 0)
        for spec in nodes:
            self.add_node(spec)

    # ---------------------------------------------------------------- arrays
    def _alloc(self, n: int, c: int) -> None:
        self.width = c
        self.cpu_cap = np.zeros(n, np.int64)
        self.cpu_free = np.zeros(n, np.int64)
        self.mem_cap = np.zeros(n, np.int64)
        self.mem_free = np.zeros(n, np.int64)
        self.model_idx = np.full(n, -1, np.int32)
        self.schedulable = np.zeros(n, np.bool_)
        self.gpu_milli_cap = np.zeros(n, np.int64)
        self.gpu_milli_used = np.zeros(n, np.int64)
        self.node_version = np.zeros(n, np.int64)
        self.idle_cards = np.zeros(n, np.int64)
        self.rdma_max_free = np.zeros(n, np.int64)
        self.offline_oversell = np.zeros(n, np.bool_)
        self.card_valid = np.zeros((n, c), np.bool_)
        self.card_milli_free = np.zeros((n, c), np.int64)
        self.card_offline_free = np.zeros((n, c), np.int64)
        """the offline compute budget left on each card (`PoolConfig.offline_compute_oversell`)"""
        self.card_mem_phys = np.zeros((n, c), np.int64)
        self.card_mem_cap = np.zeros((n, c), np.int64)
        self.card_mem_free = np.zeros((n, c), np.int64)
        self.card_enc_cap = np.zeros((n, c), np.int64)
        self.card_enc_free = np.zeros((n, c), np.int64)
        self.card_dec_cap = np.zeros((n, c), np.int64)
        self.card_dec_free = np.zeros((n, c), np.int64)
        self.card_holders = np.zeros((n, c), np.int64)
        self.card_mig = np.zeros((n, c), np.bool_)
        self.card_mig_pinned = np.zeros((n, c), np.bool_)
        self.card_mig_allowed = np.zeros((n, c), np.bool_)
        self.card_mig_slots = np.zeros((n, c), np.int64)
        self.card_mig_compute = np.zeros((n, c), np.int64)
        self.card_mig_me = np.zeros((n, c), np.bool_)
        self.card_whole = np.zeros((n, c), np.bool_)
        self.card_online_milli = np.zeros((n, c), np.int64)
        # A card another stack holds (`NodeSpec.foreign_cards`): one phantom holder keeps it from being idle, and
        # whatever gpuplane's own holders leave free is held here instead of in the free arrays.
        self.card_foreign = np.zeros((n, c), np.bool_)
        self.card_foreign_milli = np.zeros((n, c), np.int64)
        self.card_foreign_mem = np.zeros((n, c), np.int64)
        self.card_foreign_enc = np.zeros((n, c), np.int64)
        self.card_foreign_dec = np.zeros((n, c), np.int64)

    _NODE_ARRAYS = ("cpu_cap", "cpu_free", "mem_cap", "mem_free", "model_idx", "schedulable", "gpu_milli_cap",
                    "gpu_milli_used", "idle_cards", "rdma_max_free", "offline_oversell", "node_version")
    _CARD_ARRAYS = ("card_valid", "card_milli_free", "card_offline_free", "card_mem_phys", "card_mem_cap",
                    "card_mem_free", "card_enc_cap", "card_enc_free", "card_dec_cap", "card_dec_free", "card_holders",
                    "card_mig",
                    "card_mig_pinned", "card_mig_allowed", "card_mig_slots", "card_mig_compute", "card_mig_me",
                    "card_whole", "card_online_milli", "card_foreign", "card_foreign_milli", "card_foreign_mem",
                    "card_foreign_enc", "card_foreign_dec")

    def _grow(self, n: int, c: int) -> None:
        old_n, old_c = len(self.cpu_cap), self.width
        if n <= old_n and c <= old_c:
            return
        new_n = max(n, old_n * 2 if n > old_n else old_n)
        # Card rows are padded to a multiple of 8 so that a row of 8 bool flags reads as one uint64
        # (see `row_any`/`row_count`): the per-node reductions then cost microseconds, not a ufunc reduce.
        new_c = max(-(-c // CARD_ROW_ALIGN) * CARD_ROW_ALIGN, old_c)
        for name in self._NODE_ARRAYS:
            arr = getattr(self, name)
            grown = np.full(new_n, -1 if name == "model_idx" else 0, arr.dtype)
            grown[:old_n] = arr
            setattr(self, name, grown)
        for name in self._CARD_ARRAYS:
            arr = getattr(self, name)
            grown = np.zeros((new_n, new_c), arr.dtype)
            grown[:old_n, :old_c] = arr
            setattr(self, name, grown)
        self.width = new_c

    @property
    def size(self) -> int:
        """Number of node rows (node arrays may hold spare capacity beyond it)."""
        return len(self.nodes)

    def view(self, name: str) -> npt.NDArray[np.generic]:
        """The live rows of one array, without spare capacity."""
        arr: npt.NDArray[np.generic] = getattr(self, name)
        return arr[: self.size]

    ROWS_KEPT = 64
    """Masks and values `node_mask` and `node_values` keep, together (the least recently asked goes first)."""
    CHANGES_LOGGED_MIN = 1024
    """The log of changed nodes is halved past 4 × max(nodes, this) entries."""

    def node_mask(self, key: Hashable, compute: Callable[[RowIndex], BoolArray]) -> BoolArray:
        """The rows of every node of a mask over nodes (or nodes × cards) that depends on each node's own state
        only, i.e. changes for a node only when its `node_version` does (its accounting, spec, pool, labels,
        taints). `compute(rows)` gives the mask's rows `rows`; `key` names the computation (one key, one
        `compute`). The mask is kept per key and recomputed on the rows of the nodes that changed since it was
        last asked (a log of changed nodes names them), so asking it again costs those rows, not the whole mask.
        Read-only, and valid until the state next changes."""
        out: BoolArray = self._kept_rows(key, compute, np.bool_)
        return out

    def node_values(self, key: Hashable, compute: Callable[[RowIndex], FloatArray]) -> FloatArray:
        """`node_mask` for values (per node, a score that depends on the node's own state only)."""
        out: FloatArray = self._kept_rows(key, compute, np.float64)
        return out

    def _kept_rows(self, key: Hashable, compute: Callable[[RowIndex], npt.NDArray[Any]],
                   dtype: type[np.generic]) -> npt.NDArray[Any]:
        n = self.size
        versions = self.node_version[:n]
        changes = self._changed_base + len(self._changed)
        kept = self._kept.pop(key, None)
        if kept is None or len(kept.version) < n or kept.rows.shape[1:] != (self.width,) * (kept.rows.ndim - 1):
            full = compute(slice(0, n))
            rows = np.zeros((len(self.node_version), *full.shape[1:]), dtype)
            rows[:n] = full
            kept = _KeptRows(rows, np.full(len(self.node_version), -1, np.int64), changes)
            kept.version[:n] = versions
        elif kept.seen != changes:
            since = kept.seen - self._changed_base
            if changes - kept.seen > n // 8:
                stale = None
            elif since >= 0:  # the nodes changed since, from the log (a node changed twice is computed once)
                stale = np.array(sorted(set(self._changed[since:])), np.int64)  # a few: cheaper than np.unique
            else:  # the log was cut since: compare versions
                stale = np.flatnonzero(kept.version[:n] != versions)
            if stale is None or len(stale) > n // 8:
                kept.rows[:n] = compute(slice(0, n))
                kept.version[:n] = versions
            elif len(stale):
                kept.rows[stale] = compute(stale)
                kept.version[stale] = versions[stale]
            kept.seen = changes
        self._kept[key] = kept  # last: the most recently asked
        if len(self._kept) > self.ROWS_KEPT:
            del self._kept[next(iter(self._kept))]
        out = kept.rows[:n]
        out.flags.writeable = False
        return out

    def _node_changed(self, n: int) -> None:
        """Node `n`'s row changed (its `node_version` moved, or it was added): log it for `_kept_rows`."""
        self._changed.append(n)
        if len(self._changed) > 4 * max(self.size, self.CHANGES_LOGGED_MIN):  # older rows then compare versions
            cut = len(self._changed) // 2
            del self._changed[:cut]
            self._changed_base += cut

    # ---------------------------------------------------------------- nodes
    def model_of(self, node: int) -> CardModel | None:
        idx = int(self.model_idx[node])
        return self.models[idx] if idx >= 0 else None

    def add_node(self, spec: NodeSpec) -> int:
        if spec.name in self.node_index:
            raise NodeSpecError(f"node {spec.name} added twice")
        model: CardModel | None = None
        if spec.gpu_model is not None:
            model = self.catalog.get(spec.gpu_model)
            if model.name != spec.gpu_model:
                spec = spec.with_changes(gpu_model=model.name)
        n = self.size
        self._grow(n + 1, spec.gpus)
        self.nodes.append(spec)
        self.node_index[spec.name] = n
        self.nic_free.append([nic.vfs for nic in spec.topology.nics])
        self.node_pods.append(set())
        self.cpu_cap[n] = self.cpu_free[n] = spec.cpu_milli
        self.mem_cap[n] = self.mem_free[n] = spec.memory_mib
        self.model_idx[n] = self._model_index[model.name] if model else -1
        self.gpu_milli_cap[n] = spec.gpus * MILLI_PER_CARD
        self.gpu_milli_used[n] = 0
        self.idle_cards[n] = spec.gpus
        self.rdma_max_free[n] = max(self.nic_free[n], default=0)
        g = spec.gpus
        self.card_valid[n, :g] = True
        self.card_milli_free[n, :g] = self.card_offline_free[n, :g] = MILLI_PER_CARD
        if model is not None:
            self.card_mem_phys[n, :g] = model.memory_mib
            self.card_enc_cap[n, :g] = self.card_enc_free[n, :g] = model.encoders
            self.card_dec_cap[n, :g] = self.card_dec_free[n, :g] = model.decoders
            mig_ok = model.mig_capable and spec.mig_mode is not MigMode.OFF
            self.card_mig_allowed[n, :g] = mig_ok
            pinned = model.mig_capable and spec.mig_mode is MigMode.ON
            self.card_mig_pinned[n, :g] = pinned
            self.card_mig[n, :g] = pinned
            if pinned:
                self.idle_cards[n] = 0
        self._set_pool(n, spec.pool)
        self._set_foreign(n, spec.foreign_cards)
        self.schedulable[n] = spec.schedulable
        if spec.taints:
            self.tainted.add(n)
        self._reset_label_caches()
        self._node_changed(n)
        return n

    def _set_pool(self, n: int, pool: str) -> None:
        """Apply the pool's memory oversell to node n's cards. Refuses to shrink below promised memory."""
        config = self.pools.get(pool, PoolConfig())
        self.offline_oversell[n] = config.offline_compute_oversell
        ratio = config.memory_oversell
        g = self.nodes[n].gpus
        new_cap = (self.card_mem_phys[n, :g] * ratio).astype(np.int64)
        whole = self.card_whole[n, :g]
        foreign = self.card_foreign[n, :g]
        used = np.where(whole, 0, self.card_mem_cap[n, :g] - self.card_mem_free[n, :g] - self.card_foreign_mem[n, :g])
        if (used > new_cap).any():
            card = int(np.flatnonzero(used > new_cap)[0])
            raise NodeSpecError(f"node {self.nodes[n].name}: pool {pool!r} would leave card {card} "
                                f"{int(used[card])} MiB promised on {int(new_cap[card])} MiB")
        # A card held whole stays fully taken whatever its capacity; release gives it all back. On a card another
        # stack holds, what gpuplane leaves stays held for that stack.
        left = np.where(whole, 0, new_cap - used)
        self.card_mem_free[n, :g] = np.where(foreign, 0, left)
        self.card_foreign_mem[n, :g] = np.where(foreign, left, 0)
        self.card_mem_cap[n, :g] = new_cap

    def _set_foreign(self, n: int, cards: frozenset[int]) -> None:
        """Hold every card of `cards` for another stack (no share, no whole card, no MIG instance goes there) and
        give back those it held that `cards` no longer names. gpuplane's own holders of a card that turns foreign
        keep what they hold; what they leave when they go stays held."""
        spec = self.nodes[n]
        model = self.model_of(n)
        for c in range(spec.gpus):
            held = bool(self.card_foreign[n, c])
            if (c in cards) == held:
                continue
            if held:
                self._give_back_foreign(n, c)
                self.card_foreign[n, c] = False
                if self.card_holders[n, c] == 1 and not self.card_mig[n, c]:
                    self.idle_cards[n] += 1
                self.card_holders[n, c] -= 1
                self.card_mig_allowed[n, c] = model is not None and model.mig_capable \
                    and spec.mig_mode is not MigMode.OFF
            else:
                if self.card_holders[n, c] == 0 and not self.card_mig[n, c]:
                    self.idle_cards[n] -= 1
                self.card_holders[n, c] += 1
                self.card_foreign[n, c] = True
                self.card_mig_allowed[n, c] = False
                self._hold_foreign(n, c)

    def _hold_foreign(self, n: int, c: int) -> None:
        """Move what card (n, c) has free into the other stack's hold."""
        milli = int(self.card_milli_free[n, c])
        self.card_foreign_milli[n, c] += milli
        self.card_foreign_mem[n, c] += self.card_mem_free[n, c]
        self.card_foreign_enc[n, c] += self.card_enc_free[n, c]
        self.card_foreign_dec[n, c] += self.card_dec_free[n, c]
        self.card_milli_free[n, c] = self.card_mem_free[n, c] = self.card_enc_free[n, c] = 0
        self.card_dec_free[n, c] = 0
        self.gpu_milli_used[n] += milli

    def _give_back_foreign(self, n: int, c: int) -> None:
        """Move the other stack's hold on card (n, c) back to free."""
        milli = int(self.card_foreign_milli[n, c])
        self.card_milli_free[n, c] += milli
        self.card_mem_free[n, c] += self.card_foreign_mem[n, c]
        self.card_enc_free[n, c] += self.card_foreign_enc[n, c]
        self.card_dec_free[n, c] += self.card_foreign_dec[n, c]
        self.card_foreign_milli[n, c] = self.card_foreign_mem[n, c] = self.card_foreign_enc[n, c] = 0
        self.card_foreign_dec[n, c] = 0
        self.gpu_milli_used[n] -= milli

    def update_node(self, spec: NodeSpec) -> None:
        """Apply a change of labels, taints, pool, schedulability or the cards another stack holds. Raises
        `NodeSpecError`, changing nothing,
        for a change of shape (cards, cpu, memory, card model, MIG mode, topology: the node must be removed and
        added again) or a pool whose oversell would leave less card memory than is promised."""
        n = self.node_index[spec.name]
        old = self.nodes[n]
        model = spec.gpu_model
        if model is not None and model in self.catalog:
            model = self.catalog.get(model).name
        changed = [name for name, before, after in (
            ("gpus", old.gpus, spec.gpus), ("cpu_milli", old.cpu_milli, spec.cpu_milli),
            ("memory_mib", old.memory_mib, spec.memory_mib), ("gpu_model", old.gpu_model, model),
            ("mig_mode", old.mig_mode, spec.mig_mode), ("topology", old.topology, spec.topology)) if before != after]
        if changed:
            raise NodeSpecError(f"node {spec.name}: {', '.join(changed)} changed: shape and capacity changes need "
                                "the node removed and added again")
        if spec.labels != old.labels:
            self._reset_label_caches()
        if spec.pool != old.pool:
            self.nodes[n] = spec
            try:
                self._set_pool(n, spec.pool)
            except NodeSpecError:
                self.nodes[n] = old
                raise
        self.nodes[n] = spec.with_changes(gpu_model=old.gpu_model)
        if spec.foreign_cards != old.foreign_cards:
            self._set_foreign(n, spec.foreign_cards)
        self.schedulable[n] = spec.schedulable
        self.node_version[n] += 1
        self._node_changed(n)
        if spec.pool != old.pool or spec.taints != old.taints:
            self._reset_node_masks()
        if spec.taints:
            self.tainted.add(n)
        else:
            self.tainted.discard(n)

    def pools_mask(self, pools: frozenset[str]) -> BoolArray:
        """Nodes of any of `pools` (read-only; cached until a node is added or changes pool)."""
        mask = self._pool_masks.get(pools)
        if mask is None:
            mask = np.fromiter((spec.pool in pools for spec in self.nodes), np.bool_, self.size)
            mask.flags.writeable = False
            self._pool_masks[pools] = mask
        return mask

    def taint_mask(self, request: PodRequest) -> BoolArray | None:
        """Nodes whose NoSchedule and NoExecute taints the pod all tolerates (kube-scheduler's TaintToleration
        filter, `FindMatchingUntoleratedTaint`); None when no node is tainted."""
        if not self.tainted:
            return None
        mask = self._taint_masks.get(request.tolerations)
        if mask is None:
            mask = np.ones(self.size, np.bool_)
            for i in self.tainted:
                mask[i] = all(request.tolerates(t.key, t.value, t.effect) for t in self.nodes[i].taints
                              if t.effect in FILTER_EFFECTS)
            mask.flags.writeable = False
            self._taint_masks[request.tolerations] = mask
        return mask

    def prefer_no_schedule_counts(self, request: PodRequest) -> IntArray | None:
        """Per node, the PreferNoSchedule taints the pod does not tolerate (TaintToleration's score counts them);
        None when no node has one the pod does not tolerate."""
        key = request.tolerations
        if key in self._prefer_counts:
            return self._prefer_counts[key]
        counts = np.zeros(self.size, np.int64)
        for i in self.tainted:
            counts[i] = sum(1 for t in self.nodes[i].taints
                            if t.effect == "PreferNoSchedule" and not request.tolerates(t.key, t.value, t.effect))
        counts.flags.writeable = False
        result = counts if counts.any() else None
        self._prefer_counts[key] = result
        return result

    # ---------------------------------------------------------------- node labels (selector, affinity)
    def _reset_label_caches(self) -> None:
        """Forget what was worked out from node labels and names (new dicts: a copy keeps its own)."""
        self._node_labels: list[dict[str, str]] | None = None
        self._label_columns: dict[str, _LabelColumn] = {}
        self._affinity_masks: dict[AffinityKey, BoolArray] = {}
        self._preferred_weights: dict[tuple[PreferredTerm, ...], IntArray] = {}
        self._reset_node_masks()

    def _reset_node_masks(self) -> None:
        """Forget the pool and taint masks (new dicts: a copy keeps its own)."""
        self._pool_masks: dict[frozenset[str], BoolArray] = {}
        self._taint_masks: dict[tuple[Toleration, ...], BoolArray] = {}
        self._prefer_counts: dict[tuple[Toleration, ...], IntArray | None] = {}

    def _column(self, key: str) -> _LabelColumn:
        column = self._label_columns.get(key)
        if column is not None:
            return column
        if self._node_labels is None:
            self._node_labels = [dict(spec.labels) for spec in self.nodes]
        n = self.size
        codes = np.full(n, -1, np.int64)
        numbers = np.zeros(n, np.int64)
        numeric = np.zeros(n, np.bool_)
        index: dict[str, int] = {}
        for i, labels in enumerate(self._node_labels):
            value = labels.get(key)
            if value is None:
                continue
            codes[i] = index.setdefault(value, len(index))
            number = parse_int64(value)
            if number is not None:
                numbers[i], numeric[i] = number, True
        column = _LabelColumn(codes, index, numbers, numeric)
        self._label_columns[key] = column
        return column

    def _requirement_mask(self, requirement: Requirement) -> BoolArray:
        """Nodes whose labels satisfy one requirement (`labels.Requirement.Matches`), vectorised."""
        op = requirement.operator
        column = self._column(requirement.key)
        if op in (SelectorOp.IN, SelectorOp.NOT_IN):
            wanted = [column.index[v] for v in requirement.values if v in column.index]
            found: BoolArray = np.isin(column.codes, wanted) if wanted else np.zeros(self.size, np.bool_)
            return found if op is SelectorOp.IN else ~found
        if op is SelectorOp.EXISTS:
            present: BoolArray = column.codes >= 0
            return present
        if op is SelectorOp.DOES_NOT_EXIST:
            absent: BoolArray = column.codes < 0
            return absent
        bound = int(requirement.values[0])
        compared = column.numbers > bound if op is SelectorOp.GT else column.numbers < bound
        out: BoolArray = column.numeric & compared
        return out

    def _field_mask(self, requirement: Requirement) -> BoolArray:
        """Nodes whose name satisfies a `matchFields` requirement (`metadata.name` In/NotIn one name)."""
        assert requirement.key == NODE_NAME_FIELD
        mask = np.zeros(self.size, np.bool_)
        row = self.node_index.get(requirement.values[0])
        if row is not None:
            mask[row] = True
        return mask if requirement.operator is SelectorOp.IN else ~mask

    def term_mask(self, term: NodeSelectorTerm) -> BoolArray:
        """Nodes a `NodeSelectorTerm` matches (an empty term matches none)."""
        mask = np.full(self.size, not term.empty, np.bool_)
        for requirement in term.expressions:
            mask &= self._requirement_mask(requirement)
        for requirement in term.fields:
            mask &= self._field_mask(requirement)
        return mask

    def affinity_mask(self, request: PodRequest) -> BoolArray | None:
        """Nodes that satisfy the pod's node selector and required node affinity (kube-scheduler's NodeAffinity
        filter, `RequiredNodeAffinity.Match`); None when the pod has neither. Cached per distinct constraint."""
        if not request.has_node_constraints:
            return None
        key: AffinityKey = (request.node_selector, request.required_terms)
        mask = self._affinity_masks.get(key)
        if mask is not None:
            return mask
        mask = np.ones(self.size, np.bool_)
        for label, value in request.node_selector:
            column = self._column(label)
            code = column.index.get(value)
            mask &= column.codes == code if code is not None else False
        if request.required_terms is not None:
            matched = np.zeros(self.size, np.bool_)
            for term in request.required_terms:
                matched |= self.term_mask(term)
            mask &= matched
        if len(self._affinity_masks) >= 1024:
            self._affinity_masks.clear()
        self._affinity_masks[key] = mask
        return mask

    def preferred_weights(self, terms: tuple[PreferredTerm, ...]) -> IntArray:
        """Per node, the sum of the weights of the preferred terms it matches (`PreferredSchedulingTerms.Score`)."""
        weights = self._preferred_weights.get(terms)
        if weights is None:
            weights = np.zeros(self.size, np.int64)
            for preferred in terms:
                weights += preferred.weight * self.term_mask(preferred.term)
            if len(self._preferred_weights) >= 1024:
                self._preferred_weights.clear()
            self._preferred_weights[terms] = weights
        return weights

    def model_allowed(self, models: frozenset[str] | None) -> BoolArray:
        """Per catalog model index: whether the request allows it (cached per model set)."""
        table = self._allowed_cache.get(models)
        if table is None:
            table = np.array([models is None or m.name in models for m in self.models] + [False], np.bool_)
            self._allowed_cache[models] = table
        return table

    # ---------------------------------------------------------------- placement
    def oversold(self, n: int, request: PodRequest) -> bool:
        """Whether `request`'s fractional shares on node row n would count against the offline budget."""
        return request.qos is QoS.OFFLINE and bool(self.offline_oversell[n])

    def milli_free_for(self, request: PodRequest, rows: RowIndex | int) -> IntArray:
        """The card compute a fractional share of `request` may take on node rows `rows`: the offline budget
        on the offline-oversold nodes for an offline pod, else `card_milli_free` (a view when no row differs)."""
        free: IntArray = self.card_milli_free[rows]
        if request.qos is not QoS.OFFLINE or not self.offline_oversell[: self.size].any():
            return free
        oversold = self.offline_oversell[rows]
        if not oversold.any():
            return free
        out: IntArray = np.where(oversold[..., None], self.card_offline_free[rows], free)
        return out

    def check(self, assignment: Assignment, request: PodRequest) -> str | None:
        """Why `assignment` cannot be applied now, or None if it fits."""
        n = self.node_index.get(assignment.node)
        if n is None:
            return f"node {assignment.node} does not exist"
        if request.name in self.bindings:
            return f"pod {request.name} is already placed"
        if self.cpu_free[n] < request.cpu_milli:
            return "insufficient cpu"
        if self.mem_free[n] < request.memory_mib:
            return "insufficient memory"
        spec = self.nodes[n]
        model = self.model_of(n)
        mismatch = _form_mismatch(request, assignment, model)
        if mismatch is not None:
            return mismatch
        seen: set[int] = set()
        oversold = self.oversold(n, request)
        for share in assignment.cards:
            c = share.card
            if not 0 <= c < spec.gpus or c in seen:
                return f"card {c} does not exist on {spec.name} or is named twice"
            seen.add(c)
            if request.models is not None and (model is None or model.name not in request.models):
                return "GPU model mismatch"
            if self.card_foreign[n, c]:
                return f"card {c} is held by another GPU stack's pod"
            if share.mig_profile is not None:
                reason = self._check_mig(n, c, share, model)
                if reason:
                    return reason
                continue
            if self.card_mig[n, c]:
                return f"card {c} is in MIG mode"
            if share.whole and self.card_holders[n, c]:
                return f"card {c} is not idle"
            if self.card_whole[n, c]:
                return f"card {c} is held whole by another pod"
            milli_free = self.card_offline_free if oversold and not share.whole else self.card_milli_free
            if (milli_free[n, c] < share.compute_milli or self.card_mem_free[n, c] < share.memory_mib
                    or self.card_enc_free[n, c] < share.encoders or self.card_dec_free[n, c] < share.decoders):
                return f"card {c} lacks capacity"
        if assignment.rdma is not None:
            nics = self.nic_free[n]
            if not 0 <= assignment.rdma.nic < len(nics) or nics[assignment.rdma.nic] < assignment.rdma.vfs:
                return "insufficient RDMA virtual functions"
        return None

    def _check_mig(self, n: int, c: int, share: CardShare, model: CardModel | None) -> str | None:
        profile = model.mig_profile(share.mig_profile) if model and share.mig_profile is not None else None
        if model is None or profile is None or share.mig_start is None:
            return f"card {c} has no MIG profile {share.mig_profile}"
        if share.mig_start not in profile.starts:
            return f"start {share.mig_start} is not legal for profile {profile.name}"
        refusal = self._mig_refusal(n, c, profile, model)
        if refusal is not None:
            return refusal
        if int(self.card_mig_slots[n, c]) & profile.slot_mask(share.mig_start):
            return f"memory slices of card {c} overlap"
        return None

    def _mig_refusal(self, n: int, c: int, profile: MigProfile, model: CardModel) -> str | None:
        """Why card (n, c) cannot take another instance of `profile` at any start, or None."""
        if not self.card_mig_allowed[n, c]:
            return f"card {c} does not take MIG instances"
        if not self.card_mig[n, c] and self.card_holders[n, c]:
            return f"card {c} has non-MIG holders"
        if profile.media_extensions and self.card_mig_me[n, c]:
            return f"card {c} already has a +me instance"
        if self.card_mig_compute[n, c] + profile.compute_slices > model.compute_slices:
            return f"card {c} lacks compute slices"
        count = sum(1 for inst in self.mig_instances.get((n, c), ()) if inst.profile_id == profile.profile_id)
        if count >= profile.max_count:
            return f"card {c} already has {count} of profile {profile.name}"
        return None

    def place(self, request: PodRequest, assignment: Assignment, *, check: bool = True) -> Binding:
        """Apply an assignment. Raises PlacementError when it does not fit (stale decision or bug).

        `check=False` skips the fit check: only for a caller that has just run `check` on this state itself, or
        for putting back a binding just released (what-ifs).
        """
        reason = self.check(assignment, request) if check else None
        if reason is not None:
            raise PlacementError(f"cannot place {request.name} on {assignment.node}: {reason}")
        n = self.node_index[assignment.node]
        self.cpu_free[n] -= request.cpu_milli
        self.mem_free[n] -= request.memory_mib
        workload = request.workload
        online = request.qos is QoS.ONLINE
        oversold = self.oversold(n, request)
        for share in assignment.cards:
            c = share.card
            foreign = bool(self.card_foreign[n, c])
            if foreign:  # only a what-if putting back a binding released here (check=False) gets this far
                self._give_back_foreign(n, c)
            if self.card_holders[n, c] == 0 and not self.card_mig[n, c]:
                self.idle_cards[n] -= 1
            self.card_holders[n, c] += 1
            if oversold and not share.whole:
                self.card_offline_free[n, c] -= share.compute_milli
            else:
                self.card_milli_free[n, c] -= share.compute_milli
                self.gpu_milli_used[n] += share.compute_milli
            self.card_mem_free[n, c] -= share.memory_mib
            self.card_enc_free[n, c] -= share.encoders
            self.card_dec_free[n, c] -= share.decoders
            if online:
                self.card_online_milli[n, c] += share.compute_milli
            if share.whole:
                self.card_whole[n, c] = True
                self.card_mem_free[n, c] = 0
            if share.mig_profile is not None and share.mig_start is not None:
                self._place_mig(n, c, request.name, share.mig_profile, share.mig_start)
            if foreign:
                self._hold_foreign(n, c)
            if workload is not None:
                self.workload_cards.setdefault(workload, Counter())[(n, c)] += 1
        if assignment.rdma is not None:
            self.nic_free[n][assignment.rdma.nic] -= assignment.rdma.vfs
            self.rdma_max_free[n] = max(self.nic_free[n])
        binding = Binding(request, n, assignment, oversold)
        self.bindings[request.name] = binding
        # the table's compute is what a pod holds of `card_milli_free` (what evicting it frees for online pods)
        self.pod_table.add(request.name, n, request.priority, request.cpu_milli, request.memory_mib, request.queue,
                           [(s.card, 0 if oversold and not s.whole else s.compute_milli,
                             int(self.card_mem_cap[n, s.card]) if s.whole else s.memory_mib,
                             s.whole, s.mig_profile is not None) for s in assignment.cards])
        self.node_pods[n].add(request.name)
        self.node_version[n] += 1
        self._node_changed(n)
        return binding

    def _place_mig(self, n: int, c: int, pod: str, profile_id: int, start: int) -> None:
        model = self.models[int(self.model_idx[n])]
        profile = model.mig_profiles[profile_id]
        self.card_mig[n, c] = True
        self.card_mig_slots[n, c] |= profile.slot_mask(start)
        self.card_mig_compute[n, c] += profile.compute_slices
        if profile.media_extensions:
            self.card_mig_me[n, c] = True
        self.mig_instances.setdefault((n, c), []).append(MigInstance(pod, profile_id, start))

    def release(self, pod: str) -> Binding:
        """Undo a placement exactly. Raises KeyError for a pod that is not placed."""
        binding = self.bindings.pop(pod)
        self.pod_table.remove(pod)
        self.node_pods[binding.node].discard(pod)
        self.node_version[binding.node] += 1
        self._node_changed(binding.node)
        n, assignment, request = binding.node, binding.assignment, binding.request
        self.cpu_free[n] += request.cpu_milli
        self.mem_free[n] += request.memory_mib
        for share in assignment.cards:
            c = share.card
            foreign = bool(self.card_foreign[n, c])
            if foreign:
                self._give_back_foreign(n, c)
            self.card_holders[n, c] -= 1
            if binding.oversold and not share.whole:
                self.card_offline_free[n, c] += share.compute_milli
            else:
                self.card_milli_free[n, c] += share.compute_milli
                self.gpu_milli_used[n] -= share.compute_milli
            self.card_mem_free[n, c] += share.memory_mib
            self.card_enc_free[n, c] += share.encoders
            self.card_dec_free[n, c] += share.decoders
            if request.qos is QoS.ONLINE:
                self.card_online_milli[n, c] -= share.compute_milli
            if share.whole:
                self.card_whole[n, c] = False
                self.card_mem_free[n, c] = self.card_mem_cap[n, c]
            if share.mig_profile is not None and share.mig_start is not None:
                self._release_mig(n, c, pod, share.mig_profile, share.mig_start)
            if foreign:  # what the pod leaves on a card another stack holds stays held
                self._hold_foreign(n, c)
            if self.card_holders[n, c] == 0 and not self.card_mig[n, c]:
                self.idle_cards[n] += 1
            if request.workload is not None:
                counts = self.workload_cards[request.workload]
                counts[(n, c)] -= 1
                if counts[(n, c)] <= 0:
                    del counts[(n, c)]
                if not counts:
                    del self.workload_cards[request.workload]
        if assignment.rdma is not None:
            self.nic_free[n][assignment.rdma.nic] += assignment.rdma.vfs
            self.rdma_max_free[n] = max(self.nic_free[n])
        return binding

    def _release_mig(self, n: int, c: int, pod: str, profile_id: int, start: int) -> None:
        model = self.models[int(self.model_idx[n])]
        profile = model.mig_profiles[profile_id]
        self.card_mig_slots[n, c] &= ~profile.slot_mask(start)
        self.card_mig_compute[n, c] -= profile.compute_slices
        instances = self.mig_instances[(n, c)]
        instances.remove(MigInstance(pod, profile_id, start))
        if profile.media_extensions:
            self.card_mig_me[n, c] = False
        if not instances:
            del self.mig_instances[(n, c)]
            if not self.card_mig_pinned[n, c]:
                self.card_mig[n, c] = False

    # ---------------------------------------------------------------- queries
    def mig_fits(self, n: int, c: int, profile: MigProfile) -> list[int]:
        """Legal free starts for `profile` on card (n, c), honouring the profile's count limit."""
        model = self.model_of(n)
        if model is None or self._mig_refusal(n, c, profile, model) is not None:
            return []
        occupied = int(self.card_mig_slots[n, c])
        return [s for s in profile.starts if not occupied & profile.slot_mask(s)]

    def copy(self) -> ClusterState:
        """An independent copy, for what-if evaluation (preemption, gang trial placement)."""
        clone = object.__new__(ClusterState)
        clone.__dict__.update(self.__dict__)
        clone.uid = next(_STATE_UIDS)
        for name in (*self._NODE_ARRAYS, *self._CARD_ARRAYS):
            setattr(clone, name, getattr(self, name).copy())
        clone.nodes = list(self.nodes)
        clone.node_index = dict(self.node_index)
        clone.bindings = dict(self.bindings)
        clone.mig_instances = {k: list(v) for k, v in self.mig_instances.items()}
        clone.workload_cards = {k: Counter(v) for k, v in self.workload_cards.items()}
        clone.nic_free = [list(v) for v in self.nic_free]
        clone.node_pods = [set(v) for v in self.node_pods]
        clone.tainted = set(self.tainted)
        clone.pod_table = self.pod_table.copy()
        clone._allowed_cache = dict(self._allowed_cache)
        clone._label_columns = dict(self._label_columns)
        clone._affinity_masks = dict(self._affinity_masks)
        clone._preferred_weights = dict(self._preferred_weights)
        clone._pool_masks = dict(self._pool_masks)
        clone._taint_masks = dict(self._taint_masks)
        clone._prefer_counts = dict(self._prefer_counts)
        clone._kept = {}
        clone._changed = []
        return clone

    def fingerprint(self) -> tuple[bytes, ...]:
        """Bytes of every live accounting array (not the change counters): equal means equal accounting."""
        n = self.size
        return tuple(getattr(self, name)[:n].tobytes() for name in (*self._NODE_ARRAYS, *self._CARD_ARRAYS)
                     if name != "node_version")

    def total_gpu_milli(self) -> int:
        return int(self.gpu_milli_cap[: self.size].sum())

    def used_gpu_milli(self) -> int:
        return int(self.gpu_milli_used[: self.size].sum())

    def card_used_milli(self) -> IntArray:
        """Used milli of every real card, flattened (padding dropped)."""
        n = self.size
        used: IntArray = (MILLI_PER_CARD - self.card_milli_free[:n])[self.card_valid[:n]]
        return used

    def check_invariants(self) -> list[str]:
        """Every violated invariant, as text (empty when the state is sound)."""
        n = self.size
        problems: list[str] = []
        valid = self.card_valid[:n]
        pairs: Iterable[tuple[str, npt.NDArray[np.int64], npt.NDArray[np.int64]]] = (
            ("cpu", self.cpu_free[:n], self.cpu_cap[:n]),
            ("memory", self.mem_free[:n], self.mem_cap[:n]),
        )
        for label, free, cap in pairs:
            if (free < 0).any() or (free > cap).any():
                problems.append(f"node {label} out of range")
        card_pairs = (
            ("gpu compute", self.card_milli_free, np.where(valid, MILLI_PER_CARD, 0)),
            ("offline gpu compute", self.card_offline_free, np.where(valid, MILLI_PER_CARD, 0)),
            ("gpu memory", self.card_mem_free, self.card_mem_cap),
            ("encoders", self.card_enc_free, self.card_enc_cap),
            ("decoders", self.card_dec_free, self.card_dec_cap),
        )
        for label, free2, cap2 in card_pairs:
            f, c = free2[:n], cap2[:n]
            if (f < 0).any() or (f > c).any():
                problems.append(f"card {label} out of range")
        for (node, card), instances in self.mig_instances.items():
            model = self.models[int(self.model_idx[node])]
            mask = 0
            for inst in instances:
                profile = model.mig_profiles[inst.profile_id]
                if inst.start not in profile.starts:
                    problems.append(f"card {node}/{card}: illegal start {inst.start}")
                bits = profile.slot_mask(inst.start)
                if mask & bits:
                    problems.append(f"card {node}/{card}: MIG instances overlap")
                mask |= bits
            if not self.card_mig[node, card]:
                problems.append(f"card {node}/{card}: MIG instances on a card not in MIG mode")
        for binding in self.bindings.values():
            for share in binding.assignment.cards:
                if (share.mig_profile is None) == bool(self.card_mig[binding.node, share.card]):
                    problems.append(f"card {binding.node}/{share.card}: MIG and non-MIG holders mixed")
        idle = ((self.card_holders[:n] == 0) & valid & ~self.card_mig[:n]).sum(axis=1)
        if not np.array_equal(idle, self.idle_cards[:n]):
            problems.append("idle card counts out of sync")
        foreign = self.card_foreign[:n]
        if (foreign & ((self.card_milli_free[:n] > 0) | (self.card_mem_free[:n] > 0) | (self.card_enc_free[:n] > 0)
                       | (self.card_dec_free[:n] > 0) | self.card_mig_allowed[:n])).any():
            problems.append("a card another stack holds has capacity free for gpuplane")
        return problems
