"""The DRA kubelet plugin over real gRPC on Unix sockets in a temporary directory, with a real gRPC client in
kubelet's place and fake GPUs: registration, prepare and unprepare (idempotent, surviving a restart), the CDI
spec files and the environment each kind of device gets (the device plugin's HAMi-core, MPS and MIG variables)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuplane.kube import localapi
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.model import default_catalog
from gpuplane.node.allocation import AllocationSettings
from gpuplane.node.dra_plugin import (
    CDI_KIND,
    DRA_PLUGIN_SERVICE,
    PLUGIN_TYPE,
    DraPlugin,
    DraSettings,
    KubeClaimSource,
    MemoryClaimSource,
    claim_path,
    dra_protocol,
    registration_protocol,
)
from gpuplane.node.dra_slices import DRIVER
from gpuplane.node.gpu import GIB, FakeGpuBackend

NODE = "node-a"
A100 = default_catalog().get("A100-80GB")


def claim(name: str, uid: str, *devices: tuple[str, str] | tuple[str, str, Mapping[str, str]],
          namespace: str = "team", driver: str = DRIVER, pool: str = NODE) -> dict[str, Any]:
    """A ResourceClaim allocated `devices` ((request, device[, consumedCapacity]))."""
    results = []
    for d in devices:
        result: dict[str, Any] = {"request": d[0], "driver": driver, "pool": pool, "device": d[1]}
        if len(d) == 3:
            result["consumedCapacity"] = dict(d[2])
        results.append(result)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"namespace": namespace, "name": name, "uid": uid},
            "spec": {"devices": {"requests": [{"name": d[0]} for d in devices]}},
            "status": {"allocation": {"devices": {"results": results}}}}


class Kubelet:
    """kubelet's side: a gRPC client of the registration socket and of the endpoint GetInfo names."""

    def __init__(self, registration_socket: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{registration_socket}")
        self.registration = registration_protocol().services.RegistrationStub(self.channel)
        info = self.registration.GetInfo(registration_protocol().messages.InfoRequest(), timeout=5)
        self.info = info
        self.dra_channel = grpc.insecure_channel(f"unix://{info.endpoint}")
        self.dra = dra_protocol().services.DRAPluginStub(self.dra_channel)

    def notify(self, registered: bool, error: str = "") -> None:
        self.registration.NotifyRegistrationStatus(
            registration_protocol().messages.RegistrationStatus(plugin_registered=registered, error=error), timeout=5)

    @staticmethod
    def _claims(claims: list[tuple[str, str, str]]) -> list[Any]:
        return [dra_protocol().messages.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]

    def prepare(self, *claims: tuple[str, str, str]) -> Any:
        messages = dra_protocol().messages
        return self.dra.NodePrepareResources(messages.NodePrepareResourcesRequest(claims=self._claims(list(claims))),
                                             timeout=5)

    def unprepare(self, *claims: tuple[str, str, str]) -> Any:
        messages = dra_protocol().messages
        return self.dra.NodeUnprepareResources(
            messages.NodeUnprepareResourcesRequest(claims=self._claims(list(claims))), timeout=5)

    def close(self) -> None:
        self.channel.close()
        self.dra_channel.close()


def host_dirs(root: Path) -> AllocationSettings:
    """HAMi-core's host directories under `root` (prepare makes the writable ones)."""
    return AllocationSettings(vgpu_dir=str(root / "vgpu"), lock_dir=str(root / "vgpulock"))


class Node:
    """A node: fake cards, the plugin's directories (short paths: a Unix socket path is limited to 108 bytes)."""

    def __init__(self, root: Path, backend: FakeGpuBackend, allocation: AllocationSettings | None = None) -> None:
        self.root = root
        self.backend = backend
        self.source = MemoryClaimSource()
        self.settings = DraSettings(NODE, registry_dir=root / "reg", plugins_dir=root / "plugins",
                                    cdi_dir=root / "cdi", allocation=allocation or host_dirs(root))
        self.plugin = self.start()
        self.kubelet = Kubelet(self.settings.registration_socket)

    def start(self) -> DraPlugin:
        plugin = DraPlugin(self.settings, self.backend, self.source)
        plugin.start()
        return plugin

    def restart(self) -> None:
        """The plugin process ends and a new one starts (same directories, same cards)."""
        self.kubelet.close()
        self.plugin.stop()
        self.plugin = self.start()
        self.kubelet = Kubelet(self.settings.registration_socket)

    def cdi(self, uid: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.settings.cdi_dir / f"gpuplane-{uid}.json").read_text())
        return result

    def env(self, uid: str) -> dict[str, str]:
        edits = self.cdi(uid)["devices"][0]["containerEdits"]
        return dict(e.split("=", 1) for e in edits["env"])

    def close(self) -> None:
        self.kubelet.close()
        self.plugin.stop()


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(root: Path) -> Iterator[Node]:
    backend = FakeGpuBackend(2, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100)
    n = Node(root, backend)
    try:
        yield n
    finally:
        n.close()


