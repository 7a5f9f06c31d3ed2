"""Shares on several cards (HAMi's `gpu: N` with `gpumem`/`gpucores`): each of N distinct cards of one node holds
the share. Codec, model accounting, card pickers, queue hints and the device plugin's per-card HAMi-core limits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import CATALOG, cluster, framework, node, placed, renamed
from gpuplane.kube.cluster import pod_manifest
from gpuplane.kube.objects import ObjectError, pod_request
from gpuplane.model import (
    Assignment,
    CardShare,
    ClusterState,
    Fraction,
    PodRequest,
    QoS,
    RequestError,
    WholeCards,
)
from gpuplane.node.allocation import AllocationSettings, PendingPod, container_allocation
from gpuplane.node.gpu import CardInfo
from gpuplane.scheduler import SchedulingQueue
from test_properties import SETTINGS, Policy, assert_accounting, mixed_cluster, policies, requests


def shares(count: int, compute: int = 0, mem: int = 0, pct: int = 0) -> Fraction:
    return Fraction(compute_milli=compute, memory_mib=mem, memory_pct=pct, count=count)


def multi(name: str, count: int, compute: int = 0, mem: int = 0, **kwargs: Any) -> PodRequest:
    return PodRequest(name, gpu=shares(count, compute, mem), **kwargs)


def k8s_pod(limits: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]}}


# ---------------------------------------------------------------------------- request and codec

@pytest.mark.parametrize(("limits", "expected"), [
    # HAMi's own example: two cards, 3000 MiB on each.
    ({"gpuplane.io/gpu": "2", "gpuplane.io/gpumem": "3000"}, shares(2, mem=3000)),
    # gpucores is per card too: 30 % of each of 3 cards.
    ({"gpuplane.io/gpu": "3", "gpuplane.io/gpucores": "30"}, shares(3, compute=300)),
    ({"gpuplane.io/gpu": "2", "gpuplane.io/gpumem-percentage": "50"}, shares(2, pct=50)),
    # gpucores 100 alone is exclusive: whole cards, as before.
    ({"gpuplane.io/gpu": "2", "gpuplane.io/gpucores": "100"}, WholeCards(2)),
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpumem": "3000"}, shares(1, mem=3000)),
])
def test_codec_reads_a_share_per_card(limits: dict[str, str], expected: object) -> None:
    assert pod_request(k8s_pod(limits), CATALOG).gpu == expected


@pytest.mark.parametrize("gpu", [shares(2, mem=3000), shares(4, compute=250, mem=1024), shares(2, pct=25),
                                 Fraction(compute_milli=100, encoders=1, count=2)])
def test_pod_manifest_writes_back_what_reads_back(gpu: Fraction) -> None:
    request = PodRequest("ml/p", cpu_milli=1000, gpu=gpu)
    assert pod_request(pod_manifest(request), CATALOG).gpu == gpu


def test_a_share_per_card_still_names_bad_fields() -> None:
    with pytest.raises(ObjectError) as caught:
        pod_request(k8s_pod({"gpuplane.io/gpu": "2", "gpuplane.io/gpucores": "150"}), CATALOG)
    assert caught.value.field == "resources[gpuplane.io/gpucores]"
    with pytest.raises(RequestError) as refused:
        Fraction(memory_mib=1, count=0)
    assert refused.value.field == "gpu.count"


@pytest.mark.parametrize(("gpu", "milli", "cards"), [
    (shares(2, compute=300), 600, 2),   # 2 × 300
    (shares(4, compute=250), 1000, 4),  # 4 × 250
    (shares(3, mem=3000), 0, 3),        # memory only: no compute counted
    (shares(1, compute=500), 500, 1),
    (WholeCards(2), 2000, 2),
])
def test_gpu_total_is_count_times_share(gpu: Fraction | WholeCards, milli: int, cards: int) -> None:
    request = PodRequest("p", gpu=gpu)
    assert (request.gpu_milli_total, request.gpu_cards) == (milli, cards)


# ---------------------------------------------------------------------------- ClusterState

def four_cards() -> ClusterState:
    return cluster(node("n").gpus(4, "A100-40GB").cpu(32000).mem(131072).obj())


@pytest.mark.parametrize(("cards", "reason"), [
    ((CardShare(0, 300, 3000), CardShare(0, 300, 3000)), "card 0 does not exist on n or is named twice"),
    ((CardShare(0, 300, 3000),), "a share on 2 cards was given 1"),
    ((CardShare(0, 300, 3000), CardShare(1, 200, 3000)), "assignment does not match the requested fraction"),
    ((CardShare(0, 300, 3000), CardShare(1, 300, 2000)),
     "assignment does not match the requested GPU memory"),
])
def test_check_refuses_what_is_not_a_share_per_distinct_card(cards: tuple[CardShare, ...], reason: str) -> None:
    state = four_cards()
    assert state.check(Assignment("n", cards), multi("p", 2, 300, 3000)) == reason


def test_place_and_release_a_share_on_two_cards() -> None:
    state = four_cards()
    before = state.fingerprint()
    request = multi("p", 2, 300, 3000)
    state.place(request, Assignment("n", (CardShare(1, 300, 3000), CardShare(3, 300, 3000))))
    # cards 1 and 3 each: 1000 − 300 = 700 milli and 40960 − 3000 = 37960 MiB left; two cards no longer idle
    assert state.card_milli_free[0, :4].tolist() == [1000, 700, 1000, 700]
    assert state.card_mem_free[0, :4].tolist() == [40960, 37960, 40960, 37960]
    assert (int(state.idle_cards[0]), int(state.gpu_milli_used[0])) == (2, 600)
    assert state.check_invariants() == []
    state.release("p")
    assert state.fingerprint() == before


def test_a_card_without_room_refuses_its_share() -> None:
    state = four_cards()
    state.place(PodRequest("big", gpu=shares(1, compute=800)), Assignment("n", (CardShare(2, 800, 0),)))
    # card 2 has 200 milli left: a 300-milli share cannot land there
    reason = state.check(Assignment("n", (CardShare(1, 300, 0), CardShare(2, 300, 0))), multi("p", 2, 300))
    assert reason == "card 2 lacks capacity"


# ---------------------------------------------------------------------------- card pickers

@pytest.mark.parametrize(("card_policy", "expected"), [
    # used: card 0 holds 600 milli, card 1 holds 200; cards 2, 3 idle. The pod wants 300 on each of 2 cards.
    # binpack: least left after the share: card 0 (1000 − 600 − 300 = 100), card 1 (500), then the idle ones.
    ("binpack", (0, 1)),
    # spread: most left: the idle cards 2 and 3 (700 each), lower index first.
    ("spread", (2, 3)),
])
def test_pickers_choose_distinct_cards_by_their_order(card_policy: str, expected: tuple[int, ...]) -> None:
    state = four_cards()
    state.place(PodRequest("x", gpu=shares(1, 600)), Assignment("n", (CardShare(0, 600, 0),)))
    state.place(PodRequest("y", gpu=shares(1, 200)), Assignment("n", (CardShare(1, 200, 0),)))
    assignment = placed(framework(card_policy=card_policy), state, multi("p", 2, 300, 3000))
    assert assignment.card_indexes == expected
    assert all(s.compute_milli == 300 and s.memory_mib == 3000 for s in assignment.cards)


def test_a_node_with_too_few_fitting_cards_is_refused() -> None:
    state = cluster(node("a").gpus(2).cpu(8000).mem(65536).obj(), node("b").gpus(4).cpu(8000).mem(65536).obj())
    state.place(PodRequest("x", gpu=shares(1, 900)), Assignment("a", (CardShare(0, 900, 0),)))
    # a: card 0 has 100 milli left, so only card 1 takes 500: one card, not 3; b has 4 idle cards
    assignment = placed(framework(), state, multi("p", 3, 500))
    assert (assignment.node, assignment.card_indexes) == ("b", (0, 1, 2))
    decision = framework().schedule(multi("q", 2, 600), state)
    # a: 100 and 1000 milli left (one card fits), b: 500, 500, 500, 1000 (one card fits)
    assert decision.assignment is None
    assert decision.status.message.startswith("0/2 nodes are available: ")


@pytest.mark.parametrize(("node_policy", "card_policy"), [
    ("binpack", "card-only-one"), ("binpack", "colocation"), ("colocation", "binpack"), ("random", "binpack"),
    ("fgd-online", "binpack"), ("fgd-used", "binpack"), ("gpu-packing", "binpack"), ("gpu-clustering", "binpack"),
    ("dotprod", "binpack"), ("bestfit", "binpack"), ("spread", "spread"),
])
def test_every_policy_places_a_share_on_distinct_cards(node_policy: str, card_policy: str) -> None:
    state = cluster(node("a").gpus(4).cpu(32000).mem(131072).obj(), node("b").gpus(2).cpu(32000).mem(131072).obj())
    fw = framework(node_policy, card_policy)
    placed(fw, state, PodRequest("x", gpu=shares(1, 400), qos=QoS.OFFLINE))
    for i in range(3):
        request = multi(f"p{i}", 2, 300, 4096, qos=QoS.OFFLINE, workload=f"w{i}")
        assignment = placed(fw, state, request)
        assert len(set(assignment.card_indexes)) == 2
    assert state.check_invariants() == []
    assert_accounting(state)


# ---------------------------------------------------------------------------- queue hint

def test_queue_hint_counts_cards_per_pod() -> None:
    state = four_cards()
    for c in range(3):
        state.place(PodRequest(f"h{c}", gpu=shares(1, 800)), Assignment("n", (CardShare(c, 800, 0),)))
    queue = SchedulingQueue()
    queue.add(multi("two", 2, 500), 0.0)
    queue.add(multi("one", 1, 500), 1.0)
    while (entry := queue.pop()) is not None:
        queue.park(entry)
    # free milli: 200, 200, 200, 1000: one card takes 500, so "one" may fit and "two" may not
    assert queue.activate_for_node(state, 0) == 1
    assert [e.request.name for e in queue.parked] == ["two"]
    state.release("h0")  # 1000, 200, 200, 1000: two cards take 500
    assert queue.activate_for_node(state, 0) == 1
    assert queue.parked == []


# ---------------------------------------------------------------------------- device plugin

def test_hami_core_limits_per_visible_card() -> None:
    cards = {i: CardInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA A100-SXM4-40GB", total_bytes=40 << 30)
             for i in range(4)}
    assignment = Assignment("n", (CardShare(1, 300, 3000), CardShare(3, 300, 3000)))
    pending = PendingPod(key="ml/p", uid="u1", assignment=assignment, assigned_at=0.0, containers=(("main", 2),))
    envs = container_allocation(pending, "main", assignment.cards, cards, {}, AllocationSettings()).envs
    assert envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1,GPU-3"
    # the container sees its cards as 0 and 1: each has its own 3000 MiB limit, and 30 % of its compute
    assert (envs["CUDA_DEVICE_MEMORY_LIMIT_0"], envs["CUDA_DEVICE_MEMORY_LIMIT_1"]) == ("3000m", "3000m")
    assert envs["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert "CUDA_DEVICE_MEMORY_LIMIT_2" not in envs


# ---------------------------------------------------------------------------- properties

@st.composite
def mixed_requests(draw: st.DrawFn) -> PodRequest:
    """The property tests' requests, with shares on 2 or 3 cards mixed in."""
    if draw(st.booleans()):
        return draw(requests())
    compute = draw(st.sampled_from([0, 100, 250, 500]))
    memory = draw(st.sampled_from([0, 1024, 4096]))
    return PodRequest("x", cpu_milli=draw(st.sampled_from([0, 500, 2000])),
                      gpu=Fraction(compute_milli=compute or (0 if memory else 100), memory_mib=memory,
                                   count=draw(st.integers(2, 3))),
                      workload=draw(st.none() | st.sampled_from(["w1", "w2"])))


