"""kube-scheduler's HTTP extender over real HTTP on loopback, with kube-scheduler's exact JSON.

Worlds are `SimCluster`s (a cluster port); pods are `v1.Pod` JSON read through `gpuplane.kube.objects`. Most tests
run with `--filter-answers feasible` (every node that fits passes, so each node's verdict can be checked); the
`chosen` tests (the default: only gpuplane's pick passes) are in their own section.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
import yaml
from typer.testing import CliRunner

from builders import CATALOG, node
from gpuplane.cli.extender_cmd import build_profile, load_world, register, sample_pod
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.extender import (
    PLACED_ELSEWHERE,
    UNKNOWN_NODE,
    VERBS,
    Extender,
    ExtenderBindingArgs,
    ExtenderFilterResult,
    ExtenderPreemptionResult,
    ExtenderServer,
    FilterAnswers,
    HostPriority,
    VictimPod,
    Victims,
    dumps,
    extender_scores,
    scheduler_config,
)
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import (
    ASSIGNMENT,
    INVENTORY,
    MANAGED_RESOURCES,
    RES_GPU,
    CardInventory,
    NodeInventory,
    decode_assignment,
    pod_request,
)
from gpuplane.model import Assignment, NodeSpec, PodRequest
from gpuplane.port import EventKind, NodeInfo, PodPhase, Status
from gpuplane.scheduler import CycleState, Framework, Scheduler
from gpuplane.sim.cluster import SimCluster

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ harness
class Client:
    """One keep-alive HTTP/1.1 connection, as kube-scheduler's Go client keeps one."""

    def __init__(self, address: tuple[str, int], prefix: str) -> None:
        self.address = address
        self.prefix = prefix
        self.conn = http.client.HTTPConnection(*address, timeout=30)

    def post(self, verb: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        self.conn.request("POST", f"{self.prefix}/{verb}", data, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = response.read()
        return response.status, json.loads(payload) if payload else None

    def close(self) -> None:
        self.conn.close()


@contextmanager
def serving(world: SimCluster, *, policy: str = "binpack", answers: FilterAnswers = FilterAnswers.FEASIBLE,
            seed: int = 0) -> Iterator[tuple[Extender, Client]]:
    extender = Extender(world, CATALOG, build_profile(policy, None), filter_answers=answers, seed=seed)
    server = ExtenderServer(extender, port=0).start()
    client = Client(server.address, server.prefix)
    try:
        yield extender, client
    finally:
        client.close()
        server.close()
        extender.close()


def args(pod: dict[str, Any], names: Sequence[str] | None) -> dict[str, Any]:
    """`ExtenderArgs` as kube-scheduler sends it with nodeCacheCapable: true."""
    return {"Pod": pod, "Nodes": None, "NodeNames": None if names is None else list(names)}


def world_of(*specs: NodeSpec) -> SimCluster:
    return SimCluster(CATALOG, list(specs))


def pending(world: SimCluster, pod: dict[str, Any]) -> PodRequest:
    """Create the pod in the world (kube-scheduler only binds pods that exist)."""
    request = pod_request(pod, CATALOG)
    assert world.create_pod(request).ok
    return request


def bind_args(pod: dict[str, Any], node_name: str) -> dict[str, Any]:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node_name}


# ------------------------------------------------------------------ golden wire fixtures (protocols.md §1.4)
def test_golden_fixtures_from_types_test_go() -> None:
    binding = b'{"PodName":"mypodname","PodNamespace":"mypodnamespace","PodUID":"mypoduid","Node":"mynode"}'
    decoded = ExtenderBindingArgs.decode(json.loads(binding))
    assert decoded == ExtenderBindingArgs("mypodname", "mypodnamespace", "mypoduid", "mynode")
    assert dumps(decoded.encode()) == binding
    assert dumps(HostPriority("myhost", 1).encode()) == b'{"Host":"myhost","Score":1}'
    victims = ExtenderPreemptionResult({"foo": Victims((VictimPod("myuid"),), 1)})
    assert dumps(victims.encode()) == (
        b'{"NodeNameToMetaVictims":{"foo":{"Pods":[{"UID":"myuid"}],"NumPDBViolations":1}}}')
    # ExtenderFilterResult in Go's field order, null pointers as null, maps always present.
    assert dumps(ExtenderFilterResult(None, ["a"]).encode()) == (
        b'{"Nodes":null,"NodeNames":["a"],"FailedNodes":{},"FailedAndUnresolvableNodes":{},"Error":""}')


def test_binding_args_read_keys_in_any_case_last_wins() -> None:
    # Go's encoding/json folds case; of two keys naming one field the later one wins.
    doc = {"podname": "a", "PODNAMESPACE": "ns", "PodUid": "u", "node": "n1", "PodName": "b"}
    assert ExtenderBindingArgs.decode(doc) == ExtenderBindingArgs("b", "ns", "u", "n1")
    assert ExtenderBindingArgs.decode({"PodName": "b", "podname": "a", "Node": "n"}).pod_name == "a"


# ------------------------------------------------------------------ filter
def test_filter_node_cache_capable_answers_names_and_lists_every_rejection() -> None:
    world = world_of(node("a100").gpus(2, model="A100-40GB").obj(), node("t4").gpus(2, model="T4").obj(),
                     node("small").gpus(1, model="A100-40GB").obj())
    pod = sample_pod("train", cards=2, models=("A100-40GB",))
    with serving(world) as (_, client):
        status, body = client.post("filter", args(pod, ["a100", "t4", "small", "ghost"]))
    assert status == 200
    assert list(body) == ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
    assert body["Nodes"] is None and body["Error"] == ""
    assert body["NodeNames"] == ["a100"]
    # small: an A100 with one card: 2 cards never fit there, but freeing capacity is what preemption does,
    # so the framework marks card counts resolvable; T4 is the wrong model (unresolvable); ghost is unknown.
    assert set(body["FailedNodes"]) | set(body["FailedAndUnresolvableNodes"]) == {"t4", "small", "ghost"}
    assert not set(body["FailedNodes"]) & set(body["FailedAndUnresolvableNodes"])
    assert "t4" in body["FailedAndUnresolvableNodes"]
    assert body["FailedAndUnresolvableNodes"]["ghost"] == UNKNOWN_NODE


def test_filter_reasons_and_resolvability_are_the_frameworks() -> None:
    world = world_of(node("full").gpus(1, model="A100-40GB").obj(), node("t4").gpus(4, model="T4").obj(),
                     node("cordoned").gpus(4, model="A100-40GB").unschedulable().obj(),
                     node("free").gpus(4, model="A100-40GB").obj())
    hog = pending(world, sample_pod("hog", cards=1))
    filler = Framework(build_profile("binpack", None), np.random.default_rng(0))
    decision = filler.schedule(hog, world.state, within=np.array([True, False, False, False]))
    assert decision.assignment is not None and world.bind(hog.name, decision.assignment).ok
    pod = sample_pod("p", cards=1, models=("A100-40GB",))
    request = pod_request(pod, CATALOG)
    with serving(world) as (extender, client):
        _, body = client.post("filter", args(pod, ["full", "t4", "cordoned", "free"]))
        expected, diagnosis = extender.scheduler.framework.find_nodes(CycleState(), request,
                                                                      extender.scheduler.state)
    assert diagnosis is not None
    names = ["full", "t4", "cordoned", "free"]
    assert body["NodeNames"] == [n for i, n in enumerate(names) if expected[i]] == ["free"]
    for i, name in enumerate(names[:3]):
        reason = diagnosis.node_reason(i)
        unresolvable = int(diagnosis.reason_of[i]) in diagnosis.unresolvable
        assert (body["FailedAndUnresolvableNodes"] if unresolvable else body["FailedNodes"])[name] == reason
    assert "full" in body["FailedNodes"]  # one card, taken: preemption can free it
    assert "t4" in body["FailedAndUnresolvableNodes"]  # wrong model: preemption cannot help


def test_filter_with_node_objects_answers_the_passing_objects() -> None:
    world = world_of(node("n1").gpus(2, model="A100-40GB").obj(), node("n2").gpus(2, model="T4").obj())
    items = [{"metadata": {"name": "n1", "labels": {"zone": "a"}}, "status": {"allocatable": {"cpu": "8"}}},
             {"metadata": {"name": "n2"}}]
    pod = sample_pod("p", cards=1, models=("A100-40GB",))
    with serving(world) as (_, client):
        status, body = client.post("filter", {"Pod": pod, "Nodes": {"metadata": {}, "items": items},
                                              "NodeNames": None})
    assert status == 200
    assert body["NodeNames"] is None
    assert body["Nodes"] == {"metadata": {}, "items": [items[0]]}  # the object as sent, untouched
    assert list(body["FailedAndUnresolvableNodes"]) == ["n2"]


@pytest.mark.parametrize("lists", [{}, {"Nodes": None, "NodeNames": None}, {"nodes": None}])
def test_filter_with_no_list_answers_an_empty_list_not_null(lists: dict[str, Any]) -> None:
    world = world_of(node("n1").gpus(2).obj())
    with serving(world) as (_, client):
        status, body = client.post("filter", {"Pod": sample_pod("p"), **lists})
    assert status == 200 and body["Error"] == ""
    assert body["NodeNames"] == []  # kube-scheduler reads null as "all filtered out" too; we say it plainly


def test_filter_all_pass_still_returns_the_list() -> None:
    world = world_of(node("n1").gpus(2).obj(), node("n2").gpus(2).obj())
    with serving(world) as (_, client):
        _, body = client.post("filter", args(sample_pod("p"), ["n2", "n1"]))
    assert body["NodeNames"] == ["n2", "n1"] and body["FailedNodes"] == {}


def test_filter_reads_case_variants_and_writes_exact_names() -> None:
    world = world_of(node("n1").gpus(2).obj())
    with serving(world) as (_, client):
        status, body = client.post("filter", {"pod": sample_pod("p"), "nodenames": ["n1"], "NODES": None})
    assert status == 200 and body["NodeNames"] == ["n1"]
    assert "Nodes" in body and "nodenames" not in body


def test_filter_bad_pod_is_an_error_result_naming_the_field() -> None:
    world = world_of(node("n1").gpus(2).obj())
    pod = sample_pod("p")
    for kind in ("limits", "requests"):
        pod["spec"]["containers"][0]["resources"][kind][RES_GPU] = "1.5"
    with serving(world) as (_, client):
        status, body = client.post("filter", args(pod, ["n1"]))
        assert status == 200 and RES_GPU in body["Error"] and "whole" in body["Error"]
        status, body = client.post("filter", args({"metadata": {"name": "x"}}, ["n1"]))
        assert status == 200 and "spec" in body["Error"]
        status, body = client.post("filter", raw=b"{not json")
        assert status == 200 and body["Error"].startswith("body is not JSON")
        status, body = client.post("filter", {"Pod": "nope", "NodeNames": ["n1"]})
        assert status == 200 and body["Error"] == "Pod: must be an object, got str"
        # prioritize has no error field: a 400 with one
        status, body = client.post("prioritize", {"Pod": pod, "NodeNames": ["n1"]})
        assert status == 400 and RES_GPU in body["Error"]


def test_request_is_parsed_once_per_uid_and_resource_version() -> None:
    world = world_of(node("a").gpus(2, model="A100-40GB").obj(), node("t").gpus(2, model="T4").obj())
    with serving(world) as (_, client):
        first = sample_pod("p", uid="u1", resource_version="7")
        _, body = client.post("filter", args(first, ["a", "t"]))
        assert body["NodeNames"] == ["a", "t"]
        # Same uid and resourceVersion: the cached request stands (the API bumps the version on every change).
        same = sample_pod("p", uid="u1", resource_version="7", models=("T4",))
        _, body = client.post("filter", args(same, ["a", "t"]))
        assert body["NodeNames"] == ["a", "t"]
        newer = sample_pod("p", uid="u1", resource_version="8", models=("T4",))
        _, body = client.post("filter", args(newer, ["a", "t"]))
        assert body["NodeNames"] == ["t"]


# ------------------------------------------------------------------ prioritize
@pytest.mark.parametrize(("scores", "expected"), [
    ([20.0, 45.0, 70.0], [0, 5, 10]),  # 10 × (45 − 20) / (70 − 20) = 5
    ([50.0, 50.0], [10, 10]),  # a tie: every node is as good as the best
    ([0.0, 33.3, 100.0], [0, 3, 10]),  # 10 × 33.3 / 100 = 3.33 → 3
    ([10.0, 10.5, 11.0], [0, 5, 10]),  # a narrow spread keeps its order (absolute scaling would give 1, 1, 1)
    ([1.0, 1.96, 2.0], [0, 10, 10]),  # 9.6 rounds to 10
    ([], []),
])
def test_extender_scores_min_max_to_0_10(scores: list[float], expected: list[int]) -> None:
    assert extender_scores(np.array(scores, np.float64)).tolist() == expected


def test_prioritize_scores_0_10_in_the_frameworks_order() -> None:
    specs = [node(f"n{i}").gpus(4, model="A100-40GB").obj() for i in range(5)]
    world = world_of(*specs)
    framework = Framework(build_profile("binpack", None), np.random.default_rng(1))
    # Load the nodes unevenly: node i holds i single-card pods (n4: all four cards taken).
    for i in range(5):
        for j in range(i):
            request = pending(world, sample_pod(f"h{i}-{j}"))
            only = np.zeros(5, np.bool_)
            only[i] = True
            decision = framework.schedule(request, world.state, within=only)
            assert decision.assignment is not None and world.bind(request.name, decision.assignment).ok
    pod = sample_pod("p", cards=1)
    names = [f"n{i}" for i in range(5)] + ["ghost"]
    with serving(world) as (extender, client):
        status, body = client.post("prioritize", args(pod, names))
        request = pod_request(pod, CATALOG)
        cycle = CycleState()
        alive, _ = extender.scheduler.framework.find_nodes(cycle, request, extender.scheduler.state)
        feasible = np.flatnonzero(alive)
        raw = extender.scheduler.framework.score_nodes(cycle, request, extender.scheduler.state, feasible)
    assert status == 200 and isinstance(body, list)
    assert [entry["Host"] for entry in body] == names and all(list(e) == ["Host", "Score"] for e in body)
    score = {entry["Host"]: entry["Score"] for entry in body}
    assert all(0 <= s <= 10 for s in score.values())
    assert score["n4"] == 0 and score["ghost"] == 0  # full, unknown
    framework_score = {f"n{int(i)}": float(s) for i, s in zip(feasible, raw, strict=True)}
    assert sorted(framework_score) == ["n0", "n1", "n2", "n3"]
    for a in framework_score:
        for b in framework_score:
            if framework_score[a] > framework_score[b]:
                assert score[a] >= score[b]
    best = max(framework_score, key=framework_score.__getitem__)
    worst = min(framework_score, key=framework_score.__getitem__)
    assert (score[best], score[worst]) == (10, 0)
    assert best == "n3"  # binpack: the fullest node that still fits


# ------------------------------------------------------------------ bind
def test_bind_records_the_cards_through_the_port() -> None:
    world = world_of(node("n1").gpus(2, model="A100-40GB").obj())
    hog = sample_pod("hog", cards=1)
    pod = sample_pod("p", cards=1)
    pending(world, hog)
    request = pending(world, pod)
    with serving(world) as (extender, client):
        assert client.post("bind", bind_args(hog, "n1")) == (200, {"Error": ""})
        taken = world.get_pod("default/hog")
        assert taken is not None and taken.assignment is not None
        _, body = client.post("filter", args(pod, ["n1"]))
        assert body["NodeNames"] == ["n1"]
        assert client.post("bind", bind_args(pod, "n1")) == (200, {"Error": ""})
        info = world.get_pod(request.name)
        assert info is not None and info.phase is PodPhase.RUNNING and info.assignment is not None
        assert info.assignment.node == "n1"
        # Two cards, the hog holds one: the pod got the other, whole.
        assert {info.assignment.card_indexes, taken.assignment.card_indexes} == {(0,), (1,)}
        assert info.assignment.cards[0].whole
        cache = extender.scheduler.state
        assert cache.bindings[request.name].assignment == info.assignment
        assert cache.fingerprint() == world.state.fingerprint()


def test_bind_errors_are_in_the_result() -> None:
    world = world_of(node("n1").gpus(1, model="A100-40GB").obj(), node("t4").gpus(1, model="T4").obj())
    first, second, fussy = sample_pod("a"), sample_pod("b"), sample_pod("c", models=("A100-40GB",))
    for pod in (first, second, fussy):
        pending(world, pod)
    with serving(world) as (extender, client):
        assert client.post("bind", bind_args(first, "n1")) == (200, {"Error": ""})
        _, body = client.post("bind", bind_args(first, "n1"))
        assert body["Error"] == "pod default/a is not pending in gpuplane's view of the cluster"
        client.post("filter", args(first, ["n1"]))  # now the request is cached: the cache says where it is
        _, body = client.post("bind", bind_args(first, "n1"))
        assert body["Error"] == "pod default/a is already placed on n1"
        _, body = client.post("bind", bind_args(second, "n1"))
        assert "no longer fits on node n1" in body["Error"]
        _, body = client.post("bind", bind_args(fussy, "t4"))
        assert "no longer fits on node t4" in body["Error"]
        _, body = client.post("bind", bind_args(second, "ghost"))
        assert "node ghost" in body["Error"]
        _, body = client.post("bind", {**bind_args(second, "t4"), "PodName": "nobody", "PodUID": "x"})
        assert "default/nobody is not pending" in body["Error"]
        status, body = client.post("bind", {"PodName": 3, "Node": "t4"})
        assert status == 200 and body["Error"] == "PodName: must be a string, got int"
        assert extender.scheduler.state.fingerprint() == world.state.fingerprint()


class RefusingPort(SimCluster):
    """A world whose API refuses binds (a webhook, a conflict): the extender must give the cards back."""

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        return Status.error(f"conflict: pod {pod} was modified")


def test_bind_refused_by_the_port_releases_the_reservation() -> None:
    world = RefusingPort(CATALOG, [node("n1").gpus(1).obj()])
    pod = sample_pod("p")
    request = pending(world, pod)
    with serving(world) as (extender, client):
        _, body = client.post("bind", bind_args(pod, "n1"))
        assert body["Error"] == "bind default/p to n1: conflict: pod default/p was modified"
        assert request.name not in extender.scheduler.state.bindings
        _, body = client.post("filter", args(pod, ["n1"]))
        assert body["NodeNames"] == ["n1"]  # the card is free again


class SlowPort(SimCluster):
    """A world whose binds take a millisecond, like an API round trip: decisions overlap binds in flight."""

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        time.sleep(0.001)
        return super().bind(pod, assignment, node_version=node_version)


def test_parallel_binds_never_over_allocate_a_card() -> None:
    # 6 nodes × 4 A100s = 24 cards; 80 pods of mixed shapes race for them from 8 connections, each binding
    # to a node its filter passed (often the same node another thread is binding to).
    world = SlowPort(CATALOG, [node(f"n{i}").gpus(4, model="A100-40GB").obj() for i in range(6)])
    rng = random.Random(5)
    shapes: list[dict[str, Any]] = [{"cards": 1}, {"cards": 2}, {"cards": 1, "cores": 50, "memory_mib": 10000},
                                    {"cards": 1, "cores": 30, "memory_mib": 4000}, {"cards": 4}]
    pods = [sample_pod(f"p{i}", **rng.choice(shapes)) for i in range(80)]
    for pod in pods:
        pending(world, pod)
    names = [f"n{i}" for i in range(6)]
    errors: list[str] = []
    bound: list[str] = []
    with serving(world) as (extender, main):

        def worker(share: list[dict[str, Any]], seed: int) -> None:
            local = random.Random(seed)
            client = Client(main.address, main.prefix)
            try:
                for pod in share:
                    for _ in range(10):  # kube-scheduler retries a pod whose bind failed
                        _, body = client.post("filter", args(pod, names))
                        if body["Error"] or not body["NodeNames"]:
                            errors.extend([body["Error"]] if body["Error"] else [])
                            break
                        target = local.choice(body["NodeNames"][:2])
                        _, result = client.post("bind", bind_args(pod, target))
                        if not result["Error"]:
                            bound.append(pod["metadata"]["name"])
                            break
                        errors.append(result["Error"])
            finally:
                client.close()

        threads = [threading.Thread(target=worker, args=(pods[k::8], k)) for k in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        cache = extender.scheduler.state
        assert cache.check_invariants() == []
        assert cache.fingerprint() == world.state.fingerprint()
        # No capacity leaked: every pod still pending fits nowhere.
        for pod in pods:
            if pod["metadata"]["name"] not in bound:
                assert main.post("filter", args(pod, names))[1]["NodeNames"] == []
    assert world.state.check_invariants() == []
    # The port never saw a conflicting bind: every decision was taken against the assumed reservations.
    assert not [e for e in errors if "conflict" in e], errors
    # Only "lost the race" answers: a filter passed a node that another thread's bind then filled.
    assert all("no longer fits" in e for e in errors), errors
    running = [p for p in world.list_pods() if p.phase is PodPhase.RUNNING]
    assert sorted(p.request.name.split("/")[1] for p in running) == sorted(bound)
    milli = np.zeros((6, 4), np.int64)
    for info in running:
        assert info.assignment is not None
        for share in info.assignment.cards:
            milli[int(info.assignment.node[1:]), share.card] += share.compute_milli
    assert (milli <= 1000).all()


class GatedPort(SimCluster):
    """A world that records every bind it is sent and holds the binds of `gated` pods until `opened`; its
    nodes can change shape (a node agent publishing a new inventory), which rebuilds the scheduler's cache."""

    def __init__(self, specs: Sequence[NodeSpec], gated: set[str]) -> None:
        super().__init__(CATALOG, list(specs))
        self.gated = gated
        self.sent: list[tuple[str, Assignment]] = []
        self.entered = threading.Event()
        self.opened = threading.Event()

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        self.sent.append((pod, assignment))
        if pod in self.gated:
            self.entered.set()
            assert self.opened.wait(10)
        return super().bind(pod, assignment, node_version=node_version)

    def reshape(self, spec: NodeSpec) -> None:
        info = self._nodes[spec.name]
        self._nodes[spec.name] = NodeInfo(spec, info.resource_version + 1)
        self._emit(EventKind.NODE_UPDATED, node=self._nodes[spec.name])


def cards_sent_twice(sent: Sequence[tuple[str, Assignment]]) -> list[tuple[str, int]]:
    seen: dict[tuple[str, int], str] = {}
    twice = []
    for pod, assignment in sent:
        for card in assignment.card_indexes:
            if seen.setdefault((assignment.node, card), pod) != pod:
                twice.append((assignment.node, card))
    return twice


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_cache_rebuilt_while_a_bind_is_in_flight_keeps_its_cards() -> None:
    # n1 has one card. a's bind is in the port (held at the gate) when n2 changes shape, which rebuilds the
    # cache from the lists, where a is still pending. b, filtered and bound meanwhile, must not get a's card.
    world = GatedPort([node("n1").gpus(1).obj(), node("n2").gpus(1, model="T4").obj()], {"default/a"})
    first, second = sample_pod("a"), sample_pod("b", models=("A100-40GB",))
    pending(world, first)
    pending(world, second)
    with serving(world) as (extender, client):
        results: dict[str, str] = {}

        def bind(pod: dict[str, Any]) -> None:
            results[pod["metadata"]["name"]] = extender.bind(ExtenderBindingArgs.decode(bind_args(pod, "n1"))).error

        racer = threading.Thread(target=bind, args=(first,))
        other = threading.Thread(target=bind, args=(second,))
        racer.start()
        try:
            assert world.entered.wait(10)
            world.reshape(node("n2").gpus(1, model="T4").cpu(16000).obj())
            assert extender.scheduler.state.nodes[1].cpu_milli == 16000     # the cache was rebuilt
            _, body = client.post("filter", args(second, ["n1"]))
            if body["NodeNames"]:                                           # before the fix: a's card looked free
                other.start()
                wait_until(lambda: "default/b" in extender.scheduler.state.bindings or not other.is_alive())
        finally:
            world.opened.set()
            racer.join()
            if other.ident is not None:
                other.join()
    assert cards_sent_twice(world.sent) == [], world.sent
    assert results["a"] == ""                                           # a kept its reservation and bound
    assert body["NodeNames"] == [] and "default/b" not in results
    assert world.state.check_invariants() == []


def test_a_bind_whose_reservation_a_rebuild_dropped_fails_without_binding() -> None:
    # c's bind holds the port; a is decided and assumed on n2 and waits for the port. n2 then loses its card:
    # the rebuilt cache cannot hold a's reservation, so a's bind answers an error and never reaches the port.
    world = GatedPort([node("n1").gpus(1).obj(), node("n2").gpus(1).obj()], {"default/c"})
    first, blocker = sample_pod("a"), sample_pod("c")
    pending(world, first)
    pending(world, blocker)
    with serving(world) as (extender, client):
        assert client.post("filter", args(first, ["n2"]))[1]["NodeNames"] == ["n2"]   # its request is cached
        results: dict[str, str] = {}

        def bind(pod: dict[str, Any], target: str) -> None:
            results[pod["metadata"]["name"]] = extender.bind(ExtenderBindingArgs.decode(bind_args(pod, target))).error

        holder = threading.Thread(target=bind, args=(blocker, "n1"))
        waiter = threading.Thread(target=bind, args=(first, "n2"))
        holder.start()
        try:
            assert world.entered.wait(10)
            waiter.start()
            wait_until(lambda: "default/a" in extender.scheduler.state.bindings)
            world.reshape(node("n2").cpu(64000).obj())                      # no cards any more
            assert "default/a" not in extender.scheduler.state.bindings
            assert extender.scheduler.state.bindings["default/c"].assignment.node == "n1"   # in flight: kept
        finally:
            world.opened.set()
            holder.join()
            if waiter.ident is not None:
                waiter.join()
    assert results == {"c": "", "a": "bind default/a to n2: no longer reserved (its cards were released while "
                                      "the bind waited)"}
    assert [pod for pod, _ in world.sent] == ["default/c"]


# ------------------------------------------------------------------ preempt
def preemption_world() -> tuple[SimCluster, dict[str, dict[str, Any]]]:
    """n1: 2 A100s, each held by a low-priority whole-card pod (lo1 on one, lo2 on the other).
    n2: 2 A100s, each held by two half-card pods (s1, s2 on one card; s3, s4 on the other)."""
    world = world_of(node("n1").gpus(2, model="A100-40GB").obj(), node("n2").gpus(2, model="A100-40GB").obj())
    pods = {name: sample_pod(name) for name in ("lo1", "lo2")}
    pods |= {name: sample_pod(name, cores=50, memory_mib=10000) for name in ("s1", "s2", "s3", "s4")}
    for pod in pods.values():
        pending(world, pod)
    return world, pods


def meta_victims(pods: dict[str, dict[str, Any]], *names: str, pdb: int = 0) -> dict[str, Any]:
    return {"Pods": [{"UID": pods[n]["metadata"]["uid"]} for n in names], "NumPDBViolations": pdb}


def test_preempt_trims_to_the_victims_needed_and_answers_uids_only() -> None:
    world, pods = preemption_world()
    preemptor = sample_pod("urgent", cards=1)
    with serving(world) as (extender, client):
        for name in ("lo1", "lo2"):
            assert client.post("bind", bind_args(pods[name], "n1"))[1] == {"Error": ""}
        for name in ("s1", "s2", "s3", "s4"):
            assert client.post("bind", bind_args(pods[name], "n2"))[1] == {"Error": ""}
        before = extender.scheduler.state.fingerprint()
        status, body = client.post("preempt", {
            "Pod": preemptor, "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {"n1": meta_victims(pods, "lo1", "lo2", pdb=1),
                                      "n2": meta_victims(pods, "s1", "s3")}})
        assert extender.scheduler.state.fingerprint() == before  # the what-if left the cache as it was
    assert status == 200 and list(body) == ["NodeNameToMetaVictims"]
    answer = body["NodeNameToMetaVictims"]
    # n1: one whole card is enough; of two equal victims the first by name is reprieved, lo2 goes.
    assert answer["n1"] == {"Pods": [{"UID": pods["lo2"]["metadata"]["uid"]}], "NumPDBViolations": 1}
    # n2: evicting s1 and s3 leaves half of each card taken: no whole card frees up, so n2 is vetoed.
    assert "n2" not in answer


def test_preempt_with_whole_pods_and_unknown_uids() -> None:
    world, pods = preemption_world()
    preemptor = sample_pod("urgent", cards=1)
    with serving(world) as (_, client):
        for name in ("lo1", "lo2"):
            client.post("bind", bind_args(pods[name], "n1"))
        for name in ("s1", "s2", "s3", "s4"):
            client.post("bind", bind_args(pods[name], "n2"))
        # Not cache-capable: kube-scheduler sends the victims whole; the answer is still UIDs.
        _, body = client.post("preempt", {"Pod": preemptor, "NodeNameToVictims": {
            "n2": {"Pods": [pods["s1"], pods["s2"]], "NumPDBViolations": 0}}, "NodeNameToMetaVictims": None})
        assert body == {"NodeNameToMetaVictims": {"n2": {
            "Pods": [{"UID": pods["s1"]["metadata"]["uid"]}, {"UID": pods["s2"]["metadata"]["uid"]}],
            "NumPDBViolations": 0}}}
        # A UID we cannot name: we cannot judge that node, so it passes as sent.
        unknown = {"Pods": [{"UID": "who-knows"}], "NumPDBViolations": 2}
        _, body = client.post("preempt", {"Pod": preemptor, "NodeNameToMetaVictims": {"n1": unknown}})
        assert body == {"NodeNameToMetaVictims": {"n1": unknown}}
        status, body = client.post("preempt", {"Pod": preemptor, "NodeNameToMetaVictims": {"n1": {"Pods": 3}}})
        assert status == 400 and body["Error"] == "NodeNameToMetaVictims[n1].Pods: must be a list, got int"


# ------------------------------------------------------------------ 1,000 nodes
def test_thousand_node_bodies_get_an_answer_for_every_node() -> None:
    _, world = load_world(1000, seed=3)
    names = [info.name for info in world.list_nodes()]
    assert len(names) == 1000
    pod = sample_pod("big", cards=2)
    with serving(world) as (_, client):
        status, body = client.post("filter", args(pod, names))
        assert status == 200 and body["Error"] == ""
        answered = body["NodeNames"] + list(body["FailedNodes"]) + list(body["FailedAndUnresolvableNodes"])
        assert sorted(answered) == sorted(names)
        assert 0 < len(body["NodeNames"]) < 1000
        status, scores = client.post("prioritize", args(pod, body["NodeNames"]))
        assert status == 200 and [s["Host"] for s in scores] == body["NodeNames"]
        assert {s["Score"] for s in scores} <= set(range(11)) and max(s["Score"] for s in scores) == 10
        # The same with node objects (nodeCacheCapable: false).
        items = [{"metadata": {"name": name}} for name in names]
        status, body = client.post("filter", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
        assert status == 200 and len(body["Nodes"]["items"]) + len(body["FailedNodes"]) + len(
            body["FailedAndUnresolvableNodes"]) == 1000


# ------------------------------------------------------------------ restart
def rebuilt(world: SimCluster) -> SimCluster:
    """A new world from the old one's nodes and pods, as an API server would list them after a restart."""
    fresh = SimCluster(CATALOG, [info.spec for info in world.list_nodes()])
    for info in world.list_pods():
        assert fresh.create_pod(info.request).ok
        if info.assignment is not None:
            assert fresh.bind(info.name, info.assignment).ok
    return fresh


def test_restarted_extender_makes_the_same_decisions() -> None:
    _, world = load_world(60, seed=11)
    names = [info.name for info in world.list_nodes()]
    rng = random.Random(2)
    shapes: list[dict[str, Any]] = [{"cards": 1}, {"cards": 2}, {"cards": 1, "cores": 40, "memory_mib": 6000}]
    before = [sample_pod(f"before-{i}", **rng.choice(shapes)) for i in range(20)]
    after = [sample_pod(f"after-{i}", **rng.choice(shapes)) for i in range(20)]
    for pod in before + after:
        pending(world, pod)

    def place(client: Client, pods: list[dict[str, Any]]) -> list[tuple[str, Any]]:
        decisions: list[tuple[str, Any]] = []
        for pod in pods:
            _, body = client.post("filter", args(pod, names))
            _, scores = client.post("prioritize", args(pod, body["NodeNames"]))
            best = max(scores, key=lambda s: (s["Score"], s["Host"]))["Host"] if scores else None
            result = client.post("bind", bind_args(pod, best))[1] if best else None
            decisions.append((json.dumps([body, scores]), result))
        return decisions

    def assignments(w: SimCluster, pods: list[dict[str, Any]]) -> list[Assignment | None]:
        found = [w.get_pod(f"default/{p['metadata']['name']}") for p in pods]
        return [info.assignment if info is not None else None for info in found]

    with serving(world) as (_, client):
        place(client, before)
    twin = rebuilt(world)
    assert twin.state.fingerprint() == world.state.fingerprint()
    with serving(world) as (_, old), serving(twin) as (_, new):
        assert place(old, after) == place(new, after)
    assert assignments(world, after) == assignments(twin, after)
    assert any(a is not None for a in assignments(world, after))


# ------------------------------------------------------------------ HTTP mechanics
def raw_request(server: ExtenderServer, data: bytes) -> bytes:
    """Send raw bytes; read the answer to the end (every answer to a broken request closes)."""
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_http_paths_methods_and_limits() -> None:
    world = world_of(node("n1").gpus(1).obj())
    extender = Extender(world, CATALOG, build_profile("binpack", None))
    server = ExtenderServer(extender, port=0, prefix="gpuplane/", max_body=1000).start()
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        def ask(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes, str | None]:
            conn.request(method, path, body)
            response = conn.getresponse()
            return response.status, response.read(), response.getheader("Allow")

        assert ask("POST", "/gpuplane/nope", b"{}")[0] == 404
        assert ask("POST", "/filter", b"{}")[0] == 404  # verbs live under the prefix
        status, _, allow = ask("GET", "/gpuplane/filter")
        assert (status, allow) == (405, "POST")
        assert ask("PUT", "/gpuplane/bind", b"{}")[0] == 405
        assert ask("GET", "/gpuplane/healthz")[:2] == (200, b"ok")
        assert ask("GET", "/healthz")[:2] == (200, b"ok")  # for the kubelet's probe, whatever the prefix
        status, body, _ = ask("POST", "/gpuplane/prioritize", b"x" * 1001)
        assert status == 413 and b"limit" in body
        conn.close()
        # The same connection serves many requests (keep-alive) after the 413 closed the previous one.
        for _ in range(3):
            status, body, _ = ask("POST", "/gpuplane/filter?timeout=5s", dumps(args(sample_pod("p"), ["n1"])))
            assert status == 200 and json.loads(body)["NodeNames"] == ["n1"]
        assert raw_request(server, b"POST /gpuplane/filter HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
            b"HTTP/1.1 411")
        assert raw_request(server, b"POST /gpuplane/filter HTTP/1.1\r\nContent-Length: -4\r\n\r\n").startswith(
            b"HTTP/1.1 400")
        answer = raw_request(server, b"GARBAGE\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400") and answer.endswith(b'"}')
    finally:
        conn.close()
        server.close()
        extender.close()


# ------------------------------------------------------------------ filter answers: chosen (the default)
def rng_state(extender: Extender) -> Any:
    """Where every random generator of the extender's scheduler stands (the framework's, the plugins' own)."""
    framework = extender.scheduler.framework
    profile = framework.profile
    plugins: list[object] = [*profile.filters, *(w.plugin for w in profile.scores), profile.picker]
    generators = [getattr(p, "rng", None) for p in plugins]
    return [framework.rng.bit_generator.state,
            *(g.bit_generator.state for g in generators if isinstance(g, np.random.Generator))]


def test_chosen_filter_passes_only_gpuplanes_pick_and_says_where_the_others_stand() -> None:
    world = world_of(node("used").gpus(2, model="A100-40GB").obj(), node("idle").gpus(2, model="A100-40GB").obj(),
                     node("t4").gpus(2, model="T4").obj())
    hog = sample_pod("hog", cards=1)
    pod = sample_pod("p", cards=1, models=("A100-40GB",))
    pending(world, hog)
    pending(world, pod)
    with serving(world, answers=FilterAnswers.CHOSEN) as (extender, client):
        assert client.post("bind", bind_args(hog, "used")) == (200, {"Error": ""})
        _, body = client.post("filter", args(pod, ["idle", "used", "t4", "ghost"]))
    # binpack picks the node already in use; idle fits too but must not pass, or kube-scheduler's
    # LeastAllocated (which spreads) could bind there. It is unresolvable: never preempt where the pod fits.
    assert body["NodeNames"] == ["used"] and body["Error"] == ""
    assert body["FailedAndUnresolvableNodes"]["idle"] == PLACED_ELSEWHERE.format(node="used") == \
        "gpuplane placed the pod on used"
    assert "t4" in body["FailedAndUnresolvableNodes"]  # wrong model: the framework's reason, as before
    assert body["FailedAndUnresolvableNodes"]["ghost"] == UNKNOWN_NODE
    assert body["FailedNodes"] == {}
    assert extender.filter_answers is FilterAnswers.CHOSEN


def test_constraints_kube_scheduler_applies_itself_do_not_refuse_the_pod() -> None:
    # Inter-pod anti-affinity and a resource gpuplane does not model: the scheduler mode refuses such a pod, but
    # in extender mode kube-scheduler's InterPodAffinity and NodeResourcesFit have already filtered the nodes sent.
    world = world_of(node("n1").gpus(2, model="A100-40GB").obj())
    pod = sample_pod("p", cards=1)
    pod["spec"]["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname"}]}}
    pod["spec"]["containers"][0]["resources"]["limits"]["example.com/fpga"] = "1"
    pod["spec"]["containers"][0]["resources"]["requests"]["example.com/fpga"] = "1"
    assert pod_request(pod, CATALOG).unsupported  # what the scheduler mode would refuse
    with serving(world, answers=FilterAnswers.CHOSEN) as (_, client):
        _, body = client.post("filter", args(pod, ["n1"]))
    assert body["NodeNames"] == ["n1"] and body["Error"] == ""


