"""`gpuplane device-plugin` (the node agent's kubelet device plugin) and `gpuplane mig-apply` (the MIG manager)."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from gpuplane.cli.common import err, fail, log_to_stderr, on_sigterm
from gpuplane.model import CatalogError, GpuplaneError, MigMode, default_catalog

if TYPE_CHECKING:
    from gpuplane.kube.objects import NodeInventory
    from gpuplane.node.device_plugin import Sharing
    from gpuplane.node.gpu import DeviceBackend
    from gpuplane.node.pool_follow import PoolSharingSource
    from gpuplane.node.rdma import PhysicalFunction

POOL_SYNC_S = 10.0
"""How long the device plugin waits for the GpuPools and its node to be listed before it serves."""


def register(app: typer.Typer) -> None:
    """Add `device-plugin` and `mig-apply` to `app`."""

    @app.command("device-plugin")
    def device_plugin(
        directory: Annotated[Path, typer.Option("--dir", help="kubelet's device-plugin directory")]
            = Path("/var/lib/kubelet/device-plugins/"),
        node_name: Annotated[str | None, typer.Option(help="this node [default: $NODE_NAME]")] = None,
        split: Annotated[int, typer.Option(help="units advertised per card (containers that may share one), "
                                                "unless the node's GpuPool gives its own")] = 10,
        mps: Annotated[bool, typer.Option("--mps", help="the cards run an MPS daemon: hand out MPS client "
                                                        "variables instead of HAMi-core's")] = False,
        mps_pipe_dir: Annotated[str, typer.Option(help="the MPS daemon's pipe directory")] = "/tmp/nvidia-mps",
        vgpu_dir: Annotated[str, typer.Option(help="host directory with libvgpu.so and ld.so.preload")]
            = "/usr/local/vgpu",
        mig_mode: Annotated[str | None, typer.Option(help="MIG mode: dynamic, on, off, unless the node's GpuPool "
                                                          "gives its own [default: dynamic on MIG-capable cards]")]
            = None,
        fake_cards: Annotated[int | None, typer.Option(help="use N fake cards instead of NVML (a dry run "
                                                            "without a GPU)")] = None,
        fake_model: Annotated[str, typer.Option(help="catalog model of the fake cards")] = "H100-80GB",
        kubeconfig: Annotated[str | None, typer.Option(help="kubeconfig file [default: in-cluster, then "
                                                            "$KUBECONFIG]")] = None,
        interval_s: Annotated[float, typer.Option("--interval", help="seconds between health and socket "
                                                                     "checks (and GpuPool re-checks)")] = 5.0,
        mig_grace_s: Annotated[float, typer.Option("--mig-grace", help="seconds a MIG instance no live pod holds "
                                                                      "is kept before it is destroyed")] = 60.0,
        rdma_pools: Annotated[Path | None, typer.Option(help="the RDMA rails, an SR-IOV network device plugin "
                                                             "config.json with one pool per PF (deploy/rdma): serve "
                                                             "gpuplane.io/rdma-vf on their VFs, steered to the PF "
                                                             "the scheduler assigned; a missing file: no RDMA")]
            = None,
        sysfs: Annotated[Path, typer.Option(help="where the host's /sys is (the PFs' VFs)")] = Path("/sys"),
        pod_resources: Annotated[Path | None, typer.Option(help="kubelet's PodResources socket: publish the cards "
                                                                "other GPU stacks' pods hold (node annotation "
                                                                "gpuplane.io/foreign-cards); a missing socket: none")]
            = Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
    ) -> None:
        """Serve gpuplane.io/gpu to kubelet (device plugin API v1beta1) until Ctrl-C or SIGTERM. The node's GpuPool
        (label gpuplane.io/pool) gives the split and MIG mode; --split and --mig-mode apply without a valid one."""
        from gpuplane.node.allocation import AllocationSettings, AssignmentSource, MemoryAssignmentSource
        from gpuplane.node.device_plugin import DevicePlugin, PluginSettings, Sharing, publish_inventory
        from gpuplane.node.pool_follow import PoolSharingSource

        node = node_name or os.environ.get("NODE_NAME")
        if not node:
            fail("--node-name: not given and $NODE_NAME is not set")
        if split < 1:
            fail(f"--split: at least 1, got {split}")
        if interval_s <= 0:
            fail(f"--interval: must be positive, got {interval_s}")
        if mig_grace_s < 0:
            fail(f"--mig-grace: must not be negative, got {mig_grace_s}")
        try:
            mode = MigMode(mig_mode) if mig_mode is not None else None
        except ValueError:
            fail(f"--mig-mode: {mig_mode!r} is not one of dynamic, on, off")
        from gpuplane.node.rdma import KubeRdmaPods, MemoryRdmaPods, RdmaDevicePlugin, RdmaPods, rdma_nics

        rails = _rdma_rails(rdma_pools, sysfs)
        settings = PluginSettings(node_name=node, directory=directory, split=split, mig_mode=mode,
                                  mig_grace_s=mig_grace_s, nics=rdma_nics(rails),
                                  allocation=AllocationSettings(mps=mps, mps_pipe_dir=mps_pipe_dir,
                                                                vgpu_dir=vgpu_dir))
        backend = gpu_backend(fake_cards, fake_model)
        source: AssignmentSource
        publish: Callable[[NodeInventory], None] | None = None
        pools: PoolSharingSource | None = None
        rdma_pods: RdmaPods = MemoryRdmaPods()
        from gpuplane.kube.api import KubeConfigError, connect_api
        from gpuplane.node.allocation import KubeAssignmentSource
        from gpuplane.node.podresources import ForeignCardsReporter, PodResourcesClient

        foreign: ForeignCardsReporter | None = None

        try:
            api = connect_api(kubeconfig)
            source = KubeAssignmentSource(api, node, settings.resource)
            rdma_pods = KubeRdmaPods(api, node)
            publish = functools.partial(publish_inventory, api, node)
            pools = PoolSharingSource(api, node, Sharing(split, mode), refresh_s=interval_s)
            if pod_resources is not None and pod_resources.exists():
                foreign = ForeignCardsReporter(api, node, PodResourcesClient(str(pod_resources)), backend)
        except KubeConfigError as exc:
            if kubeconfig is not None or fake_cards is None:
                backend.close()
                fail(f"--kubeconfig: cannot reach the API server: {exc}")
            err.print(f"no API server ({escape(str(exc))}): a dry run, no pod will match an allocation")
            source = MemoryAssignmentSource()
        log_to_stderr()
        plugin = DevicePlugin(settings, backend, source, publish=publish)
        rdma = RdmaDevicePlugin(rails, rdma_pods, directory=directory) if rails else None
        stop = threading.Event()
        try:
            with on_sigterm(stop.set):
                if pools is not None:
                    follow_pool(pools, plugin.set_sharing, stop)
                try:
                    plugin.start()
                except GpuplaneError as exc:
                    fail(str(exc))
                err.print(f"device plugin: {len(plugin.cards)} cards × {plugin.sharing.split} units of "
                          f"{settings.resource} on {plugin.socket_path}")
                if rdma is not None:
                    rdma.start()
                    err.print(f"RDMA: {sum(len(pf.vfs) for pf in rails)} VFs of {', '.join(pf.name for pf in rails)} "
                              f"as {rdma.resource} on {rdma.socket_path}")
                    threading.Thread(target=rdma.run, args=(stop, interval_s), name="rdma plugin",
                                     daemon=True).start()
                if foreign is not None:
                    err.print(f"foreign cards: from {escape(str(pod_resources))}")
                    threading.Thread(target=foreign.run, args=(stop, interval_s), name="foreign cards",
                                     daemon=True).start()
                plugin.run(stop, interval_s)
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            if pools is not None:
                pools.stop()
            plugin.stop()
            if rdma is not None:
                rdma.stop()
            if foreign is not None:
                foreign.client.close()
            backend.close()

    @app.command("mig-apply")
    def mig_apply(
        card: Annotated[int, typer.Option(min=0, help="card index")],
        profiles: Annotated[str, typer.Option(help="wanted instances: driver names or profile IDs, optionally "
                                                   "@start, e.g. 3g.40gb,2g.20gb@0,19")],
        dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan, change nothing")] = False,
        fake_model: Annotated[str | None, typer.Option(help="plan on a fake card of this catalog model instead "
                                                            "of NVML")] = None,
    ) -> None:
        """Make a card's MIG instances exactly the wanted ones (keeping what it can), or print the plan."""
        from gpuplane.node.device_plugin import canonical_model
        from gpuplane.node.gpu import GpuBackendError
        from gpuplane.node.mig import apply_plan, parse_profiles, plan_layout

        catalog = default_catalog()
        backend = gpu_backend(1 if fake_model is not None else None, fake_model or "", mig=True)
        try:
            infos = backend.describe()
            if card >= len(infos):
                fail(f"--card: {card} is not one of the node's {len(infos)} cards")
            info = infos[card]
            model = catalog.get(canonical_model(info.name, info.total_bytes, catalog))
            wanted, status = parse_profiles(model, profiles)
            if not status.ok:
                fail(f"--profiles: {status.message}")
            plan, status = plan_layout(model, card, wanted, backend.mig_instances(card), info.mig_enabled)
            if plan is None:
                fail(f"--profiles: {status.message}")
            if dry_run:
                print(f"plan for card {card} ({model.name}), not applied (--dry-run):")
            for line in plan.lines(model):
                print(line)
            if dry_run or plan.empty:
                return
            result = apply_plan(backend, plan)
            for instance in result.created:
                print(f"card {card}: created GPU instance {instance.gpu_instance_id} at {instance.start}: "
                      f"{instance.uuid or '(no MIG device yet)'}")
            if not result.status.ok:
                err.print(f"[red]error:[/] {escape(result.status.message)}", soft_wrap=True)
                raise typer.Exit(1)
        except (GpuBackendError, CatalogError) as exc:
            fail(str(exc))
        finally:
            backend.close()


