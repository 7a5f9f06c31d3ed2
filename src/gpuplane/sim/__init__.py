"""The embedded simulated cluster: event loop, cluster port implementation, trace loading and replays."""

from gpuplane.sim.cluster import SimCluster, Workload
from gpuplane.sim.engine import EventLoop
from gpuplane.sim.replay import (
    Placement,
    ReplayMode,
    SimulationResult,
    TimedConfig,
    TimeSeries,
    run_fill,
    run_timed,
    tune_workload,
)
from gpuplane.sim.trace import (
    BUNDLED_TRACES,
    LoadReport,
    SkippedRow,
    TraceError,
    TracePod,
    bundled_path,
    load_nodes,
    load_pods,
    resolve_trace,
)

__all__ = [
    "BUNDLED_TRACES", "EventLoop", "LoadReport", "Placement", "ReplayMode", "SimCluster", "SimulationResult",
    "SkippedRow", "TimeSeries", "TimedConfig", "TraceError", "TracePod", "Workload", "bundled_path", "load_nodes",
    "load_pods", "resolve_trace", "run_fill", "run_timed", "tune_workload",
]
