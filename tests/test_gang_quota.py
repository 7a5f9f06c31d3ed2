"""Gangs (all or nothing, timeouts, network blocks, preemption) and queue quotas (maximum, borrowing,
reclaim), driven through the simulated cluster; and the bad input admission and the config loaders refuse."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import CATALOG, node, pod
from gpuplane.model import (
    MILLI_PER_CARD,
    Assignment,
    CardShare,
    GpuplaneError,
    NodeSpec,
    PodRequest,
    QueueQuota,
    QuotaError,
    Quotas,
    RequestError,
    default_priority_classes,
    load_priority_classes,
    load_quotas,
)
from gpuplane.port import Code, EventKind, PodPhase
from gpuplane.scheduler import Admission, Outcome, PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.scheduler.scheduler import NETWORK_BLOCK_LABEL
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())
A100 = CATALOG.get("A100-40GB")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

QUOTAS = Quotas([QueueQuota("a", min_gpus=2, max_gpus=4), QueueQuota("b", min_gpus=2, max_gpus=8)])
"""a: 2 guaranteed, at most 4; b: 2 guaranteed, at most 8 (all of an 8-card node)."""


# ---------------------------------------------------------------------------------------------- helpers
def world(*specs: NodeSpec, rules: SchedulingRules | None = None) -> tuple[SimCluster, Scheduler]:
    cluster = SimCluster(CATALOG, list(specs))
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=rules)
    return cluster, scheduler


def eight(name: str, block: str | None = None) -> NodeSpec:
    """An 8 × A100 node, in network block `block` if one is given."""
    builder = node(name).gpus(8)
    if block is not None:
        builder = builder.label(NETWORK_BLOCK_LABEL, block)
    return builder.obj()


def member(name: str, gang: str, size: int, cards: int | None, *, priority: int = 0,
           priority_class: str | None = None, queue: str | None = None) -> PodRequest:
    """A gang member asking for `cards` whole cards (None: CPU only)."""
    builder = pod(name).cpu(1000).mem(1024).priority(priority)
    if cards is not None:
        builder = builder.whole(cards)
    return replace(builder.obj(), gang=gang, gang_size=size, priority_class=priority_class, queue=queue)


def queued(name: str, queue: str, cards: int, *, priority: int = 0) -> PodRequest:
    return replace(pod(name).cpu(100).mem(512).whole(cards).priority(priority).obj(), queue=queue)


def pin(cluster: SimCluster, name: str, node_name: str, cards: Iterable[int]) -> None:
    """Create a pod and bind it to exactly these cards, past the scheduler (another actor's pod)."""
    cards = tuple(cards)
    assert cluster.create_pod(pod(name).cpu(100).whole(len(cards)).obj()).ok
    shares = tuple(CardShare(c, MILLI_PER_CARD, A100.memory_mib, A100.encoders, A100.decoders, whole=True)
                   for c in cards)
    assert cluster.bind(name, Assignment(node_name, shares)).ok


def codes(outcomes: Sequence[Outcome]) -> dict[str, Code]:
    return {o.request.name: o.decision.status.code for o in outcomes}


def node_of(cluster: SimCluster, name: str) -> str:
    info = cluster.get_pod(name)
    assert info is not None and info.assignment is not None, f"{name} is not bound"
    return info.assignment.node


def gang_bound(cluster: SimCluster, gang: str) -> set[str]:
    """Members of `gang` bound in the world."""
    return {name for name, b in cluster.state.bindings.items() if b.request.gang == gang}


def world_usage(cluster: SimCluster) -> dict[str, int]:
    """GPU milli per queue over the world's bindings."""
    usage: dict[str, int] = {}
    for binding in cluster.state.bindings.values():
        queue = binding.request.queue
        if queue is not None:
            usage[queue] = usage.get(queue, 0) + binding.assignment.gpu_milli
    return usage


def assert_cache_matches(scheduler: Scheduler, cluster: SimCluster) -> None:
    """The scheduler's cache holds exactly the world's bindings: nothing reserved on the side."""
    assert set(scheduler.state.bindings) == set(cluster.state.bindings)
    assert scheduler.state.fingerprint() == cluster.state.fingerprint()


# ---------------------------------------------------------------------------------------------- gangs: all or nothing
@pytest.mark.parametrize("size", [2, 3, 4])
def test_members_wait_for_the_whole_gang_then_start_together(size: int) -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"))  # 16 cards; the gang needs size × 2 ≤ 8
    for k in range(1, size):
        assert cluster.create_pod(member(f"g{k}", "g", size, 2)).ok
        outcomes = scheduler.run_pending()
        # every member present so far is reported waiting, with the count
        assert codes(outcomes) == {f"g{i}": Code.WAIT for i in range(1, k + 1)}
        assert all(f"{k} of {size} members" in o.decision.status.message for o in outcomes)
        assert all(o.decision.assignment is None for o in outcomes)
        assert gang_bound(cluster, "g") == set()
        assert_cache_matches(scheduler, cluster)  # nothing reserved for the waiting members either
    assert cluster.create_pod(member(f"g{size}", "g", size, 2)).ok
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {f"g{i}": Code.SUCCESS for i in range(1, size + 1)}  # the same run_pending
    assert gang_bound(cluster, "g") == {f"g{i}" for i in range(1, size + 1)}
    assert cluster.state.used_gpu_milli() == size * 2 * MILLI_PER_CARD
    assert scheduler.stats.gangs_placed == 1
    assert_cache_matches(scheduler, cluster)


def test_a_gang_that_does_not_fit_holds_nothing_and_starts_when_room_frees() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"))
    pin(cluster, "big", "n0", range(8))  # n0 full: the first member fits on n1, the second nowhere
    for i in range(2):
        cluster.create_pod(member(f"g{i}", "g", 2, 8))
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {"g0": Code.UNSCHEDULABLE, "g1": Code.UNSCHEDULABLE}
    assert all("does not fit whole" in o.decision.status.message for o in outcomes)
    assert gang_bound(cluster, "g") == set()
    assert not {"g0", "g1"} & set(scheduler.state.bindings)  # the trial placement on n1 was undone
    assert scheduler.state.idle_cards[scheduler.state.node_index["n1"]] == 8
    assert_cache_matches(scheduler, cluster)
    assert "g0" in scheduler.queue and "g1" in scheduler.queue  # parked, not dropped

    assert cluster.delete_pod("big").ok
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {"g0": Code.SUCCESS, "g1": Code.SUCCESS}
    assert {node_of(cluster, "g0"), node_of(cluster, "g1")} == {"n0", "n1"}
    assert_cache_matches(scheduler, cluster)


@pytest.mark.parametrize("schedule_each", [True, False], ids=["run-after-each", "run-at-end"])
def test_two_gangs_that_each_half_fit_do_not_deadlock(schedule_each: bool) -> None:
    # 2 nodes × 8 cards; gangs A and B each 2 × 8 cards: either fills the cluster, both never fit.
    cluster, scheduler = world(eight("n0"), eight("n1"))
    for name in ("A0", "B0", "A1", "B1"):
        assert cluster.create_pod(member(name, name[0], 2, 8)).ok
        if schedule_each:
            scheduler.run_pending()
    if not schedule_each:
        scheduler.run_pending()
    running = {gang for gang in "AB" if gang_bound(cluster, gang)}
    assert len(running) == 1
    (first,) = running
    other = "B" if first == "A" else "A"
    assert gang_bound(cluster, first) == {f"{first}0", f"{first}1"}
    assert gang_bound(cluster, other) == set()
    assert not any(scheduler.state.bindings[n].request.gang == other for n in scheduler.state.bindings)
    assert_cache_matches(scheduler, cluster)

    for name in sorted(gang_bound(cluster, first)):
        assert cluster.delete_pod(name).ok
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {f"{other}0": Code.SUCCESS, f"{other}1": Code.SUCCESS}
    assert gang_bound(cluster, other) == {f"{other}0", f"{other}1"}
    assert_cache_matches(scheduler, cluster)


def test_a_gang_with_a_cpu_only_launcher_and_gpu_workers_is_placed_whole() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"))
    workers = [member(f"worker-{i}", "mpi", 4, 4) for i in range(3)]  # 3 × 4 = 12 of 16 cards
    for request in workers:
        cluster.create_pod(request)
    outcomes = scheduler.run_pending()
    assert all("3 of 4 members" in o.decision.status.message for o in outcomes)
    assert cluster.state.bindings == {}
    cluster.create_pod(member("launcher", "mpi", 4, None))  # the member that completes the gang has no GPU
    outcomes = scheduler.run_pending()
    assert set(codes(outcomes).values()) == {Code.SUCCESS}
    assert gang_bound(cluster, "mpi") == {"launcher", "worker-0", "worker-1", "worker-2"}
    assert cluster.state.bindings["launcher"].assignment.cards == ()
    assert all(len(cluster.state.bindings[f"worker-{i}"].assignment.cards) == 4 for i in range(3))
    assert cluster.state.used_gpu_milli() == 12 * MILLI_PER_CARD
    assert_cache_matches(scheduler, cluster)


# ---------------------------------------------------------------------------------------------- gangs: timeout
def test_an_incomplete_gang_fails_after_its_timeout() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(gang_timeout_s=60))
    cluster.create_pod(member("t0", "t", 3, 1))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.WAIT
    cluster.loop.run(until=60.0)
    scheduler.run_pending()
    assert cluster.failed == {}  # 60 s waited: not more than the timeout yet
    cluster.loop.run(until=61.0)
    scheduler.run_pending()
    reason = cluster.failed["t0"]
    assert "timed out" in reason and "60 s" in reason and "1 of 3" in reason
    assert cluster.get_pod("t0") is None  # no longer pending in the world
    assert "t0" not in scheduler.queue
    assert scheduler.stats.gangs_failed == 1
    assert_cache_matches(scheduler, cluster)


