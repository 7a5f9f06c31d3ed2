"""`gpuplane accounting` (the bill of a period) and `gpuplane accounting-ledger` (the ledger on a live cluster).

The data is the accounting ledger: JSON lines of booked intervals (`gpuplane.controllers.accounting.Booking`), with
Unix seconds. `accounting-ledger` writes one from a Kubernetes cluster (the ledger over `KubeCluster`, utilisation
from dcgm-exporter through Prometheus); `accounting --simulate` runs the platform simulation (quick settings) with
the same ledger attached, its virtual clock starting at `--from`, and writes its ledger beside the bill.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from gpuplane.cli.common import fail, log_to_stderr, on_sigterm

if TYPE_CHECKING:
    from gpuplane.controllers.accounting import LedgerFile, UtilisationReader
    from gpuplane.kube.cluster import KubeCluster
    from gpuplane.port import Clock

out = Console(soft_wrap=True)


def parse_time(raw: str, flag: str) -> float:
    """`YYYY-MM-DD` or an ISO 8601 date and time (UTC when it names no zone) → Unix seconds."""
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError:
        fail(f"{flag} {raw!r}: give a date (2026-11-01) or an ISO 8601 time (2026-11-01T08:00:00Z)")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def accounting(from_: str, to: str, out_dir: Path, prices_path: Path | None, ledger: Path | None,
               simulate: bool, seed: int, max_efficiency: float) -> None:
    """The body of `gpuplane accounting` (see `register`)."""
    from gpuplane.controllers.accounting import LedgerError, LedgerFile, read_ledger
    from gpuplane.report.accounting import PriceError, load_prices, write_bill

    start, end = parse_time(from_, "--from"), parse_time(to, "--to")
    if end <= start:
        fail(f"--to {to} is not after --from {from_}")
    if simulate == (ledger is not None):
        fail("give one source: --ledger FILE or --simulate")
    try:
        prices = load_prices(prices_path)
    except PriceError as exc:
        fail(str(exc))
    if ledger is not None:
        try:
            bookings = read_ledger(ledger)
        except LedgerError as exc:
            fail(str(exc))
        source = f"Ledger {ledger}."
    else:
        from gpuplane.sim.accounting import simulate as run_simulation
        from gpuplane.sim.platform import SCENARIO, PlatformSettings

        settings = PlatformSettings.model_validate({**SCENARIO.quick, "seed": seed})
        run = run_simulation(settings)
        bookings = [dataclasses.replace(b, start=b.start + start, end=b.end + start) for b in run.bookings]
        out_dir.mkdir(parents=True, exist_ok=True)
        ledger_path = out_dir / "ledger.jsonl"
        ledger_path.unlink(missing_ok=True)
        sink = LedgerFile(ledger_path)
        for booking in bookings:
            sink(booking)
        sink.close()
        end = min(end, start + run.horizon_s)
        source = (f"The platform simulation (quick settings, seed {seed}, {settings.days:g} day(s) from --from, "
                  f"ledger {ledger_path}).")
    result = write_bill(bookings, prices, start, end, out_dir, source=source, max_efficiency=max_efficiency)
    t = result.totals
    out.print(f"allocated {t.allocated_gpu_s / 3600:.3f} GPU-h, used {t.used_gpu_s / 3600:.3f}, "
              f"idle {t.idle_gpu_s / 3600:.3f}, unmeasured {t.unmeasured_gpu_s / 3600:.3f}, "
              f"cost {t.cost:.2f} {result.currency}; {len(result.low)} low-efficiency pod(s)")
    if result.missing_prices:
        out.print(f"no price for {', '.join(result.missing_prices)} (billed 0)")
    for path in result.paths:
        out.print(str(path))


def record(kubeconfig: Path | None, prometheus: str | None, metric: str, ledger: Path, sample_s: float) -> None:
    """The body of `gpuplane accounting-ledger`: book every pod's cards until SIGTERM or Ctrl-C."""
    from gpuplane.cli.operator_cmd import connect
    from gpuplane.controllers.accounting import DcgmReader, LedgerFile, NoReader
    from gpuplane.kube.cluster import KubeCluster
    from gpuplane.model import default_catalog
    from gpuplane.scaler.prometheus import PrometheusClient, PrometheusError

    log_to_stderr()
    if sample_s <= 0:
        fail(f"--sample-s must be positive, got {sample_s}")
    cluster = KubeCluster(connect(kubeconfig), default_catalog())
    reader: UtilisationReader = NoReader()
    if prometheus is not None:
        try:
            reader = DcgmReader(PrometheusClient(prometheus), metric)
        except PrometheusError as exc:
            fail(str(exc))
    stop = threading.Event()
    try:
        with on_sigterm(stop.set):
            run_ledger(cluster, reader, LedgerFile(ledger), stop, sample_s)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()


