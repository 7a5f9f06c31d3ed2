"""Queue (tenant) quotas: a guaranteed minimum and a maximum, in GPUs, overall and per card model.

A queue may run beyond its minimum by borrowing idle capacity, up to its maximum; borrowed capacity is
reclaimed (its pods preempted, whatever their priority) when a queue below its minimum needs it. Two
switches change that: a queue that does not `borrow` never runs beyond its minimum, and a queue that does
not `lend` keeps its idle guaranteed share free: no other pod may take it, so it never needs reclaiming.

Per card model (`models`), a queue's pods on cards of that model count against the model's own `max`
(those cards are never used beyond it) and `min` (guaranteed on that model; what `lend` keeps free is per
model too). The queue's overall minimum covers its models' minimums.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.model.catalog import MILLI_PER_CARD, Catalog
from gpuplane.model.errors import CatalogError, GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model


class QuotaError(GpuplaneError):
    pass


def _check_bounds(what: str, min_gpus: float, max_gpus: float | None) -> None:
    if min_gpus < 0:
        raise QuotaError(f"{what}: min_gpus must not be below zero, got {min_gpus}")
    if max_gpus is not None and max_gpus < 0:
        raise QuotaError(f"{what}: max_gpus must not be below zero, got {max_gpus}")
    if max_gpus is not None and min_gpus > max_gpus:
        raise QuotaError(f"{what}: min_gpus {min_gpus} is above max_gpus {max_gpus}")


class _Bounds:
    """`min_gpus` and `max_gpus` in milli-GPUs."""

    __slots__ = ()
    min_gpus: float
    max_gpus: float | None

    @property
    def min_milli(self) -> int:
        return round(self.min_gpus * MILLI_PER_CARD)

    @property
    def max_milli(self) -> int | None:
        return None if self.max_gpus is None else round(self.max_gpus * MILLI_PER_CARD)


@dataclass(frozen=True, slots=True)
class ModelQuota(_Bounds):
    """A queue's share of one card model (canonical catalog name): `min_gpus` guaranteed, at most `max_gpus`."""

    model: str
    min_gpus: float = 0.0
    max_gpus: float | None = None


@dataclass(frozen=True, slots=True)
class QueueQuota(_Bounds):
    """`min_gpus` is guaranteed; `max_gpus` is never exceeded (None: no cap); `models` limit card models."""

    name: str
    min_gpus: float = 0.0
    max_gpus: float | None = None
    models: tuple[ModelQuota, ...] = ()
    borrow: bool = True
    """False: the queue never runs beyond its minimum (overall and per model), whatever is idle."""
    lend: bool = True
    """False: the queue's idle guaranteed share is kept free for it; pods of other queues never take it."""

    def __post_init__(self) -> None:
        if not self.name:
            raise QuotaError("queue: name must not be empty")
        _check_bounds(f"queue {self.name}", self.min_gpus, self.max_gpus)
        seen: set[str] = set()
        for share in self.models:
            what = f"queue {self.name}: models.{share.model}"
            if not share.model:
                raise QuotaError(f"queue {self.name}: models: a model name must not be empty")
            if share.model in seen:
                raise QuotaError(f"{what}: the model is listed twice")
            seen.add(share.model)
            _check_bounds(what, share.min_gpus, share.max_gpus)
            if self.max_gpus is not None and share.min_gpus > self.max_gpus:
                raise QuotaError(f"{what}: min_gpus {share.min_gpus} is above the queue's max_gpus {self.max_gpus}")
        floor = sum(share.min_milli for share in self.models)
        if self.min_milli < floor:
            raise QuotaError(f"queue {self.name}: min_gpus {self.min_gpus} is below the sum of its models' "
                             f"min_gpus ({floor / MILLI_PER_CARD:g})")

    @property
    def cap_milli(self) -> int | None:
        """What the queue may hold at most: its maximum, or its minimum when it does not borrow."""
        return self.min_milli if not self.borrow else self.max_milli

    def model(self, name: str) -> ModelQuota | None:
        for share in self.models:
            if share.model == name:
                return share
        return None

    def model_cap_milli(self, share: ModelQuota) -> int | None:
        return share.min_milli if not self.borrow else share.max_milli


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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quotas) and self._by_name == other._by_name

    def __repr__(self) -> str:
        return f"Quotas({list(self._by_name.values())!r})"

    def get(self, name: str) -> QueueQuota | None:
        return self._by_name.get(name)

    @property
    def per_model(self) -> bool:
        """Whether any queue limits a card model or keeps its idle share (the scheduler's costlier checks)."""
        return any(q.models or not q.lend for q in self._by_name.values())


def canonical_models(queue: QueueQuota, catalog: Catalog) -> QueueQuota:
    """`queue` with its models' names made canonical (`H100` → `H100-80GB`); unknown models raise, named."""
    shares = []
    for share in queue.models:
        try:
            name = catalog.canonical(share.model)
        except CatalogError as exc:
            raise QuotaError(f"queue {queue.name}: models.{share.model}: {exc}") from None
        shares.append(ModelQuota(name, share.min_gpus, share.max_gpus))
    return QueueQuota(queue.name, queue.min_gpus, queue.max_gpus, tuple(shares), queue.borrow, queue.lend)


class _ModelFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_gpus: float = Field(default=0.0, ge=0)
    max_gpus: float | None = Field(default=None, ge=0)


class _QueueFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    min_gpus: float | None = Field(default=None, ge=0)
    """Unset: the sum of the models' min_gpus (0 without models)."""
    max_gpus: float | None = Field(default=None, ge=0)
    models: dict[str, _ModelFile] = Field(default_factory=dict)
    borrow: bool = True
    lend: bool = True

    @model_validator(mode="after")
    def _min_below_max(self) -> _QueueFile:
        if self.max_gpus is not None and self.min_gpus is not None and self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus {self.min_gpus} is above max_gpus {self.max_gpus}")
        return self

    def quota(self) -> QueueQuota:
        shares = tuple(ModelQuota(m, s.min_gpus, s.max_gpus) for m, s in self.models.items())
        floor = sum(s.min_gpus for s in self.models.values())
        return QueueQuota(self.name, floor if self.min_gpus is None else self.min_gpus, self.max_gpus, shares,
                          self.borrow, self.lend)


class _QuotasFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    queues: list[_QueueFile]


def load_quotas(path: str | Path, catalog: Catalog | None = None) -> Quotas:
    """Read `queues: [{name, min_gpus, max_gpus, models: {H100: {min_gpus, max_gpus}}, borrow, lend}]` from
    YAML; errors name the file and field. With `catalog`, model names are made canonical (and checked)."""
    parsed = load_yaml_model(path, _QuotasFile, QuotaError)
    try:
        queues = [q.quota() for q in parsed.queues]
        return Quotas(canonical_models(q, catalog) if catalog is not None else q for q in queues)
    except QuotaError as exc:
        raise QuotaError(f"{path}: {exc}") from None
