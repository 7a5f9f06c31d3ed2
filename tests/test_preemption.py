"""Preemption: victim choice, disruption budgets, policy Never, nominated reservations, backfill classes,
and invariants over random clusters (the preemptor always outranks its victims; the cache equals the world)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from builders import CATALOG, cluster, framework, node, pod
from gpuplane.model import (
    Assignment,
    Binding,
    CardShare,
    ClusterState,
    Fraction,
    GpuForm,
    NodeSpec,
    PodRequest,
    WholeCards,
)
from gpuplane.model.priority import PreemptionPolicy, PriorityClass, PriorityClasses, default_priority_classes
from gpuplane.port import Code, PodPhase, Status
from gpuplane.scheduler import (
    Admission,
    Framework,
    Outcome,
    PolicyConfig,
    Preemption,
    Scheduler,
    SchedulingRules,
    VictimOrder,
    VictimRules,
    default_registry,
)
from gpuplane.sim import SimCluster

A100 = CATALOG.get("A100-40GB")
PROFILE = default_registry().build(PolicyConfig())
FEWEST = VictimOrder.FEWEST_FIRST
LOWEST = VictimOrder.LOWEST_PRIORITY_FIRST
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Held = tuple[str, int, str, int, int]
"""A pod already running: (name, priority, node, card, milli); 1000 milli means a whole card."""


# ---------------------------------------------------------------------------------------------- helpers
def whole_on(node_name: str, *cards: int) -> Assignment:
    return Assignment(node_name, tuple(CardShare(c, 1000, A100.memory_mib, A100.encoders, A100.decoders, whole=True)
                                       for c in cards))


def share_on(node_name: str, card: int, milli: int) -> Assignment:
    return Assignment(node_name, (CardShare(card, milli, 0),))


def gpu_pod(name: str, priority: int, milli: int) -> PodRequest:
    """A pod of one whole card (milli 1000) or a compute-only fraction of one."""
    builder = pod(name).cpu(100).priority(priority)
    return (builder.whole(1) if milli == 1000 else builder.fraction(milli)).obj()


def held_state(cards: Sequence[int], held: Sequence[Held]) -> ClusterState:
    """Nodes n0, n1, … with `cards` A100s each, holding the `held` pods exactly where they say."""
    state = cluster(*(node(f"n{i}").gpus(count).obj() for i, count in enumerate(cards)))
    for name, priority, node_name, card, milli in held:
        assignment = whole_on(node_name, card) if milli == 1000 else share_on(node_name, card, milli)
        state.place(gpu_pod(name, priority, milli), assignment)
    return state


def lower_rules(state: ClusterState, preemptor: PodRequest, lost: Mapping[str, float] | None = None,
                refuse: str | None = None) -> VictimRules:
    """Victims: strictly lower priority; `lost` GPU-seconds per pod; `refuse` every victim set, if given."""
    rows = state.pod_table.pods
    eligible = rows.priority[: rows.count] < preemptor.priority
    work = dict(lost or {})
    return VictimRules(eligible.copy(), lambda b: work.get(b.request.name, 0.0), lambda victims: refuse)


def only(state: ClusterState, index: int) -> np.ndarray:
    mask = np.zeros(state.size, np.bool_)
    mask[index] = True
    return mask


def fits_on(fw: Framework, state: ClusterState, request: PodRequest, index: int) -> bool:
    return fw.schedule(request, state, within=only(state, index)).assignment is not None


@dataclass(frozen=True, slots=True)
class Eviction:
    pod: str
    priority: int
    phase: PodPhase
    reason: str
    grace_s: float
    workload: str | None
    others_running: int
    """Running pods of the victim's workload besides the victim, when the eviction was asked."""

    @property
    def preemptor(self) -> str | None:
        prefix = "preempted by "
        return self.reason[len(prefix):] if self.reason.startswith(prefix) else None


class RecordingCluster(SimCluster):
    """The simulated world, recording every eviction asked of it (with the victim as it was then)."""

    def __init__(self, nodes: Sequence[NodeSpec], classes: PriorityClasses) -> None:
        super().__init__(CATALOG, nodes)
        self.admission.append(Admission(classes))
        self.evictions: list[Eviction] = []

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        info = self.get_pod(pod)
        if info is not None:
            workload = info.request.workload
            others = sum(1 for p in self.list_pods() if p.phase is PodPhase.RUNNING and p.name != pod
                         and workload is not None and p.request.workload == workload)
            self.evictions.append(Eviction(pod, info.request.priority, info.phase, reason, grace_s, workload, others))
        return super().evict(pod, grace_s=grace_s, reason=reason)

    def running(self) -> set[str]:
        return {p.name for p in self.list_pods() if p.phase is PodPhase.RUNNING}

    def phase(self, name: str) -> PodPhase | None:
        info = self.get_pod(name)
        return info.phase if info is not None else None


def world(*specs: NodeSpec, rules: SchedulingRules | None = None) -> tuple[RecordingCluster, Scheduler]:
    rules = rules or SchedulingRules()
    world_ = RecordingCluster(list(specs), rules.classes)
    scheduler = Scheduler(world_, CATALOG, PROFILE, seed=0, now=world_.loop.now, rules=rules)
    return world_, scheduler


def bind_as(world_: SimCluster, request: PodRequest, assignment: Assignment) -> None:
    """Create `request` and bind it exactly to `assignment` (the layout a test starts from)."""
    assert world_.create_pod(request).ok
    status = world_.bind(request.name, assignment)
    assert status.ok, status.message


