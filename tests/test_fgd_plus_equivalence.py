"""The fast FGD scoring decides exactly as the one it replaced, card for card.

Two checks:
1. Recorded decisions: `tests/fixtures/fgd-plus-placements.csv.gz` holds every decision of fgd-plus fill
   replays of the three bundled traces (seed 42), recorded by `scripts/record-fgd-plus-placements.py` at
   e8f0329, before the scoring was made fast. The replays now must give the same node and cards, row by row.
2. Old against new: `reference_compute` is the scoring as it was at e8f0329 (F(M) before and after every
   card of every changed node, through `frag.fragmentation`). The same replays run with it patched in and
   with the shipped code, for every FGD variant (fgd, fgd-online, fgd-used, fgd-plus) on a cut of the
   bundled cluster, and on a mixed cluster the bundled traces do not exercise: shares on two cards, shares
   that ask memory, MIG nodes, model constraints, CPU-only pods.
"""

from __future__ import annotations

import csv
import gzip
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from builders import cluster, node, pod
from gpuplane.model import (
    MILLI_PER_CARD,
    Assignment,
    CardShare,
    ClusterState,
    Fraction,
    MigMode,
    NodeSpec,
    PodRequest,
    WholeCards,
    default_catalog,
)
from gpuplane.scheduler import CycleState, Framework, PolicyConfig, default_registry
from gpuplane.scheduler.framework import BoolArray, IntArray
from gpuplane.scheduler.plugins import fgd
from gpuplane.scheduler.plugins.fgd import FGD_CARD, FgdScore
from gpuplane.scheduler.plugins.fgd_plus import FgdPlusScore
from gpuplane.scheduler.plugins.frag import ShapeArrays, TypicalPods, fragmentation, sigmoid_score
from gpuplane.sim import bundled_path, load_nodes, load_pods
from gpuplane.sim.replay import run_fill

FIXTURE = Path(__file__).parent / "fixtures" / "fgd-plus-placements.csv.gz"


def reference_compute(self: FgdScore, pod: PodRequest, state: ClusterState, nodes: IntArray, shapes: ShapeArrays,
                      card_ok: BoolArray | None = None) -> tuple[IntArray, IntArray]:
    """`FgdScore._compute` as it was at e8f0329, unchanged."""
    scale = self.delta_scale
    usable = state.card_valid[nodes] & ~state.card_mig[nodes]
    free = np.where(usable, state.card_milli_free[nodes], 0)
    cpu = state.cpu_free[nodes]
    model = state.model_idx[nodes]
    before = fragmentation(free, cpu, model, shapes)
    cpu_after = cpu - pod.cpu_milli
    gpu = pod.gpu
    none = np.full(len(nodes), -1, np.int64)
    if isinstance(gpu, Fraction):
        d = gpu.compute_milli
        width = free.shape[1]
        fits = usable & (free >= d)
        if card_ok is not None:
            fits &= card_ok
        elif gpu.memory_mib:
            fits &= state.card_mem_free[nodes] >= gpu.memory_mib
        after_free = free[:, None, :] - d * np.eye(width, dtype=np.int64)[None]
        after = fragmentation(after_free, np.repeat(cpu_after[:, None], width, axis=1),
                              np.repeat(model[:, None], width, axis=1), shapes)
        per_card = np.where(fits, sigmoid_score(before[:, None] - after, scale), -1)
        if gpu.count > 1:
            best = np.argsort(-per_card, axis=1, kind="stable")[:, : gpu.count]
            taken = np.zeros(free.shape, np.bool_)
            np.put_along_axis(taken, best, True, axis=1)
            taken &= fits
            after_node = fragmentation(free - d * taken, cpu_after, model, shapes)
            return sigmoid_score(before - after_node, scale), none
        card = np.argmax(per_card, axis=1)
        return per_card[np.arange(len(nodes)), card], card.astype(np.int64)
    if isinstance(gpu, WholeCards):
        idle = usable & (free == MILLI_PER_CARD) & (state.card_holders[nodes] == 0)
        taken = idle & (np.cumsum(idle, axis=1) <= gpu.count)
        after = fragmentation(np.where(taken, 0, free), cpu_after, model, shapes)
        return sigmoid_score(before - after, scale), none
    if gpu is None and not pod.cpu_milli:
        return np.full(len(nodes), 100, np.int64), none
    after = fragmentation(free, cpu_after, model, shapes)
    return sigmoid_score(before - after, scale), none


