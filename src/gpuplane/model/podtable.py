"""Placed pods as numpy rows, for vectorised questions across every pod (which could be preempted where).

`ClusterState` keeps one pod row per binding and one share row per card share; rows are reused after a
release. Nothing here decides anything: it only lets a caller answer aggregates such as "per card, how
much compute do pods below priority p hold" with one `bincount`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class _Rows:
    """Growable column arrays with a free list; subclasses name their columns in `COLUMNS`."""

    COLUMNS: ClassVar[tuple[tuple[str, type], ...]] = ()

    def __init__(self) -> None:
        self.capacity = 0
        self.count = 0
        self.free: list[int] = []
        self.live = np.zeros(0, np.bool_)
        for name, dtype in self.COLUMNS:
            setattr(self, name, np.zeros(0, dtype))

    def take(self) -> int:
        if self.free:
            row = self.free.pop()
        else:
            if self.count == self.capacity:
                self._grow(max(64, self.capacity * 2))
            row = self.count
            self.count += 1
        self.live[row] = True
        return row

    def give_back(self, row: int) -> None:
        self.live[row] = False
        self.free.append(row)

    def _grow(self, capacity: int) -> None:
        for name, dtype in (*self.COLUMNS, ("live", np.bool_)):
            grown: npt.NDArray[np.generic] = np.zeros(capacity, dtype)
            grown[: self.capacity] = getattr(self, name)
            setattr(self, name, grown)
        self.capacity = capacity

    def copy(self) -> _Rows:
        clone = object.__new__(type(self))
        clone.capacity, clone.count, clone.free = self.capacity, self.count, list(self.free)
        for name, _ in (*self.COLUMNS, ("live", np.bool_)):
            setattr(clone, name, getattr(self, name).copy())
        return clone


class PodRows(_Rows):
    COLUMNS = (("node", np.int64), ("priority", np.int64), ("cpu", np.int64), ("mem", np.int64),
               ("queue", np.int64), ("gpu_milli", np.int64))
    node: IntArray
    priority: IntArray
    cpu: IntArray
    mem: IntArray
    queue: IntArray
    gpu_milli: IntArray


class ShareRows(_Rows):
    COLUMNS = (("pod", np.int64), ("node", np.int64), ("card", np.int64), ("milli", np.int64),
               ("mem", np.int64), ("whole", np.bool_), ("mig", np.bool_))
    pod: IntArray
    node: IntArray
    card: IntArray
    milli: IntArray
    mem: IntArray
    whole: BoolArray
    mig: BoolArray


class PodTable:
    """Pod rows (node, priority, cpu, memory, queue, GPU milli) and their card-share rows."""

    def __init__(self) -> None:
        self.pods = PodRows()
        self.shares = ShareRows()
        self.row_of: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.names: dict[int, str] = {}
        self.queue_ids: dict[str | None, int] = {None: 0}

    def queue_id(self, queue: str | None) -> int:
        qid = self.queue_ids.get(queue)
        if qid is None:
            qid = self.queue_ids[queue] = len(self.queue_ids)
        return qid

    def add(self, name: str, node: int, priority: int, cpu: int, mem: int, queue: str | None,
            shares: list[tuple[int, int, int, bool, bool]]) -> None:
        """`shares`: (card, compute milli, memory MiB, whole, mig) per card share."""
        pods, table = self.pods, self.shares
        row = pods.take()
        pods.node[row], pods.priority[row], pods.cpu[row], pods.mem[row] = node, priority, cpu, mem
        pods.queue[row] = self.queue_id(queue)
        pods.gpu_milli[row] = sum(s[1] for s in shares)
        share_rows: list[int] = []
        for card, milli, memory, whole, mig in shares:
            srow = table.take()
            table.pod[srow], table.node[srow], table.card[srow] = row, node, card
            table.milli[srow], table.mem[srow], table.whole[srow], table.mig[srow] = milli, memory, whole, mig
            share_rows.append(srow)
        self.row_of[name] = (row, tuple(share_rows))
        self.names[row] = name

    def remove(self, name: str) -> None:
        row, share_rows = self.row_of.pop(name)
        del self.names[row]
        self.pods.give_back(row)
        for srow in share_rows:
            self.shares.give_back(srow)

    def copy(self) -> PodTable:
        clone = object.__new__(PodTable)
        clone.pods = self.pods.copy()  # type: ignore[assignment]
        clone.shares = self.shares.copy()  # type: ignore[assignment]
        clone.row_of = dict(self.row_of)
        clone.names = dict(self.names)
        clone.queue_ids = dict(self.queue_ids)
        return clone
