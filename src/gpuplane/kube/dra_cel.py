"""Kubernetes' DRA CEL device environment, evaluated with cel-python (`celpy`).

A selector (`DeviceSelector.cel.expression`, of a DeviceClass or of a claim's request) sees one variable,
`device`, as the scheduler's DRA allocator builds it (k8s.io/dynamic-resource-allocation/cel):

- `device.driver`: the slice's driver;
- `device.attributes[domain][name]`: each attribute under its domain; an unqualified name is in the driver's
  domain (`resource.kubernetes.io/pcieRoot` is `device.attributes["resource.kubernetes.io"].pcieRoot`);
- `device.capacity[domain][name]`: each capacity as a quantity (here the quantity's value in whole base units,
  compared with `quantity("80Gi")` and `compareTo`);
- `device.allowMultipleAllocations`.

A selector that names an attribute the device lacks is an evaluation error (`SelectorError`), as it fails the
allocation in Kubernetes; it is never a silent non-match.

`SelectorCache` evaluates many devices fast: an expression's programs are compiled once, and its results are
remembered by the part of the device the expression can read. An expression that iterates or sizes a map
(`exists`, `all`, `size`, `in`, …) reads all of it; any other reads only the attributes and capacities whose
names occur in its text, so the same selector over the same model's cards on a thousand nodes is evaluated a
handful of times, not once per card (the UUID, index and NUMA node that differ between them are not read).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import celpy
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError
from kubernetes.utils import parse_quantity

__all__ = ["SelectorCache", "SelectorError", "activation", "cel_quantity"]


class SelectorError(Exception):
    """A selector that does not compile or whose evaluation fails on a device (both fail the allocation)."""

    def __init__(self, expression: str, message: str) -> None:
        super().__init__(f"selector {expression!r}: {message}")
        self.expression = expression


def cel_quantity(raw: object) -> int:
    """A Kubernetes quantity in whole base units, rounded up ("80Gi" → 85899345920, "250" → 250)."""
    value = Decimal(parse_quantity(raw))  # type: ignore[no-untyped-call]
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def _quantity(raw: celtypes.StringType) -> celtypes.IntType:
    return celtypes.IntType(cel_quantity(str(raw)))


def _compare_to(a: celtypes.IntType, b: celtypes.IntType) -> celtypes.IntType:
    return celtypes.IntType((a > b) - (a < b))


FUNCTIONS: dict[str, Any] = {"quantity": _quantity, "compareTo": _compare_to}


def _by_domain(driver: str, entries: Mapping[str, Any], value: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, raw in entries.items():
        domain, _, short = name.rpartition("/")
        out.setdefault(domain or driver, {})[short] = value(raw)
    return out


def _attribute(raw: Mapping[str, Any]) -> Any:
    [(_, plain)] = raw.items()
    return plain


def activation(driver: str, device: Mapping[str, Any]) -> dict[str, Any]:
    """`device` (a ResourceSlice's device) as the CEL environment shows it."""
    attributes = _by_domain(driver, device.get("attributes") or {}, _attribute)
    capacity = _by_domain(driver, device.get("capacity") or {}, lambda c: cel_quantity(c["value"]))
    cel = json_to_cel({"driver": driver, "attributes": attributes, "capacity": capacity,
                             "allowMultipleAllocations": bool(device.get("allowMultipleAllocations", False))})
    return {"device": cel}


_WHOLE_MAP = re.compile(r"\b(exists|exists_one|all|map|filter|size|in|has)\b")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=4096)
def _words(expression: str) -> frozenset[str] | None:
    """The names the expression can read (None: all of the device, it iterates or sizes a map)."""
    return None if _WHOLE_MAP.search(expression) else frozenset(_WORD.findall(expression))


def _project(expression: str, device: Mapping[str, Any]) -> tuple[Mapping[str, Any], tuple[Any, ...]]:
    """(what of `device` the expression can read, a hashable key of it)."""
    words = _words(expression)

    def keep(name: str) -> bool:
        return words is None or name.rpartition("/")[2] in words

    attributes = {k: v for k, v in (device.get("attributes") or {}).items() if keep(k)}
    capacity = {k: {"value": v["value"]} for k, v in (device.get("capacity") or {}).items() if keep(k)}
    multiple = bool(device.get("allowMultipleAllocations", False))
    key = (tuple(sorted((k, tuple(sorted(v.items()))) for k, v in attributes.items())),
           tuple(sorted((k, str(v["value"])) for k, v in capacity.items())), multiple)
    return {"attributes": attributes, "capacity": capacity, "allowMultipleAllocations": multiple}, key


class SelectorCache:
    """Compiled selectors and their results, by expression and the part of the device it reads."""

    def __init__(self) -> None:
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}
        self._results: dict[tuple[str, str, tuple[Any, ...]], bool | str] = {}

    def _program(self, expression: str) -> Any:
        program = self._programs.get(expression)
        if program is None:
            try:
                program = self._env.program(self._env.compile(expression), functions=FUNCTIONS)
            except CELParseError as exc:
                raise SelectorError(expression, f"does not compile: {exc}") from None
            self._programs[expression] = program
        return program

    def matches(self, expression: str, driver: str, device: Mapping[str, Any]) -> bool:
        """Whether `device` passes the selector; `SelectorError` when the evaluation fails."""
        seen, key = _project(expression, device)
        memo = (expression, driver, key)
        result = self._results.get(memo)
        if result is None:
            program = self._program(expression)
            try:
                value = program.evaluate(activation(driver, seen))
            except CELEvalError as exc:
                value = exc
            if isinstance(value, Exception):
                result = f"evaluation failed: {value}"
            elif isinstance(value, celtypes.BoolType):
                result = bool(value)
            else:
                result = f"evaluates to {type(value).__name__}, not a bool"
            self._results[memo] = result
        if isinstance(result, str):
            raise SelectorError(expression, result)
        return result