def test_get_info_names_the_driver_its_endpoint_and_the_v1_service(node: Node) -> None:
    info = node.kubelet.info
    assert (info.type, info.name, list(info.supported_versions)) == (PLUGIN_TYPE, DRIVER, [DRA_PLUGIN_SERVICE])
    assert info.endpoint == str(node.root / "plugins" / DRIVER / "dra.sock")
    assert node.settings.registration_socket == node.root / "reg" / f"{DRIVER}-reg.sock"
    assert (PLUGIN_TYPE, DRA_PLUGIN_SERVICE) == ("DRAPlugin", "v1.DRAPlugin")


def test_notify_registration_status_records_kubelet_s_verdict(node: Node) -> None:
    assert node.plugin.registered is None
    node.kubelet.notify(False, "no compatible version")
    assert (node.plugin.registered, node.plugin.registration_error) == (False, "no compatible version")
    node.kubelet.notify(True)
    assert (node.plugin.registered, node.plugin.registration_error) == (True, "")


def test_a_whole_card_claim_gets_its_cdi_device_with_the_card_s_uuid_and_device_nodes(node: Node) -> None:
    node.source.add(claim("train", "uid-1", ("gpu", "gpu-1")))
    response = node.kubelet.prepare(("team", "train", "uid-1"))
    entry = response.claims["uid-1"]
    assert entry.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in entry.devices] == [
        (["gpu"], NODE, "gpu-1", [f"{CDI_KIND}=uid-1"])]
    spec = node.cdi("uid-1")
    assert (spec["cdiVersion"], spec["kind"], [d["name"] for d in spec["devices"]]) == ("0.6.0", CDI_KIND, ["uid-1"])
    assert node.env("uid-1") == {"NVIDIA_VISIBLE_DEVICES": "GPU-fake-1"}  # a whole card: no HAMi-core limits
    nodes = [d["path"] for d in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1"]
    assert "mounts" not in spec["devices"][0]["containerEdits"]


def test_a_vgpu_share_gets_hami_core_limits_from_the_consumed_capacity(node: Node) -> None:
    # 10Gi = 10240 MiB; compute 250 milli-cards = 25 % of the SMs
    node.source.add(claim("infer", "uid-2", ("share", "gpu-0-vgpu", {"memory": "10Gi", "compute": "250"})))
    assert node.kubelet.prepare(("team", "infer", "uid-2")).claims["uid-2"].error == ""
    env = node.env("uid-2")
    assert {k: env[k] for k in ("NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_SM_LIMIT",
                                "CUDA_TASK_PRIORITY")} == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-fake-0", "CUDA_DEVICE_MEMORY_LIMIT_0": "10240m", "CUDA_DEVICE_SM_LIMIT": "25",
        "CUDA_TASK_PRIORITY": "0"}
    vgpu = node.root / "vgpu"
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == f"{vgpu}/containers/uid-2_claim/vgpu.cache"
    mounts = {m["containerPath"]: m for m in node.cdi("uid-2")["devices"][0]["containerEdits"]["mounts"]}
    assert mounts["/etc/ld.so.preload"]["hostPath"] == f"{vgpu}/ld.so.preload"
    assert "ro" in mounts["/usr/local/vgpu/libvgpu.so"]["options"]
    # the runtime bind-mounts the writable ones, so they must exist on the host: prepare made them
    writable = [m["hostPath"] for m in mounts.values() if "rw" in m["options"]]
    assert sorted(writable) == sorted([f"{vgpu}/containers/uid-2_claim", str(node.root / "vgpulock")])
    assert all(Path(p).is_dir() for p in writable)


