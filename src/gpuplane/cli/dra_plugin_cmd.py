"""`gpuplane dra-plugin`: the node agent's DRA driver (kubelet plugin and ResourceSlices), in place of the
device plugin on a DRA node (docs/dra.md, deploy/modes/dra)."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Annotated

import typer

from gpuplane.cli.common import err, fail, log_to_stderr, on_sigterm
from gpuplane.cli.device_plugin_cmd import follow_pool, gpu_backend
from gpuplane.cli.operator_cmd import connect
from gpuplane.model import GpuplaneError, MigMode


def register(app: typer.Typer) -> None:
    """Add `dra-plugin` to `app`."""

    @app.command("dra-plugin")
    def dra_plugin(
        node_name: Annotated[str | None, typer.Option(help="this node [default: $NODE_NAME]")] = None,
        registry_dir: Annotated[Path, typer.Option(help="kubelet's plugin registry (its plugin watcher)")]
            = Path("/var/lib/kubelet/plugins_registry"),
        plugins_dir: Annotated[Path, typer.Option(help="kubelet's plugins directory: the DRA socket and the "
                                                       "checkpoint go in <dir>/gpu.gpuplane.io")]
            = Path("/var/lib/kubelet/plugins"),
        cdi_dir: Annotated[Path, typer.Option(help="where the container runtime reads CDI specs")]
            = Path("/var/run/cdi"),
        split: Annotated[int, typer.Option(min=1, help="holders of one card's vGPU device at most, unless the "
                                                       "node's GpuPool gives its own")] = 10,
        mig_mode: Annotated[str | None, typer.Option(help="MIG mode: dynamic, on, off, unless the node's GpuPool "
                                                          "gives its own [default: dynamic on MIG-capable cards]")]
            = None,
        unhealthy: Annotated[str, typer.Option(help="an unhealthy card's devices: taint (kept, tainted "
                                                    "NoSchedule) or omit (left out of the slices)")] = "taint",
        mps: Annotated[bool, typer.Option("--mps", help="the cards run an MPS daemon: hand out MPS client "
                                                        "variables instead of HAMi-core's")] = False,
        mps_pipe_dir: Annotated[str, typer.Option(help="the MPS daemon's pipe directory")] = "/tmp/nvidia-mps",
        vgpu_dir: Annotated[str, typer.Option(help="host directory with libvgpu.so and ld.so.preload")]
            = "/usr/local/vgpu",
        interval_s: Annotated[float, typer.Option("--interval", min=0.01, help=(
            "seconds between socket checks and slice publications (written only when they changed)"))] = 5.0,
        fake_cards: Annotated[int | None, typer.Option(help="use N fake cards instead of NVML (a dry run "
                                                            "without a GPU)")] = None,
        fake_model: Annotated[str, typer.Option(help="catalog model of the fake cards")] = "H100-80GB",
        kubeconfig: Annotated[Path | None, typer.Option(help="kubeconfig [default: in-cluster, else ~/.kube/config]")
                              ] = None,
    ) -> None:
        """Serve gpuplane's cards to kubelet as the DRA driver gpu.gpuplane.io (kubelet plugin dra/v1) and publish
        them as this node's ResourceSlices, until Ctrl-C or SIGTERM. The node's GpuPool (label gpuplane.io/pool)
        gives the split and MIG mode; --split and --mig-mode apply without a valid one."""
        from gpuplane.node.allocation import AllocationSettings
        from gpuplane.node.device_plugin import Sharing
        from gpuplane.node.dra_node import node_uid, run_dra_node, set_sharing
        from gpuplane.node.dra_plugin import DraPlugin, DraSettings, KubeClaimSource
        from gpuplane.node.dra_slices import SlicePublisher, SliceSettings, UnhealthyPolicy
        from gpuplane.node.pool_follow import PoolSharingSource

        node = node_name or os.environ.get("NODE_NAME")
        if not node:
            fail("--node-name: not given and $NODE_NAME is not set")
        try:
            mode = MigMode(mig_mode) if mig_mode is not None else None
        except ValueError:
            fail(f"--mig-mode: {mig_mode!r} is not one of dynamic, on, off")
        try:
            policy = UnhealthyPolicy(unhealthy)
        except ValueError:
            fail(f"--unhealthy: {unhealthy!r} is not one of taint, omit")
        api = connect(kubeconfig)
        backend = gpu_backend(fake_cards, fake_model)
        settings = DraSettings(node, registry_dir=registry_dir, plugins_dir=plugins_dir, cdi_dir=cdi_dir,
                               allocation=AllocationSettings(mps=mps, mps_pipe_dir=mps_pipe_dir, vgpu_dir=vgpu_dir))
        plugin = DraPlugin(settings, backend, KubeClaimSource(api))
        pools = PoolSharingSource(api, node, Sharing(split, mode), refresh_s=interval_s)
        log_to_stderr()
        stop = threading.Event()
        try:
            with on_sigterm(stop.set):
                try:
                    plugin.start()
                except GpuplaneError as exc:
                    fail(str(exc))
                if plugin.model is None:
                    fail("the cards are of no catalog model (or of several): no ResourceSlices to publish")
                publisher = SlicePublisher(api, backend, backend.describe, plugin.model,
                                           SliceSettings(node, split=split, mig_mode=mode, unhealthy=policy,
                                                         driver_version=backend.driver_version(),
                                                         node_uid=node_uid(api, node)),
                                           health_book=plugin.health_book)
                follow_pool(pools, functools.partial(set_sharing, publisher), stop)
                err.print(f"DRA driver {settings.driver} on {node} ({plugin.model.name} cards): registration "
                          f"{settings.registration_socket}, endpoint {settings.endpoint}")
                run_dra_node(plugin, publisher, stop, interval_s)
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            pools.stop()
            plugin.stop()
            backend.close()
