"""The live dashboard: a web page over the cluster port (`gpuplane dashboard`).

`state.Board` reads the world (fleet, queues, history); `server` serves the page and its server-sent events with
Starlette on uvicorn; `live` runs the platform week in accelerated time for it, or samples a live cluster;
`devtools` drives the page in headless Chromium in real time (the tests' first-paint and update timings).
"""

from gpuplane.report.dashboard.server import INTERVAL_S, DashboardError, DashboardServer, make_app
from gpuplane.report.dashboard.state import NOT_TRIED, Board, Sample, team_of

__all__ = ["INTERVAL_S", "NOT_TRIED", "Board", "DashboardError", "DashboardServer", "Sample", "make_app", "team_of"]