def follow_pool(pools: PoolSharingSource, apply: Callable[[Sharing], object], stop: threading.Event) -> None:
    """Follow the node's GpuPool: wait up to `POOL_SYNC_S` for the GpuPools and the node to be listed (the flags'
    sharing applies until then, logged), give `apply` the sharing in force, then every change on a thread until
    `stop` (and `pools.stop()`)."""
    pools.start()
    deadline = time.monotonic() + POOL_SYNC_S
    while not (synced := pools.wait_synced(0.05)) and not pools.last_error and time.monotonic() < deadline:
        pass
    if not synced:  # the flags' sharing; the pool's follows once it is known
        logging.getLogger(__name__).warning("the node's GpuPool is not known yet, the flags apply: %s",
                                            pools.last_error or "no answer")
    apply(pools.resolve().sharing)
    threading.Thread(target=pools.run, args=(apply, stop), name="node pool", daemon=True).start()


def gpu_backend(fake_cards: int | None, fake_model: str, *, mig: bool = False) -> DeviceBackend:
    """The NVML backend, or `fake_cards` fake cards of catalog model `fake_model` (exit 2 when unusable)."""
    from gpuplane.node.gpu import FakeGpuBackend, NvmlBackend

    if fake_cards is None:
        try:
            return NvmlBackend(xid_events=not mig)
        except GpuplaneError as exc:
            fail(f"cannot read the GPUs through NVML ({exc}); --fake-cards/--fake-model run without one")
    if fake_cards < 1:
        fail(f"--fake-cards: at least 1, got {fake_cards}")
    try:
        model = default_catalog().get(fake_model)
    except CatalogError as exc:
        fail(f"--fake-model: {exc}")
    return FakeGpuBackend(fake_cards, model.memory_mib << 20, name=model.name, numa=[i * 2 // fake_cards
                                                                                      for i in range(fake_cards)],
                          mig_model=model if model.mig_capable else None)


def _rdma_rails(path: Path | None, sysfs: Path) -> tuple[PhysicalFunction, ...]:
    """The PFs of the RDMA pools file with their VFs; none without a file (`--rdma-pools` unset, or its optional
    ConfigMap absent). Exits naming the problem when the file or a PF cannot be used."""
    from gpuplane.node.rdma import RdmaError, discover, load_pfs

    if path is None:
        return ()
    if not path.exists():
        err.print(f"--rdma-pools: {escape(str(path))} does not exist: no RDMA functions served")
        return ()
    try:
        return discover(load_pfs(path.read_text(encoding="utf-8")), sysfs)
    except (OSError, RdmaError) as exc:
        fail(f"--rdma-pools: {path}: {exc}")
