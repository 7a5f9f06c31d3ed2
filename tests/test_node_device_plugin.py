"""The device plugin over real unix-socket gRPC, with a fake kubelet (tests/fake_kubelet.py) on the other end:
registration, ListAndWatch with health changes, Allocate for whole cards, fractions (HAMi-core), MPS and MIG,
refusals, kubelet restarts, a multi-container pod's progress kept on the pod across a plugin restart (a real
child process, SIGKILLed), and the node inventory through a local API server (gpuplane.kube.localapi)."""

from __future__ import annotations

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

from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import (
    ASSIGNED_AT,
    BIND_PHASE,
    INVENTORY,
    PHASE_ALLOCATED,
    PHASE_ALLOCATING,
    QOS_LABEL,
    RES_GPU,
    NodeInventory,
    ObjectError,
    assignment_annotations,
    node_spec,
)
from gpuplane.model import Assignment, CardShare, GpuplaneError, MigMode, QoS, default_catalog
from gpuplane.node.allocation import (
    ALLOCATED_CONTAINERS,
    AllocationSettings,
    BoundPod,
    KubeAssignmentSource,
    MemoryAssignmentSource,
    PendingPod,
    bound_pod,
    match_pod,
    pending_pod,
)
from gpuplane.node.device_plugin import (
    DevicePlugin,
    PluginSettings,
    canonical_model,
    node_inventory,
    publish_inventory,
)
from gpuplane.node.gpu import GIB, CardInfo, FakeGpuBackend

