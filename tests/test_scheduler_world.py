"""The scheduler driving the simulated cluster through the cluster port."""

from __future__ import annotations

import numpy as np

from gpuplane.model import (
    Assignment,
    CardShare,
    Fraction,
    NodeSpec,
    PodRequest,
    PoolConfig,
    Taint,
    Toleration,
    WholeCards,
    default_catalog,
)
from gpuplane.port import Code, EventKind, PodPhase, Status
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry
from gpuplane.sim import SimCluster

CATALOG = default_catalog()
T4 = CATALOG.get("T4")
PROFILE = default_registry().build(PolicyConfig())


def t4_node(name: str, cards: int = 2, **changes: object) -> NodeSpec:
    spec = NodeSpec(name, 32000, 131072, "T4", cards)
    return spec.with_changes(**changes) if changes else spec


def gpu_pod(name: str, cards: int = 1, **extra: object) -> PodRequest:
    return PodRequest(name, cpu_milli=1000, memory_mib=1024, gpu=WholeCards(cards), **extra)  # type: ignore[arg-type]


def whole(node: str, *cards: int) -> Assignment:
    return Assignment(node, tuple(CardShare(c, 1000, T4.memory_mib, T4.encoders, T4.decoders, whole=True)
                                  for c in cards))


def assert_cache_matches(scheduler: Scheduler, cluster: SimCluster) -> None:
    """The scheduler's cache accounts exactly what the cluster accounts."""
    assert set(scheduler.state.bindings) == set(cluster.state.bindings)
    for name, binding in cluster.state.bindings.items():
        assert scheduler.state.bindings[name].assignment == binding.assignment
    assert scheduler.state.fingerprint() == cluster.state.fingerprint()


def node_of(cluster: SimCluster, pod: str) -> str | None:
    info = cluster.get_pod(pod)
    return info.assignment.node if info is not None and info.assignment is not None else None


# ---------------------------------------------------------------------------------------------- cache build
def test_cache_is_built_from_the_port_lists() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0"), t4_node("n1")])
    cluster.create_pod(gpu_pod("early", 2))
    assert cluster.bind("early", whole("n0", 0, 1)).ok
    cluster.create_pod(gpu_pod("waiting"))
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    assert "early" in scheduler.state.bindings
    assert scheduler.state.idle_cards[scheduler.state.node_index["n0"]] == 0
    assert_cache_matches(scheduler, cluster)
    assert "waiting" in scheduler.queue and "early" not in scheduler.queue
    (outcome,) = scheduler.run_pending()
    assert outcome.request.name == "waiting" and outcome.decision.status.ok
    assert node_of(cluster, "waiting") == "n1"  # n0 is full because of the pod bound before the start
    assert_cache_matches(scheduler, cluster)


def test_a_terminating_pod_is_counted_at_start() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0", 1)])
    cluster.create_pod(gpu_pod("old"))
    cluster.bind("old", whole("n0", 0))
    cluster.evict("old", grace_s=30.0)
    cluster.create_pod(gpu_pod("new"))
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    assert_cache_matches(scheduler, cluster)
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.UNSCHEDULABLE
    cluster.loop.run()  # grace ends, the old pod goes and the new one is retried
    assert scheduler.run_pending()[0].decision.status.ok
    assert node_of(cluster, "new") == "n0"


def test_schedule_one_binds_through_the_port() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0"), t4_node("n1", 4)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    bound: list[str] = []
    cluster.watch(lambda e: bound.append(e.pod.name) if e.kind is EventKind.POD_BOUND and e.pod else None)
    request = gpu_pod("p", 3)
    cluster.create_pod(request)
    decision = scheduler.schedule_one(request)
    assert decision.status.ok and decision.assignment is not None
    pod = cluster.get_pod("p")
    assert pod is not None and pod.phase is PodPhase.RUNNING
    assert pod.assignment == decision.assignment
    assert decision.assignment.node == "n1" and len(decision.assignment.cards) == 3
    assert bound == ["p"]
    assert_cache_matches(scheduler, cluster)
    assert "p" not in scheduler.queue


