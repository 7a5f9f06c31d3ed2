"""Controllers: long-running loops that act on a world through the cluster port (tidal lending, ...).

They sit above the scheduler and below the worlds: they read time from an injected clock and never touch
the outside world directly.
"""

from gpuplane.controllers.tidal import (
    LOAN_ANNOTATION,
    LOAN_LABEL,
    LOAN_TAINT,
    RECLAIM_ANNOTATION,
    SUBSET_LABEL,
    DrainOrder,
    DrainRecord,
    LoadForecast,
    ServiceBinding,
    TidalController,
    TidalStats,
    drain_costs,
    nodes_emptied,
    removal_order,
)

__all__ = [
    "LOAN_ANNOTATION", "LOAN_LABEL", "LOAN_TAINT", "RECLAIM_ANNOTATION", "SUBSET_LABEL", "DrainOrder", "DrainRecord",
    "LoadForecast", "ServiceBinding", "TidalController", "TidalStats", "drain_costs", "nodes_emptied",
    "removal_order",
]