Decisions = list[tuple[str, str, str]]
"""(pod, node or "" if it failed, cards joined by "+") per decision, in order."""


def replay(nodes: Sequence[NodeSpec], pods: Sequence[PodRequest], policy: str, seed: int = 42) -> Decisions:
    profile = default_registry().build(PolicyConfig(node_policy=policy, typical=TypicalPods.from_workload(pods),
                                                    seed=seed))
    result = run_fill(default_catalog(), nodes, pods, profile, seed=seed, record_placements=True)
    return [(p.request.name, p.node if p.outcome == "placed" else "", "+".join(map(str, p.cards)))
            for p in result.placements]


def first_difference(got: Decisions, want: Decisions) -> str:
    for seq, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"decision {seq}: got {a}, want {b}"
    return f"{len(got)} decisions, want {len(want)}"


def bundled(trace: str) -> tuple[list[NodeSpec], list[PodRequest]]:
    catalog = default_catalog()
    return load_nodes(bundled_path("nodes"), catalog), [p.request for p in load_pods(bundled_path(trace), catalog)]


# ============================================================================ 1. recorded decisions

def recorded(trace: str, seed: int) -> list[tuple[str, str]]:
    with gzip.open(FIXTURE, "rt", newline="") as text:
        return [(row["node"], row["cards"]) for row in csv.DictReader(text)
                if (row["trace"], int(row["seed"])) == (trace, seed)]


@pytest.mark.parametrize("trace", ["default", "gpushare40", "gpushare100"])
def test_fgd_plus_decides_as_recorded_before_the_speed_work(trace: str) -> None:
    want = recorded(trace, 42)
    assert len(want) > 8000  # the whole tuned workload: about 8,700 decisions on default
    nodes, pods = bundled(trace)
    got = [(node_name, cards) for _, node_name, cards in replay(nodes, pods, "fgd-plus", 42)]
    assert got == want, first_difference([("", *g) for g in got], [("", *w) for w in want])


# ============================================================================ 2. old against new

def old_and_new(monkeypatch: pytest.MonkeyPatch, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest],
                policy: str, seed: int = 42) -> tuple[Decisions, Decisions]:
    new = replay(nodes, pods, policy, seed)
    with monkeypatch.context() as patch:
        patch.setattr(FgdScore, "_compute", reference_compute)
        old = replay(nodes, pods, policy, seed)
    return old, new


@pytest.mark.parametrize(("trace", "policy"), [
    ("default", "fgd"), ("default", "fgd-online"), ("default", "fgd-used"), ("default", "fgd-plus"),
    ("gpushare40", "fgd-plus"), ("gpushare100", "fgd-plus"),
])
def test_fast_scoring_decides_as_the_old_on_a_cut_of_the_bundled_cluster(
        monkeypatch: pytest.MonkeyPatch, trace: str, policy: str) -> None:
    # 160 nodes of the bundled list; the fill protocol scales the workload to 1.3 × their capacity.
    nodes, pods = bundled(trace)
    old, new = old_and_new(monkeypatch, nodes[:160], pods, policy, 7)
    assert len(old) > 500
    assert new == old, first_difference(new, old)


def mixed_cluster() -> list[NodeSpec]:
    """48 nodes: 8×A100 (a third with MIG always on), 4×T4, 2×V100, and CPU-only nodes."""
    specs: list[NodeSpec] = []
    for i in range(48):
        kind = i % 6
        if kind in (0, 1):
            builder = node(f"a{i}").gpus(8, model="A100-40GB").cpu(96_000)
            specs.append((builder.mig(MigMode.ON) if i % 12 == 0 else builder).obj())
        elif kind in (2, 3):
            specs.append(node(f"t{i}").gpus(4, model="T4").cpu(32_000).obj())
        elif kind == 4:
            specs.append(node(f"v{i}").gpus(2, model="V100-16GB").cpu(24_000).obj())
        else:
            specs.append(node(f"c{i}").cpu(64_000).obj())
    return specs


