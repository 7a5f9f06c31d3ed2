"""gpuplane's scheduler and controller metrics: the label folding, the observer of a simulated cluster's events,
and the exposition a Prometheus scrape reads (parsed back with prometheus_client's own parser)."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from builders import CATALOG, node, pod
from gpuplane.controllers.defrag import MOVE_REASON
from gpuplane.controllers.observer import ClusterObserver, eviction_cause, outcome_reason, scheduler_counters
from gpuplane.controllers.recovery import HEALTH_LABEL
from gpuplane.controllers.tidal import (
    EARLY_RECLAIM_REASON,
    LOAN_ANNOTATION,
    LOAN_LABEL,
    RECLAIM_ANNOTATION,
    RECLAIM_REASON,
)
from gpuplane.model import PodRequest, QueueQuota, Quotas
from gpuplane.port import Code, Status
from gpuplane.port.metrics import (
    ATTEMPTS,
    EVICTIONS,
    FRAGMENTATION,
    GPUS,
    LEADER,
    NODES,
    OLDEST_PENDING,
    PENDING_PODS,
    POD_SCHEDULING_DURATION,
    PREEMPTION_VICTIMS,
    QUEUE_ALLOCATED,
    QUEUE_MAX,
    RECOVERY_ACTIONS,
    TIDAL_LENT,
    TIDAL_LOAN_OVERDUE,
    TIDAL_LOANS,
    TIDAL_RECLAIMS,
    UNSCHEDULABLE_PODS,
    PlaneMetrics,
    reason_label,
)
from gpuplane.scheduler import Outcome, PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.scheduler.framework import Decision
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())
H100 = "H100-80GB"


def samples(metrics: PlaneMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by (sample name, sorted labels)."""
    text = metrics.exposition().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics: PlaneMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


# ------------------------------------------------------------------------------------------------ label folding
@pytest.mark.parametrize(("reason", "cause"), [
    ("preempted by train-7", "preemption"),
    (RECLAIM_REASON, "tidal-reclaim"),
    (EARLY_RECLAIM_REASON, "tidal-early-reclaim"),
    (MOVE_REASON, "defragmentation"),
    ("llm-pretrain: attempt 3 failed", "recovery"),
    ("gang could not start whole", "gang"),
    ("gang stop", "gang"),
    ("completed", "completed"),
    ("", "other"),
    ("terminating in the snapshot", "other"),
    ("an attempt 3 failed", "other"),  # no ": " before it: not the recovery controller's wording
])
def test_eviction_cause(reason: str, cause: str) -> None:
    assert eviction_cause(reason) == cause


@pytest.mark.parametrize(("reason", "label"), [
    ("insufficient idle GPUs", "insufficient idle GPUs"),
    ("card-only-one: cards already host workload web-3", "card-only-one"),
    ("rack-spread: node not allowed", "rack-spread"),
    ("eviction refused for a, b.", "eviction refused for a, b"),
    ("", "other"),
])
def test_reason_label(reason: str, label: str) -> None:
    assert reason_label(reason) == label


def _outcome(status: Status) -> Outcome:
    return Outcome(pod("p").whole(1).obj(), Decision(status), 0, 0.0)


@pytest.mark.parametrize(("status", "reason"), [
    (Status(Code.WAIT, ("nominated to n1; waiting for 2 victims",)), "nominated"),
    (Status(Code.WAIT, ("queue q at its max: 4 of 4 GPUs in use, 1 more asked",)), "queue at its quota"),
    (Status(Code.WAIT, ("gang g: 1 of 4 members submitted",)), "gang members missing"),
    (Status.unschedulable("gang g does not fit whole: member g-0: 0/2 nodes"), "gang does not fit whole"),
    (Status.unschedulable("eviction refused for a"), "eviction refused for a"),
    (Status.unschedulable(""), "other"),
])
def test_outcome_reason_without_a_diagnosis(status: Status, reason: str) -> None:
    assert outcome_reason(_outcome(status)) == reason


