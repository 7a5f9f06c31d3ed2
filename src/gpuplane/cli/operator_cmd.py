"""`gpuplane webhook`, `gpuplane operator` and `gpuplane crds`: admission, the in-cluster controllers, the CRDs."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Annotated

import typer

from gpuplane.cli.common import fail, interrupt, log_to_stderr, on_sigterm, serve_health, serve_metrics

if TYPE_CHECKING:
    from gpuplane.controllers.accounting import IdleRule
    from gpuplane.kube.api import RestKubeApi
    from gpuplane.scaler.prometheus import PrometheusClient

DEFAULT_LOAD_QUERY = 'sum(rate(gpuplane_requests_total{namespace="$namespace",service="$service"}[1m]))'
"""The load of one service (requests/s); `$namespace` and `$service` name the TidalPolicy's namespace and service."""


class PrometheusLoad:
    """The operator's load reader (`gpuplane.kube.operator.LoadReader`): one instant query per service through
    the scaler's Prometheus client, which raises rather than read a missing series as 0."""

    def __init__(self, client: PrometheusClient, query: str) -> None:
        self.client = client
        self.template = Template(query)
        if "service" not in self.template.get_identifiers():
            raise ValueError(f"{query!r} does not name $service: every service would read the same load")
        self.query("ns", "svc")  # an unknown $placeholder is an error now, not at the first read

    def query(self, namespace: str, service: str) -> str:
        return self.template.substitute(namespace=namespace, service=service)

    def __call__(self, namespace: str, service: str) -> float:
        return self.client.query(self.query(namespace, service))


def connect(kubeconfig: Path | None) -> RestKubeApi:
    """The API client from `--kubeconfig` (None: in-cluster, else ~/.kube/config); exits 2 when there is none."""
    from gpuplane.kube.api import KubeConfigError, connect_api

    if kubeconfig is not None and not kubeconfig.is_file():
        fail(f"--kubeconfig {kubeconfig}: no such file")
    try:
        return connect_api(str(kubeconfig) if kubeconfig else None)
    except KubeConfigError as exc:
        fail(f"no cluster to talk to: {exc}")


def parse_idle_rule(text: str) -> IdleRule:
    """`CLASS:WINDOW_S:MAX_EFFICIENCY:GRACE_S:ACTION` as an `IdleRule`; a bad one fails naming the part."""
    from gpuplane.controllers.accounting import IdleRule

    parts = text.split(":")
    if len(parts) != 5:
        fail(f"--idle-rule {text!r}: expected CLASS:WINDOW_S:MAX_EFFICIENCY:GRACE_S:ACTION, "
             f"e.g. dev:3600:0.05:1800:evict")
    name, window, efficiency, grace, action = parts
    numbers: list[float] = []
    for label, raw in (("WINDOW_S", window), ("MAX_EFFICIENCY", efficiency), ("GRACE_S", grace)):
        try:
            numbers.append(float(raw))
        except ValueError:
            fail(f"--idle-rule {text!r}: {label} {raw!r} is not a number")
    if action not in ("evict", "scale-to-zero"):
        fail(f"--idle-rule {text!r}: ACTION {action!r} is not evict or scale-to-zero")
    if not name:
        fail(f"--idle-rule {text!r}: CLASS is empty")
    try:
        return IdleRule(name, numbers[0], numbers[1], numbers[2], "evict" if action == "evict" else "scale-to-zero")
    except ValueError as exc:
        fail(f"--idle-rule {text!r}: {exc}")


