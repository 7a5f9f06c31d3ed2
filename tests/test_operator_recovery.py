"""The operator's recovery, node health and co-location distribution against the local API server: the node
agent's Events (posted by `NodeReporter`) reach the operator's informer; an isolate-node verdict taints the
node and deletes the gang's pods (their owner re-creates them); health tiers make a node suspect and clear it;
each Event is acted on once, by this leader or the next; the next leader takes the nodes' health from their
labels; a quarantined node is cordoned, drained and its repair asked for (the lifecycle, each step in the
node's annotation), and the answer written on the node moves it on; each node is annotated with the
ColocationPolicy that governs it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.health import HEALTH_LABEL, NodeHealth
from gpuplane.controllers.lifecycle import LIFECYCLE_ANNOTATION, LIFECYCLE_HISTORY
from gpuplane.kube.api import RestKubeApi
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.node_reports import EVENTS_PATH, REPORT_LABEL
from gpuplane.kube.objects import GANG_LABEL, GANG_SIZE
from gpuplane.kube.operator import HANDLED_ANNOTATION, REPAIR_ANNOTATION, Operator
from gpuplane.kube.reconcilers import COLOCATION_ANNOTATION
from gpuplane.model.failures import load_signature_library
from gpuplane.node.health_checks import CheckResult
from gpuplane.node.reporter import NodeReporter
from test_kube_operator import CRS, HOUR, MIDNIGHT, VirtualClock, wait_for

XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2417, GPU has fallen off the bus."
LIBRARY = load_signature_library()


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer(bookmark_interval_s=0.05) as fake:
        for i in range(3):
            fake.add_node(node_json(f"gpu-{i}", labels={"gpuplane.io/colocation": "on" if i else "off"}))
        for i in range(2):  # gang ml/train: two members on gpu-0 and gpu-1
            fake.add_pod(pod_json(f"train-{i}", namespace="ml", limits={"nvidia.com/gpu": "8"}, node=f"gpu-{i}",
                                  labels={GANG_LABEL: "train"}, annotations={GANG_SIZE: "2"}, phase="Running"))
        yield fake


def operator(server: FakeApiServer, clock: VirtualClock, identity: str = "a") -> Operator:
    api = RestKubeApi.from_url(server.url, request_timeout_s=10)
    config = LeaseConfig("gpuplane-system", "gpuplane-operator", identity, lease_duration_s=12 * HOUR,
                         renew_deadline_s=10 * HOUR, retry_period_s=60)
    return Operator(api, LeaseElector(api, config, clock.now), clock, library=LIBRARY)


def agent(server: FakeApiServer, node: str, clock: VirtualClock) -> NodeReporter:
    return NodeReporter(server.api, node, FailureClassifier(LIBRARY), clock.now)


def node(server: FakeApiServer, name: str) -> dict[str, Any]:
    obj = server.get("nodes", name)
    assert obj is not None
    return obj


def health_of(server: FakeApiServer, name: str) -> tuple[str | None, bool]:
    obj = node(server, name)
    tainted = any(t.get("key") == HEALTH_LABEL for t in obj.get("spec", {}).get("taints") or [])
    return obj["metadata"]["labels"].get(HEALTH_LABEL), tainted


def reports_seen(op: Operator, count: int) -> None:
    wait_for(lambda: len(op.informers["Event"].objects()) >= count, f"{count} node reports")


def handled(server: FakeApiServer) -> list[bool]:
    items, _ = server.api.list(EVENTS_PATH, label_selector=REPORT_LABEL)
    return [HANDLED_ANNOTATION in (e["metadata"].get("annotations") or {}) for e in items]


def test_an_xid_79_isolates_its_node_and_deletes_the_gang_once(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    op = operator(server, clock)
    op.tick()
    assert op.leading and op.recovery is not None and list(op.recovery.adopted) == ["train"]
    clock.at(1.0)
    assert agent(server, "gpu-1", clock).line(XID_79) is not None
    reports_seen(op, 1)
    op.tick()
    # quarantined and tainted at once; the gang's pods are deleted in the same pass. Whether the drain sees them
    # gone in that pass or still terminating depends on whether the watch's DELETED beat the delete's answer
    # (the answer is the pod with its deletionTimestamp), so the pass may end quarantined or already repairing
    assert health_of(server, "gpu-1") in (("quarantined", True), ("repairing", True))
    assert health_of(server, "gpu-0") == (None, False) and health_of(server, "gpu-2") == (None, False)
    # both members deleted: the gang's owner re-creates them, the scheduler avoids the tainted node
    wait_for(lambda: server.keys("pods") == [], "the gang's pods deleted")
    wait_for(lambda: op.cluster is not None and op.cluster.pump() >= 0
             and not any(p.assignment is not None for p in op.cluster.list_pods()), "the deletions seen")
    op.tick()  # nothing left on it: drained, and its repair asked for
    assert health_of(server, "gpu-1") == ("repairing", True)
    assert node(server, "gpu-1")["metadata"]["annotations"][REPAIR_ANNOTATION] == "requested"
    assert [(r.job, r.cause, r.isolated, r.restarted) for r in op.recovery.history] == [
        ("train", "xid-79", ("gpu-1",), True)]
    assert handled(server) == [True]
    # the owner re-creates the gang on gpu-0 and gpu-2; a new leader acts on nothing twice
    for i, host in enumerate(("gpu-0", "gpu-2")):
        server.add_pod(pod_json(f"train-{i}", namespace="ml", limits={"nvidia.com/gpu": "8"}, node=host,
                                labels={GANG_LABEL: "train"}, annotations={GANG_SIZE: "2"}, phase="Running"))
    op.shutdown()
    clock.at(2.0)
    successor = operator(server, clock, "b")
    successor.tick()
    assert successor.leading and successor.recovery is not None
    assert successor.recovery.history == [] and sorted(server.keys("pods")) == ["ml/train-0", "ml/train-1"]
    # the successor's book has gpu-1 from its label
    assert successor.recovery.book.state("gpu-1") is NodeHealth.REPAIRING
    successor.shutdown()


def test_health_tiers_make_a_node_suspect_then_clear_it(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    op = operator(server, clock)
    op.tick()
    reporter = agent(server, "gpu-2", clock)
    clock.at(1.0)
    reporter.checks([CheckResult("dcgm", False, "diag level 1: PCIe replay")])
    reports_seen(op, 1)
    op.tick()
    assert health_of(server, "gpu-2") == ("suspect", True)
    clock.at(2.0)
    reporter.checks([CheckResult("dcgm", True, "passed")])
    reports_seen(op, 2)
    op.tick()
    assert health_of(server, "gpu-2") == (None, False) and handled(server) == [True, True]
    # the gang was on other nodes: no recovery decision
    assert op.recovery is not None and op.recovery.history == []
    op.shutdown()


def steps(server: FakeApiServer, name: str) -> list[str]:
    """The lifecycle steps written on the node, oldest first (its history annotation)."""
    history = node(server, name)["metadata"]["annotations"].get(LIFECYCLE_HISTORY, "[]")
    return [doc["step"] for doc in json.loads(history)]


@dataclass(frozen=True)
class AnswerCase:
    answer: str
    """what the person who repaired the node writes in its gpuplane.io/repair annotation"""
    health: str
    last_step: str
    cordoned: bool


ANSWER_CASES = [
    AnswerCase("done", "probation", "probation", False),  # uncordoned, the taint lifted, small jobs only
    AnswerCase("failed", "quarantined", "repair-failed", True),  # back to quarantine, still cordoned
]


@pytest.mark.parametrize("case", ANSWER_CASES, ids=[c.answer for c in ANSWER_CASES])
def test_a_node_quarantined_by_an_xid_event_is_cordoned_drained_and_waits_for_its_repair(
        server: FakeApiServer, case: AnswerCase) -> None:
    server.add_pod(pod_json("serve-0", namespace="ml", limits={"nvidia.com/gpu": "1"}, node="gpu-2",
                            phase="Running"))
    server.block_eviction("ml/serve-0", times=1)  # a disruption budget refuses the first eviction
    clock = VirtualClock(MIDNIGHT)
    op = operator(server, clock)
    op.tick()
    clock.at(1.0)
    assert agent(server, "gpu-2", clock).line(XID_79) is not None
    reports_seen(op, 1)
    op.tick()  # quarantined by the Event; cordoned; the eviction refused
    assert health_of(server, "gpu-2") == ("quarantined", True)
    assert node(server, "gpu-2")["spec"].get("unschedulable") is True
    assert steps(server, "gpu-2") == ["cordoned", "drain-blocked"]
    clock.at(2.0)
    op.tick()  # the eviction goes through
    wait_for(lambda: "ml/serve-0" not in server.keys("pods"), "serve-0 evicted")
    assert op.cluster is not None
    evicted_from = op.cluster

    def gone_from_cache() -> bool:  # the next pass reads the operator's cache, not the server
        evicted_from.pump()
        return all(not p.name.endswith("serve-0") for p in evicted_from.list_pods())

    wait_for(gone_from_cache, "the operator's cache sees serve-0 gone")
    clock.at(3.0)
    op.tick()  # nothing left on it: drained, its repair asked for; nobody has answered, so it waits
    clock.at(4.0)
    op.tick()
    assert health_of(server, "gpu-2") == ("repairing", True)
    assert node(server, "gpu-2")["metadata"]["annotations"][REPAIR_ANNOTATION] == "requested"
    assert steps(server, "gpu-2") == ["cordoned", "drain-blocked", "draining", "drained", "repairing"]
    server.api.patch("/api/v1/nodes/gpu-2", {"metadata": {"annotations": {REPAIR_ANNOTATION: case.answer}}})
    assert op.cluster is not None
    cluster = op.cluster

    def answer_seen() -> bool:
        cluster.pump()
        gpu_2 = next(n for n in cluster.list_nodes() if n.name == "gpu-2")
        return dict(gpu_2.annotations).get(REPAIR_ANNOTATION) == case.answer

    wait_for(answer_seen, "the operator's cache sees the answer")
    clock.at(5.0)
    op.tick()
    assert health_of(server, "gpu-2")[0] == case.health
    assert bool(node(server, "gpu-2")["spec"].get("unschedulable")) is case.cordoned
    assert json.loads(node(server, "gpu-2")["metadata"]["annotations"][LIFECYCLE_ANNOTATION])["step"] == \
        case.last_step
    assert health_of(server, "gpu-0") == (None, False)  # the gang's nodes untouched
    op.shutdown()


def colocation_policy(name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "ColocationPolicy",
            "metadata": {"name": name, "namespace": "ml", "generation": 1}, "spec": {"nodeSelector": selector}}


def test_each_node_is_annotated_with_the_colocation_policy_that_governs_it(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    op = operator(server, clock)
    server.add_object(f"{CRS}/namespaces/ml/colocationpolicies",
                      colocation_policy("on", {"gpuplane.io/colocation": "on"}))
    op.tick()
    wait_for(lambda: len(op.informers["ColocationPolicy"].objects()) == 1, "the policy")
    op.tick()

    def annotations() -> list[str | None]:
        return [node(server, f"gpu-{i}")["metadata"]["annotations"].get(COLOCATION_ANNOTATION) for i in range(3)]

    assert annotations() == [None, "ml/on", "ml/on"]
    server.add_object(f"{CRS}/namespaces/ml/colocationpolicies", colocation_policy("all", {}))
    wait_for(lambda: len(op.informers["ColocationPolicy"].objects()) == 2, "the second policy")
    op.tick()
    # the empty selector takes every node: gpu-0 is its alone, the others are a conflict
    assert annotations() == ["ml/all", "conflict: ml/all, ml/on", "conflict: ml/all, ml/on"]
    op.shutdown()
