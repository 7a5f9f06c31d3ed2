"""The node agent in DRA mode (`gpuplane.node.dra_node`, `gpuplane dra-plugin`): the kubelet plugin and the
node's ResourceSlices kept up by one loop against the local API server, with fake GPUs: the pool is published
once per change and owned by the Node, a refused publish is made again at the next tick, a socket kubelet
removed is served again, the command takes the split from the node's GpuPool and ends on SIGTERM taking its
sockets with it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from daemons import gpuplane_daemon, sigterm
from gpuplane.kube.crds import API_VERSION, GPU_POOL
from gpuplane.kube.localapi import FakeApiServer, node_json
from gpuplane.kube.objects import POOL_LABEL
from gpuplane.model import default_catalog
from gpuplane.node.dra_node import node_uid, run_dra_node
from gpuplane.node.dra_plugin import PLUGIN_TYPE, DraPlugin, DraSettings, MemoryClaimSource, registration_protocol
from gpuplane.node.dra_slices import DRIVER, NODE_LABEL, RESOURCE_SLICES, SlicePublisher, SliceSettings
from gpuplane.node.gpu import GIB, FakeGpuBackend

NODE = "node-a"
A100 = default_catalog().get("A100-80GB")


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def slices(server: FakeApiServer, node: str = NODE) -> list[dict]:
    return list(server.api.list(RESOURCE_SLICES, label_selector=f"{NODE_LABEL}={node}")[0])


def get_info(registration_socket: Path) -> object:
    with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
        stub = registration_protocol().services.RegistrationStub(channel)
        return stub.GetInfo(registration_protocol().messages.InfoRequest(), timeout=5)


def test_the_loop_publishes_once_per_change_retries_a_refusal_and_serves_a_removed_socket(tmp_path: Path) -> None:
    backend = FakeGpuBackend(2, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100)
    settings = DraSettings(NODE, registry_dir=tmp_path / "reg", plugins_dir=tmp_path / "plugins",
                           cdi_dir=tmp_path / "cdi")
    with FakeApiServer() as server:
        uid = server.add_object("/api/v1/nodes", node_json(NODE))["metadata"]["uid"]
        assert node_uid(server.api, NODE) == uid
        assert node_uid(server.api, "no-such-node") is None  # logged; slices then have no owner
        plugin = DraPlugin(settings, backend, MemoryClaimSource())
        plugin.start()
        assert plugin.model is not None
        publisher = SlicePublisher(server.api, backend, backend.describe, plugin.model,
                                   SliceSettings(NODE, node_uid=uid))
        server.fail_next("POST", r"/resourceslices$", 500, "InternalError")  # the first publish is refused
        stop = threading.Event()
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(run_dra_node(plugin, publisher, stop, 0.05)))
        thread.start()
        try:
            wait_until(lambda: len(slices(server)) > 0, "the node's slices")
            owners = {tuple((o["kind"], o["name"], o["uid"]) for o in s["metadata"]["ownerReferences"])
                      for s in slices(server)}
            assert owners == {(("Node", NODE, uid),)}  # garbage-collected with the Node
            generations = {s["spec"]["pool"]["generation"] for s in slices(server)}
            # the refused POST, then the whole pool at the next tick
            assert server.request_counts()["POST resourceslices"] == len(slices(server)) + 1
            backend.set_xid(1, 48)  # a critical Xid: card 1's devices are tainted in the next generation
            wait_until(lambda: {s["spec"]["pool"]["generation"] for s in slices(server)} != generations,
                       "the tainted generation")
            # kubelet removed the registration socket (a restart of kubelet does): served again, same endpoint
            settings.registration_socket.unlink()
            wait_until(settings.registration_socket.exists, "the registration socket again")
            info = get_info(settings.registration_socket)
            assert (info.type, info.name, info.endpoint) == (PLUGIN_TYPE, DRIVER, str(settings.endpoint))
        finally:
            stop.set()
            thread.join(10)
            plugin.stop()
    # two generations written: the first (after the refused try) and the tainted one; the other ticks wrote nothing
    assert result == [2]


def vgpu_shares(server: FakeApiServer) -> set[str]:
    """The `shares` capacity (holders at most: the split) of every vGPU device the node publishes."""
    return {d["capacity"]["shares"]["value"] for s in slices(server) for d in s["spec"].get("devices", [])
            if d["name"].endswith("-vgpu")}


def test_gpuplane_dra_plugin_serves_publishes_and_ends_on_sigterm(tmp_path: Path) -> None:
    # The node's GpuPool says split 4 (the flag's 10 applies without it), then 2: the slices follow.
    with FakeApiServer() as server:
        server.add_object(GPU_POOL.path(), {"apiVersion": API_VERSION, "kind": "GpuPool", "metadata": {"name": "p"},
                                            "spec": {"models": ["A100-80GB"], "split": 4}})
        server.add_node(node_json(NODE, labels={POOL_LABEL: "p"}))
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        registration = tmp_path / "reg" / f"{DRIVER}-reg.sock"
        with gpuplane_daemon(["dra-plugin", "--node-name", NODE, "--registry-dir", str(tmp_path / "reg"),
                              "--plugins-dir", str(tmp_path / "plugins"), "--cdi-dir", str(tmp_path / "cdi"),
                              "--fake-cards", "2", "--fake-model", "A100-80GB", "--interval", "0.2",
                              "--kubeconfig", str(kubeconfig)]) as child:
            wait_until(lambda: registration.exists() and len(slices(server)) > 0, "the plugin's socket and slices",
                       timeout_s=60)
            assert get_info(registration).endpoint == str(tmp_path / "plugins" / DRIVER / "dra.sock")
            assert vgpu_shares(server) == {"4"}  # the pool's split from the first publish
            # the fake's NVML driver version, "550.54.15", as a semantic version on every device
            assert {(d["attributes"].get("driverVersion") or {}).get("version") for s in slices(server)
                    for d in s["spec"].get("devices", [])} == {"550.54.15"}
            server.api.patch(GPU_POOL.path(name="p"), {"spec": {"split": 2}})
            wait_until(lambda: vgpu_shares(server) == {"2"}, "the pool's new split in the slices")
            returncode, output = sigterm(child)
            assert returncode == 0, output
        assert not registration.exists()  # stop removes both sockets; the slices stay for the next start
        assert slices(server)


def test_gpuplane_dra_plugin_refuses_bad_flags(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpuplane.cli.main import app

    runner = CliRunner()
    for flags, message in ((["--mig-mode", "half"], "--mig-mode"), (["--unhealthy", "hide"], "--unhealthy")):
        result = runner.invoke(app, ["dra-plugin", "--node-name", NODE, *flags])
        assert result.exit_code == 2 and message in result.output, result.output


def test_kubelet_watching_device_health_sees_every_device_and_a_critical_xid(tmp_path: Path) -> None:
    """`dra-health/v1` on the DRA endpoint: the first response lists every device the pool publishes, healthy;
    a critical Xid on card 1 sends a new list at the next tick with card 1's devices (whole card, MIG slices,
    vGPU share) UNHEALTHY and card 0's still HEALTHY; a quiet stream is resent after `resend_s`."""
    from gpuplane.node.dra_health import health_protocol

    backend = FakeGpuBackend(2, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100)
    settings = DraSettings(NODE, registry_dir=tmp_path / "reg", plugins_dir=tmp_path / "plugins",
                           cdi_dir=tmp_path / "cdi")
    wire = health_protocol()
    with FakeApiServer() as server:
        server.add_node(node_json(NODE))
        plugin = DraPlugin(settings, backend, MemoryClaimSource(), clock=lambda: 1_700_000_000.0,
                           health_resend_s=1.0)
        plugin.start()
        try:
            assert plugin.model is not None
            publisher = SlicePublisher(server.api, backend, backend.describe, plugin.model, SliceSettings(NODE),
                                       health_book=plugin.health_book)
            publisher.tick()
            published = {d["name"] for s in slices(server) for d in s["spec"].get("devices", [])}
            with grpc.insecure_channel(f"unix://{settings.endpoint}") as channel:
                stream = wire.services.DRAResourceHealthStub(channel).NodeWatchResources(
                    wire.messages.NodeWatchResourcesRequest(), timeout=30)
                first = next(stream)
                assert {d.device.device_name for d in first.devices} == published
                assert {(d.device.pool_name, d.health, d.last_updated_time) for d in first.devices} == {
                    (NODE, wire.messages.HEALTHY, 1_700_000_000)}
                backend.set_xid(1, 79)  # fallen off the bus: critical
                publisher.tick()
                second = next(stream)
                health = {d.device.device_name: d.health for d in second.devices}
                sick = {n for n, h in health.items() if h == wire.messages.UNHEALTHY}
                assert sick and all(n.startswith("gpu-1") for n in sick)
                assert sick == {n for n in published if n.startswith("gpu-1")}
                assert {health[n] for n in published - sick} == {wire.messages.HEALTHY}
                assert next(stream).devices == second.devices  # nothing changed: resent after 1 s
                stream.cancel()
        finally:
            plugin.stop()