CATALOG = default_catalog()
H100 = CATALOG.get("H100-80GB")
NODE = "gpu-node-1"


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # unix socket paths are limited to 107 bytes: pytest's tmp_path can be longer
    path = Path(tempfile.mkdtemp(prefix="gpdp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(sockdir / "plugins")
    fake.start()
    yield fake
    fake.stop()


def fake_cards(cards: int = 2, **kwargs: Any) -> FakeGpuBackend:
    return FakeGpuBackend(cards, 80 * GIB, name="NVIDIA H100 80GB HBM3", uuid_prefix="h100",
                          numa=[i * 2 // cards for i in range(cards)], **kwargs)


class Harness:
    def __init__(self, kubelet: FakeKubelet, backend: FakeGpuBackend, sockdir: Path, *, split: int = 4,
                 mps: bool = False, source: Any = None) -> None:
        self.kubelet = kubelet
        self.backend = backend
        self.source = source if source is not None else MemoryAssignmentSource()
        self.allocation = AllocationSettings(mps=mps, mps_pipe_dir=str(sockdir / "mps"),
                                             vgpu_dir=str(sockdir / "vgpu"), lock_dir=str(sockdir / "vgpulock"))
        self.plugin = DevicePlugin(PluginSettings(NODE, kubelet.directory, split=split, allocation=self.allocation),
                                   backend, self.source)

    def __enter__(self) -> Harness:
        self.plugin.start()
        self.kubelet.wait_registered()
        return self

    def __exit__(self, *_: object) -> None:
        self.plugin.stop(0)

    def units(self, card: int, count: int) -> list[str]:
        return [f"{self.backend.uuid(card)}::{k}" for k in range(count)]


def pod(name: str, shares: tuple[CardShare, ...], *, at: float = 100.0, qos: QoS = QoS.ONLINE,
        containers: tuple[tuple[str, int], ...] | None = None, oversubscribed: bool = False) -> PendingPod:
    units = len(shares)
    return PendingPod(f"default/{name}", f"uid-{name}", Assignment(NODE, shares, oversubscribed=oversubscribed), at,
                      qos, containers if containers is not None else (("main", units),))


def whole(card: int) -> CardShare:
    return CardShare(card, 1000, 81920, whole=True)


def envs(response: Any, i: int = 0) -> dict[str, str]:
    return dict(response.container_responses[i].envs)


def mounts(response: Any, i: int = 0) -> list[tuple[str, str, bool]]:
    return [(m.container_path, m.host_path, m.read_only) for m in response.container_responses[i].mounts]


def device_nodes(response: Any, i: int = 0) -> list[tuple[str, str, str]]:
    return [(d.container_path, d.host_path, d.permissions) for d in response.container_responses[i].devices]


# -- registration and ListAndWatch ------------------------------------------------------------------------


def test_registers_and_advertises_split_units_per_card_with_numa(kubelet: FakeKubelet, sockdir: Path) -> None:
    with Harness(kubelet, fake_cards(2), sockdir, split=4) as h:
        reg = kubelet.registrations[0]
        assert (reg.version, reg.endpoint, reg.resource_name) == ("v1beta1", "gpuplane.sock", RES_GPU)
        assert (reg.pre_start_required, reg.get_preferred_allocation_available) == (False, False)
        assert len(kubelet.options) == 1 and not kubelet.options[0].pre_start_required
        devices = kubelet.next_list()
        # 2 cards × split 4 = 8 units, card i on NUMA node i * 2 // 2 = i
        assert [d.id for d in devices] == h.units(0, 4) + h.units(1, 4)
        assert {d.numa for d in devices[:4]} == {(0,)} and {d.numa for d in devices[4:]} == {(1,)}
        assert kubelet.allocatable == 8
        assert all(len(d.id) <= 63 for d in devices)


def test_the_fake_kubelet_refuses_another_api_version(kubelet: FakeKubelet) -> None:
    with pytest.raises(grpc.RpcError) as info:
        kubelet.register_raw("v1alpha1", "gpuplane.sock", RES_GPU)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert kubelet.refused == ["v1alpha1"] and kubelet.registrations == []


def test_health_changes_are_pushed_and_recover(kubelet: FakeKubelet, sockdir: Path) -> None:
    backend = fake_cards(2)
    with Harness(kubelet, backend, sockdir, split=3) as h:
        first = kubelet.next_list()
        assert kubelet.allocatable == len(first) == 6
        backend.fail_next(1)  # the backend cannot read the cards: every card turns Unhealthy
        h.plugin.tick()
        assert {d.health for d in kubelet.next_list()} == {"Unhealthy"} and kubelet.allocatable == 0
        h.plugin.tick()  # the reading works again: all Healthy
        assert {d.health for d in kubelet.next_list()} == {"Healthy"} and kubelet.allocatable == 6
        backend.set_xid(1, 79)  # fallen off the bus: critical, card 1 only
        h.plugin.tick()
        listed = kubelet.next_list()
        assert [d.health for d in listed] == ["Healthy"] * 3 + ["Unhealthy"] * 3 and kubelet.allocatable == 3
        backend.set_xid(1, 13)  # a graphics-engine exception is the application's fault, not the card's
        h.plugin.tick()
        assert {d.health for d in kubelet.next_list()} == {"Healthy"}
        h.plugin.tick()  # nothing changed: nothing is sent
        assert kubelet.lists.empty()


# -- Allocate ----------------------------------------------------------------------------------------------


def test_allocate_whole_cards(kubelet: FakeKubelet, sockdir: Path) -> None:
    backend = fake_cards(4)
    job = pod("train", (whole(1), whole(2)))
    with Harness(kubelet, backend, sockdir, source=MemoryAssignmentSource([job])) as h:
        # kubelet picked two units of card 0; the container gets what the scheduler assigned: cards 1 and 2
        response = kubelet.allocate([h.units(0, 2)])
        assert envs(response) == {"NVIDIA_VISIBLE_DEVICES": "GPU-h100-1,GPU-h100-2"}
        assert mounts(response) == []
        assert device_nodes(response) == [("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
                                          ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),
                                          ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools", "rw"),
                                          ("/dev/nvidia1", "/dev/nvidia1", "rw"),
                                          ("/dev/nvidia2", "/dev/nvidia2", "rw")]
        assert dict(response.container_responses[0].annotations) == {"gpuplane.io/pod": "default/train"}
        assert h.source.allocated == [job] and h.source.pods == []


def test_allocate_a_fraction_hands_out_hami_core_limits(kubelet: FakeKubelet, sockdir: Path) -> None:
    # 300 milli-cards = 30 % of the SMs; 20 GiB = 20480 MiB on card 1; offline and oversold
    batch = pod("batch", (CardShare(1, 300, 20480),), qos=QoS.OFFLINE, oversubscribed=True)
    web = pod("web", (CardShare(0, 250, 8192),), at=200.0)
    with Harness(kubelet, fake_cards(2), sockdir, source=MemoryAssignmentSource([web, batch])) as h:
        response = kubelet.allocate([h.units(0, 1)])  # batch is older (assigned at 100 < 200)
        cache = f"{h.allocation.vgpu_dir}/containers/uid-batch_main"
        assert envs(response) == {
            "NVIDIA_VISIBLE_DEVICES": "GPU-h100-1",
            "CUDA_DEVICE_MEMORY_LIMIT_0": "20480m",
            "CUDA_DEVICE_SM_LIMIT": "30",
            "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"{cache}/vgpu.cache",
            "CUDA_OVERSUBSCRIBE": "true",
            "CUDA_TASK_PRIORITY": "1",
        }
        vgpu = h.allocation.vgpu_dir
        assert mounts(response) == [("/usr/local/vgpu/libvgpu.so", f"{vgpu}/libvgpu.so", True),
                                    ("/etc/ld.so.preload", f"{vgpu}/ld.so.preload", True),
                                    (cache, cache, False), (h.allocation.lock_dir, h.allocation.lock_dir, False)]
        assert Path(cache).is_dir()  # the shared region's directory exists on the host before the container
        assert ("/dev/nvidia1", "/dev/nvidia1", "rw") in device_nodes(response)

        second = envs(kubelet.allocate([h.units(1, 1)]))
        # 250 milli = 25 %; 8192 MiB; online → priority 0; not oversold → no CUDA_OVERSUBSCRIBE
        assert (second["NVIDIA_VISIBLE_DEVICES"], second["CUDA_DEVICE_MEMORY_LIMIT_0"],
                second["CUDA_DEVICE_SM_LIMIT"], second["CUDA_TASK_PRIORITY"]) == ("GPU-h100-0", "8192m", "25", "0")
        assert "CUDA_OVERSUBSCRIBE" not in second
        assert [p.key for p in h.source.allocated] == ["default/batch", "default/web"]


def test_allocate_in_mps_mode_hands_out_mps_client_variables(kubelet: FakeKubelet, sockdir: Path) -> None:
    # 250 milli = 25 % active threads; 10 GiB pinned = 10240 MiB on the container's device 0
    share = pod("infer", (CardShare(1, 250, 10240),))
    exclusive = pod("solo", (whole(0),), at=300.0)
    with Harness(kubelet, fake_cards(2), sockdir, mps=True, source=MemoryAssignmentSource([share, exclusive])) as h:
        pipe = h.allocation.mps_pipe_dir
        response = kubelet.allocate([h.units(1, 1)])
        assert envs(response) == {"NVIDIA_VISIBLE_DEVICES": "GPU-h100-1", "CUDA_MPS_PIPE_DIRECTORY": pipe,
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                                  "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M"}
        assert mounts(response) == [(pipe, pipe, False), ("/dev/shm", "/dev/shm", False)]
        # a whole card under MPS still talks to the daemon, without limits
        assert envs(kubelet.allocate([h.units(0, 1)])) == {"NVIDIA_VISIBLE_DEVICES": "GPU-h100-0",
                                                            "CUDA_MPS_PIPE_DIRECTORY": pipe}


def test_allocate_mig_creates_the_assigned_instance_and_hands_its_uuid(kubelet: FakeKubelet, sockdir: Path) -> None:
    backend = fake_cards(1, mig_model=H100)
    # 3g.40gb = profile 9 at memory slices [4, 8): 3 of 7 compute slices = 3000 // 7 = 428 milli
    big = pod("mig-big", (CardShare(0, 428, 40448, mig_profile=9, mig_start=4),))
    # 2g.20gb = profile 14 at [0, 2)
    small = pod("mig-small", (CardShare(0, 285, 20091, mig_profile=14, mig_start=0),), at=150.0)
    # 4g.40gb = profile 5 at [0, 4): overlaps both
    clash = pod("mig-clash", (CardShare(0, 571, 40448, mig_profile=5, mig_start=0),), at=200.0)
    with Harness(kubelet, backend, sockdir, source=MemoryAssignmentSource([big, small, clash])) as h:
        first = envs(kubelet.allocate([h.units(0, 1)]))
        assert first == {"NVIDIA_VISIBLE_DEVICES": "MIG-h100-0-1"}  # no HAMi-core: MIG isolates
        assert envs(kubelet.allocate([h.units(0, 1)])) == {"NVIDIA_VISIBLE_DEVICES": "MIG-h100-0-2"}
        assert [(m.profile_id, m.start, m.size) for m in backend.mig_instances(0)] == [(14, 0, 2), (9, 4, 4)]
        with pytest.raises(grpc.RpcError) as info:
            kubelet.allocate([h.units(0, 1)])
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "no legal layout" in str(info.value.details())
        assert [p.key for p in h.source.pods] == ["default/mig-clash"]


def test_allocate_an_existing_mig_instance_is_reused(kubelet: FakeKubelet, sockdir: Path) -> None:
    backend = fake_cards(1, mig_model=H100, mig_enabled=True)
    existing = backend.create_mig_instance(0, 0, 0)  # 7g.80gb
    with Harness(kubelet, backend, sockdir,
                 source=MemoryAssignmentSource([pod("all", (CardShare(0, 1000, 81152, mig_profile=0, mig_start=0),))])
                 ) as h:
        assert envs(kubelet.allocate([h.units(0, 1)]))["NVIDIA_VISIBLE_DEVICES"] == existing.uuid
        assert backend.mig_instances(0) == [existing]


def test_one_response_per_container_in_order_and_multi_container_pods(kubelet: FakeKubelet, sockdir: Path) -> None:
    # one pod, two GPU containers of 1 unit each, two whole cards: each container gets its own card, in spec order
    duo = pod("duo", (whole(2), whole(3)), containers=(("a", 1), ("b", 1)))
    with Harness(kubelet, fake_cards(4), sockdir, source=MemoryAssignmentSource([duo])) as h:
        response = kubelet.allocate([h.units(0, 1), h.units(1, 1)])
        assert [envs(response, i)["NVIDIA_VISIBLE_DEVICES"] for i in range(2)] == ["GPU-h100-2", "GPU-h100-3"]
        assert [p.key for p in h.source.allocated] == ["default/duo"]


def test_refusals_fail_the_rpc_and_push_a_fresh_list(kubelet: FakeKubelet, sockdir: Path) -> None:
    backend = fake_cards(2)
    with Harness(kubelet, backend, sockdir, split=2) as h:
        kubelet.next_list()
        with pytest.raises(grpc.RpcError) as info:
            kubelet.allocate([h.units(0, 1)])  # no pod waits
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "no pod on node gpu-node-1 is waiting" in str(info.value.details())
        assert len(kubelet.next_list()) == 4  # pushed after the failure

        h.source.add(pod("late", (whole(0),)))
        for bad in ("GPU-nope::0", f"{backend.uuid(0)}::2", "no-separator"):  # unknown card, k ≥ split, garbage
            with pytest.raises(grpc.RpcError) as info:
                kubelet.allocate([[bad]])
            assert info.value.code() is grpc.StatusCode.NOT_FOUND, bad
            kubelet.next_list()

        backend.set_xid(0, 48)  # double-bit ECC: card 0 Unhealthy
        h.plugin.tick()
        kubelet.drain()
        with pytest.raises(grpc.RpcError) as info:
            kubelet.allocate([h.units(0, 1)])
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "Unhealthy" in str(info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            kubelet.allocate([h.units(1, 1)])  # a healthy unit, but the pod's assigned card 0 is not
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "card 0" in str(info.value.details())
        assert [p.key for p in h.source.pods] == ["default/late"]


def test_kubelet_restart_re_registers_and_serves_again(kubelet: FakeKubelet, sockdir: Path) -> None:
    source = MemoryAssignmentSource([pod("after", (whole(1),))])
    with Harness(kubelet, fake_cards(2), sockdir, source=source) as h:
        h.plugin.tick()
        assert h.plugin.registrations == 1  # nothing changed: no second registration
        kubelet.restart()  # wipes the directory (our socket too), new kubelet.sock
        assert not h.plugin.socket_path.exists()
        h.plugin.tick()
        assert kubelet.wait_registered(2).endpoint == "gpuplane.sock" and h.plugin.registrations == 2
        assert h.plugin.socket_path.exists()
        assert len(kubelet.drain()) == 8
        assert envs(kubelet.allocate([h.units(0, 1)]))["NVIDIA_VISIBLE_DEVICES"] == "GPU-h100-1"

        # kubelet.sock recreated while our socket survives: register again, same server
        served = h.plugin.socket_path.stat().st_ino
        kubelet.stop()
        kubelet.start()
        h.plugin.tick()
        kubelet.wait_registered(3)
        assert h.plugin.socket_path.stat().st_ino == served


def test_no_kubelet_yet_registers_once_it_appears(sockdir: Path) -> None:
    kubelet = FakeKubelet(sockdir / "late")
    plugin = DevicePlugin(PluginSettings(NODE, kubelet.directory), fake_cards(1), MemoryAssignmentSource())
    plugin.start()
    try:
        assert plugin.registrations == 0
        kubelet.start()
        plugin.tick()
        kubelet.wait_registered()
        assert plugin.registrations == 1
    finally:
        plugin.stop(0)
        kubelet.stop()


# -- matching (pure) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("units", "handed", "expected"), [
    (1, {}, ("default/old", 0, (1,))),  # oldest first among one-card pods (assigned at 10 < 20)
    (2, {}, ("default/pair", 0, (2, 3))),  # only the two-card pod asks for 2
    (1, {"uid-old": 1}, ("default/young", 0, (0,))),  # old handed its only container already
    (3, {}, None),  # nobody asks for 3
])
def test_match_pod(units: int, handed: dict[str, int], expected: tuple[str, int, tuple[int, ...]] | None) -> None:
    pending = [pod("young", (whole(0),), at=20.0), pod("old", (whole(1),), at=10.0),
               pod("pair", (whole(2), whole(3)), at=5.0)]
    match = match_pod(pending, units, handed)
    got = None if match is None else (match[0].key, match[1], tuple(s.card for s in match[2]))
    assert got == expected


# -- through the API server ----------------------------------------------------------------------------------


def pod_json(name: str, node: str, shares: tuple[CardShare, ...], *, phase: str = PHASE_ALLOCATING,
             at: float = 100.0, gpus: int = 1) -> dict[str, Any]:
    annotations = assignment_annotations(Assignment(node, shares), at)
    annotations[BIND_PHASE] = phase
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "annotations": annotations,
                         "labels": {QOS_LABEL: "offline"}},
            "spec": {"nodeName": node, "containers": [
                {"name": "side", "image": "busybox"},
                {"name": "main", "image": "cuda", "resources": {"limits": {RES_GPU: str(gpus)}}}]},
            "status": {"phase": "Pending"}}


def test_allocate_through_the_api_marks_the_pod_allocated(kubelet: FakeKubelet, sockdir: Path) -> None:
    with FakeApiServer() as server:
        server.add_pod(pod_json("done", NODE, (CardShare(1, 500, 4096),), phase=PHASE_ALLOCATED, at=1.0))
        server.add_pod(pod_json("elsewhere", "other-node", (CardShare(1, 500, 4096),), at=2.0))
        server.add_pod(pod_json("job", NODE, (CardShare(1, 500, 4096),), at=3.0))
        selectors: list[str | None] = []
        api = server.api
        real_list = api.list

        def recording_list(path: str, **kwargs: Any) -> Any:
            selectors.append(kwargs.get("field_selector"))
            return real_list(path, **kwargs)

        api.list = recording_list
        source = KubeAssignmentSource(api, NODE)
        assert [p.key for p in source.pending()] == ["ml/job"]
        with Harness(kubelet, fake_cards(2), sockdir, source=source) as h:
            got = envs(kubelet.allocate([h.units(0, 1)]))
            assert (got["NVIDIA_VISIBLE_DEVICES"], got["CUDA_DEVICE_SM_LIMIT"], got["CUDA_TASK_PRIORITY"]) == \
                ("GPU-h100-1", "50", "1")
            assert got["CUDA_DEVICE_MEMORY_SHARED_CACHE"].endswith("/containers/uid-job_main/vgpu.cache")
        stored = server.get("pods", "ml/job")
        assert stored is not None and stored["metadata"]["annotations"][BIND_PHASE] == PHASE_ALLOCATED
        assert source.pending() == []
        assert set(selectors) == {f"spec.nodeName={NODE}"}


def test_pending_pod_reads_containers_and_skips_other_phases() -> None:
    raw = pod_json("p", NODE, (whole(0), whole(1)), gpus=2)
    got = pending_pod(raw, NODE)
    assert got is not None and got.containers == (("main", 2),) and got.qos is QoS.OFFLINE
    assert got.assigned_at == 100.0 and got.assignment.card_indexes == (0, 1)
    assert pending_pod(raw, "other") is None
    assert pending_pod(pod_json("q", NODE, (whole(0),), phase=PHASE_ALLOCATED), NODE) is None


# -- the inventory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "gib", "expected"), [
    ("NVIDIA H100 80GB HBM3", 80, "H100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 40, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 80, "A100-80GB"),  # two A100 models: the closer in memory
    ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
    ("NVIDIA L40S", 45, "L40S"),  # not L4: whole words only
    ("NVIDIA L4", 22, "L4"),
    ("NVIDIA H200", 141, "H200-141GB"),
    ("Tesla T4", 15, "T4"),
])
def test_canonical_model(name: str, gib: int, expected: str) -> None:
    assert canonical_model(name, gib * GIB, CATALOG) == expected


