"""Queue quotas per card model and the borrowing switches (`borrow`, `lend`), driven through the simulated
cluster with the core scheduler; and the bad quotas the model and the file loader refuse."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import CATALOG, node, pod
from gpuplane.model import (
    MILLI_PER_CARD,
    ModelQuota,
    NodeSpec,
    PodRequest,
    QueueQuota,
    QuotaError,
    Quotas,
    load_quotas,
)
from gpuplane.port import Code
from gpuplane.scheduler import Outcome, PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())
H100, A100 = "H100-80GB", "A100-40GB"


def world(*specs: NodeSpec, quotas: Quotas) -> tuple[SimCluster, Scheduler]:
    cluster = SimCluster(CATALOG, list(specs))
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now,
                          rules=SchedulingRules(quotas=quotas, default_victim_grace_s=0.0))
    return cluster, scheduler


def two_models() -> tuple[NodeSpec, NodeSpec]:
    """One 8 × H100 node and one 8 × A100 node."""
    return node("h").gpus(8, H100).obj(), node("a").gpus(8, A100).obj()


def queued(name: str, queue: str | None, cards: int, *models: str) -> PodRequest:
    builder = pod(name).cpu(100).mem(512).whole(cards)
    if models:
        builder = builder.models(*models)
    return replace(builder.obj(), queue=queue)


def submit(cluster: SimCluster, scheduler: Scheduler, pods: list[PodRequest]) -> dict[str, Outcome]:
    for request in pods:
        assert cluster.create_pod(request).ok
    return {o.request.name: o for o in scheduler.run_pending()}


def model_usage(cluster: SimCluster) -> dict[tuple[str, str], int]:
    """GPU milli per (queue, card model) over the world's bindings."""
    usage: dict[tuple[str, str], int] = {}
    for binding in cluster.state.bindings.values():
        model = cluster.state.model_of(binding.node)
        if binding.request.queue is not None and model is not None:
            key = (binding.request.queue, model.name)
            usage[key] = usage.get(key, 0) + binding.assignment.gpu_milli
    return usage


def bound(outcomes: dict[str, Outcome]) -> int:
    return sum(o.decision.status.ok for o in outcomes.values())


# ---------------------------------------------------------------------------------------------- per card model
@pytest.mark.parametrize(
    ("quota", "pods", "bound_count", "usage"),
    [
        # H100 max 2: six 1-card pods that may run anywhere, after a pod of no queue that makes binpack prefer
        # the H100 node: 2 of them there at most, the rest on A100.
        (QueueQuota("q", models=(ModelQuota(H100, max_gpus=2),)),
         [queued("other", None, 1, H100), *(queued(f"p{i}", "q", 1) for i in range(6))],
         7, {("q", H100): 2000, ("q", A100): 4000}),
        # The same cap with pods that ask for H100 only: 2 bound, 4 held (refused on the model, not the queue).
        (QueueQuota("q", models=(ModelQuota(H100, max_gpus=2),)),
         [queued(f"p{i}", "q", 1, H100) for i in range(6)], 2, {("q", H100): 2000}),
        # A100 max 3 and H100 max 1 with 2-card pods: 1 + 2 ≤ 3 on A100 → one pod; 2 > 1 on H100 → none.
        (QueueQuota("q", models=(ModelQuota(A100, max_gpus=3), ModelQuota(H100, max_gpus=1))),
         [queued(f"p{i}", "q", 2) for i in range(3)], 1, {("q", A100): 2000}),
        # The queue's overall max (3) binds before the models' (8 each): 3 of 5.
        (QueueQuota("q", max_gpus=3, models=(ModelQuota(H100, max_gpus=8), ModelQuota(A100, max_gpus=8))),
         [queued(f"p{i}", "q", 1) for i in range(5)], 3, None),
        # No borrowing: the H100 cap is its minimum 1, whatever its maximum (6); A100 (no share) is uncapped.
        (QueueQuota("q", min_gpus=1, models=(ModelQuota(H100, min_gpus=1, max_gpus=6),), borrow=False),
         [queued(f"p{i}", "q", 1, H100) for i in range(3)], 1, {("q", H100): 1000}),
    ],
)
def test_a_queue_never_uses_a_card_model_beyond_its_share(quota: QueueQuota, pods: list[PodRequest],
                                                          bound_count: int,
                                                          usage: dict[tuple[str, str], int] | None) -> None:
    cluster, scheduler = world(*two_models(), quotas=Quotas([quota]))
    outcomes = submit(cluster, scheduler, pods)
    assert bound(outcomes) == bound_count
    world_usage = model_usage(cluster)
    assert scheduler.quota_model_usage() == world_usage
    for share in quota.models:
        cap = quota.model_cap_milli(share)
        assert cap is None or world_usage.get(("q", share.model), 0) <= cap
    if usage is not None:
        assert world_usage == usage
    for outcome in outcomes.values():
        if not outcome.decision.status.ok:  # held pods say why, naming the model or the queue
            assert "queue q at its" in outcome.decision.status.message