def test_on_an_mps_node_a_vgpu_share_gets_the_mps_client_variables_instead(root: Path) -> None:
    backend = FakeGpuBackend(1, 80 * GIB, name="NVIDIA A100-SXM4-80GB")
    n = Node(root, backend, replace(host_dirs(root), mps=True, mps_pipe_dir=str(root / "mps")))
    try:
        n.source.add(claim("infer", "uid-3", ("share", "gpu-0-vgpu", {"memory": "20Gi", "compute": "500"})))
        assert n.kubelet.prepare(("team", "infer", "uid-3")).claims["uid-3"].error == ""
        env = n.env("uid-3")
        # 20Gi = 20480 MiB on visible device 0; 500 milli = 50 %
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env  # HAMi-core is not loaded under MPS
    finally:
        n.close()


def test_a_mig_device_gets_an_instance_made_for_it_and_its_mig_uuid(node: Node) -> None:
    node.source.add(claim("mig", "uid-4", ("slice", "gpu-0-mig-9-4")))  # 3g.40gb at memory slice 4
    assert node.kubelet.prepare(("team", "mig", "uid-4")).claims["uid-4"].error == ""
    [instance] = node.backend.mig_instances(0)
    assert (instance.profile_id, instance.start) == (9, 4)
    assert node.env("uid-4")["NVIDIA_VISIBLE_DEVICES"] == instance.uuid
    assert node.plugin.prepared["uid-4"].created_mig == ((0, instance.gpu_instance_id),)
    node.kubelet.unprepare(("team", "mig", "uid-4"))
    assert node.backend.mig_instances(0) == []


def test_prepare_is_idempotent_and_survives_a_restart_without_reading_the_claim_again(node: Node) -> None:
    node.source.add(claim("mig", "uid-5", ("slice", "gpu-1-mig-19-2"), ("card", "gpu-0")))
    first = node.kubelet.prepare(("team", "mig", "uid-5"))
    again = node.kubelet.prepare(("team", "mig", "uid-5"))
    assert first == again and first.claims["uid-5"].error == ""
    assert node.source.reads == 1 and len(node.backend.mig_instances(1)) == 1
    spec = node.cdi("uid-5")
    (node.settings.cdi_dir / "gpuplane-uid-5.json").unlink()  # /var/run is a tmpfs: a reboot empties it
    node.source.claims.clear()
    node.restart()
    after = node.kubelet.prepare(("team", "mig", "uid-5"))
    assert after == first and node.cdi("uid-5") == spec
    assert node.source.reads == 1 and len(node.backend.mig_instances(1)) == 1
    response = node.kubelet.unprepare(("team", "mig", "uid-5"))
    assert response.claims["uid-5"].error == ""
    assert not (node.settings.cdi_dir / "gpuplane-uid-5.json").exists()
    assert node.backend.mig_instances(1) == [] and node.plugin.prepared == {}
    node.restart()
    assert node.plugin.prepared == {}  # the checkpoint forgot it too
    again_gone = node.kubelet.unprepare(("team", "mig", "uid-5"))
    assert list(again_gone.claims) == ["uid-5"] and again_gone.claims["uid-5"].error == ""