def test_the_timeout_runs_from_the_first_member_and_fails_every_member() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(gang_timeout_s=60))
    cluster.create_pod(member("t0", "t", 3, 1))
    scheduler.run_pending()
    cluster.loop.run(until=30.0)
    cluster.create_pod(member("t1", "t", 3, 1))  # a later member does not restart the clock
    outcomes = scheduler.run_pending()
    assert all("2 of 3 members" in o.decision.status.message for o in outcomes)
    cluster.loop.run(until=61.0)  # 61 s after t0, 31 s after t1
    scheduler.run_pending()
    assert set(cluster.failed) == {"t0", "t1"}
    assert all("2 of 3" in reason for reason in cluster.failed.values())
    assert cluster.list_pods() == []


def test_a_gang_completed_before_its_timeout_runs_and_is_not_failed() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(gang_timeout_s=60))
    for i in range(2):
        cluster.create_pod(member(f"t{i}", "t", 3, 1))
    scheduler.run_pending()
    cluster.loop.run(until=59.0)
    cluster.create_pod(member("t2", "t", 3, 1))
    assert set(codes(scheduler.run_pending()).values()) == {Code.SUCCESS}
    cluster.loop.run(until=200.0)
    scheduler.run_pending()
    assert cluster.failed == {}
    assert gang_bound(cluster, "t") == {"t0", "t1", "t2"}


