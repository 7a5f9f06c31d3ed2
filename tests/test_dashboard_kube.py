"""The dashboard over a Kubernetes cluster (`gpuplane dashboard --kubeconfig`, `live.ClusterWatch`) against the local
API server: why each pending pod waits, read from the `PodScheduled=False` condition its scheduler wrote
(kube-scheduler's, or gpuplane-scheduler's, which writes it the same way), and the quotas of the cluster's Queue
resources, on the board's data and the served JSON, following edits."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.pending import fit_error_reason, pending_reason
from gpuplane.model import Assignment, CardShare, default_catalog
from gpuplane.port.metrics import OTHER_REASON
from gpuplane.report.browser import Chromium, table_rows
from gpuplane.report.dashboard import NOT_TRIED, DashboardServer
from gpuplane.report.dashboard.live import ClusterWatch
from test_kube_declarations import QUEUES, queue, wait_for
from test_kube_scheduler_mode import make as make_scheduler
from test_kube_scheduler_mode import pod as scheduler_pod
from test_kube_scheduler_mode import settle

CATALOG = default_catalog()
PODS = "/api/v1/namespaces/default/pods"
NOT_HELPFUL = "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."


def unschedulable(obj: dict[str, Any], message: str, reason: str = "Unschedulable") -> dict[str, Any]:
    """`obj` with the condition kube-scheduler writes on a pod it could not place."""
    obj["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": reason,
                                    "message": message, "lastProbeTime": None,
                                    "lastTransitionTime": "2026-12-02T17:00:00Z"}]
    return obj


@pytest.mark.parametrize(("message", "label"), [
    # the reason counted on the most nodes: 2 > 1
    ("0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 Insufficient nvidia.com/gpu. " + NOT_HELPFUL,
     "Insufficient nvidia.com/gpu"),
    # a tie (1 = 1): the first in the message (kube-scheduler sorts them as strings)
    ("0/2 nodes are available: 1 Insufficient cpu, 1 Insufficient memory.", "Insufficient cpu"),
    # Go's string sort puts "10 …" before "2 …": the count decides, not the place (10 > 2)
    ("0/12 nodes are available: 10 GPU model mismatch, 2 insufficient idle GPUs.", "GPU model mismatch"),
    # a reason with ": " in it keeps its head only (reason_label), as the in-process reasons do
    ("0/1 nodes are available: 1 node(s) had volume node affinity conflict: zone.",
     "node(s) had volume node affinity conflict"),
    # gpuplane-scheduler's PreFilter-like refusals, folded as outcome_reason folds the scheduler's status
    ("0/4 nodes are available: gang default/g is waiting for its members (minMember 4).", "gang members missing"),
    ("0/4 nodes are available: gang default/g: 4 members do not fit together.", "gang does not fit whole"),
    ("0/4 nodes are available: queue team-a: 10 of 10 GPUs in use.", "queue at its quota"),
    ("0/4 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
     "pod has unbound immediate PersistentVolumeClaims"),
    ("0/0 nodes are available.", OTHER_REASON),
    ("no nodes available to schedule pods", "no nodes available to schedule pods"),
    ("", OTHER_REASON),
])
def test_a_fit_error_message_folds_into_the_reason_on_the_most_nodes(message: str, label: str) -> None:
    assert fit_error_reason(message) == label


@pytest.mark.parametrize(("conditions", "reason"), [
    ([], None),  # no scheduler has judged it
    ([{"type": "PodScheduled", "status": "True"}], None),
    ([{"type": "Ready", "status": "False", "reason": "Unschedulable", "message": "x"}], None),
    ([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
       "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}], "Insufficient nvidia.com/gpu"),
    ([{"type": "PodScheduled", "status": "False", "reason": "SchedulerError", "message": "binding refused"}],
     "SchedulerError"),  # gpuplane-scheduler's failed bind: the condition's reason
    ([{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}], OTHER_REASON),  # no message
])
def test_the_pending_reason_is_read_from_the_pod_scheduled_condition(conditions: list[dict[str, Any]],
                                                                     reason: str | None) -> None:
    obj = pod_json("p")
    obj["status"]["conditions"] = conditions
    assert pending_reason(obj) == reason


def test_a_nominated_pod_waits_for_its_victims() -> None:
    """Preemption made room on n0 (`nominatedNodeName`): the pod waits for the victims to leave, as the in-process
    scheduler's `outcome_reason` says of a nominated pod."""
    obj = unschedulable(pod_json("high"), "0/1 nodes are available: 1 insufficient idle GPUs.")
    obj["status"]["nominatedNodeName"] = "n0"
    assert pending_reason(obj) == "nominated"