def register(app: typer.Typer) -> None:
    @app.command("crds")
    def crds(
        out: Annotated[Path, typer.Option("--out", help="folder to write <plural>.gpuplane.io.yaml into")] = Path(
            "deploy/crds"),
    ) -> None:
        """Write the CustomResourceDefinitions of gpuplane's custom resources (generated from their models)."""
        from gpuplane.kube.crds import write_crds

        try:
            paths = write_crds(out)
        except OSError as exc:
            fail(f"--out {out}: {exc}")
        for path in paths:
            print(path)

    @app.command("webhook")
    def webhook(
        port: Annotated[int, typer.Option(min=0, max=65535, help="port to serve /validate on")] = 9443,
        addr: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
        cert: Annotated[Path | None, typer.Option(help="TLS certificate (PEM); without it, plain HTTP")] = None,
        key: Annotated[Path | None, typer.Option(help="TLS private key (PEM)")] = None,
        scheduler_account: Annotated[list[str] | None, typer.Option(
            "--scheduler-account", help="user allowed to write the scheduler's pod annotations (repeatable) "
                                        "[default: system:serviceaccount:gpuplane-system:gpuplane-scheduler]")] = None,
        device_plugin_account: Annotated[list[str] | None, typer.Option(
            "--device-plugin-account", help="user allowed to change bind-phase only (repeatable) "
                                            "[default: system:serviceaccount:gpuplane-system:gpuplane-node-agent]")
        ] = None,
    ) -> None:
        """Serve the validating admission webhook (AdmissionReview v1 on POST /validate) until Ctrl-C or SIGTERM."""

        from gpuplane.kube.webhook import (
            DEFAULT_DEVICE_PLUGIN_ACCOUNT,
            DEFAULT_SCHEDULER_ACCOUNT,
            AdmissionPolicy,
            WebhookServer,
        )

        if (cert is None) != (key is None):
            fail("--cert and --key go together")
        for flag, path in (("--cert", cert), ("--key", key)):
            if path is not None and not path.is_file():
                fail(f"{flag} {path}: no such file")
        policy = AdmissionPolicy(frozenset(scheduler_account or [DEFAULT_SCHEDULER_ACCOUNT]),
                                 frozenset(device_plugin_account or [DEFAULT_DEVICE_PLUGIN_ACCOUNT]))
        try:
            server = WebhookServer(policy, addr, port, cert=cert, key=key)
        except (OSError, ValueError) as exc:
            fail(f"cannot serve on {addr}:{port}: {exc}")
        log_to_stderr()
        logging.getLogger(__name__).info("admission webhook on %s/validate", server.url)
        # serve_forever runs on this thread: shutdown() from a handler here would wait forever.
        try:
            with on_sigterm(interrupt):
                server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()

    @app.command("operator")
    def operator(
        namespace: Annotated[str, typer.Option(help="namespace of the leader-election Lease")] = "gpuplane-system",
        lease_name: Annotated[str, typer.Option(help="name of the Lease")] = "gpuplane-operator",
        identity: Annotated[str | None, typer.Option(help="this replica's holder identity [default: $POD_NAME, "
                                                          "else the host name]")] = None,
        watch_namespace: Annotated[str | None, typer.Option(help="only this namespace's policies [default: all]")
                                   ] = None,
        lease_duration: Annotated[float, typer.Option(help="seconds")] = 15.0,
        renew_deadline: Annotated[float, typer.Option(help="seconds")] = 10.0,
        retry_period: Annotated[float, typer.Option(help="seconds")] = 2.0,
        metrics_port: Annotated[int | None, typer.Option(min=0, max=65535, help=(
            "serve Prometheus metrics (GET /metrics) on this port: the operator's leader gauge "
            "(docs/monitoring.md); 0: a free port, logged [default: none]"))] = None,
        health_port: Annotated[int | None, typer.Option(min=0, max=65535, help="serve /healthz on this port")
                               ] = None,
        kubeconfig: Annotated[Path | None, typer.Option(help="kubeconfig [default: in-cluster, else ~/.kube/config]")
                              ] = None,
        prometheus: Annotated[str | None, typer.Option(
            help="Prometheus URL to read each tidal service's load from (the forecaster learns from it); "
                 "without it the policies' floors alone set replicas")] = None,
        load_query: Annotated[str, typer.Option(
            help="PromQL for one service's load in requests/s; $namespace and $service are substituted")
        ] = DEFAULT_LOAD_QUERY,
        prometheus_timeout: Annotated[float, typer.Option(min=0.001, help="seconds per Prometheus query")] = 2.0,
        ledger: Annotated[Path | None, typer.Option(
            help="also book every pod's cards into this accounting ledger while leading (docs/accounting.md; a "
                 "volume every replica mounts), utilisation from --prometheus's dcgm-exporter series")] = None,
        ledger_metric: Annotated[str, typer.Option(help="DCGM_FI_DEV_GPU_UTIL or DCGM_FI_PROF_SM_ACTIVE")
                                 ] = "DCGM_FI_DEV_GPU_UTIL",
        ledger_sample_s: Annotated[float, typer.Option(min=1.0, help="seconds between the ledger's readings")
                                   ] = 60.0,
        idle_rule: Annotated[list[str] | None, typer.Option(
            "--idle-rule", help="the idle policy on the ledger's readings (repeatable, needs --ledger): "
                                "CLASS:WINDOW_S:MAX_EFFICIENCY:GRACE_S:ACTION, e.g. dev:3600:0.05:1800:evict; pods "
                                "of the priority class whose cards were at most that busy over the window are "
                                "noticed (annotation and Event), then evicted or scaled to zero after the grace "
                                "(docs/accounting.md)")] = None,
        parity: Annotated[bool, typer.Option(
            "--parity", help="instead of running: the operator against the local API server through a compressed "
                             "day next to the simulator's controllers on the same inputs; print the decisions "
                             "compared and the differences (exit 1 on a difference)")] = False,
        parity_json: Annotated[bool, typer.Option("--json", help="with --parity: the result as JSON")] = False,
    ) -> None:
        """Run the controllers in-cluster with leader election on a Lease until Ctrl-C or SIGTERM."""
        import threading

        if parity:
            import json

            from gpuplane.report.operator_parity import render, run_parity

            result = run_parity()
            print(json.dumps(result.to_dict(), indent=2) if parity_json else render(result))
            raise typer.Exit(1 if result.differences else 0)

        from gpuplane.kube.lease import LeaseConfig, LeaseConfigError
        from gpuplane.kube.operator import run_operator
        from gpuplane.scaler.prometheus import PrometheusClient, PrometheusError

        load = None
        if prometheus is not None:
            try:
                load = PrometheusLoad(PrometheusClient(prometheus, timeout_s=prometheus_timeout), load_query)
            except PrometheusError as exc:
                fail(f"--prometheus {prometheus}: {exc}")
            except KeyError as exc:
                fail(f"--load-query: unknown placeholder ${exc.args[0]} (use $namespace and $service)")
            except ValueError as exc:
                fail(f"--load-query: {exc}")

        ledger_settings = None
        if ledger is not None:
            from gpuplane.controllers.accounting import DcgmReader, NoReader, UtilisationReader
            from gpuplane.kube.operator import LedgerSettings

            reader: UtilisationReader = NoReader()
            if prometheus is not None:
                try:
                    reader = DcgmReader(PrometheusClient(prometheus, timeout_s=prometheus_timeout), ledger_metric)
                except (PrometheusError, ValueError) as exc:
                    fail(f"--ledger-metric {ledger_metric}: {exc}")
            ledger_settings = LedgerSettings(ledger, reader, ledger_sample_s,
                                             tuple(parse_idle_rule(r) for r in idle_rule or ()))
        elif idle_rule:
            fail("--idle-rule: the idle policy reads the accounting ledger: pass --ledger too")

        holder = identity or os.environ.get("POD_NAME") or socket.gethostname()
        try:
            config = LeaseConfig(namespace, lease_name, holder, lease_duration, renew_deadline, retry_period)
        except LeaseConfigError as exc:
            fail(str(exc))
        api = connect(kubeconfig)
        log_to_stderr()
        stop = threading.Event()
        health = serve_health(health_port)
        metrics = serve_metrics(metrics_port)
        try:
            with on_sigterm(stop.set):
                run_operator(api, config, stop, namespace=watch_namespace, load=load, metrics=metrics,
                             ledger=ledger_settings)
        except KeyboardInterrupt:
            pass
        finally:
            if health is not None:
                health.stop()