@pytest.mark.parametrize(
    ("size", "cards", "need", "capacity"),
    [
        (3, 8, 24, 16),  # 3 × 8 = 24 > 2 × 8 = 16
        (5, 4, 20, 16),  # 5 × 4 = 20 > 16: each member would fit a node on its own
        (17, 1, 17, 16),  # 17 × 1: one card more than the cluster
    ],
)
def test_a_gang_larger_than_the_cluster_fails_at_once_with_its_need(size: int, cards: int, need: int,
                                                                     capacity: int) -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"))
    names = [f"x{i}" for i in range(size)]
    for name in names[:-1]:
        cluster.create_pod(member(name, "x", size, cards))
    for outcome in scheduler.run_pending():  # incomplete: waiting, with a reason
        assert outcome.decision.status.code is Code.WAIT and outcome.decision.status.message
    cluster.create_pod(member(names[-1], "x", size, cards))
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == dict.fromkeys(names, Code.UNSCHEDULABLE_AND_UNRESOLVABLE)
    assert set(cluster.failed) == set(names)
    for reason in cluster.failed.values():
        assert f"needs {need} GPUs" in reason and f"{capacity}" in reason
    assert cluster.list_pods() == []  # nothing left pending
    assert cluster.state.bindings == {}
    assert len(scheduler.queue) == 0


# ---------------------------------------------------------------------------------------------- gangs: network blocks
@pytest.mark.parametrize("labelled", [True, False])
def test_a_gang_that_fits_one_network_block_is_placed_inside_it(labelled: bool) -> None:
    blocks = {"n0": "b1", "n1": "b1", "n2": "b2", "n3": "b2"}
    cluster, scheduler = world(*(eight(n, blocks[n] if labelled else None) for n in blocks))
    # idle cards: n0 8, n1 4, n2 7, n3 4 → b1 12, b2 11 (b1 tried first)
    pin(cluster, "f1", "n1", range(4))
    pin(cluster, "f2", "n2", range(1))
    pin(cluster, "f3", "n3", range(4))
    for i in range(2):
        cluster.create_pod(member(f"g{i}", "g", 2, 4))
    assert set(codes(scheduler.run_pending()).values()) == {Code.SUCCESS}
    used = {blocks[node_of(cluster, f"g{i}")] for i in range(2)}
    if labelled:
        assert used == {"b1"}  # n1 and n0
    else:
        assert used == {"b1", "b2"}  # control: binpack alone takes the fullest nodes, n1 and n3
    assert_cache_matches(scheduler, cluster)


def test_a_gang_skips_a_block_with_more_idle_cards_that_cannot_hold_it() -> None:
    blocks = {"n0": "b1", "n1": "b1", "n2": "b2", "n3": "b2"}
    cluster, scheduler = world(*(eight(n, b) for n, b in blocks.items()))
    # idle cards: n0 6, n1 6 (b1: 12, but no node with 8), n2 8, n3 2 (b2: 10)
    pin(cluster, "f0", "n0", range(2))
    pin(cluster, "f1", "n1", range(2))
    pin(cluster, "f3", "n3", range(6))
    cluster.create_pod(member("big", "g", 2, 8))
    cluster.create_pod(member("small", "g", 2, 1))
    assert set(codes(scheduler.run_pending()).values()) == {Code.SUCCESS}
    assert node_of(cluster, "big") == "n2"
    assert blocks[node_of(cluster, "small")] == "b2"


def test_a_gang_no_block_can_hold_spans_blocks_and_is_placed_whole() -> None:
    blocks = {"n0": "b1", "n1": "b1", "n2": "b2", "n3": "b2"}
    cluster, scheduler = world(*(eight(n, b) for n, b in blocks.items()))
    for i in range(3):  # 3 × 8 cards; each block has 2 nodes of 8
        cluster.create_pod(member(f"g{i}", "g", 3, 8))
    assert set(codes(scheduler.run_pending()).values()) == {Code.SUCCESS}
    assert {blocks[node_of(cluster, f"g{i}")] for i in range(3)} == {"b1", "b2"}
    assert len({node_of(cluster, f"g{i}") for i in range(3)}) == 3


# ---------------------------------------------------------------------------------------------- gangs: preemption
@pytest.mark.parametrize("victims", ["lower-priority", "batch-low"])
def test_a_high_priority_gang_preempts_to_fit_whole(victims: str) -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"), rules=SchedulingRules(default_victim_grace_s=0))
    cluster.admission.append(Admission(default_priority_classes()))
    for i in range(4):  # 4 × 4 cards fill both nodes
        low = pod(f"low{i}").cpu(100).whole(4).obj()
        # batch-low resolves to priority 100 with a 0 s victim grace (and backfills: the shadow-cache path)
        assert cluster.create_pod(replace(low, priority_class="batch-low") if victims == "batch-low" else low).ok
    assert set(codes(scheduler.run_pending()).values()) == {Code.SUCCESS}
    for i in range(2):
        cluster.create_pod(member(f"h{i}", "h", 2, 8, priority_class="online"))  # priority 1000
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {"h0": Code.SUCCESS, "h1": Code.SUCCESS}
    assert set(cluster.state.bindings) == {"h0", "h1"}  # every low pod was evicted, the gang runs whole
    assert {node_of(cluster, "h0"), node_of(cluster, "h1")} == {"n0", "n1"}
    assert_cache_matches(scheduler, cluster)


