"""The operator against the local API server in virtual time: the leader applies a TidalPolicy through KubeCluster
(nodes get the loan labels, taints and annotations; deployments are scaled; training pods are evicted at reclaim),
labels the nodes of each GpuPool (`gpuplane.io/pool`; conflicts reported, others' labels and lent nodes left
alone), the follower does nothing, an invalid resource gets a status condition naming the field, and a new
operator instance rebuilds its state from the API and makes the same decisions as the one it replaced."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from typer import Typer
from typer.testing import CliRunner

from gpuplane.cli.operator_cmd import DEFAULT_LOAD_QUERY, PrometheusLoad, register
from gpuplane.controllers.accounting import IDLE_NOTICE, IDLE_NOTICED, IdleRule, NoReader, read_ledger
from gpuplane.controllers.tidal import LOAN_ANNOTATION, LOAN_LABEL, RECLAIM_ANNOTATION, SUBSET_LABEL
from gpuplane.kube.api import RestKubeApi
from gpuplane.kube.cluster import EVICTION_REASON, KubeCluster
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import POOL_LABEL, WORKLOAD_LABEL, assignment_annotations
from gpuplane.kube.operator import HealthServer, LedgerSettings, Operator, run_operator
from gpuplane.model import MILLI_PER_CARD, Assignment, CardShare, default_catalog
from gpuplane.port import Timer
from gpuplane.port.clock import WallClock
from gpuplane.port.metrics import PlaneMetrics
from gpuplane.scaler.prometheus import PrometheusClient
from test_scaler_prometheus import EMPTY, StubPrometheus, vector

MIDNIGHT = 1_764_374_400.0  # 2025-11-29T00:00:00Z
HOUR = 3600.0
CRS = "/apis/gpuplane.io/v1alpha1"


CATALOG = default_catalog()


class VirtualClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        raise AssertionError("the operator schedules nothing")

    def at(self, hours: float) -> None:
        """Move to `hours` after midnight of the first day (24+ for the next day)."""
        assert MIDNIGHT + hours * HOUR >= self.t
        self.t = MIDNIGHT + hours * HOUR


def tidal_policy(shrink_at: str = "22:30", generation: int = 1) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "TidalPolicy",
            "metadata": {"name": "night", "namespace": "ml", "generation": generation},
            "spec": {"services": [{"name": "chat", "minReplicas": 2, "maxReplicas": 10, "dayFloor": 6,
                                   "perReplicaCapacity": 50, "gpuMilliPerReplica": 1000}],
                     "windows": [{"name": "night", "shrinkAt": shrink_at, "lendFrom": "23:30", "reclaimAt": "07:30",
                                  "nightReplicas": {"chat": 2}}]}}


def deployment(name: str, replicas: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {WORKLOAD_LABEL: name}}}}


def populate(server: FakeApiServer) -> None:
    """One stable node and three tidal ones (8 cards each), chat's two Deployments, one chat-tidal replica running
    on tidal-0, and the TidalPolicy ml/night."""
    server.add_node(node_json("stable-0", labels={SUBSET_LABEL: "stable", POOL_LABEL: "inference-stable"}))
    for i in range(3):
        server.add_node(node_json(f"tidal-{i}", labels={SUBSET_LABEL: "tidal", POOL_LABEL: "inference-tidal"}))
    for name, replicas in (("chat-stable", 2), ("chat-tidal", 1)):
        server.add_object("/apis/apps/v1/namespaces/ml/deployments", deployment(name, replicas))
    server.add_pod(pod_json("chat-tidal-1", namespace="ml", limits={"gpuplane.io/gpu": "1"}, node="tidal-0",
                            labels={WORKLOAD_LABEL: "chat-tidal"}, phase="Running"))
    server.add_object(f"{CRS}/namespaces/ml/tidalpolicies", tidal_policy())


def operator(server: FakeApiServer, clock: VirtualClock, identity: str, prometheus: str | None = None,
             ledger: LedgerSettings | None = None) -> Operator:
    api = RestKubeApi.from_url(server.url, request_timeout_s=10)
    # Durations longer than the virtual jumps between ticks (at most 8 h here), so leadership holds across them.
    config = LeaseConfig("gpuplane-system", "gpuplane-operator", identity, lease_duration_s=12 * HOUR,
                         renew_deadline_s=10 * HOUR, retry_period_s=60)
    load = None if prometheus is None else PrometheusLoad(PrometheusClient(prometheus), DEFAULT_LOAD_QUERY)
    return Operator(api, LeaseElector(api, config, clock.now), clock, load=load, ledger=ledger)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Wait for an informer to catch up with a change made behind the operator's back."""
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def sees(op: Operator, pod: str) -> bool:
    """Whether the operator's cluster cache holds `pod` (or it has none yet: it will list it when it leads)."""
    return op.cluster is None or op.cluster.pods.get(pod) is not None


def node(server: FakeApiServer, name: str) -> dict[str, Any]:
    obj = server.get("nodes", name)
    assert obj is not None
    return obj


