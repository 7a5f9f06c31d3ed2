"""Queue (tenant) quotas: a guaranteed minimum and a maximum, in GPUs.

A queue may run beyond its minimum by borrowing idle capacity, up to its maximum; borrowed capacity is
reclaimed (its pods preempted, whatever their priority) when a queue below its minimum needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.model.catalog import MILLI_PER_CARD
from gpuplane.model.errors import GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model


class QuotaError(GpuplaneError):
    pass


@dataclass(frozen=True, slots=True)
class QueueQuota:
    """`min_gpus` is guaranteed; `max_gpus` is never exceeded (None: no cap)."""

    name: str
    min_gpus: float = 0.0
    max_gpus: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise QuotaError("queue: name must not be empty")
        if self.min_gpus < 0:
            raise QuotaError(f"queue {self.name}: min_gpus must not be below zero, got {self.min_gpus}")
        if self.max_gpus is not None and self.max_gpus < 0:
            raise QuotaError(f"queue {self.name}: max_gpus must not be below zero, got {self.max_gpus}")
        if self.max_gpus is not None and self.min_gpus > self.max_gpus:
            raise QuotaError(f"queue {self.name}: min_gpus {self.min_gpus} is above max_gpus {self.max_gpus}")

    @property
    def min_milli(self) -> int:
        return round(self.min_gpus * MILLI_PER_CARD)

    @property
    def max_milli(self) -> int | None:
        return None if self.max_gpus is None else round(self.max_gpus * MILLI_PER_CARD)


class Quotas:
    def __init__(self, queues: Iterable[QueueQuota] = ()) -> None:
        self._by_name: dict[str, QueueQuota] = {}
        for queue in queues:
            if queue.name in self._by_name:
                raise QuotaError(f"queue {queue.name!r} is defined twice")
            self._by_name[queue.name] = queue

    def __iter__(self) -> Iterator[QueueQuota]:
        return iter(self._by_name.values())

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def get(self, name: str) -> QueueQuota | None:
        return self._by_name.get(name)


class _QueueFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    min_gpus: float = Field(default=0.0, ge=0)
    max_gpus: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _min_below_max(self) -> _QueueFile:
        if self.max_gpus is not None and self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus {self.min_gpus} is above max_gpus {self.max_gpus}")
        return self


class _QuotasFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queues: list[_QueueFile]


def load_quotas(path: str | Path) -> Quotas:
    """Read `queues: [{name, min_gpus, max_gpus}]` from YAML; errors name the file and field."""
    parsed = load_yaml_model(path, _QuotasFile, QuotaError)
    try:
        return Quotas(QueueQuota(q.name, q.min_gpus, q.max_gpus) for q in parsed.queues)
    except QuotaError as exc:
        raise QuotaError(f"{path}: {exc}") from None
