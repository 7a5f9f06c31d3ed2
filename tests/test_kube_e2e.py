"""End to end: the admission webhook, the extender over `KubeCluster` and the device plugin, talking to each other
over their real protocols with no live cluster.

`FakeApiServer` is the API server (real HTTP, the API's paths and status codes). The test plays the other parties:
a user (an AdmissionReview POSTed to the webhook, then a pod created through the API), kube-scheduler
(`gpuplane.kube.standin`: its default filters and scorers over its own informer view, calling the extender's
filter/prioritize/bind as the generated KubeSchedulerConfiguration says, nodeCacheCapable; single verbs through its
`ExtenderClient`) and the kubelet (`FakeKubelet`: the device plugin API v1beta1 over unix-socket gRPC; the nodes'
allocatable `gpuplane.io/gpu` is what kubelet would publish for the plugin's units). Each component has its own API
client, as separate processes would. The GPU node `gpu-x` runs the device plugin over `FakeGpuBackend` cards; the
plugin publishes the node's inventory, so the UUIDs the scheduler assigns are the ones the plugin hands out.
"""

from __future__ import annotations

import http.client
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from tests.fake_kubelet import WAIT_S, FakeKubelet

from gpuplane.cli.extender_cmd import build_profile
from gpuplane.kube.api import RestKubeApi, pod_path
from gpuplane.kube.cluster import EVICTION_REASON, KubeCluster
from gpuplane.kube.extender import PLACED_ELSEWHERE, Extender, ExtenderServer, scheduler_config
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import (
    ASSIGNMENT,
    BIND_PHASE,
    INVENTORY,
    PHASE_ALLOCATED,
    PHASE_ALLOCATING,
    RES_CORES,
    RES_GPU,
    RES_MEM,
    NodeInventory,
    assignment_annotations,
    decode_assignment,
    encode_assignment,
    object_key,
)
from gpuplane.kube.standin import ExtenderClient, ExtenderConfig, StandInScheduler
from gpuplane.kube.webhook import AdmissionPolicy, WebhookServer
from gpuplane.model import Assignment, CardShare, default_catalog
from gpuplane.node.allocation import AllocationSettings, KubeAssignmentSource
from gpuplane.node.device_plugin import DevicePlugin, PluginSettings, node_inventory, publish_inventory
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.port import PodPhase
from gpuplane.port.status import Code

CATALOG = default_catalog()
NS = "ml"
NODE_X = "gpu-x"  # A100-40GB × 2, runs the device plugin; card 0 held by a running pod
NODE_Y = "gpu-y"  # A100-40GB × 2, idle
CPU_NODE = "cpu-1"  # no GPUs
NODES = [NODE_X, NODE_Y, CPU_NODE]
SPLIT = 4
A100_MIB = 40960
USER = "alice@example.com"