def test_a_preempting_gang_is_bound_whole_when_its_last_victim_is_gone() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"))  # victims without a class: 30 s grace
    for i in range(4):
        cluster.create_pod(pod(f"low{i}").cpu(100).whole(4).obj())
    scheduler.run_pending()
    for i in range(2):
        cluster.create_pod(member(f"h{i}", "h", 2, 8, priority=1000))
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {"h0": Code.WAIT, "h1": Code.WAIT}
    assert all("nominated" in o.decision.status.message for o in outcomes)
    assert gang_bound(cluster, "h") == set()
    assert {"h0", "h1"} <= set(scheduler.state.bindings)  # reserved in the cache meanwhile
    assert all(p.phase is PodPhase.TERMINATING for p in cluster.list_pods() if p.name.startswith("low"))
    cluster.loop.run(until=29.0)
    scheduler.run_pending()
    assert gang_bound(cluster, "h") == set()
    cluster.loop.run(until=30.0)
    scheduler.run_pending()
    assert set(cluster.state.bindings) == {"h0", "h1"}
    assert_cache_matches(scheduler, cluster)


def test_a_gang_that_cannot_fit_even_by_preemption_evicts_nobody() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"), rules=SchedulingRules(default_victim_grace_s=0))
    cluster.create_pod(pod("low").cpu(100).whole(8).obj())
    cluster.create_pod(pod("vip").cpu(100).whole(4).priority(5000).obj())
    scheduler.run_pending()
    assert node_of(cluster, "low") != node_of(cluster, "vip")
    for i in range(2):  # 2 × 8 at priority 1000: `low`'s node would do for one, `vip` blocks the other
        cluster.create_pod(member(f"h{i}", "h", 2, 8, priority=1000))
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {"h0": Code.UNSCHEDULABLE, "h1": Code.UNSCHEDULABLE}
    assert set(cluster.state.bindings) == {"low", "vip"}  # `low` was not evicted for half a gang
    assert all(p.phase is PodPhase.RUNNING for p in cluster.list_pods() if p.name in ("low", "vip"))
    assert_cache_matches(scheduler, cluster)


def test_preempting_a_gang_member_does_not_leave_its_gang_partly_running() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"), rules=SchedulingRules(default_victim_grace_s=0))
    for i in range(2):
        cluster.create_pod(member(f"L{i}", "L", 2, 8))
    scheduler.run_pending()
    cluster.create_pod(pod("hi").cpu(100).whole(8).priority(1000).obj())
    scheduler.run_pending()
    cluster.loop.run(until=60.0)
    scheduler.run_pending()
    assert node_of(cluster, "hi") in ("n0", "n1")
    assert len(gang_bound(cluster, "L")) in (0, 2)  # actually 1: L0 keeps 8 cards for a gang that cannot run


# ---------------------------------------------------------------------------------------------- gangs: invariant
gang_shapes = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 8)), min_size=2, max_size=6)
gang_actions = st.lists(st.tuples(st.sampled_from(["submit"] * 3 + ["complete"] * 3 + ["delete", "delete", "drop",
                                                                                      "tick"]),
                                  st.integers(0, 5)), min_size=10, max_size=50)


@SETTINGS
@given(shapes=gang_shapes, actions=gang_actions)
def test_gangs_are_always_bound_whole_or_not_at_all(shapes: list[tuple[int, int]],
                                                    actions: list[tuple[str, int]]) -> None:
    """'submit' adds a gang's next member, 'complete' all its remaining ones; 'delete' removes a whole gang,
    'drop' one pending member, 'tick' passes 31 s (gangs time out after 60 s). After every run_pending each
    gang has 0 or all members bound, and the cache holds no reservation the world does not."""
    cluster, scheduler = world(eight("n0"), eight("n1"), node("n2").gpus(4).obj(),  # 20 cards
                               rules=SchedulingRules(gang_timeout_s=60))
    submitted = [0] * len(shapes)
    for op, index in actions:
        g = index % len(shapes)
        size, cards = shapes[g]
        names = [f"g{g}-{i}" for i in range(size)]
        if op in ("submit", "complete"):
            last = size if op == "complete" else min(size, submitted[g] + 1)
            for name in names[submitted[g]:last]:
                cluster.create_pod(member(name, f"g{g}", size, cards))
            submitted[g] = max(submitted[g], last)
        elif op == "delete":
            for name in names:
                cluster.delete_pod(name)
        elif op == "drop":
            pending = [p.name for p in cluster.list_pods() if p.request.gang == f"g{g}" and p.phase is PodPhase.PENDING]
            if pending:
                cluster.delete_pod(pending[0])
        elif op == "tick":
            cluster.loop.run(until=cluster.loop.now() + 31.0)
        for outcome in scheduler.run_pending():
            assert outcome.decision.status.code is not Code.ERROR
            if not outcome.decision.status.ok:
                assert outcome.decision.status.message  # never waiting without a reason
        for gang, (size, _) in enumerate(shapes):
            assert len(gang_bound(cluster, f"g{gang}")) in (0, size)
        assert cluster.state.check_invariants() == []
        assert scheduler.state.check_invariants() == []
        assert_cache_matches(scheduler, cluster)