def replicas(server: FakeApiServer, name: str) -> int:
    obj = server.get("deployments", f"ml/{name}")
    assert obj is not None
    return int(obj["spec"]["replicas"])


def status(server: FakeApiServer, plural: str, key: str) -> dict[str, Any]:
    obj = server.get(plural, key)
    assert obj is not None
    return dict(obj.get("status") or {})


def condition(server: FakeApiServer, plural: str, key: str, type_: str) -> dict[str, Any]:
    return next(c for c in status(server, plural, key)["conditions"] if c["type"] == type_)


def lent(server: FakeApiServer) -> list[str]:
    return sorted(n for n in ("tidal-0", "tidal-1", "tidal-2")
                  if node(server, n)["metadata"]["labels"].get(LOAN_LABEL) == "lent")


def api_server() -> FakeApiServer:
    # Bookmarks every 50 ms wake idle watches, so that informers stop at once when leadership ends.
    return FakeApiServer(bookmark_interval_s=0.05)


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with api_server() as fake:
        populate(fake)
        yield fake


# ------------------------------------------------------------------ the leader applies the policy
def test_the_leader_runs_the_tidal_policy_through_the_api(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT + 22 * HOUR)
    op = operator(server, clock, "a")
    try:
        op.tick()                                  # 22:00, day: chat at its day floor 6 = 2 stable + 4 tidal
        assert op.leading
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 4)
        assert condition(server, "tidalpolicies", "ml/night", "Applied")["reason"] == "Reconciled"
        assert status(server, "tidalpolicies", "ml/night")["phase"] == "day" and lent(server) == []

        clock.at(23.75)                            # 23:45, lending: night floor 2 (all stable), tidal to 0
        op.tick()
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 0)
        # tidal-0 still holds a chat replica (no ReplicaSet controller here removes it): only 1 and 2 are lent.
        assert lent(server) == ["tidal-1", "tidal-2"]
        lent_node = node(server, "tidal-1")
        assert lent_node["metadata"]["labels"][POOL_LABEL] == "training"
        assert {"key": "gpuplane.io/tidal", "value": "lent", "effect": "NoSchedule"} in lent_node["spec"]["taints"]
        loan = json.loads(lent_node["metadata"]["annotations"][LOAN_ANNOTATION])
        assert loan == {"since": MIDNIGHT + 23.75 * HOUR, "window": "night", "home_pool": "inference-tidal"}
        assert float(lent_node["metadata"]["annotations"][RECLAIM_ANNOTATION]) == MIDNIGHT + 31.5 * HOUR  # 07:30
        assert status(server, "tidalpolicies", "ml/night") | {"conditions": None} == {
            "observedGeneration": 1, "nodes": 3, "phase": "lend", "lentNodes": 2, "conditions": None}
        # the replica to go first is marked with the lowest pod-deletion-cost
        pod = server.get("pods", "ml/chat-tidal-1")
        assert pod is not None and pod["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "0"

        # a training job lands on tidal-1 (what the scheduler would do), then the window closes at 07:30
        server.add_pod(pod_json("trainer-0", namespace="train", limits={"gpuplane.io/gpu": "8"}, node="tidal-1",
                                labels={WORKLOAD_LABEL: "trainer"}, phase="Running"))
        wait_for(functools.partial(sees, op, "train/trainer-0"), "the training pod")
        clock.at(31.6)                             # 07:36 the next day
        op.tick()
        assert lent(server) == [] and server.get("pods", "train/trainer-0") is None  # evicted for reclaim
        assert node(server, "tidal-1")["metadata"]["labels"][POOL_LABEL] == "inference-tidal"
        assert LOAN_ANNOTATION not in node(server, "tidal-1")["metadata"]["annotations"]
        assert server.requests_to(r"/namespaces/train/pods/trainer-0/eviction$", "POST")
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 4)
    finally:
        op.shutdown()


CHAT_LOAD = 'sum(rate(gpuplane_requests_total{namespace="ml",service="chat"}[1m]))'


def test_the_leader_forecasts_each_services_load_from_prometheus(server: FakeApiServer,
                                                                 stub: StubPrometheus) -> None:
    clock = VirtualClock(MIDNIGHT + 12 * HOUR)
    op = operator(server, clock, "a", prometheus=stub.url)
    try:
        stub.set(CHAT_LOAD, vector("400"))
        op.tick()  # 12:00: 400 req/s × 1.05 (the forecaster's margin; no error learnt yet) = 420 → ⌈420/50⌉ = 9
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 7)
        assert stub.queries(CHAT_LOAD) == 1
        stub.set(CHAT_LOAD, EMPTY)  # the exporter is gone: an error, never 0 (that would scale chat down)
        clock.at(12.05)
        op.tick()  # the forecast keeps what it saw 3 minutes ago (the recent maximum): still 9
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 7)
        assert op.tidal["TidalPolicy/ml/night"].controller.stats.load_misses == 1
        stub.set(CHAT_LOAD, vector("100"))
        clock.at(12.5)
        op.tick()  # 12:30: the bins ahead were never seen (a first day), so the last hour's maximum, 400: still 9
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 7)
        clock.at(13.75)
        op.tick()  # 13:45: the 400 is over an hour old; 100 × 1.05 → 3, under the day floor 6 = 2 stable + 4 tidal
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 4)
        assert stub.queries(CHAT_LOAD) == 4
    finally:
        op.shutdown()