def assert_cache_matches(scheduler: Scheduler, world_: SimCluster) -> None:
    assert set(scheduler.state.bindings) == set(world_.state.bindings)
    for name, binding in world_.state.bindings.items():
        assert scheduler.state.bindings[name].assignment == binding.assignment
    assert scheduler.state.fingerprint() == world_.state.fingerprint()


def classed(request: PodRequest, priority_class: str, **changes: object) -> PodRequest:
    return replace(request, priority_class=priority_class, **changes)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- victim choice
# Nodes have one or more A100s; the preemptor P has priority 5 unless the case says otherwise.
WHOLE_P = gpu_pod("P", 5, 1000)
FRACTION_P = gpu_pod("P", 5, 700)


@pytest.mark.parametrize(("cards", "held", "preemptor", "order", "lost", "expected"), [
    # n0: one victim of priority 2; n1: two of priority 1. Fewest: rank (1, 2) < (2, 1) → n0.
    pytest.param([1, 1], [("a", 2, "n0", 0, 1000), ("b", 1, "n1", 0, 500), ("c", 1, "n1", 0, 500)],
                 WHOLE_P, FEWEST, {}, ("n0", {"a"}), id="fewest-victims-win"),
    # Same cluster, kube-scheduler's order: highest victim priority first, (1, 2) < (2, 1) → n1 with two victims.
    pytest.param([1, 1], [("a", 2, "n0", 0, 1000), ("b", 1, "n1", 0, 500), ("c", 1, "n1", 0, 500)],
                 WHOLE_P, LOWEST, {}, ("n1", {"b", "c"}), id="lowest-priority-first-takes-more-victims"),
    # n0: three victims of priority 1 fill the card (250 + 250 + 500); n1: one of priority 2.
    pytest.param([1, 1], [("x", 1, "n0", 0, 250), ("y", 1, "n0", 0, 250), ("z", 1, "n0", 0, 500),
                          ("big", 2, "n1", 0, 1000)],
                 WHOLE_P, FEWEST, {}, ("n1", {"big"}), id="fewest-one-of-priority-2"),
    pytest.param([1, 1], [("x", 1, "n0", 0, 250), ("y", 1, "n0", 0, 250), ("z", 1, "n0", 0, 500),
                          ("big", 2, "n1", 0, 1000)],
                 WHOLE_P, LOWEST, {}, ("n0", {"x", "y", "z"}), id="lowest-three-of-priority-1"),
    # One victim each: the lower highest-victim priority wins (1 < 2), in both orders.
    pytest.param([1, 1], [("a", 2, "n0", 0, 1000), ("b", 1, "n1", 0, 1000)],
                 WHOLE_P, FEWEST, {}, ("n1", {"b"}), id="tie-on-count-lower-priority-fewest"),
    pytest.param([1, 1], [("a", 2, "n0", 0, 1000), ("b", 1, "n1", 0, 1000)],
                 WHOLE_P, LOWEST, {}, ("n1", {"b"}), id="tie-on-count-lower-priority-lowest"),
    # Two victims each, highest priority 3 on both: the priority sum decides, 1 + 3 = 4 < 2 + 3 = 5 → n0.
    pytest.param([1, 1], [("a1", 1, "n0", 0, 500), ("a2", 3, "n0", 0, 500),
                          ("b1", 2, "n1", 0, 500), ("b2", 3, "n1", 0, 500)],
                 WHOLE_P, FEWEST, {}, ("n0", {"a1", "a2"}), id="tie-then-priority-sum"),
    # One victim of priority 1 each: the least work lost wins, 50 < 100 GPU-s → n1; swapped → n0.
    pytest.param([1, 1], [("a", 1, "n0", 0, 1000), ("b", 1, "n1", 0, 1000)],
                 WHOLE_P, FEWEST, {"a": 100.0, "b": 50.0}, ("n1", {"b"}), id="tie-then-least-work-lost"),
    pytest.param([1, 1], [("a", 1, "n0", 0, 1000), ("b", 1, "n1", 0, 1000)],
                 WHOLE_P, FEWEST, {"a": 50.0, "b": 100.0}, ("n0", {"a"}), id="tie-then-least-work-lost-swapped"),
    pytest.param([1, 1], [("a", 1, "n0", 0, 1000), ("b", 1, "n1", 0, 1000)],
                 WHOLE_P, LOWEST, {"a": 50.0, "b": 100.0}, ("n0", {"a"}), id="lowest-then-least-work-lost"),
    # Only strictly lower priorities are victims: a (5 = P's) and c (7) are safe, b (4) is taken.
    pytest.param([1, 1, 1], [("a", 5, "n0", 0, 1000), ("b", 4, "n1", 0, 1000), ("c", 7, "n2", 0, 1000)],
                 WHOLE_P, FEWEST, {}, ("n1", {"b"}), id="equal-priority-is-no-victim"),
    pytest.param([1, 1], [("a", 5, "n0", 0, 1000), ("c", 7, "n1", 0, 1000)],
                 WHOLE_P, FEWEST, {}, None, id="nothing-lower-no-plan"),
    pytest.param([1, 1], [("a", 5, "n0", 0, 1000), ("c", 7, "n1", 0, 1000)],
                 WHOLE_P, LOWEST, {}, None, id="nothing-lower-no-plan-lowest"),
    # A higher pod shares the card: evicting the lower one frees 500 < 700 milli, so no plan.
    pytest.param([1], [("low", 1, "n0", 0, 500), ("high", 6, "n0", 0, 500)],
                 FRACTION_P, FEWEST, {}, None, id="fraction-blocked-by-a-higher-sharer"),
    # 0.7 card on a node of two cards, each with two 0.5 pods: one card's two pods go, not four. Reprieve by
    # name keeps h0, h1 (card 0) and then card 1 has 500 < 700 free with h2 or h3 back → both are victims.
    pytest.param([2], [("h0", 0, "n0", 0, 500), ("h1", 0, "n0", 0, 500),
                       ("h2", 0, "n0", 1, 500), ("h3", 0, "n0", 1, 500)],
                 FRACTION_P, FEWEST, {}, ("n0", {"h2", "h3"}), id="fraction-two-halves-of-one-card"),
    # One card with 0.5 + 0.25 and 0.25 free: evicting the 0.5 frees 250 + 500 = 750 ≥ 700, the 0.25 alone
    # frees 500 < 700 → only the 0.5 goes.
    pytest.param([1], [("half", 0, "n0", 0, 500), ("quarter", 0, "n0", 0, 250)],
                 FRACTION_P, FEWEST, {}, ("n0", {"half"}), id="fraction-only-what-is-needed"),
    # The same on a two-card node: one card's 0.5 is enough (750 ≥ 700), the other card keeps everything.
    pytest.param([2], [("a-half", 0, "n0", 0, 500), ("a-quarter", 0, "n0", 0, 250),
                       ("b-half", 0, "n0", 1, 500), ("b-quarter", 0, "n0", 1, 250)],
                 FRACTION_P, FEWEST, {}, ("n0", {"b-half"}), id="fraction-one-pod-of-one-card"),
    # n0: 0.5 + 0.25 (one victim needed); n1: two 0.5 (two victims) → n0.
    pytest.param([1, 1], [("half", 0, "n0", 0, 500), ("quarter", 0, "n0", 0, 250),
                          ("h0", 0, "n1", 0, 500), ("h1", 0, "n1", 0, 500)],
                 FRACTION_P, FEWEST, {}, ("n0", {"half"}), id="fraction-fewest-across-nodes"),
    # Card: x 0.25 (priority 0), y 0.25 (priority 3), z 0.5 (priority 0), full. Keeping y leaves 750 ≥ 700 once
    # x and z go; keeping x instead would cost y (priority 3) → victims x and z.
    pytest.param([1], [("x", 0, "n0", 0, 250), ("y", 3, "n0", 0, 250), ("z", 0, "n0", 0, 500)],
                 FRACTION_P, FEWEST, {}, ("n0", {"x", "z"}), id="fraction-keeps-the-higher-sharer"),
    # Two whole cards from a node of four single-card pods: two victims, not four (w0, w1 reprieved by name).
    pytest.param([4], [(f"w{i}", 0, "n0", i, 1000) for i in range(4)],
                 replace(WHOLE_P, gpu=WholeCards(2)), FEWEST, {}, ("n0", {"w2", "w3"}), id="two-of-four-cards"),
])
def test_victim_selection(cards: list[int], held: list[Held], preemptor: PodRequest, order: VictimOrder,
                          lost: dict[str, float], expected: tuple[str, set[str]] | None) -> None:
    state = held_state(cards, held)
    fw = framework()
    before, names = state.fingerprint(), set(state.bindings)
    result = Preemption(fw, order=order).plan(preemptor, state, lower_rules(state, preemptor, lost))
    assert state.fingerprint() == before and set(state.bindings) == names
    if expected is None:
        assert result.plan is None and result.reason
        return
    assert result.plan is not None, result.reason
    plan = result.plan
    node_name, victims = expected
    assert state.nodes[plan.node].name == node_name
    assert {v.pod for v in plan.victims} == victims
    priorities = {name: priority for name, priority, *_ in held}
    assert all(v.priority == priorities[v.pod] < preemptor.priority for v in plan.victims)
    assert all(v.work_lost_gpu_s == lost.get(v.pod, 0.0) for v in plan.victims)
    assignment = plan.decision.assignment
    assert assignment is not None and assignment.node == node_name
    gone = [state.release(v.pod) for v in plan.victims]
    assert state.check(assignment, preemptor) is None  # the nominated placement fits once the victims are gone
    for binding in gone:
        state.place(binding.request, binding.assignment)