def test_a_pod_held_on_its_models_share_runs_when_a_pod_of_its_queue_leaves() -> None:
    quota = QueueQuota("q", models=(ModelQuota(H100, max_gpus=1),))
    cluster, scheduler = world(*two_models(), quotas=Quotas([quota]))
    outcomes = submit(cluster, scheduler, [queued("p0", "q", 1, H100), queued("p1", "q", 1, H100)])
    assert outcomes["p1"].decision.status.code is Code.UNSCHEDULABLE  # parked, with the model named
    assert f"{H100}: queue q at its maximum there (1 of 1 GPUs)" in outcomes["p1"].decision.status.message
    assert cluster.delete_pod("p0").ok
    cluster.loop.run(until=1.0)
    assert {o.request.name: o.decision.status.code for o in scheduler.run_pending()} == {"p1": Code.SUCCESS}


# ---------------------------------------------------------------------------------------------- borrow on/off
@pytest.mark.parametrize(
    ("borrow", "bound_count", "held_message"),
    [
        (True, 6, "queue q at its maximum: 6 of 6 GPUs"),  # min 2, borrows 4 idle cards up to max 6
        (False, 2, "queue q at its minimum (it does not borrow): 2 of 2 GPUs"),  # never beyond min 2
    ],
)
def test_a_queue_borrows_idle_cards_only_when_it_may(borrow: bool, bound_count: int, held_message: str) -> None:
    quota = QueueQuota("q", min_gpus=2, max_gpus=6, borrow=borrow)
    cluster, scheduler = world(node("n").gpus(8).obj(), quotas=Quotas([quota]))
    outcomes = submit(cluster, scheduler, [queued(f"p{i}", "q", 1) for i in range(8)])
    assert bound(outcomes) == bound_count
    held = [o for o in outcomes.values() if not o.decision.status.ok]
    assert held and all(o.decision.status.code is Code.WAIT for o in held)
    assert held_message in held[0].decision.status.message
    assert cluster.state.idle_cards[: cluster.state.size].sum() == 8 - bound_count  # idle, but not the queue's


# ---------------------------------------------------------------------------------------------- lend on/off
@pytest.mark.parametrize(
    ("lend", "others_bound", "owner_bound", "evicted"),
    [
        # k (min 4) lends its idle share: o (no minimum, max 8) takes all 8 cards; k's 4 pods then reclaim 4.
        (True, 8, 4, 4),
        # k keeps its idle share: o gets the 4 cards beyond it; k's 4 pods then run without evicting anyone.
        (False, 4, 4, 0),
    ],
)
def test_a_queue_that_does_not_lend_keeps_its_idle_guaranteed_share(lend: bool, others_bound: int,
                                                                    owner_bound: int, evicted: int) -> None:
    quotas = Quotas([QueueQuota("k", min_gpus=4, max_gpus=8, lend=lend), QueueQuota("o", max_gpus=8)])
    cluster, scheduler = world(node("n").gpus(8).obj(), quotas=quotas)
    outcomes = submit(cluster, scheduler, [queued(f"o{i}", "o", 1) for i in range(8)])
    assert bound(outcomes) == others_bound
    for outcome in outcomes.values():
        if not outcome.decision.status.ok:  # parked, saying whose share it is
            assert outcome.decision.status.code is Code.UNSCHEDULABLE
            assert "idle guaranteed share of queue(s) k (4 GPUs) is kept" in outcome.decision.status.message
    submit(cluster, scheduler, [queued(f"k{i}", "k", 1) for i in range(4)])  # victims go at once (grace 0)
    assert sum(1 for n in cluster.state.bindings if n.startswith("k")) == owner_bound
    assert others_bound - sum(1 for n in cluster.state.bindings if n.startswith("o")) == evicted


