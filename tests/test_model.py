"""The resource model: catalog, requests, node specs and ClusterState accounting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from builders import cluster, node, pod
from gpuplane.model import (
    Assignment,
    CardModel,
    CardShare,
    Catalog,
    CatalogError,
    ClusterState,
    Fraction,
    MigMode,
    MigSlice,
    NodeSpec,
    NodeSpecError,
    PlacementError,
    PodRequest,
    PoolConfig,
    QoS,
    RdmaLocality,
    RdmaNic,
    RdmaShare,
    RequestError,
    Topology,
    WholeCards,
    default_catalog,
    make_request,
)

CAT = default_catalog()


def whole(node_name: str, *cards: int, state: ClusterState) -> Assignment:
    n = state.node_index[node_name]
    return Assignment(node_name, tuple(
        CardShare(c, 1000, int(state.card_mem_cap[n, c]), int(state.card_enc_cap[n, c]),
                  int(state.card_dec_cap[n, c]), whole=True) for c in cards))


def frac(node_name: str, card: int, milli: int, mem: int = 0, enc: int = 0, dec: int = 0) -> Assignment:
    return Assignment(node_name, (CardShare(card, milli, mem, enc, dec),))


def mig(node_name: str, card: int, profile_id: int, start: int, model: str = "A100-40GB") -> Assignment:
    card_model = CAT.get(model)
    profile = card_model.mig_profiles[profile_id]
    return Assignment(node_name, (CardShare(card, card_model.mig_compute_milli(profile), profile.memory_mib,
                                            mig_profile=profile_id, mig_start=start),))


A100_WHOLE_0 = CardShare(0, 1000, 40960, 0, 5, whole=True)
"""Card 0 of an A100-40GB node, whole (for tables built before any state exists)."""


def frac_pod(name: str, milli: int = 100) -> PodRequest:
    return pod(name).fraction(milli).obj()


def mig_pod(name: str, profile: int) -> PodRequest:
    return pod(name).mig(profile).obj()


# ============================================================================ catalog

@pytest.mark.parametrize(("key", "canonical"), [
    ("V100M16", "V100-16GB"),
    ("v100m16", "V100-16GB"),
    ("V100", "V100-16GB"),
    ("V100M32", "V100-32GB"),
    ("A100", "A100-40GB"),
    ("A100-SXM4-80GB", "A100-80GB"),
    ("H100-SXM5-80GB", "H100-80GB"),
    ("H200", "H200-141GB"),
    ("A30", "A30-24GB"),
    ("T4", "T4"),
])
def test_catalog_aliases(key: str, canonical: str) -> None:
    assert key in CAT
    assert CAT.canonical(key) == canonical
    assert CAT.get(key) is CAT.get(canonical)


def test_catalog_unknown_model_names_known_models() -> None:
    assert "Z9" not in CAT
    with pytest.raises(CatalogError, match=r"unknown GPU model 'Z9'.*A100-40GB"):
        CAT.get("Z9")


def test_catalog_rejects_duplicates_and_ambiguous_aliases() -> None:
    a = CardModel("X1", 1000, 10, 0, 0)
    with pytest.raises(CatalogError, match="declared twice"):
        Catalog([a, CardModel("X1", 2000, 10, 0, 0)])
    with pytest.raises(CatalogError, match="ambiguous"):
        Catalog([a, CardModel("X2", 2000, 10, 0, 0, aliases=("x1",))])


def test_catalog_whole_card_data() -> None:
    assert len(CAT) == len(CAT.names) == 23  # protocols.md §5's 15, and 8 data-centre parts since
    t4 = CAT.get("T4")
    assert (t4.memory_mib, t4.sms, t4.encoders, t4.decoders) == (15360, 40, 1, 2)
    assert not t4.mig_capable
    assert t4.mig_profile(19) is None
    assert CAT.get("A100-40GB").mig_capable
    assert CAT.get("G1").declared_default and not CAT.get("T4").declared_default


# §5.2: id, compute slices, memory slices, legal starts, max count — shared by A100/H100/H200.
GA100_TABLE = [
    (19, 1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
    (20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    (15, 1, 2, (0, 2, 4, 6), 4),
    (14, 2, 2, (0, 2, 4), 3),
    (9, 3, 4, (0, 4), 2),
    (5, 4, 4, (0,), 1),
    (0, 7, 8, (0,), 1),
]


@pytest.mark.parametrize("model", ["A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"])
@pytest.mark.parametrize(("pid", "compute", "memory", "starts", "max_count"), GA100_TABLE)
def test_ga100_mig_geometry(model: str, pid: int, compute: int, memory: int, starts: tuple[int, ...],
                            max_count: int) -> None:
    card = CAT.get(model)
    assert (card.compute_slices, card.memory_slices) == (7, 8)
    profile = card.mig_profiles[pid]
    assert (profile.profile_id, profile.compute_slices, profile.memory_slices, profile.starts,
            profile.max_count) == (pid, compute, memory, starts, max_count)
    assert profile.media_extensions == (pid == 20)
    assert profile.memory_mib <= card.memory_mib
    # Every legal placement stays inside the 8 memory slices.
    assert all(s + memory <= 8 for s in starts)


def test_a100_40gb_profile_9() -> None:
    card = CAT.get("A100-40GB")
    p9 = card.mig_profile(9)
    assert p9 is not None
    assert (p9.name, p9.compute_slices, p9.memory_slices, p9.starts) == ("3g.20gb", 3, 4, (0, 4))
    assert (p9.memory_mib, p9.sms, p9.decoders) == (19968, 42, 2)
    assert card.mig_profile("3g.20gb") is p9
    assert card.mig_profile("3g.40gb") is None
    assert p9.slot_mask(0) == 0b00001111
    assert p9.slot_mask(4) == 0b11110000
    # 3 of 7 compute slices, floored to milli-cards.
    assert card.mig_compute_milli(p9) == 3000 // 7 == 428


@pytest.mark.parametrize(("model", "pid", "name", "memory_mib"), [
    ("A100-40GB", 19, "1g.5gb", 4864),       # go-nvml mock: 1 memory slice = 4864 MiB
    ("A100-40GB", 0, "7g.40gb", 40192),
    ("A100-80GB", 9, "3g.40gb", 40192),
    ("H100-80GB", 0, "7g.80gb", 81152),      # 79.25 GiB · 1024
    ("H100-80GB", 15, "1g.20gb", 20091),     # round(19.62 · 1024)
    ("H200-141GB", 9, "3g.71gb", 71168),     # 69.5 · 1024
    ("A30-24GB", 0, "4g.24gb", 24003),       # round(23.44 · 1024)
])
def test_mig_profile_names_and_memory(model: str, pid: int, name: str, memory_mib: int) -> None:
    profile = CAT.get(model).mig_profiles[pid]
    assert (profile.name, profile.memory_mib) == (name, memory_mib)


def test_a30_mig_geometry() -> None:
    a30 = CAT.get("A30")
    assert (a30.compute_slices, a30.memory_slices) == (4, 4)
    rows = {pid: (p.compute_slices, p.memory_slices, p.starts, p.max_count, p.media_extensions)
            for pid, p in a30.mig_profiles.items()}
    assert rows == {
        14: (1, 1, (0, 1, 2, 3), 4, False),
        21: (1, 1, (0, 1, 2, 3), 1, True),
        5: (2, 2, (0, 2), 2, False),
        6: (2, 2, (0, 2), 1, True),
        0: (4, 4, (0,), 1, False),
    }
    assert a30.mig_compute_milli(a30.mig_profiles[5]) == 500


def test_packages() -> None:
    half = CAT.package("A30", "half")
    assert (half.compute_milli, half.memory_mib) == (500, 12288)
    quarter = CAT.package("T4", "quarter")
    assert (quarter.compute_milli, quarter.memory_mib) == (250, 15360 // 4)
    with pytest.raises(CatalogError, match=r"A30-24GB has no vGPU package 'third'.*half, quarter"):
        CAT.package("A30", "third")


# ============================================================================ requests

REQUEST_ERRORS: list[tuple[str, Callable[[], object], str]] = [
    ("negative compute", lambda: Fraction(compute_milli=-1), "gpu.compute_milli"),
    ("negative gpu memory", lambda: Fraction(memory_mib=-5), "gpu.memory_mib"),
    ("negative pct", lambda: Fraction(memory_pct=-1), "gpu.memory_pct"),
    ("negative encoders", lambda: Fraction(encoders=-1), "gpu.encoders"),
    ("negative decoders", lambda: Fraction(decoders=-2), "gpu.decoders"),
    ("compute above a card", lambda: Fraction(compute_milli=1001), "gpu.compute_milli"),
    ("pct above 100", lambda: Fraction(memory_pct=101), "gpu.memory_pct"),
    ("pct and MiB", lambda: Fraction(memory_pct=50, memory_mib=100), "gpu.memory_pct"),
    ("empty fraction", lambda: Fraction(), "gpu"),
    ("zero whole cards", lambda: WholeCards(0), "gpu.count"),
    ("negative MIG profile", lambda: MigSlice(-1), "gpu.profile"),
    ("empty name", lambda: PodRequest(""), "name"),
    ("negative cpu", lambda: PodRequest("p", cpu_milli=-1), "cpu_milli"),
    ("negative memory", lambda: PodRequest("p", memory_mib=-1), "memory_mib"),
    ("negative rdma", lambda: PodRequest("p", rdma_vfs=-1), "rdma_vfs"),
    ("negative instance", lambda: PodRequest("p", instance=-1), "instance"),
    ("empty model set", lambda: PodRequest("p", models=frozenset()), "models"),
    ("unknown QoS", lambda: QoS.from_trace("premium"), "qos"),
    ("memory above the allowed card", lambda: make_request(
        CAT, "p", gpu=Fraction(memory_mib=15361), models={"T4"}), "gpu.memory_mib"),
    ("memory above every card", lambda: make_request(
        CAT, "p", gpu=Fraction(memory_mib=284209)), "gpu.memory_mib"),  # GB300: 284208 MiB
    ("MIG profile an allowed model lacks", lambda: make_request(
        CAT, "p", gpu=MigSlice(9), models={"A100-40GB", "T4"}), "gpu.profile"),
    ("MIG profile no model has", lambda: make_request(CAT, "p", gpu=MigSlice(99)), "gpu.profile"),
    ("MIG profile name no model has", lambda: make_request(CAT, "p", gpu=MigSlice("9g.99gb")), "gpu.profile"),
    ("unknown model", lambda: make_request(CAT, "p", gpu=WholeCards(1), models={"Z9"}), "models"),
    ("unknown package model", lambda: make_request(CAT, "p", package=("Z9", "half")), "package"),
    ("unknown package", lambda: make_request(CAT, "p", package=("A30", "third")), "package"),
    ("package and GPU form", lambda: make_request(
        CAT, "p", package=("A30", "half"), gpu=WholeCards(1)), "package"),
]


@pytest.mark.parametrize(("build", "field"), [(b, f) for _, b, f in REQUEST_ERRORS],
                         ids=[label for label, _, _ in REQUEST_ERRORS])
def test_request_errors_name_the_field(build: Callable[[], object], field: str) -> None:
    with pytest.raises(RequestError) as info:
        build()
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_request_error_messages_name_the_culprit() -> None:
    with pytest.raises(RequestError, match=r"exceeds the largest allowed card.*15360 MiB"):
        make_request(CAT, "p", gpu=Fraction(memory_mib=20000), models={"T4"})
    with pytest.raises(RequestError, match=r"MIG profile 9 does not exist on T4$"):
        make_request(CAT, "p", gpu=MigSlice(9), models={"A100-40GB", "T4"})


@pytest.mark.parametrize("build", [
    lambda: Fraction(compute_milli=1000),
    lambda: Fraction(memory_pct=100),
    lambda: Fraction(encoders=1),
    lambda: WholeCards(1),
    lambda: MigSlice(0),
    lambda: make_request(CAT, "p", gpu=Fraction(memory_mib=15360), models={"T4"}),
    lambda: make_request(CAT, "p", gpu=Fraction(memory_mib=143771)),
])
def test_request_boundaries_are_accepted(build: Callable[[], object]) -> None:
    build()


def test_make_request_package() -> None:
    request = make_request(CAT, "p", package=("A30", "half"))
    assert request.gpu == Fraction(compute_milli=500, memory_mib=12288, package="A30-24GB/half")
    assert request.models == frozenset({"A30-24GB"})
    assert request.gpu_milli_total == 500


def test_make_request_canonicalises_models_and_narrows_mig() -> None:
    assert make_request(CAT, "p", gpu=WholeCards(1), models={"V100M16", "A100"}).models == frozenset(
        {"V100-16GB", "A100-40GB"})
    assert make_request(CAT, "p", gpu=WholeCards(1)).models is None
    # No models named: a MIG request is narrowed to the models that offer the profile.
    assert make_request(CAT, "p", gpu=MigSlice(9)).models == frozenset(
        {"A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "B200-180GB"})
    assert make_request(CAT, "p", gpu=MigSlice(21)).models == frozenset({"A30-24GB"})
    assert make_request(CAT, "p", gpu=MigSlice("3g.20gb")).models == frozenset({"A100-40GB"})
    request = make_request(CAT, "p", cpu_milli=2000, memory_mib=4096, gpu=WholeCards(2), priority=7,
                           workload="w", instance=3)
    assert (request.cpu_milli, request.memory_mib, request.priority, request.workload, request.instance) == (
        2000, 4096, 7, "w", 3)


def test_gpu_milli_total_and_memory_on() -> None:
    assert pod("a").whole(3).obj().gpu_milli_total == 3000
    assert pod("b").fraction(250).obj().gpu_milli_total == 250
    assert pod("c").mig(9).obj().gpu_milli_total == 0
    assert pod("d").obj().gpu_milli_total == 0
    assert Fraction(memory_pct=25).memory_on(15360) == 3840
    assert Fraction(memory_pct=33).memory_on(100) == 33
    assert Fraction(memory_mib=700).memory_on(15360) == 700


@pytest.mark.parametrize(("value", "qos"), [
    ("LS", QoS.ONLINE), ("Guaranteed", QoS.ONLINE), ("Burstable", QoS.OFFLINE), ("BE", QoS.BEST_EFFORT),
    (" best-effort ", QoS.BEST_EFFORT), ("online", QoS.ONLINE),
])
def test_qos_from_trace(value: str, qos: QoS) -> None:
    assert QoS.from_trace(value) is qos


def test_tolerations() -> None:
    request = pod("p").tolerate("gpu", "a100").tolerate("spot").obj()
    assert request.tolerates("gpu", "a100")
    assert not request.tolerates("gpu", "t4")
    assert request.tolerates("spot", "anything")
    assert not request.tolerates("other", "x")


# ============================================================================ node specs

NODE_ERRORS: list[tuple[str, Callable[[], object], str]] = [
    ("empty name", lambda: NodeSpec("", 1000, 1000, None, 0), "name must not be empty"),
    ("negative cpu", lambda: NodeSpec("n", -1, 1000, None, 0), "cpu_milli must not be negative"),
    ("negative memory", lambda: NodeSpec("n", 1000, -1, None, 0), "memory_mib must not be negative"),
    ("negative gpus", lambda: NodeSpec("n", 1000, 1000, "T4", -1), "gpus must not be negative"),
    ("gpus without model", lambda: NodeSpec("n", 1000, 1000, None, 2), "has 2 GPUs but no GPU model"),
    ("topology too short", lambda: NodeSpec("n", 1, 1, "T4", 4, topology=Topology((0, 0), (0, 0))),
     "topology describes 2 cards, node has 4"),
    ("NVLink card out of range", lambda: NodeSpec("n", 1, 1, "T4", 2, topology=Topology(
        (0, 0), (0, 0), ((0, 2),))), "names card 2"),
    ("NVLink card twice", lambda: NodeSpec("n", 1, 1, "T4", 4, topology=Topology(
        (0, 0, 0, 0), (0, 0, 0, 0), ((0, 1), (1, 2)))), "names card 1"),
    ("negative NIC functions", lambda: RdmaNic("mlx0", 0, 0, -1), "NIC mlx0"),
    ("oversell below 1", lambda: PoolConfig(memory_oversell=0.5), "memory_oversell"),
    ("oversell above 16", lambda: PoolConfig(memory_oversell=17.0), "memory_oversell"),
]


@pytest.mark.parametrize(("build", "message"), [(b, m) for _, b, m in NODE_ERRORS],
                         ids=[label for label, _, _ in NODE_ERRORS])
def test_node_spec_errors(build: Callable[[], object], message: str) -> None:
    with pytest.raises(NodeSpecError, match=message):
        build()


def test_node_default_topology() -> None:
    spec = node("n").gpus(8).obj()
    assert spec.topology.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert spec.topology.pcie_switch == (0, 0, 1, 1, 2, 2, 3, 3)
    bare = NodeSpec("m", 1000, 1000, "T4", 3)
    assert bare.topology.numa == (0, 0, 1)
    assert bare.topology.pcie_switch == (0, 0, 1)
    linked = node("l").gpus(8).nvlink([[0, 1, 2, 3], [4, 5, 6, 7]]).obj()
    assert linked.topology.nvlink_group_of(5) == 1
    assert linked.topology.nvlink_group_of(0) == 0
    assert spec.topology.nvlink_group_of(0) == -1


def test_cluster_state_node_errors() -> None:
    state = cluster(node("n1").gpus(2, "T4").obj())
    with pytest.raises(NodeSpecError, match="added twice"):
        state.add_node(node("n1").obj())
    with pytest.raises(CatalogError, match="unknown GPU model"):
        state.add_node(node("n2").gpus(1, "Z9").obj())
    with pytest.raises(NodeSpecError, match="capacity changes"):
        state.update_node(node("n1").gpus(2, "T4").cpu(1).obj())


def test_node_model_alias_is_canonicalised() -> None:
    state = cluster(node("n1").gpus(2, "V100M16").obj())
    assert state.nodes[0].gpu_model == "V100-16GB"
    model = state.model_of(0)
    assert model is not None and model.name == "V100-16GB"
    assert state.card_mem_cap[0, 0] == 16160


def test_cluster_state_initial_arrays() -> None:
    state = cluster(node("a").gpus(2, "T4").cpu(8000).mem(1000).obj(), node("b").gpus(4).obj(),
                    node("c").cpu(4000).obj())
    assert state.size == 3 and state.width >= 4
    assert state.view("cpu_free").tolist() == [8000, 64000, 4000]
    assert state.view("idle_cards").tolist() == [2, 4, 0]
    assert state.card_valid[:3].sum(axis=1).tolist() == [2, 4, 0]
    assert state.view("gpu_milli_cap").tolist() == [2000, 4000, 0]
    assert state.total_gpu_milli() == 6000 and state.used_gpu_milli() == 0
    assert state.model_of(2) is None
    assert state.card_enc_cap[0, :2].tolist() == [1, 1]
    assert state.card_dec_cap[1, :4].tolist() == [5, 5, 5, 5]
    assert state.check_invariants() == []


# ============================================================================ place / release / check

def test_whole_cards_place_and_release() -> None:
    state = cluster(node("n").gpus(4).obj())
    before = state.fingerprint()
    a = pod("a").cpu(1000).mem(2048).whole(2).obj()
    binding = state.place(a, whole("n", 0, 1, state=state))
    assert binding.node == 0
    assert state.idle_cards[0] == 2
    assert state.card_milli_free[0, :4].tolist() == [0, 0, 1000, 1000]
    assert state.card_mem_free[0, :2].tolist() == [0, 0]
    assert state.card_dec_free[0, :2].tolist() == [0, 0]
    assert (state.cpu_free[0], state.mem_free[0]) == (63000, 262144 - 2048)
    assert state.used_gpu_milli() == 2000
    assert sorted(state.card_used_milli().tolist()) == [0, 0, 1000, 1000]
    assert state.check(whole("n", 1, state=state), pod("b").whole(1).obj()) == "card 1 is not idle"
    assert state.check(frac("n", 0, 1), frac_pod("c", 1)) == "card 0 is held whole by another pod"
    assert state.check(mig("n", 0, 19, 0), mig_pod("d", 19)) == "card 0 has non-MIG holders"
    assert state.check_invariants() == []
    state.release("a")
    assert state.fingerprint() == before
    assert state.bindings == {}


def test_fractions_share_a_card() -> None:
    state = cluster(node("n").gpus(2).obj())
    state.place(frac_pod("a", 500), frac("n", 0, 500, 10000))
    assert state.idle_cards[0] == 1
    assert state.check(frac("n", 0, 600), frac_pod("b", 600)) == "card 0 lacks capacity"
    assert state.check(frac("n", 0, 500, 30961), frac_pod("b", 500)) == "card 0 lacks capacity"
    assert state.check(frac("n", 0, 500, 30960), frac_pod("b", 500)) is None
    state.place(frac_pod("b", 500), frac("n", 0, 500, 30960))
    assert (state.card_milli_free[0, 0], state.card_mem_free[0, 0], state.card_holders[0, 0]) == (0, 0, 2)
    assert state.check(whole("n", 0, state=state), pod("c").whole(1).obj()) == "card 0 is not idle"
    state.release("a")
    assert state.idle_cards[0] == 1
    state.release("b")
    assert state.idle_cards[0] == 2
    assert state.check_invariants() == []


def test_codec_accounting() -> None:
    state = cluster(node("n").gpus(1, "T4").obj())
    state.place(pod("a").fraction(enc=1).obj(), frac("n", 0, 0, enc=1))
    assert (state.card_enc_free[0, 0], state.card_dec_free[0, 0]) == (0, 2)
    assert state.check(frac("n", 0, 0, enc=1), pod("b").fraction(enc=1).obj()) == "card 0 lacks capacity"
    assert state.check(frac("n", 0, 0, dec=2), pod("b").fraction(dec=2).obj()) is None
    state.place(pod("b").fraction(dec=2).obj(), frac("n", 0, 0, dec=2))
    assert state.check(frac("n", 0, 0, dec=1), pod("c").fraction(dec=1).obj()) == "card 0 lacks capacity"
    state.release("a")
    assert state.card_enc_free[0, 0] == 1
    assert state.check_invariants() == []


@pytest.mark.parametrize(("assignment", "request_", "reason"), [
    (Assignment("zz"), pod("x").obj(), "node zz does not exist"),
    (Assignment("n"), pod("x").cpu(64001).obj(), "insufficient cpu"),
    (Assignment("n"), pod("x").mem(262145).obj(), "insufficient memory"),
    (frac("n", 2, 100), frac_pod("x"), "card 2 does not exist on n or is named twice"),
    (frac("n", -1, 100), frac_pod("x"), "card -1 does not exist on n or is named twice"),
    # Only a whole-card request takes more than one share, so a card named twice needs one.
    (Assignment("n", (A100_WHOLE_0, A100_WHOLE_0)), pod("x").whole(2).obj(),
     "card 0 does not exist on n or is named twice"),
    (frac("n", 0, 100), pod("x").fraction(100).models("T4").obj(), "GPU model mismatch"),
    (frac("n", 0, 0, 40961), pod("x").fraction(mem=40961).obj(), "card 0 lacks capacity"),
    (frac("n", 0, 0, enc=1), pod("x").fraction(enc=1).obj(), "card 0 lacks capacity"),  # A100: no NVENC
    (Assignment("n", rdma=RdmaShare(0, 1, RdmaLocality.REMOTE)), pod("x").rdma(1).obj(),
     "insufficient RDMA virtual functions"),
    # The assignment must answer the request's form and RDMA ask (`_form_mismatch`).
    (Assignment("n"), pod("x").rdma(1).obj(), "assignment's RDMA functions differ from the request"),
    (Assignment("n", rdma=RdmaShare(0, 1, RdmaLocality.REMOTE)), pod("x").obj(),
     "assignment's RDMA functions differ from the request"),
    (Assignment("n", rdma=RdmaShare(0, 1, RdmaLocality.REMOTE)), pod("x").rdma(2).obj(),
     "assignment's RDMA functions differ from the request"),
    (frac("n", 0, 100), pod("x").obj(), "a CPU-only pod was given cards"),
    (Assignment("n", (A100_WHOLE_0,)), pod("x").whole(2).obj(), "assignment does not hold 2 whole card(s)"),
    (Assignment("n"), pod("x").whole(1).obj(), "assignment does not hold 1 whole card(s)"),
    (frac("n", 0, 1000, 40960, dec=5), pod("x").whole(1).obj(), "assignment does not hold 1 whole card(s)"),
    (Assignment("n", (CardShare(0, 500, 40960, 0, 5, whole=True),)), pod("x").whole(1).obj(),
     "assignment does not hold 1 whole card(s)"),
    (Assignment("n"), frac_pod("x"), "a fraction or MIG slice takes exactly one card"),
    (Assignment("n", (CardShare(0, 100, 0), CardShare(1, 100, 0))), frac_pod("x"),
     "a fraction or MIG slice takes exactly one card"),
    (Assignment("n", mig("n", 0, 19, 0).cards + mig("n", 1, 19, 0).cards), mig_pod("x", 19),
     "a fraction or MIG slice takes exactly one card"),
    (mig("n", 0, 19, 0), mig_pod("x", 9), "assignment does not hold MIG profile 9"),
    (mig("n", 0, 19, 0), pod("x").mig("3g.20gb").obj(), "assignment does not hold MIG profile '3g.20gb'"),
    (frac("n", 0, 428, 19968), mig_pod("x", 9), "assignment does not hold MIG profile 9"),
    (frac("n", 0, 200), frac_pod("x"), "assignment does not match the requested fraction"),
    (Assignment("n", (CardShare(0, 100, 0, whole=True),)), frac_pod("x"),
     "assignment does not match the requested fraction"),
    (Assignment("n", (replace(mig("n", 0, 19, 0).cards[0], compute_milli=100),)), frac_pod("x"),
     "assignment does not match the requested fraction"),
    (frac("n", 0, 100, dec=1), frac_pod("x"), "assignment does not match the requested fraction"),
    (frac("n", 0, 100, enc=1), pod("x").fraction(100, dec=1).obj(), "assignment does not match the requested fraction"),
    (frac("n", 0, 100, 999), pod("x").fraction(100, mem=1000).obj(),
     "assignment does not match the requested GPU memory"),
])
def test_check_reasons(assignment: Assignment, request_: PodRequest, reason: str) -> None:
    state = cluster(node("n").gpus(2).obj())
    assert state.check(assignment, request_) == reason
    with pytest.raises(PlacementError, match=f"cannot place x on {assignment.node}: "):
        state.place(request_, assignment)
    assert state.bindings == {}
    assert state.check_invariants() == []


def test_compute_beyond_free_lacks_capacity() -> None:
    # A fraction asks at most one card's compute, so compute runs short only on a card already shared.
    state = cluster(node("n").gpus(2).obj())
    state.place(frac_pod("busy", 1), frac("n", 0, 1))
    x = frac_pod("x", 1000)
    assert state.check(frac("n", 0, 1000), x) == "card 0 lacks capacity"
    with pytest.raises(PlacementError, match="cannot place x on n: card 0 lacks capacity"):
        state.place(x, frac("n", 0, 1000))
    assert list(state.bindings) == ["busy"]
    assert state.check(frac("n", 1, 1000), x) is None
    assert state.check_invariants() == []


def test_place_twice_and_release_unknown() -> None:
    state = cluster(node("n").gpus(2).obj())
    a = frac_pod("a")
    state.place(a, frac("n", 0, 100))
    assert state.check(frac("n", 1, 100), a) == "pod a is already placed"
    with pytest.raises(KeyError):
        state.release("nobody")
    state.release("a")
    with pytest.raises(KeyError):
        state.release("a")


def test_cpu_only_pod_on_cpu_only_node() -> None:
    state = cluster(node("c").cpu(4000).mem(8192).obj())
    state.place(pod("a").cpu(4000).mem(8192).obj(), Assignment("c"))
    assert (state.cpu_free[0], state.mem_free[0]) == (0, 0)
    assert state.check(Assignment("c"), pod("b").cpu(1).obj()) == "insufficient cpu"
    assert state.check(frac("c", 0, 100), frac_pod("b")) == "card 0 does not exist on c or is named twice"
    assert state.check_invariants() == []


# ---------------------------------------------------------------------------- MIG

def test_mig_legal_start_and_overlap() -> None:
    state = cluster(node("n").gpus(1).obj())
    assert state.check(mig("n", 0, 9, 2), mig_pod("a", 9)) == "start 2 is not legal for profile 3g.20gb"
    state.place(mig_pod("a", 9), mig("n", 0, 9, 0))
    assert state.card_mig_slots[0, 0] == 0b00001111
    assert state.card_mig_compute[0, 0] == 3
    assert state.check(mig("n", 0, 14, 2), mig_pod("b", 14)) == "memory slices of card 0 overlap"
    assert state.check(mig("n", 0, 19, 3), mig_pod("b", 19)) == "memory slices of card 0 overlap"
    assert state.check(mig("n", 0, 9, 4), mig_pod("b", 9)) is None
    state.place(mig_pod("b", 9), mig("n", 0, 9, 4))
    # Two 3g instances use 6 of 7 compute slices and all 8 memory slices.
    assert state.card_mig_slots[0, 0] == 0xFF and state.card_mig_compute[0, 0] == 6
    assert state.mig_fits(0, 0, CAT.get("A100-40GB").mig_profiles[19]) == []
    assert state.card_milli_free[0, 0] == 1000 - 2 * 428
    assert state.card_mem_free[0, 0] == 40960 - 2 * 19968
    assert state.check_invariants() == []


def test_mig_fits_lists_free_legal_starts() -> None:
    state = cluster(node("n").gpus(1).obj())
    profiles = CAT.get("A100-40GB").mig_profiles
    assert state.mig_fits(0, 0, profiles[9]) == [0, 4]
    assert state.mig_fits(0, 0, profiles[19]) == [0, 1, 2, 3, 4, 5, 6]
    state.place(mig_pod("a", 14), mig("n", 0, 14, 2))
    assert state.mig_fits(0, 0, profiles[9]) == [4]
    assert state.mig_fits(0, 0, profiles[15]) == [0, 4, 6]
    assert state.mig_fits(0, 0, profiles[5]) == []
    assert state.mig_fits(0, 0, profiles[0]) == []


def test_mig_media_extensions_at_most_once() -> None:
    state = cluster(node("n").gpus(1).obj())
    state.place(mig_pod("a", 20), mig("n", 0, 20, 0))
    assert state.card_mig_me[0, 0]
    assert state.check(mig("n", 0, 20, 3), mig_pod("b", 20)) == "card 0 already has a +me instance"
    assert state.mig_fits(0, 0, CAT.get("A100-40GB").mig_profiles[20]) == []
    assert state.check(mig("n", 0, 19, 3), mig_pod("b", 19)) is None
    state.place(mig_pod("b", 19), mig("n", 0, 19, 3))
    state.release("a")
    assert not state.card_mig_me[0, 0]
    assert state.mig_fits(0, 0, CAT.get("A100-40GB").mig_profiles[20]) == [0, 1, 2, 4, 5, 6]


def test_a30_two_different_me_profiles_refused() -> None:
    # A30 has two +me profiles (21: 1g+me, 6: 2g+me); media extensions exist at most once per GPU.
    state = cluster(node("n").gpus(1, "A30").obj())
    state.place(mig_pod("a", 21), mig("n", 0, 21, 0, model="A30-24GB"))
    assert state.check(mig("n", 0, 6, 2, model="A30-24GB"), mig_pod("b", 6)) == "card 0 already has a +me instance"
    assert state.mig_fits(0, 0, CAT.get("A30").mig_profiles[6]) == []
    assert state.check(mig("n", 0, 5, 2, model="A30-24GB"), mig_pod("b", 5)) is None


def test_dynamic_mig_mode_enters_and_leaves() -> None:
    state = cluster(node("n").gpus(2).obj())
    before = state.fingerprint()
    assert not state.card_mig[0, 0] and state.idle_cards[0] == 2
    state.place(mig_pod("a", 19), mig("n", 0, 19, 0))
    assert state.card_mig[0, 0] and state.idle_cards[0] == 1
    state.place(mig_pod("b", 19), mig("n", 0, 19, 1))
    assert [i.pod for i in state.mig_instances[(0, 0)]] == ["a", "b"]
    # A card in MIG mode takes neither fractions nor whole-card pods.
    assert state.check(frac("n", 0, 100), frac_pod("c")) == "card 0 is in MIG mode"
    assert state.check(whole("n", 0, state=state), pod("c").whole(1).obj()) == "card 0 is in MIG mode"
    state.release("a")
    assert state.card_mig[0, 0] and state.idle_cards[0] == 1
    state.release("b")
    assert not state.card_mig[0, 0] and state.idle_cards[0] == 2
    assert (0, 0) not in state.mig_instances
    assert state.fingerprint() == before
    # Out of MIG mode again: a fraction fits, after which MIG is refused.
    state.place(frac_pod("c"), frac("n", 0, 100))
    assert state.check(mig("n", 0, 19, 0), mig_pod("d", 19)) == "card 0 has non-MIG holders"
    assert state.mig_fits(0, 0, CAT.get("A100-40GB").mig_profiles[19]) == []
    assert state.check_invariants() == []


def test_mig_mode_on_and_off() -> None:
    state = cluster(node("on").gpus(2, "H100").mig(MigMode.ON).obj(),
                    node("off").gpus(2).mig(MigMode.OFF).obj(),
                    node("t4").gpus(1, "T4").obj())
    assert state.card_mig[0, :2].all() and state.idle_cards[0] == 0
    assert state.check(frac("on", 0, 100), frac_pod("x")) == "card 0 is in MIG mode"
    state.place(mig_pod("a", 9), mig("on", 0, 9, 4, model="H100-80GB"))
    assert state.idle_cards[0] == 0
    state.release("a")
    assert state.card_mig[0, 0] and state.idle_cards[0] == 0
    assert state.check(mig("off", 0, 9, 0), mig_pod("b", 9)) == "card 0 does not take MIG instances"
    assert state.mig_fits(1, 0, CAT.get("A100-40GB").mig_profiles[9]) == []
    # A model without the profile cannot answer the request at all: the form check names model and profile.
    assert state.check(mig("t4", 0, 9, 0), mig_pod("b", 9)) == "GPU model T4 has no MIG profile 9"
    h100_3g = CAT.get("H100-80GB").mig_profiles[9]
    no_start = Assignment("on", (CardShare(0, 428, h100_3g.memory_mib, mig_profile=9),))  # 3 of 7 slices → 428
    assert state.check(no_start, mig_pod("b", 9)) == "card 0 has no MIG profile 9"
    assert state.check_invariants() == []


# ---------------------------------------------------------------------------- pools, RDMA, copies

def test_oversell_pool_doubles_card_memory() -> None:
    pools = {"dev": PoolConfig(memory_oversell=2.0)}
    state = cluster(node("d").gpus(2).pool("dev").obj(), node("p").gpus(2).obj(), pools=pools)
    assert state.card_mem_cap[0, :2].tolist() == [81920, 81920]
    assert state.card_mem_phys[0, :2].tolist() == [40960, 40960]
    assert state.card_mem_cap[1, :2].tolist() == [40960, 40960]
    state.place(frac_pod("a", 300), frac("d", 0, 300, 40000))
    assert state.check(frac("d", 0, 300, 41920), frac_pod("b", 300)) is None
    assert state.check(frac("d", 0, 300, 41921), frac_pod("b", 300)) == "card 0 lacks capacity"
    state.place(frac_pod("b", 300), frac("d", 0, 300, 41920))
    assert state.card_mem_free[0, 0] == 0
    assert state.check_invariants() == []


def test_pool_change_moves_capacity() -> None:
    state = cluster(node("n").gpus(1).obj(), pools={"dev": PoolConfig(memory_oversell=2.0)})
    state.place(frac_pod("a", 100), frac("n", 0, 100, 10000))
    state.update_node(node("n").gpus(1).pool("dev").obj())
    assert (state.card_mem_cap[0, 0], state.card_mem_free[0, 0]) == (81920, 71920)
    state.release("a")
    assert state.card_mem_free[0, 0] == 81920
    state.update_node(node("n").gpus(1).unschedulable().obj())
    assert (state.card_mem_cap[0, 0], state.schedulable[0]) == (40960, False)
    assert state.check_invariants() == []


def test_card_held_whole_rejects_every_other_share() -> None:
    state = cluster(node("n").gpus(2).obj())
    state.place(pod("a").whole(1).obj(), whole("n", 0, state=state))
    memory_only = pod("b").fraction(mem=1000).obj()
    assert state.check(frac("n", 0, 0, 1000), memory_only) == "card 0 is held whole by another pod"
    assert state.check(frac("n", 0, 0, dec=1), pod("b").fraction(dec=1).obj()) == (
        "card 0 is held whole by another pod")
    assert state.check(frac("n", 1, 0, 1000), memory_only) is None
    assert state.check_invariants() == []


def test_whole_card_stays_taken_when_oversell_rises() -> None:
    state = cluster(node("n").gpus(2).obj(), pools={"dev": PoolConfig(memory_oversell=2.0)})
    state.place(pod("a").whole(1).obj(), whole("n", 0, state=state))
    state.update_node(node("n").gpus(2).pool("dev").obj())
    assert state.card_mem_cap[0, :2].tolist() == [81920, 81920]
    assert state.card_mem_free[0, :2].tolist() == [0, 81920]
    # The raised capacity of a card held whole is not up for grabs, not even by a memory-only fraction.
    memory_only = pod("b").fraction(mem=1000).obj()
    assert state.check(frac("n", 0, 0, 1000), memory_only) == "card 0 is held whole by another pod"
    assert state.check(frac("n", 1, 0, 1000), memory_only) is None
    assert state.check_invariants() == []
    # Release after the change gives back the new capacity, not the memory the share was placed with.
    state.release("a")
    assert (state.card_mem_cap[0, 0], state.card_mem_free[0, 0]) == (81920, 81920)
    assert state.idle_cards[0] == 2
    assert state.check(frac("n", 0, 0, 1000), memory_only) is None
    assert state.check_invariants() == []


def test_whole_card_stays_taken_when_oversell_falls() -> None:
    state = cluster(node("n").gpus(1).pool("dev").obj(), pools={"dev": PoolConfig(memory_oversell=2.0)})
    state.place(pod("a").whole(1).obj(), whole("n", 0, state=state))
    assert state.bindings["a"].assignment.cards[0].memory_mib == 81920
    # A card held whole promises no fractional memory, so shrinking its pool is allowed.
    state.update_node(node("n").gpus(1).obj())
    assert (state.card_mem_cap[0, 0], state.card_mem_free[0, 0]) == (40960, 0)
    assert state.check_invariants() == []
    state.release("a")
    assert (state.card_mem_cap[0, 0], state.card_mem_free[0, 0]) == (40960, 40960)
    assert state.check_invariants() == []


def test_pool_change_below_promised_memory_is_refused() -> None:
    pools = {"dev": PoolConfig(memory_oversell=2.0), "mid": PoolConfig(memory_oversell=1.5)}
    spec = node("n").gpus(2).pool("dev").obj()
    state = cluster(spec, pools=pools)
    state.place(frac_pod("a", 100), frac("n", 0, 100))
    state.place(pod("b").fraction(100, mem=70000).obj(), frac("n", 1, 100, 70000))
    before = state.fingerprint()
    with pytest.raises(NodeSpecError, match=r"^node n: pool 'mid' would leave card 1 70000 MiB promised "
                                            r"on 61440 MiB$"):
        state.update_node(node("n").gpus(2).pool("mid").unschedulable().taint("k").obj())
    assert state.nodes[0] == spec
    assert state.fingerprint() == before
    assert state.card_mem_cap[0, :2].tolist() == [81920, 81920]
    assert state.card_mem_free[0, :2].tolist() == [81920, 11920]
    assert state.schedulable[0] and not state.tainted
    with pytest.raises(NodeSpecError, match="would leave card 1 70000 MiB promised on 40960 MiB"):
        state.update_node(node("n").gpus(2).obj())
    assert state.nodes[0] == spec and state.fingerprint() == before
    # Once the promise fits, the same change goes through and keeps what is promised.
    state.release("b")
    state.place(pod("c").fraction(100, mem=30000).obj(), frac("n", 1, 100, 30000))
    state.update_node(node("n").gpus(2).pool("mid").obj())
    assert state.nodes[0].pool == "mid"
    assert state.card_mem_cap[0, :2].tolist() == [61440, 61440]
    assert state.card_mem_free[0, :2].tolist() == [61440, 31440]
    assert state.check_invariants() == []


def test_rdma_accounting() -> None:
    spec = node("n").gpus(2).nic("mlx0", switch=0, numa=0, vfs=4).nic("mlx1", switch=1, numa=1, vfs=2).obj()
    state = cluster(spec)
    before = state.fingerprint()
    assert state.nic_free == [[4, 2]] and state.rdma_max_free[0] == 4
    a = pod("a").rdma(3).obj()
    state.place(a, Assignment("n", rdma=RdmaShare(0, 3, RdmaLocality.PCIE_SWITCH)))
    assert state.nic_free == [[1, 2]] and state.rdma_max_free[0] == 2
    two = pod("b").rdma(2).obj()
    assert state.check(Assignment("n", rdma=RdmaShare(0, 2, RdmaLocality.NUMA)), two) == (
        "insufficient RDMA virtual functions")
    assert state.check(Assignment("n", rdma=RdmaShare(2, 2, RdmaLocality.NUMA)), two) == (
        "insufficient RDMA virtual functions")
    assert state.check(Assignment("n", rdma=RdmaShare(1, 2, RdmaLocality.NUMA)), two) is None
    state.release("a")
    assert state.nic_free == [[4, 2]]
    assert state.fingerprint() == before


def test_copy_is_independent() -> None:
    spec = node("n").gpus(2).nic("mlx0", switch=0, numa=0, vfs=4).obj()
    state = cluster(spec)
    state.place(pod("a").mig(19).workload("w").rdma(1).obj(), Assignment(
        "n", mig("n", 0, 19, 0).cards, RdmaShare(0, 1, RdmaLocality.PCIE_SWITCH)))
    before = state.fingerprint()
    clone = state.copy()
    assert clone.fingerprint() == before
    clone.place(pod("b").mig(19).workload("w").rdma(2).cpu(100).obj(), Assignment(
        "n", mig("n", 0, 19, 1).cards, RdmaShare(0, 2, RdmaLocality.PCIE_SWITCH)))
    clone.release("a")
    clone.add_node(node("m").gpus(1, "T4").obj())
    assert state.fingerprint() == before
    assert list(state.bindings) == ["a"]
    assert [i.pod for i in state.mig_instances[(0, 0)]] == ["a"]
    assert state.workload_cards == {"w": {(0, 0): 1}}
    assert state.nic_free == [[3]]
    assert state.size == 1 and "m" not in state.node_index
    assert clone.size == 2 and [i.pod for i in clone.mig_instances[(0, 0)]] == ["b"]
    assert clone.check_invariants() == [] and state.check_invariants() == []


def test_workload_cards_tracking() -> None:
    state = cluster(node("n").gpus(2).obj())
    state.place(pod("a").fraction(100).workload("w", 0).obj(), frac("n", 0, 100))
    state.place(pod("b").fraction(100).workload("w", 1).obj(), frac("n", 0, 100))
    state.place(pod("c").whole(1).workload("w", 2).obj(), whole("n", 1, state=state))
    assert state.workload_cards == {"w": {(0, 0): 2, (0, 1): 1}}
    state.release("a")
    state.release("c")
    assert state.workload_cards == {"w": {(0, 0): 1}}
    state.release("b")
    assert state.workload_cards == {}


def test_check_invariants_detects_corruption() -> None:
    state = cluster(node("n").gpus(2).obj())
    state.place(mig_pod("a", 19), mig("n", 0, 19, 0))
    assert state.check_invariants() == []
    broken = state.copy()
    broken.cpu_free[0] = -1
    assert "node cpu out of range" in broken.check_invariants()
    broken = state.copy()
    broken.card_mem_free[0, 1] = 40961
    assert "card gpu memory out of range" in broken.check_invariants()
    broken = state.copy()
    broken.idle_cards[0] = 2
    assert "idle card counts out of sync" in broken.check_invariants()
    broken = state.copy()
    broken.card_mig[0, 0] = False
    problems = broken.check_invariants()
    assert "card 0/0: MIG instances on a card not in MIG mode" in problems
    assert "card 0/0: MIG and non-MIG holders mixed" in problems


def test_model_allowed_and_masks() -> None:
    state = cluster(node("a").gpus(1, "T4").pool("dev").taint("spot", "yes").obj(), node("b").gpus(1).obj())
    allowed = state.model_allowed(frozenset({"T4"}))
    assert allowed[state.view("model_idx")].tolist() == [True, False]
    assert allowed[-1] == np.False_  # the CPU-only sentinel (model index -1)
    assert state.model_allowed(None)[state.view("model_idx")].tolist() == [True, True]
    assert state.pools_mask(frozenset({"dev"})).tolist() == [True, False]
    mask = state.taint_mask(pod("p").obj())
    assert mask is not None and mask.tolist() == [False, True]
    mask = state.taint_mask(pod("p").tolerate("spot").obj())
    assert mask is not None and mask.tolist() == [True, True]
    assert cluster(node("c").obj()).taint_mask(pod("p").obj()) is None


# ============================================================================ offline compute oversell

def _oversold_state() -> ClusterState:
    """Node "co" in a pool with an offline compute budget, node "plain" without (one card each)."""
    pools = {"co": PoolConfig(offline_compute_oversell=True)}
    return cluster(node("co").gpus(1).pool("co").obj(), node("plain").gpus(1).obj(), pools=pools)


def _offline(name: str, milli: int) -> PodRequest:
    return pod(name).fraction(milli).qos(QoS.OFFLINE).obj()


@pytest.mark.parametrize(("node_name", "online_milli", "offline_held", "ask", "reason"), [
    # online holds the whole card's compute (1000); the offline budget is a second 1000 on "co" only
    ("co", 1000, 0, 300, None),
    ("co", 1000, 0, 1000, None),
    ("co", 1000, 700, 300, None),  # 1000 - 700 = 300 of the offline budget left
    ("co", 1000, 700, 301, "card 0 lacks capacity"),
    ("plain", 1000, 0, 300, "card 0 lacks capacity"),  # no budget of its own: 1000 - 1000 < 300
    ("plain", 400, 300, 300, None),  # 1000 - 400 - 300 = 300 fits exactly
    ("plain", 400, 300, 301, "card 0 lacks capacity"),
])
def test_offline_shares_count_against_their_own_budget(node_name: str, online_milli: int, offline_held: int,
                                                       ask: int, reason: str | None) -> None:
    state = _oversold_state()
    state.place(frac_pod("online", online_milli), frac(node_name, 0, online_milli))
    if offline_held:
        state.place(_offline("held", offline_held), frac(node_name, 0, offline_held))
    assert state.check(frac(node_name, 0, ask), _offline("off", ask)) == reason
    assert state.check_invariants() == []


def test_oversold_offline_share_leaves_online_compute_and_releases_exactly() -> None:
    state = _oversold_state()
    before = state.fingerprint()
    state.place(_offline("off", 600), frac("co", 0, 600, 8000))
    # the online compute is untouched (1000 free, no node milli used); the offline budget has 1000 - 600 = 400
    assert (state.card_milli_free[0, 0], state.card_offline_free[0, 0], state.gpu_milli_used[0]) == (1000, 400, 0)
    assert state.bindings["off"].oversold
    assert state.check(frac("co", 0, 1000, 8000), frac_pod("online", 1000)) is None  # online still gets it all
    # an online pod sees card_milli_free, an offline pod the offline budget
    assert state.milli_free_for(frac_pod("x"), 0).tolist()[:1] == [1000]
    assert state.milli_free_for(_offline("x", 1), 0).tolist()[:1] == [400]
    assert state.milli_free_for(_offline("x", 1), 1).tolist()[:1] == [1000]  # "plain": card_milli_free
    # a whole card is never oversold: the offline holder keeps it from being idle
    assert state.check(whole("co", 0, state=state), pod("w").whole(1).obj()) == "card 0 is not idle"
    state.release("off")
    assert state.fingerprint() == before


def test_pool_change_keeps_what_an_oversold_share_holds() -> None:
    """A node that leaves the oversold pool (tidal lending) keeps its oversold offline pods on the budget
    they were placed on; new offline pods there count against card_milli_free."""
    state = _oversold_state()
    state.place(frac_pod("online", 800), frac("co", 0, 800))
    state.place(_offline("off", 500), frac("co", 0, 500))
    state.update_node(node("co").gpus(1).obj())  # the default pool: no offline budget
    assert state.check(frac("co", 0, 300), _offline("late", 300)) == "card 0 lacks capacity"  # 1000 - 800 = 200
    assert state.check(frac("co", 0, 200), _offline("late", 200)) is None
    state.release("off")
    assert (state.card_milli_free[0, 0], state.card_offline_free[0, 0]) == (200, 1000)
    assert state.check_invariants() == []