def test_a_label_outside_its_set_is_refused() -> None:
    metrics = PlaneMetrics()
    with pytest.raises(ValueError, match="cause 'typo'"):
        metrics.eviction("typo")
    with pytest.raises(ValueError, match="result"):
        metrics.attempt("bound")


# ------------------------------------------------------------------------------------------------ the observer
def world(quotas: Quotas | None = None) -> tuple[SimCluster, Scheduler, ClusterObserver, PlaneMetrics]:
    """Two 8 × H100 nodes, `a` in pool `inference`, `b` in pool `training`."""
    cluster = SimCluster(CATALOG, [node("a").gpus(8, H100).pool("inference").obj(),
                                   node("b").gpus(8, H100).pool("training").obj()])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now,
                          rules=SchedulingRules(quotas=quotas or Quotas(), default_victim_grace_s=30.0))
    metrics = PlaneMetrics()
    observer = ClusterObserver(cluster, metrics, now=cluster.loop.now, quotas=quotas)
    metrics.counters(scheduler_counters(scheduler))
    return cluster, scheduler, observer, metrics


def queued(name: str, cards: int, *, queue: str | None = None, cls: str | None = None) -> PodRequest:
    return replace(pod(name).cpu(100).mem(256).whole(cards).obj(), queue=queue, priority_class=cls)


def test_pending_bound_and_unschedulable_pods() -> None:
    cluster, scheduler, observer, metrics = world()
    cluster.loop.run(until=10.0)
    for request in (queued("p1", 8, cls="prod"), queued("p2", 8, cls="batch"), queued("big", 9, cls="batch")):
        assert cluster.create_pod(request).ok
    cluster.loop.run(until=25.0)
    observer.run_pending(scheduler)
    # p1 and p2 take one node each (8 cards); big asks 9 cards of nodes of 8 and stays pending.
    assert value(metrics, ATTEMPTS, result="scheduled") == 2
    assert value(metrics, ATTEMPTS, result="unschedulable") == 1
    assert value(metrics, PENDING_PODS, priority_class="batch", queue="none") == 1
    assert value(metrics, PENDING_PODS, priority_class="prod", queue="none") is None
    assert value(metrics, OLDEST_PENDING, priority_class="batch", queue="none") == 15.0  # created at 10, now 25
    reasons = {dict(k[1])["reason"]: v for k, v in samples(metrics).items() if k[0] == UNSCHEDULABLE_PODS}
    assert sum(reasons.values()) == 1, reasons
    # created at 10 s, bound at 25 s: both in the (5, 15] bucket and none at or below 5 s.
    assert value(metrics, POD_SCHEDULING_DURATION + "_count") == 2
    assert value(metrics, POD_SCHEDULING_DURATION + "_bucket", le="5.0") == 0
    assert value(metrics, POD_SCHEDULING_DURATION + "_bucket", le="15.0") == 2
    assert value(metrics, POD_SCHEDULING_DURATION + "_sum") == 30.0  # 15 + 15
    # all 16 cards are full.
    assert value(metrics, GPUS, pool="inference", state="full") == 8
    assert value(metrics, GPUS, pool="training", state="full") == 8
    assert value(metrics, FRAGMENTATION, pool="inference") == 0.0
    assert value(metrics, NODES, pool="inference", health="healthy") == 1
    # the big pod leaves: no pending pods, no reasons.
    assert cluster.delete_pod("big").ok
    assert value(metrics, PENDING_PODS, priority_class="batch", queue="none") is None
    assert not [k for k in samples(metrics) if k[0] == UNSCHEDULABLE_PODS]


def test_fragmentation_of_partly_used_cards() -> None:
    cluster, scheduler, observer, metrics = world()
    for i in range(3):
        assert cluster.create_pod(replace(pod(f"f{i}").cpu(100).mem(256).fraction(500, mem=1024).obj(),
                                          pools=frozenset({"inference"}))).ok
    observer.run_pending(scheduler)
    # binpack puts the three halves on two cards of `a`: one full card, one half used, six free.
    # free compute in pool inference: 0.5 (partial card) + 6 × 1.0 = 6.5 cards; fragmented share 0.5 / 6.5.
    assert value(metrics, GPUS, pool="inference", state="full") == 1
    assert value(metrics, GPUS, pool="inference", state="partial") == 1
    assert value(metrics, GPUS, pool="inference", state="free") == 6
    assert value(metrics, FRAGMENTATION, pool="inference") == pytest.approx(0.5 / 6.5)
    assert value(metrics, FRAGMENTATION, pool="training") == 0.0


