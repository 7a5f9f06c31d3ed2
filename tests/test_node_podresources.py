"""Cards held by other GPU stacks: the PodResources API (our proto against the upstream facts, a client over real
unix-socket gRPC against a fake kubelet), device IDs mapped to cards, the node annotation published once per change,
the codec reading it (and the safety net without it), and ClusterState counting those cards fully taken."""

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

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import given
from hypothesis import strategies as st

from builders import CATALOG, cluster, framework, node, pod
from fake_kubelet import WAIT_S, FakeKubelet
from fake_podresources import Claim, Container, FakePodResources, Pod
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.foreign import FOREIGN_CARDS, ForeignHold, ForeignReport, UnmappedDevice
from gpuplane.kube.localapi import FakeApiServer, node_json
from gpuplane.kube.objects import ObjectError, node_spec
from gpuplane.model import Assignment, CardShare, MigMode, NodeSpecError, PodRequest, WholeCards
from gpuplane.node.gpu import FakeGpuBackend
from gpuplane.node.podresources import (
    CardIds,
    ForeignCardsReporter,
    HeldDevices,
    PodResourcesClient,
    foreign_report,
    protocol,
)
from gpuplane.port import WallClock
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry
from test_properties import SETTINGS

# ---------------------------------------------------------------------------- the proto against upstream

# Facts of kubernetes/kubernetes staging/src/k8s.io/kubelet/pkg/apis/podresources/v1/api.proto (read at
# 95f08499d652): package, service methods, and per message (field, number, type, repeated). DynamicResource's
# field 1 (class_name) is a tombstone since 1.31.
UPSTREAM_PACKAGE = "v1"
UPSTREAM_METHODS = {
    "List": ("ListPodResourcesRequest", "ListPodResourcesResponse"),
    "GetAllocatableResources": ("AllocatableResourcesRequest", "AllocatableResourcesResponse"),
    "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse"),
}
S, I64, U64 = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64
M = FieldDescriptor.TYPE_MESSAGE
UPSTREAM_MESSAGES: dict[str, list[tuple[str, int, int, str | None, bool]]] = {
    # message: [(field, number, type, message type, repeated)]
    "AllocatableResourcesRequest": [],
    "AllocatableResourcesResponse": [("devices", 1, M, "ContainerDevices", True), ("cpu_ids", 2, I64, None, True),
                                     ("memory", 3, M, "ContainerMemory", True)],
    "ListPodResourcesRequest": [],
    "ListPodResourcesResponse": [("pod_resources", 1, M, "PodResources", True)],
    "PodResources": [("name", 1, S, None, False), ("namespace", 2, S, None, False),
                     ("containers", 3, M, "ContainerResources", True)],
    "ContainerResources": [("name", 1, S, None, False), ("devices", 2, M, "ContainerDevices", True),
                           ("cpu_ids", 3, I64, None, True), ("memory", 4, M, "ContainerMemory", True),
                           ("dynamic_resources", 5, M, "DynamicResource", True)],
    "ContainerMemory": [("memory_type", 1, S, None, False), ("size", 2, U64, None, False),
                        ("topology", 3, M, "TopologyInfo", False)],
    "ContainerDevices": [("resource_name", 1, S, None, False), ("device_ids", 2, S, None, True),
                         ("topology", 3, M, "TopologyInfo", False)],
    "TopologyInfo": [("nodes", 1, M, "NUMANode", True)],
    "NUMANode": [("ID", 1, I64, None, False)],
    "DynamicResource": [("claim_name", 2, S, None, False), ("claim_namespace", 3, S, None, False),
                        ("claim_resources", 4, M, "ClaimResource", True)],
    "ClaimResource": [("cdi_devices", 1, M, "CDIDevice", True), ("driver_name", 2, S, None, False),
                      ("pool_name", 3, S, None, False), ("device_name", 4, S, None, False)],
    "CDIDevice": [("name", 1, S, None, False)],
    "GetPodResourcesRequest": [("pod_name", 1, S, None, False), ("pod_namespace", 2, S, None, False)],
    "GetPodResourcesResponse": [("pod_resources", 1, M, "PodResources", False)],
}


