"""The RDMA device plugin (`gpuplane.node.rdma`): the rails from the SR-IOV device plugin's config format, VFs
from sysfs, and kubelet steered to the VFs of the PF the scheduler assigned (over real unix-socket gRPC with
the fake kubelet)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tests.fake_kubelet import WAIT_S, FakeKubelet

from gpuplane.kube.localapi import pod_json
from gpuplane.kube.objects import RES_GPU, RES_RDMA, NodeInventory, assignment_annotations
from gpuplane.model import Assignment, RdmaLocality, RdmaNic, RdmaShare
from gpuplane.node.allocation import MemoryAssignmentSource
from gpuplane.node.device_plugin import DevicePlugin, PluginSettings, protocol
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.node.rdma import (
    MemoryRdmaPods,
    PhysicalFunction,
    RdmaDevicePlugin,
    RdmaError,
    RdmaPod,
    VirtualFunction,
    discover,
    load_pfs,
    match_rdma_pod,
    pci_env,
    rdma_nics,
    rdma_pod,
    steer,
)

ROOT = Path(__file__).resolve().parent.parent


def pools(*selectors: Any) -> str:
    return json.dumps({"resourceList": [{"resourceName": f"rdma_{i}", "selectors": s}
                                        for i, s in enumerate(selectors)]})


def test_the_shipped_pools_file_names_the_rails() -> None:
    configmap = (ROOT / "deploy" / "rdma" / "pools-configmap.yaml").read_text(encoding="utf-8")
    text = configmap.split("config.json: |\n", 1)[1]
    assert load_pfs(text) == ("ens1f0np0", "ens2f0np0", "ens3f0np0", "ens4f0np0")


@pytest.mark.parametrize(("text", "message"), [
    ("{}", "resourceList"),
    (pools([{"pfNames": ["a", "b"], "isRdma": True}]), r"resourceList\[0\].selectors\[0\].pfNames"),
    (pools([{"pfNames": ["a#0-3"], "isRdma": True}]), "no VF range"),
    (pools([{"pfNames": ["a"]}]), r"isRdma"),
    (pools([{"pfNames": ["a"], "isRdma": True}], [{"pfNames": ["b"], "isRdma": True}], []), r"resourceList\[2\]"),
    (pools([{"pfNames": ["a"], "isRdma": True}], [{"pfNames": ["a"], "isRdma": True}]), "another pool"),
])
def test_a_pools_file_gpuplane_cannot_steer_is_refused_by_entry(text: str, message: str) -> None:
    with pytest.raises(RdmaError, match=message):
        load_pfs(text)


def test_one_selector_object_is_one_pool() -> None:  # the device plugin takes a lone object as a list of one
    assert load_pfs(pools({"pfNames": ["ens1f0np0"], "isRdma": True})) == ("ens1f0np0",)


# ------------------------------------------------------------------ sysfs
def fake_sysfs(root: Path, pfs: dict[str, tuple[str, int, list[str]]]) -> Path:
    """`/sys` with PCI functions and the net class links: pf -> (pf pci, numa, [vf pci])."""
    devices = root / "bus" / "pci" / "devices"
    uverbs = 0
    for pf, (pci, numa, vfs) in pfs.items():
        (devices / pci).mkdir(parents=True)
        (devices / pci / "numa_node").write_text(f"{numa}\n")
        (root / "class" / "net" / pf).mkdir(parents=True)
        (root / "class" / "net" / pf / "device").symlink_to(devices / pci)
        for i, vf in enumerate(vfs):
            (devices / vf / "infiniband_verbs" / f"uverbs{uverbs}").mkdir(parents=True)
            (devices / vf / "infiniband_mad" / f"umad{uverbs}").mkdir(parents=True)
            (devices / pci / f"virtfn{i}").symlink_to(devices / vf)
            uverbs += 1
    return root


SYSFS = {"ens1f0np0": ("0000:17:00.0", 0, ["0000:17:00.2", "0000:17:00.3"]),
         "ens2f0np0": ("0000:b3:00.0", -1, [f"0000:b3:00.{i}" for i in range(2, 14)])}


def test_the_vfs_and_their_rdma_devices_come_from_sysfs(tmp_path: Path) -> None:
    found = discover(["ens2f0np0", "ens1f0np0"], fake_sysfs(tmp_path, SYSFS))
    assert [(pf.name, pf.pci, pf.numa, len(pf.vfs)) for pf in found] == [("ens2f0np0", "0000:b3:00.0", 0, 12),
                                                                        ("ens1f0np0", "0000:17:00.0", 0, 2)]
    assert found[0].vfs[10].pci == "0000:b3:00.12"  # virtfn10 after virtfn9: numeric order
    assert found[1].vfs[0] == VirtualFunction("0000:17:00.2", ("/dev/infiniband/umad0", "/dev/infiniband/uverbs0"))
    assert rdma_nics(found)[1] == RdmaNic("ens1f0np0", 0, 0, 2)


@pytest.mark.parametrize(("pf", "message"), [("eth9", "does not exist"), ("bare", "no VFs")])
def test_a_pf_that_cannot_serve_is_named(tmp_path: Path, pf: str, message: str) -> None:
    root = fake_sysfs(tmp_path, {"bare": ("0000:01:00.0", 0, [])})
    with pytest.raises(RdmaError, match=f"PF {pf}: .*{message}"):
        discover([pf], root)


# ------------------------------------------------------------------ steering
@pytest.mark.parametrize(("wanted", "available", "must", "size", "chosen"), [
    (["a", "b", "c"], ["x", "b", "c", "a"], [], 2, ["a", "b"]),  # the PF's VFs, in the PF's order
    (["a", "b", "c"], ["x", "c"], [], 2, ["c"]),                  # fewer than asked: kubelet fills the rest
    (["a", "b", "c"], ["a", "b", "c"], ["b"], 2, ["b", "a"]),     # kubelet's must-include devices first
])
def test_the_preference_is_the_assigned_pfs_available_vfs(wanted: list[str], available: list[str],
                                                          must: list[str], size: int, chosen: list[str]) -> None:
    assert steer(wanted, available, must, size) == chosen


def pod(key: str, nic: int, vfs: int, at: float) -> RdmaPod:
    return RdmaPod(key, f"uid-{key}", Assignment("n1", (), RdmaShare(nic, vfs, RdmaLocality.NUMA)), at)


def test_the_oldest_pod_with_vfs_left_is_the_one_allocated() -> None:
    old, new = pod("a", 0, 2, 1.0), pod("b", 1, 1, 2.0)
    assert match_rdma_pod([new, old], {}, 1) == old
    assert match_rdma_pod([new, old], {"uid-a": 2}, 1) == new  # a has all its VFs
    assert match_rdma_pod([new, old], {"uid-a": 1}, 2) is None  # nobody has two left


@pytest.mark.parametrize(("change", "waiting"), [
    ({}, True),
    ({"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}},
     True),
    ({"status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}}, False),
    ({"spec": {"nodeName": "n2"}}, False),
])
def test_a_pod_waits_for_vfs_until_a_container_starts(change: dict[str, Any], waiting: bool) -> None:
    obj = pod_json("p", node="n1", annotations=assignment_annotations(pod("p", 1, 2, 0).assignment, 5.0))
    for key, value in change.items():
        obj[key].update(value)
    found = rdma_pod(obj, "n1")
    assert (found is not None) == waiting
    if found is not None:
        assert found.assigned_at == 5.0 and found.assignment.rdma == RdmaShare(1, 2, RdmaLocality.NUMA)


def test_the_variable_is_the_sriov_device_plugins() -> None:
    assert pci_env("gpuplane.io/rdma-vf") == "PCIDEVICE_GPUPLANE_IO_RDMA_VF"


# ------------------------------------------------------------------ over gRPC, with the fake kubelet
@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gprdma-", dir="/tmp"))  # unix socket paths: 107 bytes at most
    yield path
    shutil.rmtree(path, ignore_errors=True)


RAILS = (PhysicalFunction("ens1f0np0", "0000:17:00.0", 0, tuple(VirtualFunction(f"0000:17:00.{i}",
                                                                               (f"/dev/infiniband/uverbs{i}",))
                                                              for i in (2, 3, 4))),
         PhysicalFunction("ens2f0np0", "0000:b3:00.0", 1, tuple(VirtualFunction(f"0000:b3:00.{i}",
                                                                               (f"/dev/infiniband/uverbs{10 + i}",))
                                                              for i in (2, 3, 4))))


def preferred(kubelet: FakeKubelet, endpoint: str, available: list[str], size: int) -> list[str]:
    pb = protocol().messages
    with grpc.insecure_channel(f"unix://{kubelet.directory / endpoint}") as channel:
        answer = protocol().services.DevicePluginStub(channel).GetPreferredAllocation(pb.PreferredAllocationRequest(
            container_requests=[pb.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                                                       allocation_size=size)]), timeout=WAIT_S)
    return list(answer.container_responses[0].deviceIDs)


def test_kubelet_is_steered_to_the_assigned_pfs_vfs(sockdir: Path) -> None:
    kubelet = FakeKubelet(sockdir)
    kubelet.start()
    pods = MemoryRdmaPods(pod("default/p", 1, 2, 1.0))
    plugin = RdmaDevicePlugin(RAILS, pods, directory=sockdir)
    try:
        plugin.start()
        registration = kubelet.wait_registered()
        assert (registration.resource_name, registration.get_preferred_allocation_available) == \
            ("gpuplane.io/rdma-vf", True)
        listed = kubelet.next_list()
        assert [(d.id, d.numa) for d in listed] == [(vf.pci, (pf.numa,)) for pf in RAILS for vf in pf.vfs]
        everything = [d.id for d in listed]
        # kubelet's devicesToAllocate: the preferred devices that are available, then Allocate with them
        chosen = preferred(kubelet, registration.endpoint, everything[1:], 2)
        assert chosen == ["0000:b3:00.2", "0000:b3:00.3"]  # NIC 1 of the inventory: the second rail
        answer = kubelet.allocate([chosen]).container_responses[0]
        assert dict(answer.envs) == {"PCIDEVICE_GPUPLANE_IO_RDMA_VF": "0000:b3:00.2,0000:b3:00.3"}
        assert [(d.host_path, d.permissions) for d in answer.devices] == [
            ("/dev/infiniband/uverbs12", "rw"), ("/dev/infiniband/uverbs13", "rw"), ("/dev/infiniband/rdma_cm", "rw")]
        with pytest.raises(grpc.RpcError) as caught:  # the pod has its VFs: nobody waits for more
            kubelet.allocate([["0000:b3:00.4"]])
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        plugin.stop()
        kubelet.stop()


@pytest.mark.parametrize(("ids", "code", "message"), [
    (["0000:17:00.2", "0000:17:00.3"], grpc.StatusCode.FAILED_PRECONDITION, "assigned PF ens2f0np0"),
    (["0000:99:00.1"], grpc.StatusCode.NOT_FOUND, "unknown device"),
])
def test_an_allocation_off_the_assigned_pf_is_refused(sockdir: Path, ids: list[str], code: grpc.StatusCode,
                                                      message: str) -> None:
    kubelet = FakeKubelet(sockdir)
    kubelet.start()
    plugin = RdmaDevicePlugin(RAILS, MemoryRdmaPods(pod("default/p", 1, 2, 1.0)), directory=sockdir)
    try:
        plugin.start()
        kubelet.wait_registered()
        with pytest.raises(grpc.RpcError) as caught:
            kubelet.allocate([ids])
        assert caught.value.code() is code and message in str(caught.value.details())
    finally:
        plugin.stop()
        kubelet.stop()


def test_a_kubelet_restart_is_followed(sockdir: Path) -> None:
    kubelet = FakeKubelet(sockdir)
    kubelet.start()
    plugin = RdmaDevicePlugin(RAILS, MemoryRdmaPods(), directory=sockdir)
    try:
        plugin.start()
        kubelet.wait_registered()
        kubelet.restart()  # the socket directory is wiped, a new kubelet.sock appears
        plugin.tick()
        assert kubelet.wait_registered(2).endpoint == "gpuplane-rdma.sock" and plugin.registrations == 2
    finally:
        plugin.stop()
        kubelet.stop()


# ------------------------------------------------------------------ the node agent's command and inventory
def test_the_gpu_plugin_publishes_the_rails_as_the_inventorys_nics(sockdir: Path, tmp_path: Path) -> None:
    kubelet = FakeKubelet(sockdir)
    kubelet.start()
    published: list[NodeInventory] = []
    nics = rdma_nics(discover(["ens1f0np0", "ens2f0np0"], fake_sysfs(tmp_path, SYSFS)))
    plugin = DevicePlugin(PluginSettings("n1", sockdir, nics=nics),
                          FakeGpuBackend(2, 80 * GIB, name="NVIDIA H100 80GB HBM3", uuid_prefix="h100"),
                          MemoryAssignmentSource(), publish=published.append)
    try:
        plugin.start()
        assert [n.name for n in published[-1].nics] == ["ens1f0np0", "ens2f0np0"]  # NIC i: the pools file's i-th PF
        assert NodeInventory.decode(published[-1].encode()).nics == nics  # what the scheduler reads
    finally:
        plugin.stop(0)
        kubelet.stop()


def command(*args: str) -> list[str]:
    script = ("import typer; from gpuplane.cli.device_plugin_cmd import register; app = typer.Typer(); "
              "register(app); app()")
    return [sys.executable, "-c", script, "device-plugin", *args]


def test_the_device_plugin_command_serves_the_rails_beside_the_cards(sockdir: Path, tmp_path: Path) -> None:
    kubelet = FakeKubelet(sockdir)
    kubelet.start()
    config = tmp_path / "config.json"
    config.write_text(pools([{"pfNames": ["ens2f0np0"], "isRdma": True}]), encoding="utf-8")
    env = {**os.environ, "NODE_NAME": "n1", "KUBECONFIG": "/nonexistent/kubeconfig", "KUBERNETES_SERVICE_HOST": ""}
    proc = subprocess.Popen(command("--dir", str(sockdir), "--fake-cards", "1", "--interval", "0.2",
                                    "--rdma-pools", str(config), "--sysfs", str(fake_sysfs(tmp_path / "sys", SYSFS))),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert kubelet.wait_registered(1).resource_name == RES_GPU
        assert kubelet.wait_registered(2).resource_name == RES_RDMA
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=WAIT_S)
        kubelet.stop()
    assert proc.returncode == 0, stderr
    assert "RDMA: 12 VFs of ens2f0np0 as gpuplane.io/rdma-vf" in stderr


def test_the_device_plugin_command_names_a_pools_file_it_cannot_use(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    app = typer_app()
    config = tmp_path / "config.json"
    config.write_text(pools([{"pfNames": ["eth9"], "isRdma": True}]), encoding="utf-8")
    args = ["device-plugin", "--fake-cards", "1", "--node-name", "n1", "--sysfs", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--rdma-pools", str(config)])
    assert result.exit_code == 2 and "--rdma-pools" in result.output and "PF eth9" in result.output


def typer_app() -> Any:
    import typer

    from gpuplane.cli.device_plugin_cmd import register

    app = typer.Typer()
    register(app)
    return app