def test_a_pod_outside_any_queue_is_kept_off_a_models_idle_share_too() -> None:
    # k keeps 6 H100 for itself: a pod with no queue asking for 4 H100 cards is refused (8 − 4 < 6), one
    # asking for any model goes to the A100 node instead.
    quota = QueueQuota("k", min_gpus=6, models=(ModelQuota(H100, min_gpus=6),), lend=False)
    cluster, scheduler = world(*two_models(), quotas=Quotas([quota]))
    outcomes = submit(cluster, scheduler, [queued("h4", None, 4, H100), queued("any4", None, 4)])
    assert outcomes["h4"].decision.status.code is Code.UNSCHEDULABLE
    assert f"{H100}: 6 idle GPUs kept for queues that do not lend" in outcomes["h4"].decision.status.message
    assert outcomes["any4"].decision.status.ok and outcomes["any4"].decision.assignment is not None
    assert outcomes["any4"].decision.assignment.node == "a"


SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["k", "o", None]), st.integers(1, 4), st.sampled_from([(), (H100,)])),
                min_size=1, max_size=12),
       st.integers(0, 16), st.integers(0, 3))
def test_caps_and_kept_shares_hold_whatever_arrives(pods: list[tuple[str | None, int, tuple[str, ...]]],
                                                    k_min: int, h100_cap: int) -> None:
    # Invariants after every pass: o never holds more H100 than its cap, and the cards free in the cluster
    # always cover what k (which does not lend) has not used of its minimum.
    quotas = Quotas([QueueQuota("k", min_gpus=k_min, lend=False),
                     QueueQuota("o", models=(ModelQuota(H100, max_gpus=h100_cap),))])
    cluster, scheduler = world(*two_models(), quotas=quotas)
    for i, (queue, cards, models) in enumerate(pods):
        submit(cluster, scheduler, [queued(f"p{i}", queue, cards, *models)])
        usage = model_usage(cluster)
        assert usage.get(("o", H100), 0) <= h100_cap * MILLI_PER_CARD
        k_used = sum(milli for (queue_name, _), milli in usage.items() if queue_name == "k")
        free = cluster.state.total_gpu_milli() - cluster.state.used_gpu_milli()
        assert free >= max(0, k_min * MILLI_PER_CARD - k_used)