def test_proto_matches_the_upstream_definition() -> None:
    file = protocol().messages.DESCRIPTOR
    assert file.package == UPSTREAM_PACKAGE
    assert list(file.services_by_name) == ["PodResourcesLister"]
    service = file.services_by_name["PodResourcesLister"]
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == UPSTREAM_METHODS
    assert all(not (m.client_streaming or m.server_streaming) for m in service.methods)
    assert set(file.message_types_by_name) == set(UPSTREAM_MESSAGES)
    for name, fields in UPSTREAM_MESSAGES.items():
        message = file.message_types_by_name[name]
        got = [(f.name, f.number, f.type, f.message_type.name if f.message_type else None,
                f.is_repeated) for f in message.fields]
        assert got == fields, name


# ---------------------------------------------------------------------------- device IDs → cards

IDS = CardIds({"GPU-a": 0, "GPU-b": 1, "GPU-c": 2, "GPU-d": 3}, {"MIG-x": 2}, {10: 0, 11: 1, 12: 2, 13: 3})


def held(resource: str, *ids: str, pod_key: str = "ml/p", dra: bool = False) -> HeldDevices:
    return HeldDevices(pod_key, "main", resource, ids, dra)


@pytest.mark.parametrize(("entry", "cards", "unmapped"), [
    (held("nvidia.com/gpu", "GPU-b"), {1}, ()),                             # the device plugin's GPU UUID
    (held("nvidia.com/gpu", "GPU-a::0", "GPU-a::3"), {0}, ()),              # time-slicing replicas of one card
    (held("nvidia.com/mig-1g.10gb", "MIG-x"), {2}, ()),                     # a MIG device: its parent card
    (held("gpu.nvidia.com", "gpu-13", dra=True), {3}, ()),                  # DRA device name: minor 13 is card 3
    (held("gpu.nvidia.com", "gpu-11-mig-19-0-1", dra=True), {1}, ()),       # DRA MIG device of minor 11
    (held("gpu.nvidia.com", "gpu-99", "k8s.gpu.nvidia.com/device=GPU-c", dra=True), {2}, ()),  # CDI names the UUID
    (held("gpuplane.io/gpu", "GPU-a::1"), set(), ()),                       # gpuplane's own: never foreign
    (held("intel.com/sriov", "0000:3b:02.1"), set(), ()),                   # not a GPU resource, not a card
    (held("example.com/fpga-driver", "gpu-0", dra=True), set(), ()),        # not a GPU DRA driver
    (held("nvidia.com/gpu", "GPU-zzz"), set(), (UnmappedDevice("ml/p", "nvidia.com/gpu", "GPU-zzz"),)),
    (held("gpu.nvidia.com", "gpu-7", dra=True), set(), (UnmappedDevice("ml/p", "gpu.nvidia.com", "gpu-7"),)),
])
def test_device_ids_map_to_cards(entry: HeldDevices, cards: set[int],
                                 unmapped: tuple[UnmappedDevice, ...]) -> None:
    report = foreign_report([entry], IDS)
    assert {h.index for h in report.holds} == cards
    assert report.unmapped == unmapped


def test_report_groups_pods_and_resources_per_card() -> None:
    report = foreign_report([held("nvidia.com/gpu", "GPU-a::0", pod_key="a/one"),
                             held("nvidia.com/gpu", "GPU-a::1", pod_key="b/two"),
                             held("nvidia.com/gpu.shared", "GPU-a::2", pod_key="a/one"),
                             held("nvidia.com/gpu", "GPU-d", pod_key="c/three")], IDS)
    assert report.holds == (ForeignHold(0, ("a/one", "b/two"), ("nvidia.com/gpu", "nvidia.com/gpu.shared")),
                            ForeignHold(3, ("c/three",), ("nvidia.com/gpu",)))
    assert ForeignReport.decode(report.encode()) == report


# ---------------------------------------------------------------------------- the client over unix-socket gRPC

