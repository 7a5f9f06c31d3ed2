"""Errors raised for bad input to the model: they name the field (and file/line where one exists)."""

from __future__ import annotations


class GpuplaneError(ValueError):
    """Base of every input error gpuplane raises; expected outcomes use `Status` instead."""


class CatalogError(GpuplaneError):
    """An unknown card model, MIG profile or vGPU package."""


class RequestError(GpuplaneError):
    """A pod request that can never be valid; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def __reduce__(self) -> tuple[type[RequestError], tuple[str, str]]:
        return RequestError, (self.field, self.reason)


class NodeSpecError(GpuplaneError):
    """A node description that is inconsistent (topology, capacities)."""


class PlacementError(GpuplaneError):
    """An assignment that does not fit the cluster state it is applied to (a bug or a stale cache)."""