def test_chosen_filter_with_no_fit_keeps_every_reason_so_preemption_can_run() -> None:
    world = world_of(node("full").gpus(1, model="A100-40GB").obj(), node("t4").gpus(1, model="T4").obj())
    hog = sample_pod("hog", cards=1)
    pod = sample_pod("p", cards=1, models=("A100-40GB",))
    pending(world, hog)
    pending(world, pod)
    with serving(world, answers=FilterAnswers.CHOSEN) as (_, client):
        assert client.post("bind", bind_args(hog, "full")) == (200, {"Error": ""})
        _, body = client.post("filter", args(pod, ["full", "t4"]))
    assert body["NodeNames"] == []
    assert "full" in body["FailedNodes"]  # its card is taken: preemption may free it
    assert "t4" in body["FailedAndUnresolvableNodes"]


def test_chosen_same_question_same_answer_without_a_second_draw() -> None:
    # random node and card policy: every decision draws from the scheduler's generator
    specs = [node(f"n{i}").gpus(4, model="A100-40GB").obj() for i in range(6)]
    world = world_of(*specs)
    pod = sample_pod("p", cards=1)
    names = [spec.name for spec in specs]
    with serving(world, policy="random", answers=FilterAnswers.CHOSEN) as (extender, client):
        before = rng_state(extender)
        _, first = client.post("filter", args(pod, names))
        after_first = rng_state(extender)
        _, again = client.post("filter", args(pod, names))
        status, scores = client.post("prioritize", args(pod, names))
        assert rng_state(extender) == after_first != before  # one decision, one set of draws
    assert again == first and len(first["NodeNames"]) == 1
    (chosen,) = first["NodeNames"]
    assert status == 200 and scores == [{"Host": n, "Score": 10 if n == chosen else 0} for n in names]