def test_the_board_over_a_cluster_shows_the_schedulers_reasons_and_the_queues_quotas() -> None:
    with FakeApiServer() as fake:
        fake.add_node(node_json("a100-0", cards=8))
        fake.add_object(QUEUES, queue("team-a", minGpus=2, maxGpus=10))
        team_a = {"gpuplane.io/queue": "team-a"}
        fake.add_pod(pod_json("train-0", limits={"gpuplane.io/gpu": "2"}, labels=team_a))
        fake.add_pod(unschedulable(pod_json("wait-0", limits={"gpuplane.io/gpu": "16"}, labels=team_a),
                                   "0/3 nodes are available: 1 node(s) had untolerated taint(s), 2 Insufficient "
                                   "nvidia.com/gpu. " + NOT_HELPFUL))
        fake.add_pod(unschedulable(pod_json("wait-1", limits={"gpuplane.io/gpu": "16"}),
                                   "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. " + NOT_HELPFUL))
        fake.add_pod(pod_json("new-0", limits={"gpuplane.io/gpu": "1"}))  # not judged yet
        with ClusterWatch(fake.api, CATALOG, sample_s=3600, sync_timeout_s=20) as watch:
            cards = (CardShare(0, 1000, 40_960, whole=True), CardShare(1, 1000, 40_960, whole=True))
            assert watch.cluster.bind("default/train-0", Assignment("a100-0", cards)).ok
            state = watch.board.state()
            # wait-0 and wait-1: Insufficient nvidia.com/gpu (2 and 3 nodes of 3); new-0 has no condition.
            assert state["reasons"] == {"Insufficient nvidia.com/gpu": 2, NOT_TRIED: 1}
            # no pod names a priority class: one class, (none), with the same counts
            assert state["class_reasons"] == {"(none)": {"Insufficient nvidia.com/gpu": 2, NOT_TRIED: 1}}
            assert {row[0]: row[4] for row in state["pending"]} == {
                "default/wait-0": "Insufficient nvidia.com/gpu", "default/wait-1": "Insufficient nvidia.com/gpu",
                "default/new-0": NOT_TRIED}
            # team-a: train-0 holds 2 whole cards (2 × 1000 milli = 2.0 GPUs) of min 2, max 10
            assert state["quotas"] == [["team-a", 2.0, 2.0, 10.0]]
            with DashboardServer(watch.board) as server:
                # The scheduler judges new-0 (through the status subresource, as it writes it); a Queue is added.
                fake.api.patch(f"{PODS}/new-0/status", unschedulable(
                    {"status": {}}, "0/1 nodes are available: queue team-b: 1 of 1 GPUs in use."),
                    patch_type="strategic")
                fake.api.create(QUEUES, queue("team-b", minGpus=1))

                def served() -> dict[str, Any]:
                    with urllib.request.urlopen(server.url + "api/state", timeout=10) as answer:
                        data: dict[str, Any] = json.load(answer)
                    return data

                wait_for(lambda: served()["reasons"].get("queue at its quota") == 1
                         and len(served()["quotas"]) == 2, "the condition and the new Queue")
                state = served()
                assert state["reasons"] == {"Insufficient nvidia.com/gpu": 2, "queue at its quota": 1}
                assert state["quotas"] == [["team-a", 2.0, 2.0, 10.0], ["team-b", 0.0, 1.0, None]]
                # The page draws them (headless Chromium, one live update).
                rows = table_rows(Chromium.find().dump_dom(server.url + "?updates=1"))
                assert ["Insufficient nvidia.com/gpu", "2"] in rows and ["queue at its quota", "1"] in rows
                assert ["(none)", "Insufficient nvidia.com/gpu", "2"] in rows
                assert ["(none)", "queue at its quota", "1"] in rows
                assert ["team-a", "2.00", "2.0", "10.0", ""] in rows and ["team-b", "0.00", "1.0", "–", ""] in rows
                listed = {r[0]: r[4] for r in rows if len(r) == 5 and r[0].startswith("default/")}
                assert listed == {"default/wait-0": "Insufficient nvidia.com/gpu",
                                  "default/wait-1": "Insufficient nvidia.com/gpu",
                                  "default/new-0": "queue at its quota"}
                # The pod is bound: it leaves the pending reasons.
                assert watch.cluster.bind("default/new-0", Assignment("a100-0", (CardShare(2, 1000, 40_960,
                                                                                          whole=True),))).ok
                assert watch.cluster.pending_reasons() == {"default/wait-0": "Insufficient nvidia.com/gpu",
                                                           "default/wait-1": "Insufficient nvidia.com/gpu"}
                fake.api.delete(f"{PODS}/wait-1")
                wait_for(lambda: "default/wait-1" not in watch.cluster.pending_reasons(), "the deletion")


def _judged(fake: FakeApiServer, names: list[str]) -> bool:
    """Whether gpuplane-scheduler has written a PodScheduled condition on every named pod of "default"."""
    return all(any(c.get("type") == "PodScheduled"
                   for c in (fake.get("pods", f"default/{name}") or {}).get("status", {}).get("conditions", []))
               for name in names)


