"""`Status`: the result of an operation whose failure is an expected outcome, with its reasons."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Code(enum.Enum):
    """Kubernetes scheduling-framework codes.

    UNSCHEDULABLE: may fit after other pods leave or are preempted. UNSCHEDULABLE_AND_UNRESOLVABLE:
    preemption cannot help (wrong model, missing MIG profile, a custom-topo rule). WAIT: a permit is
    pending (gangs). SKIP: the plugin has nothing to say for this pod. ERROR: the operation failed.
    """

    SUCCESS = "Success"
    ERROR = "Error"
    UNSCHEDULABLE = "Unschedulable"
    UNSCHEDULABLE_AND_UNRESOLVABLE = "UnschedulableAndUnresolvable"
    WAIT = "Wait"
    SKIP = "Skip"
    PENDING = "Pending"


@dataclass(frozen=True, slots=True)
class Status:
    code: Code = Code.SUCCESS
    reasons: tuple[str, ...] = ()
    plugin: str = ""

    @property
    def ok(self) -> bool:
        return self.code is Code.SUCCESS

    @property
    def message(self) -> str:
        return "; ".join(self.reasons)

    @staticmethod
    def success() -> Status:
        return _SUCCESS

    @staticmethod
    def error(*reasons: str, plugin: str = "") -> Status:
        return Status(Code.ERROR, reasons, plugin)

    @staticmethod
    def unschedulable(*reasons: str, plugin: str = "", resolvable: bool = True) -> Status:
        code = Code.UNSCHEDULABLE if resolvable else Code.UNSCHEDULABLE_AND_UNRESOLVABLE
        return Status(code, reasons, plugin)


_SUCCESS = Status()


def aggregate_reasons(total_nodes: int, counts: Mapping[str, int]) -> str:
    """kube-scheduler's message: "0/1213 nodes are available: 812 insufficient GPU memory, 300 …".

    `counts` maps each rejection reason to the number of nodes rejected for it.
    """
    ranked = sorted(((r, c) for r, c in counts.items() if c), key=lambda kv: (-kv[1], kv[0]))
    parts = ", ".join(f"{count} {reason}" for reason, count in ranked)
    available = total_nodes - sum(counts.values())
    return f"{available}/{total_nodes} nodes are available" + (f": {parts}." if parts else ".")
