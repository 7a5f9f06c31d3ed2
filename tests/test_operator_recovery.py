"""The operator's recovery, node health and co-location distribution against the local API server: the node
agent's Events (posted by `NodeReporter`) reach the operator's informer; an isolate-node verdict taints the
node and deletes the gang's pods (their owner re-creates them); health tiers make a node suspect and clear it;
each Event is acted on once, by this leader or the next; the next leader takes the nodes' health from their
labels; each node is annotated with the ColocationPolicy that governs it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.health import HEALTH_LABEL, NodeHealth
from gpuplane.kube.api import RestKubeApi
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.node_reports import EVENTS_PATH, REPORT_LABEL
from gpuplane.kube.objects import GANG_LABEL, GANG_SIZE
from gpuplane.kube.operator import HANDLED_ANNOTATION, Operator
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
    assert health_of(server, "gpu-1") == ("quarantined", True)
    assert health_of(server, "gpu-0") == (None, False) and health_of(server, "gpu-2") == (None, False)
    # both members deleted: the gang's owner re-creates them, the scheduler avoids the tainted node
    wait_for(lambda: server.keys("pods") == [], "the gang's pods deleted")
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
    assert successor.recovery.book.state("gpu-1") is NodeHealth.QUARANTINED
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