def test_chosen_bind_takes_the_cards_decided_at_filter() -> None:
    world = world_of(node("n1").gpus(8, model="A100-40GB").obj(), node("n2").gpus(8, model="A100-40GB").obj())
    pod = sample_pod("p", cards=2)
    request = pending(world, pod)
    with serving(world, policy="random", answers=FilterAnswers.CHOSEN, seed=3) as (extender, client):
        _, body = client.post("filter", args(pod, ["n1", "n2"]))
        (chosen,) = body["NodeNames"]
        decided = extender._decide(pod, request, ["n1", "n2"]).decision.assignment  # the cached decision
        state = rng_state(extender)
        assert client.post("bind", bind_args(pod, chosen)) == (200, {"Error": ""})
        assert rng_state(extender) == state  # the random card picker was not asked again
    info = world.get_pod(request.name)
    assert decided is not None and info is not None and info.assignment == decided


def test_chosen_bind_elsewhere_decides_again_on_that_node() -> None:
    world = world_of(node("n1").gpus(2, model="A100-40GB").obj(), node("n2").gpus(2, model="A100-40GB").obj())
    pod = sample_pod("p", cards=1)
    request = pending(world, pod)
    with serving(world, answers=FilterAnswers.CHOSEN) as (_, client):
        _, body = client.post("filter", args(pod, ["n1", "n2"]))
        other = ({"n1", "n2"} - set(body["NodeNames"])).pop()
        assert client.post("bind", bind_args(pod, other)) == (200, {"Error": ""})
    info = world.get_pod(request.name)
    assert info is not None and info.assignment is not None and info.assignment.node == other