# ---------------------------------------------------------------------------------------------- quotas: maximum
@pytest.mark.parametrize(
    ("cards", "submitted", "running"),
    [
        (1, 5, 4),  # 4 × 1 = 4 = max; the 5th would make 5
        (2, 3, 2),  # 2 × 2 = 4; a 3rd would make 6
        (3, 2, 1),  # 3; a 2nd would make 6
        (4, 2, 1),  # 4; a 2nd would make 8
    ],
)
def test_a_queue_never_exceeds_its_maximum(cards: int, submitted: int, running: int) -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS))  # 8 cards: room is not the limit
    for i in range(submitted):
        cluster.create_pod(queued(f"a{i}", "a", cards))
    outcomes = scheduler.run_pending()
    ran = [o for o in outcomes if o.decision.status.ok]
    held = [o for o in outcomes if not o.decision.status.ok]
    assert len(ran) == running
    assert scheduler.quota_usage()["a"] == world_usage(cluster)["a"] == running * cards * MILLI_PER_CARD
    for outcome in held:
        assert outcome.decision.status.code is Code.WAIT
        assert "queue a at its maximum" in outcome.decision.status.message
        assert f"{running * cards:g} of 4 GPUs" in outcome.decision.status.message
    assert scheduler.run_pending() == []  # not polled while the queue is full
    cluster.create_pod(queued("b0", "b", 1))
    scheduler.run_pending()
    cluster.delete_pod("b0")  # another queue's release does not help a
    assert scheduler.run_pending() == []

    first_held = held[0].request.name
    cluster.delete_pod(ran[0].request.name)  # a pod of the same queue leaves: the next one starts
    outcomes = scheduler.run_pending()
    assert codes(outcomes)[first_held] is Code.SUCCESS
    assert world_usage(cluster)["a"] <= 4 * MILLI_PER_CARD
    assert_cache_matches(scheduler, cluster)


def test_a_queue_borrows_idle_capacity_beyond_its_minimum_up_to_its_maximum() -> None:
    cluster, scheduler = world(eight("n0"), node("n1").gpus(4).obj(), rules=SchedulingRules(quotas=QUOTAS))
    for i in range(9):  # b: min 2, max 8; the cluster has 12 cards
        cluster.create_pod(queued(f"b{i}", "b", 1))
    outcomes = scheduler.run_pending()
    assert sum(o.decision.status.ok for o in outcomes) == 8  # 6 borrowed beyond its minimum of 2
    (held,) = [o for o in outcomes if not o.decision.status.ok]
    assert held.decision.status.code is Code.WAIT
    assert "queue b at its maximum: 8 of 8 GPUs" in held.decision.status.message
    assert cluster.state.idle_cards[: cluster.state.size].sum() == 4  # idle, but beyond b's maximum
    assert scheduler.quota_usage() == world_usage(cluster) == {"b": 8 * MILLI_PER_CARD}


# ---------------------------------------------------------------------------------------------- quotas: reclaim
def borrowed_node(grace: float) -> tuple[SimCluster, Scheduler]:
    """One 8-card node that queue b fills alone: 8 of its maximum 8, borrowing 6 beyond its minimum."""
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS, default_victim_grace_s=grace))
    for i in range(8):
        cluster.create_pod(queued(f"b{i}", "b", 1))
    scheduler.run_pending()
    assert world_usage(cluster) == {"b": 8000}
    return cluster, scheduler


def test_a_queue_below_its_minimum_reclaims_what_another_queue_borrows() -> None:
    cluster, scheduler = borrowed_node(grace=0.0)
    for i in range(3):  # equal priority: only a's guaranteed 2 may be reclaimed
        cluster.create_pod(queued(f"a{i}", "a", 1))
    outcomes = codes(scheduler.run_pending())
    assert outcomes == {"a0": Code.SUCCESS, "a1": Code.SUCCESS, "a2": Code.UNSCHEDULABLE}  # a2: a at its min
    assert world_usage(cluster) == scheduler.quota_usage() == {"a": 2000, "b": 6000}
    assert len(cluster.list_pods()) == 9  # 2 of b's pods were evicted, a2 is pending
    assert_cache_matches(scheduler, cluster)


def test_a_reclaiming_pod_is_nominated_and_bound_when_its_victim_is_gone() -> None:
    cluster, scheduler = borrowed_node(grace=30.0)
    cluster.create_pod(queued("a0", "a", 1))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.WAIT and "nominated" in outcome.decision.status.message
    assert "a0" not in cluster.state.bindings
    assert scheduler.quota_usage() == {"a": 1000, "b": 7000}  # the reservation counts for its queue at once
    cluster.loop.run(until=30.0)
    scheduler.run_pending()
    assert "a0" in cluster.state.bindings
    assert world_usage(cluster) == {"a": 1000, "b": 7000}
    assert_cache_matches(scheduler, cluster)


def test_a_queue_reclaims_its_whole_minimum_when_victims_take_a_grace_period() -> None:
    cluster, scheduler = borrowed_node(grace=30.0)
    for i in range(2):
        cluster.create_pod(queued(f"a{i}", "a", 1))
    for t in (0.0, 30.0, 60.0, 90.0, 120.0, 600.0):  # one reclaim at a time would take 60 s
        cluster.loop.run(until=t)
        scheduler.run_pending()
    assert world_usage(cluster) == {"a": 2000, "b": 6000}  # actually a 1000, b 7000: a1 parked for ever


def test_reclaim_never_evicts_a_pod_that_would_take_its_queue_below_its_minimum() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS, default_victim_grace_s=0))
    cluster.create_pod(queued("b-all", "b", 8))  # b borrows 6 beyond its minimum, in one pod
    scheduler.run_pending()
    cluster.create_pod(queued("a0", "a", 2))  # owed 2, but evicting b-all would leave b 0 of its 2
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.UNSCHEDULABLE
    assert "queue b would drop below its guaranteed minimum" in outcome.decision.status.message
    assert set(cluster.state.bindings) == {"b-all"}
    assert_cache_matches(scheduler, cluster)


