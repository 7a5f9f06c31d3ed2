"""The scheduling queue: pending pods by priority then arrival; parked pods retried on capacity change.

A parked (unschedulable) pod is not polled. When capacity frees on a node, a vectorised hint over all
parked pods moves back only those whose demand that node could now meet (cpu, memory, idle cards or
the largest free card share), like kube-scheduler's queueing hints.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpuplane.model import ClusterState, Fraction, MigSlice, PodRequest, WholeCards


@dataclass(slots=True)
class QueuedPod:
    request: PodRequest
    enqueued_at: float
    attempts: int = 0
    hint_node: int = -1
    """The node whose freed capacity reactivated this pod (-1: not reactivated by a node)."""
    order: int = -1
    """Arrival order in the queue, fixed at `add`: ties in priority go to the pod that came first."""
    seq: int = -1
    """Sequence number of this entry's live heap item; older heap items for the same name are stale."""
    alike: PodRequest | None = None
    """The request under a common name (the scheduler's key for pods that decide alike), made once."""


ShapeKey = tuple[object, ...]


def shape_key(request: PodRequest) -> ShapeKey:
    """What decides where a pod fits: everything but its name, priority and QoS."""
    return (request.cpu_milli, request.memory_mib, request.gpu, request.models, request.rdma_vfs, request.pools,
            request.tolerations, request.workload, request.instance, request.gang, request.node_selector,
            request.required_terms, request.unsupported)


_UNBOUNDED = np.iinfo(np.int64).max // 4