def test_chosen_decisions_are_the_simulators_pod_by_pod() -> None:
    # The extender (filter then bind, as kube-scheduler with one feasible node) against the simulator's own
    # scheduler over an identical world, same seed, random node and card policy: the same node and cards.
    rng = random.Random(7)
    specs = [node(f"n{i}").gpus(rng.choice((2, 4, 8)), model="A100-40GB").obj() for i in range(12)]
    ours, theirs = world_of(*specs), world_of(*specs)
    reference = Scheduler(theirs, CATALOG, build_profile("random", None), seed=5)
    names = [spec.name for spec in specs]
    with serving(ours, policy="random", answers=FilterAnswers.CHOSEN, seed=5) as (_, client):
        for i in range(40):
            share = rng.random() < 0.4
            pod = sample_pod(f"p{i}", cards=rng.choice((1, 1, 2)), cores=50 if share else None,
                             memory_mib=4096 if share else None)
            request = pending(ours, pod)
            assert theirs.create_pod(request).ok
            _, body = client.post("filter", args(pod, names))
            expected = reference.run_pending()[-1].decision.assignment
            if not body["NodeNames"]:
                assert expected is None
                continue
            assert client.post("bind", bind_args(pod, body["NodeNames"][0])) == (200, {"Error": ""})
            info = ours.get_pod(request.name)
            assert info is not None and info.assignment == expected, i
    reference.close()