class RefusingCluster(SimCluster):
    """A world whose kubelet refuses binds while `refuse` is set (without binding anything)."""

    refuse = True

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        if self.refuse:
            return Status.error(f"conflict: admission refused {pod}")
        return super().bind(pod, assignment, node_version=node_version)


def test_a_failed_bind_leaves_the_cache_without_the_pod() -> None:
    cluster = RefusingCluster(CATALOG, [t4_node("n0", 1)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    cluster.create_pod(gpu_pod("p"))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.ERROR
    assert outcome.decision.status.reasons[0].startswith("conflict")
    assert outcome.decision.assignment is None
    assert "p" not in scheduler.state.bindings
    assert scheduler.state.used_gpu_milli() == 0
    assert_cache_matches(scheduler, cluster)
    pod = cluster.get_pod("p")
    assert pod is not None and pod.phase is PodPhase.PENDING
    assert "p" in scheduler.queue  # parked for a retry
    cluster.refuse = False
    cluster.patch_node("n0", labels={"retry": "1"})  # a node change moves parked pods back
    (retry,) = scheduler.run_pending()
    assert retry.decision.status.ok and retry.attempt == 2
    assert_cache_matches(scheduler, cluster)


class RacingCluster(SimCluster):
    """Another actor binds `rival` to `rival_assignment` just before the scheduler's bind lands."""

    rival: tuple[str, Assignment] | None = None

    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        if self.rival is not None:
            name, theirs = self.rival
            self.rival = None
            if self.get_pod(name) is None:
                self.create_pod(gpu_pod(name))
            assert super().bind(name, theirs).ok
        return super().bind(pod, assignment, node_version=node_version)


def test_a_bind_that_lost_to_another_pod_on_the_same_card_is_forgotten() -> None:
    cluster = RacingCluster(CATALOG, [t4_node("n0", 2), t4_node("n1", 2)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    request = gpu_pod("p")
    cluster.create_pod(request)
    chosen = scheduler.decide(request).assignment
    assert chosen is not None
    cluster.rival = ("rival", chosen)  # another pod takes the very card the scheduler picked
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.ERROR
    assert outcome.decision.status.reasons[0].startswith("conflict")
    assert "p" not in scheduler.state.bindings
    assert "rival" in scheduler.state.bindings
    assert_cache_matches(scheduler, cluster)


def test_a_pod_bound_by_someone_else_during_our_bind_is_in_the_cache() -> None:
    cluster = RacingCluster(CATALOG, [t4_node("n0", 2), t4_node("n1", 2)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    request = gpu_pod("p")
    cluster.create_pod(request)
    chosen = scheduler.decide(request).assignment
    assert chosen is not None
    other = "n1" if chosen.node == "n0" else "n0"
    cluster.rival = ("p", whole(other, 1))  # the same pod, bound elsewhere first
    (outcome,) = scheduler.run_pending()
    assert not outcome.decision.status.ok
    assert node_of(cluster, "p") == other
    assert "p" not in scheduler.queue
    assert_cache_matches(scheduler, cluster)


# ---------------------------------------------------------------------------------------------- capacity
def test_deleting_pods_frees_capacity_and_retries_parked_pods() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0", 2), t4_node("n1", 2)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    for i in range(4):
        cluster.create_pod(gpu_pod(f"fill-{i}"))
    assert all(o.decision.status.ok for o in scheduler.run_pending())
    cluster.create_pod(gpu_pod("late"))
    cluster.create_pod(gpu_pod("huge", 4))
    outcomes = scheduler.run_pending()
    assert [o.decision.status.code for o in outcomes] == [Code.UNSCHEDULABLE] * 2
    assert "insufficient idle GPUs" in outcomes[0].decision.status.message
    assert {e.request.name for e in scheduler.queue.parked} == {"late", "huge"}
    assert scheduler.run_pending() == []  # parked pods are not polled

    victim = "fill-0"
    freed_node = node_of(cluster, victim)
    assert cluster.delete_pod(victim).ok
    n = scheduler.state.node_index[freed_node or ""]
    assert scheduler.state.idle_cards[n] == 1
    assert_cache_matches(scheduler, cluster)
    outcomes = scheduler.run_pending()
    assert [o.request.name for o in outcomes] == ["late"]  # the 4-card pod cannot fit on a 2-card node
    assert outcomes[0].decision.status.ok and outcomes[0].attempt == 2
    assert node_of(cluster, "late") == freed_node
    assert "huge" in scheduler.queue
    assert_cache_matches(scheduler, cluster)


def test_eviction_frees_capacity_only_after_grace() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0", 1)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now)
    cluster.create_pod(gpu_pod("old"))
    scheduler.run_pending()
    cluster.create_pod(gpu_pod("new"))
    assert not scheduler.run_pending()[0].decision.status.ok
    cluster.evict("old", grace_s=10.0)
    assert scheduler.run_pending() == []
    assert_cache_matches(scheduler, cluster)
    cluster.loop.run(until=10.0)
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.ok and outcome.waited == 10.0
    assert_cache_matches(scheduler, cluster)


def test_cache_follows_the_cluster_through_a_random_workload() -> None:
    rng = np.random.default_rng(3)
    nodes = [t4_node(f"n{i}", int(rng.choice([1, 2, 4]))) for i in range(6)]
    cluster = SimCluster(CATALOG, nodes)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=1, now=cluster.loop.now)
    for step in range(120):
        cluster.loop.run(until=float(step))
        action = rng.random()
        running = sorted(p.name for p in cluster.list_pods() if p.phase is PodPhase.RUNNING)
        if action < 0.55:
            gpu = Fraction(compute_milli=int(rng.integers(1, 10)) * 100) if rng.random() < 0.5 else \
                WholeCards(int(rng.choice([1, 2, 4])))
            cluster.create_pod(PodRequest(f"p{step}", cpu_milli=1000, memory_mib=512, gpu=gpu))
        elif action < 0.75 and running:
            cluster.delete_pod(str(rng.choice(running)))
        elif action < 0.9 and running:
            cluster.evict(str(rng.choice(running)), grace_s=float(rng.integers(0, 4)))
        else:
            cluster.patch_node(f"n{rng.integers(6)}", unschedulable=bool(rng.random() < 0.3))
        for outcome in scheduler.run_pending():
            assert outcome.decision.status.code is not Code.ERROR
        assert_cache_matches(scheduler, cluster)
        assert scheduler.state.check_invariants() == []
        pending = {p.name for p in cluster.list_pods() if p.phase is PodPhase.PENDING}
        assert pending == {e.request.name for e in scheduler.queue.parked}
    assert cluster.state.used_gpu_milli() > 0


# ---------------------------------------------------------------------------------------------- node filters
def test_no_schedule_taints_block_pods_without_a_toleration() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0", 4), t4_node("n1", 4)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    cluster.patch_node("n0", taints=[Taint("dedicated", "ml")])
    cluster.patch_node("n1", taints=[Taint("dedicated", "ml"), Taint("soft", "x", "PreferNoSchedule")])
    plain = gpu_pod("plain")
    cluster.create_pod(plain)
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert outcome.decision.diagnosis is not None
    assert outcome.decision.diagnosis.counts() == {"node(s) had untolerated taints": 2}
    assert node_of(cluster, "plain") is None

    cluster.create_pod(gpu_pod("wrong-value", tolerations=(Toleration("dedicated", "web"),)))
    cluster.create_pod(gpu_pod("exact", tolerations=(Toleration("dedicated", "ml"),)))
    cluster.create_pod(gpu_pod("any", tolerations=(Toleration("dedicated"),)))
    results = {o.request.name: o.decision.status.ok for o in scheduler.run_pending()}
    assert results == {"wrong-value": False, "exact": True, "any": True}
    cluster.patch_node("n1", taints=[])
    placed = {o.request.name: node_of(cluster, o.request.name) for o in scheduler.run_pending()
              if o.decision.status.ok}
    assert placed == {"plain": "n1", "wrong-value": "n1"}  # n0 keeps its taint


def test_unschedulable_nodes_are_skipped() -> None:
    cluster = SimCluster(CATALOG, [t4_node("n0", 4), t4_node("n1", 4)])
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    cluster.patch_node("n0", unschedulable=True)
    for i in range(4):
        cluster.create_pod(gpu_pod(f"p{i}"))
    assert all(o.decision.status.ok for o in scheduler.run_pending())
    assert {node_of(cluster, f"p{i}") for i in range(4)} == {"n1"}
    cluster.create_pod(gpu_pod("extra"))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.diagnosis is not None
    assert outcome.decision.diagnosis.node_reason(scheduler.state.node_index["n0"]) == "node(s) were unschedulable"
    cluster.patch_node("n0", unschedulable=False)  # uncordon: the parked pod is retried
    (retry,) = scheduler.run_pending()
    assert retry.decision.status.ok and node_of(cluster, "extra") == "n0"


def test_pool_restriction() -> None:
    nodes = [t4_node("a0", 2, pool="a"), t4_node("b0", 2, pool="b"), t4_node("b1", 2, pool="b")]
    cluster = SimCluster(CATALOG, nodes)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0)
    for i in range(4):
        cluster.create_pod(gpu_pod(f"b{i}", pools=frozenset({"b"})))
    cluster.create_pod(gpu_pod("b-extra", pools=frozenset({"b"})))
    cluster.create_pod(gpu_pod("c", pools=frozenset({"c"})))
    cluster.create_pod(gpu_pod("free"))
    outcomes = {o.request.name: o.decision for o in scheduler.run_pending()}
    assert {node_of(cluster, f"b{i}") for i in range(4)} == {"b0", "b1"}
    assert outcomes["b-extra"].status.code is Code.UNSCHEDULABLE
    assert outcomes["c"].status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert outcomes["c"].diagnosis is not None
    assert outcomes["c"].diagnosis.counts() == {"node(s) in another pool": 3}
    assert node_of(cluster, "free") == "a0"


def test_oversell_pool_marks_oversubscribed_assignments() -> None:
    pools = {"dev": PoolConfig(memory_oversell=2.0)}
    nodes = [t4_node("dev0", 1, pool="dev"), t4_node("prod0", 1)]  # prod0 is in pool "default"
    cluster = SimCluster(CATALOG, nodes, pools=pools)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, pools=pools)
    share = T4.memory_mib * 7 // 10  # two exceed the card's physical memory, three even the doubled one

    def frac(name: str, pool: str) -> PodRequest:
        return PodRequest(name, cpu_milli=100, memory_mib=64, gpu=Fraction(compute_milli=100, memory_mib=share),
                          pools=frozenset({pool}))

    for name, pool in (("d1", "dev"), ("d2", "dev"), ("d3", "dev"), ("p1", "default"), ("p2", "default")):
        cluster.create_pod(frac(name, pool))
    outcomes = {o.request.name: o.decision for o in scheduler.run_pending()}
    d1, d2 = outcomes["d1"].assignment, outcomes["d2"].assignment
    assert d1 is not None and d2 is not None
    assert not d1.oversubscribed
    assert d2.oversubscribed
    assert d1.node == d2.node == "dev0"
    pod = cluster.get_pod("d2")
    assert pod is not None and pod.phase is PodPhase.RUNNING and pod.assignment is not None
    assert pod.assignment.oversubscribed
    assert not outcomes["d3"].status.ok  # 3 × 70 % exceeds even the doubled memory
    assert outcomes["p1"].status.ok and not outcomes["p1"].assignment.oversubscribed  # type: ignore[union-attr]
    assert outcomes["p2"].status.code is Code.UNSCHEDULABLE
    assert "insufficient GPU memory" in outcomes["p2"].status.message
    assert_cache_matches(scheduler, cluster)
