"""`gpuplane scheduler` against the local API server: it binds the pods that name it (the card assignment recorded
before the Binding, 3 writes a pod), writes PodScheduled and FailedScheduling with kube-scheduler's exact text
once per message, counts the pods of other schedulers without touching them, preempts through the Eviction API
with nominatedNodeName (a disruption budget keeps the preemptor waiting), leads on a Lease (a follower decides
nothing), and rebuilds the same card state after a restart. One test runs it as a separate process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuplane.cli.extender_cmd import build_profile
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import ASSIGNMENT
from gpuplane.kube.scheduler_mode import (
    NO_VICTIMS,
    NOT_HELPFUL,
    SchedulerMode,
    fit_error_message,
)
from gpuplane.port import Timer

PODS = "/api/v1/namespaces/default/pods"
WAIT_S = 20.0
"""How long a test waits for the scheduler and the watches to get somewhere (never a timing assertion)."""


class Clock:
    def __init__(self, t: float = 1_764_374_400.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        raise AssertionError("the scheduler sets no timers: its loop runs the clock's deadlines")


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def pod(name: str, *, cards: int = 0, cpu: str | None = None, scheduler: str = "gpuplane", priority: int = 0,
        node: str | None = None, phase: str = "Pending", annotations: dict[str, str] | None = None) -> dict[str, Any]:
    limits = {"gpuplane.io/gpu": str(cards)} if cards else {}
    if cpu is not None:
        limits["cpu"] = cpu
    obj = pod_json(name, limits=limits, node=node, phase=phase, annotations=annotations)
    obj["spec"]["schedulerName"] = scheduler
    if priority:
        obj["spec"]["priority"] = priority
    return obj


def make(server: FakeApiServer, *, bind_workers: int = 0, clock: Clock | None = None,
         elector: LeaseElector | None = None, identity: str = "test") -> SchedulerMode:
    return SchedulerMode(server.api, build_profile("binpack", None), seed=42, bind_workers=bind_workers,
                         clock=clock or Clock(), elector=elector, identity=identity)


def settle(modes: list[SchedulerMode], done: Callable[[], bool]) -> None:
    """Tick the schedulers (and let their writes land) until `done()`; fail if it never is."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "the scheduler did not get there"
        for mode in modes:
            mode.tick()
            mode.flush()
            if mode.cluster is not None:
                mode.cluster.wait_for_changes(0.02)


def bound(server: FakeApiServer, name: str) -> str | None:
    obj = server.get("pods", f"default/{name}")
    return None if obj is None else obj.get("spec", {}).get("nodeName")


def events(server: FakeApiServer, name: str, reason: str) -> list[dict[str, Any]]:
    found = [server.get("events", key) for key in server.keys("events")]
    return [e for e in found if e is not None and e["regarding"]["name"] == name and e["reason"] == reason]


def condition(server: FakeApiServer, name: str) -> dict[str, Any] | None:
    obj = server.get("pods", f"default/{name}") or {}
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"), None)


def writes_to(server: FakeApiServer, name: str) -> list[tuple[str, str]]:
    """The write requests about pod `name` (its own paths, and events regarding it), in order."""
    out = []
    for method, path, body in server.requests:
        if method == "GET":
            continue
        about = path.rstrip("/").split("/pods/")[-1].split("/")[0] if "/pods/" in path else None
        if path.endswith("/events") and isinstance(body, dict):
            about = body.get("regarding", {}).get("name")
            path = "events"
        if about == name:
            out.append((method, path.split(f"/pods/{name}")[-1] or "pod"))
    return out


