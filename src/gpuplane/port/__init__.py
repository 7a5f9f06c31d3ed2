"""The cluster port and the clock: the interfaces through which the brain acts on a world."""

from gpuplane.port.clock import Clock, Timer, WallClock
from gpuplane.port.cluster import (
    DELETION_COST,
    ClusterEvent,
    ClusterPort,
    EventKind,
    EventType,
    Handler,
    NodeInfo,
    ObjectEvent,
    PodInfo,
    PodPhase,
    Unsubscribe,
)
from gpuplane.port.status import Code, Status, aggregate_reasons

__all__ = [
    "DELETION_COST", "Clock", "ClusterEvent", "ClusterPort", "Code", "EventKind", "EventType", "Handler", "NodeInfo",
    "ObjectEvent", "PodInfo", "PodPhase", "Status", "Timer", "Unsubscribe", "WallClock", "aggregate_reasons",
]
