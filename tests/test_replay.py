"""Trace replays on the simulated cluster: workload tuning, fill mode and timed mode."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import cache

import numpy as np
import pytest

from gpuplane.model import (
    MILLI_PER_CARD,
    Fraction,
    GpuplaneError,
    NodeSpec,
    PodRequest,
    QoS,
    WholeCards,
    default_catalog,
)
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins import fit
from gpuplane.sim import (
    ReplayMode,
    SimulationResult,
    TimedConfig,
    TracePod,
    bundled_path,
    load_nodes,
    load_pods,
    run_fill,
    run_timed,
    tune_workload,
)
from gpuplane.sim.synthetic import synthetic_nodes

CATALOG = default_catalog()
PROFILE = default_registry().build(PolicyConfig())
FIT_REASONS = {value for name, value in vars(fit).items() if name.isupper() and isinstance(value, str)}


@cache
def small_cluster(count: int = 60, seed: int = 11) -> tuple[NodeSpec, ...]:
    return tuple(synthetic_nodes(load_nodes(bundled_path("nodes"), CATALOG), count, seed))


@cache
def trace_pods() -> tuple[TracePod, ...]:
    return tuple(load_pods(bundled_path("default"), CATALOG))


def requests(count: int = 300) -> list[PodRequest]:
    return [p.request for p in trace_pods()[:count]]


def placement_rows(result: SimulationResult) -> list[tuple[str, str, tuple[int, ...], str]]:
    return [(p.request.name, p.node, p.cards, p.outcome) for p in result.placements]


# ---------------------------------------------------------------------------------------------- tune
def demand_pods() -> list[PodRequest]:
    sizes = [1000, 460, 2000, 300, 8000, 0, 810]
    return [PodRequest(f"p{i}", gpu=WholeCards(s // 1000) if s % 1000 == 0 and s else
                       Fraction(compute_milli=s) if s else None) for i, s in enumerate(sizes)]


def test_tune_workload_grows_to_the_target_with_renamed_copies() -> None:
    pods = demand_pods()
    capacity = 40 * MILLI_PER_CARD
    tuned = tune_workload(pods, capacity, seed=5, target=1.3)
    total = sum(p.gpu_milli_total for p in tuned)
    goal = 1.3 * capacity
    assert total <= goal
    assert total > goal - max(p.gpu_milli_total for p in pods)  # stopped only when the next pod overflowed
    originals = {p.name: p for p in pods}
    assert sorted(p.name for p in tuned[:len(pods)]) == sorted(originals)  # every trace pod, shuffled
    copies = tuned[len(pods):]
    assert copies, "the trace alone is below the target, copies must be added"
    for index, copy in enumerate(copies):
        source_name, _, suffix = copy.name.rpartition("-tuned-")
        assert suffix == str(index)
        assert copy == replace(originals[source_name], name=copy.name)
    assert len({p.name for p in tuned}) == len(tuned)


def test_tune_workload_trims_a_list_that_is_too_large() -> None:
    pods = demand_pods()  # 12.57 cards of demand
    tuned = tune_workload(pods, 5 * MILLI_PER_CARD, seed=3, target=1.3)
    assert sum(p.gpu_milli_total for p in tuned) <= 6500
    assert {p.name for p in tuned} < {p.name for p in pods}
    assert not any("-tuned-" in p.name for p in tuned)


def test_tune_workload_is_deterministic_per_seed() -> None:
    pods = requests(200)
    names = [[p.name for p in tune_workload(pods, 150_000, seed)] for seed in (1, 1, 2)]
    assert names[0] == names[1]
    assert names[0] != names[2]


# ---------------------------------------------------------------------------------------------- fill
@cache
def fill(seed: int) -> SimulationResult:
    return run_fill(CATALOG, small_cluster(), requests(), PROFILE, seed=seed, trace="default",
                    record_placements=True)


def test_fill_is_deterministic_per_seed() -> None:
    first = fill(7)
    again = run_fill(CATALOG, small_cluster(), requests(), PROFILE, seed=7, record_placements=True)
    assert placement_rows(first) == placement_rows(again)
    assert np.array_equal(first.arrived_pct, again.arrived_pct)
    assert np.array_equal(first.allocation_pct, again.allocation_pct)
    assert np.array_equal(first.card_used_milli_at_end, again.card_used_milli_at_end)
    assert first.failed_by_reason == again.failed_by_reason
    other = fill(8)
    assert placement_rows(other) != placement_rows(first)
    assert not np.array_equal(other.allocation_pct, first.allocation_pct)


def test_fill_result_is_consistent() -> None:
    result = fill(7)
    nodes = small_cluster()
    assert result.mode is ReplayMode.FILL
    assert (result.nodes, result.total_gpus) == (60, sum(n.gpus for n in nodes))
    assert result.submitted == result.decisions == len(result.placements) == len(result.arrived_pct)
    assert result.submitted > 300  # tuned up to 130 % of a cluster bigger than 300 pods' demand
    assert result.placed + result.failed == result.submitted
    assert result.placed == sum(1 for p in result.placements if p.outcome == "placed")
    assert result.failed > 0
    assert result.failed_by_reason == Counter({k: v for k, v in result.failed_by_reason.items() if v > 0})
    assert set(result.failed_by_reason) <= FIT_REASONS
    assert np.all(np.diff(result.arrived_pct) >= 0)
    assert np.all(np.diff(result.allocation_pct) >= 0)  # no departures in fill mode
    assert np.all(result.allocation_pct <= result.arrived_pct + 1e-9)
    assert 100.0 < result.arrived_pct[-1] <= 130.0
    assert 0.0 < result.allocation_at(100) <= 100.0
    capacity = result.total_gpus * MILLI_PER_CARD
    # unallocated at 100 % arrived, against a second bookkeeping: the placed pods' GPU demand up to the last
    # arrival that kept the arrived workload within 100 %
    last = int(np.searchsorted(result.arrived_pct, 100.0 + 1e-9, side="right")) - 1
    placed_milli = sum(p.request.gpu_milli_total for p in result.placements[:last + 1] if p.outcome == "placed")
    assert result.unallocated_at(100) == pytest.approx(100.0 - placed_milli * 100.0 / capacity)
    assert result.card_used_milli_at_end.sum() == pytest.approx(result.allocation_pct[-1] * capacity / 100)
    assert len(result.card_used_milli_at_end) == result.total_gpus
    assert result.card_used_milli_at_100.sum() <= result.card_used_milli_at_end.sum()
    for row in result.placements:
        if row.outcome == "placed":
            assert row.node and (len(row.cards) > 0) == (row.request.gpu is not None)
        else:
            assert row.node == "" and row.cards == () and row.outcome.startswith("0/60 nodes are available")


def test_fill_why_explains_every_node_for_an_unschedulable_pod() -> None:
    impossible = PodRequest("needs-h200", cpu_milli=1000, gpu=WholeCards(1), models=frozenset({"H200-141GB"}))
    late_failure = next(p.request.name for p in fill(7).placements if p.outcome != "placed")
    placed = next(p.request.name for p in fill(7).placements if p.outcome == "placed")
    names = [n.name for n in small_cluster()]
    result = run_fill(CATALOG, small_cluster(), [*requests(), impossible], PROFILE, seed=7, why=["needs-h200"])
    rows = result.why["needs-h200"]
    assert [node for node, _ in rows] == names
    assert {reason for _, reason in rows} == {"GPU model mismatch"}
    assert result.why_message["needs-h200"].startswith("0/60 nodes are available: 60 GPU model mismatch")
    # The same workload and seed as fill(7): the same pods fail.
    result = run_fill(CATALOG, small_cluster(), requests(), PROFILE, seed=7, why=[late_failure, placed])
    assert set(result.why) == {placed, late_failure}
    rows = result.why[late_failure]
    assert [node for node, _ in rows] == names
    assert all(reason in FIT_REASONS for _, reason in rows)  # nobody is "feasible"
    assert result.why_message[late_failure].startswith("0/60 nodes are available: ")
    (chosen,) = result.why[placed]
    assert chosen[1] == "chosen" and result.why_message[placed] == f"placed on {chosen[0]}"


def test_fill_with_an_empty_pool_restriction_places_nothing() -> None:
    pods = [replace(p, pools=frozenset({"elsewhere"})) for p in requests(40)]
    result = run_fill(CATALOG, small_cluster(), pods, PROFILE, seed=1)
    assert result.placed == 0
    assert result.failed_by_reason == Counter({fit.POOL_MISMATCH: result.submitted})
    assert result.allocation_at(100) == 0.0


def test_progress_is_reported_up_to_the_total() -> None:
    calls: list[tuple[int, int]] = []
    result = run_fill(CATALOG, small_cluster(), requests(100), PROFILE, seed=1,
                      progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (1, result.submitted) and calls[-1] == (result.submitted, result.submitted)


# ---------------------------------------------------------------------------------------------- timed
# A short horizon keeps the run small; 150 % offered load on 6 nodes makes pods queue.
LOADED = TimedConfig(load=1.5, hours=2.0, warmup_hours=0.5, max_duration_s=3600.0)


@cache
def timed(seed: int) -> SimulationResult:
    return run_timed(CATALOG, small_cluster(6, 4), trace_pods()[:300], PROFILE, seed=seed, config=LOADED,
                     record_placements=True)


def test_timed_replay_places_waiting_pods_after_departures() -> None:
    result = timed(3)
    assert result.mode is ReplayMode.TIMED
    assert result.submitted > 50
    trace_names = {p.request.name for p in trace_pods()[:300]}
    for row in result.placements:  # trace pods, or copies drawn from them to fill the horizon
        assert row.request.name in trace_names or row.request.name.rpartition("-r")[0] in trace_names
    assert result.placed + result.never_placed == result.submitted
    assert result.placed + result.failed == result.submitted
    assert len(result.waits_s) == result.placed
    assert min(result.waits_s) >= 0.0
    waited = sum(1 for w in result.waits_s if w > 0)
    assert waited > 0, "a cluster offered 150 % of its capacity must make some pods wait"
    # Every pod that waited failed its first attempt and was placed later, after a departure freed room.
    first_failed = {p.request.name for p in result.placements if p.outcome != "placed"}
    placed_rows = [p for p in result.placements if p.outcome == "placed"]
    later = [p for p in placed_rows if p.request.name in first_failed]
    assert len(later) == waited
    seq_failed = {p.request.name: p.seq for p in result.placements if p.outcome != "placed"}
    assert all(p.seq > seq_failed[p.request.name] for p in later)
    assert result.decisions > result.submitted  # retries happened


def test_timed_series_is_sampled() -> None:
    result = timed(3)
    series = result.series
    assert series is not None
    times = np.array(series.time_s)
    assert len(times) > 2 and times[0] == 0.0
    assert np.allclose(np.diff(times), LOADED.sample_every_s)
    n = len(times)
    assert len(series.allocation_pct) == len(series.occupied_cards_pct) == len(series.utilisation_pct) == n
    assert len(series.pending) == n
    for values in (series.allocation_pct, series.occupied_cards_pct, series.utilisation_pct):
        assert min(values) >= 0.0 and max(values) <= 100.0 + 1e-9
    assert max(series.allocation_pct) > 50.0
    assert max(series.pending) > 0
    assert all(u <= a + 1e-9 for u, a in zip(series.utilisation_pct, series.allocation_pct, strict=True))


def test_timed_replay_is_deterministic_per_seed() -> None:
    first = timed(3)
    again = run_timed(CATALOG, small_cluster(6, 4), trace_pods()[:300], PROFILE, seed=3, config=LOADED,
                      record_placements=True)
    assert placement_rows(first) == placement_rows(again)
    assert first.waits_s == again.waits_s
    assert first.series == again.series
    assert (first.placed, first.decisions, first.never_placed) == (again.placed, again.decisions, again.never_placed)
    other = timed(4)
    assert placement_rows(other) != placement_rows(first)
    assert other.waits_s != first.waits_s


def test_timed_replay_with_trace_arrivals_follows_the_timestamps() -> None:
    node = NodeSpec("only", 8000, 65536, "T4", 1)

    def pod(name: str, cards: int, created: float, deleted: float) -> TracePod:
        gpu = WholeCards(cards) if cards else None
        return TracePod(PodRequest(name, cpu_milli=1000, memory_mib=1024, gpu=gpu, qos=QoS.OFFLINE), 2,
                        created, deleted)

    pods = [pod("a", 1, 1000.0, 1500.0), pod("b", 1, 1100.0, 1200.0), pod("c", 0, 1200.0, 1300.0)]
    config = TimedConfig(arrival="trace", sample_every_s=50.0)
    result = run_timed(CATALOG, [node], pods, PROFILE, seed=0, config=config, record_placements=True)
    # a runs 0..500; b arrives at 100, waits for a's card and runs 500..600; c needs no card.
    assert sorted(result.waits_s) == [0.0, 0.0, 400.0]
    assert [(p.request.name, p.outcome == "placed") for p in result.placements] == [
        ("a", True), ("b", False), ("c", True), ("b", True)]
    assert result.placed == 3 and result.never_placed == 0
    assert result.series is not None and result.series.time_s[-1] >= 550.0
    assert result.series.allocation_pct[:2] == [100.0, 100.0]


def test_timed_pods_that_can_never_fit_stay_pending() -> None:
    node = NodeSpec("only", 8000, 65536, "T4", 1)
    pods = [TracePod(PodRequest("big", gpu=WholeCards(2)), 2, 0.0, 100.0),
            TracePod(PodRequest("ok", gpu=WholeCards(1)), 3, 10.0, 100.0)]
    result = run_timed(CATALOG, [node], pods, PROFILE, seed=0, config=TimedConfig(arrival="trace"))
    assert (result.placed, result.never_placed) == (1, 1)
    assert result.failed_by_reason == Counter({"still pending at the end": 1})


@pytest.mark.parametrize("kwargs", [
    {"arrival": "uniform"}, {"load": 0.0}, {"load": -1.0}, {"load": 10.5}, {"min_duration_s": 0.0},
    {"min_duration_s": 100.0, "max_duration_s": 50.0}, {"sample_every_s": 0.0}, {"sample_every_s": -5.0},
    {"hours": 0.0}, {"hours": 1.0, "warmup_hours": 1.0}, {"warmup_hours": -1.0},
])
def test_timed_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TimedConfig(**kwargs)  # type: ignore[arg-type]


def test_timed_config_accepts_edge_values() -> None:
    TimedConfig(load=10.0, min_duration_s=1.0, max_duration_s=1.0, arrival="trace", hours=0.5, warmup_hours=0.0)


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        ([], "the workload is empty"),
        ([PodRequest("cpu-only", cpu_milli=1000)], "no pod asks for GPU"),
    ],
)
def test_tune_workload_rejects_what_it_cannot_tune(pods: list[PodRequest], message: str) -> None:
    with pytest.raises(GpuplaneError, match=message):
        tune_workload(pods, 8 * MILLI_PER_CARD, seed=1)


def test_fill_rejects_duplicate_pod_names() -> None:
    twice = [PodRequest("same", gpu=WholeCards(1)), PodRequest("same", gpu=WholeCards(1))]
    with pytest.raises(GpuplaneError, match="'same' appears twice"):
        run_fill(CATALOG, small_cluster(), twice, PROFILE, seed=1)