# ------------------------------------------------------------------ messages
@pytest.mark.parametrize(("total", "counts", "prefilter", "postfilter", "expected"), [
    # Go's sort.Strings on "count reason": "10 …" sorts before "2 …" (string order, not by count).
    (12, {"GPU model mismatch": 10, "insufficient idle GPUs": 2}, "", "",
     "0/12 nodes are available: 10 GPU model mismatch, 2 insufficient idle GPUs."),
    # Equal counts: the reason text decides.
    (4, {"b": 2, "a": 2}, "", "", "0/4 nodes are available: 2 a, 2 b."),
    # A PreFilter message replaces the per-node reasons; the PostFilter message follows either.
    (3, {"ignored": 3}, "gang ns/g: 1 of 2 members submitted", "", "0/3 nodes are available: gang ns/g: 1 of 2 "
                                                                   "members submitted."),
    (3, {"Insufficient cpu": 2, "node(s) had untolerated taint(s)": 1}, "",
     "preemption: 0/3 nodes are available: 1 Preemption is not helpful for scheduling, 2 No preemption victims "
     "found for incoming pod.",
     "0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 Insufficient cpu. preemption: 0/3 nodes are "
     "available: 1 Preemption is not helpful for scheduling, 2 No preemption victims found for incoming pod."),
    # No node at all: nothing after the colon but the PostFilter's.
    (0, {}, "", "", "0/0 nodes are available:"),
])
def test_fit_error_message_is_kube_schedulers(total: int, counts: dict[str, int], prefilter: str, postfilter: str,
                                              expected: str) -> None:
    assert fit_error_message(total, counts, prefilter=prefilter, postfilter=postfilter) == expected


# ------------------------------------------------------------------ binding
@pytest.mark.parametrize("bind_workers", [0, 4])
def test_binds_with_the_assignment_recorded_first_in_three_writes(server: FakeApiServer, bind_workers: int) -> None:
    for i in range(2):
        server.add_node(node_json(f"n{i}", cards=4))
    mode = make(server, bind_workers=bind_workers)
    mode.tick()
    names = [f"p{i}" for i in range(6)]
    for name in names:
        server.api.create(PODS, pod(name, cards=1))
    settle([mode], lambda: all(bound(server, n) for n in names) and all(events(server, n, "Scheduled")
                                                                       for n in names))
    used: set[tuple[str, int]] = set()
    for name in names:
        obj = server.get("pods", f"default/{name}")
        assert obj is not None
        assignment = json.loads(obj["metadata"]["annotations"][ASSIGNMENT])
        assert assignment["node"] == obj["spec"]["nodeName"]
        for share in assignment["cards"]:  # whole cards: never one card twice
            assert (assignment["node"], share["card"]) not in used
            used.add((assignment["node"], share["card"]))
        # Recorded, then bound, then announced: exactly the three writes, in that order.
        assert writes_to(server, name) == [("PATCH", "pod"), ("POST", "/binding"), ("POST", "events")]
        scheduled = condition(server, name)
        assert scheduled is not None
        assert {k: v for k, v in scheduled.items() if k != "lastTransitionTime"} == {"type": "PodScheduled",
                                                                                    "status": "True"}
        (event,) = events(server, name, "Scheduled")
        assert (event["type"], event["action"], event["note"], event["reportingController"]) == (
            "Normal", "Binding", f"Successfully assigned default/{name} to {obj['spec']['nodeName']}", "gpuplane")
        assert event["regarding"]["uid"] == obj["metadata"]["uid"]
    # Binpack fills one node before the other: 6 one-card pods on two 4-card nodes leave 4 + 2.
    assert sorted(sum(1 for n in names if bound(server, n) == node) for node in ("n0", "n1")) == [2, 4]
    # No reads beyond the watch streams: every GET is a list or a watch of a collection.
    singles = [path for method, path, _ in server.requests if method == "GET" and "/pods/" in path]
    assert singles == []
    mode.shutdown()


def test_failed_scheduling_written_once_with_the_aggregated_message(server: FakeApiServer) -> None:
    for i in range(10):
        server.add_node(node_json(f"t{i:02d}", model="T4", cards=4))
    for i in range(2):
        server.add_node(node_json(f"a{i}", model="A100-40GB", cards=8))
    clock = Clock()
    mode = make(server, clock=clock)
    mode.tick()
    server.api.create(PODS, pod("big", cards=16, annotations={"gpuplane.io/gpu-models": "A100-40GB"}))
    settle([mode], lambda: bool(events(server, "big", "FailedScheduling")))
    # 10 T4 nodes: wrong model (preemption cannot help); 2 A100 nodes: 8 cards < 16 (no victims to evict there).
    expected = ("0/12 nodes are available: 10 GPU model mismatch, 2 insufficient idle GPUs. preemption: 0/12 nodes "
                f"are available: 10 {NOT_HELPFUL}, 2 {NO_VICTIMS}.")
    (event,) = events(server, "big", "FailedScheduling")
    assert (event["type"], event["action"], event["note"]) == ("Warning", "Scheduling", expected)
    found = condition(server, "big")
    assert found is not None
    assert (found["status"], found["reason"], found["message"]) == ("False", "Unschedulable", expected)
    before = writes_to(server, "big")
    assert before == [("PATCH", "/status"), ("POST", "events")]
    # Retried (the parked pods' flush, 5 minutes on) with the same outcome: nothing is written again.
    clock.t += 301
    attempts = mode.outcomes
    settle([mode], lambda: mode.outcomes > attempts)
    assert writes_to(server, "big") == before
    mode.shutdown()