# ---------------------------------------------------------------------------------------------- bad quotas
@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"models": (ModelQuota(H100, 2, 1),)}, f"models.{H100}: min_gpus 2 is above max_gpus 1"),
        ({"models": (ModelQuota(H100, -1),)}, f"models.{H100}: min_gpus must not be below zero"),
        ({"models": (ModelQuota(H100), ModelQuota(H100))}, f"models.{H100}: the model is listed twice"),
        ({"models": (ModelQuota(""),)}, "a model name must not be empty"),
        # the queue's minimum covers its models' minimums: 1 < 2 + 3
        ({"min_gpus": 1, "models": (ModelQuota(H100, 2), ModelQuota(A100, 3))}, "below the sum of its models"),
        ({"min_gpus": 4, "max_gpus": 4, "models": (ModelQuota(H100, 5),)}, "above the queue's max_gpus 4"),
    ],
)
def test_a_bad_model_share_raises_naming_the_queue_and_model(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(QuotaError, match="queue x") as raised:
        QueueQuota("x", **kwargs)  # type: ignore[arg-type]
    assert fragment in str(raised.value)


def test_load_quotas_reads_models_and_switches_with_canonical_names(tmp_path: Path) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text("queues:\n"
                    "  - {name: a, max_gpus: 16, models: {H100: {min_gpus: 8, max_gpus: 16}}, lend: false}\n"
                    "  - {name: b, min_gpus: 1, borrow: false}\n")
    quotas = load_quotas(path, CATALOG)
    a, b = quotas.get("a"), quotas.get("b")
    # a's minimum defaults to its models' sum (8); H100 is made H100-80GB
    assert a == QueueQuota("a", 8, 16, (ModelQuota(H100, 8, 16),), borrow=True, lend=False)
    assert b == QueueQuota("b", 1, None, (), borrow=False, lend=True)
    assert quotas.per_model and a is not None and a.cap_milli == 16000 and b is not None and b.cap_milli == 1000


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("queues:\n  - {name: a, models: {Z9: {max_gpus: 1}}}\n", "queue a: models.Z9: unknown GPU model 'Z9'"),
        ("queues:\n  - {name: a, models: {H100: {mx: 1}}}\n", "queues.0.models.H100.mx"),
        ("queues:\n  - {name: a, min_gpus: 1, models: {H100: {min_gpus: 2}}}\n", "below the sum of its models"),
        ("queues:\n  - {name: a, lend: maybe}\n", "queues.0.lend"),
    ],
)
def test_load_quotas_names_the_file_and_field_of_a_bad_model_share(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text(text)
    with pytest.raises(QuotaError) as raised:
        load_quotas(path, CATALOG)
    assert str(raised.value).startswith(f"{path}:") and fragment in str(raised.value)


# ---------------------------------------------------------------------------------------------- gangs, preemption
@pytest.mark.parametrize(
    ("shares", "placed_on"),
    [
        # 3 members × 2 cards = 6 > H100's 4: the whole gang goes to the A100 node, never split across the cap.
        ((ModelQuota(H100, max_gpus=4),), "a"),
        # Both models capped below the gang's 6: nothing is placed, the members are parked with the reason.
        ((ModelQuota(H100, max_gpus=4), ModelQuota(A100, max_gpus=5)), None),
    ],
)
def test_a_gang_is_placed_whole_within_its_queues_model_shares(shares: tuple[ModelQuota, ...],
                                                               placed_on: str | None) -> None:
    cluster, scheduler = world(*two_models(), quotas=Quotas([QueueQuota("q", models=shares)]))
    submit(cluster, scheduler, [queued("other", None, 1, H100)])  # binpack now prefers the H100 node
    members = [replace(queued(f"g{i}", "q", 2), gang="g", gang_size=3) for i in range(3)]
    outcomes = submit(cluster, scheduler, members)
    nodes = {b.assignment.node for n, b in cluster.state.bindings.items() if n != "other"}
    if placed_on is None:
        assert nodes == set()
        assert all(o.decision.status.code is Code.UNSCHEDULABLE for o in outcomes.values())
        assert all("no card model left within the queue quotas" in o.decision.status.message
                   for o in outcomes.values())
    else:
        assert nodes == {placed_on} and len(cluster.state.bindings) == 4


def test_preemption_never_takes_a_pod_onto_a_model_beyond_its_queues_share() -> None:
    # q holds its 2 H100 cards (its share); the A100 node is full of low-priority pods of no queue; 6 H100
    # cards are idle. A high-priority pod of q may not use them: it preempts on the A100 node instead.
    quota = QueueQuota("q", models=(ModelQuota(H100, max_gpus=2),))
    cluster, scheduler = world(*two_models(), quotas=Quotas([quota]))
    submit(cluster, scheduler, [queued("h0", "q", 1, H100), queued("h1", "q", 1, H100)])
    submit(cluster, scheduler, [replace(queued(f"low{i}", None, 1, A100), priority=0) for i in range(8)])
    assert model_usage(cluster) == {("q", H100): 2000}
    outcome = submit(cluster, scheduler, [replace(queued("urgent", "q", 1), priority=100)])["urgent"]
    cluster.loop.run(until=1.0)
    scheduler.run_pending()
    assert outcome.decision.status.code in (Code.SUCCESS, Code.WAIT)
    assert node_of(cluster, "urgent") == "a"
    assert model_usage(cluster) == {("q", H100): 2000, ("q", A100): 1000}
    assert len([n for n in cluster.state.bindings if n.startswith("low")]) == 7  # one evicted


def node_of(cluster: SimCluster, name: str) -> str:
    binding = cluster.state.bindings.get(name)
    assert binding is not None, f"{name} is not bound"
    return binding.assignment.node
