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

from gpuplane.model import ClusterState, Fraction, MigSlice, PodRequest, WholeCards


@dataclass(slots=True)
class QueuedPod:
    request: PodRequest
    enqueued_at: float
    attempts: int = 0
    seq: int = -1
    """Sequence number of this entry's live heap item; older heap items for the same name are stale."""


class SchedulingQueue:
    def __init__(self) -> None:
        self._active: list[tuple[int, int, str]] = []
        self._pods: dict[str, QueuedPod] = {}
        self._parked: dict[str, QueuedPod] = {}
        self._seq = itertools.count()

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
            _, seq, name = heapq.heappop(self._active)
            entry = self._pods.get(name)
            if entry is not None and entry.seq == seq:
                del self._pods[name]
                entry.attempts += 1
                return entry
        return None

    def park(self, entry: QueuedPod) -> None:
        self._parked[entry.request.name] = entry

    def remove(self, name: str) -> None:
        self._pods.pop(name, None)
        self._parked.pop(name, None)

    def activate_all(self) -> int:
        """Move every parked pod back (a node was added or changed)."""
        moved = list(self._parked.values())
        self._parked.clear()
        for entry in moved:
            self._requeue(entry)
        return len(moved)

    def activate_for_node(self, state: ClusterState, node: int) -> int:
        """Move back the parked pods that `node`'s free capacity could now satisfy."""
        if not self._parked:
            return 0
        entries = list(self._parked.values())
        reqs = [e.request for e in entries]
        cpu = np.fromiter((r.cpu_milli for r in reqs), np.int64, len(reqs))
        mem = np.fromiter((r.memory_mib for r in reqs), np.int64, len(reqs))
        whole = np.fromiter((r.gpu.count if isinstance(r.gpu, WholeCards) else 0 for r in reqs), np.int64, len(reqs))
        milli = np.fromiter((r.gpu.compute_milli if isinstance(r.gpu, Fraction) else 0 for r in reqs), np.int64,
                            len(reqs))
        is_mig = np.fromiter((isinstance(r.gpu, MigSlice) for r in reqs), np.bool_, len(reqs))
        plain = state.card_valid[node] & ~state.card_mig[node]
        best_share = int(state.card_milli_free[node][plain].max()) if plain.any() else -1
        maybe = (cpu <= state.cpu_free[node]) & (mem <= state.mem_free[node])
        maybe &= (whole <= state.idle_cards[node]) & ((milli == 0) | (milli <= best_share) | is_mig)
        moved = 0
        for entry, ok in zip(entries, maybe, strict=True):
            if ok:
                del self._parked[entry.request.name]
                self._requeue(entry)
                moved += 1
        return moved

    def _requeue(self, entry: QueuedPod) -> None:
        entry.seq = next(self._seq)
        self._pods[entry.request.name] = entry
        heapq.heappush(self._active, (-entry.request.priority, entry.seq, entry.request.name))
