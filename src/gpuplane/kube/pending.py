"""Why a pending pod waits, as its scheduler wrote it on the pod: the `PodScheduled` condition.

kube-scheduler, and gpuplane-scheduler exactly as it (`gpuplane.kube.scheduler_mode`), write a pod it could not
place as `status.conditions[type=PodScheduled]` with status `False`, reason `Unschedulable` and kube-scheduler's
`FitError` message ("0/N nodes are available: 3 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint(s).
preemption: …"), or reason `SchedulerError` when the bind failed. `pending_reason` folds that into the bounded
label the dashboard and the metrics count (`controllers.observer.outcome_reason` gives the same labels for the
same decisions of an in-process scheduler): the reason that rejected the most nodes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpuplane.port.metrics import OTHER_REASON, reason_label

UNSCHEDULABLE = "Unschedulable"
"""The `PodScheduled=False` reason of a pod no node fits (kube-scheduler's `v1.PodReasonUnschedulable`)."""

NOMINATED = "nominated"
"""The label of a pod nominated to a node, waiting for its preemption victims to leave (`outcome_reason`'s)."""

_FIT_ERROR = re.compile(r"^\d+/\d+ nodes are available(?::\s*(?P<body>.*?))?\.?(?:\s+preemption:.*)?$", re.DOTALL)
_COUNTED = re.compile(r"^(?P<count>\d+) (?P<reason>.+)$")


def scheduled_condition(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's `PodScheduled` condition when its status is `False` (the scheduler tried and failed), else None."""
    status = pod.get("status")
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    if not isinstance(conditions, list):
        return None
    for condition in conditions:
        if isinstance(condition, Mapping) and condition.get("type") == "PodScheduled":
            return condition if condition.get("status") == "False" else None
    return None


def fit_error_reason(message: str) -> str:
    """The bounded label of a `FitError` message: the per-node reason counted on the most nodes (ties: the first,
    in the message's order), or the PreFilter text, folded as `outcome_reason` folds a status message; any other
    message through `reason_label`.

    >>> fit_error_reason("0/4 nodes are available: 1 node(s) were unschedulable, 3 Insufficient nvidia.com/gpu. "
    ...                  "preemption: 0/4 nodes are available: 4 Preemption is not helpful for scheduling.")
    'Insufficient nvidia.com/gpu'
    >>> fit_error_reason("0/2 nodes are available: gang ns/g is waiting for its members (minMember 4).")
    'gang members missing'
    >>> fit_error_reason("0/2 nodes are available: queue team-a: 8 of 8 GPUs in use.")
    'queue at its quota'
    """
    match = _FIT_ERROR.match(message.strip())
    if match is None:
        return reason_label(message) if message.strip() else OTHER_REASON
    body = (match.group("body") or "").strip()
    if not body:
        return OTHER_REASON
    parts = body.split(", ")
    counted = [m for part in parts if (m := _COUNTED.match(part.strip())) is not None]
    if len(counted) == len(parts):  # max keeps the first of equal counts
        return reason_label(max(counted, key=lambda m: int(m.group("count"))).group("reason"))
    if body.startswith("gang "):
        return "gang members missing" if "is waiting for its members" in body else "gang does not fit whole"
    if body.startswith("queue "):
        return "queue at its quota"
    return reason_label(body)


def pending_reason(pod: Mapping[str, Any]) -> str | None:
    """Why the pending pod `pod` waits, from its `PodScheduled=False` condition: `NOMINATED` when it is also
    nominated to a node (`status.nominatedNodeName`: preemption made room, the victims are leaving), else
    `fit_error_reason` of the message for `Unschedulable`, else the condition's reason (`SchedulerError`: the bind
    failed); None when no scheduler has judged it (no such condition)."""
    condition = scheduled_condition(pod)
    if condition is None:
        return None
    reason, message = condition.get("reason"), condition.get("message")
    status = pod.get("status")
    if reason == UNSCHEDULABLE and isinstance(status, Mapping) and status.get("nominatedNodeName"):
        return NOMINATED
    if reason == UNSCHEDULABLE or not reason:
        return fit_error_reason(message) if isinstance(message, str) else OTHER_REASON
    return str(reason)


__all__ = ["NOMINATED", "UNSCHEDULABLE", "fit_error_reason", "pending_reason", "scheduled_condition"]