def test_plan_needs_preemption_policy_and_eligible_victims() -> None:
    state = held_state([1], [("low", 0, "n0", 0, 1000)])
    fw = framework()
    before = state.fingerprint()
    never = replace(WHOLE_P, preempt=False)
    result = Preemption(fw).plan(never, state, lower_rules(state, never))
    assert result.plan is None and result.reason == "preemption policy is Never"
    low = gpu_pod("P", 0, 1000)
    result = Preemption(fw).plan(low, state, lower_rules(state, low))
    assert result.plan is None and result.reason == "no pod may be preempted for it"
    result = Preemption(fw).plan(WHOLE_P, state, lower_rules(state, WHOLE_P, refuse="budget says no"))
    assert result.plan is None and result.reason == "budget says no"
    assert state.fingerprint() == before and set(state.bindings) == {"low"}


# ---------------------------------------------------------------------------------------------- work lost
@pytest.mark.parametrize(("checkpoint_a", "checkpoint_b", "victim", "lost_gpu_s"), [
    # a (0.5 card) bound at t=0, b (0.5 card) at t=50, P at t=100: a lost 0.5 × 100 = 50, b 0.5 × 50 = 25 → b.
    (0.0, 0.0, "b", 25.0),
    # a checkpoints every 30 s: fmod(100, 30) = 10 s → 0.5 × 10 = 5 GPU-s < 25 → a.
    (30.0, 0.0, "a", 5.0),
    # b checkpoints every 20 s: fmod(50, 20) = 10 s → 5 GPU-s; a lost 50 → b.
    (0.0, 20.0, "b", 5.0),
    # a every 40 s: fmod(100, 40) = 20 s → 10 GPU-s; b every 15 s: fmod(50, 15) = 5 s → 2.5 GPU-s → b.
    (40.0, 15.0, "b", 2.5),
])
def test_least_work_lost_breaks_ties_in_virtual_time(checkpoint_a: float, checkpoint_b: float, victim: str,
                                                     lost_gpu_s: float) -> None:
    world_, scheduler = world(node("n0").gpus(1).obj(), node("n1").gpus(1).obj(),
                              rules=SchedulingRules(default_victim_grace_s=0.0))
    bind_as(world_, replace(gpu_pod("a", 1, 500), checkpoint_every_s=checkpoint_a), share_on("n0", 0, 500))
    world_.loop.run(until=50.0)
    bind_as(world_, replace(gpu_pod("b", 1, 500), checkpoint_every_s=checkpoint_b), share_on("n1", 0, 500))
    world_.loop.run(until=100.0)
    world_.create_pod(FRACTION_P)  # 700 > 500 free on either card: one victim on either node, same priority
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.ok, outcome.decision.status.message
    assert [e.pod for e in world_.evictions] == [victim]
    assert scheduler.stats.work_lost_gpu_s == pytest.approx(lost_gpu_s)
    survivor = "a" if victim == "b" else "b"
    assert world_.running() == {survivor, "P"}
    assert_cache_matches(scheduler, world_)


