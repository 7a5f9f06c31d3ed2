"""Priority classes (Kubernetes PriorityClass in miniature) and per-pod preemption policy."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gpuplane.model.errors import GpuplaneError, RequestError
from gpuplane.model.request import PodRequest
from gpuplane.model.yamlfile import load_yaml_model

MAX_USER_PRIORITY = 1_000_000_000
"""Kubernetes caps user priority classes here (system classes sit above)."""


class PreemptionPolicy(enum.Enum):
    PREEMPT_LOWER_PRIORITY = "PreemptLowerPriority"
    NEVER = "Never"


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """A named priority. `victim_grace_s` is the grace period a pod of this class gets when preempted."""

    name: str
    value: int
    preemption_policy: PreemptionPolicy = PreemptionPolicy.PREEMPT_LOWER_PRIORITY
    victim_grace_s: float = 30.0
    description: str = ""
    backfill: bool = False
    """Backfill pods fill fragments and idle cards; pods of higher classes are placed as if they were not
    there and evict those in their way."""

    def __post_init__(self) -> None:
        if not self.name:
            raise GpuplaneError("priority class: name must not be empty")
        if not -MAX_USER_PRIORITY <= self.value <= MAX_USER_PRIORITY:
            raise GpuplaneError(f"priority class {self.name}: value {self.value} is outside "
                                f"±{MAX_USER_PRIORITY}")
        if self.victim_grace_s < 0:
            raise GpuplaneError(f"priority class {self.name}: victim_grace_s must not be negative")


ONLINE = "online"
TRAINING = "training"
DEV = "dev"
BATCH_LOW = "batch-low"


def default_priority_classes() -> PriorityClasses:
    """online 1000 > training 500 > dev 300 > low-priority batch 100 (preempted at once, grace 0 s)."""
    return PriorityClasses([
        PriorityClass(ONLINE, 1000, description="online inference"),
        PriorityClass(TRAINING, 500, description="training jobs"),
        PriorityClass(DEV, 300, description="development machines"),
        PriorityClass(BATCH_LOW, 100, victim_grace_s=0.0, backfill=True,
                      description="low-priority batch (data production) that backfills fragments"),
    ])


class PriorityClasses:
    """The configured classes by name. Resolving a request fills in its priority and policy."""

    def __init__(self, classes: Iterable[PriorityClass]) -> None:
        self._by_name: dict[str, PriorityClass] = {}
        for cls in classes:
            if cls.name in self._by_name:
                raise GpuplaneError(f"priority class {cls.name!r} is defined twice")
            self._by_name[cls.name] = cls

    def __iter__(self) -> Iterator[PriorityClass]:
        return iter(sorted(self._by_name.values(), key=lambda c: -c.value))

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> PriorityClass:
        try:
            return self._by_name[name]
        except KeyError:
            known = ", ".join(c.name for c in self)
            raise RequestError("priority_class", f"unknown priority class {name!r} (known: {known})") from None

    def resolve(self, request: PodRequest) -> PodRequest:
        """The request with its class's priority and policy applied. Raises RequestError for an unknown class."""
        if request.priority_class is None:
            return request
        cls = self.get(request.priority_class)
        preempt = request.preempt if request.preempt is not None else \
            cls.preemption_policy is PreemptionPolicy.PREEMPT_LOWER_PRIORITY
        if request.priority == cls.value and request.preempt == preempt:
            return request
        return replace(request, priority=cls.value, preempt=preempt)

    def victim_grace_s(self, request: PodRequest, default: float = 30.0) -> float:
        """Grace period for evicting `request` as a preemption victim."""
        if request.priority_class is not None and request.priority_class in self._by_name:
            return self._by_name[request.priority_class].victim_grace_s
        return default


class _ClassFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    value: int = Field(ge=-MAX_USER_PRIORITY, le=MAX_USER_PRIORITY)
    preemption_policy: PreemptionPolicy = PreemptionPolicy.PREEMPT_LOWER_PRIORITY
    victim_grace_s: float = Field(default=30.0, ge=0)
    description: str = ""
    backfill: bool = False


class _ClassesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    priority_classes: list[_ClassFile]


def load_priority_classes(path: str | Path) -> PriorityClasses:
    """Read `priority_classes: [{name, value, preemption_policy, victim_grace_s}]` from YAML."""
    parsed = load_yaml_model(path, _ClassesFile)
    try:
        return PriorityClasses(PriorityClass(c.name, c.value, c.preemption_policy, c.victim_grace_s, c.description,
                                             c.backfill) for c in parsed.priority_classes)
    except GpuplaneError as exc:
        raise GpuplaneError(f"{path}: {exc}") from None