def mixed_workload(count: int, seed: int) -> list[PodRequest]:
    """Shares on one and on two cards (some asking memory, up to most of a T4, so memory rules out cards that
    have compute left), whole cards, MIG slices, model constraints, CPU only."""
    rng = np.random.default_rng(seed)
    pods: list[PodRequest] = []
    for i in range(count):
        cpu = int(rng.choice([0, 500, 1000, 4000, 8000]))
        kind = int(rng.integers(8))
        builder = pod(f"p{i:04d}").cpu(cpu)
        milli = int(rng.choice([100, 250, 300, 500, 700]))
        if kind <= 2:
            builder = builder.fraction(milli, mem=int(rng.choice([0, 0, 4000, 12000])))
        elif kind == 3:
            pods.append(PodRequest(f"p{i:04d}", cpu_milli=cpu, gpu=Fraction(compute_milli=milli, count=2)))
            continue
        elif kind == 4:
            builder = builder.whole(int(rng.choice([1, 1, 2, 4, 8])))
        elif kind == 5:
            builder = builder.mig("1g.5gb")
        elif kind == 6 and cpu == 0:
            builder = builder.cpu(2000)
        if rng.random() < 0.2 and kind in (0, 1, 4):
            builder = builder.models("T4")
        pods.append(builder.obj())
    return pods


@pytest.mark.parametrize(("policy", "seed"), [("fgd-plus", 1), ("fgd-plus", 2), ("fgd", 3), ("fgd-used", 4)])
def test_fast_scoring_decides_as_the_old_on_a_mixed_cluster(monkeypatch: pytest.MonkeyPatch, policy: str,
                                                            seed: int) -> None:
    pods = mixed_workload(900, seed)
    old, new = old_and_new(monkeypatch, mixed_cluster(), pods, policy, seed)
    placed = [d for d in old if d[1]]
    assert len(placed) > 200
    assert any("+" in cards for _, _, cards in placed)  # some share went on two cards
    assert new == old, first_difference(new, old)


@pytest.mark.parametrize(("small_batch", "start_over"), [
    (0, False),  # every batch through the node classes
    (10**9, False),  # every batch from the nodes' own rows
    (0, True),  # the class table starts over at every score (as when it reaches its size bound)
], ids=["classes-only", "rows-only", "classes-start-over"])
def test_either_scoring_path_decides_as_the_old(monkeypatch: pytest.MonkeyPatch, small_batch: int,
                                                start_over: bool) -> None:
    pods = mixed_workload(600, 5)
    with monkeypatch.context() as patch:
        patch.setattr(fgd, "SMALL_BATCH", small_batch)
        if start_over:
            patch.setattr(fgd._NodeClasses, "full", lambda self, nodes: True)
        new = replay(mixed_cluster(), pods, "fgd-plus", 5)
    with monkeypatch.context() as patch:
        patch.setattr(FgdScore, "_compute", reference_compute)
        old = replay(mixed_cluster(), pods, "fgd-plus", 5)
    assert len([d for d in old if d[1]]) > 200
    assert new == old, first_difference(new, old)


def test_a_node_whose_filters_rule_out_a_card_its_class_could_take_is_placed_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 40 nodes of 8 A100-40GB, each with 100 milli used on card 0 (900 free), so all share one class. On the
    # even nodes that share also holds 38,000 MiB, so a share asking 10,000 MiB cannot go on card 0 there:
    # the filters (CARD_OK) rule out a card the class could take, and those nodes must not decide as the class.
    # M is one whole-card shape, so card 0 (900 → 600, no idle card broken) is the class's best card.
    state = cluster(*(node(f"n{i}").gpus(8).obj() for i in range(40)))
    for i in range(40):
        state.place(pod(f"u{i}").fraction(100, mem=38_000 if i % 2 == 0 else 0).obj(),
                    Assignment(f"n{i}", (CardShare(0, 100, 38_000 if i % 2 == 0 else 0),)))
    typical = TypicalPods(((1000, 1000, 1, None),), np.array([1.0]))
    request = pod("p").cpu(1000).fraction(300, mem=10_000).obj()
    profile = default_registry().build(PolicyConfig(node_policy="fgd-plus", typical=typical))
    nodes = np.arange(state.size)

    def scored() -> tuple[list[float], list[int]]:
        cycle = CycleState()
        alive, _ = Framework(profile, np.random.default_rng(0)).find_nodes(cycle, request, state)
        assert alive.all()
        got = FgdPlusScore(typical).score(cycle, request, state, nodes)
        return got.tolist(), cycle.read(FGD_CARD)[nodes].tolist()

    new_scores, new_cards = scored()
    with monkeypatch.context() as patch:
        patch.setattr(FgdScore, "_compute", reference_compute)
        old_scores, old_cards = scored()
    assert (new_scores, new_cards) == (old_scores, old_cards)
    assert set(new_cards[0::2]) == {1} and set(new_cards[1::2]) == {0}  # the memory-held card is skipped
