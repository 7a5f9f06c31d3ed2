"""The kube-scheduler stand-in (`gpuplane.kube.standin`): kube-scheduler's accounting, filters and scores, table-driven
with the arithmetic written out as upstream's tests do (`least_allocated_test.go`, `balanced_allocation_test.go`),
its cycle over a local API server, and the fill replay through the extender against the simulator.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from gpuplane.cli.common import policy_config
from gpuplane.kube.api import RestKubeApi, pod_path
from gpuplane.kube.extender import FilterAnswers, scheduler_config
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import RES_CORES, RES_GPU
from gpuplane.kube.standin import (
    DEFAULT_MEMORY_REQUEST,
    ERR_AFFINITY,
    ERR_UNSCHEDULABLE,
    NON_ZERO,
    StandInError,
    StandInScheduler,
    balanced_allocation,
    default_normalize,
    extender_weighted,
    fill_through_extender,
    least_allocated,
    managed_by,
    matches_node,
    num_feasible_nodes_to_find,
    pod_requests,
    pop_best,
    term_matches,
    tolerates,
)
from gpuplane.model import default_catalog
from gpuplane.scheduler import Profile, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim.replay import run_fill, tune_workload
from gpuplane.sim.trace import bundled_path, load_nodes, load_pods, resolve_trace

MI = 1 << 20


# ------------------------------------------------------------------ scores (pure), upstream's arithmetic
@pytest.mark.parametrize(("requested", "allocatable", "weights", "expected"), [
    # CPU ((4000 - 3000) * 100) / 4000 = 25; memory ((10000 - 5000) * 100) / 10000 = 50; (25 + 50) / 2 = 37
    ((3000, 5000), (4000, 10000), (1, 1), 37),
    # CPU ((6000 - 3000) * 100) / 6000 = 50; memory 50; (50 + 50) / 2 = 50
    ((3000, 5000), (6000, 10000), (1, 1), 50),
    # CPU requested over capacity scores 0; memory 50; (0 + 50) / 2 = 25
    ((5000, 5000), (4000, 10000), (1, 1), 25),
    # nothing requested: (100 + 100) / 2 = 100
    ((0, 0), (4000, 10000), (1, 1), 100),
    # weights 2 and 1: (25 * 2 + 50 * 1) / 3 = 33
    ((3000, 5000), (4000, 10000), (2, 1), 33),
    # a resource the node does not have is left out (weight too): CPU 25 / 1 = 25
    ((3000, 5000), (4000, 0), (1, 1), 25),
    # no resource at all: 0
    ((1, 1), (0, 0), (1, 1), 0),
])
def test_least_allocated(requested: tuple[int, int], allocatable: tuple[int, int], weights: tuple[int, int],
                         expected: int) -> None:
    assert least_allocated(requested, allocatable, weights) == expected


@pytest.mark.parametrize(("requested", "allocatable", "expected"), [
    # fractions 3000 / 4000 = 0.75 and 5000 / 10000 = 0.5; std |0.75 - 0.5| / 2 = 0.125; (1 - 0.125) * 100 = 87
    ((3000, 5000), (4000, 10000), 87),
    # 3000 / 6000 = 0.5 and 0.5: std 0; 100
    ((3000, 5000), (6000, 10000), 100),
    # 6000 / 4000 capped at 1 and 0.5: std 0.25; 75
    ((6000, 5000), (4000, 10000), 75),
    # one resource left (memory allocatable 0): std 0; 100
    ((3000, 5000), (4000, 0), 100),
    # three: 0.2, 0.4, 0.6, mean 0.4, std sqrt((0.04 + 0 + 0.04) / 3) = 0.1633; (1 - 0.1633) * 100 = 83
    ((2, 4, 6), (10, 10, 10), 83),
])
def test_balanced_allocation(requested: tuple[int, ...], allocatable: tuple[int, ...], expected: int) -> None:
    assert balanced_allocation(requested, allocatable) == expected


@pytest.mark.parametrize(("scores", "reverse", "expected"), [
    ([0, 0], True, [100, 100]),  # TaintToleration: no node has an intolerable PreferNoSchedule taint
    ([0, 0], False, [0, 0]),  # NodeAffinity: no preferred term matches
    ([1, 3], True, [67, 0]),  # 100 * 1 / 3 = 33, reversed 67; 100 * 3 / 3 = 100, reversed 0
    ([2, 4], False, [50, 100]),
])
def test_default_normalize(scores: list[int], reverse: bool, expected: list[int]) -> None:
    assert default_normalize(scores, reverse=reverse) == expected


@pytest.mark.parametrize(("score", "weight", "expected"), [
    (10, 1, 100),  # score * weight * (MaxNodeScore / MaxExtenderPriority) = 10 * 1 * (100 / 10)
    (7, 2, 140),
    (0, 5, 0),
])
def test_extender_scores_scale_by_ten_times_weight(score: int, weight: int, expected: int) -> None:
    assert extender_weighted(score, weight) == expected


@pytest.mark.parametrize(("totals", "randomizers", "expected"), [
    ([5, 7, 7], [0, 1, 9], 2),  # a tie on 7: the greater randomizer
    ([5, 7, 7], [0, 9, 1], 1),
    ([9, 7, 7], [0, 9, 1], 0),  # the greatest score whatever the randomizers
    ([3, 3, 3, 3], [0, 0, 0, 0], 0),  # full ties, no randomizer: Go's heap (Init, Pop) hands back the first
])
def test_pop_best_is_container_heap_order(totals: list[int], randomizers: list[int], expected: int) -> None:
    assert pop_best(totals, randomizers) == expected


@pytest.mark.parametrize(("percentage", "nodes", "expected"), [
    (0, 50, 50),  # under minFeasibleNodesToFind (100): all
    (0, 1000, 420),  # adaptive: 50 - 1000 / 125 = 42 %
    (0, 5000, 500),  # 50 - 40 = 10 %
    (0, 10000, 500),  # 50 - 80 < 5: 5 %
    (10, 200, 100),  # 20, raised to minFeasibleNodesToFind
    (100, 1213, 1213),  # what gpuplane's configuration sets
])
def test_num_feasible_nodes_to_find(percentage: int, nodes: int, expected: int) -> None:
    assert num_feasible_nodes_to_find(percentage, nodes) == expected


# ------------------------------------------------------------------ accounting
def pod_with(containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": containers, **spec}}


def box(requests: Mapping[str, str] | None = None, limits: Mapping[str, str] | None = None,
        **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = dict(requests)
    if limits is not None:
        resources["limits"] = dict(limits)
    return {"name": "c", "resources": resources, **extra}


@pytest.mark.parametrize(("pod", "expected"), [
    # two containers are summed
    (pod_with([box({"cpu": "1", "memory": "1Gi"}), box({"cpu": "500m"})]), {"cpu": 1500, "memory": 1024 * MI}),
    # a limit stands in for a missing request (the API server's defaulting); a request wins over its limit
    (pod_with([box(limits={"cpu": "2", RES_GPU: "1"}), box({"cpu": "1"}, {"cpu": "4"})]), {"cpu": 3000, RES_GPU: 1}),
    # an init container larger than the sum: max(1000, 3000)
    (pod_with([box({"cpu": "1"})], initContainers=[box({"cpu": "3"})]), {"cpu": 3000}),
    # a native sidecar (restartPolicy Always) adds to the sum, and runs beside the init containers after it:
    # containers 1 + sidecar 1 = 2; init 2 + sidecar 1 = 3; max(2, 3) = 3
    (pod_with([box({"cpu": "1"})], initContainers=[box({"cpu": "1"}, restartPolicy="Always"), box({"cpu": "2"})]),
     {"cpu": 3000}),
    # overhead is added
    (pod_with([box({"cpu": "1"})], overhead={"cpu": "250m", "memory": "120Mi"}), {"cpu": 1250, "memory": 120 * MI}),
    # pod-level requests replace the containers' for CPU and memory
    (pod_with([box({"cpu": "1", RES_GPU: "2"})], resources={"requests": {"cpu": "4"}}), {"cpu": 4000, RES_GPU: 2}),
])
def test_pod_requests(pod: dict[str, Any], expected: dict[str, int]) -> None:
    assert pod_requests(pod) == expected


def test_scoring_counts_containers_without_requests_as_100m_and_200mi() -> None:
    pod = pod_with([box(), box({"cpu": "1"}), box({"memory": "0"})])
    # container 1: 100m + 200Mi; container 2: 1000m + 200Mi; container 3: 100m + 0 (named, so not missing)
    assert pod_requests(pod, non_missing=NON_ZERO) == {"cpu": 1200, "memory": 2 * DEFAULT_MEMORY_REQUEST}
    assert pod_requests(pod) == {"cpu": 1000, "memory": 0}


# ------------------------------------------------------------------ taints and affinity
TAINT = {"key": "gpu", "value": "a100", "effect": "NoSchedule"}


@pytest.mark.parametrize(("toleration", "expected"), [
    ({"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}, True),
    ({"key": "gpu", "value": "a100"}, True),  # operator defaults to Equal; an empty effect matches every effect
    ({"key": "gpu", "value": "a100", "effect": "NoExecute"}, False),
    ({"key": "gpu", "value": "t4"}, False),
    ({"key": "gpu", "operator": "Exists"}, True),
    ({"operator": "Exists"}, True),  # an empty key with Exists tolerates everything
    ({"operator": "Exists", "effect": "PreferNoSchedule"}, False),
    ({"value": "a100"}, False),  # an empty key needs Exists
])
def test_tolerates_is_tolerates_taint(toleration: dict[str, str], expected: bool) -> None:
    assert tolerates(toleration, TAINT) is expected


LABELS = {"zone": "a", "gen": "9"}


@pytest.mark.parametrize(("expressions", "expected"), [
    ([{"key": "zone", "operator": "In", "values": ["a", "b"]}], True),
    ([{"key": "zone", "operator": "NotIn", "values": ["a"]}], False),
    ([{"key": "rack", "operator": "NotIn", "values": ["a"]}], True),  # an absent label is not in any set
    ([{"key": "zone", "operator": "Exists"}], True),
    ([{"key": "zone", "operator": "DoesNotExist"}], False),
    ([{"key": "gen", "operator": "Gt", "values": ["8"]}], True),
    ([{"key": "gen", "operator": "Lt", "values": ["8"]}], False),
    ([{"key": "zone", "operator": "In", "values": ["a"]}, {"key": "gen", "operator": "Lt", "values": ["9"]}], False),
    ([], False),  # an empty term matches nothing
])
def test_node_selector_terms(expressions: list[dict[str, Any]], expected: bool) -> None:
    assert term_matches({"matchExpressions": expressions}, LABELS, "n1") is expected


def test_node_affinity_filter_ands_the_selector_and_ors_the_terms() -> None:
    terms = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]},
             {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]
    pod = {"spec": {"nodeSelector": {"gen": "9"}, "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}}
    assert matches_node(pod, LABELS, "n1")  # the second term
    assert matches_node(pod, {"gen": "9"}, "n2")  # the first term
    assert not matches_node(pod, {"gen": "9"}, "n1")
    assert not matches_node(pod, {"zone": "a"}, "n1")  # the nodeSelector fails


# ------------------------------------------------------------------ the cycle over the API
@pytest.fixture
def api() -> Iterator[tuple[FakeApiServer, RestKubeApi]]:
    server = FakeApiServer().start()
    client = RestKubeApi.from_url(server.url)
    try:
        yield server, client
    finally:
        client.close()
        server.stop()


def no_extender() -> dict[str, Any]:
    config = scheduler_config()
    config["extenders"] = []
    return config


def test_default_filters_and_least_allocated_spread(api: tuple[FakeApiServer, RestKubeApi]) -> None:
    server, client = api
    server.add_node(node_json("busy", cpu="8", memory="32Gi"))
    server.add_node(node_json("quiet", cpu="8", memory="32Gi"))
    server.add_node(node_json("cordoned", cpu="64", memory="256Gi", unschedulable=True))
    server.add_node(node_json("tainted", cpu="64", memory="256Gi",
                              taints=[{"key": "dedicated", "value": "x", "effect": "NoSchedule"}]))
    server.add_node(node_json("elsewhere", cpu="64", memory="256Gi", labels={"zone": "b"}))
    server.add_pod(pod_json("resident", limits={"cpu": "4", "memory": "8Gi"}, node="busy", phase="Running"))
    for name in ("busy", "quiet", "cordoned", "tainted", "elsewhere"):
        server.mutate("nodes", name, lambda n: n["metadata"]["labels"].setdefault("zone", "a"))
    standin = StandInScheduler(client, no_extender(), seed=1).start()
    try:
        manifest = pod_json("p", limits={"cpu": "2", "memory": "4Gi"})
        manifest["spec"]["nodeSelector"] = {"zone": "a"}
        result = standin.schedule_one(client.create(pod_path("default"), manifest))
        # feasible: busy and quiet (cordoned, tainted: filtered; elsewhere: zone b)
        # quiet: LeastAllocated CPU (8000 - 2000) * 100 / 8000 = 75, memory (32 - 4) * 100 / 32 = 87, (75 + 87) / 2
        #   = 81; BalancedAllocation 2/8 = 0.25, 4/32 = 0.125, std 0.0625 -> 93; TaintToleration 100 (no
        #   PreferNoSchedule taints) x 3 = 300; NodeAffinity 0 (no preferred terms): 300 + 81 + 93 = 474
        # busy (a resident 4 CPU, 8Gi): LeastAllocated CPU 25, memory 62 -> 43; BalancedAllocation 6/8 = 0.75,
        #   12/32 = 0.375, std 0.1875 -> 81; 300 + 43 + 81 = 424
        assert result.scores == {"busy": 424, "quiet": 474}
        assert result.node == "quiet", result
        bound = server.get("pods", "default/p")
        assert bound is not None and bound["spec"]["nodeName"] == "quiet"  # DefaultBinder: the Binding
        big = client.create(pod_path("default"), pod_json("big", limits={"cpu": "100"}))
        failed = standin.schedule_one(big)
        assert failed.node is None
        assert "Insufficient cpu" in failed.message and ERR_UNSCHEDULABLE in failed.message
        assert "untolerated taint {dedicated: x}" in failed.message
    finally:
        standin.close()


def test_unimplemented_constraints_are_refused_by_name(api: tuple[FakeApiServer, RestKubeApi]) -> None:
    server, client = api
    for name in ("n1", "n2"):
        server.add_node(node_json(name))
    standin = StandInScheduler(client, no_extender()).start()
    try:
        pod = pod_json("p", limits={"cpu": "1"})
        pod["spec"]["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": "zone",
                                                    "whenUnsatisfiable": "ScheduleAnyway"}]
        with pytest.raises(StandInError, match=r"spec\.topologySpreadConstraints"):
            standin.schedule_one(client.create(pod_path("default"), pod))
        owned = pod_json("q", limits={"cpu": "1"})
        owned["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "controller": True,
                                                 "apiVersion": "apps/v1", "uid": "u"}]
        with pytest.raises(StandInError, match="ownerReferences"):
            standin.schedule_one(client.create(pod_path("default"), owned))
    finally:
        standin.close()


def test_extended_resources_are_counted_against_allocatable_and_ignored_ones_are_not(
        api: tuple[FakeApiServer, RestKubeApi]) -> None:
    server, client = api
    node = node_json("n1")
    node["status"]["allocatable"][RES_GPU] = "2"
    server.add_node(node)
    standin = StandInScheduler(client, no_extender()).start()  # gpuplane's pluginConfig, no extender
    try:
        # gpucores is in NodeResourcesFit's ignoredResources (no node advertises it); gpuplane.io/gpu counts:
        # 2 fit, the third does not
        for i in range(2):
            pod = client.create(pod_path("default"), pod_json(f"p{i}", limits={RES_GPU: "1", RES_CORES: "50"}))
            assert standin.schedule_one(pod).node == "n1"
        third = standin.schedule_one(client.create(pod_path("default"), pod_json("p2", limits={RES_GPU: "1"})))
        assert third.node is None and f"Insufficient {RES_GPU}" in third.message
        assert ERR_AFFINITY not in third.message
    finally:
        standin.close()


@pytest.mark.parametrize(("plugin_config", "extender_ignores", "counted"), [
    # the args' ignoredResources
    ([{"name": "NodeResourcesFit", "args": {"ignoredResources": ["example.com/a"]}}], [], "example.com/b"),
    # a whole group (the part before the slash)
    ([{"name": "NodeResourcesFit", "args": {"ignoredResourceGroups": ["example.com"]}}], [], "other.io/b"),
    # the extenders' ignoredByScheduler resources replace the args' (buildExtenders)
    ([{"name": "NodeResourcesFit", "args": {"ignoredResources": ["example.com/b"]}}], ["example.com/a"],
     "example.com/b"),
])
def test_ignored_resources(api: tuple[FakeApiServer, RestKubeApi], plugin_config: list[dict[str, Any]],
                           extender_ignores: list[str], counted: str) -> None:
    _, client = api
    config = no_extender()
    config["profiles"][0]["pluginConfig"] = plugin_config
    if extender_ignores:
        config["extenders"] = [{"urlPrefix": "http://127.0.0.1:1/x", "managedResources": [
            {"name": name, "ignoredByScheduler": True} for name in extender_ignores]}]
    standin = StandInScheduler(client, config)
    assert not standin._ignores(counted)
    assert standin._ignores("example.com/a")
    assert not standin._ignores("cpu")


def test_other_plugin_configuration_is_refused(api: tuple[FakeApiServer, RestKubeApi]) -> None:
    _, client = api
    config = no_extender()
    config["profiles"][0]["pluginConfig"] = [{"name": "NodeResourcesFit", "args": {
        "scoringStrategy": {"type": "MostAllocated"}}}]
    with pytest.raises(StandInError, match=r"pluginConfig\[0\]"):
        StandInScheduler(client, config)


def test_an_extender_without_managed_resources_is_asked_about_every_pod() -> None:
    cpu_only = pod_json("p", limits={"cpu": "1"})
    assert managed_by(cpu_only, frozenset())
    assert not managed_by(cpu_only, frozenset({RES_GPU}))
    assert managed_by(pod_json("g", limits={RES_GPU: "1"}), frozenset({RES_GPU}))


# ------------------------------------------------------------------ the fill through the extender
CATALOG = default_catalog()


def fill_inputs(nodes: int, pods: int, *, gpu_only: bool) -> tuple[list[Any], list[Any], Any]:
    specs = load_nodes(bundled_path("nodes"), CATALOG)[:nodes]
    requests = [p.request for p in load_pods(resolve_trace("default"), CATALOG)]
    if gpu_only:
        requests = [r for r in requests if r.gpu_milli_total]
    return specs, requests, TypicalPods.from_workload(requests)


def profile_of(policy: str, typical: Any) -> Profile:
    return default_registry().build(policy_config(policy, None, seed=42, typical=typical))


@pytest.mark.parametrize("policy", ["binpack", "fgd"])
def test_fill_through_the_extender_is_the_simulators_pod_by_pod(policy: str) -> None:
    # Every pod (CPU-only ones too: the configuration has no managedResources) goes through the extender, whose
    # filter answers gpuplane's pick; kube-scheduler, left with one node, binds there. Same seed, same tuned
    # workload: the same node and cards for every pod.
    specs, requests, typical = fill_inputs(24, 0, gpu_only=False)
    assert any(not r.gpu_milli_total for r in requests)
    simulated = run_fill(CATALOG, specs, requests, profile_of(policy, typical), seed=42, record_placements=True)
    workload = tune_workload(requests, sum(s.gpus for s in specs) * 1000, 42)  # what run_fill replayed
    through = fill_through_extender(CATALOG, specs, workload, profile_of(policy, typical), seed=42)
    assert through.pods == simulated.submitted == len(workload) and through.placed == simulated.placed
    assert [(p.node, p.cards) for p in through.placements] == [(p.node, tuple(p.cards)) for p in simulated.placements]
    assert list(through.allocation_pct) == pytest.approx(list(simulated.allocation_pct))
    assert through.unallocated_at(100.0) == pytest.approx(simulated.unallocated_at(100.0))


def test_feasible_answers_let_kube_schedulers_scorers_in() -> None:
    # With every feasible node passed, kube-scheduler's LeastAllocated and BalancedAllocation (weights 1 + 1)
    # sit beside the extender's 0…10 × 10: binpack is overridden for some pods, which `chosen` prevents.
    specs, requests, typical = fill_inputs(24, 0, gpu_only=True)
    workload = tune_workload(requests, sum(s.gpus for s in specs) * 1000, 42)[:20]
    chosen = fill_through_extender(CATALOG, specs, workload, profile_of("binpack", typical), seed=42)
    feasible = fill_through_extender(CATALOG, specs, workload, profile_of("binpack", typical), seed=42,
                                     filter_answers=FilterAnswers.FEASIBLE)
    assert feasible.filter_answers == "feasible"
    assert [p.node for p in feasible.placements] != [p.node for p in chosen.placements]
    used_chosen = {p.node for p in chosen.placements if p.node}
    used_feasible = {p.node for p in feasible.placements if p.node}
    assert len(used_feasible) > len(used_chosen)  # spread over more nodes