@SETTINGS
@given(policy=policies, reqs=st.lists(mixed_requests(), min_size=1, max_size=25), data=st.data())
def test_no_card_over_allocated_and_release_restores_exactly(policy: Policy, reqs: list[PodRequest],
                                                             data: st.DataObject) -> None:
    state = mixed_cluster()
    fw = policy.framework()
    history: list[tuple[str, tuple[bytes, ...]]] = []
    for i, raw in enumerate(reqs):
        request = renamed(raw, f"p{i}")
        before = state.fingerprint()
        decision = fw.schedule(request, state)
        if decision.assignment is None:
            continue
        state.place(request, decision.assignment)
        gpu = request.gpu
        if isinstance(gpu, Fraction):
            assert len(decision.assignment.cards) == gpu.count
            assert len(set(decision.assignment.card_indexes)) == gpu.count
        assert_accounting(state)
        history.append((request.name, before))
    for name, before in reversed(history) if data.draw(st.booleans(), label="lifo") else []:
        state.release(name)
        assert state.fingerprint() == before
    if state.bindings:
        for name in data.draw(st.permutations(sorted(state.bindings)), label="order"):
            state.release(name)
            assert_accounting(state)
        assert np.array_equal(state.card_milli_free[: state.size][state.card_valid[: state.size]],
                              np.full(int(state.card_valid[: state.size].sum()), 1000))
