"""Admission: refuse at submission what could never run, with the reason; complete what can.

The same check serves the simulated world's `create_pod` and, later, a validating webhook.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuplane.model import MILLI_PER_CARD, GpuplaneError, PodRequest
from gpuplane.model.priority import PriorityClasses
from gpuplane.model.quota import Quotas
from gpuplane.port import ClusterEvent, ClusterPort, EventKind, Unsubscribe


class Admission:
    """Resolves priority classes; refuses unknown classes and queues, pods above their queue's maximum, and
    gang members once the gang's members so far need more GPUs than the whole cluster has
    (`cluster_gpu_milli`, when given)."""

    def __init__(self, classes: PriorityClasses, quotas: Quotas | None = None, *, require_class: bool = False,
                 cluster_gpu_milli: Callable[[], int] | None = None) -> None:
        self.classes = classes
        self.quotas = quotas or Quotas()
        self.require_class = require_class
        self.cluster_gpu_milli = cluster_gpu_milli
        self._gang_members: dict[str, dict[str, int]] = {}
        """Per gang, the GPU milli of each admitted member that has not left yet."""

    def attach(self, port: ClusterPort) -> Unsubscribe:
        """Watch `port` so that members that leave (deleted, failed) stop counting towards their gang."""
        return port.watch(self.on_event)

    def on_event(self, event: ClusterEvent) -> None:
        if event.kind in (EventKind.POD_DELETED, EventKind.POD_FAILED) and event.pod is not None:
            gang = event.pod.request.gang
            if gang is not None and gang in self._gang_members:
                members = self._gang_members[gang]
                members.pop(event.pod.name, None)
                if not members:
                    del self._gang_members[gang]

    def __call__(self, request: PodRequest) -> PodRequest | str:
        if request.priority_class is None and self.require_class:
            return "priority_class: every pod must name a priority class"
        try:
            request = self.classes.resolve(request)
        except GpuplaneError as exc:
            return str(exc)
        if request.queue is not None:
            quota = self.quotas.get(request.queue)
            if quota is None:
                known = ", ".join(sorted(q.name for q in self.quotas)) or "none configured"
                return f"queue: unknown queue {request.queue!r} (known: {known})"
            cap = quota.cap_milli
            if cap is not None and request.gpu_milli_total > cap:
                bound = "maximum" if quota.borrow else "minimum (it does not borrow)"
                return (f"queue: pod needs {request.gpu_milli_total / MILLI_PER_CARD:g} GPUs, more than queue "
                        f"{quota.name}'s {bound} of {cap / MILLI_PER_CARD:g}")
        if request.gang is not None and self.cluster_gpu_milli is not None:
            members = self._gang_members.setdefault(request.gang, {})
            total = sum(members.values()) + request.gpu_milli_total
            capacity = self.cluster_gpu_milli()
            if total > capacity:
                if not members:
                    del self._gang_members[request.gang]
                return (f"gang: gang {request.gang} would need at least {total / MILLI_PER_CARD:g} GPUs, more than "
                        f"the whole cluster's {capacity / MILLI_PER_CARD:g}")
            members[request.name] = request.gpu_milli_total
        return request