def test_evictions_by_cause_and_preemption_counts() -> None:
    cluster, scheduler, observer, metrics = world()
    for name in ("v1", "v2"):
        assert cluster.create_pod(queued(name, 8)).ok
    observer.run_pending(scheduler)
    assert cluster.evict("v1", grace_s=30.0, reason=RECLAIM_REASON).ok
    assert cluster.evict("v1", grace_s=30.0, reason=RECLAIM_REASON).ok  # already terminating: counted once
    assert cluster.evict("v2", grace_s=30.0, reason="preempted by hi").ok
    assert value(metrics, EVICTIONS, cause="tidal-reclaim") == 1
    assert value(metrics, EVICTIONS, cause="preemption") == 1
    assert value(metrics, EVICTIONS, cause="defragmentation") == 0
    # the pods terminate; a deletion is not an eviction.
    cluster.loop.run(until=100.0)
    assert cluster.create_pod(queued("v3", 8)).ok
    observer.run_pending(scheduler)
    assert cluster.delete_pod("v3").ok
    assert value(metrics, EVICTIONS, cause="other") == 0
    assert value(metrics, PREEMPTION_VICTIMS) == 0  # the scheduler chose none itself


def test_scheduler_preemption_victims_exported() -> None:
    cluster, scheduler, observer, metrics = world()
    for name in ("low-a", "low-b"):
        assert cluster.create_pod(replace(queued(name, 8), priority=0)).ok
    observer.run_pending(scheduler)
    assert cluster.create_pod(replace(queued("high", 8), priority=1000)).ok
    observer.run_pending(scheduler)
    # one 8-card node must be cleared for `high`: one victim, evicted with the scheduler's reason.
    assert value(metrics, PREEMPTION_VICTIMS) == 1
    assert value(metrics, EVICTIONS, cause="preemption") == 1
    assert value(metrics, ATTEMPTS, result="waiting") == 1  # nominated while its victim terminates


def test_loans_reclaims_and_overdue() -> None:
    cluster, _scheduler, _observer, metrics = world()
    note = json.dumps({"since": 0, "window": "night", "home_pool": "inference"})
    assert cluster.patch_node("a", labels={LOAN_LABEL: "lent"}, pool="training",
                              annotations={LOAN_ANNOTATION: note, RECLAIM_ANNOTATION: "100"}).ok
    assert value(metrics, TIDAL_LOANS, pool="training") == 1
    assert value(metrics, TIDAL_LENT, pool="training") == 1
    assert value(metrics, TIDAL_LOAN_OVERDUE, node="a", window="night") == -100.0  # at t = 0: 100 s left
    cluster.loop.run(until=400.0)
    assert value(metrics, TIDAL_LOAN_OVERDUE, node="a", window="night") == 300.0  # 400 - 100
    assert cluster.patch_node("a", labels={LOAN_LABEL: None}, pool="inference",
                              annotations={LOAN_ANNOTATION: None, RECLAIM_ANNOTATION: None}).ok
    assert value(metrics, TIDAL_RECLAIMS, kind="scheduled") == 1
    assert value(metrics, TIDAL_RECLAIMS, kind="early") == 0
    assert value(metrics, TIDAL_LOAN_OVERDUE, node="a", window="night") is None
    # lent again with the deadline at 1000 s, taken back at 400 s: early.
    assert cluster.patch_node("a", labels={LOAN_LABEL: "lent"}, annotations={RECLAIM_ANNOTATION: "1000"}).ok
    assert cluster.patch_node("a", labels={LOAN_LABEL: None}, annotations={RECLAIM_ANNOTATION: None}).ok
    assert value(metrics, TIDAL_RECLAIMS, kind="early") == 1