def test_without_prometheus_the_floors_set_the_replicas(server: FakeApiServer, stub: StubPrometheus) -> None:
    stub.set(CHAT_LOAD, vector("400"))
    clock = VirtualClock(MIDNIGHT + 12 * HOUR)
    op = operator(server, clock, "a")
    try:
        op.tick()
        assert (replicas(server, "chat-stable"), replicas(server, "chat-tidal")) == (2, 4)  # the day floor 6
        assert stub.queries(CHAT_LOAD) == 0
    finally:
        op.shutdown()


@pytest.mark.parametrize(("query", "message"), [
    ("sum(rate(requests_total[1m]))", "does not name $service"),
    ('sum(rate(requests_total{service="$service",zone="$zone"}[1m]))', "unknown placeholder $zone"),
])
def test_a_load_query_that_cannot_name_the_service_exits_2(query: str, message: str) -> None:
    app = Typer()
    register(app)
    result = CliRunner().invoke(app, ["operator", "--prometheus", "http://127.0.0.1:9", "--load-query", query])
    assert result.exit_code == 2
    assert message in result.output


def test_held_evictions_are_retried_by_the_next_pass_not_by_sleeping(server: FakeApiServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Three training pods whose evictions a disruption budget holds for good. With KubeCluster's default four
    # attempts each eviction would wait 1 + 2 + 4 s, 3 × 7 = 21 s in one tick: past a 15 s lease. The operator
    # tries each once per pass; the tidal controller's next pass (its strays) is the retry.
    waits: list[float] = []
    monkeypatch.setattr(KubeCluster, "_wait", lambda self, delay_s: waits.append(delay_s))
    clock = VirtualClock(MIDNIGHT + 23.75 * HOUR)
    op = operator(server, clock, "a")
    trainers = [f"train/trainer-{i}" for i in range(3)]
    try:
        op.tick()                                  # 23:45: tidal-1 and tidal-2 lent
        assert lent(server) == ["tidal-1", "tidal-2"]
        for i, key in enumerate(trainers):
            trainer = pod_json(key.split("/")[1], namespace="train", limits={"gpuplane.io/gpu": "2"},
                               node=f"tidal-{1 + i % 2}", labels={WORKLOAD_LABEL: "trainer"}, phase="Running")
            trainer["spec"]["nodeSelector"] = {POOL_LABEL: "training"}  # a training pod: the lent nodes' pool
            server.add_pod(trainer)
            server.block_eviction(key)
            wait_for(functools.partial(sees, op, key), key)
        for hours, passes in ((31.6, 1), (31.7, 2)):  # 07:36 reclaim, 07:42 the held ones again (strays)
            clock.at(hours)
            op.tick()
            assert op.leading and waits == []
            for key in trainers:
                assert server.get("pods", key) is not None
                name = key.split("/")[1]
                assert len(server.requests_to(rf"/namespaces/train/pods/{name}/eviction$", "POST")) == passes
                # the reason is written once: the second pass finds it on the pod
                assert len([r for r in server.requests_to(rf"/namespaces/train/pods/{name}$", "PATCH")
                            if EVICTION_REASON in str(r[2])]) == 1
        lease = server.get("leases", "gpuplane-system/gpuplane-operator")
        assert lease is not None and lease["spec"]["holderIdentity"] == "a"
    finally:
        op.shutdown()


def test_the_follower_does_nothing(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT + 23.75 * HOUR)
    leader, follower = operator(server, clock, "a"), operator(server, clock, "b")
    try:
        leader.tick()
        assert leader.leading and lent(server) == ["tidal-1", "tidal-2"]
        writes = [r for r in server.requests if r[0] != "GET"]
        for hours in (24, 25, 26):
            clock.at(hours)
            follower.tick()
        assert not follower.leading and follower.cluster is None and not follower.informers
        assert [r for r in server.requests if r[0] != "GET"] == writes  # the follower wrote nothing
    finally:
        leader.shutdown()
        follower.shutdown()


def test_the_follower_takes_over_when_the_leader_shuts_down(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT + 23.75 * HOUR)
    a, b = operator(server, clock, "a"), operator(server, clock, "b")
    try:
        a.tick()
        b.tick()
        a.shutdown()                               # releases the Lease
        clock.at(23.8)                             # b's next try, one retry period (60 s) later
        b.tick()
        assert b.leading and not a.leading
        lease = server.get("leases", "gpuplane-system/gpuplane-operator")
        assert lease is not None and lease["spec"]["holderIdentity"] == "b"
    finally:
        b.shutdown()



def test_only_the_leader_books_the_ledger_and_a_handover_books_nothing_twice(server: FakeApiServer,
                                                                            tmp_path: Path) -> None:
    """Two replicas share one ledger file (a volume both mount); `train` holds card 0 of tidal-1 all along.
    a leads from 23:00 and samples every 10 minutes; b, the follower, books nothing. a samples at 23:15 and shuts
    down at once (nothing left open); b takes the released Lease at 23:24, samples at 23:54 and shuts down:
    15 + 30 = 45 minutes of one card, in intervals that do not overlap, the 9 minutes without a leader unbooked."""
    card = CardShare(0, MILLI_PER_CARD, CATALOG.get("A100-40GB").memory_mib, 0, 0, whole=True)
    server.add_pod(pod_json("train", namespace="ml", limits={"gpuplane.io/gpu": "1"}, node="tidal-1",
                            phase="Running", annotations=assignment_annotations(Assignment("tidal-1", (card,)), 0.0)))
    settings = LedgerSettings(tmp_path / "ledger.jsonl", NoReader(), sample_s=600.0)
    clock = VirtualClock(MIDNIGHT + 23.0 * HOUR)
    a, b = operator(server, clock, "a", ledger=settings), operator(server, clock, "b", ledger=settings)
    a.tick()
    b.tick()
    assert a.leading and not b.leading and b.ledger is None
    clock.at(23.25)
    a.tick()  # 15 min ≥ 10: a sample books 23:00-23:15
    b.tick()
    a.shutdown()  # at 23:15 too: nothing more to book
    clock.at(23.4)
    b.tick()  # takes the released Lease at 23:24
    assert b.leading and b.ledger is not None
    clock.at(23.9)
    b.tick()  # a sample books 23:24-23:54
    b.shutdown()
    mine = sorted((x for x in read_ledger(settings.path) if x.pod == "ml/train"), key=lambda x: x.start)
    spans = [(round((x.start - MIDNIGHT) / HOUR, 6), round((x.end - MIDNIGHT) / HOUR, 6)) for x in mine]
    assert spans == [(23.0, 23.25), (23.4, 23.9)]
    assert all(x.gpu_milli == MILLI_PER_CARD and x.node == "tidal-1" for x in mine)
    assert sum(x.end - x.start for x in mine) == pytest.approx(0.75 * HOUR)

def test_the_leader_runs_the_idle_policy_on_its_ledgers_readings(server: FakeApiServer, tmp_path: Path) -> None:
    """A dev box holds card 0 of tidal-1 with no utilisation read (used 0 of what it holds). Rule: dev pods at most
    5 % busy over 10 minutes are noticed, then evicted 10 minutes later. a leads from 23:00 and samples every
    10 minutes: at 23:10 the box has held its card a whole window at 0 % (600 of 600 GPU-s idle): noticed, due at
    23:20; at 23:20 it is evicted, with the policy's reason."""
    card = CardShare(0, MILLI_PER_CARD, CATALOG.get("A100-40GB").memory_mib, 0, 0, whole=True)
    box = pod_json("box", namespace="ml", limits={"gpuplane.io/gpu": "1"}, node="tidal-1", phase="Running",
                   annotations=assignment_annotations(Assignment("tidal-1", (card,)), 0.0))
    box["spec"]["priorityClassName"] = "dev"
    server.add_pod(box)
    settings = LedgerSettings(tmp_path / "ledger.jsonl", NoReader(), sample_s=600.0,
                              idle_rules=(IdleRule("dev", window_s=600.0, grace_s=600.0),))
    clock = VirtualClock(MIDNIGHT + 23.0 * HOUR)
    op = operator(server, clock, "a", ledger=settings)
    try:
        op.tick()
        assert op.idle is not None and op.idle.actions == []
        clock.at(23.0 + 10 / 60)
        op.tick()
        assert [(a.kind, a.efficiency) for a in op.idle.actions] == [("notice", 0.0)]
        pod = server.get("pods", "ml/box")
        assert pod is not None and json.loads(pod["metadata"]["annotations"][IDLE_NOTICE])["action"] == "evict"
        notices = [e for e in server.api.list("/api/v1/namespaces/ml/events")[0] if e.get("reason") == IDLE_NOTICED]
        assert [(e["type"], e["involvedObject"]["name"]) for e in notices] == [("Warning", "box")]
        assert not server.requests_to(r"/eviction$")
        wait_for(lambda: IDLE_NOTICE in (op.cluster.pods.get("ml/box") or {}).get("metadata", {}).get(  # type: ignore[union-attr]
            "annotations", {}), "the notice in the cache")
        clock.at(23.0 + 20 / 60)
        op.tick()
        assert [a.kind for a in op.idle.actions] == ["notice", "evict"]
        assert len(server.requests_to(r"/pods/box/eviction$", "POST")) == 1
    finally:
        op.shutdown()
    assert op.idle is None  # not leading: no policy runs


@pytest.mark.parametrize(("text", "expected"), [
    ("dev:3600:0.05:1800:evict", IdleRule("dev", 3600.0, 0.05, 1800.0, "evict")),
    ("low:600:0:0:scale-to-zero", IdleRule("low", 600.0, 0.0, 0.0, "scale-to-zero")),
    ("dev:3600:0.05:1800", "expected CLASS:WINDOW_S:MAX_EFFICIENCY:GRACE_S:ACTION"),
    ("dev:an hour:0.05:1800:evict", "WINDOW_S 'an hour' is not a number"),
    ("dev:3600:0.05:1800:kill", "ACTION 'kill' is not evict or scale-to-zero"),
    (":3600:0.05:1800:evict", "CLASS is empty"),
    ("dev:3600:1.5:1800:evict", "0 <= max_efficiency < 1"),
])
def test_idle_rules_on_the_command_line(text: str, expected: IdleRule | str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from gpuplane.cli.operator_cmd import parse_idle_rule

    if isinstance(expected, IdleRule):
        assert parse_idle_rule(text) == expected
        return
    from typer import Exit

    with pytest.raises(Exit) as exited:
        parse_idle_rule(text)
    assert exited.value.exit_code == 2
    assert expected in capsys.readouterr().err.replace("\n", "")


# ------------------------------------------------------------------ invalid resources
def test_an_invalid_resource_gets_a_condition_naming_the_field_and_is_not_applied(server: FakeApiServer) -> None:
    server.mutate("tidalpolicies", "ml/night", lambda obj: obj.update(tidal_policy("25:00", generation=2)))
    # The pool of the tidal nodes, named as they are labelled already: valid, and nothing to write.
    server.add_object(f"{CRS}/gpupools", {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool",
                                          "metadata": {"name": "inference-tidal", "generation": 1},
                                          "spec": {"models": ["A100-40GB"], "nodeSelector": {SUBSET_LABEL: "tidal"}}})
    server.add_object(f"{CRS}/gpupools", {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool",
                                          "metadata": {"name": "bad"},
                                          "spec": {"models": ["A100-40GB"], "split": 0}})
    clock = VirtualClock(MIDNIGHT + 23.75 * HOUR)
    op = operator(server, clock, "a")
    try:
        op.tick()
        valid = condition(server, "tidalpolicies", "ml/night", "Valid")
        assert (valid["status"], valid["reason"], valid["observedGeneration"]) == ("False", "InvalidSpec", 2)
        assert valid["message"].startswith("spec.windows[0].shrinkAt: ")
        assert condition(server, "tidalpolicies", "ml/night", "Applied")["status"] == "False"
        assert lent(server) == [] and replicas(server, "chat-tidal") == 1  # nothing applied
        assert not server.requests_to(r"^/api/v1/nodes/", "PATCH")
        assert not server.requests_to(r"/deployments/.*/scale$", "PATCH")
        bad = condition(server, "gpupools", "bad", "Valid")
        assert (bad["status"], bad["observedGeneration"]) == ("False", 1) and bad["message"].startswith("spec.split: ")
        assert condition(server, "gpupools", "bad", "Applied")["reason"] == "InvalidSpec"
        assert condition(server, "gpupools", "inference-tidal", "Valid")["status"] == "True"
        assert status(server, "gpupools", "inference-tidal")["nodes"] == 3

        # fixed: the next pass applies it
        server.mutate("tidalpolicies", "ml/night", lambda obj: obj.update(tidal_policy(generation=3)))
        wait_for(lambda: any(o["metadata"].get("generation") == 3 for o in op.informers["TidalPolicy"].objects()),
                 "the fixed policy")
        op.tick()
        assert condition(server, "tidalpolicies", "ml/night", "Valid")["status"] == "True"
        assert status(server, "tidalpolicies", "ml/night")["observedGeneration"] == 3
        assert lent(server) == ["tidal-1", "tidal-2"]
    finally:
        op.shutdown()


def test_an_unchanged_status_is_not_rewritten(server: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT + 12 * HOUR)
    op = operator(server, clock, "a")
    try:
        op.tick()
        wait_for(lambda: all(o.get("status") for o in op.informers["TidalPolicy"].objects()), "the status")
        writes = len(server.requests_to(r"/tidalpolicies/night/status$", "PATCH"))
        clock.at(12.5)
        op.tick()
        assert len(server.requests_to(r"/tidalpolicies/night/status$", "PATCH")) == writes == 1
    finally:
        op.shutdown()


# ------------------------------------------------------------------ restart
STEPS = (22.0, 23.75, 24.5, 27.0, 31.6)  # day, lending, night, night, reclaimed the next morning
TRAINING_AT = 24.0


def decisions(server: FakeApiServer, since: int) -> list[tuple[str, str, Any]]:
    """The writes after request `since`, leaving out the Lease and status writes (bookkeeping, not decisions)."""
    return [r for r in server.requests[since:]
            if r[0] != "GET" and "/leases" not in r[1] and not r[1].endswith("/status")]


def world(server: FakeApiServer) -> dict[str, Any]:
    """What the controllers decided, as the API holds it."""
    def strip(obj: dict[str, Any] | None) -> Any:
        assert obj is not None
        meta = obj["metadata"]
        return {"labels": meta.get("labels"), "annotations": meta.get("annotations"),
                "taints": obj["spec"].get("taints"), "replicas": obj["spec"].get("replicas")}
    return {"nodes": {n: strip(server.get("nodes", n)) for n in server.keys("nodes")},
            "pods": {p: strip(server.get("pods", p)) for p in server.keys("pods")},
            "deployments": {d: strip(server.get("deployments", d)) for d in server.keys("deployments")},
            "status": {k: v for k, v in status(server, "tidalpolicies", "ml/night").items()}}


def run_steps(server: FakeApiServer, clock: VirtualClock, restart_after: float | None
              ) -> list[tuple[list[tuple[str, str, Any]], dict[str, Any]]]:
    """Tick at each of STEPS; with `restart_after`, the operator shuts down after that step and a new instance
    (another replica) carries on. Returns, per step, the writes it made and the world after it."""
    op = operator(server, clock, "a")
    out = []
    try:
        for hours in STEPS:
            clock.at(hours)
            if hours > TRAINING_AT and server.get("pods", "train/trainer-0") is None and hours < 31:
                server.add_pod(pod_json("trainer-0", namespace="train", limits={"gpuplane.io/gpu": "8"},
                                        node="tidal-1", labels={WORKLOAD_LABEL: "trainer"}, phase="Running"))
                wait_for(functools.partial(sees, op, "train/trainer-0"), "the training pod")
            since = len(server.requests)
            op.tick()
            out.append((decisions(server, since), world(server)))
            if hours == restart_after:
                op.shutdown()
                op = operator(server, clock, "b")   # a fresh process: nothing in memory
    finally:
        op.shutdown()
    return out


def test_a_new_operator_rebuilds_its_state_from_the_api_and_decides_the_same() -> None:
    with api_server() as first, api_server() as second:
        populate(first)
        populate(second)
        straight = run_steps(first, VirtualClock(MIDNIGHT), restart_after=None)
        restarted = run_steps(second, VirtualClock(MIDNIGHT), restart_after=23.75)
    assert [len(d) for d, _ in straight] == [len(d) for d, _ in restarted]
    for step, ((writes_a, world_a), (writes_b, world_b)) in enumerate(zip(straight, restarted, strict=True)):
        assert writes_a == writes_b, f"step {STEPS[step]} h"
        assert world_a == world_b, f"step {STEPS[step]} h"
    # and the run did make decisions: lent two nodes at 23:45, evicted the trainer and returned them at 07:36
    assert straight[1][1]["status"]["lentNodes"] == 2 and restarted[2][1]["status"]["lentNodes"] == 2
    assert any(path.endswith("/trainer-0/eviction") for _, path, _ in restarted[-1][0])
    assert restarted[-1][1]["status"]["lentNodes"] == 0 and "train/trainer-0" not in restarted[-1][1]["pods"]


# ------------------------------------------------------------------ running it
def test_run_operator_leads_until_stopped_and_releases(server: FakeApiServer) -> None:
    config = LeaseConfig("gpuplane-system", "gpuplane-operator", "pod-a", 15, 10, 0.05)
    stop = threading.Event()
    api = RestKubeApi.from_url(server.url, request_timeout_s=10)
    thread = threading.Thread(target=run_operator, args=(api, config, stop), kwargs={"clock": WallClock()})
    thread.start()
    try:
        wait_for(lambda: bool(server.requests_to(r"/tidalpolicies/night/status$", "PATCH")), "a status write")
    finally:
        stop.set()
        thread.join(20)
    assert not thread.is_alive()
    lease = server.get("leases", "gpuplane-system/gpuplane-operator")
    assert lease is not None and lease["spec"]["holderIdentity"] == ""   # released on the way out


def test_health_server_answers() -> None:
    import urllib.request

    health = HealthServer(0, "127.0.0.1").start()
    try:
        port = health.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
            assert answer.status == 200
    finally:
        health.stop()


@pytest.mark.parametrize(("args", "message"), [
    (["operator", "--lease-duration", "5", "--renew-deadline", "10"], "lease_duration_s 5.0 must be above"),
    (["operator", "--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig /nonexistent/kubeconfig"),
    (["webhook", "--cert", "/nonexistent.crt"], "--cert and --key go together"),
    (["webhook", "--cert", "/nonexistent.crt", "--key", "/nonexistent.key"], "--cert /nonexistent.crt: no such file"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], message: str) -> None:
    app = Typer()
    register(app)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


# ------------------------------------------------------------------ GpuPools
def gpu_pool(name: str, selector: dict[str, str], models: tuple[str, ...] = ("A100-40GB",),
             **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": name},
            "spec": {"models": list(models), "nodeSelector": selector, **spec}}


def pool_world(server: FakeApiServer) -> None:
    """Team a's nodes: a-0, a-1 (A100-40GB), a-h (H100-80GB: not a model of pool a), a-x (also in zone x: pool
    dev selects it too), a-hand (labelled pool=manual by someone else); a-lent (lent by the tidal controller:
    pool training, loan label); b-0 (team b). Pools a (team=a, A100-40GB) and dev (zone=x)."""
    team_a = {"team": "a"}
    server.add_node(node_json("a-0", labels=team_a))
    server.add_node(node_json("a-1", labels=team_a))
    server.add_node(node_json("a-h", model="H100-80GB", labels=team_a))
    server.add_node(node_json("a-x", labels={**team_a, "zone": "x"}))
    server.add_node(node_json("a-hand", labels={**team_a, POOL_LABEL: "manual"}))
    server.add_node(node_json("a-lent", labels={**team_a, POOL_LABEL: "training", LOAN_LABEL: "lent"}))
    server.add_node(node_json("b-0", labels={"team": "b"}))
    server.add_object(f"{CRS}/gpupools", gpu_pool("a", team_a, oversubscriptionRatio=2.0))
    server.add_object(f"{CRS}/gpupools", gpu_pool("dev", {"zone": "x"}))


def pool_labels(server: FakeApiServer) -> dict[str, str | None]:
    return {n: node(server, n)["metadata"]["labels"].get(POOL_LABEL) for n in server.keys("nodes")}


def node_patches(server: FakeApiServer) -> list[tuple[str, str, Any]]:
    return server.requests_to(r"^/api/v1/nodes/", "PATCH")


def statuses_seen(op: Operator) -> bool:
    """Whether the operator's GpuPool informer holds the statuses it wrote (so a pass compares with them)."""
    return all(o.get("status", {}).get("conditions") for o in op.informers["GpuPool"].objects())


@pytest.fixture
def pools() -> Iterator[FakeApiServer]:
    with api_server() as fake:
        pool_world(fake)
        yield fake


BEFORE = {"a-0": None, "a-1": None, "a-h": None, "a-x": None, "a-hand": "manual", "a-lent": "training", "b-0": None}
AFTER = {**BEFORE, "a-0": "a", "a-1": "a"}
"""a-0, a-1: pool a alone selects them. a-h: no pool (H100 is not a model of a). a-x: a and dev (conflict).
a-hand: someone else's label. a-lent: lent. b-0: no pool."""


def test_the_leader_labels_each_pools_nodes_and_reports_them(pools: FakeApiServer) -> None:
    op = operator(pools, VirtualClock(MIDNIGHT), "a")
    try:
        op.tick()
        assert pool_labels(pools) == AFTER
        assert sorted(r[1] for r in node_patches(pools)) == ["/api/v1/nodes/a-0", "/api/v1/nodes/a-1"]
        a = status(pools, "gpupools", "a")
        assert (a["nodes"], a["models"]) == (2, ["A100-40GB"])
        assert condition(pools, "gpupools", "a", "Applied")["status"] == "True"
        conflict = condition(pools, "gpupools", "a", "Conflict")
        assert (conflict["status"], conflict["reason"]) == ("True", "OverlappingPools")
        assert "nodes a-x are also selected by GpuPool dev" in conflict["message"]
        assert f"nodes a-hand carry {POOL_LABEL}=manual" in conflict["message"]
        assert "a-lent" not in conflict["message"]
        dev = status(pools, "gpupools", "dev")
        assert (dev["nodes"], dev["models"]) == (0, [])
        assert "nodes a-x are also selected by GpuPool a" in condition(pools, "gpupools", "dev", "Conflict")["message"]
    finally:
        op.shutdown()


def test_a_second_pass_writes_nothing(pools: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    op = operator(pools, clock, "a")
    try:
        op.tick()
        wait_for(lambda: statuses_seen(op), "the pools' statuses")
        writes = decisions(pools, 0), pools.requests_to(r"/gpupools/.*/status$", "PATCH")
        clock.at(1)
        op.tick()
        assert (decisions(pools, 0), pools.requests_to(r"/gpupools/.*/status$", "PATCH")) == writes
        assert len(writes[1]) == 2  # one status write per pool, on the first pass
    finally:
        op.shutdown()


def test_a_node_the_pool_no_longer_selects_loses_the_label_only_if_it_names_the_pool(pools: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    op = operator(pools, clock, "a")
    try:
        op.tick()
        assert pool_labels(pools) == AFTER
        pools.mutate("gpupools", "a", lambda obj: obj["spec"].update(nodeSelector={"team": "b"}))
        wait_for(lambda: all(o["spec"]["nodeSelector"] == {"team": "b"} for o in op.informers["GpuPool"].objects()
                             if o["metadata"]["name"] == "a"), "the new selector")
        since = len(pools.requests)
        clock.at(1)
        op.tick()
        # a-0, a-1 leave (their label names a); b-0 joins; a-hand (manual) and a-lent (training) untouched;
        # a-x is dev's alone now: labelled dev.
        assert pool_labels(pools) == {**BEFORE, "b-0": "a", "a-x": "dev"}
        patched = sorted(r[1].rsplit("/", 1)[1] for r in pools.requests[since:]
                         if r[0] == "PATCH" and r[1].startswith("/api/v1/nodes/"))
        assert patched == ["a-0", "a-1", "a-x", "b-0"]
        assert condition(pools, "gpupools", "dev", "Conflict")["status"] == "False"
        assert status(pools, "gpupools", "dev")["nodes"] == 1
        assert status(pools, "gpupools", "a")["nodes"] == 1
    finally:
        op.shutdown()


def test_lent_nodes_and_others_labels_are_never_touched(pools: FakeApiServer) -> None:
    # A pool named after the tidal controller's training pool, selecting the lent node: still the loan's.
    pools.add_object(f"{CRS}/gpupools", gpu_pool("training", {"team": "nobody"}))
    pools.add_object(f"{CRS}/gpupools", gpu_pool("hand", {"kubernetes.io/hostname": "a-hand"}))
    op = operator(pools, VirtualClock(MIDNIGHT), "a")
    try:
        op.tick()
        # pool training selects nothing, yet a-lent keeps pool=training (lent: skipped); a-hand is selected by a
        # and hand (a conflict) and keeps the label someone else set.
        labels = pool_labels(pools)
        assert (labels["a-lent"], labels["a-hand"]) == ("training", "manual")
        assert not any(r[1].endswith(("/a-lent", "/a-hand")) for r in node_patches(pools))
        assert node(pools, "a-lent")["metadata"]["labels"][LOAN_LABEL] == "lent"
        assert status(pools, "gpupools", "training")["nodes"] == 0
    finally:
        op.shutdown()


def test_a_failed_label_write_is_reported_and_retried(pools: FakeApiServer) -> None:
    pools.fail_next("PATCH", r"^/api/v1/nodes/a-1$", 500, "InternalError")
    clock = VirtualClock(MIDNIGHT)
    op = operator(pools, clock, "a")
    try:
        op.tick()
        applied = condition(pools, "gpupools", "a", "Applied")
        assert (applied["status"], applied["reason"]) == ("False", "PatchFailed") and "a-1" in applied["message"]
        assert status(pools, "gpupools", "a")["nodes"] == 1
        wait_for(lambda: statuses_seen(op), "the pools' statuses")
        clock.at(1)
        op.tick()
        assert pool_labels(pools) == AFTER
        assert condition(pools, "gpupools", "a", "Applied")["status"] == "True"
        assert status(pools, "gpupools", "a")["nodes"] == 2
    finally:
        op.shutdown()


def test_the_follower_labels_nothing(pools: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    leader, follower = operator(pools, clock, "a"), operator(pools, clock, "b")
    try:
        leader.tick()
        pools.mutate("nodes", "a-0", lambda obj: obj["metadata"]["labels"].pop(POOL_LABEL))
        writes = [r for r in pools.requests if r[0] != "GET"]
        clock.at(1)
        follower.tick()
        assert not follower.leading
        assert [r for r in pools.requests if r[0] != "GET"] == writes
        assert pool_labels(pools)["a-0"] is None  # nobody put it back
    finally:
        leader.shutdown()
        follower.shutdown()


def test_a_new_operator_makes_the_same_labels_without_flapping(pools: FakeApiServer) -> None:
    clock = VirtualClock(MIDNIGHT)
    first = operator(pools, clock, "a")
    try:
        first.tick()
    finally:
        first.shutdown()
    labels = pool_labels(pools)
    since = len(pools.requests)
    clock.at(1)
    second = operator(pools, clock, "b")
    try:
        second.tick()
        assert second.leading
        assert pool_labels(pools) == labels == AFTER
        assert decisions(pools, since) == []   # no node written: nothing to change, nothing taken off and back
        assert not [r for r in pools.requests[since:] if r[0] == "PATCH" and "/gpupools/" in r[1]]  # nor statuses
    finally:
        second.shutdown()


def _leader_gauge(metrics: PlaneMetrics) -> float | None:
    for line in metrics.exposition().decode().splitlines():
        if line.startswith('gpuplane_leader{component="operator"}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_leader_gauge_follows_the_lease(server: FakeApiServer) -> None:
    """Two replicas: the first to tick takes the Lease (gauge 1), the other waits (gauge 0); when the leader
    shuts down (releasing the Lease), the other takes it on its next tick."""
    clock = VirtualClock(MIDNIGHT + 12 * HOUR)
    gauges = {name: PlaneMetrics() for name in ("a", "b")}
    ops = {name: operator(server, clock, name) for name in ("a", "b")}
    for name, op in ops.items():
        op.metrics = gauges[name]
    ops["a"].tick()
    ops["b"].tick()
    assert (_leader_gauge(gauges["a"]), _leader_gauge(gauges["b"])) == (1.0, 0.0)
    ops["a"].shutdown()
    assert _leader_gauge(gauges["a"]) == 0.0
    clock.t += 60.0  # the other's next retry
    ops["b"].tick()
    assert _leader_gauge(gauges["b"]) == 1.0
    ops["b"].shutdown()