def test_an_unimplemented_constraint_or_unreadable_field_reaches_the_event(server: FakeApiServer) -> None:
    server.add_node(node_json("n0"))
    mode = make(server)
    mode.tick()
    affinity = pod("aff", cpu="1")
    affinity["spec"]["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "zone"}]}}
    bad = pod("bad", cpu="1")
    bad["spec"]["priority"] = "high"
    server.api.create(PODS, affinity)
    server.api.create(PODS, bad)
    settle([mode], lambda: all(events(server, name, "FailedScheduling") for name in ("aff", "bad")))
    assert "spec.affinity.podAffinity" in events(server, "aff", "FailedScheduling")[0]["note"]
    assert events(server, "bad", "FailedScheduling")[0]["note"] == (
        "0/1 nodes are available: default/bad: spec.priority: must be an integer, got 'high'.")
    assert bound(server, "aff") is None and bound(server, "bad") is None
    mode.shutdown()


def test_pods_of_other_schedulers_are_left_alone_but_hold_their_capacity(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cpu="64"))
    server.add_node(node_json("n1", cpu="64"))
    # Bound by kube-scheduler (no card assignment): its 60 CPUs on n0 are taken whoever bound them.
    server.add_pod(pod("theirs-bound", cpu="60", scheduler="default-scheduler", node="n0", phase="Running"))
    server.add_pod(pod("theirs-pending", cpu="1", scheduler="default-scheduler"))
    mode = make(server)
    mode.tick()
    server.api.create(PODS, pod("ours", cpu="8"))
    settle([mode], lambda: bound(server, "ours") is not None)
    # Binpack would prefer the fuller n0, but 64 - 60 = 4 CPUs < 8 there.
    assert bound(server, "ours") == "n1"
    assert bound(server, "theirs-pending") is None
    assert writes_to(server, "theirs-pending") == [] and writes_to(server, "theirs-bound") == []
    mode.shutdown()


# ------------------------------------------------------------------ preemption
def test_preemption_evicts_nominates_and_binds_when_the_victims_are_gone() -> None:
    with FakeApiServer(pod_deletion_delay_s=None) as server:  # victims stay terminating until finish_deletion
        server.add_node(node_json("n0", cards=2))
        mode = make(server)
        mode.tick()
        for name in ("low-0", "low-1"):
            server.api.create(PODS, pod(name, cards=1, priority=100))
        settle([mode], lambda: bool(bound(server, "low-0") and bound(server, "low-1")))
        server.api.create(PODS, pod("high", cards=2, priority=1000))

        def nominated() -> str | None:
            node: str | None = (server.get("pods", "default/high") or {}).get("status", {}).get("nominatedNodeName")
            return node

        settle([mode], lambda: nominated() == "n0")
        evictions = [path for method, path, _ in server.requests if path.endswith("/eviction")]
        assert sorted(evictions) == [f"{PODS}/low-0/eviction", f"{PODS}/low-1/eviction"]
        assert bound(server, "high") is None
        found = condition(server, "high")
        assert found is not None and found["reason"] == "Unschedulable"
        assert found["message"] == "0/1 nodes are available: 1 insufficient idle GPUs."  # PostFilter succeeded
        for name in ("low-0", "low-1"):
            server.finish_deletion(f"default/{name}")
        settle([mode], lambda: bound(server, "high") == "n0" and nominated() is None)
        mode.shutdown()


