"""The parity proof on a slice: the simulator and the Kubernetes world (local API server) decide alike, and the
comparison does see a difference when one world is given another policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuplane.kube.localapi import FakeApiServer
from gpuplane.model import Fraction, NodeSpec, PodRequest, WholeCards, default_catalog
from gpuplane.scheduler import PolicyConfig, Profile, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim import bundled_path, load_nodes, load_pods, parity, run_fill

CATALOG = default_catalog()
SEED = 42


@pytest.fixture(scope="module")
def trace_pods() -> list[PodRequest]:
    return [p.request for p in load_pods(bundled_path("default"), CATALOG)]


@pytest.fixture(scope="module")
def small_cluster() -> list[NodeSpec]:
    # 40 of the trace's nodes: the workload tuned to 130 % of their GPUs is a few hundred pods, and the last
    # third of them fail (fill protocol), so both placement and refusal are compared.
    return load_nodes(bundled_path("nodes"), CATALOG)[:40]


def profile(policy: str, trace_pods: list[PodRequest]) -> Profile:
    return default_registry().build(PolicyConfig(node_policy=policy, seed=SEED,
                                                 typical=TypicalPods.from_workload(trace_pods)))


# ---------------------------------------------------------------------------------------------- the objects
def test_a_pod_that_cannot_be_written_is_reported_not_dropped() -> None:
    fine = PodRequest("a", cpu_milli=1000, memory_mib=1024, gpu=Fraction(compute_milli=460))
    # gpucores is whole percent: 455 milli-cards is 45.5 %, which no pod can ask for.
    odd = PodRequest("b", cpu_milli=1000, memory_mib=1024, gpu=Fraction(compute_milli=455))
    kept, refused = parity.expressible([fine, odd], CATALOG)
    assert [p.name for p in kept] == ["parity/a"]
    assert len(refused) == 1 and refused[0].startswith("b: ") and "whole percent" in refused[0]


def test_the_api_server_lists_nodes_by_name_like_etcd_whatever_the_creation_order() -> None:
    specs = [NodeSpec(name, 8000, 16384, CATALOG.canonical("T4"), 1) for name in ("n-2", "n-10", "n-1")]
    with FakeApiServer() as server:
        for spec in specs:
            server.add_node(parity.node_manifest(spec))
        items, _ = server.api.list("/api/v1/nodes")
    assert [i["metadata"]["name"] for i in items] == ["n-1", "n-10", "n-2"]  # byte order of the keys
    assert [spec.name for spec in parity.in_api_order(specs)] == ["n-1", "n-10", "n-2"]


def test_a_node_list_out_of_name_order_runs_in_the_api_order_in_both_worlds(
        small_cluster: list[NodeSpec], trace_pods: list[PodRequest]) -> None:
    binpack = profile("binpack", trace_pods)
    shuffled = small_cluster[20:] + small_cluster[:20]
    result = parity.fill_parity(CATALOG, shuffled, trace_pods, binpack, parity.in_process(CATALOG, binpack, SEED),
                                seed=SEED, limit=80)
    assert result.nodes_reordered and result.differences == 0


# ---------------------------------------------------------------------------------------------- fill
def test_the_simulated_side_is_run_fill(small_cluster: list[NodeSpec], trace_pods: list[PodRequest]) -> None:
    binpack = profile("binpack", trace_pods)
    workload, refused = parity.fill_workload(CATALOG, small_cluster, trace_pods, SEED)
    assert not refused
    ours = parity.sim_fill(CATALOG, small_cluster, workload, binpack, SEED)
    theirs = run_fill(CATALOG, small_cluster, trace_pods, binpack, seed=SEED, record_placements=True)
    # The same tuned workload, the same decisions, pod for pod (names carry the `parity/` namespace).
    assert [p.request.name.lower() for p in theirs.placements] == [r.name.removeprefix("parity/") for r in workload]
    assert ours == [(p.node, p.cards) for p in theirs.placements]


def scheduler_process(policy: str, tmp_path: Path) -> parity.SchedulerFactory:
    """`gpuplane scheduler` as its own process, as the experiment runs it."""
    return parity.separate_process(parity.scheduler_args(policy, None, SEED, trace="default"), tmp_path)


@pytest.mark.parametrize("policy", ["binpack", "fgd"])
def test_fill_places_every_pod_on_the_same_node_and_cards(small_cluster: list[NodeSpec],
                                                          trace_pods: list[PodRequest], policy: str,
                                                          tmp_path: Path) -> None:
    chosen = profile(policy, trace_pods)
    result = parity.fill_parity(CATALOG, small_cluster, trace_pods, chosen, scheduler_process(policy, tmp_path),
                                seed=SEED)
    assert result.differences == 0, result.first_differences
    assert result.pods > 200 and result.failed > 20 and result.placed > 100
    assert result.sim_unallocated_pct == result.kube_unallocated_pct
    theirs = run_fill(CATALOG, small_cluster, trace_pods, chosen, seed=SEED)
    assert result.sim_unallocated_pct == pytest.approx(theirs.unallocated_at(100.0), abs=1e-3)


def test_fill_comparison_sees_a_different_policy(small_cluster: list[NodeSpec], trace_pods: list[PodRequest]) -> None:
    binpack = profile("binpack", trace_pods)
    result = parity.fill_parity(CATALOG, small_cluster, trace_pods, binpack,
                                parity.in_process(CATALOG, binpack, SEED), seed=SEED, limit=60,
                                sim_profile=profile("spread", trace_pods))
    assert result.differences > 0
    first = result.first_differences[0]
    assert first.sim != first.kube


# ---------------------------------------------------------------------------------------------- timed
def test_timed_script_gives_the_same_binds_and_evictions_in_order(trace_pods: list[PodRequest],
                                                                   tmp_path: Path) -> None:
    binpack = profile("binpack", trace_pods)
    result = parity.timed_parity(CATALOG, binpack, scheduler_process("binpack", tmp_path), seed=SEED)
    assert result.differences == 0, result.first_differences
    assert result.sim_events == result.kube_events
    events = result.kube_events
    # The script exercises what it says: backfill evicted for the gang, the gang bound whole, a dev pod evicted
    # for the online pod, which binds only after its victim's 30 s grace.
    assert {"evict parity/batch-0", "evict parity/batch-1", "evict parity/batch-2"} <= set(events)
    gang = [i for i, e in enumerate(events) if e.startswith("bind parity/train-")]
    assert len(gang) == 3 and gang == list(range(gang[0], gang[0] + 3))
    online = next(i for i, e in enumerate(events) if e.startswith("bind parity/online-0"))
    assert events.index("evict parity/dev-0") < online


def test_the_harness_drives_an_in_process_scheduler_alike(trace_pods: list[PodRequest]) -> None:
    binpack = profile("binpack", trace_pods)
    result = parity.timed_parity(CATALOG, binpack, parity.in_process(CATALOG, binpack, SEED), seed=SEED)
    assert result.differences == 0, result.first_differences


def test_timed_comparison_sees_a_different_policy(trace_pods: list[PodRequest]) -> None:
    binpack = profile("binpack", trace_pods)
    result = parity.timed_parity(CATALOG, binpack, parity.in_process(CATALOG, binpack, SEED), seed=SEED,
                                 sim_profile=profile("spread", trace_pods))
    assert result.differences > 0


def test_script_pods_are_whole_cards_with_priorities() -> None:
    script = parity.timed_script(CATALOG)
    requests = [s.request for s in script if isinstance(s, parity.Arrive)]
    assert all(isinstance(r.gpu, WholeCards) and r.priority > 0 for r in requests)
    assert max(s.at for s in script) < 60  # under the scheduler's shortest retry timer
