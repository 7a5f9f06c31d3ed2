"""Queueing hints (`SchedulingRules.queueing_hints`): which cluster events wake a parked pod or gang, the gang's
room bound that skips trial placements that cannot succeed, and the property that the hints change no decision
(the pods bound with hints on are the pods bound with hints off)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import CATALOG, node, pod
from gpuplane.model import Fraction, NodeSpec, PodRequest
from gpuplane.model.priority import PriorityClass, PriorityClasses
from gpuplane.model.quota import QueueQuota, Quotas
from gpuplane.port import PodPhase
from gpuplane.scheduler import PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())
CLASSES = PriorityClasses([PriorityClass("fill", 100, victim_grace_s=0.0, backfill=True),
                           PriorityClass("train", 500, victim_grace_s=0.0),
                           PriorityClass("top", 1000, victim_grace_s=0.0)])
LEVEL = {"fill": 100, "train": 500, "top": 1000}


def request(name: str, cards: int, level: str, pools: str = "train", gang: str | None = None,
            size: int = 0) -> PodRequest:
    return replace(pod(name).whole(cards).pools(pools).obj(), priority_class=level, priority=LEVEL[level],
                   gang=gang, gang_size=size)


def world(nodes: list[NodeSpec], *, hints: bool = True) -> tuple[SimCluster, Scheduler]:
    cluster = SimCluster(CATALOG, nodes)
    rules = SchedulingRules(classes=CLASSES, queueing_hints=hints)
    return cluster, Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=rules)


def parked(scheduler: Scheduler) -> set[str]:
    return {e.request.name for e in scheduler.queue.parked}


def active(scheduler: Scheduler) -> set[str]:
    return {e.request.name for e in scheduler.queue.entries()} - parked(scheduler)


def bound(cluster: SimCluster) -> set[str]:
    return {p.name for p in cluster.list_pods() if p.phase is PodPhase.RUNNING}


# ---------------------------------------------------------------------------------------------- the hint table
def parked_gang(hints: bool) -> tuple[SimCluster, Scheduler]:
    """Pool train: t0 (4 cards: top0 holds 2, fill pods f0 and f1 one each), t1 (top1 holds all 4), t2 (4 idle
    cards, cordoned); pool infer: i0 (inf holds all 4). The gang g (2 members × 2 cards, pool train) gets t0's 2
    backfill cards for one member and nothing for the other (t1's 4 cards are top1's, a higher pod; t2 is
    cordoned): it is parked, both members."""
    nodes = [node(name).gpus(4).pool(p).label("slot", name).obj()
             for name, p in (("t0", "train"), ("t1", "train"), ("i0", "infer"))]
    cluster, scheduler = world([*nodes, node("t2").gpus(4).pool("train").unschedulable().obj()], hints=hints)
    for name, cards, level, pools, where in (("top0", 2, "top", "train", "t0"), ("f0", 1, "fill", "train", "t0"),
                                             ("f1", 1, "fill", "train", "t0"), ("top1", 4, "top", "train", "t1"),
                                             ("inf", 4, "top", "infer", "i0")):
        assert cluster.create_pod(replace(request(name, cards, level, pools), node_selector=(("slot", where),))).ok
        scheduler.run_pending()
        assert cluster.get_pod(name).assignment.node == where  # type: ignore[union-attr]
    for i in range(2):
        assert cluster.create_pod(request(f"g{i}", 2, "train", gang="team/g", size=2)).ok
    scheduler.run_pending()
    assert parked(scheduler) == {"g0", "g1"}
    return cluster, scheduler


def _relabel(cluster: SimCluster) -> None:
    cluster.patch_node("t1", labels={"rack": "r2"})


def _uncordon(cluster: SimCluster) -> None:
    cluster.patch_node("t2", unschedulable=False)


def _bind_another(cluster: SimCluster) -> None:
    assert cluster.create_pod(request("late", 1, "fill", "infer")).ok  # pending: the scheduler binds it next


EVENTS: dict[str, Callable[[SimCluster], object]] = {
    # A backfill pod leaves t0: the shadow (the cache without backfill) is unchanged there, so the gang's members
    # see t0 as before (2 free cards beside top0); in the cache t0 has 1 idle card, fewer than a member's 2.
    "a backfill pod leaves a node of its pool": lambda c: c.delete_pod("f0"),
    # inf leaves i0: 4 idle cards ≥ 2, but i0 is in pool infer, which the gang's pool filter refuses for good.
    "a pod leaves a node of another pool": lambda c: c.delete_pod("inf"),
    # top1 leaves t1: 4 idle cards ≥ 2 on a node of its pool, where a pod above the backfill held them.
    "a higher pod leaves a node of its pool": lambda c: c.delete_pod("top1"),
    # top0 leaves t0: the shadow's t0 now has 4 free cards (the backfill aside) ≥ 2.
    "a higher pod leaves the node it shares with backfill": lambda c: c.delete_pod("top0"),
    # A node changed: only that node changed, so it wakes the pods it now admits and has room for. t1 relabelled:
    # still 0 idle cards < 2 (without the hints, every parked pod is tried again).
    "a full node of its pool is updated": _relabel,
    # t2 uncordoned: its 4 idle cards ≥ 2, and the cordon no longer refuses the gang.
    "a cordoned node of its pool is uncordoned": _uncordon,
    # A pod is added (and bound): capacity only shrinks.
    "another pod is added": _bind_another,
}


@pytest.mark.parametrize(
    ("event", "wakes_with_hints", "wakes_without"),
    [
        ("a backfill pod leaves a node of its pool", False, True),   # without: the shadow's 2 cards ≥ 2, woken
        ("a pod leaves a node of another pool", False, True),        # without: 4 idle cards ≥ 2, pool ignored
        ("a higher pod leaves a node of its pool", True, True),
        ("a higher pod leaves the node it shares with backfill", True, True),
        ("a full node of its pool is updated", False, True),
        ("a cordoned node of its pool is uncordoned", True, True),
        ("another pod is added", False, False),
    ],
)
def test_an_event_wakes_a_parked_gang_only_if_it_could_help(event: str, wakes_with_hints: bool,
                                                             wakes_without: bool) -> None:
    for hints, wakes in ((True, wakes_with_hints), (False, wakes_without)):
        cluster, scheduler = parked_gang(hints)
        EVENTS[event](cluster)
        woken = {"g0", "g1"} & active(scheduler)
        assert bool(woken) is wakes, (hints, woken)


def test_a_gang_woken_by_the_room_it_lacked_starts_whole() -> None:
    # top1 leaves: t1's 4 idle cards and t0's 2 backfill cards hold both 2-card members.
    cluster, scheduler = parked_gang(True)
    cluster.delete_pod("top1")
    scheduler.run_pending()
    assert {"g0", "g1"} <= bound(cluster)


def test_the_flush_retries_a_gang_no_event_woke() -> None:
    # Nothing woke it (a backfill pod left); the flush (every 300 s) tries it again all the same.
    cluster, scheduler = parked_gang(True)
    cluster.delete_pod("f0")
    assert not {"g0", "g1"} & active(scheduler)
    cluster.loop.run(until=301.0)
    outcomes = scheduler.run_pending()
    assert {o.request.name for o in outcomes} >= {"g0", "g1"}


# ---------------------------------------------------------------------------------------------- the gang's room bound
def eight(name: str) -> NodeSpec:
    return node(name).gpus(8).pool("train").label("slot", name).obj()


@pytest.mark.parametrize(
    ("running", "gang", "screened", "placed"),
    [
        # 3 nodes, each held whole by a pod of the gang's priority (not a victim): room 0 < 2 members.
        ([("s0", 8, "train"), ("s1", 8, "train"), ("s2", 8, "train")], (2, 8), True, False),
        # 2 nodes held by higher pods, 1 free: room 1 < 3 members.
        ([("s0", 8, "top"), ("s1", 8, "top")], (3, 8), True, False),
        # The same cluster, 1 member: room 1 ≥ 1, tried and placed on the free node.
        ([("s0", 8, "top"), ("s1", 8, "top")], (1, 8), False, True),
        # Backfill on every node: evicting it gives room 3 ≥ 3, tried and placed (the backfill pushed aside).
        ([("b0", 8, "fill"), ("b1", 8, "fill"), ("b2", 8, "fill")], (3, 8), False, True),
        # 4-card members on free nodes: 8 // 4 = 2 a node, 6 ≥ 3, tried and placed.
        ([], (3, 4), False, True),
        # Two nodes half held by higher pods (4 of 8): 4 // 4 = 1 each, plus the free node's 2: 4 ≥ 4, tried and
        # placed.
        ([("s0", 4, "top"), ("s1", 4, "top")], (4, 4), False, True),
        # ... and 5 members: room 4 < 5.
        ([("s0", 4, "top"), ("s1", 4, "top")], (5, 4), True, False),
    ],
)
def test_a_gang_is_trial_placed_only_when_its_room_bound_holds_it(running: list[tuple[str, int, str]],
                                                                  gang: tuple[int, int], screened: bool,
                                                                  placed: bool) -> None:
    cluster, scheduler = world([eight(f"n{i}") for i in range(3)])
    for name, cards, level in running:
        assert cluster.create_pod(request(name, cards, level)).ok
        scheduler.run_pending()
    assert bound(cluster) == {name for name, _, _ in running}
    members, cards = gang
    for i in range(members):
        assert cluster.create_pod(request(f"g{i}", cards, "train", gang="team/g", size=members)).ok
    outcomes = scheduler.run_pending()
    gang_outcomes = [o for o in outcomes if o.request.gang == "team/g"]
    assert scheduler.stats.gangs_screened == (1 if screened else 0)
    assert ({f"g{i}" for i in range(members)} <= bound(cluster)) is placed
    if screened:
        assert all("room for at most" in o.decision.status.message for o in gang_outcomes)


def test_fractional_members_are_bounded_by_card_shares() -> None:
    # One 2-card node: 5 members of 400 milli ask 2,000 milli, no more than its 2 × 1,000, but a card holds
    # 1000 // 400 = 2 shares, 2 × 2 = 4 < 5: screened; 4 members: tried, placed.
    for members, screened in ((5, True), (4, False)):
        cluster, scheduler = world([node("n0").gpus(2).pool("train").obj()])
        for i in range(members):
            member = replace(request(f"g{i}", 1, "train", gang="team/g", size=members), gpu=Fraction(400))
            assert cluster.create_pod(member).ok
        scheduler.run_pending()
        assert scheduler.stats.gangs_screened == int(screened)
        assert ({f"g{i}" for i in range(members)} <= bound(cluster)) is not screened


# ---------------------------------------------------------------------------------------------- hints change nothing
LEVELS = ("fill", "train", "top")
Scenario = tuple[list[tuple[str, int, bool]], list[tuple[int, str, str]], tuple[int, int, bool], list[tuple[str, int]]]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """(nodes: pool, cards, cordoned once the running pods started; running pods: cards, level, pool; the pending
    gang (or pods of one shape): members, cards, whether it is a gang; events: ("delete", k-th running pod) /
    ("add", cards of a fill pod) / ("cordon", node: cordon or uncordon it) / ("flush", 0))."""
    nodes = draw(st.lists(st.tuples(st.sampled_from(("train", "infer")), st.sampled_from((2, 4, 8)), st.booleans()),
                          min_size=1, max_size=4))
    running = draw(st.lists(st.tuples(st.integers(1, 4), st.sampled_from(LEVELS), st.sampled_from(("train", "infer"))),
                            max_size=8))
    pending = draw(st.tuples(st.integers(1, 3), st.integers(1, 4), st.booleans()))
    events = draw(st.lists(st.one_of(st.tuples(st.just("delete"), st.integers(0, 7)),
                                     st.tuples(st.just("add"), st.integers(1, 2)),
                                     st.tuples(st.just("cordon"), st.integers(0, 3)),
                                     st.tuples(st.just("flush"), st.just(0))), min_size=1, max_size=8))
    return nodes, running, pending, events


def replay(scenario: Scenario, hints: bool) -> list[set[str]]:
    """The pods running after each step: one pending gang, or pods of one shape, of priority train (and the fill
    pods added meanwhile)."""
    nodes, running, pending, events = scenario
    cluster, scheduler = world([node(f"n{i}").gpus(cards).pool(p).obj() for i, (p, cards, _) in enumerate(nodes)],
                               hints=hints)
    names: list[str] = []
    for k, (cards, level, pools) in enumerate(running):
        name = f"r{k}"
        cluster.create_pod(request(name, cards, level, pools))
        scheduler.run_pending()
        if cluster.get_pod(name).phase is PodPhase.RUNNING:  # type: ignore[union-attr]
            names.append(name)
        else:
            cluster.delete_pod(name)
    for i, (_, _, cordoned) in enumerate(nodes):
        if cordoned:
            cluster.patch_node(f"n{i}", unschedulable=True)
    members, cards, is_gang = pending
    for i in range(members):  # a gang, or as many pods asking the same (one failure answers for the others)
        cluster.create_pod(request(f"p{i}", cards, "train", gang="team/p" if is_gang else None,
                                   size=members if is_gang else 0))
    scheduler.run_pending()
    seen = [bound(cluster)]
    for n, (kind, value) in enumerate(events):
        if kind == "delete" and names:
            cluster.delete_pod(names.pop(value % len(names)))
        elif kind == "add":
            cluster.create_pod(request(f"a{n}", value, "fill"))
        elif kind == "cordon":
            name = f"n{value % len(nodes)}"
            cluster.patch_node(name, unschedulable=cluster.state.nodes[cluster.state.node_index[name]].schedulable)
        else:
            cluster.loop.run(until=cluster.loop.now() + 301.0)
        scheduler.run_pending()
        seen.append(bound(cluster))
    return seen


@SETTINGS
@given(scenarios())
def test_the_hints_change_no_decision(scenario: Scenario) -> None:
    # A skipped retry is one that would have failed, and a failed attempt changes nothing (not the cache, not the
    # tie-break draws): so after every step the same pods run with the hints on as with them off.
    assert replay(scenario, True) == replay(scenario, False)


def test_a_trial_stops_when_the_members_left_cannot_fit_with_what_they_may_evict() -> None:
    # Queues a (minimum 16 GPUs) and b (minimum 8); 4 nodes of 8 cards; b runs 3 training pods of 8 on n1-n3 (24,
    # borrowing 16). A gang of a, 4 × 8 cards at b's priority: while a is owed its minimum (0 + 8 and 8 + 8 ≤ 16)
    # it may reclaim b's borrowed cards, so the bound before the trial counts 4 nodes: 4 ≥ 4, tried. Member 1
    # takes the idle n0, member 2 reclaims one of b's nodes; then a holds 16 and is owed no more (16 + 8 > 16),
    # and b holds 16 (borrowing 8) at a's priority: nothing the last 2 members may evict, room 0 < 2: the trial
    # stops there (without the hints: the same failure, from the preemption search, which finds no victim).
    quotas = Quotas([QueueQuota("a", min_gpus=16), QueueQuota("b", min_gpus=8)])
    for hints, reason in ((True, "room for at most 0 of the 2 members left"),
                          (False, "Preemption: no pod may be preempted for it")):
        cluster = SimCluster(CATALOG, [eight(f"n{i}") for i in range(4)])
        rules = SchedulingRules(classes=CLASSES, quotas=quotas, queueing_hints=hints)
        scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=rules)
        for i in range(1, 4):
            running = replace(request(f"b{i}", 8, "train"), queue="b", node_selector=(("slot", f"n{i}"),))
            assert cluster.create_pod(running).ok
        scheduler.run_pending()
        assert bound(cluster) == {"b1", "b2", "b3"}
        for i in range(4):
            assert cluster.create_pod(replace(request(f"g{i}", 8, "train", gang="a/g", size=4), queue="a")).ok
        outcomes = scheduler.run_pending()
        assert bound(cluster) == {"b1", "b2", "b3"}  # the trial undone: b keeps its nodes
        assert scheduler.stats.gangs_screened == 0
        assert all(reason in o.decision.status.message for o in outcomes if o.request.gang == "a/g"), hints