def test_an_eviction_a_disruption_budget_refuses_keeps_the_preemptor_waiting(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=1))
    mode = make(server)
    mode.tick()
    server.api.create(PODS, pod("low", cards=1, priority=100))
    settle([mode], lambda: bound(server, "low") is not None)
    server.block_eviction("default/low")
    server.api.create(PODS, pod("high", cards=1, priority=1000))
    settle([mode], lambda: bool(events(server, "high", "FailedScheduling")))
    assert server.requests_to(r"/low/eviction$", "POST")  # tried, answered 429
    assert bound(server, "low") == "n0" and bound(server, "high") is None
    high = server.get("pods", "default/high") or {}
    assert "nominatedNodeName" not in high.get("status", {})
    assert "eviction refused for default/low" in events(server, "high", "FailedScheduling")[0]["note"]
    mode.shutdown()


# ------------------------------------------------------------------ running it
def test_two_instances_on_one_lease_only_the_leader_decides(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=8))
    clock = Clock()
    modes = [make(server, clock=clock, identity=name,
                  elector=LeaseElector(server.api, LeaseConfig("gpuplane-system", "gpuplane-scheduler", name),
                                       clock.now)) for name in ("a", "b")]
    for mode in modes:
        mode.tick()
    leader, follower = modes if modes[0].leading else modes[::-1]
    assert leader.leading and not follower.leading
    server.api.create(PODS, pod("p0", cards=1))
    settle(modes, lambda: bound(server, "p0") is not None)
    assert follower.outcomes == 0 and follower.cluster is None  # no informers, no decisions, no writes
    # The leader stops renewing (say it hangs); after the lease duration the follower takes over, rebuilds from
    # the API and binds the next pod beside the first (the card state came back from the recorded assignment).
    leader.shutdown()
    clock.t += 16
    server.api.create(PODS, pod("p1", cards=7))
    settle([follower], lambda: bound(server, "p1") is not None)
    assert follower.leading and follower.outcomes == 1
    cards = [json.loads((server.get("pods", f"default/{n}") or {})["metadata"]["annotations"][ASSIGNMENT])["cards"]
             for n in ("p0", "p1")]
    assert sorted(s["card"] for c in cards for s in c) == list(range(8))  # 1 + 7 cards, none twice
    follower.shutdown()


def test_a_restart_rebuilds_the_same_card_state(server: FakeApiServer) -> None:
    for i in range(3):
        server.add_node(node_json(f"n{i}", cards=4))
    first = make(server, bind_workers=4)
    first.tick()
    for i in range(5):
        server.api.create(PODS, pod(f"a{i}", cards=1 + i % 3))
    settle([first], lambda: all(bound(server, f"a{i}") for i in range(5)))
    assert first.scheduler is not None
    cards_before = first.scheduler.state.card_used_milli().tolist()
    first.shutdown()  # killed: the next one knows only what the API says
    second = make(server, bind_workers=4)
    second.tick()
    assert second.scheduler is not None
    assert second.scheduler.state.card_used_milli().tolist() == cards_before
    # 5 pods took 1+2+3+1+2 = 9 of 12 cards; 3 more one-card pods fill it exactly, a fourth does not fit.
    for i in range(4):
        server.api.create(PODS, pod(f"b{i}", cards=1))
    settle([second], lambda: sum(1 for i in range(4) if bound(server, f"b{i}")) == 3
           and any(events(server, f"b{i}", "FailedScheduling") for i in range(4)))
    used: set[tuple[str, int]] = set()
    for key in server.keys("pods"):
        raw = (server.get("pods", key) or {})["metadata"]["annotations"].get(ASSIGNMENT)
        if raw and bound(server, key.split("/")[1]):
            assignment = json.loads(raw)
            for share in assignment["cards"]:
                assert (assignment["node"], share["card"]) not in used, "a card was given twice"
                used.add((assignment["node"], share["card"]))
    assert len(used) == 12
    second.shutdown()