# ---------------------------------------------------------------------------------------------- budgets
@pytest.mark.parametrize(("budget", "victims", "node_of_p"), [
    # n0: w-0, w-1 (priority 0, workload w); n1: x-0, x-1 (priority 1). One victim either way; w is lower
    # (the reprieve goes by name, so w-0 is kept and w-1 goes; on n1, x-0 is kept and x-1 goes).
    ({}, {"w-1"}, "n0"),
    # Two of w must stay running: evicting one would leave 1 < 2 → n1's priority-1 pod instead.
    ({"w": 2}, {"x-1"}, "n1"),
    # One must stay: evicting one of two leaves 1 ≥ 1 → allowed.
    ({"w": 1}, {"w-1"}, "n0"),
    # A budget for another workload changes nothing.
    ({"other": 5}, {"w-1"}, "n0"),
])
def test_min_available_is_respected(budget: dict[str, int], victims: set[str], node_of_p: str) -> None:
    world_, scheduler = world(node("n0").gpus(2).obj(), node("n1").gpus(2).obj(),
                              rules=SchedulingRules(min_available=budget, default_victim_grace_s=0.0))
    bind_as(world_, pod("w-0").cpu(100).whole(1).workload("w", 0).obj(), whole_on("n0", 0))
    bind_as(world_, pod("w-1").cpu(100).whole(1).workload("w", 1).obj(), whole_on("n0", 1))
    bind_as(world_, pod("x-0").cpu(100).whole(1).priority(1).obj(), whole_on("n1", 0))
    bind_as(world_, pod("x-1").cpu(100).whole(1).priority(1).obj(), whole_on("n1", 1))
    world_.create_pod(WHOLE_P)
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.ok, outcome.decision.status.message
    assert {e.pod for e in world_.evictions} == victims
    assert outcome.decision.assignment is not None and outcome.decision.assignment.node == node_of_p
    assert sum(1 for name in world_.running() if name.startswith("w-")) >= budget.get("w", 0)
    assert_cache_matches(scheduler, world_)


def test_min_available_refuses_when_only_its_pods_could_go() -> None:
    world_, scheduler = world(node("n0").gpus(2).obj(),
                              rules=SchedulingRules(min_available={"w": 2}, default_victim_grace_s=0.0))
    bind_as(world_, pod("w-0").cpu(100).whole(1).workload("w", 0).obj(), whole_on("n0", 0))
    bind_as(world_, pod("w-1").cpu(100).whole(1).workload("w", 1).obj(), whole_on("n0", 1))
    world_.create_pod(WHOLE_P)
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.UNSCHEDULABLE
    assert "minimum available 2" in outcome.decision.status.message
    assert world_.evictions == []
    assert world_.running() == {"w-0", "w-1"}
    assert_cache_matches(scheduler, world_)


def test_min_available_prefers_a_victim_outside_the_budget_on_the_same_node() -> None:
    # n0: "a" (no workload) on card 0, w-0 (the only pod of w, budget 1) on card 1; both priority 0.
    # Evicting "a" respects the budget. The reprieve keeps "a" first (by name) and picks w-0, which is refused.
    world_, scheduler = world(node("n0").gpus(2).obj(),
                              rules=SchedulingRules(min_available={"w": 1}, default_victim_grace_s=0.0))
    bind_as(world_, pod("a").cpu(100).whole(1).obj(), whole_on("n0", 0))
    bind_as(world_, pod("w-0").cpu(100).whole(1).workload("w", 0).obj(), whole_on("n0", 1))
    world_.create_pod(WHOLE_P)
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.ok, outcome.decision.status.message
    assert [e.pod for e in world_.evictions] == ["a"]


# ---------------------------------------------------------------------------------------------- policy Never
NEVER_CLASSES = PriorityClasses([*default_priority_classes(),
                                 PriorityClass("urgent-polite", 2000, PreemptionPolicy.NEVER)])


