"""Nodes: capacity, cards, pool, labels, taints and the topology that multi-card pods care about."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from gpuplane.model.errors import NodeSpecError


class MigMode(enum.Enum):
    """How a node's MIG-capable cards take MIG instances.

    DYNAMIC: an idle card enters MIG mode with its first instance and leaves it with its last.
    ON: the cards are always in MIG mode (take only MIG requests). OFF: never.
    """

    DYNAMIC = "dynamic"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class RdmaNic:
    name: str
    pcie_switch: int
    numa: int
    vfs: int

    def __post_init__(self) -> None:
        if self.vfs < 0:
            raise NodeSpecError(f"NIC {self.name}: virtual functions must not be negative")


@dataclass(frozen=True, slots=True)
class Topology:
    """Where each card sits. Tuples are indexed by card index."""

    numa: tuple[int, ...]
    pcie_switch: tuple[int, ...]
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    nics: tuple[RdmaNic, ...] = ()

    @staticmethod
    def default(cards: int) -> Topology:
        """Two NUMA nodes (halves), a PCIe switch per pair of cards, no NVLink, no RDMA NICs."""
        half = max(1, (cards + 1) // 2)
        return Topology(numa=tuple(i // half for i in range(cards)),
                        pcie_switch=tuple(i // 2 for i in range(cards)))

    def nvlink_group_of(self, card: int) -> int:
        for index, group in enumerate(self.nvlink_groups):
            if card in group:
                return index
        return -1


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpu_model: str | None
    """Canonical card model name; None for a CPU-only node."""
    gpus: int
    pool: str = "default"
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[Taint, ...] = ()
    schedulable: bool = True
    mig_mode: MigMode = MigMode.DYNAMIC
    topology: Topology = field(default_factory=lambda: Topology((), ()))
    foreign_cards: frozenset[int] = frozenset()
    """Cards another GPU stack holds (the NVIDIA device plugin's pods, KAI fractions, DRA claims: the node agent
    reads them from kubelet's PodResources API): gpuplane counts them fully taken, so none is double-booked."""

    def __post_init__(self) -> None:
        if not self.name:
            raise NodeSpecError("node name must not be empty")
        outside = sorted(c for c in self.foreign_cards if not 0 <= c < self.gpus)
        if outside:
            raise NodeSpecError(f"node {self.name}: foreign_cards names card(s) {outside}, node has {self.gpus}")
        for attr in ("cpu_milli", "memory_mib", "gpus"):
            if getattr(self, attr) < 0:
                raise NodeSpecError(f"node {self.name}: {attr} must not be negative")
        if self.gpus and self.gpu_model is None:
            raise NodeSpecError(f"node {self.name}: has {self.gpus} GPUs but no GPU model")
        topo = self.topology
        if not topo.numa and not topo.pcie_switch and self.gpus:
            object.__setattr__(self, "topology", Topology.default(self.gpus))
            topo = self.topology
        if len(topo.numa) != self.gpus or len(topo.pcie_switch) != self.gpus:
            raise NodeSpecError(f"node {self.name}: topology describes {len(topo.numa)} cards, node has {self.gpus}")
        seen: set[int] = set()
        for group in topo.nvlink_groups:
            for card in group:
                if not 0 <= card < self.gpus or card in seen:
                    raise NodeSpecError(f"node {self.name}: NVLink group {group} names card {card} "
                                        "out of range or twice")
                seen.add(card)

    def with_changes(self, **changes: object) -> NodeSpec:
        return replace(self, **changes)  # type: ignore[arg-type]

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None