def test_reclaim_stops_at_the_other_queues_minimum_when_minimums_overlap() -> None:
    quotas = Quotas([QueueQuota("a", min_gpus=3, max_gpus=4), QueueQuota("b", min_gpus=3, max_gpus=4)])
    cluster, scheduler = world(node("n0").gpus(4).obj(), rules=SchedulingRules(quotas=quotas,
                                                                               default_victim_grace_s=0))
    for i in range(4):  # b: 4 of 4 cards, 1 borrowed beyond its minimum of 3
        cluster.create_pod(queued(f"b{i}", "b", 1))
    scheduler.run_pending()
    cluster.create_pod(queued("a-three", "a", 3))  # owed 3, but only 1 may be reclaimed
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.UNSCHEDULABLE
    assert world_usage(cluster) == {"b": 4000}
    cluster.create_pod(queued("a-one", "a", 1))  # 1 is what b borrows: it may go
    assert codes(scheduler.run_pending())["a-one"] is Code.SUCCESS
    assert world_usage(cluster) == {"a": 1000, "b": 3000}
    cluster.create_pod(queued("a-two", "a", 1))  # a still owed 2, but b is at its minimum now
    assert codes(scheduler.run_pending())["a-two"] is Code.UNSCHEDULABLE
    assert world_usage(cluster) == {"a": 1000, "b": 3000}


def test_a_parked_pod_reclaims_once_its_queue_drops_below_its_minimum() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS, default_victim_grace_s=0))
    for name in ("a0", "a1", "b0", "b1", "b2", "b3", "b4", "b5"):  # a at its minimum 2, b borrows 4
        cluster.create_pod(queued(name, name[0], 1))
    scheduler.run_pending()
    cluster.create_pod(queued("b6", "b", 1))  # both parked: the node is full and a is not owed anything
    cluster.create_pod(queued("a2", "a", 1))
    assert codes(scheduler.run_pending()) == {"b6": Code.UNSCHEDULABLE, "a2": Code.UNSCHEDULABLE}
    cluster.delete_pod("a0")  # a drops to 1 of its guaranteed 2; the freed card goes to b6 (queued first)
    scheduler.run_pending()
    for t in (60.0, 120.0, 600.0):  # past the periodic retry of parked preemptors
        cluster.loop.run(until=t)
        scheduler.run_pending()
    assert world_usage(cluster).get("a", 0) == 2000  # actually 1000: a2 stays parked while b borrows 5
    assert "a2" in cluster.state.bindings


def test_capacity_a_reclaim_frees_beyond_its_need_goes_to_a_waiting_pod() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS, default_victim_grace_s=0))
    cluster.create_pod(queued("b-two", "b", 2))
    for i in range(5):
        cluster.create_pod(queued(f"b{i}", "b", 1))
    cluster.create_pod(queued("a0", "a", 1))
    scheduler.run_pending()  # full: b 7 (borrowing 5), a 1
    cluster.create_pod(queued("b-late", "b", 1))
    assert codes(scheduler.run_pending()) == {"b-late": Code.UNSCHEDULABLE}
    cluster.create_pod(queued("a1", "a", 1))  # a owed 1: the reprieve keeps the 1-card pods, evicts b-two
    assert codes(scheduler.run_pending()) == {"a1": Code.SUCCESS, "b-late": Code.SUCCESS}  # b-two's 2nd card
    assert "b-two" not in cluster.state.bindings
    assert world_usage(cluster) == {"a": 2000, "b": 6000}
    assert_cache_matches(scheduler, cluster)


# ---------------------------------------------------------------------------------------------- quotas and gangs
def test_a_gang_waits_for_room_in_its_queue_then_starts_whole() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS))
    cluster.create_pod(queued("a-solo", "a", 2))
    scheduler.run_pending()
    for i in range(2):  # 2 + 2 × 2 = 6 > a's maximum of 4
        cluster.create_pod(member(f"q{i}", "q", 2, 2, queue="a"))
    outcomes = scheduler.run_pending()
    assert codes(outcomes) == {"q0": Code.WAIT, "q1": Code.WAIT}
    assert all("queue a at its maximum: 2 of 4 GPUs in use, 4 more asked" in o.decision.status.message
               for o in outcomes)
    assert gang_bound(cluster, "q") == set()
    cluster.delete_pod("a-solo")
    assert codes(scheduler.run_pending()) == {"q0": Code.SUCCESS, "q1": Code.SUCCESS}
    assert world_usage(cluster) == scheduler.quota_usage() == {"a": 4000}


def test_a_gang_larger_than_its_queues_maximum_fails_with_the_maximum() -> None:
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS, gang_timeout_s=60))
    for i in range(3):  # 3 × 2 = 6 > a's maximum of 4; each member alone is within it
        cluster.create_pod(member(f"q{i}", "q", 3, 2, queue="a"))
    scheduler.run_pending()
    cluster.loop.run(until=3600.0)
    scheduler.run_pending()
    assert set(cluster.failed) == {"q0", "q1", "q2"}  # actually none: pending for ever
    assert all("maximum" in reason for reason in cluster.failed.values())


# ---------------------------------------------------------------------------------------------- quotas: invariant
quota_actions = st.lists(
    st.tuples(st.sampled_from(["a", "a", "a", "b", "b", "b", "delete", "delete", "tick"]),
              st.integers(1, 4), st.sampled_from([0, 10]), st.integers(0, 50)),
    min_size=10, max_size=50,
)