@pytest.fixture
def sockdir() -> Iterator[Path]:
    # unix socket paths are limited to 107 bytes: pytest's tmp_path can be longer
    path = Path(tempfile.mkdtemp(prefix="gppr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[FakePodResources]:
    fake = FakePodResources(sockdir / "pod-resources" / "kubelet.sock").start()
    yield fake
    fake.stop()


def test_client_lists_devices_and_claims(kubelet: FakePodResources) -> None:
    kubelet.set_pods(Pod("ml", "train", (Container("main", {"nvidia.com/gpu": ["GPU-fake-1"]}),
                                         Container("side", claims=(Claim("gpu.nvidia.com", "gpu-0",
                                                                         ("k8s.gpu.nvidia.com/device=gpu-0",)),)))))
    client = PodResourcesClient(str(kubelet.socket))
    try:
        assert client.list() == [
            HeldDevices("ml/train", "main", "nvidia.com/gpu", ("GPU-fake-1",)),
            HeldDevices("ml/train", "side", "gpu.nvidia.com", ("gpu-0", "k8s.gpu.nvidia.com/device=gpu-0"), True)]
    finally:
        client.close()


def test_card_ids_from_the_backend_follow_mig_devices() -> None:
    backend = FakeGpuBackend(2, mig_model=CATALOG.get("A100-40GB"), mig_enabled=True)
    instance = backend.create_mig_instance(1, 19, 0)
    ids = CardIds.from_backend(backend)
    assert (ids.card_of("GPU-fake-0"), ids.card_of(str(instance.uuid)), ids.card_of("GPU-other")) == (0, 1, None)


# ---------------------------------------------------------------------------- publishing on the node

@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_node(node_json("n1", cards=4))
        yield server


def patches(server: FakeApiServer) -> int:
    return len(server.requests_to(r"/api/v1/nodes/n1$", "PATCH"))


def test_reporter_patches_once_per_change(kubelet: FakePodResources, api_server: FakeApiServer) -> None:
    client = PodResourcesClient(str(kubelet.socket))
    reporter = ForeignCardsReporter(api_server.api, "n1", client, FakeGpuBackend(4))
    try:
        assert reporter.tick()  # first round: an empty report, so the codec knows nothing is held
        assert json.loads(annotation(api_server)) == {"cards": []}
        assert not reporter.tick() and patches(api_server) == 1  # unchanged: no write
        kubelet.set_pods(Pod("ml", "p", (Container("c", {"nvidia.com/gpu": ["GPU-fake-2"]}),)))
        assert reporter.tick() and patches(api_server) == 2
        assert ForeignReport.decode(annotation(api_server)).cards(4) == {2}
        assert not reporter.tick() and patches(api_server) == 2
        # A restarted agent reads what is on the node and writes nothing while it still holds.
        again = ForeignCardsReporter(api_server.api, "n1", client, FakeGpuBackend(4))
        assert not again.tick() and patches(api_server) == 2
        kubelet.stop()  # kubelet away: nothing is published, the last report stands
        assert not again.tick() and patches(api_server) == 2
    finally:
        client.close()


def test_the_scheduler_follows_the_report(kubelet: FakePodResources, api_server: FakeApiServer) -> None:
    """Agent → node annotation → KubeCluster's NODE_UPDATED → the scheduler's cache, in place (no rebuild)."""
    cluster = KubeCluster(api_server.api, CATALOG, clock=WallClock(), dispatch="manual", watch_timeout_s=30)
    client = PodResourcesClient(str(kubelet.socket))
    try:
        scheduler = Scheduler(cluster, CATALOG, default_registry().build(PolicyConfig()), seed=0, queue_pods=False)
        cache = scheduler.state
        four = PodRequest("ml/four", gpu=WholeCards(4))
        assert scheduler.decide(four).assignment is not None
        kubelet.set_pods(Pod("kai", "reservation", (Container("c", {"nvidia.com/gpu": ["GPU-fake-0"]}),)))
        assert ForeignCardsReporter(api_server.api, "n1", client, FakeGpuBackend(4)).tick()
        while not scheduler.state.nodes[0].foreign_cards and cluster.wait_for_changes(10.0):  # a safety net
            cluster.pump()
        assert scheduler.state is cache and scheduler.state.nodes[0].foreign_cards == {0}
        assert scheduler.decide(four).assignment is None  # card 0 is the reservation pod's: 3 cards left
        three = scheduler.decide(PodRequest("ml/three", gpu=WholeCards(3))).assignment
        assert three is not None and three.card_indexes == (1, 2, 3)
    finally:
        client.close()
        cluster.close()


def test_the_node_agent_command_publishes_foreign_cards(kubelet: FakePodResources, api_server: FakeApiServer,
                                                        sockdir: Path) -> None:
    plugins = FakeKubelet(sockdir / "plugins")
    plugins.start()
    kubelet.set_pods(Pod("ml", "nv", (Container("c", {"nvidia.com/gpu": ["GPU-fake-1"]}),)))
    script = ("import typer; from gpuplane.cli.device_plugin_cmd import register; app = typer.Typer(); "
              "register(app); app()")
    kubeconfig = api_server.write_kubeconfig(sockdir / "kubeconfig")
    proc = subprocess.Popen([sys.executable, "-c", script, "device-plugin", "--dir", str(plugins.directory),
                             "--node-name", "n1", "--fake-cards", "4", "--fake-model", "A100-40GB", "--kubeconfig",
                             str(kubeconfig), "--pod-resources", str(kubelet.socket), "--interval", "0.2"],
                            env={**os.environ, "KUBERNETES_SERVICE_HOST": ""}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        node = api_server.wait_for("nodes", "n1", lambda o: o is not None and FOREIGN_CARDS in
                                   o["metadata"].get("annotations", {}), WAIT_S)
        assert node is not None
        assert ForeignReport.decode(node["metadata"]["annotations"][FOREIGN_CARDS]).cards(4) == {1}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=WAIT_S)
        plugins.stop()
    assert proc.returncode == 0, stderr
    assert "foreign cards: from" in stderr


def annotation(server: FakeApiServer) -> str:
    obj = server.get("nodes", "n1")
    assert obj is not None
    return str(obj["metadata"]["annotations"][FOREIGN_CARDS])


# ---------------------------------------------------------------------------- the codec

def k8s_node(report: str | None = None, allocatable: dict[str, str] | None = None) -> dict[str, Any]:
    obj = node_json("n1", cards=4)
    if report is not None:
        obj["metadata"]["annotations"][FOREIGN_CARDS] = report
    obj["status"]["allocatable"].update(allocatable or {})
    return obj


REPORT_1_3 = ForeignReport((ForeignHold(1, ("a/p",), ("nvidia.com/gpu",)),
                            ForeignHold(3, ("b/q",), ("gpu.nvidia.com",)))).encode()


@pytest.mark.parametrize(("report", "allocatable", "cards"), [
    (None, {}, set()),                                    # no other stack on the node
    (REPORT_1_3, {}, {1, 3}),
    (REPORT_1_3, {"nvidia.com/gpu": "4"}, {1, 3}),        # the report decides once it is there
    ('{"cards":[]}', {"nvidia.com/gpu": "4"}, set()),
    (None, {"nvidia.com/gpu": "4"}, {0, 1, 2, 3}),        # safety net: another stack and no report yet
    (None, {"nvidia.com/gpu": "0"}, set()),
    (None, {"nvidia.com/mig-1g.10gb": "7"}, {0, 1, 2, 3}),
    ('{"cards":[],"unmapped":[{"pod":"a/p","resource":"nvidia.com/gpu","device":"GPU-x"}]}', {}, {0, 1, 2, 3}),
    ('{"cards":[{"index":6,"pods":[],"resources":[]}]}', {}, {0, 1, 2, 3}),  # card 6 of 4: trust neither
])
def test_codec_reads_the_cards_other_stacks_hold(report: str | None, allocatable: dict[str, str],
                                                 cards: set[int]) -> None:
    assert node_spec(k8s_node(report, allocatable), CATALOG).foreign_cards == cards


@pytest.mark.parametrize("report", ["not json", '{"cards":[{"index":-1}]}', '{"cards":[{"index":1},{"index":1}]}',
                                    '{"holds":[]}'])
def test_a_bad_report_names_the_field(report: str) -> None:
    with pytest.raises(ObjectError) as caught:
        node_spec(k8s_node(report), CATALOG)
    assert caught.value.field == f"metadata.annotations[{FOREIGN_CARDS}]"


# ---------------------------------------------------------------------------- ClusterState

def held_node(*foreign: int, mig: MigMode = MigMode.DYNAMIC) -> Any:
    return node("n").gpus(4, "A100-40GB").mig(mig).cpu(64000).mem(262144).obj().with_changes(
        foreign_cards=frozenset(foreign))


@pytest.mark.parametrize(("request_", "reason"), [
    (pod("w").whole(1).obj(), "card 1 is held by another GPU stack's pod"),
    (pod("f").fraction(100).obj(), "card 1 is held by another GPU stack's pod"),
    (pod("m").mig(19).obj(), "card 1 is held by another GPU stack's pod"),
])
def test_a_held_card_takes_nothing(request_: PodRequest, reason: str) -> None:
    state = cluster(held_node(1))
    shares = {"w": CardShare(1, 1000, 40960, 0, 5, whole=True), "f": CardShare(1, 100, 0),
              "m": CardShare(1, 142, 4864, mig_profile=19, mig_start=0)}
    assert state.check(Assignment("n", (shares[request_.name],)), request_) == reason


def test_held_cards_count_fully_taken() -> None:
    state = cluster(held_node(0, 2))
    # 4 cards, 2 held: 2 idle, 2 × 1000 milli used, nothing free on 0 and 2, no MIG there
    assert (int(state.idle_cards[0]), int(state.gpu_milli_used[0])) == (2, 2000)
    assert state.card_milli_free[0, :4].tolist() == [0, 1000, 0, 1000]
    assert state.card_mem_free[0, :4].tolist() == [0, 40960, 0, 40960]
    assert state.card_mig_allowed[0, :4].tolist() == [False, True, False, True]
    assert state.check_invariants() == []
    fw = framework()
    decision = fw.schedule(pod("three").whole(3).obj(), state)
    assert decision.assignment is None
    assert placed_cards(fw, state, pod("two").whole(2).obj()) == (1, 3)
    assert fw.schedule(pod("share").fraction(100).obj(), state).assignment is None  # 1 and 3 are held whole


def placed_cards(fw: Any, state: Any, request: PodRequest) -> tuple[int, ...]:
    decision = fw.schedule(request, state)
    assert decision.assignment is not None, decision.status.message
    state.place(request, decision.assignment)
    return decision.assignment.card_indexes


def test_update_node_follows_the_report_and_gives_back_exactly() -> None:
    state = cluster(held_node())
    fresh = state.fingerprint()
    state.place(pod("f").fraction(300, mem=1000).obj(), Assignment("n", (CardShare(2, 300, 1000),)))
    state.update_node(state.nodes[0].with_changes(foreign_cards=frozenset({2, 3})))
    # card 2 keeps gpuplane's share (another stack took what it left: 700 milli, 39960 MiB); card 3 all held
    assert state.card_milli_free[0, :4].tolist() == [1000, 1000, 0, 0]
    assert (int(state.card_foreign_milli[0, 2]), int(state.card_foreign_mem[0, 2])) == (700, 39960)
    assert state.check_invariants() == []
    state.release("f")  # what the pod leaves stays held while the other stack holds the card
    assert state.card_milli_free[0, :4].tolist() == [1000, 1000, 0, 0]
    assert state.check_invariants() == []
    state.update_node(state.nodes[0].with_changes(foreign_cards=frozenset()))
    assert state.fingerprint() == fresh


def test_foreign_cards_outside_the_node_are_refused() -> None:
    with pytest.raises(NodeSpecError, match="foreign_cards"):
        node("n").gpus(2).obj().with_changes(foreign_cards=frozenset({2}))


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[str, Any]]:
    return draw(st.lists(st.one_of(
        st.tuples(st.just("place"), st.sampled_from([pod("x").whole(1).obj(), pod("x").whole(2).obj(),
                                                     pod("x").fraction(300, mem=8000).obj(), pod("x").mig(19).obj(),
                                                     pod("x").mig(9).obj(), pod("x").fraction(500).obj()])),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("foreign"), st.frozensets(st.integers(0, 3)))), min_size=1, max_size=30))


