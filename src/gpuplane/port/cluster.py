"""The cluster port: the only way the scheduler and controllers touch a cluster.

Its verbs mirror the Kubernetes API (list/watch nodes and pods, bind with a card assignment, evict,
delete, scale, patch nodes). Worlds implement it: the embedded simulated cluster (`gpuplane.sim`) and,
later, Kubernetes. Semantics follow Kubernetes: `bind` can fail when the node changed under the caller,
evictions honour a grace period, watches deliver events in order to every subscriber.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from gpuplane.model import Assignment, NodeSpec, PodRequest, Taint
from gpuplane.port.status import Status


class PodPhase(enum.Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    TERMINATING = "Terminating"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True, slots=True)
class PodInfo:
    request: PodRequest
    phase: PodPhase
    assignment: Assignment | None = None
    created_at: float = 0.0
    bound_at: float | None = None
    annotations: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.request.name


@dataclass(frozen=True, slots=True)
class NodeInfo:
    spec: NodeSpec
    resource_version: int
    annotations: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class EventKind(enum.Enum):
    NODE_ADDED = "NodeAdded"
    NODE_UPDATED = "NodeUpdated"
    NODE_REMOVED = "NodeRemoved"
    POD_ADDED = "PodAdded"
    POD_BOUND = "PodBound"
    POD_TERMINATING = "PodTerminating"
    POD_DELETED = "PodDeleted"
    POD_FAILED = "PodFailed"


@dataclass(frozen=True, slots=True)
class ClusterEvent:
    kind: EventKind
    time: float
    pod: PodInfo | None = None
    node: NodeInfo | None = None


class EventType(enum.Enum):
    """An `ObjectEvent`'s type, as Kubernetes has it: Normal, or Warning (something to look at)."""

    NORMAL = "Normal"
    WARNING = "Warning"


@dataclass(frozen=True, slots=True)
class ObjectEvent:
    """An Event about a pod or a node, for the people who look at it (`record_event`; in Kubernetes a core/v1
    `Event`, which `kubectl describe` lists), not for controllers to act on."""

    kind: Literal["Pod", "Node"]
    name: str
    """The pod's key or the node's name."""
    type: EventType
    reason: str
    """CamelCase, one word: what happened (`IdleGpuNotice`)."""
    message: str
    time: float
    """When the world recorded it (its clock)."""


Handler = Callable[[ClusterEvent], None]
Unsubscribe = Callable[[], None]


@runtime_checkable
class ClusterPort(Protocol):
    """What every world offers. Expected failures come back as a `Status`, never as an exception."""

    def list_nodes(self) -> Sequence[NodeInfo]: ...

    def list_pods(self) -> Sequence[PodInfo]: ...

    def watch(self, handler: Handler) -> Unsubscribe:
        """Deliver every later event to `handler`, in order. Returns a function that stops delivery."""
        ...

    def create_pod(self, request: PodRequest) -> Status:
        """Submit a pod. Admission may refuse it (code ERROR, reason starting "rejected")."""
        ...

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        """Bind a pending pod with its card assignment.

        Fails (code ERROR, reason starting "conflict") when the pod is not pending, the node is gone,
        `node_version` is given and the node changed since, or the assignment no longer fits.
        """
        ...

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        """Graceful eviction: the pod turns TERMINATING now and is deleted after `grace_s`."""
        ...

    def delete_pod(self, pod: str) -> Status:
        """Delete at once, with no grace: the pod is gone when this returns (`evict` is the graceful way)."""
        ...

    def fail_pod(self, pod: str, reason: str) -> Status:
        """Give up on a pending pod: it turns FAILED with `reason` (a gang that timed out, say)."""
        ...

    def scale(self, workload: str, replicas: int) -> Status:
        """Resize a workload. Scale-down removes pending pods first, then the lowest
        `controller.kubernetes.io/pod-deletion-cost`, then the newest (the ReplicaSet ranking, in short)."""
        ...

    def patch_pod(self, pod: str, *, annotations: Mapping[str, str | None]) -> Status:
        """Patch a pod's annotations; a None value removes that key."""
        ...

    def patch_node(self, node: str, *, labels: Mapping[str, str | None] | None = None,
                   taints: Sequence[Taint] | None = None, annotations: Mapping[str, str | None] | None = None,
                   unschedulable: bool | None = None, pool: str | None = None) -> Status:
        """Patch a node; a None value in `labels`/`annotations` removes that key."""
        ...

    def record_event(self, kind: Literal["Pod", "Node"], name: str, *, type_: EventType, reason: str,
                     message: str) -> Status:
        """Record an Event about the pod or node `name`, stamped with the world's clock. As in Kubernetes, the
        object need not exist; an error (code ERROR) means the Event was not recorded."""
        ...
