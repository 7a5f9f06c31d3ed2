"""gpuplane-scheduler allocates DRA ResourceClaims against the local API server (issue 21, part 4): the claim's
status (allocation with request/driver/pool/device, consumedCapacity for a vGPU share, nodeSelector; reservedFor)
is written before the Binding; the CEL selectors decide the cards and a failing one is named in FailedScheduling;
claim holders are preempted and their claims released; a shared claim is allocated once and released with its
last pod; device-plugin and DRA nodes side by side; a vGPU share never on a card given whole or in MIG slices;
and, with hypothesis, no device is allocated twice and releasing everything restores the cards exactly."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplane.kube.cluster import pod_manifest
from gpuplane.kube.dra import (
    CLAIMS,
    DRIVER,
    DeviceKind,
    claim_from_template,
    claim_manifest,
    claim_path,
    dra_scheduler,
    parse_device_name,
    with_claim,
)
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import SCHEDULER_NAME
from gpuplane.kube.scheduler_mode import SchedulerMode
from gpuplane.kube.standin import node_manifest
from gpuplane.model import Fraction, MigMode, MigSlice, NodeSpec, PodRequest, WholeCards, default_catalog
from gpuplane.node.dra_slices import spec_slices
from gpuplane.port import WallClock
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.sim.dra_bench import device_classes, dra_node_manifest, publish_dra

CATALOG = default_catalog()
A100 = CATALOG.canonical("A100-80GB")
NS = "team-a"
PODS = f"/api/v1/namespaces/{NS}/pods"
WAIT_S = 20.0


def slices_of(spec: NodeSpec) -> list[dict[str, Any]]:
    return spec_slices(spec, CATALOG)


class World:
    """The local API server with DRA nodes (and device-plugin nodes), the DeviceClasses, and the DRA scheduler
    binding inline."""

    def __init__(self, server: FakeApiServer, dra: list[NodeSpec], plugin: tuple[NodeSpec, ...] = (),
                 policy: str = "binpack", card_policy: str | None = None) -> None:
        self.server = server
        self.api = server.api
        for spec in dra:
            server.add_node(dra_node_manifest(spec))
        for spec in plugin:
            server.add_node(node_manifest(spec))
        publish_dra(self.api, dra, slices_of)
        profile = default_registry().build(PolicyConfig(node_policy=policy, card_policy=card_policy))
        self.mode: SchedulerMode = dra_scheduler(self.api, profile, catalog=CATALOG, clock=WallClock(),
                                                 scheduler_name=SCHEDULER_NAME, bind_workers=0, seed=7)
        self.mode.tick()

    def submit(self, name: str, gpu: Any, *, priority: int = 0, claim: str | None = None,
               create_claim: bool = True) -> None:
        request = PodRequest(f"{NS}/{name}", cpu_milli=100, gpu=gpu)
        claim = claim or f"{name}-gpu"
        if create_claim:
            self.api.create(claim_path(NS), claim_manifest(request, claim))
        pod = with_claim(pod_manifest(request, scheduler_name=SCHEDULER_NAME), claim)
        if priority:
            pod["spec"]["priority"] = priority
        self.api.create(PODS, pod)

    def settle(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, "the scheduler did not get there"
            self.mode.tick()
            self.mode.flush()
            cluster = self.mode.cluster
            assert cluster is not None
            cluster.wait_for_changes(0.02)

    def idle(self, seconds: float = 0.5) -> None:
        end = time.monotonic() + seconds
        self.settle(lambda: time.monotonic() > end)

    def node_of(self, pod: str) -> str | None:
        obj = self.server.get("pods", f"{NS}/{pod}")
        return None if obj is None else obj["spec"].get("nodeName")

    def claim(self, name: str) -> dict[str, Any]:
        obj = self.server.get("resourceclaims", f"{NS}/{name}")
        assert obj is not None
        return obj

    def devices(self, claim: str) -> list[str]:
        allocation = (self.claim(claim).get("status") or {}).get("allocation") or {}
        return [r["device"] for r in allocation.get("devices", {}).get("results", [])]

    def events(self, pod: str, reason: str) -> list[str]:
        found = [self.server.get("events", k) for k in self.server.keys("events")]
        return [e["note"] for e in found if e and e["regarding"]["name"] == pod and e["reason"] == reason]

    def close(self) -> None:
        self.mode.shutdown()


def a100(name: str, cards: int = 2, mig: MigMode = MigMode.DYNAMIC) -> NodeSpec:
    return NodeSpec(name, 64_000, 512_000, A100, cards, mig_mode=mig)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


# ------------------------------------------------------------------ allocation, table-driven
@pytest.mark.parametrize(("gpu", "devices", "consumed"), [
    # 2 whole cards of a 2-card node: gpu-0 and gpu-1, no capacity consumed.
    (WholeCards(2), ["gpu-0", "gpu-1"], None),
    # A share of 20 GiB and 250 milli-cards: card 0's vGPU device, its capacity consumed as asked, one share.
    (Fraction(compute_milli=250, memory_mib=20480), ["gpu-0-vgpu"], {"memory": "20480Mi", "compute": "250",
                                                                    "shares": "1"}),
    # 3g.40gb (profile 9): the policy's slot on card 0, start 0 or 4 (either leaves 4 slices for the same).
    (MigSlice("3g.40gb"), ["gpu-0-mig-9-0", "gpu-0-mig-9-4"], None),
])
def test_a_claim_is_allocated_reserved_then_bound(server: FakeApiServer, gpu: Any, devices: list[str],
                                                  consumed: dict[str, str] | None) -> None:
    world = World(server, [a100("dra-0")])
    world.submit("p", gpu)
    world.settle(lambda: world.node_of("p") == "dra-0")
    status = world.claim("p-gpu")["status"]
    # What was written passes the strict resource.k8s.io/v1 schema (1.35: consumedCapacity and shareID included).
    assert kubernetes_validate.validate(world.claim("p-gpu"), "1.35", strict=True) == "1.35"
    results = status["allocation"]["devices"]["results"]
    got = [r["device"] for r in results]
    assert got == devices if not isinstance(gpu, MigSlice) else (len(got) == 1 and got[0] in devices)
    assert all(r["driver"] == DRIVER and r["pool"] == "dra-0" and r["request"] == "gpu" for r in results)
    assert results[0].get("consumedCapacity") == consumed
    assert status["allocation"]["nodeSelector"] == {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["dra-0"]}]}]}
    uid = server.get("pods", f"{NS}/p")["metadata"]["uid"]  # type: ignore[index]
    assert status["reservedFor"] == [{"resource": "pods", "name": "p", "uid": uid}]
    # The claim's status is written before the Binding, and no assignment annotation (the claim is the record).
    writes = [(m, p) for m, p, _ in server.requests if m != "GET" and ("/p-gpu" in p or "/pods/p/" in p)]
    assert writes.index(("PATCH", claim_path(NS, "p-gpu", "status"))) < writes.index(("POST", f"{PODS}/p/binding"))
    assert not [p for m, p, _ in server.requests if m == "PATCH" and p == f"{PODS}/p"]
    world.close()


@pytest.mark.parametrize(("selector", "expected"), [
    # Card index 1 only: the policy would take card 0 first, the selector moves it.
    ('device.attributes["gpu.gpuplane.io"].index == 1', "gpu-1"),
    # A quantity comparison that every card passes: card 0 (binpack's lowest index).
    ('device.capacity["gpu.gpuplane.io"].memory.compareTo(quantity("80Gi")) >= 0', "gpu-0"),
])
def test_the_request_s_selectors_choose_the_card(server: FakeApiServer, selector: str, expected: str) -> None:
    world = World(server, [a100("dra-0")])
    request = PodRequest(f"{NS}/p", cpu_milli=100, gpu=WholeCards(1))
    claim = claim_manifest(request, "p-gpu")
    claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": selector}}]
    world.api.create(claim_path(NS), claim)
    world.api.create(PODS, with_claim(pod_manifest(request, scheduler_name=SCHEDULER_NAME), "p-gpu"))
    world.settle(lambda: world.node_of("p") == "dra-0")
    assert world.devices("p-gpu") == [expected]
    world.close()


def test_an_unsatisfiable_claim_names_its_request_and_the_failing_selector(server: FakeApiServer) -> None:
    world = World(server, [a100("dra-0"), a100("dra-1")])
    request = PodRequest(f"{NS}/p", cpu_milli=100, gpu=WholeCards(1))
    claim = claim_manifest(request, "p-gpu")
    claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.attributes["gpu.gpuplane.io"].model == "H100-80GB"'}}]
    world.api.create(claim_path(NS), claim)
    world.api.create(PODS, with_claim(pod_manifest(request, scheduler_name=SCHEDULER_NAME), "p-gpu"))
    world.settle(lambda: bool(world.events("p", "FailedScheduling")))
    [note] = world.events("p", "FailedScheduling")
    # Both nodes rejected by the request's own selector (the class's passed): one reason, counted twice.
    assert note.startswith("0/2 nodes are available: 2 cannot allocate request 'gpu' (class gpu.gpuplane.io): "
                           'no device matches selector `device.attributes["gpu.gpuplane.io"].model == '
                           '"H100-80GB"`.'), note
    assert "preemption: " in note and world.node_of("p") is None
    world.close()


# ------------------------------------------------------------------ preemption
def test_a_claim_holder_is_preempted_and_its_claim_released(server: FakeApiServer) -> None:
    world = World(server, [a100("dra-0")])
    world.submit("low", WholeCards(2), priority=100)
    world.settle(lambda: world.node_of("low") == "dra-0")
    assert world.devices("low-gpu") == ["gpu-0", "gpu-1"]
    world.submit("high", WholeCards(2), priority=1000)
    world.settle(lambda: world.node_of("high") == "dra-0")
    assert server.requests_to(rf"/namespaces/{NS}/pods/low/eviction$", "POST")
    assert server.get("pods", f"{NS}/low") is None
    released = world.claim("low-gpu").get("status") or {}
    assert not released.get("allocation") and not released.get("reservedFor")
    assert world.devices("high-gpu") == ["gpu-0", "gpu-1"]  # the same cards, now the preemptor's
    world.close()


# ------------------------------------------------------------------ sharing
def test_a_shared_claim_is_allocated_once_and_released_with_its_last_pod(server: FakeApiServer) -> None:
    world = World(server, [a100("dra-0"), a100("dra-1")])
    world.submit("first", WholeCards(1), claim="shared")
    world.settle(lambda: world.node_of("first") is not None)
    node = world.node_of("first")
    world.submit("second", WholeCards(1), claim="shared", create_claim=False)
    world.settle(lambda: world.node_of("second") is not None)
    assert world.node_of("second") == node  # pinned to the claim's node
    status = world.claim("shared")["status"]
    assert [r["name"] for r in status["reservedFor"]] == ["first", "second"]
    assert len(status["allocation"]["devices"]["results"]) == 1  # allocated once
    # The holder goes: the card stays held while the other pod shares it.
    world.api.delete(f"{PODS}/first")
    world.settle(lambda: [r["name"] for r in world.claim("shared")["status"]["reservedFor"]] == ["second"])
    state = world.mode.scheduler.state  # type: ignore[union-attr]
    assert state.card_holders[state.node_index[node]].sum() == 1  # type: ignore[index]
    world.api.delete(f"{PODS}/second")
    world.settle(lambda: not (world.claim("shared").get("status") or {}).get("allocation"))
    world.idle(0.3)
    state = world.mode.scheduler.state  # type: ignore[union-attr]
    assert state.card_holders[state.node_index[node]].sum() == 0  # type: ignore[index]
    world.close()


# ------------------------------------------------------------------ side by side, kinds kept apart
def test_device_plugin_and_dra_nodes_side_by_side(server: FakeApiServer) -> None:
    world = World(server, [a100("dra-0")], plugin=(a100("dp-0"),))
    world.submit("claims", WholeCards(1))
    world.api.create(PODS, pod_manifest(PodRequest(f"{NS}/plugin", cpu_milli=100, gpu=WholeCards(1)),
                                        scheduler_name=SCHEDULER_NAME))
    world.settle(lambda: world.node_of("claims") is not None and world.node_of("plugin") is not None)
    assert (world.node_of("claims"), world.node_of("plugin")) == ("dra-0", "dp-0")
    world.close()


@pytest.mark.parametrize("first", [WholeCards(1), MigSlice("1g.10gb")])
def test_a_vgpu_share_never_lands_on_a_card_given_whole_or_in_mig_slices(server: FakeApiServer,
                                                                         first: Any) -> None:
    world = World(server, [a100("dra-0", cards=1)])
    world.submit("taken", first)
    world.settle(lambda: world.node_of("taken") == "dra-0")
    world.submit("share", Fraction(compute_milli=100, memory_mib=1024))
    world.settle(lambda: bool(world.events("share", "FailedScheduling")))
    assert world.node_of("share") is None and not world.devices("share-gpu")
    world.api.delete(f"{PODS}/taken")
    world.settle(lambda: world.node_of("share") == "dra-0")
    assert world.devices("share-gpu") == ["gpu-0-vgpu"]
    world.close()


# ------------------------------------------------------------------ invariants
SHAPES = [WholeCards(1), WholeCards(2), MigSlice("1g.10gb"), MigSlice("3g.40gb"),
          Fraction(compute_milli=300, memory_mib=20480), Fraction(compute_milli=500, memory_mib=40960)]


def _check_allocations(world: World) -> None:
    """No device twice (vGPU devices: within their shares and capacity); no vGPU share on a card that holds a
    whole card or MIG slice; MIG slices on one card within its memory slices and not overlapping."""
    model = CATALOG.get(A100)
    held: dict[tuple[str, int], set[str]] = {}
    seen: set[tuple[str, str]] = set()
    for obj in world.api.list(CLAIMS)[0]:
        allocation = (obj.get("status") or {}).get("allocation")
        for result in (allocation or {}).get("devices", {}).get("results", []):
            ref = parse_device_name(result["device"])
            assert ref is not None
            key = (result["pool"], result["device"])
            assert ref.kind is DeviceKind.VGPU or key not in seen, key
            seen.add(key)
            held.setdefault((result["pool"], ref.card), set()).add(ref.kind.value if ref.kind is not DeviceKind.MIG
                                                                   else result["device"])
    for (_, _card), kinds in held.items():
        assert not ("vgpu" in kinds and len(kinds) > 1), kinds
        assert not ("gpu" in kinds and len(kinds) > 1), kinds
        slots = 0
        for name in kinds - {"gpu", "vgpu"}:
            ref = parse_device_name(name)
            assert ref is not None and ref.profile_id is not None and ref.start is not None
            mask = model.mig_profiles[ref.profile_id].slot_mask(ref.start)
            assert not slots & mask, kinds
            slots |= mask


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(range(len(SHAPES))), st.booleans()), min_size=3, max_size=9))
def test_no_device_is_allocated_twice_and_releasing_all_restores_the_cards(plan: list[tuple[int, bool]]) -> None:
    with FakeApiServer() as server:
        world = World(server, [a100("dra-0"), a100("dra-1")])
        state = world.mode.scheduler.state  # type: ignore[union-attr]
        empty = state.fingerprint()
        for i, (shape, leave) in enumerate(plan):
            world.submit(f"p{i}", SHAPES[shape])
            world.idle(0.15)
            _check_allocations(world)
            if leave and world.node_of(f"p{i}") is not None:
                world.api.delete(f"{PODS}/p{i}")
        world.idle(0.3)
        _check_allocations(world)
        for i in range(len(plan)):
            if server.get("pods", f"{NS}/p{i}") is not None:
                world.api.delete(f"{PODS}/p{i}")
        world.settle(lambda: not any((c.get("status") or {}).get("allocation") for c in world.api.list(CLAIMS)[0]))
        world.idle(0.3)
        assert world.mode.scheduler.state.fingerprint() == empty  # type: ignore[union-attr]
        world.close()


@pytest.mark.parametrize(("devices", "problem"), [
    (["gpu-0", "gpu-0"], "twice"),  # one whole card in two claims
    (["gpu-0", "gpu-0-vgpu"], "vgpu beside whole"),
    (["gpu-0-mig-9-0", "gpu-0-vgpu"], "vgpu beside MIG"),
    (["gpu-0-mig-9-0", "gpu-0-mig-14-2"], "overlapping MIG slices"),  # 3g at slices 0-3, 2g at 2-3
])
def test_the_invariant_check_sees_a_double_allocation(server: FakeApiServer, devices: list[str],
                                                      problem: str) -> None:
    world = World(server, [a100("dra-0")])
    for i, device in enumerate(devices):
        claim = claim_manifest(PodRequest(f"{NS}/x{i}", gpu=WholeCards(1)), f"x{i}")
        world.api.create(claim_path(NS), claim)
        world.api.patch(claim_path(NS, f"x{i}", "status"), {"status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": "dra-0", "device": device}]}}}})
    with pytest.raises(AssertionError):
        _check_allocations(world)
    world.close()


# ------------------------------------------------------------------ docs/dra.md's worked example
EXAMPLE = [d for d in yaml.safe_load_all((Path(__file__).parent / "fixtures" / "dra_allocation_example.yaml")
                                         .read_text()) if d]


def run_example(server: FakeApiServer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example on a node of two A100-80GB (MIG DYNAMIC): the template, the pod, the claim the resourceclaim
    controller makes (its name in the pod's status); (the pod, the claim) once the pod is bound."""
    world = World(server, [a100("node-a")])
    by_kind = {d["kind"]: d for d in EXAMPLE}
    deployed = {c["metadata"]["name"]: c["spec"] for c in device_classes()}
    assert by_kind["DeviceClass"]["spec"] == deployed["mig.gpu.gpuplane.io"]  # the class as deployed
    world.api.create(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates",
                     by_kind["ResourceClaimTemplate"])
    pod = world.api.create(PODS, by_kind["Pod"])
    claim = world.api.create(claim_path(NS), claim_from_template(by_kind["ResourceClaimTemplate"], pod, "slice"))
    world.api.patch(f"{PODS}/train/status", {"status": {"resourceClaimStatuses": [
        {"name": "slice", "resourceClaimName": claim["metadata"]["name"]}]}})
    world.settle(lambda: world.node_of("train") == "node-a")
    bound = server.get("pods", f"{NS}/train")
    allocated = server.get("resourceclaims", f"{NS}/{claim['metadata']['name']}")
    assert bound is not None and allocated is not None
    world.close()
    return bound, allocated