@pytest.mark.parametrize("preemptor", [
    pytest.param(replace(gpu_pod("P", 900, 1000), preempt=False), id="preempt-false"),
    pytest.param(classed(gpu_pod("P", 0, 1000), "urgent-polite"), id="class-policy-never"),
    pytest.param(classed(gpu_pod("P", 0, 1000), "online", preempt=False), id="class-overridden-to-never"),
])
def test_preemption_policy_never_evicts_no_one(preemptor: PodRequest) -> None:
    world_, scheduler = world(node("n0").gpus(2).obj(), rules=SchedulingRules(classes=NEVER_CLASSES))
    bind_as(world_, gpu_pod("low", 0, 1000), whole_on("n0", 0))
    bind_as(world_, classed(gpu_pod("fill", 0, 1000), "batch-low"), whole_on("n0", 1))  # backfill as well
    world_.create_pod(preemptor)
    info = world_.get_pod("P")
    assert info is not None and not info.request.preempts and info.request.priority > 100
    outcomes = scheduler.run_pending()
    world_.loop.run(until=100.0)
    outcomes += scheduler.run_pending()
    assert [o.decision.status.code for o in outcomes] == [Code.UNSCHEDULABLE]
    assert "Preemption" not in outcomes[0].decision.status.message
    assert world_.evictions == []
    assert world_.running() == {"low", "fill"}
    assert world_.phase("P") is PodPhase.PENDING
    assert scheduler.stats.attempts == 0
    assert_cache_matches(scheduler, world_)


# ---------------------------------------------------------------------------------------------- nomination
@pytest.mark.parametrize("other_priority", [0, 3, 5])
def test_nominated_capacity_is_reserved_until_the_victims_are_gone(other_priority: int) -> None:
    # n0: card 0 idle, card 1 held by v (priority 0, no class: default grace 30 s). P wants both cards.
    world_, scheduler = world(node("n0").gpus(2).obj())
    deferred: list[Outcome] = []
    scheduler.on_deferred = deferred.append
    bind_as(world_, gpu_pod("v", 0, 1000), whole_on("n0", 1))
    world_.loop.run(until=10.0)
    world_.create_pod(replace(WHOLE_P, gpu=WholeCards(2)))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.WAIT
    assert outcome.decision.assignment is not None and outcome.decision.assignment.card_indexes == (0, 1)
    assert [(e.pod, e.grace_s, e.reason) for e in world_.evictions] == [("v", 30.0, "preempted by P")]
    assert world_.phase("v") is PodPhase.TERMINATING and world_.phase("P") is PodPhase.PENDING
    assert "P" in scheduler.state.bindings and "v" not in scheduler.state.bindings  # reserved in the cache

    # Meanwhile the world has card 0 idle; a pod of lower or equal priority must not take it.
    world_.loop.run(until=20.0)
    world_.create_pod(gpu_pod("O", other_priority, 1000))
    (other,) = scheduler.run_pending()
    assert other.decision.status.code is Code.UNSCHEDULABLE
    assert world_.phase("O") is PodPhase.PENDING
    assert len(world_.evictions) == 1  # O may not evict the nominated P (P's priority is not below O's)
    assert deferred == []

    world_.loop.run(until=10.0 + 31.0)  # v's grace ends at 40 s
    assert world_.phase("v") is None
    assert world_.phase("P") is PodPhase.RUNNING
    (late,) = deferred
    assert late.request.name == "P" and late.decision.status.ok
    assert late.decision.assignment == outcome.decision.assignment
    assert late.waited == pytest.approx(30.0)
    info = world_.get_pod("P")
    assert info is not None and info.assignment == outcome.decision.assignment and info.bound_at == 40.0
    assert scheduler.run_pending() == []  # O stays parked: nothing was freed for it
    assert world_.phase("O") is PodPhase.PENDING
    assert_cache_matches(scheduler, world_)


def test_preempting_a_nominated_pod_requeues_it() -> None:
    world_, scheduler = world(node("n0").gpus(1).obj())
    bind_as(world_, gpu_pod("v", 0, 1000), whole_on("n0", 0))
    world_.create_pod(gpu_pod("P", 5, 1000))
    (nominated,) = scheduler.run_pending()
    assert nominated.decision.status.code is Code.WAIT  # v terminates for 30 s
    world_.loop.run(until=1.0)
    world_.create_pod(gpu_pod("H", 9, 1000))
    outcomes = {o.request.name: o for o in scheduler.run_pending()}
    # H takes over the reservation and waits for v; P loses its nomination, is tried again (nothing left
    # for it) and stays Pending.
    higher = outcomes["H"]
    assert higher.decision.status.code is Code.WAIT, higher.decision.status.message
    assert outcomes["P"].decision.status.code is Code.UNSCHEDULABLE
    assert world_.phase("P") is PodPhase.PENDING
    world_.loop.run(until=40.0)
    assert world_.phase("H") is PodPhase.RUNNING and world_.phase("P") is PodPhase.PENDING
    scheduler.run_pending()
    assert_cache_matches(scheduler, world_)


