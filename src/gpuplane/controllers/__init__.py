"""Controllers: long-running loops that act on a world through the cluster port (tidal lending, ...).

They sit above the scheduler and below the worlds: they read time from an injected clock and never touch
the outside world directly.
"""

from gpuplane.controllers.forecast import (
    NO_FORECAST,
    FixedForecast,
    LoadForecast,
    LoadSource,
    SeasonalForecaster,
)
from gpuplane.controllers.tidal import (
    EARLY_RECLAIM_REASON,
    LEND_REASON,
    LOAN_ANNOTATION,
    LOAN_LABEL,
    LOAN_TAINT,
    RECLAIM_ANNOTATION,
    RECLAIM_REASON,
    SUBSET_LABEL,
    DrainOrder,
    DrainRecord,
    ServiceBinding,
    TidalController,
    TidalStats,
    drain_costs,
    nodes_emptied,
    removal_order,
)

__all__ = [
    "EARLY_RECLAIM_REASON",
    "LEND_REASON",
    "LOAN_ANNOTATION",
    "LOAN_LABEL",
    "LOAN_TAINT",
    "NO_FORECAST",
    "RECLAIM_ANNOTATION",
    "RECLAIM_REASON",
    "SUBSET_LABEL",
    "DrainOrder",
    "DrainRecord",
    "FixedForecast",
    "LoadForecast",
    "LoadSource",
    "SeasonalForecaster",
    "ServiceBinding",
    "TidalController",
    "TidalStats",
    "drain_costs",
    "nodes_emptied",
    "removal_order",
]
