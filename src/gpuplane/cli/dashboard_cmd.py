"""`gpuplane dashboard`: the live dashboard, over the platform simulation (the default) or a Kubernetes cluster.

On its own it runs the platform week's platform arm at quick settings (`SCENARIO.quick`) in accelerated time
(`--speed` virtual seconds per wall second) and serves the page; with `--kubeconfig` it watches that cluster
through `KubeCluster` (utilisation from dcgm-exporter with `--prometheus`). It serves until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from gpuplane.cli.common import fail, log_to_stderr, on_sigterm

if TYPE_CHECKING:
    from gpuplane.controllers.accounting import UtilisationReader
    from gpuplane.report.dashboard import Board
    from gpuplane.report.dashboard.live import PacedWeek

out = Console(soft_wrap=True)


def simulated_week(seed: int, speed: float) -> PacedWeek:
    """The platform week (quick settings, `seed`) started in a thread, paced at `speed` (its board is ready)."""
    from gpuplane.report.dashboard.live import PacedWeek
    from gpuplane.sim.platform import SCENARIO, PlatformSettings

    settings = PlatformSettings.model_validate({**SCENARIO.quick, "seed": seed})
    week = PacedWeek(settings, speed=speed)
    week.start()
    return week


def cluster_board(kubeconfig: Path | None, prometheus: str | None, sample_s: float) -> Board:
    """A board over the cluster `kubeconfig` names (its pods' scheduling reasons and its queues' quotas), sampled
    every `sample_s` wall seconds."""
    from gpuplane.cli.operator_cmd import connect
    from gpuplane.controllers.accounting import DcgmReader
    from gpuplane.model import default_catalog
    from gpuplane.report.dashboard.live import ClusterWatch
    from gpuplane.scaler.prometheus import PrometheusClient, PrometheusError

    catalog = default_catalog()
    api = connect(kubeconfig)
    reader: UtilisationReader | None = None
    if prometheus is not None:
        try:
            reader = DcgmReader(PrometheusClient(prometheus))
        except PrometheusError as exc:
            fail(str(exc))
    return ClusterWatch(api, catalog, reader=reader, sample_s=sample_s).board


def serve(board: Board, host: str, port: int, interval_s: float) -> None:
    from gpuplane.report.dashboard import DashboardError, DashboardServer

    server = DashboardServer(board, host, port, interval_s)
    try:
        url = server.start()
    except DashboardError as exc:
        fail(str(exc))
    out.print(f"dashboard: {url}  (Ctrl-C stops it)")
    stop = threading.Event()
    try:
        with on_sigterm(stop.set):
            while not stop.wait(0.5):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def register(app: typer.Typer) -> None:
    @app.command("dashboard")
    def dashboard(
        kubeconfig: Annotated[Path | None, typer.Option(help="watch this cluster through KubeCluster [default: run "
                                                        "the platform simulation]")] = None,
        host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="port to listen on (0: a free one)")] = 8080,
        interval_s: Annotated[float, typer.Option("--interval-s", help="seconds between live updates")] = 0.5,
        speed: Annotated[float, typer.Option(help="simulation: virtual seconds per wall second")] = 120.0,
        seed: Annotated[int, typer.Option(help="simulation: the platform week's seed")] = 1,
        prometheus: Annotated[str | None, typer.Option(help="cluster: Prometheus URL with dcgm-exporter's series, "
                                                       "for utilisation")] = None,
        sample_s: Annotated[float, typer.Option("--sample-s", help="cluster: seconds between history samples")
                            ] = 30.0,
    ) -> None:
        """A live web dashboard: the fleet map, the queues and their history, updated by server-sent events."""
        log_to_stderr()
        if interval_s <= 0 or speed <= 0 or sample_s <= 0:
            fail("--interval-s, --speed and --sample-s must be positive")
        if kubeconfig is None:
            out.print(f"running the platform simulation (quick settings, seed {seed}) at {speed:g}× …")
            week = simulated_week(seed, speed)
            if week.board is None:
                fail(f"the platform simulation did not start: {week.error!r}")
            board = week.board
        else:
            board = cluster_board(kubeconfig, prometheus, sample_s)
        serve(board, host, port, interval_s)


def main() -> None:
    """`python3 -m gpuplane.cli.dashboard_cmd dashboard …`: the command outside `gpuplane`."""
    app = typer.Typer(no_args_is_help=True)

    @app.callback()
    def group() -> None:
        """gpuplane's dashboard command."""

    register(app)
    app(prog_name="gpuplane")


if __name__ == "__main__":
    main()