@SETTINGS
@given(prefill=st.lists(st.tuples(st.integers(1, 4), st.sampled_from([0, 10])), max_size=6), actions=quota_actions)
def test_queues_stay_within_their_maximum_and_reclaim_their_minimum(
        prefill: list[tuple[int, int]], actions: list[tuple[str, int, int, int]]) -> None:
    """One 8-card node, queues a (2..4) and b (2..8), victims go at once. First b submits `prefill` (often
    borrowing most of the node), then actions: submit a pod of 1–4 cards to a or b (priority 0 or 10),
    delete a pod (running or pending), let 61 s pass. After every run_pending:

    - usage per queue (the cache's quota_usage and the world's bindings, which agree) never exceeds the maximum;
    - a pod submitted while its queue is owed it (usage + its c cards ≤ the minimum 2) is bound, by reclaiming
      if it fits nowhere (a higher pod may then preempt it: the cards its victims freed beyond its need wake
      the parked ones; hypothesis found a 0-priority pod of a, bound, then reclaimed by a priority-10 pod of b
      once a borrowed): then fewer than c cards are idle and its queue holds ≤ 2 − c, so the other queue
      holds ≥ 8 − (c − 1) − (2 − c) = 7, borrowing ≥ 5; the reprieve leaves fewer than c + (largest victim)
      cards free, so the victims total ≤ c − 1 + 4 ≤ 5 and the other queue keeps its minimum;
    - no submission takes the other queue from at or above its minimum to below it.
    """
    cluster, scheduler = world(eight("n0"), rules=SchedulingRules(quotas=QUOTAS, default_victim_grace_s=0))
    quotas = {q.name: q for q in QUOTAS}
    bound_in_step: set[str] = set()
    cluster.watch(lambda e: bound_in_step.add(e.pod.name) if e.kind is EventKind.POD_BOUND and e.pod else None)
    for i, (cards, priority) in enumerate(prefill):
        cluster.create_pod(queued(f"fill{i}", "b", cards, priority=priority))
    scheduler.run_pending()
    for step, (op, cards, priority, index) in enumerate(actions):
        before = world_usage(cluster)
        bound_in_step.clear()
        new: str | None = None
        queue = op
        if op in quotas:
            new = f"{queue}{step}"
            cluster.create_pod(queued(new, queue, cards, priority=priority))
        elif op == "delete":
            names = sorted(p.name for p in cluster.list_pods())
            if names:
                cluster.delete_pod(names[index % len(names)])
        else:
            cluster.loop.run(until=cluster.loop.now() + 61.0)
        for outcome in scheduler.run_pending():
            assert outcome.decision.status.code is not Code.ERROR
        usage = world_usage(cluster)
        assert {q: m for q, m in scheduler.quota_usage().items() if m} == {q: m for q, m in usage.items() if m}
        for name, quota in quotas.items():
            assert usage.get(name, 0) <= (quota.max_milli or 0)
        if new is not None:
            owed = before.get(queue, 0) + cards * MILLI_PER_CARD <= quotas[queue].min_milli
            if owed:  # bound, though a higher pod woken by what it freed may preempt it in the same pass
                assert new in bound_in_step, f"{new} was owed its queue's minimum"
            other = "b" if queue == "a" else "a"
            if before.get(other, 0) >= quotas[other].min_milli:
                assert usage.get(other, 0) >= quotas[other].min_milli
        assert cluster.state.check_invariants() == []
        assert_cache_matches(scheduler, cluster)


# ---------------------------------------------------------------------------------------------- bad input: admission
def admitting(quotas: Quotas | None = None, *, require_class: bool = False) -> SimCluster:
    cluster = SimCluster(CATALOG, [eight("n0")])
    cluster.admission.append(Admission(default_priority_classes(), quotas, require_class=require_class))
    return cluster


def test_an_unknown_priority_class_is_rejected_naming_the_known_ones() -> None:
    cluster = admitting()
    status = cluster.create_pod(replace(pod("p").whole(1).obj(), priority_class="vip"))
    assert not status.ok and status.code is Code.ERROR
    assert "'vip'" in status.message and "priority_class" in status.message
    for known in ("online", "training", "dev", "batch-low"):
        assert known in status.message
    assert cluster.get_pod("p") is None


def test_a_known_priority_class_is_resolved_into_the_pods_priority() -> None:
    cluster = admitting()
    assert cluster.create_pod(replace(pod("p").whole(1).obj(), priority_class="training")).ok
    info = cluster.get_pod("p")
    assert info is not None and info.request.priority == 500 and info.request.preempts


def test_a_pod_without_a_class_is_rejected_when_classes_are_required() -> None:
    status = admitting(require_class=True).create_pod(pod("p").whole(1).obj())
    assert not status.ok and "priority_class" in status.message


@pytest.mark.parametrize(
    ("quotas", "queue", "cards", "fragments"),
    [
        (QUOTAS, "zzz", 1, ("unknown queue 'zzz'", "known: a, b")),
        (None, "zzz", 1, ("unknown queue 'zzz'", "none configured")),
        (QUOTAS, "a", 5, ("needs 5 GPUs", "queue a's maximum of 4")),  # 5 > a's maximum 4
    ],
)
def test_a_pod_for_an_unknown_queue_or_above_its_maximum_is_rejected(quotas: Quotas | None, queue: str,
                                                                      cards: int, fragments: tuple[str, ...]) -> None:
    cluster = admitting(quotas)
    status = cluster.create_pod(queued("p", queue, cards))
    assert not status.ok
    for fragment in fragments:
        assert fragment in status.message
    assert cluster.list_pods() == []


def test_a_pod_at_its_queues_maximum_is_admitted() -> None:
    assert admitting(QUOTAS).create_pod(queued("p", "a", 4)).ok


