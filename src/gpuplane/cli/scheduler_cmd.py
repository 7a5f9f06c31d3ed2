"""`gpuplane scheduler`: gpuplane's own scheduler for the pods that name it (`gpuplane.kube.scheduler_mode`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from gpuplane.cli.common import (
    CardOnlyOneScopeOption,
    CardPolicyOption,
    NodePolicyOption,
    SeedOption,
    TopoOption,
    fail,
    log_to_stderr,
    on_sigterm,
    serve_health,
    serve_metrics,
)
from gpuplane.kube.scheduler_mode import DEFAULT_LEASE_NAME, DEFAULT_LEASE_NAMESPACE, DEFAULT_SCHEDULER_NAME


def register(app: typer.Typer) -> None:
    @app.command("scheduler")
    def scheduler(
        scheduler_name: Annotated[str, typer.Option(help="the spec.schedulerName of the pods to schedule")]
            = DEFAULT_SCHEDULER_NAME,
        node_policy: NodePolicyOption = "binpack",
        card_policy: CardPolicyOption = None,
        card_only_one_scope: CardOnlyOneScopeOption = "workload",
        topo: TopoOption = None,
        seed: SeedOption = 0,
        typical_pods: Annotated[str | None, typer.Option(help=(
            "the workload FGD's policies aim at: a bundled trace name (default, gpushare40, gpushare100) or a pod "
            "CSV, as `simulate --trace` reads it (needed by fgd and fgd-online)"))] = None,
        pools: Annotated[Path | None, typer.Option(help="pool settings (YAML, as `simulate --pools`)")] = None,
        bind_workers: Annotated[int, typer.Option(min=0, help="threads making the API calls of binds, "
                                                              "conditions and events")] = 4,
        sync_binds: Annotated[bool, typer.Option("--sync-binds", help=(
            "bind on the deciding thread, one API round trip after another (the parity experiment)"))] = False,
        leader_elect: Annotated[bool, typer.Option("--leader-elect/--no-leader-elect",
                                                   help="elect a leader on a Lease")] = True,
        lease_namespace: Annotated[str, typer.Option(help="namespace of the Lease")] = DEFAULT_LEASE_NAMESPACE,
        lease_name: Annotated[str, typer.Option(help="name of the Lease")] = DEFAULT_LEASE_NAME,
        identity: Annotated[str | None, typer.Option(help="this replica's holder identity [default: $POD_NAME, "
                                                          "else the host name]")] = None,
        lease_duration: Annotated[float, typer.Option(help="seconds")] = 15.0,
        renew_deadline: Annotated[float, typer.Option(help="seconds")] = 10.0,
        retry_period: Annotated[float, typer.Option(help="seconds")] = 2.0,
        health_port: Annotated[int | None, typer.Option(min=0, max=65535, help="serve /healthz on this port")
                               ] = None,
        metrics_port: Annotated[int | None, typer.Option(min=0, max=65535, help=(
            "serve Prometheus metrics (GET /metrics) on this port, every replica: the leader gauge always, the "
            "cluster's figures while leading (docs/monitoring.md); 0: a free port, logged [default: none]"))
                                ] = None,
        kubeconfig: Annotated[Path | None, typer.Option(
            help="kubeconfig file (default: in-cluster config, else $KUBECONFIG or ~/.kube/config)")] = None,
        context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
        dra: Annotated[bool, typer.Option("--dra", help=(
            "also allocate ResourceClaims of gpuplane's DeviceClasses on DRA nodes, read from their ResourceSlices "
            "(docs/dra.md)"))] = False,
    ) -> None:
        """Schedule the pods whose spec.schedulerName names this scheduler, with gpuplane's core (queue, gangs,
        backfill, quotas, preemption), until Ctrl-C or SIGTERM."""
        from gpuplane.cli.common import policy_config
        from gpuplane.kube.api import KubeConfigError, connect_api
        from gpuplane.kube.lease import LeaseConfig, LeaseConfigError, LeaseElector
        from gpuplane.kube.scheduler_mode import SchedulerMode
        from gpuplane.model import GpuplaneError, default_catalog
        from gpuplane.port import WallClock
        from gpuplane.scheduler import PolicyError, default_registry
        from gpuplane.scheduler.plugins.frag import TypicalPods
        from gpuplane.sim import load_pods, resolve_trace
        from gpuplane.sim.pools import load_pools

        if not scheduler_name:
            fail("--scheduler-name: must not be empty")
        catalog = default_catalog()
        try:
            typical = None
            if typical_pods is not None:
                workload = load_pods(resolve_trace(typical_pods), catalog)
                typical = TypicalPods.from_workload(p.request for p in workload)
            config = policy_config(node_policy, card_policy, card_only_one_scope, topo, seed, typical=typical)
            profile = default_registry().build(config)
            pool_table = load_pools(pools) if pools is not None else None
        except PolicyError as exc:
            fail(f"--node-policy/--card-policy: {exc}")
        except (GpuplaneError, OSError) as exc:
            fail(str(exc))
        holder = identity or os.environ.get("POD_NAME") or socket.gethostname()
        if kubeconfig is not None and not kubeconfig.is_file():
            fail(f"--kubeconfig {kubeconfig}: no such file")
        try:
            api = connect_api(str(kubeconfig) if kubeconfig else None, context)
        except KubeConfigError as exc:
            fail(f"no cluster to talk to: {exc}")
        clock = WallClock()
        elector = None
        if leader_elect:
            try:
                lease = LeaseConfig(lease_namespace, lease_name, holder, lease_duration, renew_deadline,
                                     retry_period)
            except LeaseConfigError as exc:
                fail(str(exc))
            elector = LeaseElector(api, lease, clock.now)
        log_to_stderr()
        health = serve_health(health_port)
        metrics = serve_metrics(metrics_port)
        make: Callable[..., SchedulerMode] = SchedulerMode
        if dra:
            from gpuplane.kube.dra import dra_scheduler

            make = dra_scheduler
        mode = make(api, profile, catalog=catalog, seed=seed, pools=pool_table, scheduler_name=scheduler_name,
                    elector=elector, clock=clock, bind_workers=0 if sync_binds else bind_workers, identity=holder,
                    metrics=metrics, freeze_gc=True)  # the process is the scheduler's alone
        logging.getLogger(__name__).info("gpuplane scheduler %r (%s, seed %d, %s)", scheduler_name, profile.name,
                                         seed, "leader election on " + f"{lease_namespace}/{lease_name}"
                                         if leader_elect else "no leader election")
        stop = threading.Event()
        try:
            with on_sigterm(stop.set):
                mode.run(stop)
        except KeyboardInterrupt:
            pass
        finally:
            if health is not None:
                health.stop()