def test_the_command_schedules_as_a_separate_process(server: FakeApiServer, tmp_path: Path) -> None:
    server.add_node(node_json("n0", cards=4))
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    child = subprocess.Popen(
        [sys.executable, "-m", "gpuplane.cli.main", "scheduler", "--kubeconfig", str(kubeconfig),
         "--no-leader-elect", "--scheduler-name", "gpu-team", "--node-policy", "binpack", "--seed", "7"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        server.api.create(PODS, pod("p0", cards=2, scheduler="gpu-team"))
        server.api.create(PODS, pod("p1", cards=2, scheduler="gpuplane"))  # not its name: left alone
        deadline = time.monotonic() + WAIT_S
        while not events(server, "p0", "Scheduled"):
            assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
            assert time.monotonic() < deadline, "the command did not bind the pod"
            time.sleep(0.05)
        assert bound(server, "p0") == "n0" and bound(server, "p1") is None
        assert events(server, "p0", "Scheduled")[0]["reportingController"] == "gpu-team"
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=WAIT_S)
    assert child.returncode == 0


def test_a_leader_that_loses_its_lease_stops_deciding(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=8))
    clock = Clock()
    config = LeaseConfig("gpuplane-system", "gpuplane-scheduler", "a")
    mode = make(server, clock=clock, elector=LeaseElector(server.api, config, clock.now))
    mode.tick()
    assert mode.leading

    def taken(lease: dict[str, Any]) -> None:  # another replica took the lease (say we were partitioned)
        lease["spec"]["holderIdentity"] = "b"

    server.mutate("leases", "gpuplane-system/gpuplane-scheduler", taken)
    clock.t += config.retry_period_s  # the next renewal reads the lease and sees b holding it
    mode.tick()
    assert not mode.leading and mode.cluster is None
    server.api.create(PODS, pod("p0", cards=1))
    for _ in range(10):  # a standby never decides, however often it ticks
        mode.tick()
    assert bound(server, "p0") is None and writes_to(server, "p0") == []
    mode.shutdown()


def test_a_bind_the_api_refuses_releases_the_cards_and_the_pod_is_tried_again(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=1))
    mode = make(server, bind_workers=2)
    mode.tick()
    server.fail_next("POST", r"/pods/p0/binding$", 409, "Conflict")  # the first Binding is refused
    server.api.create(PODS, pod("p0", cards=1))
    settle([mode], lambda: bool(events(server, "p0", "FailedScheduling")))
    (event,) = events(server, "p0", "FailedScheduling")
    assert "binding default/p0 to n0 refused" in event["note"]
    # The refusal released the one card and queued the pod again: it takes the card again and binds.
    settle([mode], lambda: bound(server, "p0") == "n0")
    assert [w for w in writes_to(server, "p0") if w[1] == "/binding"] == [("POST", "/binding")] * 2
    mode.shutdown()


# ------------------------------------------------------------------ declarations
PODGROUPS = "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/default/podgroups"