def test_capacity_a_victim_still_holds_is_not_handed_out() -> None:
    # n0 (1 card) held whole by v (grace 30 s). P (0.5) evicts v and is nominated to half of card 0.
    world_, scheduler = world(node("n0").gpus(1).obj())
    bind_as(world_, gpu_pod("v", 0, 1000), whole_on("n0", 0))
    world_.create_pod(gpu_pod("P", 5, 500))
    (nominated,) = scheduler.run_pending()
    assert nominated.decision.status.code is Code.WAIT
    world_.create_pod(gpu_pod("O", 5, 300))  # fits beside P once v is gone: 300 ≤ 1000 - 500
    outcomes = scheduler.run_pending()
    world_.loop.run(until=31.0)
    outcomes += scheduler.run_pending()
    assert all(o.decision.status.code is not Code.ERROR for o in outcomes), [o.decision.status for o in outcomes]
    assert world_.phase("P") is PodPhase.RUNNING
    assert world_.phase("O") is PodPhase.RUNNING
    assert_cache_matches(scheduler, world_)


# ---------------------------------------------------------------------------------------------- plan is pure
def test_plan_leaves_the_state_exactly_as_it_was() -> None:
    state = held_state([2, 2], [("a", 0, "n0", 0, 500), ("b", 2, "n0", 0, 250), ("c", 1, "n0", 1, 1000),
                                ("d", 0, "n1", 0, 300), ("e", 3, "n1", 1, 1000)])
    fw = framework()
    before, names = state.fingerprint(), set(state.bindings)
    table_before = {name: state.pod_table.pods.priority[row] for name, (row, _) in state.pod_table.row_of.items()}
    for preemptor in (WHOLE_P, FRACTION_P, replace(WHOLE_P, gpu=WholeCards(2)), gpu_pod("P", 1, 900)):
        for order in VictimOrder:
            Preemption(fw, order=order).plan(preemptor, state, lower_rules(state, preemptor))
            assert state.fingerprint() == before
            assert set(state.bindings) == names
            assert {n: state.pod_table.pods.priority[row]
                    for n, (row, _) in state.pod_table.row_of.items()} == table_before
            assert int(state.pod_table.pods.live[: state.pod_table.pods.count].sum()) == len(names)
            assert state.check_invariants() == []


# ---------------------------------------------------------------------------------------------- backfill
def test_backfill_is_transparent_to_a_higher_class() -> None:
    # n0 (4 cards): training t0, t1 on cards 0, 1; backfill b0 + b1 (0.5 each) on card 2, b2 (whole) on card 3.
    # n1 (4 cards): idle. Binpack ignoring backfill: n0 is 2/4 used, n1 0/4 → n0, on card 2 or 3.
    world_, scheduler = world(node("n0").gpus(4).obj(), node("n1").gpus(4).obj())
    bind_as(world_, classed(gpu_pod("t0", 0, 1000), "training"), whole_on("n0", 0))
    bind_as(world_, classed(gpu_pod("t1", 0, 1000), "training"), whole_on("n0", 1))
    bind_as(world_, classed(gpu_pod("b0", 0, 500), "batch-low"), share_on("n0", 2, 500))
    bind_as(world_, classed(gpu_pod("b1", 0, 500), "batch-low"), share_on("n0", 2, 500))
    bind_as(world_, classed(gpu_pod("b2", 0, 1000), "batch-low"), whole_on("n0", 3))
    assert scheduler.shadow is not None and set(scheduler.shadow.bindings) == {"t0", "t1"}
    world_.create_pod(classed(gpu_pod("T", 0, 1000), "training"))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.ok, outcome.decision.status.message  # batch-low's grace is 0 s: bound at once
    assignment = outcome.decision.assignment
    assert assignment is not None and assignment.node == "n0" and assignment.card_indexes[0] in (2, 3)
    on_card = {2: {"b0", "b1"}, 3: {"b2"}}[assignment.card_indexes[0]]
    assert {e.pod for e in world_.evictions} == on_card
    assert all(e.grace_s == 0.0 and e.reason == "preempted by T" for e in world_.evictions)
    assert world_.running() == {"t0", "t1", "T"} | ({"b0", "b1", "b2"} - on_card)
    assert scheduler.shadow is not None and set(scheduler.shadow.bindings) == {"t0", "t1", "T"}
    assert_cache_matches(scheduler, world_)


# (backfill_headroom_milli, cards on n0, node of the batch pod): n0 holds training t on card 0, the rest free;
# n1 (4 cards) is idle. Binpack sends a one-card pod to n0 (2/2 or 2/4 used after it beats n1's 1/4), the
# batch pod as well unless the headroom it must leave on n0 does not fit there.
HEADROOM_CASES = [
    (0, 2, "n0"),       # no headroom: backfill fills everything
    (1000, 2, "n1"),    # 2000 − 1000 (t) − 1000 (batch) = 0 < 1000 left on n0: the batch pod goes to idle n1
    (1000, 4, "n0"),    # 4000 − 1000 − 1000 = 2000 ≥ 1000: beside t, one card of headroom still free
    (10**6, 4, "n1"),   # more than any node holds: backfill on idle nodes only
]


@pytest.mark.parametrize(("headroom", "cards", "batch_node"), HEADROOM_CASES)
def test_backfill_leaves_the_headroom_beside_higher_pods(headroom: int, cards: int, batch_node: str) -> None:
    world_, scheduler = world(node("n0").gpus(cards).obj(), node("n1").gpus(4).obj(),
                              rules=SchedulingRules(backfill_headroom_milli=headroom))
    bind_as(world_, classed(gpu_pod("t", 0, 1000), "training"), whole_on("n0", 0))
    world_.create_pod(classed(gpu_pod("b", 0, 1000), "batch-low"))
    (batch,) = scheduler.run_pending()
    assert batch.decision.assignment is not None and batch.decision.assignment.node == batch_node