# ------------------------------------------------------------------ helpers
def eventually(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Wait for an informer to catch up (a safety net with a deadline, not a speed assertion)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def gpu_pod(name: str, *, cores: int | None = None, mem: int | None = None,
            annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A pod as a user writes it: one container asking for one card (a fraction with `cores`/`mem`)."""
    limits = {RES_GPU: "1", "cpu": "1", "memory": "4Gi"}
    if cores is not None:
        limits[RES_CORES] = str(cores)
    if mem is not None:
        limits[RES_MEM] = str(mem)
    pod = pod_json(name, namespace=NS, limits=limits, annotations=annotations)
    del pod["status"]
    return pod


def whole(card: int) -> CardShare:
    return CardShare(card, 1000, A100_MIB, whole=True)


class SchedulerClient(ExtenderClient):
    """kube-scheduler's side of one extender verb at a time: the stand-in's HTTP client, node names only."""

    def __init__(self, server: ExtenderServer) -> None:
        super().__init__(ExtenderConfig.from_config(scheduler_config(server.url)["extenders"][0]), timeout_s=WAIT_S)

    def names(self, verb: str, pod: Mapping[str, Any], names: list[str]) -> Any:
        return self.post(verb, {"Pod": pod, "Nodes": None, "NodeNames": names})

    def filter_names(self, pod: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
        result: dict[str, Any] = self.names("filter", pod, names)
        return result

    def prioritize_names(self, pod: Mapping[str, Any], names: list[str]) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.names("prioritize", pod, names)
        return result


def gpu_units(node: dict[str, Any], units: int) -> dict[str, Any]:
    """The node with `units` of `gpuplane.io/gpu` allocatable (kubelet's view of the device plugin's list)."""
    for key in ("allocatable", "capacity"):
        node["status"][key][RES_GPU] = str(units)
    return node


class World:
    """The API server with three nodes and a running pod on gpu-x card 0; the webhook; gpu-x's device plugin
    registered with a fake kubelet; the extender over a `KubeCluster` (as `gpuplane extender` builds it)."""

    def __init__(self, sockdir: Path) -> None:
        self.sockdir = sockdir
        self.server = FakeApiServer().start()
        self._apis: list[RestKubeApi] = []
        self.user = self.client()
        self.webhook = WebhookServer(AdmissionPolicy(catalog=CATALOG)).start()
        self.kubelet = FakeKubelet(sockdir / "plugins")
        self.backend = FakeGpuBackend(2, 40 * GIB, name="NVIDIA A100-SXM4-40GB", uuid_prefix=NODE_X, numa=[0, 0])
        self.allocation = AllocationSettings(mps_pipe_dir=str(sockdir / "mps"), vgpu_dir=str(sockdir / "vgpu"),
                                             lock_dir=str(sockdir / "vgpulock"))
        self.plugin: DevicePlugin | None = None
        self.cluster: KubeCluster | None = None
        self.extender: Extender | None = None
        self.http: ExtenderServer | None = None
        self.scheduler: SchedulerClient | None = None
        self.standin: StandInScheduler | None = None
        self.backoffs: list[float] = []
        """The eviction back-offs the cluster port waited (injected: no real sleeping)."""

        # gpu-x's inventory comes from the device plugin
        self.server.add_node(gpu_units(node_json(NODE_X, model=None), 2 * SPLIT))
        self.server.add_node(gpu_units(node_json(NODE_Y, model="A100-40GB", cards=2), 2 * 10))
        self.server.add_node(node_json(CPU_NODE, model=None))
        resident = assignment_annotations(Assignment(NODE_X, (whole(0),)), 1.0)
        resident[BIND_PHASE] = PHASE_ALLOCATED
        self.server.add_pod(pod_json("resident", namespace=NS, limits={RES_GPU: "1"}, annotations=resident,
                                     node=NODE_X, phase="Running"))
        self.kubelet.start()
        self.start_plugin()
        self.start_extender()

    def client(self) -> RestKubeApi:
        api = RestKubeApi.from_url(self.server.url, request_timeout_s=WAIT_S)
        self._apis.append(api)
        return api

    # -- the node agent ---------------------------------------------------------------------------------------
    def start_plugin(self) -> DevicePlugin:
        api = self.client()
        settings = PluginSettings(NODE_X, self.kubelet.directory, split=SPLIT, allocation=self.allocation)
        self.plugin = DevicePlugin(settings, self.backend, KubeAssignmentSource(api, NODE_X), catalog=CATALOG,
                                   publish=lambda inventory: publish_inventory(api, NODE_X, inventory))
        self.plugin.start()
        return self.plugin

    def stop_plugin(self) -> None:
        if self.plugin is not None:
            self.plugin.stop(0)
            self.plugin = None

    # -- the extender -----------------------------------------------------------------------------------------
    def start_extender(self) -> None:
        cluster = KubeCluster(self.client(), CATALOG, sleep=self.backoffs.append, eviction_attempts=3)
        self.cluster = cluster

        def uid_names(uid: str) -> str | None:
            return next((object_key(p) for p in cluster.pods.objects()
                         if p.get("metadata", {}).get("uid") == uid), None)

        self.extender = Extender(cluster, CATALOG, build_profile("binpack", None), subscribe_lock=cluster.lock,
                                 uid_names=uid_names)
        self.http = ExtenderServer(self.extender, port=0).start()
        self.scheduler = SchedulerClient(self.http)
        self.standin = StandInScheduler(self.client(), scheduler_config(self.http.url)).start()

    def stop_extender(self) -> None:
        if self.standin is not None:
            self.standin.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.http is not None:
            self.http.close()
        if self.extender is not None:
            self.extender.close()
        if self.cluster is not None:
            self.cluster.close()
        self.scheduler = self.http = self.extender = self.cluster = None
        self.standin = None

    def close(self) -> None:
        self.stop_extender()
        self.stop_plugin()
        self.kubelet.stop()
        self.webhook.stop()
        for api in self._apis:
            api.close()
        self.server.stop()

    # -- views ------------------------------------------------------------------------------------------------
    @property
    def ks(self) -> SchedulerClient:
        assert self.scheduler is not None
        return self.scheduler

    @property
    def port(self) -> KubeCluster:
        assert self.cluster is not None
        return self.cluster

    @property
    def core(self) -> Extender:
        assert self.extender is not None
        return self.extender

    def stored(self, key: str, kind: str = "pods") -> dict[str, Any]:
        obj = self.server.get(kind, key)
        assert obj is not None, f"{kind} {key}"
        return obj

    def until_seen(self, key: str, phase: PodPhase | None = PodPhase.PENDING) -> None:
        """Wait until the extender's cluster view holds pod `key` in `phase` (None: until it is gone)."""
        def check() -> bool:
            info = self.port.get_pod(key)
            return info is None if phase is None else info is not None and info.phase is phase

        eventually(check, f"pod {key} {phase.value if phase else 'gone'} in the extender's view")

    # -- the user ---------------------------------------------------------------------------------------------
    def admit(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        """POST the pod's CREATE AdmissionReview to the webhook, as the API server does; its `response`."""
        uid = f"review-{pod['metadata']['name']}"
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": NS,
            "operation": "CREATE", "object": pod, "oldObject": None,
            "userInfo": {"username": USER, "groups": ["system:authenticated"]}, "dryRun": False}}
        host, port = self.webhook.server_address[:2]
        conn = http.client.HTTPConnection(str(host), int(port), timeout=WAIT_S)
        try:
            conn.request("POST", "/validate", json.dumps(review).encode(), {"Content-Type": "application/json"})
            answer = conn.getresponse()
            body = json.loads(answer.read())
        finally:
            conn.close()
        assert answer.status == 200 and body["response"]["uid"] == uid, body
        response: dict[str, Any] = body["response"]
        return response

    def submit(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        """What a user's `kubectl create` does: admission first, then the create; the pod as kube-scheduler
        then sees it (uid, resourceVersion) once the extender's view has it too."""
        assert self.admit(pod)["allowed"] is True
        created = self.user.create(pod_path(NS), pod)
        self.until_seen(object_key(created))
        return created

    # -- kube-scheduler ---------------------------------------------------------------------------------------
    def schedule(self, pod: Mapping[str, Any]) -> str:
        """One scheduling cycle as kube-scheduler runs it (the stand-in): its filters, the extender's filter, the
        scores if more than one node is left, bind through the extender."""
        assert self.standin is not None
        result = self.standin.schedule_one(self.stored(object_key(pod)))
        assert result.node is not None, result
        return result.node

    def units(self) -> list[str]:
        """The device IDs kubelet holds from the plugin's latest ListAndWatch list."""
        eventually(lambda: bool(self.kubelet.latest), "a device list from ListAndWatch")
        return [d.id for d in self.kubelet.latest]


@pytest.fixture
def world() -> Iterator[World]:
    # unix socket paths are limited to 107 bytes: pytest's tmp_path can be longer
    sockdir = Path(tempfile.mkdtemp(prefix="gpe2e-", dir="/tmp"))
    built: World | None = None
    try:
        built = World(sockdir)
        yield built
    finally:
        if built is not None:
            built.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def envs(response: Any) -> dict[str, str]:
    return dict(response.container_responses[0].envs)


def request_index(server: FakeApiServer, method: str, path: str, test: Callable[[Any], bool] = bool) -> int:
    """Where in the API server's request log the first `method path` request whose body passes `test` is."""
    for i, (m, p, body) in enumerate(server.requests):
        if m == method and p == path and test(body):
            return i
    raise AssertionError(f"no {method} {path} in the request log")


# ------------------------------------------------------------------ 1. the happy path
def test_a_fractional_pod_goes_from_admission_to_its_containers_environment(world: World) -> None:
    # The inventory the device plugin published is what the extender schedules on: the backend's UUIDs.
    inventory = NodeInventory.decode(world.stored(NODE_X, "nodes")["metadata"]["annotations"][INVENTORY])
    assert [(c.index, c.uuid) for c in inventory.cards] == [(0, "GPU-gpu-x-0"), (1, "GPU-gpu-x-1")]
    assert [world.backend.uuid(i) for i in range(2)] == ["GPU-gpu-x-0", "GPU-gpu-x-1"]
    assert world.kubelet.registrations[0].resource_name == RES_GPU
    assert [d.id for d in world.kubelet.next_list()] == [f"GPU-gpu-x-{card}::{k}" for card in (0, 1)
                                                          for k in range(SPLIT)]

    pod = world.submit(gpu_pod("frac", cores=30, mem=10240))
    key = f"{NS}/frac"
    passed = world.ks.filter_names(pod, NODES)
    # binpack: gpu-x already has a card in use. Only gpuplane's pick passes; gpu-y fits too, and is reported
    # unresolvable so kube-scheduler never preempts there; the CPU node has no cards.
    assert passed["Error"] == "" and passed["NodeNames"] == [NODE_X]
    assert passed["FailedAndUnresolvableNodes"][NODE_Y] == PLACED_ELSEWHERE.format(node=NODE_X)
    assert set(passed["FailedNodes"]) | set(passed["FailedAndUnresolvableNodes"]) == {NODE_Y, CPU_NODE}
    assert world.ks.prioritize_names(pod, [NODE_X, NODE_Y]) == [{"Host": NODE_X, "Score": 10},
                                                                {"Host": NODE_Y, "Score": 0}]
    assert world.ks.bind(pod, NODE_X) == ""

    bound = world.stored(key)
    assert bound["spec"]["nodeName"] == NODE_X
    notes = bound["metadata"]["annotations"]
    assert notes[BIND_PHASE] == PHASE_ALLOCATING
    assignment = decode_assignment(notes[ASSIGNMENT])
    # card 0 is the resident's whole card: 30 % and 10240 MiB of card 1
    assert assignment == Assignment(NODE_X, (CardShare(1, 300, 10240),))
    # the assignment was recorded on the pod before the Binding was posted
    path = pod_path(NS, "frac")
    recorded = request_index(world.server, "PATCH", path,
                             lambda body: ASSIGNMENT in body.get("metadata", {}).get("annotations", {}))
    assert recorded < request_index(world.server, "POST", f"{path}/binding")

    # kubelet: one unit of card 0 (it picks by count); the container gets the card the scheduler assigned
    response = world.kubelet.allocate([world.units()[:1]])
    got = envs(response)
    assert got["NVIDIA_VISIBLE_DEVICES"] == world.backend.uuid(assignment.cards[0].card) == "GPU-gpu-x-1"
    assert got["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"
    assert got["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert world.stored(key)["metadata"]["annotations"][BIND_PHASE] == PHASE_ALLOCATED
    # the extender's view: the pod holds its share, its bind phase read back from the API
    def seen_allocated() -> bool:
        info = world.port.get_pod(key)
        return info is not None and dict(info.annotations).get(BIND_PHASE) == PHASE_ALLOCATED

    eventually(seen_allocated, "the allocated bind phase in the extender's view")
    assert world.core.scheduler.state.bindings[key].assignment == assignment


# ------------------------------------------------------------------ 2. a forged assignment
def test_a_forged_assignment_is_refused_and_never_counted(world: World) -> None:
    # A 30 % pod whose owner claims 30 % of gpu-x's last free card (card 1): a share that matches its request.
    forged = encode_assignment(Assignment(NODE_X, (CardShare(1, 300, 10240),)))
    pod = gpu_pod("forged", cores=30, mem=10240, annotations={ASSIGNMENT: forged})
    verdict = world.admit(pod)
    assert verdict["allowed"] is False and verdict["status"]["code"] == 403
    assert f"metadata.annotations[{ASSIGNMENT}]" in verdict["status"]["message"]

    # Admitted anyway (straight into the store): a pending pod's recorded assignment holds nothing.
    world.server.add_pod({**pod, "status": {"phase": "Pending"}})
    key = f"{NS}/forged"
    world.until_seen(key)
    state = world.core.scheduler.state
    assert key not in state.bindings
    assert int(state.idle_cards[state.node_index[NODE_X]]) == 1  # card 1 is still idle
    probe = gpu_pod("probe")
    probe["metadata"].update(uid="probe-uid", resourceVersion="1")
    assert world.ks.filter_names(probe, [NODE_X])["NodeNames"] == [NODE_X]  # a whole card still fits there
    # The device plugin does not hand it cards either: it is not bound to the node.
    assert world.plugin is not None and world.plugin.source.pending() == []
    # Bound through the scheduler (to gpu-y), the pod gets the cards the extender chose, not the forged ones.
    stored = world.stored(key)
    assert world.ks.bind(stored, NODE_Y) == ""
    rebound = decode_assignment(world.stored(key)["metadata"]["annotations"][ASSIGNMENT])
    assert rebound.node == NODE_Y and world.stored(key)["spec"]["nodeName"] == NODE_Y


# ------------------------------------------------------------------ 3. a race for the last card
def test_two_pods_racing_for_the_last_card_only_one_is_bound(world: World) -> None:
    pods = [world.submit(gpu_pod(name)) for name in ("a", "b")]
    for pod in pods:  # gpu-x has one free card: each pod alone fits
        assert world.ks.filter_names(pod, [NODE_X])["NodeNames"] == [NODE_X]
    assert world.http is not None
    other = SchedulerClient(world.http)  # kube-scheduler binds in parallel, each bind on its own connection
    start = threading.Barrier(2)
    errors: dict[str, str] = {}

    def bind(client: SchedulerClient, pod: dict[str, Any]) -> None:
        start.wait(WAIT_S)
        errors[pod["metadata"]["name"]] = client.bind(pod, NODE_X)

    threads = [threading.Thread(target=bind, args=(client, pod)) for client, pod in zip((world.ks, other), pods,
                                                                                        strict=True)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
    finally:
        other.close()
    winners = [name for name, error in errors.items() if error == ""]
    losers = [name for name, error in errors.items() if error]
    assert len(winners) == 1 and len(losers) == 1, errors
    assert "no longer fits on node gpu-x" in errors[losers[0]]
    on_x = [k for k in world.server.keys("pods") if world.stored(k).get("spec", {}).get("nodeName") == NODE_X]
    assert sorted(on_x) == sorted([f"{NS}/resident", f"{NS}/{winners[0]}"])
    loser = world.stored(f"{NS}/{losers[0]}")
    assert ASSIGNMENT not in loser["metadata"]["annotations"]  # refused before anything was written
    assert not world.server.requests_to(rf"/pods/{losers[0]}/binding$", "POST")
    # kube-scheduler retries the loser: now only gpu-y takes it
    assert world.schedule(loser) == NODE_Y


# ------------------------------------------------------------------ 4. a restart in the middle
def test_restarted_extender_and_device_plugin_carry_on(world: World) -> None:
    frac = world.submit(gpu_pod("frac", cores=30, mem=10240))
    big = world.submit(gpu_pod("big"))
    assert world.schedule(frac) == NODE_X  # card 1 of gpu-x, 30 %
    assert world.schedule(big) == NODE_Y  # a whole card: gpu-x has none left whole
    probes = [gpu_pod("probe-frac", cores=50, mem=8192), gpu_pod("probe-whole")]
    for i, probe in enumerate(probes):  # as kube-scheduler sends them: with a uid and a resourceVersion
        probe["metadata"].update(uid=f"probe-uid-{i}", resourceVersion="1")
    old_answers = [(world.ks.filter_names(p, NODES), world.ks.prioritize_names(p, NODES)) for p in probes]
    old_fingerprint = world.core.scheduler.state.fingerprint()
    assert any(score["Score"] for _, scores in old_answers for score in scores)

    first = world.kubelet.next_list()
    world.stop_extender()
    world.stop_plugin()
    world.start_extender()
    world.start_plugin()
    assert world.kubelet.wait_registered(2).endpoint == "gpuplane.sock"
    assert world.kubelet.next_list() == first  # the new plugin's ListAndWatch: the same units, all Healthy

    assert world.core.scheduler.state.fingerprint() == old_fingerprint
    assert [(world.ks.filter_names(p, NODES), world.ks.prioritize_names(p, NODES)) for p in probes] == old_answers
    # frac was bound before the restart and never allocated: the new plugin still hands it its card
    assert world.stored(f"{NS}/frac")["metadata"]["annotations"][BIND_PHASE] == PHASE_ALLOCATING
    got = envs(world.kubelet.allocate([world.units()[:1]]))
    assert (got["NVIDIA_VISIBLE_DEVICES"], got["CUDA_DEVICE_SM_LIMIT"], got["CUDA_DEVICE_MEMORY_LIMIT_0"]) == \
        ("GPU-gpu-x-1", "30", "10240m")
    assert world.stored(f"{NS}/frac")["metadata"]["annotations"][BIND_PHASE] == PHASE_ALLOCATED


# ------------------------------------------------------------------ 5. eviction under a disruption budget
def test_eviction_held_by_a_disruption_budget_frees_cards_only_when_the_pod_is_gone(world: World) -> None:
    world.server.pod_deletion_delay_s = None  # an evicted pod stays terminating until finish_deletion
    victim = world.submit(gpu_pod("victim"))
    assert world.schedule(victim) == NODE_X  # binpack: gpu-x's last card; gpu-x is now full
    victim_key = f"{NS}/victim"
    world.until_seen(victim_key, PodPhase.RUNNING)
    urgent = world.submit(gpu_pod("urgent"))
    assert NODE_X in world.ks.filter_names(urgent, [NODE_X])["FailedNodes"]  # preemption may help

    # kube-scheduler asks which victims the extender needs gone: one card's worth, not both pods
    resident_uid = world.stored(f"{NS}/resident")["metadata"]["uid"]
    victim_uid = world.stored(victim_key)["metadata"]["uid"]
    answer = world.ks.post("preempt", {"Pod": urgent, "NodeNameToVictims": None, "NodeNameToMetaVictims": {
        NODE_X: {"Pods": [{"UID": resident_uid}, {"UID": victim_uid}], "NumPDBViolations": 1}}})
    # both hold a whole card at one priority: the resident ("ml/resident" < "ml/victim") is given back first
    assert answer == {"NodeNameToMetaVictims": {NODE_X: {"Pods": [{"UID": victim_uid}], "NumPDBViolations": 1}}}

    world.server.block_eviction(victim_key)
    held = world.port.evict(victim_key, grace_s=5, reason="preempted by ml/urgent")
    assert held.code is Code.PENDING and held.message.startswith("blocked:"), held
    assert world.backoffs == [1.0, 2.0]  # 3 attempts: two back-offs, doubling
    stored = world.stored(victim_key)
    assert "deletionTimestamp" not in stored["metadata"]
    assert stored["metadata"]["annotations"][EVICTION_REASON] == "preempted by ml/urgent"
    assert NODE_X in world.ks.filter_names(urgent, [NODE_X])["FailedNodes"]

    world.server.unblock_eviction(victim_key)
    assert world.port.evict(victim_key, grace_s=5).ok
    assert "deletionTimestamp" in world.stored(victim_key)["metadata"]
    world.until_seen(victim_key, PodPhase.TERMINATING)
    assert NODE_X in world.ks.filter_names(urgent, [NODE_X])["FailedNodes"]  # terminating: the card is still held

    world.server.finish_deletion(victim_key)
    world.until_seen(victim_key, None)
    assert world.ks.filter_names(urgent, [NODE_X])["NodeNames"] == [NODE_X]
    assert world.schedule(urgent) == NODE_X  # binpack: the fuller node, the victim's card
    taken = decode_assignment(world.stored(f"{NS}/urgent")["metadata"]["annotations"][ASSIGNMENT])
    assert (taken.node, taken.card_indexes) == (NODE_X, (1,))  # the victim's card


# ------------------------------------------------------------------ a node whose agent starts after the extender
def test_a_node_whose_inventory_lands_after_the_extender_started_gets_its_cards_scheduled(world: World) -> None:
    late = "gpu-late"
    world.server.add_node(node_json(late, model=None))  # kubelet registered the node; no node agent yet

    def cards_in_view(count: int) -> Callable[[], bool]:
        return lambda: any(n.name == late and n.spec.gpus == count for n in world.port.list_nodes())

    eventually(cards_in_view(0), f"node {late} in the extender's view")
    backend = FakeGpuBackend(2, 40 * GIB, name="NVIDIA A100-SXM4-40GB", uuid_prefix=late)
    publish_inventory(world.user, late, node_inventory(backend.describe(), CATALOG, split=SPLIT))
    eventually(cards_in_view(2), f"node {late}'s inventory in the extender's view")
    probe = gpu_pod("probe")
    probe["metadata"].update(uid="probe-uid", resourceVersion="1")
    assert world.ks.filter_names(probe, [late])["NodeNames"] == [late]
    # and the view still follows the API server afterwards
    world.server.add_pod({**gpu_pod("later"), "status": {"phase": "Pending"}})
    world.until_seen(f"{NS}/later")