def test_recovery_actions_from_the_health_label() -> None:
    cluster, _scheduler, _observer, metrics = world()
    for label in ("quarantined", "probation", None, "quarantined", "lemon"):
        assert cluster.patch_node("b", labels={HEALTH_LABEL: label}).ok
    assert value(metrics, RECOVERY_ACTIONS, action="quarantine") == 2
    assert value(metrics, RECOVERY_ACTIONS, action="probation") == 1
    assert value(metrics, RECOVERY_ACTIONS, action="return") == 1
    assert value(metrics, RECOVERY_ACTIONS, action="retire") == 1
    assert value(metrics, NODES, pool="training", health="lemon") == 1


def test_queue_quota_use() -> None:
    quotas = Quotas([QueueQuota("team-a", min_gpus=2, max_gpus=4)])
    cluster, scheduler, observer, metrics = world(quotas)
    for i in range(3):
        assert cluster.create_pod(queued(f"q{i}", 2, queue="team-a")).ok
    observer.run_pending(scheduler)
    # 2 + 2 GPUs bound reach the cap of 4; the third pod waits on the quota.
    assert value(metrics, QUEUE_ALLOCATED, queue="team-a") == 4.0
    assert value(metrics, QUEUE_MAX, queue="team-a") == 4.0
    assert value(metrics, UNSCHEDULABLE_PODS, reason="queue at its quota") == 1
    assert value(metrics, PENDING_PODS, priority_class="none", queue="team-a") == 1


def test_leader_extender_and_serving() -> None:
    metrics = PlaneMetrics()
    metrics.set_leader("scheduler", True)
    metrics.extender_request("filter", ok=False, seconds=0.002)
    port = metrics.serve(0, addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'gpuplane_leader{component="scheduler"} 1.0' in text
    assert 'gpuplane_extender_requests_total{result="error",verb="filter"} 1.0' in text
    assert value(metrics, LEADER, component="scheduler") == 1.0


# ------------------------------------------------------------------------------------------------ invariants
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["whole", "frac"]), st.integers(1, 8), st.integers(100, 900)),
                max_size=12))
def test_cards_and_pending_add_up(requests: list[tuple[str, int, int]]) -> None:
    cluster, scheduler, observer, _metrics = world()
    for i, (kind, cards, milli) in enumerate(requests):
        builder = pod(f"r{i}").cpu(10).mem(16)
        request = builder.whole(cards).obj() if kind == "whole" else builder.fraction(milli, mem=512).obj()
        assert cluster.create_pod(request).ok
    observer.run_pending(scheduler)
    snap = observer.snapshot()
    # every card is in exactly one state: 2 nodes × 8 cards.
    assert sum(snap.gpus.values()) == 16
    assert all(0.0 <= f <= 1.0 for f in snap.fragmentation.values())
    pending = sum(1 for p in cluster.list_pods() if p.phase.value == "Pending")
    assert sum(snap.pending.values()) == pending
    assert sum(snap.unschedulable.values()) <= pending


def test_a_new_observer_replaces_the_old_and_close_drops_its_gauges() -> None:
    cluster, scheduler, observer, metrics = world()
    assert cluster.create_pod(queued("big", 9)).ok
    observer.run_pending(scheduler)
    # a component that takes over again builds a new observer on the same registry: one set of gauges, not two.
    again = ClusterObserver(cluster, metrics, now=cluster.loop.now)
    metrics.counters(scheduler_counters(scheduler))
    text = metrics.exposition().decode()
    assert text.count("# TYPE gpuplane_scheduler_pending_pods gauge") == 1
    assert text.count("# TYPE gpuplane_scheduler_preemption_attempts_total counter") == 1
    assert value(metrics, PENDING_PODS, priority_class="none", queue="none") == 1
    observer.close()  # the old one leaves; the new one still exports under the shared key
    assert value(metrics, PENDING_PODS, priority_class="none", queue="none") == 1
    again.close()
    assert PENDING_PODS not in metrics.exposition().decode()