# (headroom, batch pods the next training pod evicts): on a 2-card n0 beside t, the free card is the batch
# pod's without headroom (the training pod then evicts it), and stays free with it
@pytest.mark.parametrize(("headroom", "evicted"), [(0, 1), (1000, 0)])
def test_the_headroom_is_there_for_the_next_higher_pod(headroom: int, evicted: int) -> None:
    world_, scheduler = world(node("n0").gpus(2).obj(), node("n1").gpus(4).obj(),
                              rules=SchedulingRules(backfill_headroom_milli=headroom))
    bind_as(world_, classed(gpu_pod("t", 0, 1000), "training"), whole_on("n0", 0))
    world_.create_pod(classed(gpu_pod("b", 0, 1000), "batch-low"))
    scheduler.run_pending()
    world_.create_pod(classed(gpu_pod("T", 0, 1000), "training"))
    (training,) = scheduler.run_pending()
    assert training.decision.status.ok, training.decision.status.message
    assert training.decision.assignment is not None and training.decision.assignment.node == "n0"
    assert len(world_.evictions) == evicted
    assert_cache_matches(scheduler, world_)


def test_backfill_headroom_parks_a_batch_pod_with_nowhere_to_go() -> None:
    world_, scheduler = world(node("n0").gpus(2).obj(), rules=SchedulingRules(backfill_headroom_milli=1000))
    bind_as(world_, classed(gpu_pod("t", 0, 1000), "training"), whole_on("n0", 0))
    world_.create_pod(classed(gpu_pod("b", 0, 1000), "batch-low"))
    (batch,) = scheduler.run_pending()
    # card 1 is free, but it is the headroom beside t: resolvable (the node is idle again once t is gone)
    assert batch.decision.status.code is Code.UNSCHEDULABLE
    assert "the backfill headroom must stay free" in batch.decision.status.message
    assert world_.running() == {"t"}


def test_backfill_pods_do_not_displace_each_other() -> None:
    world_, scheduler = world(node("n0").gpus(1).obj())
    bind_as(world_, classed(gpu_pod("b0", 0, 1000), "batch-low"), whole_on("n0", 0))
    world_.create_pod(classed(gpu_pod("b1", 0, 1000), "batch-low"))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.code is Code.UNSCHEDULABLE
    assert world_.evictions == [] and world_.running() == {"b0"}


def test_fraction_clears_only_the_backfill_it_needs() -> None:
    # n0 (1 card): training t (0.5) and backfill b0 (0.25), b1 (0.25). A 0.4 training pod: ignoring backfill the
    # card has 500 free; in truth 0. Clearing one 0.25 frees 250 < 400, both free 500 ≥ 400 → both go.
    # A 0.2 training pod would need one of them only (250 ≥ 200).
    for need, gone in ((400, 2), (200, 1)):
        world_, scheduler = world(node("n0").gpus(1).obj())
        bind_as(world_, classed(gpu_pod("t", 0, 500), "training"), share_on("n0", 0, 500))
        bind_as(world_, classed(gpu_pod("b0", 0, 250), "batch-low"), share_on("n0", 0, 250))
        bind_as(world_, classed(gpu_pod("b1", 0, 250), "batch-low"), share_on("n0", 0, 250))
        world_.create_pod(classed(gpu_pod("T", 0, need), "training"))
        (outcome,) = scheduler.run_pending()
        assert outcome.decision.status.ok, outcome.decision.status.message
        assert len(world_.evictions) == gone
        assert {e.pod for e in world_.evictions} <= {"b0", "b1"}
        assert_cache_matches(scheduler, world_)


def test_backfill_clearing_respects_min_available() -> None:
    # As above, but b0 and b1 form workload w with min_available 2: evicting either leaves 1 < 2.
    world_, scheduler = world(node("n0").gpus(4).obj(), node("n1").gpus(4).obj(),
                              rules=SchedulingRules(min_available={"w": 2}))
    bind_as(world_, classed(gpu_pod("t0", 0, 1000), "training"), whole_on("n0", 0))
    bind_as(world_, classed(gpu_pod("t1", 0, 1000), "training"), whole_on("n0", 1))
    bind_as(world_, classed(gpu_pod("b0", 0, 500), "batch-low", workload="w"), share_on("n0", 2, 500))
    bind_as(world_, classed(gpu_pod("b1", 0, 500), "batch-low", workload="w"), share_on("n0", 2, 500))
    bind_as(world_, classed(gpu_pod("b2", 0, 1000), "batch-low"), whole_on("n0", 3))
    world_.create_pod(classed(gpu_pod("T", 0, 1000), "training"))
    (outcome,) = scheduler.run_pending()
    assert outcome.decision.status.ok, outcome.decision.status.message
    assert {"b0", "b1"} <= world_.running()


# ---------------------------------------------------------------------------------------------- properties
# Priority levels 0–3 as classes with grace 0 (victims go at once); level 0 backfills.
LEVELS = ("fill", "low", "mid", "high")
ZERO_GRACE = PriorityClasses([
    PriorityClass("fill", 100, victim_grace_s=0.0, backfill=True),
    PriorityClass("low", 200, victim_grace_s=0.0),
    PriorityClass("mid", 300, victim_grace_s=0.0),
    PriorityClass("high", 400, victim_grace_s=0.0),
])


@dataclass(frozen=True, slots=True)
class Submit:
    level: int
    gpu: GpuForm
    preempt: bool
    in_budget: bool


@dataclass(frozen=True, slots=True)
class Delete:
    pick: int


