"""The defragmentation planner (`plan_moves`) on hand-made layouts, its invariants, and the controller in the
simulated world: freed cards go to the pending pod they were freed for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.defrag import (
    NO_MOVE_ANNOTATION,
    DefragController,
    DefragPolicy,
    Movable,
    movable_pods,
    plan_moves,
)
from gpuplane.model import (
    Assignment,
    CardShare,
    ClusterState,
    Fraction,
    NodeSpec,
    PodRequest,
    WholeCards,
    default_catalog,
)
from gpuplane.port import PodPhase
from gpuplane.scheduler import Framework, PolicyConfig, default_registry
from gpuplane.sim.scenario import build_world

CATALOG = default_catalog()
PROFILE = default_registry().build(PolicyConfig(node_policy="binpack"))

Layout = Mapping[str, Sequence[Sequence[tuple[str, int]]]]
"""node → per card, the fractional pods on it as (name, milli)."""

# n0: card 0 holds a (600; 400 free), card 1 holds b and c (300 each; 400 free)
# n1: card 0 holds d, e, f (300 each; 100 free), card 1 holds g (500) and h (400; 100 free)
# n2: one card holding k (100; 900 free): the room movers go to (k itself never moves: not in EVERYONE)
LAYOUT: Layout = {
    "n0": [[("a", 600)], [("b", 300), ("c", 300)]],
    "n1": [[("d", 300), ("e", 300), ("f", 300)], [("g", 500), ("h", 400)]],
    "n2": [[("k", 100)]],
}


def _fraction(name: str, milli: int, priority: int = 0, workload: str | None = None) -> PodRequest:
    return PodRequest(name, cpu_milli=1000, memory_mib=1024, gpu=Fraction(compute_milli=milli), priority=priority,
                      workload=workload or name)


def _state(layout: Layout, priorities: Mapping[str, int] | None = None,
           workloads: Mapping[str, str] | None = None) -> ClusterState:
    nodes = [NodeSpec(name, 64000, 262144, "T4", len(cards)) for name, cards in layout.items()]
    state = ClusterState(CATALOG, nodes)
    for node, cards in layout.items():
        for card, pods in enumerate(cards):
            for name, milli in pods:
                request = _fraction(name, milli, (priorities or {}).get(name, 0), (workloads or {}).get(name))
                state.place(request, Assignment(node, (CardShare(card, milli, 0),)))
    return state


def _framework() -> Framework:
    return Framework(PROFILE, np.random.default_rng(0))


WHOLE1 = PodRequest("big", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(1))
WHOLE2 = PodRequest("big2", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(2))
EVERYONE = frozenset("abcdefgh")


@pytest.mark.parametrize(("case", "pending", "movable", "priorities", "workloads", "budget", "expected"), [
    # Fewest moves: n0 card 0 takes one move (a); n0 card 1 and n1 card 1 take two, n1 card 0 three. a (600)
    # fits on n2 (900 free).
    ("fewest", WHOLE1, Movable(EVERYONE), {}, {}, 12, {"a"}),
    # a must not move (annotated): the next fewest is two moves, n0 card 1 (b, c) before n1 card 1 (g, h) by
    # node order; b and c (600 in all) fit on n2 (900 free).
    ("no-move", WHOLE1, Movable(EVERYONE - {"a"}), {}, {}, 12, {"b", "c"}),
    # a has priority 10 above the pending pod's 0: never moved for it, so b and c as above.
    ("priority", WHOLE1, Movable(EVERYONE), {"a": 10}, {}, 12, {"b", "c"}),
    # a pinned; b and c belong to workload w whose budget allows one disruption (2 running, minAvailable 1):
    # n0 card 1 would take both, so n1 card 1 (g 500 → n2, h 400 → n0's 400 free).
    ("pdb", WHOLE1, Movable(EVERYONE - {"a"}, {"w": 1}), {}, {"b": "w", "c": "w"}, 12, {"g", "h"}),
    # The same budget allowing two disruptions (3 running, minAvailable 1): b and c again.
    ("pdb-room", WHOLE1, Movable(EVERYONE - {"a"}, {"w": 2}), {}, {"b": "w", "c": "w"}, 12, {"b", "c"}),
    # a pinned and one move left this hour: every other card takes two or more, so no plan.
    ("budget", WHOLE1, Movable(EVERYONE - {"a"}), {}, {}, 1, None),
    ("budget-spent", WHOLE1, Movable(EVERYONE), {}, {}, 0, None),
    # Two whole cards on one node: n0 takes a, b, c (1200 milli) but only n2's 900 and n1's 100 + 100 are
    # elsewhere, and no single card holds a 300 after a 600 went to n2; n1 takes five movers (1800 > 900 + 800
    # free elsewhere). No plan: movers must all fit elsewhere.
    ("movers-must-fit", WHOLE2, Movable(EVERYONE), {}, {}, 12, None),
])
def test_plan_moves_table(case: str, pending: PodRequest, movable: Movable, priorities: Mapping[str, int],
                          workloads: Mapping[str, str], budget: int, expected: set[str] | None) -> None:
    state = _state(LAYOUT, priorities, workloads)
    before = {name: b.assignment for name, b in state.bindings.items()}
    plan = plan_moves(state, [pending], movable, _framework(), budget=budget)
    assert {name: b.assignment for name, b in state.bindings.items()} == before, case
    if expected is None:
        assert plan.freed == () and [pod for pod, _ in plan.skipped] == [pending.name], case
        return
    (freed,) = plan.freed
    assert {m.pod for m in freed.moves} == expected, case
    assert plan.moves == len(expected) <= budget
    assert all(m.destination.node != freed.assignment.node for m in freed.moves)


def test_budget_is_shared_by_the_pending_pods() -> None:
    # LAYOUT plus n3, one card holding a pinned k2 (100; 900 free). Two pending one-card pods and 3 moves: the
    # first takes a (1 move, 600 → n2 or n3), the second then needs two (b, c: 600 → the other 900), 1 + 2 = 3
    # fits; with 2 moves the second is left out.
    layout = {**LAYOUT, "n3": [[("k2", 100)]]}
    other = PodRequest("big-b", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(1))
    for budget, plans in ((3, 2), (2, 1)):
        plan = plan_moves(_state(layout), [WHOLE1, other], Movable(EVERYONE), _framework(), budget=budget)
        assert len(plan.freed) == plans and plan.moves <= budget
        moved = [m.pod for f in plan.freed for m in f.moves]
        assert len(moved) == len(set(moved))  # no pod moved twice


def test_movable_pods_reads_annotations_owners_and_budgets() -> None:
    from gpuplane.port import PodInfo

    def info(name: str, workload: str | None, annotations: tuple[tuple[str, str], ...] = (),
             phase: PodPhase = PodPhase.RUNNING, whole: bool = False) -> PodInfo:
        gpu = WholeCards(1) if whole else Fraction(compute_milli=300)
        return PodInfo(PodRequest(name, gpu=gpu, workload=workload), phase, annotations=annotations, bound_at=0.0)

    pods = [info("owned", "w"), info("pinned", "w", ((NO_MOVE_ANNOTATION, "true"),)), info("bare", None),
            info("leaving", "w", phase=PodPhase.TERMINATING), info("whole", "x", whole=True)]
    movable = movable_pods(pods, {"w": 1})
    # Movable: only the running, owned, unannotated fraction. w has 2 running (owned, pinned), minAvailable 1.
    assert movable.pods == {"owned"}
    assert movable.allowance == {"w": 1}


# ---------------------------------------------------------------------------------------------- invariants
@st.composite
def _layouts(draw: st.DrawFn) -> tuple[Layout, int, int]:
    layout: dict[str, list[list[tuple[str, int]]]] = {}
    k = 0
    for n in range(draw(st.integers(2, 4))):
        cards: list[list[tuple[str, int]]] = []
        for _ in range(draw(st.integers(1, 4))):
            pods: list[tuple[str, int]] = []
            used = 0
            for milli in draw(st.lists(st.sampled_from([100, 200, 250, 300, 500, 700]), max_size=4)):
                if used + milli <= 1000:
                    pods.append((f"p{k}", milli))
                    k += 1
                    used += milli
            cards.append(pods)
        layout[f"n{n}"] = cards
    return layout, draw(st.integers(1, 2)), draw(st.integers(0, 6))


@given(_layouts())
@settings(max_examples=60, deadline=None)
def test_a_plan_never_overfills_a_card_and_the_freed_cards_fit(case: tuple[Layout, int, int]) -> None:
    layout, cards, budget = case
    state = _state(layout)
    names = frozenset(state.bindings)
    pending = [PodRequest(f"want-{i}", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(cards)) for i in range(2)]
    before = {name: b.assignment for name, b in state.bindings.items()}
    plan = plan_moves(state, pending, Movable(names), _framework(), budget=budget)
    assert {name: b.assignment for name, b in state.bindings.items()} == before
    assert plan.moves <= budget
    # Carry the plan out on the state with every check on: a mover's destination or a freed card that is
    # over-allocated raises PlacementError.
    for freed in plan.freed:
        for move in freed.moves:
            released = state.release(move.pod)
            assert move.destination.node != freed.assignment.node  # a mover leaves the node it frees
            state.place(released.request, move.destination)
        request = next(p for p in pending if p.name == freed.pod)
        assert state.check(freed.assignment, request) is None
        state.place(request, freed.assignment)
    assert (state.card_milli_free >= 0).all()


# ---------------------------------------------------------------------------------------------- controller
def test_freed_cards_go_to_the_pending_pod_not_a_later_arrival() -> None:
    # n0 (2 cards): a (500) on card 0, b (500) on card 1. n1 (1 card): c (400), 600 free. A whole-card pod
    # fits nowhere; moving a (1 move: its 500 fits beside c in n1's 600) frees n0 card 0.
    nodes = [NodeSpec("n0", 64000, 262144, "T4", 2), NodeSpec("n1", 64000, 262144, "T4", 1)]
    world = build_world(CATALOG, nodes, PROFILE, seed=0, stop_s=2.0)
    cluster, scheduler, loop = world.cluster, world.scheduler, world.loop
    for name, node, card, milli in (("a", "n0", 0, 500), ("b", "n0", 1, 500), ("c", "n1", 0, 400)):
        request = _fraction(name, milli)
        assert cluster.create_pod(request).ok
        assert cluster.bind(name, Assignment(node, (CardShare(card, milli, 0),))).ok
    controller = DefragController(cluster, scheduler, now=loop.now, policy=DefragPolicy(max_moves_per_hour=4),
                                  recreate=True)
    assert cluster.create_pod(WHOLE1).ok
    scheduler.run_pending()
    assert cluster.get_pod("big").phase is PodPhase.PENDING  # type: ignore[union-attr]
    plan = controller.tick()
    assert [m.pod for f in plan.freed for m in f.moves] == ["a"]
    assert cluster.get_pod("a").phase is PodPhase.TERMINATING  # type: ignore[union-attr]
    # A later whole-card pod arrives while a terminates: it must not take n0 card 0. A later fraction of 600
    # would fit n1's 600 free, but that is a's planned room, held for it: it must wait.
    later = PodRequest("later", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(1))
    assert cluster.create_pod(later).ok
    assert cluster.create_pod(_fraction("later-frac", 600)).ok
    scheduler.run_pending()
    assert cluster.get_pod("later-frac").phase is PodPhase.PENDING  # type: ignore[union-attr]
    loop.run(until=60.0)  # a's 30 s grace, then 2 s to stop; then it is created again
    scheduler.run_pending()
    big = cluster.get_pod("big")
    assert big is not None and big.phase is PodPhase.RUNNING and big.assignment is not None
    assert big.assignment.node == "n0" and big.assignment.card_indexes == (0,)
    assert cluster.get_pod("later").phase is PodPhase.PENDING  # type: ignore[union-attr]
    moved = cluster.get_pod("a")
    assert moved is not None and moved.phase is PodPhase.RUNNING and moved.assignment is not None
    # The new a is bound to its planned room beside c, and the placeholder that held it is gone.
    assert moved.assignment.node == "n1"
    assert "a~room" not in scheduler.state.bindings
    assert controller.stats.moves == 1 and controller.budget_left() == 3


def test_the_controller_spends_at_most_its_hourly_budget() -> None:
    # Budget 1 an hour: a first tick moves a; a second whole-card pod would need b moved (1 move) but the
    # hour's budget is spent until a's move is an hour old.
    nodes = [NodeSpec("n0", 64000, 262144, "T4", 2), NodeSpec("n1", 64000, 262144, "T4", 2)]
    world = build_world(CATALOG, nodes, PROFILE, seed=0, stop_s=2.0)
    cluster, scheduler, loop = world.cluster, world.scheduler, world.loop
    for name, node, card, milli in (("a", "n0", 0, 500), ("b", "n0", 1, 500), ("c", "n1", 0, 300),
                                    ("d", "n1", 1, 300)):
        assert cluster.create_pod(_fraction(name, milli)).ok
        assert cluster.bind(name, Assignment(node, (CardShare(card, milli, 0),))).ok
    controller = DefragController(cluster, scheduler, now=loop.now, policy=DefragPolicy(max_moves_per_hour=1),
                                  recreate=True)
    for name in ("w1", "w2"):
        assert cluster.create_pod(PodRequest(name, cpu_milli=1000, memory_mib=1024, gpu=WholeCards(1))).ok
    scheduler.run_pending()
    assert controller.tick().moves == 1
    loop.run(until=600.0)
    scheduler.run_pending()
    assert controller.tick().moves == 0 and controller.budget_left() == 0
    loop.run(until=3700.0)
    scheduler.run_pending()
    assert controller.budget_left() == 1
