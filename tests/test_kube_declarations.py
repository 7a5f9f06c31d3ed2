"""The declarations gpuplane-scheduler reads (`gpuplane.kube.declarations`): scheduler-plugins PodGroups,
Queues and GpuPool quotas, over the local API server's real HTTP watches; and how each is validated."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest

from builders import CATALOG, pod
from gpuplane.kube.crds import ResourceError, parse_resource
from gpuplane.kube.declarations import POD_GROUP_PATH, Declarations, parse_pod_group, with_pool_queue
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.model import ModelQuota, QueueQuota, Quotas
from test_kube_scheduler_mode import PODS, bound, settle
from test_kube_scheduler_mode import condition as scheduled_condition
from test_kube_scheduler_mode import make as make_scheduler

QUEUES = "/apis/gpuplane.io/v1alpha1/queues"
POOLS = "/apis/gpuplane.io/v1alpha1/gpupools"


def queue(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "Queue", "metadata": {"name": name}, "spec": spec}


def pool(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": name},
            "spec": {"models": ["A100-40GB"], **spec}}


def pod_group(name: str, namespace: str = "team", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


@contextmanager
def declarations(fake: FakeApiServer) -> Iterator[tuple[Declarations, threading.Event]]:
    decl = Declarations(fake.api, CATALOG)
    changed = threading.Event()
    decl.on_change(changed.set)
    try:
        assert decl.start(20)
        yield decl, changed
    finally:
        decl.stop()


# ------------------------------------------------------------------ PodGroups
def test_a_pod_group_gives_its_gang_size_and_timeout_and_follows_edits_and_deletion() -> None:
    with FakeApiServer() as fake:
        fake.add_object("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/team/podgroups",
                        pod_group("train", minMember=4, scheduleTimeoutSeconds=120))
        with declarations(fake) as (decl, changed):
            assert decl.gang_size("team", "train") == 4
            assert decl.gang_timeout_s("team", "train") == 120.0
            assert decl.gang_timeouts() == {"team/train": 120.0}  # as SchedulingRules.gang_timeouts takes them
            assert decl.gang_size("other", "train") is None  # PodGroups are namespaced
            assert decl.gang_size("team", "unknown") is None  # not declared yet: its pods wait
            changed.clear()
            fake.mutate("podgroups", "team/train", lambda obj: obj["spec"].update(minMember=8))
            wait_for(lambda: decl.gang_size("team", "train") == 8, "the edit")
            assert changed.is_set()
            changed.clear()
            fake.api.delete("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/team/podgroups/train")
            wait_for(lambda: decl.gang_size("team", "train") is None, "the deletion")
            assert changed.is_set()


def test_an_invalid_pod_group_is_reported_with_its_field_and_its_pods_wait(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuplane.kube.declarations")
    with FakeApiServer() as fake:
        path = "/apis/scheduling.x-k8s.io/v1alpha1/namespaces/team/podgroups"
        fake.add_object(path, pod_group("zero", minMember=0))
        fake.add_object(path, pod_group("unset"))
        with declarations(fake) as (decl, _):
            assert decl.gang_size("team", "zero") is None and decl.gang_size("team", "unset") is None
            assert "spec.minMember" in decl.invalid["PodGroup/team/zero"]
            assert "spec.minMember: missing" in decl.invalid["PodGroup/team/unset"]
            assert "PodGroup/team/zero: invalid, its pods wait: spec.minMember" in caplog.text
            fake.mutate("podgroups", "team/zero", lambda obj: obj["spec"].update(minMember=2))  # fixed
            wait_for(lambda: decl.gang_size("team", "zero") == 2, "the fix")
            assert "PodGroup/team/zero" not in decl.invalid


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"minMember": 3}, (3, None)),
        ({"minMember": 3, "scheduleTimeoutSeconds": 0}, (3, None)),  # 0: the default timeout, as upstream
        ({"minMember": 3, "scheduleTimeoutSeconds": 90}, (3, 90.0)),
        ({"minMember": 2, "minResources": {"cpu": "4", "nvidia.com/gpu": 2}}, (2, None)),  # read, not applied
        ({"minMember": 0}, "spec.minMember: Input should be greater than or equal to 1"),
        ({"minMember": "3"}, "spec.minMember: Input should be a valid integer"),
        ({"minMember": 3, "scheduleTimeoutSeconds": -1}, "spec.scheduleTimeoutSeconds"),
        ({"minMember": 3, "minMembers": 4}, "spec.minMembers: Extra inputs are not permitted"),  # a typo is named
        ({}, "spec.minMember: missing"),
    ],
)
def test_pod_groups_are_read_exactly_as_scheduler_plugins_defines_them(
        spec: dict[str, Any], expected: tuple[int, float | None] | str) -> None:
    obj = pod_group("g", **spec)
    if isinstance(expected, str):
        with pytest.raises(ResourceError) as raised:
            parse_pod_group(obj)
        assert str(raised.value).startswith(expected)
    else:
        group = parse_pod_group(obj)
        assert (group.min_member, group.timeout_s) == expected


def test_a_pod_group_of_another_api_version_is_refused() -> None:
    obj = {**pod_group("g", minMember=2), "apiVersion": "scheduling.volcano.sh/v1beta1"}
    with pytest.raises(ResourceError, match=r"apiVersion: must be scheduling\.x-k8s\.io/v1alpha1"):
        parse_pod_group(obj)


# ------------------------------------------------------------------ Queues and pool quotas
def test_queues_and_pool_quotas_become_the_schedulers_quotas() -> None:
    with FakeApiServer() as fake:
        fake.add_object(QUEUES, queue("research", maxGpus=16, models={"H100": {"minGpus": 8, "maxGpus": 16}},
                                      lend=False))
        fake.add_object(POOLS, pool("dev", quota={"minGpus": 2, "maxGpus": 4}))
        fake.add_object(POOLS, pool("prod"))  # no quota: no queue
        with declarations(fake) as (decl, changed):
            assert decl.quotas() == Quotas([
                QueueQuota("dev", 2, 4),
                # minGpus unset: the models' sum (8); H100 made canonical
                QueueQuota("research", 8, 16, (ModelQuota("H100-80GB", 8, 16),), borrow=True, lend=False),
            ])
            changed.clear()
            fake.mutate("queues", "research", lambda obj: obj["spec"].update(borrow=False))
            wait_for(lambda: (q := decl.quotas().get("research")) is not None and not q.borrow, "the edit")
            assert changed.is_set()
            changed.clear()
            fake.mutate("gpupools", "prod", lambda obj: obj["metadata"].update(labels={"x": "y"}))  # no quota change
            fake.mutate("queues", "research", lambda obj: obj["spec"].update(lend=True))
            wait_for(lambda: (q := decl.quotas().get("research")) is not None and q.lend, "the second edit")
            fake.api.delete(f"{POOLS}/dev")
            wait_for(lambda: "dev" not in decl.quotas(), "the pool's removal")


def test_an_invalid_queue_is_reported_and_not_applied_and_a_queue_shadows_a_pools_quota() -> None:
    with FakeApiServer() as fake:
        fake.add_object(QUEUES, queue("bad", minGpus=1, models={"H100": {"minGpus": 2}}))
        fake.add_object(QUEUES, queue("dev", maxGpus=1))
        fake.add_object(POOLS, pool("dev", quota={"maxGpus": 8}))
        with declarations(fake) as (decl, _):
            assert decl.quotas() == Quotas([QueueQuota("dev", 0, 1)])  # the Queue wins over the pool's quota
            assert decl.invalid["Queue/bad"] == ("invalid, not applied: spec.minGpus: 1 is below the sum of the "
                                                 "models' minGpus (2)")
            assert "the Queue dev is defined and wins" in decl.invalid["GpuPool/dev"]
            fake.api.delete(f"{QUEUES}/dev")
            wait_for(lambda: decl.quotas() == Quotas([QueueQuota("dev", 0, 8)]), "the pool's quota in force")
            assert "GpuPool/dev" not in decl.invalid


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"models": {"Z9": {}}}, "spec.models.Z9: unknown GPU model 'Z9'"),
        ({"models": {"H100": {"minGpus": 3, "maxGpus": 2}}}, "spec.models.H100.minGpus: 3 is above maxGpus 2"),
        ({"maxGpus": 4, "models": {"H100": {"minGpus": 5}}}, "spec.models.H100.minGpus: 5 is above the queue's"),
        ({"minGpus": 5, "maxGpus": 4}, "spec.minGpus: 5 is above maxGpus 4"),
        ({"models": {"H100": {}, "h100-80gb": {}}}, "spec.models.h100-80gb: names the model H100-80GB a second"),
        ({"borrow": "yes"}, "spec.borrow: Input should be a valid boolean"),
        ({"maxGPUs": 4}, "spec.maxGPUs: Extra inputs are not permitted"),
    ],
)
def test_the_webhooks_parser_names_the_field_of_a_bad_queue(spec: dict[str, Any], fragment: str) -> None:
    # parse_resource is what the admission webhook and the operator call
    with pytest.raises(ResourceError) as raised:
        parse_resource(queue("q", **spec), CATALOG)
    assert str(raised.value).startswith(fragment)


def test_a_queue_is_cluster_scoped() -> None:
    obj = queue("q")
    obj["metadata"]["namespace"] = "team"
    with pytest.raises(ResourceError, match=r"metadata\.namespace: Queue is cluster-scoped"):
        parse_resource(obj, CATALOG)


@pytest.mark.parametrize(
    ("queue_name", "pools", "expected"),
    [
        (None, frozenset({"dev"}), "dev"),        # no queue, one pool with a quota: the pool's queue
        ("research", frozenset({"dev"}), "research"),  # a named queue wins
        (None, frozenset({"prod"}), None),         # a pool without a quota
        (None, frozenset({"dev", "prod"}), None),  # two pools: no single pool's quota to count against
        (None, None, None),
    ],
)
def test_a_pod_that_names_no_queue_counts_against_its_pools_quota(queue_name: str | None,
                                                                  pools: frozenset[str] | None,
                                                                  expected: str | None) -> None:
    request = replace(pod("p").whole(1).obj(), queue=queue_name, pools=pools)
    quotas = Quotas([QueueQuota("dev", 0, 4), QueueQuota("research")])
    assert with_pool_queue(request, quotas).queue == expected


def test_pod_groups_are_served_by_the_local_api_server() -> None:
    with FakeApiServer() as fake:
        fake.add_object("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/a/podgroups", pod_group("g", "a", minMember=2))
        items, _ = fake.api.list(POD_GROUP_PATH)
        assert [(i["kind"], i["metadata"]["namespace"]) for i in items] == [("PodGroup", "a")]
        listed, _ = fake.api.list("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/b/podgroups")
        assert listed == []


def test_the_operator_writes_each_queues_valid_condition() -> None:
    from test_kube_operator import VirtualClock, condition, operator

    with FakeApiServer() as fake:
        fake.add_object(QUEUES, queue("good", maxGpus=4))
        fake.add_object(QUEUES, queue("bad", models={"Z9": {}}))
        op = operator(fake, VirtualClock(1_764_374_400.0), "op-0")
        try:
            op.tick()
            assert condition(fake, "queues", "good", "Valid")["status"] == "True"
            bad = condition(fake, "queues", "bad", "Valid")
            assert (bad["status"], bad["reason"]) == ("False", "InvalidSpec")
            assert bad["message"].startswith("spec.models.Z9: unknown GPU model 'Z9'")
        finally:
            op.shutdown()


# ------------------------------------------------------------------ through gpuplane-scheduler (scheduler mode)
def gpu_pod(name: str, cards: int, labels: dict[str, str] | None = None,
            selector: dict[str, str] | None = None) -> dict[str, Any]:
    obj = pod_json(name, limits={"gpuplane.io/gpu": str(cards)}, labels=labels)
    obj["spec"]["schedulerName"] = "gpuplane"
    if selector:
        obj["spec"]["nodeSelector"] = selector
    return obj


def held_message(fake: FakeApiServer, name: str) -> str:
    """The PodScheduled=False message of a pod the scheduler decided not to bind ('' before it decides)."""
    found = scheduled_condition(fake, name)
    return "" if found is None or found["status"] != "False" else str(found["message"])


def test_a_queues_maximum_holds_its_pods_until_one_leaves_or_the_queue_grows() -> None:
    with FakeApiServer() as fake:
        fake.add_node(node_json("n0", cards=4))
        fake.add_object(QUEUES, queue("q", maxGpus=1))
        mode = make_scheduler(fake)
        try:
            mode.tick()
            for name in ("a", "b", "c"):
                fake.api.create(PODS, gpu_pod(name, 1, {"gpuplane.io/queue": "q"}))
            settle([mode], lambda: bound(fake, "a") is not None and bool(held_message(fake, "c")))
            assert bound(fake, "b") is None and bound(fake, "c") is None
            assert "queue q at its maximum: 1 of 1 GPUs in use, 1 more asked" in held_message(fake, "b")
            fake.mutate("queues", "q", lambda obj: obj["spec"].update(maxGpus=2))  # the Queue grows: b or c runs
            settle([mode], lambda: sum(bound(fake, n) is not None for n in "abc") == 2)
            fake.api.delete(f"{PODS}/a")  # a leaves: the last one runs
            settle([mode], lambda: bound(fake, "b") is not None and bound(fake, "c") is not None)
        finally:
            mode.shutdown()


def test_a_pod_group_makes_its_pods_a_gang_that_starts_whole() -> None:
    with FakeApiServer() as fake:
        fake.add_node(node_json("n0", cards=4))
        mode = make_scheduler(fake)
        try:
            mode.tick()
            member = {"scheduling.x-k8s.io/pod-group": "train"}
            fake.api.create(PODS, gpu_pod("w0", 1, member))
            fake.api.create(PODS, gpu_pod("w1", 1, member))
            # No PodGroup yet: once the scheduler has seen both members, a pass binds neither (size unknown).
            settle([mode], lambda: mode.cluster is not None and all(
                mode.cluster.pods.get(f"default/{n}") is not None for n in ("w0", "w1")))
            mode.tick()
            mode.flush()
            assert bound(fake, "w0") is None and bound(fake, "w1") is None
            fake.add_object("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/default/podgroups",
                            pod_group("train", "default", minMember=3))
            settle([mode], lambda: "gang default/train" in held_message(fake, "w0") and any(
                size in held_message(fake, "w0") for size in ("minMember 3", "of 3")))  # waiting, sized by it
            assert bound(fake, "w0") is None and bound(fake, "w1") is None  # capacity for both: still all or none
            fake.api.create(PODS, gpu_pod("w2", 1, member))
            settle([mode], lambda: all(bound(fake, n) is not None for n in ("w0", "w1", "w2")))
        finally:
            mode.shutdown()


def test_a_gpu_pools_quota_holds_the_pods_that_select_the_pool() -> None:
    with FakeApiServer() as fake:
        fake.add_node(node_json("d0", cards=4, labels={"gpuplane.io/pool": "dev"}))
        fake.add_object(POOLS, pool("dev", quota={"maxGpus": 1}))
        mode = make_scheduler(fake)
        try:
            mode.tick()
            in_dev = {"gpuplane.io/pool": "dev"}
            fake.api.create(PODS, gpu_pod("a", 1, selector=in_dev))
            fake.api.create(PODS, gpu_pod("b", 1, selector=in_dev))
            settle([mode], lambda: bound(fake, "a") is not None and bool(held_message(fake, "b")))
            assert "queue dev at its maximum" in held_message(fake, "b")  # the pool's quota, by its name
        finally:
            mode.shutdown()


@pytest.mark.parametrize(("spec", "message"), [
    ({"maxGpus": 16, "models": {"H100": {"minGpus": 8, "maxGpus": 16}}, "lend": False}, None),
    ({"models": {"H100": {"minGpus": 3, "maxGpus": 2}}}, "Queue/q: spec.models.H100.minGpus: 3 is above maxGpus 2"),
    ({"minGpus": 1, "models": {"A100": {"minGpus": 2}}}, "Queue/q: spec.minGpus: 1 is below the sum"),
    ({"models": {"Z9000": {}}}, "Queue/q: spec.models.Z9000: unknown GPU model 'Z9000'"),
])
def test_the_webhook_refuses_a_bad_queue_naming_the_field(spec: dict[str, Any], message: str | None) -> None:
    from gpuplane.kube.webhook import WebhookServer
    from test_kube_webhook import POLICY, response, review

    server = WebhookServer(POLICY).start()
    try:
        for operation in ("CREATE", "UPDATE"):
            answer = response(server.url, review(operation, queue("q", **spec), old=queue("q"),
                                                 kind=("gpuplane.io", "v1alpha1", "Queue")))
            assert answer["allowed"] is (message is None)
            if message is not None:
                assert answer["status"]["message"].startswith(message)
    finally:
        server.stop()