def test_the_worked_example_is_allocated_a_3g_slice(server: FakeApiServer) -> None:
    pod, claim = run_example(server)
    [result] = claim["status"]["allocation"]["devices"]["results"]
    # binpack's MIG choice: of the two 3g.40gb placements of card 0 (start 0 or 4), the one leaving most
    # placements; card 0 before card 1 (equal, lower index).
    assert result == {"request": "slice", "driver": DRIVER, "pool": "node-a", "device": result["device"]}
    assert result["device"] in {"gpu-0-mig-9-0", "gpu-0-mig-9-4"}
    assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "train", "uid": pod["metadata"]["uid"]}]
    assert claim["metadata"]["ownerReferences"][0]["name"] == "train"


# ------------------------------------------------------------------ bench kube with claims
def test_bench_kube_with_claims_binds_every_pod_with_three_scheduler_writes() -> None:
    from gpuplane.cli.dra_cmd import bench_slices
    from gpuplane.sim import kube_bench

    run = kube_bench.run_kube_bench([10], pods=30, repeats=1, ceiling=False, dra=bench_slices)
    [measured] = run.figures[0].runs
    assert measured.bound == 30 and run.figures[0].ceiling is None
    # Per pod: the client's claim and pod creates; the scheduler's claim status PATCH, Binding and event (the
    # allocation replaces the device-plugin path's assignment PATCH): 3 writes, no reads beyond the watches.
    per = measured.requests_per_bound_pod
    assert (per["POST resourceclaims"], per["POST pods"], per["PATCH resourceclaims/status"],
            per["POST pods/binding"]) == (1.0, 1.0, 1.0, 1.0)
    assert "PATCH pods" not in per
    assert measured.scheduler_writes_per_pod == 3.0 and measured.reads_beyond_watches == 0
    assert run.ok, run.misses