def test_inventory_round_trips_through_the_node_annotation() -> None:
    backend = FakeGpuBackend(4, 80 * GIB, name="NVIDIA H100 80GB HBM3", numa=[0, 0, 1, 1],
                             nvlink_groups=[(0, 1), (2, 3)], mig_model=H100)
    inventory = node_inventory(backend.describe(), CATALOG, split=7)
    assert inventory.model == "H100-80GB" and inventory.split == 7 and inventory.mig_mode is MigMode.DYNAMIC
    assert inventory.nvlink_groups == ((0, 1), (2, 3))
    assert [(c.index, c.uuid, c.numa) for c in inventory.cards] == [(i, f"GPU-fake-{i}", i // 2) for i in range(4)]
    with FakeApiServer() as server:
        server.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                         "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}}})
        publish_inventory(server.api, NODE, inventory)
        node = server.get("nodes", NODE)
        assert node is not None
        assert NodeInventory.decode(node["metadata"]["annotations"][INVENTORY]) == inventory
        spec = node_spec(node, CATALOG)
        assert (spec.gpu_model, spec.gpus, spec.topology.numa) == ("H100-80GB", 4, (0, 0, 1, 1))


def test_a_node_of_mixed_models_has_no_model_no_inventory_and_no_mig(kubelet: FakeKubelet, sockdir: Path) -> None:
    """Every card counts, not card 0 alone: an A100 40 GB next to an 80 GB one is no node model."""
    a100 = CATALOG.get("A100-40GB")
    backend = FakeGpuBackend(2, [40 * GIB, 80 * GIB], name="NVIDIA A100-SXM4", mig_model=a100)
    share = CardShare(1, 428, 20480, mig_profile=9, mig_start=4)  # 3g.20gb at [4, 8) of card 1
    published: list[NodeInventory] = []
    h = Harness(kubelet, backend, sockdir, source=MemoryAssignmentSource([pod("mig", (share,))]))
    h.plugin = DevicePlugin(PluginSettings(NODE, kubelet.directory, split=4, allocation=h.allocation), backend,
                            h.source, publish=published.append)
    with h:
        assert h.plugin.model is None and published == []
        with pytest.raises(grpc.RpcError) as info:
            kubelet.allocate([h.units(1, 1)])
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "one model per node, found A100-40GB, A100-80GB" in str(info.value.details())
        assert backend.mig_instances(1) == []


def test_the_plugin_publishes_the_inventory_at_start_and_retries_until_it_lands(kubelet: FakeKubelet,
                                                                              sockdir: Path) -> None:
    published: list[NodeInventory] = []
    failures = [RuntimeError("API server away")]

    def publish(inventory: NodeInventory) -> None:
        if failures:
            raise failures.pop()
        published.append(inventory)

    plugin = DevicePlugin(PluginSettings(NODE, kubelet.directory, split=5), fake_cards(2, mig_model=H100),
                          MemoryAssignmentSource(), publish=publish)
    plugin.start()  # the first attempt fails: logged, not fatal
    try:
        kubelet.wait_registered()
        assert published == [] and failures == []
        plugin.tick()  # tried again
        assert [(i.model, i.split, [c.uuid for c in i.cards]) for i in published] == \
            [("H100-80GB", 5, ["GPU-h100-0", "GPU-h100-1"])]
        plugin.tick()  # unchanged: not written again
        assert len(published) == 1
    finally:
        plugin.stop(0)


def test_card_info_defaults_describe_an_unknown_place() -> None:
    info = CardInfo(0, "GPU-x", "NVIDIA A10", 23 * GIB)
    assert (info.minor, info.numa, info.nvlink_peers, info.mig_enabled) == (None, None, (), None)


# -- the command ---------------------------------------------------------------------------------------------


def test_device_plugin_command_serves_fake_cards_until_sigterm(kubelet: FakeKubelet) -> None:
    script = ("import typer; from gpuplane.cli.device_plugin_cmd import register; app = typer.Typer(); "
              "register(app); app()")
    env = {**os.environ, "NODE_NAME": NODE, "KUBECONFIG": "/nonexistent/kubeconfig",
           "KUBERNETES_SERVICE_HOST": ""}
    proc = subprocess.Popen([sys.executable, "-c", script, "device-plugin", "--dir", str(kubelet.directory),
                             "--fake-cards", "2", "--split", "3", "--interval", "0.2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        registration = kubelet.wait_registered()
        assert registration.resource_name == RES_GPU
        assert len(kubelet.next_list()) == 6  # 2 fake cards × split 3
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, stderr
    assert "2 cards × 3 units" in stderr


def test_device_plugin_command_rejects_bad_flags() -> None:
    import typer
    from typer.testing import CliRunner

    from gpuplane.cli.device_plugin_cmd import register

    app = typer.Typer()
    register(app)
    runner = CliRunner()
    result = runner.invoke(app, ["device-plugin", "--fake-cards", "1", "--node-name", "n", "--mig-grace", "-1"])
    assert result.exit_code == 2 and "--mig-grace" in result.output
    result = runner.invoke(app, ["device-plugin", "--fake-cards", "1", "--split", "0", "--node-name", "n"])
    assert result.exit_code == 2 and "--split" in result.output
    result = runner.invoke(app, ["device-plugin", "--fake-cards", "1"], env={"NODE_NAME": ""})
    assert result.exit_code == 2 and "--node-name" in result.output
    result = runner.invoke(app, ["device-plugin", "--fake-cards", "1", "--node-name", "n", "--mig-mode", "half"])
    assert result.exit_code == 2 and "--mig-mode" in result.output


# -- a multi-container pod's progress lives on the pod -------------------------------------------------------


def duo_json(name: str = "duo", *, handed: str | None = None) -> dict[str, Any]:
    """Two GPU containers of one unit each (and a sidecar without GPUs), assigned whole cards 2 and 3."""
    raw = pod_json(name, NODE, (whole(2), whole(3)))
    raw["spec"]["containers"] = [{"name": "a", "image": "cuda", "resources": {"limits": {RES_GPU: "1"}}},
                                 {"name": "side", "image": "busybox"},
                                 {"name": "b", "image": "cuda", "resources": {"limits": {RES_GPU: "1"}}}]
    if handed is not None:
        raw["metadata"]["annotations"][ALLOCATED_CONTAINERS] = handed
    return raw


def annotations(server: FakeApiServer, key: str) -> dict[str, str]:
    stored = server.get("pods", key)
    assert stored is not None
    return dict(stored["metadata"]["annotations"])


def test_progress_is_recorded_on_the_pod_and_the_phase_turns_allocated_with_the_last_container(
        kubelet: FakeKubelet, sockdir: Path) -> None:
    with FakeApiServer() as server, \
            Harness(kubelet, fake_cards(4), sockdir, source=KubeAssignmentSource(server.api, NODE)) as h:
        server.add_pod(duo_json())
        assert envs(kubelet.allocate([h.units(0, 1)]))["NVIDIA_VISIBLE_DEVICES"] == "GPU-h100-2"
        notes = annotations(server, "ml/duo")
        assert (notes[ALLOCATED_CONTAINERS], notes[BIND_PHASE]) == ("1", PHASE_ALLOCATING)
        assert envs(kubelet.allocate([h.units(0, 1)]))["NVIDIA_VISIBLE_DEVICES"] == "GPU-h100-3"
        notes = annotations(server, "ml/duo")
        assert (notes[ALLOCATED_CONTAINERS], notes[BIND_PHASE]) == ("2", PHASE_ALLOCATED)
        with pytest.raises(grpc.RpcError) as info:  # nothing waits any more
            kubelet.allocate([h.units(0, 1)])
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_progress_not_recorded_fails_the_rpc_and_the_retry_gets_the_same_container(kubelet: FakeKubelet,
                                                                                  sockdir: Path) -> None:
    with FakeApiServer() as server, \
            Harness(kubelet, fake_cards(4), sockdir, source=KubeAssignmentSource(server.api, NODE)) as h:
        server.add_pod(duo_json())
        server.fail_next("PATCH", r"/pods/duo$", 500, "InternalError")
        with pytest.raises(grpc.RpcError) as info:
            kubelet.allocate([h.units(0, 1)])
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE and ALLOCATED_CONTAINERS in str(info.value.details())
        assert ALLOCATED_CONTAINERS not in annotations(server, "ml/duo")
        # kubelet retries the first container: it gets the first share again, not the second
        assert envs(kubelet.allocate([h.units(0, 1)]))["NVIDIA_VISIBLE_DEVICES"] == "GPU-h100-2"


def test_a_restarted_plugin_resumes_a_multi_container_pod_from_the_pod(kubelet: FakeKubelet, sockdir: Path) -> None:
    """The plugin is a real process, killed (SIGKILL: nothing is flushed) between the pod's two containers."""
    with FakeApiServer() as server:
        server.add_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        server.add_pod(duo_json())
        kubeconfig = server.write_kubeconfig(sockdir / "kubeconfig")
        script = ("import typer; from gpuplane.cli.device_plugin_cmd import register; app = typer.Typer(); "
                  "register(app); app()")
        env = {**os.environ, "NODE_NAME": NODE, "KUBERNETES_SERVICE_HOST": ""}
        args = [sys.executable, "-c", script, "device-plugin", "--dir", str(kubelet.directory), "--fake-cards", "4",
                "--split", "2", "--kubeconfig", str(kubeconfig), "--interval", "0.2"]
        given: list[str] = []
        for run in (1, 2):
            proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                kubelet.wait_registered(run)
                given.append(envs(kubelet.allocate([["GPU-fake-0::0"]]))["NVIDIA_VISIBLE_DEVICES"])
            finally:
                proc.kill()
                _, stderr = proc.communicate(timeout=WAIT_S)
            notes = annotations(server, "ml/duo")
            assert notes[ALLOCATED_CONTAINERS] == str(run), stderr
        # kubelet asked for one unit of card 0 twice; the pod's containers got its cards 2 then 3, in spec order
        assert given == ["GPU-fake-2", "GPU-fake-3"]
        assert annotations(server, "ml/duo")[BIND_PHASE] == PHASE_ALLOCATED


@pytest.mark.parametrize(("handed", "expected"), [
    (None, 0),  # no annotation: no container has its cards yet
    ("1", 1),
    ("2", 2),  # all of them (the bind phase would say allocated; the count alone does not match any more)
])
def test_pending_pod_reads_the_progress(handed: str | None, expected: int) -> None:
    got = pending_pod(duo_json(handed=handed), NODE)
    assert got is not None and got.containers == (("a", 1), ("b", 1)) and got.handed == expected
    match = match_pod([got], 1)
    # the next container's card: card 2 for container 0, card 3 for container 1, nothing after both
    assert (None if match is None else (match[1], match[2][0].card)) == {0: (0, 2), 1: (1, 3), 2: None}[expected]


@pytest.mark.parametrize("handed", ["-1", "one", "²", "", pytest.param("1" * 5000, id="past-int-digit-limit")])
def test_an_unreadable_progress_is_named_and_the_pod_skipped(handed: str) -> None:
    with pytest.raises(GpuplaneError, match=f"annotations\\[{ALLOCATED_CONTAINERS}\\]"):
        pending_pod(duo_json(handed=handed), NODE)
    with FakeApiServer() as server:
        server.add_pod(duo_json(handed=handed))
        server.add_pod(pod_json("fine", NODE, (whole(0),)))
        assert [p.key for p in KubeAssignmentSource(server.api, NODE).pending()] == ["ml/fine"]


def _set(*path: str | int, value: Any) -> Any:
    """A change to `duo_json`: `value` at `path` (keys and list indexes)."""
    def change(raw: dict[str, Any]) -> None:
        target: Any = raw
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    return change


@pytest.mark.parametrize(("change", "field"), [
    # an unknown QoS label was read as online (CUDA_TASK_PRIORITY=0) before
    (_set("metadata", "labels", QOS_LABEL, value="urgent"), f"metadata.labels[{QOS_LABEL}]"),
    # an unreadable stamp was ordered last (infinity) before
    (_set("metadata", "annotations", ASSIGNED_AT, value="yesterday"), f"metadata.annotations[{ASSIGNED_AT}]"),
    # 1.5 units were truncated to 1 before
    (_set("spec", "containers", 2, "resources", "limits", RES_GPU, value="1.5"),
     f"spec.containers[2].resources[{RES_GPU}]"),
    (_set("spec", "containers", 2, "resources", "limits", RES_GPU, value="-1"),
     f"spec.containers[2].resources[{RES_GPU}]"),
    (_set("spec", "containers", 1, value="busybox"), "spec.containers"),  # a container that is no object was skipped
    (_set("spec", "containers", 2, "resources", "limits", value=[RES_GPU]), "spec.containers[2].resources.limits"),
])
def test_an_unreadable_pod_waiting_for_devices_is_named_and_skipped(change: Any, field: str) -> None:
    raw = duo_json()
    change(raw)
    with pytest.raises(ObjectError) as caught:
        pending_pod(raw, NODE)
    assert (caught.value.obj, caught.value.field) == ("ml/duo", field)
    with FakeApiServer() as server:
        server.add_pod(raw)
        server.add_pod(pod_json("fine", NODE, (whole(0),)))
        assert [p.key for p in KubeAssignmentSource(server.api, NODE).pending()] == ["ml/fine"]


@pytest.mark.parametrize(("status", "deleting", "waits"), [
    ("Pending", False, True),  # bound, its containers not started: the kubelet is about to call Allocate
    ("Unknown", False, True),  # the node lost contact: still bound here
    ("Running", True, False),  # terminating
    ("Succeeded", False, False),  # finished: no container will start
    ("Failed", False, False),
])
def test_pending_pod_follows_the_pods_phase(status: str, deleting: bool, waits: bool) -> None:
    got = pending_pod(with_status(duo_json(), status, terminating=deleting), NODE)
    assert (got is not None) is waits


@pytest.mark.parametrize(("stamp", "assigned_at"), [
    ("100.5", 100.5),  # what the scheduler writes
    ("1970-01-01T00:02:00Z", 120.0),  # RFC 3339
    (None, float("inf")),  # none: after every stamped pod
])
def test_pending_pod_reads_the_assignment_stamp(stamp: str | None, assigned_at: float) -> None:
    raw = duo_json()
    if stamp is None:
        del raw["metadata"]["annotations"][ASSIGNED_AT]
    else:
        raw["metadata"]["annotations"][ASSIGNED_AT] = stamp
    got = pending_pod(raw, NODE)
    assert got is not None and got.assigned_at == assigned_at


def test_the_memory_source_keeps_progress_across_plugins(kubelet: FakeKubelet, sockdir: Path) -> None:
    source = MemoryAssignmentSource([pod("duo", (whole(2), whole(3)), containers=(("a", 1), ("b", 1)))])
    with Harness(kubelet, fake_cards(4), sockdir, source=source) as h:
        assert envs(kubelet.allocate([h.units(0, 1)]))["NVIDIA_VISIBLE_DEVICES"] == "GPU-h100-2"
    assert [p.handed for p in source.pods] == [1] and source.allocated == []
    with Harness(kubelet, fake_cards(4), sockdir, source=source) as h:
        kubelet.wait_registered(2)
        assert envs(kubelet.allocate([h.units(1, 1)]))["NVIDIA_VISIBLE_DEVICES"] == "GPU-h100-3"
    assert source.pods == [] and [p.key for p in source.allocated] == ["default/duo"]


# -- which pods hold cards (for the MIG reconcile) -------------------------------------------------------------


def with_status(raw: dict[str, Any], phase: str, *, terminating: bool = False) -> dict[str, Any]:
    raw["status"] = {"phase": phase}
    if terminating:
        raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return raw


@pytest.mark.parametrize(("raw", "holds"), [
    (with_status(pod_json("p", NODE, (whole(0),)), "Pending"), True),  # allocating
    (with_status(pod_json("p", NODE, (whole(0),), phase=PHASE_ALLOCATED), "Running"), True),
    (with_status(pod_json("p", NODE, (whole(0),), phase=PHASE_ALLOCATED), "Running", terminating=True),
     True),  # still running its containers
    (with_status(pod_json("p", NODE, (whole(0),), phase=PHASE_ALLOCATED), "Succeeded"), False),
    (with_status(pod_json("p", NODE, (whole(0),), phase=PHASE_ALLOCATED), "Failed"), False),
    # finished but not yet gone: terminating wins (`pod_phase`), so it holds its cards until it is deleted
    (with_status(pod_json("p", NODE, (whole(0),), phase=PHASE_ALLOCATED), "Succeeded", terminating=True), True),
    (with_status(pod_json("p", "other-node", (whole(0),)), "Running"), False),
])
def test_bound_pod(raw: dict[str, Any], holds: bool) -> None:
    got = bound_pod(raw, NODE)
    assert (got is not None) is holds
    if got is not None:
        assert got == BoundPod("ml/p", Assignment(NODE, (whole(0),)))


def test_holders_through_the_api_refuse_to_guess() -> None:
    with FakeApiServer() as server:
        server.add_pod(with_status(pod_json("run", NODE, (whole(0),), phase=PHASE_ALLOCATED), "Running"))
        server.add_pod(with_status(pod_json("done", NODE, (whole(1),), phase=PHASE_ALLOCATED), "Succeeded"))
        source = KubeAssignmentSource(server.api, NODE)
        assert [h.key for h in source.holders()] == ["ml/run"]
        server.fail_next("GET", r"^/api/v1/pods$", 500, "InternalError")
        with pytest.raises(GpuplaneError, match="cannot list the pods"):
            source.holders()
        broken = pod_json("broken", NODE, (whole(2),))
        broken["metadata"]["annotations"]["gpuplane.io/assignment"] = "{not json"
        server.add_pod(broken)
        with pytest.raises(GpuplaneError, match="ml/broken"):  # what it holds is unknown: no answer at all
            source.holders()


# -- who may write the progress (the admission webhook; not this module's code) --------------------------------

NODE_AGENT = "system:serviceaccount:gpuplane-system:gpuplane-node-agent"


def admission(operation: str, new: dict[str, Any], old: dict[str, Any] | None, user: str) -> bool:
    from gpuplane.kube.webhook import AdmissionPolicy

    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "namespace": "ml",
        "operation": operation, "object": new, "oldObject": old, "userInfo": {"username": user}}}
    return bool(AdmissionPolicy().review(body)["response"]["allowed"])


def test_the_node_agent_may_record_progress() -> None:
    old = duo_json()
    assert admission("UPDATE", duo_json(handed="1"), old, NODE_AGENT)
    done = duo_json(handed="2")
    done["metadata"]["annotations"][BIND_PHASE] = PHASE_ALLOCATED
    assert admission("UPDATE", done, old, NODE_AGENT)


def test_a_user_cannot_forge_progress_on_create() -> None:
    raw = duo_json(handed="1")
    for note in ("gpuplane.io/assignment", "gpuplane.io/assigned-at", BIND_PHASE):
        del raw["metadata"]["annotations"][note]
    del raw["spec"]["nodeName"]
    assert not admission("CREATE", raw, None, "alice@example.com")


def test_a_user_cannot_change_progress() -> None:
    assert not admission("UPDATE", duo_json(handed="1"), duo_json(), "alice@example.com")