@pytest.mark.parametrize(("obj", "expected"), [
    (claim("c", "other-uid", ("gpu", "gpu-0")), "has UID other-uid"),
    (claim("c", "uid-6", ("gpu", "gpu-7")), "no device gpu-7"),
    (claim("c", "uid-6", ("gpu", "gpu-0"), pool="node-b"), "pool node-b"),
    (claim("c", "uid-6", ("gpu", "gpu-0-mig-9-2")), "no such MIG profile and placement"),  # 3g starts at 0 or 4
    (claim("c", "uid-6", ("a", "gpu-0-mig-19-0"), ("b", "gpu-0-mig-19-1")), "second MIG device of card 0"),
    (claim("c", "uid-6", ("s", "gpu-0-vgpu", {"memory": "ten"})), "not a Kubernetes quantity"),
    ({**claim("c", "uid-6"), "status": {}}, "not allocated"),
    (None, "not found"),
])
def test_a_claim_that_cannot_be_prepared_fails_alone(node: Node, obj: dict[str, Any] | None, expected: str) -> None:
    if obj is not None:
        node.source.add(obj)
    node.source.add(claim("fine", "uid-ok", ("gpu", "gpu-1")))
    response = node.kubelet.prepare(("team", "c", "uid-6"), ("team", "fine", "uid-ok"))
    assert expected in response.claims["uid-6"].error
    assert response.claims["uid-ok"].error == "" and len(response.claims["uid-ok"].devices) == 1
    assert "uid-6" not in node.plugin.prepared
    assert node.backend.mig_instances(0) == []  # the first MIG instance of a refused claim is not left behind


def test_devices_of_other_drivers_in_the_claim_are_not_ours(node: Node) -> None:
    obj = claim("mixed", "uid-7", ("gpu", "gpu-0"))
    obj["status"]["allocation"]["devices"]["results"].append(
        {"request": "nic", "driver": "rdma.example.com", "pool": "elsewhere", "device": "nic-0"})
    node.source.add(obj)
    entry = node.kubelet.prepare(("team", "mixed", "uid-7")).claims["uid-7"]
    assert (entry.error, [d.device_name for d in entry.devices]) == ("", ["gpu-0"])


def test_tick_serves_again_when_a_socket_is_removed(node: Node) -> None:
    node.settings.registration_socket.unlink()
    node.plugin.tick()
    kubelet = Kubelet(node.settings.registration_socket)
    try:
        assert kubelet.info.name == DRIVER
    finally:
        kubelet.close()


def test_the_settings_put_sockets_where_kubelet_looks() -> None:
    settings = DraSettings(NODE)
    assert str(settings.registration_socket) == f"/var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
    assert str(settings.endpoint) == f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock"
    assert replace(settings, driver="x.io").pool == NODE


def test_the_claim_is_read_from_the_api_server(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the local API server serves resource.k8s.io only when told of it (not among its built-in resources yet)
    monkeypatch.setitem(localapi.BUILTIN, ("resource.k8s.io", "resourceclaims"),
                        ("ResourceClaim", "resource.k8s.io/v1"))
    with FakeApiServer() as server:
        stored = server.add_object(claim_path("team", ""), claim("train", "", ("gpu", "gpu-0")))
        uid = stored["metadata"]["uid"]
        backend = FakeGpuBackend(1, 80 * GIB, name="NVIDIA A100-SXM4-80GB")
        settings = DraSettings(NODE, registry_dir=root / "reg", plugins_dir=root / "plugins", cdi_dir=root / "cdi")
        plugin = DraPlugin(settings, backend, KubeClaimSource(server.api))
        plugin.start()
        kubelet = Kubelet(settings.registration_socket)
        try:
            entry = kubelet.prepare(("team", "train", uid)).claims[uid]
            assert (entry.error, [d.device_name for d in entry.devices]) == ("", ["gpu-0"])
            missing = kubelet.prepare(("team", "gone", "uid-x")).claims["uid-x"]
            assert "cannot read ResourceClaim team/gone" in missing.error
        finally:
            kubelet.close()
            plugin.stop()
