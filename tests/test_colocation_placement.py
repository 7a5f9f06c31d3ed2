"""Co-location-aware placement (`gpuplane.scheduler.plugins.colocation`) on hand-built clusters: the cost, the
card picker (node and card policy `colocation`), the node score, and the per-card online compute that
`ClusterState` keeps for it.

Cards are A100-40GB: 1000 milli of compute and 40 960 MiB of memory, so memory shares are multiples of 1/40 per
1 024 MiB (4 096 MiB = 0.1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import cluster, framework, node, placed, pod, schedule
from gpuplane.model import Assignment, CardShare, ClusterState, Fraction, NodeSpec, PodRequest, PoolConfig, QoS
from gpuplane.scheduler import CycleState
from gpuplane.scheduler.plugins.colocation import (
    ColocationScore,
    ColocationWeights,
    card_costs,
    colocation_cost,
    ratio_mismatch,
)

MIB = 40960
"""A100-40GB memory."""


def f64(*values: float) -> np.ndarray[Any, np.dtype[np.float64]]:
    return np.array(values, dtype=np.float64)


# ------------------------------------------------------------------------------------------------- the cost
@pytest.mark.parametrize(("milli_left", "mem_left", "mem_cap", "expected"), [
    (300, 2048, MIB, 0.25),  # memory 2048/40960 = 0.05, compute 0.3: |0.05 - 0.3|
    (500, 24576, MIB, 0.1),  # 0.6 - 0.5
    (200, 32768, MIB, 0.6),  # 0.8 - 0.2
    (700, 32768, MIB, 0.1),  # 0.8 - 0.7
    (1000, MIB, MIB, 0.0),  # an empty card is balanced
    (0, 0, MIB, 0.0),  # so is a full one
    (0, MIB, MIB, 1.0),  # all memory, no compute: every byte stranded
    (1000, 0, MIB, 1.0),  # all compute, no memory
    (400, 5000, 0, 0.4),  # no memory capacity (a card without memory): share 0, |0 - 0.4|
])
def test_ratio_mismatch(milli_left: int, mem_left: int, mem_cap: int, expected: float) -> None:
    got = ratio_mismatch(f64(milli_left), f64(mem_left), f64(mem_cap))
    assert got.shape == (1,)
    assert got[0] == pytest.approx(expected)


def test_ratio_mismatch_is_elementwise_over_cards() -> None:
    got = ratio_mismatch(f64(300, 500, 1000), f64(2048, 24576, MIB), f64(MIB, MIB, MIB))
    np.testing.assert_allclose(got, [0.25, 0.1, 0.0])


@pytest.mark.parametrize(("pressure", "mismatch", "weights", "expected"), [
    (0.6, 0.6, (0.6, 0.4), 0.6),  # 0.36 + 0.24
    (0.1, 0.1, (0.6, 0.4), 0.1),  # 0.06 + 0.04
    (1.0, 0.0, (0.6, 0.4), 0.6),
    (0.0, 1.0, (0.6, 0.4), 0.4),
    (0.0, 0.25, (0.6, 0.4), 0.1),  # 0.4 x 0.25
    (0.5, 0.1, (1.0, 1.0), 0.3),  # (0.5 + 0.1) / 2: weights are normalised
    (0.9, 0.25, (0.0, 2.0), 0.25),  # ratio alone
    (0.9, 0.25, (3.0, 0.0), 0.9),  # pressure alone
    (1.0, 1.0, (0.6, 0.4), 1.0),  # the worst card costs 1
])
def test_colocation_cost(pressure: float, mismatch: float, weights: tuple[float, float], expected: float) -> None:
    got = colocation_cost(f64(pressure), f64(mismatch), ColocationWeights(*weights))
    assert got[0] == pytest.approx(expected)


@pytest.mark.parametrize("weights", [(-0.1, 1.0), (1.0, -0.1), (0.0, 0.0)])
def test_bad_weights(weights: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="weights"):
        ColocationWeights(*weights)


# ------------------------------------------------------------------------------------------ hand-built cards
def a100s(name: str, cards: int = 2) -> NodeSpec:
    return node(name).gpus(cards, "A100-40GB").obj()


def put(state: ClusterState, request: PodRequest, node_name: str, card: int) -> None:
    """Place a fractional pod on a card of our choosing."""
    gpu = request.gpu
    assert isinstance(gpu, Fraction)
    state.place(request, Assignment(node_name, (CardShare(card, gpu.compute_milli, gpu.memory_mib),)))


def online(name: str, milli: int, mem: int) -> PodRequest:
    return pod(name).fraction(milli, mem=mem).qos(QoS.ONLINE).obj()


def offline(name: str, milli: int, mem: int, qos: QoS = QoS.OFFLINE) -> PodRequest:
    return pod(name).fraction(milli, mem=mem).qos(qos).obj()


def busy_and_calm(node_name: str = "n") -> ClusterState:
    """Card 0 holds an online pod of 600 milli, card 1 one of 100 milli; 4 096 MiB each."""
    state = cluster(a100s(node_name))
    put(state, online("on-busy", 600, 4096), node_name, 0)
    put(state, online("on-calm", 100, 4096), node_name, 1)
    return state


def test_the_state_counts_online_compute_per_card() -> None:
    state = busy_and_calm()
    assert state.card_online_milli[0, :2].tolist() == [600, 100]
    put(state, offline("off", 200, 1024), "n", 1)  # offline compute is not online pressure
    assert state.card_online_milli[0, :2].tolist() == [600, 100]
    assert state.card_milli_free[0, :2].tolist() == [400, 700]


def test_costs_of_the_busy_and_calm_cards() -> None:
    state = busy_and_calm()
    request = offline("off", 200, 4096)
    costs = card_costs(request, state, np.array([0]), ColocationWeights())
    # busy: pressure 0.6; left 400 - 200 = 200 milli (0.2), 40960 - 8192 = 32768 MiB (0.8): mismatch 0.6;
    #       0.6 x 0.6 + 0.4 x 0.6 = 0.6
    # calm: pressure 0.1; left 700 milli (0.7), 32768 MiB (0.8): mismatch 0.1; 0.06 + 0.04 = 0.1
    np.testing.assert_allclose(costs[0, :2], [0.6, 0.1])
    # a pod that does not fit costs +inf: 500 milli only fits the calm card (400 free on the busy one)
    costs = card_costs(offline("big", 500, 4096), state, np.array([0]), ColocationWeights())
    assert np.isinf(costs[0, 0]) and np.isfinite(costs[0, 1])


@pytest.mark.parametrize("qos", [QoS.OFFLINE, QoS.BEST_EFFORT])
def test_an_offline_fraction_goes_to_the_card_with_less_online_compute(qos: QoS) -> None:
    request = offline("off", 200, 4096, qos)
    # binpack: the fuller card, the busy one (400 free milli against 900)
    assert placed(framework("binpack", "binpack"), busy_and_calm(), request).cards[0].card == 0
    # colocation: the calm card (cost 0.1 against 0.6, above)
    for fw in (framework("binpack", "colocation"), framework("colocation", "colocation")):
        state = busy_and_calm()
        share = placed(fw, state, request).cards[0]
        assert (share.card, share.compute_milli, share.memory_mib) == (1, 200, 4096)
        assert state.card_milli_free[0, :2].tolist() == [400, 700]


@pytest.mark.parametrize("request_", [
    online("on", 200, 4096),
    online("on-small", 100, 1024),
    pod("whole").whole(1).qos(QoS.OFFLINE).obj(),
], ids=["online", "online-small", "offline-whole-card"])
def test_other_pods_are_placed_as_binpack_places_them(request_: PodRequest) -> None:
    state = cluster(a100s("n", 3))
    put(state, online("on-busy", 600, 4096), "n", 0)
    put(state, online("on-calm", 100, 4096), "n", 1)
    reference = placed(framework("binpack", "binpack"), state.copy(), request_)
    got = placed(framework("binpack", "colocation"), state, request_)
    assert got.cards == reference.cards


def test_an_online_pod_packs_onto_the_busy_card() -> None:
    state = busy_and_calm()
    share = placed(framework("binpack", "colocation"), state, online("on", 200, 4096)).cards[0]
    assert share.card == 0  # the fuller card, like binpack: online pods do not avoid online pressure
    assert state.card_online_milli[0, :2].tolist() == [800, 100]


def test_a_memory_heavy_pod_goes_where_the_leftover_is_balanced() -> None:
    """No online load anywhere (pressure 0): only the ratio decides.

    card 0 holds an offline pod of 600 milli and 26 624 MiB: 400 milli and 14 336 MiB (0.35) free;
    card 1 holds an offline pod of 400 milli and 4 096 MiB: 600 milli and 36 864 MiB (0.9) free.
    The new pod is memory-heavy: 100 milli (0.1 of the card) and 12 288 MiB (0.3).
    - on card 0: left 300 milli (0.3) and 2 048 MiB (0.05): mismatch 0.25, cost 0.4 x 0.25 = 0.1. Its 300 milli
      are stranded: 2 GiB is too little for another pod like it.
    - on card 1: left 500 milli (0.5) and 24 576 MiB (0.6): mismatch 0.1, cost 0.04.
    binpack takes card 0 (300 milli left < 500); colocation takes card 1.
    """
    def build() -> ClusterState:
        state = cluster(a100s("n"))
        put(state, offline("heavy-compute", 600, 26624), "n", 0)
        put(state, offline("light", 400, 4096), "n", 1)
        return state

    request = offline("mem-heavy", 100, 12288)
    costs = card_costs(request, build(), np.array([0]), ColocationWeights())
    np.testing.assert_allclose(costs[0, :2], [0.1, 0.04])
    assert placed(framework("binpack", "binpack"), build(), request).cards[0].card == 0
    state = build()
    assert placed(framework("binpack", "colocation"), state, request).cards[0].card == 1
    # and a second such pod still fits (on card 1 again: 500 milli, 24 576 MiB free)
    assert placed(framework("binpack", "colocation"), state, offline("mem-heavy-2", 100, 12288)).cards[0].card == 1


def test_ties_go_to_the_fuller_card_then_the_lower_index() -> None:
    state = cluster(a100s("n", 3))
    # cards 1 and 2 cost the same after the pod (no online; both balanced once filled the same way), card 0 is
    # empty: the pod of 500 milli / 20 480 MiB leaves card 0 at 0.5/0.5 (cost 0) too. All cost 0.
    put(state, offline("x", 250, 10240), "n", 1)
    put(state, offline("y", 250, 10240), "n", 2)
    share = placed(framework("binpack", "colocation"), state, offline("p", 500, 20480)).cards[0]
    # all three cost 0; cards 1 and 2 have 750 milli free against 1000: the fuller, then the lower index
    assert share.card == 1


# -------------------------------------------------------------------------------------------- node scores
def test_the_node_score_prefers_the_node_whose_best_card_is_cheapest() -> None:
    state = cluster(a100s("busy"), a100s("calm"), a100s("empty"))
    for name, milli in (("busy", 600), ("calm", 100)):
        put(state, online(f"{name}-0", milli, 4096), name, 0)
        put(state, online(f"{name}-1", milli, 4096), name, 1)
    request = offline("off", 200, 4096)
    scores = ColocationScore().score(CycleState(), request, state, np.arange(3))
    # busy: both cards cost 0.6 (above): 100 x (1 - 0.6) = 40
    # calm: both 0.1: 90
    # empty: pressure 0; left 800 milli (0.8), 36 864 MiB (0.9): mismatch 0.1, cost 0.04: 96
    np.testing.assert_allclose(scores, [40.0, 90.0, 96.0])
    # a node where the pod fits nowhere scores 0
    put(state, online("empty-0", 900, 4096), "empty", 0)
    put(state, online("empty-1", 900, 4096), "empty", 1)
    scores = ColocationScore().score(CycleState(), request, state, np.arange(3))
    np.testing.assert_allclose(scores, [40.0, 90.0, 0.0])


def test_the_colocation_node_policy_picks_the_calm_node() -> None:
    state = cluster(a100s("busy"), a100s("calm"))
    for name, milli in (("busy", 600), ("calm", 100)):
        put(state, online(f"{name}-0", milli, 4096), name, 0)
        put(state, online(f"{name}-1", milli, 4096), name, 1)
    request = offline("off", 200, 4096)
    # binpack packs onto the busier node (more allocated); colocation's score (40 against 90) outweighs that
    assert placed(framework("binpack", "binpack"), state.copy(), request).node == "busy"
    assert placed(framework("colocation", "colocation"), state, request).node == "calm"


@pytest.mark.parametrize("request_", [
    online("on", 200, 4096),
    pod("whole").whole(1).qos(QoS.OFFLINE).obj(),
    pod("mig").mig("1g.5gb").qos(QoS.OFFLINE).obj(),
    pod("cpu").cpu(1000).qos(QoS.OFFLINE).obj(),
], ids=["online-fraction", "offline-whole", "offline-mig", "offline-cpu-only"])
def test_pods_that_are_not_offline_fractions_score_zero(request_: PodRequest) -> None:
    state = cluster(a100s("busy"), a100s("calm"), a100s("empty"))
    put(state, online("busy-0", 600, 4096), "busy", 0)
    put(state, online("calm-0", 100, 4096), "calm", 0)
    scores = ColocationScore().score(CycleState(), request_, state, np.arange(3))
    np.testing.assert_array_equal(scores, [0.0, 0.0, 0.0])


def test_no_nodes_no_scores() -> None:
    state = cluster(a100s("n"))
    assert len(ColocationScore().score(CycleState(), offline("off", 100, 1024), state, np.arange(0))) == 0


# ------------------------------------------------------------------------------- online compute bookkeeping
pods_to_place = st.lists(
    st.tuples(st.sampled_from([QoS.ONLINE, QoS.OFFLINE, QoS.BEST_EFFORT]),
              st.sampled_from([100, 200, 250, 300, 500, 700]),
              st.sampled_from([0, 1024, 4096, 10240, 20480]),
              st.booleans()),  # release a placed pod after this one
    min_size=1, max_size=30)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods_to_place, st.sampled_from(["binpack", "colocation"]), st.randoms(use_true_random=False))
def test_online_milli_is_the_sum_of_online_pods_and_release_restores_it(
        steps: list[tuple[QoS, int, int, bool]], card_policy: str, rnd: Any) -> None:
    state = cluster(a100s("a"), a100s("b"))
    fw = framework("colocation" if card_policy == "colocation" else "binpack", card_policy)
    free_before = state.card_milli_free.copy()
    live: dict[str, PodRequest] = {}

    def expected() -> np.ndarray[Any, np.dtype[np.int64]]:
        out = np.zeros_like(state.card_online_milli)
        for name, request in live.items():
            binding = state.bindings[name]
            if request.qos is QoS.ONLINE:
                for share in binding.assignment.cards:
                    out[binding.node, share.card] += share.compute_milli
        return out

    for i, (qos, milli, mem, release) in enumerate(steps):
        request = offline(f"p{i}", milli, mem, qos)
        decision = fw.schedule(request, state)
        if decision.assignment is not None:
            state.place(request, decision.assignment)
            live[request.name] = request
        np.testing.assert_array_equal(state.card_online_milli, expected())
        if release and live:
            name = rnd.choice(sorted(live))
            state.release(name)
            del live[name]
            np.testing.assert_array_equal(state.card_online_milli, expected())
        assert np.all(state.card_online_milli >= 0)
        assert np.all(state.card_online_milli <= 1000 - state.card_milli_free)
    for name in list(live):
        state.release(name)
    assert not state.card_online_milli.any()
    np.testing.assert_array_equal(state.card_milli_free, free_before)


@pytest.mark.parametrize(("oversell", "policies", "placed_card"), [
    # both cards' compute held by online pods (1000 and 900): without an offline budget nothing fits 300 milli
    (False, ("binpack", "colocation"), None),
    # with it, card 1 (online pressure 0.9 against 1.0) is the colocation policy's choice
    (True, ("binpack", "colocation"), 1),
    # binpack packs the offline budget too: both cards have 1000 of it, ties go to the lower index
    (True, ("binpack", "binpack"), 0),
], ids=["no-oversell", "oversell-colocation", "oversell-binpack"])
def test_offline_fractions_take_the_compute_online_pods_hold(oversell: bool, policies: tuple[str, str],
                                                             placed_card: int | None) -> None:
    state = cluster(node("n").gpus(2, "A100-40GB").pool("co").obj(),
                    pools={"co": PoolConfig(offline_compute_oversell=oversell)})
    put(state, online("on-full", 1000, 4096), "n", 0)
    put(state, online("on-most", 900, 4096), "n", 1)
    decision = schedule(framework(*policies), state, offline("off", 300, 4096))
    if placed_card is None:
        assert decision.assignment is None
        return
    assert decision.assignment is not None and decision.assignment.cards[0].card == placed_card
    # the online compute is as it was; the offline budget of the chosen card has 1000 - 300 = 700 left
    assert state.card_milli_free[0, :2].tolist() == [0, 100]
    assert state.card_offline_free[0, placed_card] == 700
    # an online pod still gets the 100 milli card 1 has left
    assert placed(framework(*policies), state, online("on-late", 100, 1024)).cards[0].card == 1