def test_a_gang_member_beyond_the_clusters_capacity_is_rejected_at_submission() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"), rules=SchedulingRules(gang_timeout_s=60))
    cluster.admission.append(Admission(default_priority_classes(), cluster_gpu_milli=cluster.state.total_gpu_milli))
    assert cluster.create_pod(member("x0", "x", 3, 8)).ok  # 8 ≤ 16
    assert cluster.create_pod(member("x1", "x", 3, 8)).ok  # 16 ≤ 16
    status = cluster.create_pod(member("x2", "x", 3, 8))  # 24 > 16
    assert not status.ok
    assert "gang x would need at least 24 GPUs" in status.message and "cluster's 16" in status.message
    outcomes = scheduler.run_pending()  # the two admitted members wait, with a reason, until the timeout
    assert all(o.decision.status.code is Code.WAIT and "2 of 3" in o.decision.status.message for o in outcomes)
    cluster.loop.run(until=61.0)
    scheduler.run_pending()
    assert set(cluster.failed) == {"x0", "x1"}
    assert cluster.list_pods() == []


def test_a_gang_name_can_be_used_again_once_its_pods_are_gone() -> None:
    cluster, scheduler = world(eight("n0"), eight("n1"))
    admission = Admission(default_priority_classes(), cluster_gpu_milli=cluster.state.total_gpu_milli)
    cluster.admission.append(admission)
    admission.attach(cluster)  # members that leave stop counting towards their gang
    for i in range(2):  # 2 × 8 = 16: the whole cluster
        assert cluster.create_pod(member(f"run1-{i}", "train", 2, 8)).ok
    assert set(codes(scheduler.run_pending()).values()) == {Code.SUCCESS}
    for i in range(2):
        assert cluster.delete_pod(f"run1-{i}").ok
    status = cluster.create_pod(member("run2-0", "train", 2, 8))
    assert status.ok, status.message


# ---------------------------------------------------------------------------------------------- bad input: quotas
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"min_gpus": -1}, "min_gpus must not be below zero"),
        ({"max_gpus": -1}, "max_gpus must not be below zero"),
        ({"min_gpus": 3, "max_gpus": 2}, "min_gpus 3 is above max_gpus 2"),
    ],
)
def test_a_queue_quota_out_of_range_raises_naming_the_field(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(QuotaError, match=fragment):
        QueueQuota("x", **kwargs)


def test_a_queue_quota_without_a_name_or_defined_twice_raises() -> None:
    with pytest.raises(QuotaError, match="name must not be empty"):
        QueueQuota("")
    with pytest.raises(QuotaError, match="'a' is defined twice"):
        Quotas([QueueQuota("a"), QueueQuota("a", 1)])


def test_load_quotas_reads_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text("queues:\n  - {name: a, min_gpus: 2, max_gpus: 4}\n  - {name: b, min_gpus: 0.5}\n")
    quotas = load_quotas(path)
    a, b = quotas.get("a"), quotas.get("b")
    assert a is not None and (a.min_milli, a.max_milli) == (2000, 4000)
    assert b is not None and (b.min_milli, b.max_milli) == (500, None)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("queues:\n  - {name: a, min_gpus: -1}\n", "queues.0.min_gpus"),
        ("queues:\n  - {name: a, max_gpus: -2}\n", "queues.0.max_gpus"),
        ("queues:\n  - {name: a, min_gpus: 3, max_gpus: 2}\n", "min_gpus 3.0 is above max_gpus 2.0"),
        ("queues:\n  - {min_gpus: 1}\n", "queues.0.name"),
        ("queues:\n  - {name: a, mx_gpus: 2}\n", "queues.0.mx_gpus"),
        ("queues:\n  - {name: a}\n  - {name: a}\n", "'a' is defined twice"),
        ("queues: [\n", "quotas.yaml"),  # not YAML at all
    ],
)
def test_load_quotas_errors_name_the_file_and_field(tmp_path: Path, text: str, fragment: str) -> None:
    assert_names_file_and_field(tmp_path / "quotas.yaml", text, fragment, load_quotas, QuotaError)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("priority_classes:\n  - {name: a, value: 1}\n  - {name: a, value: 2}\n", "'a' is defined twice"),
        ("priority_classes:\n  - {name: a}\n", "priority_classes.0.value"),
        ("priority_classes:\n  - {name: a, value: 1, victim_grace_s: -1}\n", "priority_classes.0.victim_grace_s"),
        ("priority_classes:\n  - {name: a, value: 2000000000}\n", "priority_classes.0.value"),
    ],
)
def test_load_priority_classes_errors_name_the_file_and_field(tmp_path: Path, text: str, fragment: str) -> None:
    assert_names_file_and_field(tmp_path / "classes.yaml", text, fragment, load_priority_classes, GpuplaneError)


def assert_names_file_and_field(path: Path, text: str, fragment: str, load: Callable[[Path], object],
                                error: type[Exception]) -> None:
    """Loading `text` from `path` raises `error` whose message starts with the path and holds `fragment`."""
    path.write_text(text)
    with pytest.raises(error) as raised:
        load(path)
    assert str(raised.value).startswith(f"{path}:")
    assert fragment in str(raised.value)


# ---------------------------------------------------------------------------------------------- bad input: gang fields
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"gang": "g"}, "gang_size of at least 1, got 0"),
        ({"gang": "g", "gang_size": -1}, "gang_size of at least 1, got -1"),
        ({"gang_size": 2}, "names no gang"),
    ],
)
def test_gang_fields_are_checked_at_construction(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(RequestError) as raised:
        PodRequest("p", **kwargs)  # type: ignore[arg-type]
    assert raised.value.field == "gang_size"
    assert fragment in str(raised.value)