# ------------------------------------------------------------------ kube-scheduler configuration
def test_sample_kube_scheduler_configuration() -> None:
    config = yaml.safe_load((ROOT / "deploy/scheduler/kube-scheduler-config.yaml").read_text())
    assert config == scheduler_config()
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["profiles"][0]["schedulerName"] == "gpuplane-scheduler"
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:8888/gpuplane"
    assert extender["weight"] > 0 and extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    # No managedResources: kube-scheduler calls the extender for every pod of the profile (IsInterested), GPU or
    # not. NodeResourcesFit counts gpuplane.io/gpu (the device plugin advertises it) and ignores the rest.
    assert "managedResources" not in extender
    (fit,) = config["profiles"][0]["pluginConfig"]
    assert fit == {"name": "NodeResourcesFit",
                   "args": {"ignoredResources": [name for name in MANAGED_RESOURCES if name != RES_GPU]}}
    verbs = [extender[f"{verb}Verb"] for verb in ("filter", "prioritize", "bind", "preempt")]
    assert verbs == list(VERBS)
    # Every verb the configuration names is served at urlPrefix/verb.
    world = world_of(node("n1").gpus(1).obj())
    core = Extender(world, CATALOG, build_profile("binpack", None))
    server = ExtenderServer(core, port=0, prefix=extender["urlPrefix"].split("8888", 1)[1]).start()
    try:
        conn = http.client.HTTPConnection(*server.address, timeout=10)
        for verb in verbs:
            conn.request("POST", f"/gpuplane/{verb}", b"{}")
            response = conn.getresponse()
            response.read()
            assert response.status in (200, 400), verb
        conn.close()
    finally:
        server.close()
        core.close()
    with pytest.raises(ValueError, match="weight"):
        scheduler_config(weight=0)


