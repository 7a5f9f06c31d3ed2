"""Parity of the two paths to a card (issue 21, part 5): the same fill workload through the device-plugin path
(nodes with the GPU inventory, pods asking `gpuplane.io/gpu`) and through the DRA path (the same nodes' cards as
ResourceSlices, each pod's ask as a ResourceClaim of gpuplane's classes) gives the same cards, card for card; and
the comparison sees a difference when the DRA side runs another card policy."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import pytest

from gpuplane.kube.api import pod_path
from gpuplane.kube.cluster import pod_manifest
from gpuplane.kube.dra import DraBook, DraKubeCluster, claim_path, dra_profile, parse_device_name, with_claim
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.model import Fraction, MigSlice, NodeSpec, PodRequest, Topology, WholeCards, default_catalog, make_request
from gpuplane.node.dra_slices import spec_slices
from gpuplane.scheduler import PolicyConfig, Profile, Scheduler, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim import bundled_path, load_nodes, load_pods, parity
from gpuplane.sim.dra_bench import claim_of, dra_node_manifest, publish_dra

CATALOG = default_catalog()
SEED = 42
Placement = tuple[str, tuple[int, ...]]


def claimable(request: PodRequest) -> bool:
    """A form a claim says the same way (`claim_manifest`): whole cards, a share with memory in MiB and no
    codec units, a MIG slice."""
    gpu = request.gpu
    if isinstance(gpu, Fraction):
        return bool(gpu.memory_mib) and not (gpu.memory_pct or gpu.encoders or gpu.decoders)
    return isinstance(gpu, WholeCards | MigSlice)


def dra_fill(nodes: Sequence[NodeSpec], workload: Sequence[PodRequest], profile: Profile,
             timeout_s: float = 30.0) -> list[Placement]:
    """`parity.kube_fill` through the DRA path: per pod its claim, then the pod; the scheduler in this process
    over a `DraKubeCluster`; the cards read from the claim's allocation; an unplaced pod deleted."""
    out: list[Placement] = []
    with FakeApiServer() as server:
        for spec in nodes:
            server.add_node(dra_node_manifest(spec))
        publish_dra(server.api, nodes, lambda spec: spec_slices(spec, CATALOG))
        book = DraBook(CATALOG)
        cluster = DraKubeCluster(server.api, CATALOG, book, dispatch="manual")
        scheduler = Scheduler(cluster, CATALOG, dra_profile(profile, book), seed=SEED, now=lambda: 0.0)
        try:
            for request in workload:
                namespace, name = request.name.split("/", 1)
                claim = claim_of(request)
                server.api.create(claim_path(namespace), claim)
                server.api.create(pod_path(namespace), with_claim(pod_manifest(request), claim["metadata"]["name"]))
                deadline = time.monotonic() + timeout_s
                while cluster.get_pod(request.name) is None:
                    assert time.monotonic() < deadline, f"the cache never saw {request.name}"
                    cluster.wait_for_changes(0.05)
                    cluster.pump()
                scheduler.run_pending()
                pod = server.get("pods", request.name) or {}
                node = (pod.get("spec") or {}).get("nodeName")
                if not node:
                    out.append(("", ()))
                    server.api.delete(pod_path(namespace, name))
                    continue
                stored = server.get("resourceclaims", f"{namespace}/{claim['metadata']['name']}") or {}
                results = stored["status"]["allocation"]["devices"]["results"]
                refs = [parse_device_name(r["device"]) for r in results]
                out.append((node, tuple(sorted(r.card for r in refs if r is not None))))
        finally:
            scheduler.close()
            cluster.close()
    return out


def profile(policy: str, card_policy: str | None, pods: list[PodRequest]) -> Profile:
    return default_registry().build(PolicyConfig(node_policy=policy, card_policy=card_policy, seed=SEED,
                                                 typical=TypicalPods.from_workload(pods)))


def mixed_workload(count: int, seed: int) -> list[PodRequest]:
    """Whole cards (1, 2, 4), vGPU shares (compute 100…900, memory 1…40 GiB) and A100 MIG slices, in a seeded
    mix, written as both worlds run them (`parity/<name>`)."""
    rng = random.Random(seed)
    pods = []
    for i in range(count):
        kind = rng.choice(("whole", "share", "share", "mig"))
        gpu: Any
        if kind == "whole":
            gpu = WholeCards(rng.choice((1, 1, 2, 4)))
        elif kind == "share":
            gpu = Fraction(compute_milli=100 * rng.randint(1, 9), memory_mib=1024 * rng.randint(1, 40))
        else:
            gpu = MigSlice(rng.choice(("1g.10gb", "2g.20gb", "3g.40gb")))
        pods.append(make_request(CATALOG, f"pod-{i:04d}", cpu_milli=1000, memory_mib=4096, gpu=gpu))
    kept, refused = parity.expressible(pods, CATALOG)
    assert not refused
    return kept


@pytest.fixture(scope="module")
def setting() -> tuple[list[NodeSpec], list[PodRequest], list[PodRequest]]:
    trace = [p.request for p in load_pods(bundled_path("default"), CATALOG)]
    # 12 of the trace's nodes (P100s, V100s, T4s, …) and 6 A100-80GB nodes of 8 cards (two NVLink groups of 4,
    # two NUMA nodes), MIG DYNAMIC; 220 pods over-fill them (about 150 cards' worth asked of 72 cards), so the
    # fill reaches refusals too.
    a100 = CATALOG.canonical("A100-80GB")
    topology = Topology((0, 0, 0, 0, 1, 1, 1, 1), (0, 0, 1, 1, 2, 2, 3, 3), ((0, 1, 2, 3), (4, 5, 6, 7)))
    big = [NodeSpec(f"a100-{i}", 128_000, 1_048_576, a100, 8, topology=topology) for i in range(6)]
    nodes = parity.in_api_order(load_nodes(bundled_path("nodes"), CATALOG)[:12] + big)
    workload = mixed_workload(220, SEED)
    assert all(claimable(p) for p in workload)
    return nodes, workload, trace


def differences(a: Sequence[Placement], b: Sequence[Placement]) -> list[tuple[int, Placement, Placement]]:
    return [(i, x, y) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


@pytest.mark.parametrize(("policy", "card_policy"), [("binpack", None), ("spread", "spread")])
def test_the_device_plugin_and_dra_paths_give_the_same_cards(
        setting: tuple[list[NodeSpec], list[PodRequest], list[PodRequest]], policy: str,
        card_policy: str | None) -> None:
    nodes, workload, trace = setting
    chosen = profile(policy, card_policy, trace)
    plugin = parity.kube_fill(nodes, workload, parity.in_process(CATALOG, chosen, SEED))
    dra = dra_fill(nodes, workload, chosen)
    assert differences(plugin, dra) == []
    placed = sum(1 for node, _ in dra if node)
    kinds = {type(p.gpu).__name__ for p, (node, _) in zip(workload, dra, strict=True) if node}
    # The comparison covers placements and refusals, and every kind of device.
    assert 0 < placed < len(workload) and kinds == {"WholeCards", "Fraction", "MigSlice"}, (placed, kinds)


def test_the_comparison_sees_another_card_policy(
        setting: tuple[list[NodeSpec], list[PodRequest], list[PodRequest]]) -> None:
    nodes, workload, trace = setting
    plugin = parity.kube_fill(nodes, workload[:60], parity.in_process(CATALOG, profile("binpack", None, trace),
                                                                      SEED))
    dra = dra_fill(nodes, workload[:60], profile("binpack", "spread", trace))
    assert differences(plugin, dra)
