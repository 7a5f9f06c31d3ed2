"""`KubeCluster`, the cluster port over the Kubernetes API, against the local API server over real HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import kubernetes_validate
import pytest

from gpuplane.kube.cluster import KubeCluster, pod_manifest
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import (
    ASSIGNED_AT,
    ASSIGNMENT,
    BIND_PHASE,
    PHASE_ALLOCATING,
    PHASE_FAILED,
    POOL_LABEL,
    decode_assignment,
    pod_request,
)
from gpuplane.model import (
    Assignment,
    CardShare,
    Fraction,
    MigSlice,
    PodRequest,
    QoS,
    Taint,
    Toleration,
    WholeCards,
    default_catalog,
    make_request,
)
from gpuplane.port import ClusterEvent, ClusterPort, Code, EventKind, EventType, PodPhase

CATALOG = default_catalog()
GPU = {"gpuplane.io/gpu": "1"}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback: Callable[[], None]) -> object:
        raise AssertionError("KubeCluster needs no timers")


class World:
    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.sleeps: list[float] = []
        self.cluster = KubeCluster(server.api, CATALOG, clock=Clock(), sleep=self.sleeps.append, dispatch="manual",
                                   watch_timeout_s=30)
        self.events: list[tuple[EventKind, str]] = []
        self.cluster.watch(self.record)

    def record(self, event: ClusterEvent) -> None:
        subject = event.pod.name if event.pod is not None else event.node.name if event.node is not None else ""
        self.events.append((event.kind, subject))

    def settle(self, check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Pump watch events until `check` holds (a deadline for the watch thread, not a speed assertion)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.cluster.pump()
            if check():
                return True
            self.cluster.wait_for_changes(0.05)
        return check()


@pytest.fixture
def world() -> Iterator[World]:
    with FakeApiServer() as server:
        server.add_node(node_json("n1", cards=8))
        server.add_node(node_json("n2", cards=4, model="T4"))
        built = World(server)
        yield built
        built.cluster.close()


def whole(node: str, *cards: int) -> Assignment:
    return Assignment(node, tuple(CardShare(card=c, compute_milli=1000, memory_mib=40960, whole=True)
                                  for c in cards))


def test_kube_cluster_is_a_cluster_port(world: World) -> None:
    assert isinstance(world.cluster, ClusterPort)


def test_lists_come_from_the_cache(world: World) -> None:
    nodes = {n.name: n.spec for n in world.cluster.list_nodes()}
    assert (nodes["n1"].gpus, nodes["n1"].gpu_model, nodes["n2"].gpus) == (8, "A100-40GB", 4)
    world.server.add_pod(pod_json("p", limits=GPU))
    assert world.settle(lambda: [p.name for p in world.cluster.list_pods()] == ["default/p"])
    assert world.events == [(EventKind.POD_ADDED, "default/p")]
    assert world.cluster.list_pods()[0].phase is PodPhase.PENDING


def test_bind_records_the_assignment_then_posts_the_binding(world: World) -> None:
    world.server.add_pod(pod_json("p", limits=GPU))
    assert world.settle(lambda: world.cluster.get_pod("default/p") is not None)
    since = len(world.server.requests)
    assignment = whole("n1", 3)
    assert world.cluster.bind("default/p", assignment).ok
    writes = [(m, p) for m, p, _ in world.server.requests[since:] if m != "GET"]
    assert writes == [("PATCH", "/api/v1/namespaces/default/pods/p"),
                      ("POST", "/api/v1/namespaces/default/pods/p/binding")]
    patch = world.server.requests[since][2]
    assert patch["metadata"]["resourceVersion"]  # guarded: the pod must not have changed since it was read
    assert decode_assignment(patch["metadata"]["annotations"][ASSIGNMENT]) == assignment
    assert patch["metadata"]["annotations"][BIND_PHASE] == PHASE_ALLOCATING
    assert patch["metadata"]["annotations"][ASSIGNED_AT] == "1000.000000"
    binding = world.server.requests[since + 1][2]
    assert binding["kind"] == "Binding" and binding["target"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    # The cache shows the bind at once (an assumed write), and the event is delivered before bind returns.
    bound = world.cluster.get_pod("default/p")
    assert bound is not None and bound.phase is PodPhase.RUNNING and bound.assignment == assignment
    assert world.events[-1] == (EventKind.POD_BOUND, "default/p")
    # The watch then brings the real objects: no second POD_BOUND.
    assert world.settle(lambda: world.cluster.pods.get("default/p", ) is not None and
                        (world.cluster.pods.get("default/p") or {}).get("status", {}).get("conditions") is not None)
    world.cluster.pump()
    assert world.events.count((EventKind.POD_BOUND, "default/p")) == 1


def test_a_refused_binding_is_a_conflict_and_takes_the_assignment_back(world: World) -> None:
    world.server.add_pod(pod_json("p", limits=GPU))
    assert world.settle(lambda: world.cluster.get_pod("default/p") is not None)
    world.server.fail_next("POST", r"/binding$", 409, "Conflict")
    status = world.cluster.bind("default/p", whole("n1", 0))
    assert status.code is Code.ERROR and status.message.startswith("conflict")
    annotations = world.server.get("pods", "default/p")["metadata"]["annotations"]  # type: ignore[index]
    assert ASSIGNMENT not in annotations and annotations[BIND_PHASE] == PHASE_FAILED
    assert world.cluster.get_pod("default/p").phase is PodPhase.PENDING  # type: ignore[union-attr]


@pytest.mark.parametrize(("setup", "message"), [
    (lambda s: s.add_pod(pod_json("p", limits=GPU, node="n2", phase="Running")), "conflict: pod default/p is Running"),
    (lambda s: None, "pod default/p not found"),
])
def test_bind_refuses_what_the_cache_says_cannot_bind(world: World, setup: Callable[[FakeApiServer], object],
                                                       message: str) -> None:
    setup(world.server)
    world.settle(lambda: world.cluster.get_pod("default/p") is not None, timeout_s=0.5)
    status = world.cluster.bind("default/p", whole("n1", 0))
    assert not status.ok and status.message.startswith(message)


def test_bind_to_an_unknown_node_or_stale_version_is_a_conflict(world: World) -> None:
    world.server.add_pod(pod_json("p", limits=GPU))
    assert world.settle(lambda: world.cluster.get_pod("default/p") is not None)
    assert world.cluster.bind("default/p", whole("n9", 0)).message.startswith("conflict: node n9 not found")
    version = next(n.resource_version for n in world.cluster.list_nodes() if n.name == "n1")
    assert world.cluster.bind("default/p", whole("n1", 0), node_version=version - 1).message.startswith("conflict")
    assert world.cluster.bind("default/p", whole("n1", 0), node_version=version).ok


def running(world: World, name: str = "p") -> str:
    world.server.add_pod(pod_json(name, limits=GPU, node="n1", phase="Running"))
    key = f"default/{name}"
    assert world.settle(lambda: world.cluster.get_pod(key) is not None)
    return key


def test_eviction_is_retried_while_a_budget_blocks_it(world: World) -> None:
    key = running(world)
    world.server.block_eviction(key, times=2)
    assert world.cluster.evict(key, grace_s=5).ok
    assert world.sleeps == [1.0, 2.0]  # back-off 1 s, doubling: two 429s, then the eviction went through
    evictions = world.server.requests_to(r"/eviction$")
    assert len(evictions) == 3 and evictions[-1][2]["deleteOptions"] == {"gracePeriodSeconds": 5}
    assert world.settle(lambda: (EventKind.POD_DELETED, key) in world.events)
    assert world.events[-2:] == [(EventKind.POD_TERMINATING, key), (EventKind.POD_DELETED, key)]


def test_an_eviction_blocked_for_good_is_pending_not_failed(world: World) -> None:
    key = running(world)
    world.server.block_eviction(key)
    status = world.cluster.evict(key)
    # Four attempts (the default), waits 1 + 2 + 4 s between them; then 'blocked, try again later'.
    assert world.sleeps == [1.0, 2.0, 4.0]
    assert status.code is Code.PENDING and status.message.startswith("blocked: disruption budget")
    assert world.server.get("pods", key) is not None


def test_eviction_errors(world: World) -> None:
    key = running(world)
    world.server.several_pdbs(key)
    status = world.cluster.evict(key)
    assert status.code is Code.ERROR and "more than one PodDisruptionBudget" in status.message
    assert world.cluster.evict("default/ghost").ok  # 404: already gone is what eviction wanted


def test_eviction_records_its_reason(world: World) -> None:
    key = running(world)
    world.server.pod_deletion_delay_s = None
    assert world.cluster.evict(key, reason="tidal reclaim").ok
    pod = world.server.get("pods", key)
    assert pod is not None and pod["metadata"]["annotations"]["gpuplane.io/eviction-reason"] == "tidal reclaim"
    assert world.settle(lambda: world.cluster.get_pod(key).phase is PodPhase.TERMINATING)  # type: ignore[union-attr]


def test_a_held_eviction_retried_records_its_reason_once(world: World) -> None:
    # A budget holds the eviction; the caller's next pass evicts again with the same reason: one PATCH for the
    # reason (the pod carries it already), one eviction POST per attempt; a new reason is written.
    key = running(world)
    world.server.block_eviction(key)
    world.cluster.eviction_attempts = 1

    def reason_patches() -> list[object]:
        return [r for r in world.server.requests_to(r"/pods/p$", "PATCH") if "gpuplane.io/eviction-reason" in str(r[2])]

    for _ in range(2):
        assert world.cluster.evict(key, reason="tidal reclaim").code is Code.PENDING
    assert len(reason_patches()) == 1 and len(world.server.requests_to(r"/eviction$", "POST")) == 2
    assert world.cluster.evict(key, reason="node drain").code is Code.PENDING
    assert len(reason_patches()) == 2
    pod = world.server.get("pods", key)
    assert pod is not None and pod["metadata"]["annotations"]["gpuplane.io/eviction-reason"] == "node drain"
    assert world.sleeps == []  # one attempt each: no back-off


def test_delete_and_fail(world: World) -> None:
    key = running(world, "a")
    assert world.cluster.delete_pod(key).ok
    # gone from the API and from the view when delete_pod returns, before any watch event is pumped
    assert world.cluster.get_pod(key) is None and world.server.get("pods", key) is None
    assert world.events[-1] == (EventKind.POD_DELETED, key)
    assert world.server.requests_to(r"/pods/a$", "DELETE")[-1][2] == {"gracePeriodSeconds": 0}
    world.cluster.pump()  # the watch's DELETED event, when it comes, is not a second deletion
    assert world.settle(lambda: world.server.resource_version <= int(world.cluster.pods.resource_version))
    assert [e for e in world.events if e == (EventKind.POD_DELETED, key)] == [(EventKind.POD_DELETED, key)]
    assert not world.cluster.delete_pod(key).ok
    # a pod terminating in a long grace (a kubelet that has not stopped it) is deleted at once too
    world.server.pod_deletion_delay_s = None
    slow = running(world, "slow")
    assert world.cluster.evict(slow, grace_s=30).ok
    assert world.settle(lambda: world.cluster.get_pod(slow).phase is PodPhase.TERMINATING)  # type: ignore[union-attr]
    assert world.cluster.delete_pod(slow).ok
    assert world.cluster.get_pod(slow) is None and world.server.get("pods", slow) is None
    world.server.add_pod(pod_json("b", limits=GPU))
    assert world.settle(lambda: world.cluster.get_pod("default/b") is not None)
    assert world.cluster.fail_pod("default/b", "gang timed out").ok
    assert world.events[-1] == (EventKind.POD_FAILED, "default/b")
    assert world.cluster.get_pod("default/b") is None  # an ended pod leaves the list, as in the simulation
    status = world.server.get("pods", "default/b")["status"]  # type: ignore[index]
    assert (status["phase"], status["message"]) == ("Failed", "gang timed out")
    assert world.cluster.fail_pod("default/b", "again").message == "pod default/b not found"


def test_scale_through_the_scale_subresource(world: World) -> None:
    deployments = "/apis/apps/v1/namespaces/ml/deployments"
    world.server.add_object(deployments, {"metadata": {"name": "web"}, "spec": {"replicas": 1}})
    world.server.add_object("/apis/apps/v1/namespaces/ml/replicasets", {
        "metadata": {"name": "web-7f9c", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "controller": True, "uid": "u"}]},
        "spec": {"replicas": 1}})

    def replicas() -> int:
        return int(world.server.get("deployments", "ml/web")["spec"]["replicas"])  # type: ignore[index]

    assert world.cluster.scale("ml/web", 3).ok and replicas() == 3
    assert world.cluster.scale("ml/Deployment/web", 4).ok and replicas() == 4
    assert world.cluster.scale("ml/ReplicaSet/web-7f9c", 2).ok and replicas() == 2  # its Deployment scales
    assert world.server.requests_to(r"/scale$", "PATCH")[-1][1] == f"{deployments}/web/scale"
    assert world.cluster.scale("ml/nope", 1).message == "workload ml/nope not found"
    assert world.cluster.scale("ml/Job/x", 1).message.startswith("workload ml/Job/x: cannot scale a Job")
    assert world.cluster.scale("web", 1).message.startswith("workload 'web' is not")
    assert world.cluster.scale("ml/web", -1).message.startswith("replicas must not be negative")


def test_patch_pod_annotations(world: World) -> None:
    world.server.add_pod(pod_json("p", limits=GPU, annotations={"a": "1", "b": "2"}))
    assert world.settle(lambda: world.cluster.get_pod("default/p") is not None)
    assert world.cluster.patch_pod("default/p", annotations={"a": None, "c": "3"}).ok
    assert dict(world.cluster.get_pod("default/p").annotations) == {"b": "2", "c": "3"}  # type: ignore[union-attr]
    assert world.server.get("pods", "default/p")["metadata"]["annotations"] == {"b": "2", "c": "3"}  # type: ignore[index]
    assert world.cluster.patch_pod("default/ghost", annotations={"a": "1"}).message == "pod default/ghost not found"


def test_record_event_posts_a_core_v1_event_as_client_gos_recorder_does(world: World) -> None:
    world.server.add_pod(pod_json("p", namespace="ml", limits=GPU))
    assert world.settle(lambda: world.cluster.get_pod("ml/p") is not None)
    pod = world.server.get("pods", "ml/p")
    assert pod is not None
    world.cluster.event_instance = "operator-7f9c"
    assert world.cluster.record_event("Pod", "ml/p", type_=EventType.WARNING, reason="IdleGpuNotice",
                                      message="evict due").ok
    assert world.cluster.record_event("Node", "n1", type_=EventType.NORMAL, reason="Checked", message="ok").ok
    assert world.cluster.record_event("Pod", "ml/p", type_=EventType.NORMAL, reason="Again", message="x" * 2000).ok
    [first, again] = world.server.api.list("/api/v1/namespaces/ml/events")[0]
    [node_event] = world.server.api.list("/api/v1/namespaces/default/events")[0]
    for event in (first, again, node_event):  # the upstream schema, strictly (no field it lacks)
        assert kubernetes_validate.validate(event, "1.34", strict=True) == "1.34"
    # the clock reads 1000 s: 1000 × 10⁹ ns = 0xe8d4a51000; the next Event of that nanosecond is one later
    assert first["metadata"]["name"] == "p.e8d4a51000" and again["metadata"]["name"] == "p.e8d4a51002"
    assert node_event["metadata"]["name"] == "n1.e8d4a51001"
    assert first["involvedObject"] == {"kind": "Pod", "apiVersion": "v1", "namespace": "ml", "name": "p",
                                       "uid": pod["metadata"]["uid"],
                                       "resourceVersion": pod["metadata"]["resourceVersion"]}
    assert {k: first[k] for k in ("reason", "message", "type", "source", "reportingComponent", "reportingInstance",
                                  "firstTimestamp", "lastTimestamp", "count")} == {
        "reason": "IdleGpuNotice", "message": "evict due", "type": "Warning",
        "source": {"component": "gpuplane", "host": "operator-7f9c"}, "reportingComponent": "gpuplane",
        "reportingInstance": "operator-7f9c", "firstTimestamp": "1970-01-01T00:16:40Z",
        "lastTimestamp": "1970-01-01T00:16:40Z", "count": 1}
    assert node_event["involvedObject"]["kind"] == "Node" and node_event["involvedObject"]["name"] == "n1"
    assert node_event["type"] == "Normal"
    assert len(again["message"]) == 1024 and again["message"].endswith("…")  # cut at the note limit


def test_an_event_the_api_refuses_is_an_error_naming_it(world: World) -> None:
    world.server.fail_next("POST", r"/events$", 403, "Forbidden")
    status = world.cluster.record_event("Pod", "ml/p", type_=EventType.WARNING, reason="IdleGpuNotice",
                                        message="m")
    assert not status.ok and status.message.startswith("recording the IdleGpuNotice event of Pod ml/p failed: ")
    assert "403" in status.message


def test_patch_node(world: World) -> None:
    world.server.mutate("nodes", "n1", lambda n: n["spec"].update(
        taints=[{"key": "old", "effect": "NoSchedule"}]))
    assert world.settle(lambda: bool(next(n for n in world.cluster.list_nodes() if n.name == "n1").spec.taints))
    status = world.cluster.patch_node("n1", labels={"zone": "a", "kubernetes.io/hostname": None},
                                      taints=[Taint("gpuplane.io/draining", "", "NoSchedule")],
                                      annotations={"note": "x"}, unschedulable=True, pool="train")
    assert status.ok
    stored = world.server.get("nodes", "n1")
    assert stored is not None
    assert stored["metadata"]["labels"] == {"zone": "a", POOL_LABEL: "train"}
    assert stored["spec"] == {"taints": [{"key": "gpuplane.io/draining", "effect": "NoSchedule"}],  # replaced
                              "unschedulable": True}
    assert stored["metadata"]["annotations"]["note"] == "x"
    spec = next(n for n in world.cluster.list_nodes() if n.name == "n1").spec  # the view, at once
    assert (spec.pool, spec.schedulable, [t.key for t in spec.taints]) == ("train", False, ["gpuplane.io/draining"])
    assert world.events[-1] == (EventKind.NODE_UPDATED, "n1")
    assert world.cluster.patch_node("n9", unschedulable=True).message == "node n9 not found"


def test_node_heartbeats_send_no_update(world: World) -> None:
    world.server.mutate("nodes", "n2", lambda n: n["status"].update(conditions=[{"type": "Ready"}]))
    world.server.mutate("nodes", "n2", lambda n: n["metadata"]["labels"].update(zone="b"))
    assert world.settle(lambda: len(world.events) >= 1)
    world.cluster.pump()
    assert world.events == [(EventKind.NODE_UPDATED, "n2")]


def test_unreadable_objects_are_reported_not_dropped(world: World) -> None:
    world.server.add_pod(pod_json("bad", limits={"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "150"}))
    world.server.add_pod(pod_json("good", limits=GPU))
    bad_node = node_json("n3")
    bad_node["metadata"]["annotations"]["gpuplane.io/gpu-inventory"] = "{not json"
    world.server.add_node(bad_node)
    assert world.settle(lambda: world.cluster.get_pod("default/good") is not None and
                        len(world.cluster.unreadable()) == 2)
    (node_key, node_error), (pod_key, pod_error) = world.cluster.unreadable()
    assert node_key == "node n3" and "gpu-inventory" in node_error
    assert pod_key == "pod default/bad" and "gpucores" in pod_error
    assert [p.name for p in world.cluster.list_pods()] == ["default/good"]
    world.server.api.delete("/api/v1/namespaces/default/pods/bad")
    assert world.settle(lambda: len(world.cluster.unreadable()) == 1)


REQUESTS: list[PodRequest] = [
    make_request(CATALOG, "default/whole", cpu_milli=4000, memory_mib=16384, gpu=WholeCards(2)),
    make_request(CATALOG, "ml/frac", cpu_milli=500, gpu=Fraction(compute_milli=300, memory_mib=8192),
                 qos=QoS.OFFLINE, queue="team-a", workload="ml/Deployment/frac", instance=3),
    make_request(CATALOG, "ml/codec", gpu=Fraction(compute_milli=100, memory_pct=25, encoders=1, decoders=2)),
    make_request(CATALOG, "ml/mig", gpu=MigSlice("3g.40gb"), models={"A100-80GB"}, gang="g1", gang_size=4,
                 priority=1000, priority_class="high", preempt=False, checkpoint_every_s=600.0),
    make_request(CATALOG, "default/cpu-only", cpu_milli=250, memory_mib=512, rdma_vfs=0,
                 pools=frozenset({"train"}), tolerations=(Toleration("gpu", None), Toleration("zone", "a"))),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.name)
def test_create_pod_round_trips_through_the_codec(world: World, request_: PodRequest) -> None:
    assert world.cluster.create_pod(request_).ok
    stored = world.server.get("pods", request_.name)
    assert stored is not None and stored["status"] == {"phase": "Pending"}
    read = pod_request(stored, CATALOG)
    assert replace(read, labels=()) == replace(request_, labels=())
    assert set(request_.labels) <= set(read.labels)
    assert world.cluster.get_pod(request_.name) is not None  # in the view at once
    assert world.cluster.create_pod(request_).message.startswith("conflict")


def test_what_a_pod_cannot_say_is_refused() -> None:
    request = make_request(CATALOG, "p", gpu=Fraction(compute_milli=333))
    with pytest.raises(ValueError, match="whole percent"):
        pod_manifest(request)


def test_thread_dispatch_delivers_events_under_the_lock() -> None:
    with FakeApiServer() as server:
        server.add_node(node_json("n1"))
        cluster = KubeCluster(server.api, CATALOG, clock=Clock(), watch_timeout_s=30)
        try:
            seen: list[tuple[EventKind, bool]] = []
            with cluster.lock:  # list and subscribe with nothing delivered in between
                assert [n.name for n in cluster.list_nodes()] == ["n1"]
                cluster.watch(lambda e: seen.append((e.kind, cluster.lock._is_owned())))  # type: ignore[attr-defined]
            server.add_pod(pod_json("p", limits=GPU))
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
            assert seen == [(EventKind.POD_ADDED, True)]
        finally:
            cluster.close()


def test_a_pod_with_an_unreadable_stamp_is_reported_and_delivery_goes_on() -> None:
    """A bad `assigned-at` once escaped the codec as a ValueError and ended the dispatcher: nothing after it was
    delivered (the cache froze)."""
    with FakeApiServer() as server:
        server.add_node(node_json("n1"))
        cluster = KubeCluster(server.api, CATALOG, clock=Clock(), watch_timeout_s=30)
        try:
            seen: list[tuple[EventKind, str]] = []
            cluster.watch(lambda e: seen.append((e.kind, e.pod.name if e.pod is not None else "")))
            server.add_pod(pod_json("stamped", limits=GPU, node="n1", phase="Running",
                                    annotations={ASSIGNED_AT: "yesterday"}))
            server.add_pod(pod_json("later", limits=GPU))
            deadline = time.monotonic() + 5  # a deadline for the dispatcher thread, not a speed assertion
            while (EventKind.POD_ADDED, "default/later") not in seen and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (EventKind.POD_ADDED, "default/later") in seen
            assert [name for name, _ in cluster.unreadable()] == ["pod default/stamped"]
            assert f"metadata.annotations[{ASSIGNED_AT}]" in cluster.unreadable()[0][1]
            assert cluster.get_pod("default/stamped") is None
        finally:
            cluster.close()