def test_a_gang_waits_for_its_pod_group_then_goes_all_or_nothing(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=4))
    mode = make(server)
    mode.tick()
    members = [f"w{i}" for i in range(3)]
    for name in members:
        member = pod(name, cards=1)
        member["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = "train"
        server.api.create(PODS, member)
    # No PodGroup yet: the members stay out of the queue (coscheduling's PreEnqueue), nothing is written.
    settle([mode], lambda: mode.port is not None and len(mode.port.waiting_for_group) == 3)
    assert mode.scheduler is not None and len(mode.scheduler.queue) == 0
    assert all(writes_to(server, name) == [] for name in members)
    # minMember 4 > the 3 members: the gang is admitted and waits for a fourth; 3 of 4 cards stay free.
    server.add_object(PODGROUPS, {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
                                  "metadata": {"name": "train", "namespace": "default"}, "spec": {"minMember": 4}})
    settle([mode], lambda: all(events(server, name, "FailedScheduling") for name in members))
    assert all(bound(server, name) is None for name in members)
    # One message for the whole wait: a count in it would rewrite every member as each one arrives.
    assert events(server, "w0", "FailedScheduling")[0]["note"] == (
        "0/1 nodes are available: gang default/train is waiting for its members (minMember 4).")
    # The fourth member arrives: all four bind at once, one card each; the others were written to once.
    assert all(writes_to(server, name) == [("PATCH", "/status"), ("POST", "events")] for name in members)
    fourth = pod("w3", cards=1)
    fourth["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = "train"
    server.api.create(PODS, fourth)
    settle([mode], lambda: all(bound(server, f"w{i}") == "n0" for i in range(4)))
    mode.shutdown()


def test_a_queue_at_its_maximum_holds_its_pods(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=4))
    server.add_object("/apis/gpuplane.io/v1alpha1/queues", {"apiVersion": "gpuplane.io/v1alpha1", "kind": "Queue",
                                                            "metadata": {"name": "research"},
                                                            "spec": {"minGpus": 1, "maxGpus": 2}})
    mode = make(server)
    mode.tick()
    for i in range(3):
        member = pod(f"q{i}", cards=1)
        member["metadata"]["labels"]["gpuplane.io/queue"] = "research"
        server.api.create(PODS, member)
    settle([mode], lambda: bool(events(server, "q2", "FailedScheduling")))
    # Two of the queue's pods run (its maximum, 2 GPUs); the third waits although 2 cards are idle.
    assert [bound(server, f"q{i}") for i in range(3)] == ["n0", "n0", None]
    assert events(server, "q2", "FailedScheduling")[0]["note"] == (
        "0/1 nodes are available: queue research at its maximum: 2 of 2 GPUs in use, 1 more asked.")
    mode.shutdown()


# ------------------------------------------------------------------ the cluster port's reading
@pytest.mark.parametrize(("change", "reread"), [
    # The scheduler's own writes and the Binding leave the request as it was: it is kept, not read again.
    (lambda obj: obj["metadata"]["annotations"].update({"gpuplane.io/bind-phase": "allocating"}), False),
    (lambda obj: obj["status"].update({"nominatedNodeName": "n0"}), False),
    # Anything the codec reads makes it read the pod again: a label, another annotation, the spec.
    (lambda obj: obj["metadata"]["labels"].update({"gpuplane.io/queue": "research"}), True),
    (lambda obj: obj["metadata"]["annotations"].update({"gpuplane.io/gpu-models": "T4"}), True),
    (lambda obj: obj["spec"].update({"priority": 7}), True),
])
def test_a_change_that_leaves_the_request_as_it_was_keeps_it(server: FakeApiServer,
                                                              change: Callable[[dict[str, Any]], None],
                                                              reread: bool) -> None:
    from gpuplane.kube.cluster import KubeCluster
    from gpuplane.model import default_catalog

    server.add_node(node_json("n0"))
    server.add_pod(pod("p0", cards=1))
    with KubeCluster(server.api, default_catalog(), dispatch="manual") as cluster:
        before = cluster.get_pod("default/p0")
        assert before is not None
        version = server.mutate("pods", "default/p0", change)["metadata"]["resourceVersion"]
        deadline = time.monotonic() + WAIT_S
        while cluster.pods.resource_version != version:
            assert time.monotonic() < deadline
            cluster.wait_for_changes(0.02)
        cluster.pump()
        after = cluster.get_pod("default/p0")
        assert after is not None
        assert (after.request is not before.request) == reread
        assert (after.request == before.request) != reread


def test_a_pod_groups_own_timeout_fails_a_gang_that_never_assembles(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=4))
    server.add_object(PODGROUPS, {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
                                  "metadata": {"name": "short", "namespace": "default"},
                                  "spec": {"minMember": 3, "scheduleTimeoutSeconds": 30}})
    clock = Clock()
    mode = make(server, clock=clock)
    mode.tick()
    member = pod("s0", cards=1)
    member["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = "short"
    server.api.create(PODS, member)
    settle([mode], lambda: bool(events(server, "s0", "FailedScheduling")))
    # 30 s, not the scheduler's default 600 s: 31 s later the lone member is given up on (phase Failed).
    clock.t += 31
    settle([mode], lambda: (server.get("pods", "default/s0") or {}).get("status", {}).get("phase") == "Failed")
    mode.shutdown()


@pytest.mark.parametrize("bind_workers", [0, 2])
def test_a_cache_rebuilt_before_the_watch_shows_a_bind_keeps_its_cards(server: FakeApiServer,
                                                                       bind_workers: int) -> None:
    server.add_node(node_json("n0", cards=1))
    mode = make(server, bind_workers=bind_workers)
    mode.tick()
    server.api.create(PODS, pod("p0", cards=1))
    settle([mode], lambda: mode.scheduler is not None and "default/p0" in mode.scheduler.state.bindings)
    # Rebuild at once (a node's cards changed, a quota changed), before this tick's pump has seen the Binding:
    # the pod is still Pending in the informer's view, and its card must stay taken in the rebuilt cache.
    assert mode.scheduler is not None
    mode.scheduler.resync()
    assert "default/p0" in mode.scheduler.state.bindings
    server.api.create(PODS, pod("p1", cards=1))
    settle([mode], lambda: bool(events(server, "p1", "FailedScheduling")))
    assert bound(server, "p0") == "n0" and bound(server, "p1") is None
    mode.shutdown()