class SchedulingQueue:
    """Active pods in a heap by (priority, arrival); parked pods grouped by shape.

    A parked pod is not retried until capacity frees somewhere it could use. Pods of one shape fit the
    same places, so a freed node reactivates, per shape, at most as many pods as it could hold (an
    over-estimate: models, taints, codecs and MIG slots are left to the real filters). One vectorised
    pass over the shapes costs microseconds however many pods wait.
    """

    def __init__(self) -> None:
        self._active: list[tuple[int, int, int, str]] = []
        self._pods: dict[str, QueuedPod] = {}
        self._parked: dict[str, QueuedPod] = {}
        self._seq = itertools.count()
        self._group_of: dict[ShapeKey, int] = {}
        self._group_heaps: list[list[tuple[int, int, int, str]]] = []
        self._group_live = np.zeros(0, np.int64)
        self._group_cpu = np.zeros(0, np.int64)
        self._group_mem = np.zeros(0, np.int64)
        self._group_whole = np.zeros(0, np.int64)
        self._group_milli = np.zeros(0, np.int64)
        self._group_gpu_mem = np.zeros(0, np.int64)
        self._group_span = np.zeros(0, np.int64)
        """Distinct cards each pod of a fractional group takes a share of (HAMi's `gpu: N` with `gpumem`)."""
        self._group_unbounded_gpu = np.zeros(0, np.bool_)
        self._entry_group: dict[str, int] = {}
        self._group_request: list[PodRequest] = []
        """A pod of each group: its shape decides the node filters the group passes."""

    def __len__(self) -> int:
        return len(self._pods) + len(self._parked)

    def __contains__(self, name: object) -> bool:
        return name in self._pods or name in self._parked

    @property
    def parked(self) -> list[QueuedPod]:
        return list(self._parked.values())

    def add(self, request: PodRequest, now: float) -> None:
        if request.name in self:
            return
        self._requeue(QueuedPod(request, now))

    def pop(self) -> QueuedPod | None:
        while self._active:
            _, _, seq, name = heapq.heappop(self._active)
            entry = self._pods.get(name)
            if entry is not None and entry.seq == seq:
                del self._pods[name]
                entry.attempts += 1
                return entry
        return None

    def park(self, entry: QueuedPod) -> None:
        """Park `entry` (a name is queued once: an active or parked entry of the same name is replaced)."""
        self.take(entry.request.name)
        group = self._group(entry.request)
        entry.seq = next(self._seq)
        self._parked[entry.request.name] = entry
        self._entry_group[entry.request.name] = group
        heapq.heappush(self._group_heaps[group],
                       (-entry.request.priority, entry.order, entry.seq, entry.request.name))
        self._group_live[group] += 1

    def remove(self, name: str) -> None:
        self.take(name)

    def take(self, name: str) -> QueuedPod | None:
        """Remove a pod, active or parked, and return its entry (None if it is not queued)."""
        entry = self._pods.pop(name, None)
        if entry is not None:
            return entry
        entry = self._parked.pop(name, None)
        if entry is not None:
            self._group_live[self._entry_group.pop(name)] -= 1
        return entry

    def entries(self) -> list[QueuedPod]:
        """Every queued entry, active and parked."""
        return [*self._pods.values(), *self._parked.values()]

    def requeue(self, entry: QueuedPod) -> None:
        """Put an entry taken out earlier back among the active pods, keeping its arrival order."""
        self._requeue(entry)

    def activate_all(self) -> int:
        """Move every parked pod back (a node was added or changed)."""
        moved = list(self._parked.values())
        self._parked.clear()
        self._entry_group.clear()
        for heap in self._group_heaps:
            heap.clear()
        self._group_live[:] = 0
        for entry in moved:
            self._requeue(entry)
        return len(moved)

    def activate_for_node(self, state: ClusterState, node: int, *, above_priority: int | None = None,
                          filtered: bool = True, budgeted: bool = True) -> int:
        """Move back the parked pods that `node`'s free capacity could hold, in queue order (only pods of
        priority above `above_priority` when given; `filtered`: only pods the node's pool, taints, labels,
        cordon and GPU model admit, `admits`; not `budgeted`: every such pod of a shape the node has room for,
        not only as many as its capacity holds, for a node that changed: a pod the budget passed over at an
        earlier wake-up must not miss this one).

        A vectorised bound per shape picks the shapes worth a look; then the heads of those shapes are
        taken in (priority, arrival) order against a running budget of the node's free capacity, and a
        shape is dropped at its first pod that no longer fits (its later pods are the same shape).
        """
        if not self._parked:
            return 0
        live = np.flatnonzero(self._group_live > 0)
        room = self._room(state, node, live)
        heads: list[tuple[int, int, int]] = []
        for group in live[room > 0]:
            if filtered and not admits(state, self._group_request[group], node):
                continue  # a node its unresolvable filters refuse: only a node event changes that
            head = self._head(int(group))
            if head is not None:
                heads.append((head[0], head[1], int(group)))
        heapq.heapify(heads)
        budget = _Budget(state, node)
        moved = 0
        while heads:
            neg_priority, _, group = heapq.heappop(heads)
            if above_priority is not None and -neg_priority <= above_priority:
                break  # heads come out by priority: every later one is lower
            # A gang member takes no budget: its gang needs more than this node, so it may well not use it, and
            # the pods behind it must not miss the capacity (a plain pod that does not use it is looked at again).
            if budgeted and self._group_request[group].gang is None and not budget.take(self, group):
                continue
            name = heapq.heappop(self._group_heaps[group])[3]
            entry = self._parked.pop(name)
            del self._entry_group[name]
            self._group_live[group] -= 1
            entry.hint_node = node
            self._requeue(entry)
            moved += 1
            head = self._head(group)
            if head is not None:
                heapq.heappush(heads, (head[0], head[1], group))
        return moved

    def _head(self, group: int) -> tuple[int, int] | None:
        """(−priority, arrival order) of the group's first live entry, dropping stale heap items."""
        heap = self._group_heaps[group]
        while heap:
            priority, order, seq, name = heap[0]
            entry = self._parked.get(name)
            if entry is not None and entry.seq == seq:
                return priority, order
            heapq.heappop(heap)
        return None

    def _room(self, state: ClusterState, node: int, groups: np.ndarray) -> np.ndarray:
        """Per group, an upper bound on how many of its pods `node` could take now."""
        cpu, mem = self._group_cpu[groups], self._group_mem[groups]
        room = np.full(len(groups), _UNBOUNDED, np.int64)
        np.minimum(room, np.where(cpu > 0, state.cpu_free[node] // np.maximum(cpu, 1), _UNBOUNDED), out=room)
        np.minimum(room, np.where(mem > 0, state.mem_free[node] // np.maximum(mem, 1), _UNBOUNDED), out=room)
        whole = self._group_whole[groups]
        np.minimum(room, np.where(whole > 0, state.idle_cards[node] // np.maximum(whole, 1), _UNBOUNDED), out=room)
        milli, gpu_mem = self._group_milli[groups], self._group_gpu_mem[groups]
        fraction = (milli > 0) | (gpu_mem > 0)
        if fraction.any():
            plain = state.card_valid[node] & ~state.card_mig[node] & ~state.card_whole[node]
            free_milli = _milli_bound(state, node)[plain]
            free_mem = state.card_mem_free[node][plain]
            per_card = np.full((len(groups), len(free_milli)), _UNBOUNDED, np.int64)
            by_milli = free_milli[None, :] // np.maximum(milli, 1)[:, None]
            by_mem = free_mem[None, :] // np.maximum(gpu_mem, 1)[:, None]
            per_card = np.where((milli > 0)[:, None], np.minimum(per_card, by_milli), per_card)
            per_card = np.where((gpu_mem > 0)[:, None], np.minimum(per_card, by_mem), per_card)
            slots = np.minimum(per_card, len(groups) + 1024).sum(axis=1) if len(free_milli) else \
                np.zeros(len(groups), np.int64)
            slots //= np.maximum(self._group_span[groups], 1)  # each pod needs that many of the card slots
            np.minimum(room, np.where(fraction, slots, _UNBOUNDED), out=room)
        room[self._group_unbounded_gpu[groups]] = np.maximum(room[self._group_unbounded_gpu[groups]], 1)
        return room

    def _group(self, request: PodRequest) -> int:
        key = shape_key(request)
        group = self._group_of.get(key)
        if group is not None:
            return group
        group = len(self._group_heaps)
        self._group_of[key] = group
        self._group_heaps.append([])
        self._group_request.append(request)
        gpu = request.gpu
        values = (
            request.cpu_milli,
            request.memory_mib,
            gpu.count if isinstance(gpu, WholeCards) else 0,
            gpu.compute_milli if isinstance(gpu, Fraction) else 0,
            gpu.memory_mib if isinstance(gpu, Fraction) else 0,
            gpu.count if isinstance(gpu, Fraction) else 0,
        )
        self._group_live = np.append(self._group_live, 0)
        for name, value in zip(("cpu", "mem", "whole", "milli", "gpu_mem", "span"), values, strict=True):
            setattr(self, f"_group_{name}", np.append(getattr(self, f"_group_{name}"), value))
        # MIG slices and codec- or percent-only fractions: let at least one through to the real filters.
        unbounded = isinstance(gpu, MigSlice) or (isinstance(gpu, Fraction) and not gpu.compute_milli
                                                  and not gpu.memory_mib)
        self._group_unbounded_gpu = np.append(self._group_unbounded_gpu, unbounded)
        return group

    def shape(self, group: int) -> tuple[int, int, int, int, int, int, bool]:
        """(cpu, memory, whole cards, milli, GPU memory, cards sharing, unbounded) of a group's pods."""
        return (int(self._group_cpu[group]), int(self._group_mem[group]), int(self._group_whole[group]),
                int(self._group_milli[group]), int(self._group_gpu_mem[group]), int(self._group_span[group]),
                bool(self._group_unbounded_gpu[group]))

    def _requeue(self, entry: QueuedPod) -> None:
        if entry.request.name in self._parked:
            self.take(entry.request.name)
        entry.seq = next(self._seq)
        if entry.order < 0:
            entry.order = entry.seq
        self._pods[entry.request.name] = entry
        heapq.heappush(self._active, (-entry.request.priority, entry.order, entry.seq, entry.request.name))


def admits(state: ClusterState, request: PodRequest, node: int) -> bool:
    """Whether `node` passes the pod's unresolvable node filters (NodeFit's cordon, pool, taints, node affinity,
    GPU model): the scalar form of `static_nodes`, for one node."""
    if not state.schedulable[node] and not request.tolerates_unschedulable:
        return False
    if request.pools is not None and not state.pools_mask(request.pools)[node]:
        return False
    for mask in (state.taint_mask(request), state.affinity_mask(request)):
        if mask is not None and not mask[node]:
            return False
    if request.gpu is not None:
        model = int(state.model_idx[node])
        if model < 0 or (request.models is not None and not state.model_allowed(request.models)[model]):
            return False
    return True


def static_nodes(state: ClusterState, request: PodRequest) -> npt.NDArray[np.bool_]:
    """The nodes that pass the pod's unresolvable node filters (`admits` on every node, vectorised): only a
    node event changes them."""
    n = state.size
    mask = state.schedulable[:n].copy() if not request.tolerates_unschedulable else np.ones(n, np.bool_)
    if request.pools is not None:
        mask &= state.pools_mask(request.pools)[:n]
    for extra in (state.taint_mask(request), state.affinity_mask(request)):
        if extra is not None:
            mask &= extra[:n]
    if request.gpu is not None:
        model_idx = state.model_idx[:n]
        mask &= model_idx >= 0
        if request.models is not None:
            mask &= state.model_allowed(request.models)[model_idx]
    return mask


def _milli_bound(state: ClusterState, node: int) -> np.ndarray:
    """Per card, the most compute a fractional pod of any class may take now (an offline pod on an
    offline-oversold node takes the offline budget, `ClusterState.milli_free_for`)."""
    free: np.ndarray = state.card_milli_free[node]
    if state.offline_oversell[node]:
        free = np.maximum(free, state.card_offline_free[node])
    return free


class _Budget:
    """A node's free capacity, consumed as parked pods are reactivated against it."""

    def __init__(self, state: ClusterState, node: int) -> None:
        self.cpu = int(state.cpu_free[node])
        self.mem = int(state.mem_free[node])
        self.idle = int(state.idle_cards[node])
        plain = state.card_valid[node] & ~state.card_mig[node] & ~state.card_whole[node]
        self.cards = [[int(m), int(g)] for m, g in zip(_milli_bound(state, node)[plain],
                                                        state.card_mem_free[node][plain], strict=True)]
        self.unbounded_taken: set[int] = set()

    def take(self, queue: SchedulingQueue, group: int) -> bool:
        cpu, mem, whole, milli, gpu_mem, span, unbounded = queue.shape(group)
        if cpu > self.cpu or mem > self.mem or whole > self.idle:
            return False
        cards: list[list[int]] = []
        if milli or gpu_mem:
            fitting = [c for c in self.cards if c[0] >= milli and c[1] >= gpu_mem]
            if len(fitting) < max(span, 1):
                return False
            cards = sorted(fitting, key=lambda c: (c[0] - milli, c[1] - gpu_mem))[: max(span, 1)]
        elif unbounded:
            # MIG slices and codec-only fractions: one per shape goes through to the real filters.
            if group in self.unbounded_taken:
                return False
            self.unbounded_taken.add(group)
        self.cpu -= cpu
        self.mem -= mem
        self.idle -= whole
        for card in cards:
            card[0] -= milli
            card[1] -= gpu_mem
        return True