def run_ledger(cluster: KubeCluster, reader: UtilisationReader, sink: LedgerFile, stop: threading.Event,
               sample_s: float, clock: Clock | None = None) -> None:
    """Book `cluster`'s pods into `sink` until `stop` is set; then book every open interval up to then and close
    the file. The ledger samples on this thread, under the lock the cluster delivers its events under."""
    from gpuplane.controllers.accounting import AccountingLedger
    from gpuplane.port import WallClock

    with cluster.lock:
        book = AccountingLedger(cluster, clock if clock is not None else WallClock(), reader, sample_s=0.0,
                                sink=sink, keep_bookings=False)
    try:
        while not stop.wait(sample_s):
            with cluster.lock:
                book.sample()
    finally:
        with cluster.lock:
            book.close()
        sink.close()


def register(app: typer.Typer) -> None:
    @app.command("accounting")
    def accounting_cmd(
        from_: Annotated[str, typer.Option("--from", help="start of the period (a date or ISO time, UTC)")],
        to: Annotated[str, typer.Option("--to", help="end of the period, exclusive")],
        out_dir: Annotated[Path, typer.Option("--out", help="folder for bill.csv, monthly.csv, "
                                                            "low-efficiency.csv and accounting.html")],
        prices: Annotated[Path | None, typer.Option("--prices", help="price table YAML (default: the bundled "
                                                                     "gpu-prices.yaml, assumptions)")] = None,
        ledger: Annotated[Path | None, typer.Option("--ledger", help="an accounting ledger (JSON lines)")] = None,
        simulate: Annotated[bool, typer.Option("--simulate", help="run the platform simulation (quick settings), "
                                                                  "its clock starting at --from")] = False,
        seed: Annotated[int, typer.Option("--seed", help="the simulation's seed")] = 1,
        max_efficiency: Annotated[float, typer.Option("--max-efficiency", help="low-efficiency report: at most this "
                                                      "share used (0..1)")] = 0.3,
    ) -> None:
        """GPU-hours allocated, used and idle, and the bill, per namespace, team, queue, card model and class."""
        accounting(from_, to, out_dir, prices, ledger, simulate, seed, max_efficiency)

    @app.command("accounting-ledger")
    def accounting_ledger_cmd(
        ledger: Annotated[Path, typer.Option("--ledger", help="the ledger file to append to")],
        kubeconfig: Annotated[Path | None, typer.Option("--kubeconfig", help="default: in-cluster, else "
                                                                             "~/.kube/config")] = None,
        prometheus: Annotated[str | None, typer.Option("--prometheus", help="Prometheus URL with dcgm-exporter's "
                                                       "series (none: allocation only, every second unmeasured)")
                              ] = None,
        metric: Annotated[str, typer.Option("--metric", help="DCGM_FI_DEV_GPU_UTIL or DCGM_FI_PROF_SM_ACTIVE")
                          ] = "DCGM_FI_DEV_GPU_UTIL",
        sample_s: Annotated[float, typer.Option("--sample-s", help="seconds between utilisation readings")] = 60.0,
    ) -> None:
        """Book every pod's cards on a Kubernetes cluster into an accounting ledger, until SIGTERM."""
        record(kubeconfig, prometheus, metric, ledger, sample_s)


def main() -> None:
    """`python3 -m gpuplane.cli.accounting_cmd accounting …`: the same commands outside `gpuplane`."""
    app = typer.Typer(no_args_is_help=True)
    register(app)
    app(prog_name="gpuplane")


if __name__ == "__main__":
    main()