def test_the_configuration_scores_every_node() -> None:
    # kube-scheduler's default percentageOfNodesToScore (numFeasibleNodesToFind) stops at 5 %…50 % of the nodes
    # on a cluster over 100 nodes: the extender would choose among a sample. 100 sends them all.
    for config in (scheduler_config(), yaml.safe_load((ROOT / "deploy/scheduler/kube-scheduler-config.yaml")
                                                      .read_text())):
        assert config["percentageOfNodesToScore"] == 100


# ------------------------------------------------------------------ the command
def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps typer from collapsing the app into `extender`
        pass

    return app


def test_cli_prints_the_configuration_it_serves() -> None:
    result = CliRunner().invoke(cli(), ["extender", "--print-config"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output) == scheduler_config()
    result = CliRunner().invoke(cli(), ["extender", "--print-config", "--port", "9000", "--prefix", "x/"])
    assert yaml.safe_load(result.output)["extenders"][0]["urlPrefix"] == "http://127.0.0.1:9000/x"


@pytest.mark.parametrize(("flags", "message"), [
    (["--node-policy", "nope"], "unknown node policy 'nope'"),
    (["--policy", "fgd"], "needs the target workload"),
    (["--card-policy", "custom-topo"], "needs a topology file"),
    (["--card-only-one-scope", "x"], "--card-only-one-scope"),
    (["--port", "70000"], "--port"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig: /nonexistent/kubeconfig is not a file"),
    (["--filter-answers", "best"], "--filter-answers: choose chosen or feasible"),
])
def test_cli_bad_flags_exit_2_naming_the_flag(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(cli(), ["extender", *flags])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(("flags", "message"), [
    (["--split", "0"], "--split: must be at least 1"),
    (["--filter-answers", "best"], "--filter-answers: choose chosen or feasible"),
])
def test_experiment_extender_fill_bad_flags_exit_2(flags: list[str], message: str) -> None:
    app = typer.Typer()
    experiment = typer.Typer()
    app.add_typer(experiment, name="experiment")
    register(app)  # finds the experiment group and adds extender-fill to it
    result = CliRunner().invoke(app, ["experiment", "extender-fill", *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output


def inventory_node(name: str, model: str, cards: int) -> dict[str, Any]:
    inventory = NodeInventory(model, tuple(CardInventory(i, f"GPU-{name}-{i}") for i in range(cards)))
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {INVENTORY: inventory.encode()}},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}}}


def test_restart_over_the_api_rebuilds_the_cache_and_decides_the_same() -> None:
    # A restarted extender reads the card assignments back from the pods' annotations (FakeApiServer +
    # KubeCluster: the API's paths and JSON), then answers and binds exactly as the old one would have.
    rng = random.Random(4)
    shapes: list[dict[str, Any]] = [{"cards": 1}, {"cards": 2}, {"cards": 1, "cores": 40, "memory_mib": 6000}]
    with FakeApiServer() as fake:
        for i, (model, cards) in enumerate([("A100-40GB", 4), ("A100-40GB", 8), ("T4", 4), ("H100-80GB", 8)]):
            fake.add_node(inventory_node(f"n{i}", model, cards))
        pods = [fake.add_pod(sample_pod(f"p{i}", **rng.choice(shapes))) for i in range(16)]
        probes = [sample_pod(f"probe-{i}", **shape) for i, shape in enumerate(shapes)]
        names = [f"n{i}" for i in range(4)]

        def best(client: Client, pod: dict[str, Any]) -> str | None:
            _, body = client.post("filter", args(pod, names))
            _, scores = client.post("prioritize", args(pod, body["NodeNames"]))
            return max(scores, key=lambda s: (s["Score"], s["Host"]))["Host"] if scores else None

        def start(cluster: KubeCluster) -> tuple[Extender, ExtenderServer, Client]:
            core = Extender(cluster, CATALOG, build_profile("binpack", None), subscribe_lock=cluster.lock)
            server = ExtenderServer(core, port=0).start()
            return core, server, Client(server.address, server.prefix)

        old_cluster = KubeCluster(fake.api, CATALOG)
        old, old_server, client = start(old_cluster)
        try:
            for pod in pods[:8]:
                target = best(client, pod)
                assert target is not None and client.post("bind", bind_args(pod, target))[1] == {"Error": ""}
            answers = [(client.post("filter", args(p, names)), client.post("prioritize", args(p, names)))
                       for p in probes]
            fingerprint = old.scheduler.state.fingerprint()
            # What the old extender would bind next: each pod where its scores point, its cards held (assumed)
            # in the cache for the pods after it, as binds in flight would be.
            targets: list[str | None] = []
            planned: list[Assignment | None] = []
            for pod in pods[8:]:
                target = best(client, pod)
                request = pod_request(pod, CATALOG)
                assignment = old.placement(request, target).assignment if target else None
                if assignment is not None:
                    old.scheduler.assume(request, assignment)
                targets.append(target)
                planned.append(assignment)
        finally:
            client.close()
            old_server.close()
            old.close()
            old_cluster.close()
        assert any(a is not None for a in planned)
        new_cluster = KubeCluster(fake.api, CATALOG)
        new, new_server, client = start(new_cluster)
        try:
            assert new.scheduler.state.fingerprint() == fingerprint
            assert [(client.post("filter", args(p, names)), client.post("prioritize", args(p, names)))
                    for p in probes] == answers
            for pod, target, assignment in zip(pods[8:], targets, planned, strict=True):
                if target is None:
                    continue
                assert client.post("bind", bind_args(pod, target))[1] == {"Error": ""}
                stored = fake.get("pods", f"default/{pod['metadata']['name']}")
                assert stored is not None and stored["spec"]["nodeName"] == target
                assert decode_assignment(stored["metadata"]["annotations"][ASSIGNMENT]) == assignment
        finally:
            client.close()
            new_server.close()
            new.close()
            new_cluster.close()