@SETTINGS
@given(ops=steps(), seed=st.integers(0, 2**16))
def test_never_a_share_on_a_held_card_and_giving_back_restores(ops: list[tuple[str, Any]], seed: int) -> None:
    state = cluster(held_node())
    fresh = state.fingerprint()
    fw = framework(seed=seed)
    live: list[str] = []
    for i, (kind, payload) in enumerate(ops):
        if kind == "place":
            request = PodRequest(f"p{i}", gpu=payload.gpu)
            decision = fw.schedule(request, state)
            if decision.assignment is not None:
                assert not set(decision.assignment.card_indexes) & state.nodes[0].foreign_cards
                state.place(request, decision.assignment)
                live.append(request.name)
        elif kind == "release" and live:
            state.release(live.pop(payload % len(live)))
        elif kind == "foreign":
            state.update_node(state.nodes[0].with_changes(foreign_cards=payload))
        assert state.check_invariants() == []
        assert (state.card_milli_free[0, :4] >= 0).all() and (state.card_mem_free[0, :4] >= 0).all()
        held = np.array([c in state.nodes[0].foreign_cards for c in range(4)])
        assert (state.card_milli_free[0, :4][held] == 0).all()
    for name in live:
        state.release(name)
    state.update_node(state.nodes[0].with_changes(foreign_cards=frozenset()))
    assert state.fingerprint() == fresh
