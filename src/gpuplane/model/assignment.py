"""What a placement decision hands out: cards (or slices of cards) on one node, and RDMA functions."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CardShare:
    """The part of one card a pod holds. A whole card holds all of every dimension."""

    card: int
    compute_milli: int
    memory_mib: int
    encoders: int = 0
    decoders: int = 0
    mig_profile: int | None = None
    mig_start: int | None = None
    whole: bool = False


class RdmaLocality(enum.Enum):
    PCIE_SWITCH = "pcie-switch"
    NUMA = "numa"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class RdmaShare:
    nic: int
    vfs: int
    locality: RdmaLocality


@dataclass(frozen=True, slots=True)
class Assignment:
    node: str
    cards: tuple[CardShare, ...] = ()
    rdma: RdmaShare | None = None
    oversubscribed: bool = False
    """True when a card's memory is promised beyond its physical size (pool oversell)."""

    @property
    def card_indexes(self) -> tuple[int, ...]:
        return tuple(share.card for share in self.cards)

    @property
    def gpu_milli(self) -> int:
        return sum(share.compute_milli for share in self.cards)