def test_the_board_shows_the_reason_gpuplane_scheduler_wrote() -> None:
    with FakeApiServer() as fake:
        for i in range(2):
            fake.add_node(node_json(f"a{i}", cards=8))
        mode = make_scheduler(fake)
        try:
            mode.tick()
            fake.api.create(PODS, scheduler_pod("big", cards=16))
            settle([mode], lambda: _judged(fake, ["big"]))
            with ClusterWatch(fake.api, CATALOG, sample_s=3600, sync_timeout_s=20) as watch:
                # 2 A100 nodes of 8 cards, 16 asked: "0/2 nodes are available: 2 insufficient idle GPUs. …"
                wait_for(lambda: watch.board.state()["reasons"] == {"insufficient idle GPUs": 1}, "the reason")
        finally:
            mode.shutdown()


# The same pods in both worlds: 2 A100 nodes of 8 cards each, none bound, so every pod waits.
# (name, priority class, cards, models, gang) -> the reason either world's scheduler gives
SAME_PODS = [
    ("serve-0", "online", 16, None, None),          # 16 > 8 cards on any node: insufficient idle GPUs
    ("train-0", "training", 16, None, None),        # the same
    ("train-1", "training", 2, None, ("g", 4)),     # 1 member of a gang of 4: gang members missing
    ("dev-0", "dev", 1, {"H100-80GB"}, None),       # no H100 node: GPU model mismatch
    ("fill-0", "batch-low", 9, None, None),         # 9 > 8: insufficient idle GPUs
]


def _same_requests() -> list[Any]:
    from gpuplane.model import PodRequest, WholeCards

    return [PodRequest(f"default/{name}", cpu_milli=100, gpu=WholeCards(cards), priority_class=cls,
                       models=frozenset(models) if models else None, gang=gang[0] if gang else None,
                       gang_size=gang[1] if gang else 0)
            for name, cls, cards, models, gang in SAME_PODS]


def test_both_worlds_count_the_same_pods_reasons_per_class_alike() -> None:
    """The board counts why pods wait per priority class from the simulator's scheduling pass
    (`record_outcomes`) and from the `PodScheduled=False` conditions gpuplane-scheduler wrote on a cluster; the
    same pods on the same nodes give the same counts per class, and each class's counts add up to its pending
    pods."""
    from gpuplane.cli.extender_cmd import build_profile
    from gpuplane.kube.cluster import pod_manifest
    from gpuplane.kube.scheduler_mode import DEFAULT_SCHEDULER_NAME
    from gpuplane.report.dashboard import Board
    from gpuplane.scheduler.scheduler import Scheduler
    from gpuplane.sim.cluster import SimCluster

    expected = {
        "batch-low": {"insufficient idle GPUs": 1},
        "dev": {"GPU model mismatch": 1},
        "online": {"insufficient idle GPUs": 1},
        "training": {"gang members missing": 1, "insufficient idle GPUs": 1},  # a tie (1 = 1): by name
    }
    with FakeApiServer() as fake:
        for i in range(2):
            fake.add_node(node_json(f"a{i}", cards=8))
        mode = make_scheduler(fake)
        try:
            mode.tick()
            for request in _same_requests():
                fake.api.create(PODS, pod_manifest(request, scheduler_name=DEFAULT_SCHEDULER_NAME))
            settle([mode], lambda: _judged(fake, [name for name, *_ in SAME_PODS]))
            with ClusterWatch(fake.api, CATALOG, sample_s=3600, sync_timeout_s=20) as watch:
                wait_for(lambda: len(watch.cluster.pending_reasons()) == len(SAME_PODS), "the reasons")
                kube = watch.board.state()
                specs = [n.spec for n in watch.cluster.list_nodes()]
                with DashboardServer(watch.board) as server:
                    kube_rows = table_rows(Chromium.find().dump_dom(server.url + "?updates=1"))
        finally:
            mode.shutdown()
    sim = SimCluster(CATALOG, specs)
    for request in _same_requests():
        assert sim.create_pod(request).ok
    board = Board(sim, CATALOG, now=lambda: 0.0,
                  scheduler=Scheduler(sim, CATALOG, build_profile("binpack", None), seed=42))
    assert board.scheduler is not None
    board.record_outcomes(board.scheduler.run_pending())
    simulated = board.state()
    assert simulated["class_reasons"] == kube["class_reasons"] == expected
    with DashboardServer(board) as server:
        sim_rows = table_rows(Chromium.find().dump_dom(server.url + "?updates=1"))
    # The pages draw them alike: the rows of three cells (the classes' pending and running, the reasons by class).
    drawn = sorted(r for r in sim_rows if len(r) == 3)
    assert drawn == sorted(r for r in kube_rows if len(r) == 3)
    assert [[c, r, str(n)] for c, why in expected.items() for r, n in why.items()] == [
        r for r in sim_rows if len(r) == 3 and r[2].isdigit() and not r[1].isdigit()]
    for state in (simulated, kube):
        assert {c: sum(why.values()) for c, why in state["class_reasons"].items()} == {
            c: pending for c, (pending, _) in state["classes"].items()}
        # over all classes: insufficient idle GPUs on 3 pods (online, training, batch-low), 1 + 1 others
        assert state["reasons"] == {"insufficient idle GPUs": 3, "gang members missing": 1,
                                    "GPU model mismatch": 1}
