"""The dashboard over the running platform week (what `gpuplane dashboard` shows on its own): the week advances
paced, the page shows the frozen world's true numbers once the run is stopped, and the command's flags."""

from __future__ import annotations

import time

import pytest
from typer import Typer
from typer.testing import CliRunner

from gpuplane.cli import dashboard_cmd
from gpuplane.model import MILLI_PER_CARD
from gpuplane.port import PodPhase
from gpuplane.report.browser import Chromium, table_rows
from gpuplane.report.dashboard import DashboardServer
from gpuplane.report.dashboard.live import PacedWeek
from gpuplane.sim.platform import SCENARIO, PlatformSettings


def test_the_paced_week_feeds_the_page_and_stops_on_request() -> None:
    settings = PlatformSettings.model_validate({**SCENARIO.quick, "seed": 1})
    week = PacedWeek(settings, speed=1200.0, sample_s=300.0)
    board = week.start()
    started = time.monotonic()
    with DashboardServer(board) as server:
        while len(board.history) < 4 and time.monotonic() - started < 60:
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        week.stop()
        assert board.status == "stopped"
        virtual = board.now()
        # paced: 1200 virtual s a wall second at most (4 samples 300 s apart: at least 900 virtual s)
        assert 900.0 <= virtual <= 1200.0 * (elapsed + 1.0)
        nodes, pods = board.port.list_nodes(), board.port.list_pods()
        held = {}
        for pod in pods:
            if pod.assignment is not None and pod.phase in (PodPhase.RUNNING, PodPhase.TERMINATING):
                for share in pod.assignment.cards:
                    key = (pod.assignment.node, share.card)
                    held[key] = held.get(key, 0) + (MILLI_PER_CARD if share.whole else share.compute_milli)
        full = sum(v >= MILLI_PER_CARD for v in held.values())
        pending = sum(p.phase is PodPhase.PENDING for p in pods)
        dom = Chromium.find().dump_dom(server.url + "?updates=1")
    row = next(r for r in table_rows(dom) if r and r[0] == "nodes")
    shown = dict(zip(row[0::2], row[1::2], strict=True))
    assert shown["nodes"] == str(len(nodes)) == "32"  # quick settings: 6 + 6 + 4 + 4 + 8 + 4 nodes
    assert shown["cards"] == str(sum(n.spec.gpus for n in nodes))
    assert shown["cards full"] == str(full) and full > 0
    assert shown["pods pending"] == str(pending)
    assert dom.count("<polyline") >= 8  # the charts drew the history (tide, evictions, health, utilisation)
    assert any(s.util_pct is not None for s in board.history)  # the week's busy model gives utilisation


@pytest.mark.parametrize(("flags", "message"), [
    (["--speed", "0"], "must be positive"),
    (["--interval-s", "-1"], "must be positive"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "no such file"),
])
def test_bad_flags_exit_2_with_the_reason(flags: list[str], message: str) -> None:
    app = Typer()

    @app.callback()
    def group() -> None:
        """test group"""

    dashboard_cmd.register(app)
    result = CliRunner().invoke(app, ["dashboard", *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output