Step = Submit | Delete


gpu_forms = st.one_of(st.builds(WholeCards, st.integers(1, 2)),
                      st.builds(lambda m: Fraction(compute_milli=m), st.sampled_from([100, 250, 300, 500, 700, 900])))
submits = st.builds(Submit, st.integers(0, 3), gpu_forms, st.sampled_from([True, True, True, False]), st.booleans())
steps = st.builds(lambda kind, submit, pick: Delete(pick) if kind == 3 else submit,  # 3 submits : 1 delete
                  st.integers(0, 3), submits, st.integers(0, 50))


@SETTINGS
@given(cards=st.lists(st.integers(2, 4), min_size=1, max_size=3), plan=st.lists(steps, min_size=8, max_size=30),
       order=st.sampled_from(list(VictimOrder)), budget=st.integers(0, 2))
def test_preemptors_always_outrank_their_victims(cards: list[int], plan: list[Step], order: VictimOrder,
                                                 budget: int) -> None:
    rules = SchedulingRules(classes=ZERO_GRACE, victim_order=order, min_available={"w": budget} if budget else {},
                            default_victim_grace_s=0.0)
    world_, scheduler = world(*(node(f"n{i}").gpus(c).cpu(16000).obj() for i, c in enumerate(cards)), rules=rules)
    priority: dict[str, int] = {}
    preempts: dict[str, bool] = {}
    seen = 0
    for index, step in enumerate(plan):
        world_.loop.run(until=float(index))
        if isinstance(step, Submit):
            name = f"p{index}"
            request = PodRequest(name, cpu_milli=1000, memory_mib=1024, gpu=step.gpu,
                                 priority_class=LEVELS[step.level], preempt=None if step.preempt else False,
                                 workload="w" if step.in_budget and step.level > 0 else None)
            assert world_.create_pod(request).ok
            info = world_.get_pod(name)
            assert info is not None
            priority[name], preempts[name] = info.request.priority, info.request.preempts
        else:
            running = sorted(world_.running())
            if running:
                world_.delete_pod(running[step.pick % len(running)])
        outcomes = scheduler.run_pending()
        assert all(o.decision.status.code is not Code.ERROR for o in outcomes)
        fresh = world_.evictions[seen:]
        seen = len(world_.evictions)
        for eviction in fresh:
            assert eviction.phase is PodPhase.RUNNING
            assert eviction.grace_s == 0.0
            preemptor = eviction.preemptor
            assert preemptor is not None, eviction.reason
            assert preempts[preemptor]
            assert priority[preemptor] > eviction.priority == priority[eviction.pod]
            if eviction.workload == "w":
                assert eviction.others_running >= budget
        assert world_.state.check_invariants() == []
        assert scheduler.state.check_invariants() == []
        assert_cache_matches(scheduler, world_)
    event(f"evictions: {min(len(world_.evictions), 3)}{'+' if len(world_.evictions) >= 3 else ''}")


@st.composite
def occupied_states(draw: st.DrawFn) -> ClusterState:
    """Small clusters filled by the framework with pods of random priorities 0–3."""
    cards = draw(st.lists(st.integers(2, 4), min_size=1, max_size=3))
    state = cluster(*(node(f"n{i}").gpus(c).cpu(16000).obj() for i, c in enumerate(cards)))
    fw = framework()
    pods = draw(st.lists(st.tuples(st.integers(0, 3), gpu_forms), min_size=4, max_size=20))
    for index, (level, gpu) in enumerate(pods):
        request = PodRequest(f"q{index}", cpu_milli=1000, memory_mib=1024, gpu=gpu, priority=level)
        decision = fw.schedule(request, state)
        if decision.assignment is not None:
            state.place(request, decision.assignment)
    return state


@SETTINGS
@given(state=occupied_states(), gpu=gpu_forms, level=st.integers(1, 4), order=st.sampled_from(list(VictimOrder)))
def test_plans_are_pure_lower_and_minimal(state: ClusterState, gpu: GpuForm, level: int, order: VictimOrder) -> None:
    fw = framework()
    preemptor = PodRequest("P", cpu_milli=1000, memory_mib=1024, gpu=gpu, priority=level)
    decision = fw.schedule(preemptor, state)
    if decision.status.code is not Code.UNSCHEDULABLE:
        return  # it fits (or preemption cannot help): the scheduler would not ask for a plan
    before, names = state.fingerprint(), set(state.bindings)
    result = Preemption(fw, order=order).plan(preemptor, state, lower_rules(state, preemptor), decision.diagnosis)
    assert state.fingerprint() == before and set(state.bindings) == names
    assert state.check_invariants() == []
    plan = result.plan
    event(f"plan: {plan is not None}")
    if plan is None:
        return
    assert plan.victims
    for victim in plan.victims:
        binding = state.bindings[victim.pod]
        assert binding.node == plan.node
        assert victim.priority == binding.request.priority < preemptor.priority
    assignment = plan.decision.assignment
    assert assignment is not None and assignment.node == state.nodes[plan.node].name
    gone: list[Binding] = [state.release(v.pod) for v in plan.victims]
    assert state.check(assignment, preemptor) is None
    # Minimal: putting back any one victim (the others still gone) leaves no room for the preemptor on the node.
    for binding in gone:
        state.place(binding.request, binding.assignment)
        assert not fits_on(fw, state, preemptor, plan.node), binding.request.name
        state.release(binding.request.name)
    for binding in gone:
        state.place(binding.request, binding.assignment)
    assert state.fingerprint() == before
