"""The scenario kit: the checkpointing job's save model, the seed sweep, the load model and the kubelet's
termination time in the simulated cluster."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.model import (
    Assignment,
    CardShare,
    NodeSpec,
    PodRequest,
    QueueQuota,
    Quotas,
    WholeCards,
    default_catalog,
    default_priority_classes,
)
from gpuplane.port import EventKind, PodPhase
from gpuplane.scheduler import PolicyConfig, SchedulingRules, default_registry
from gpuplane.sim import EventLoop, SimCluster
from gpuplane.sim.scenario import (
    CheckpointingJob,
    LoadModel,
    SaveModel,
    SeedsError,
    Spread,
    WorkLedger,
    World,
    build_world,
    parse_seeds,
    sample_load,
)

SAVE = SaveModel(every_s=100.0, save_s=10.0)


def _job(work_s: float = 1000.0, save: SaveModel = SAVE) -> CheckpointingJob:
    job = CheckpointingJob("j", work_s, 8.0, save)
    job.start(0.0)
    return job


# (at, done, kept): cycles of 100 s of work then a 10 s save that keeps the work done at its start
@pytest.mark.parametrize(("at", "done", "kept"), [
    (50.0, 50.0, 0.0),
    (105.0, 100.0, 0.0),    # inside the first save (100..110): no progress, nothing kept yet
    (110.0, 100.0, 100.0),  # the save completed
    (165.0, 155.0, 100.0),  # 110 + 55 of work
    (220.0, 200.0, 100.0),  # 110 + 100 + 10 = 220 is the second save's end: (t0 + 2 cycles) keeps 200
])
def test_progress_and_saves_follow_the_cycle(at: float, done: float, kept: float) -> None:
    job = _job()
    assert job.done_s(at) == pytest.approx(done)
    expected_kept = 200.0 if at >= 220.0 else kept
    assert job.kept_s(at) == pytest.approx(expected_kept)


# (at, grace, on_signal, kept, lost, exit)
@pytest.mark.parametrize(("at", "grace", "on_signal", "kept", "lost", "exit_s"), [
    (50.0, 30.0, True, 50.0, 0.0, 60.0),     # a save started at the signal ends at 60 <= 80: all kept
    (50.0, 5.0, True, 0.0, 50.0, 55.0),      # 60 > 55: the kill comes first, all 50 s lost
    (50.0, 30.0, False, 0.0, 50.0, 50.0),    # no SIGTERM handler: exits at once, loses since the last save
    (105.0, 5.0, True, 100.0, 0.0, 110.0),   # the save in flight ends at 110 = the deadline: kept
    (105.0, 4.0, True, 0.0, 100.0, 109.0),   # it ends after the deadline: lost, and no time for another
    (165.0, 20.0, True, 155.0, 0.0, 175.0),  # 100 kept earlier, the signal save keeps the 55 since
    (165.0, 0.0, True, 100.0, 55.0, 165.0),  # grace 0: the 55 s since the save at 110 are lost
])
def test_a_stop_keeps_what_a_save_within_the_grace_covers(at: float, grace: float, on_signal: bool, kept: float,
                                                          lost: float, exit_s: float) -> None:
    job = _job(save=SAVE.model_copy(update={"on_signal": on_signal}))
    outcome = job.stop(at, grace)
    assert (outcome.saved_s, outcome.lost_s, outcome.exit_s) == pytest.approx((kept, lost, exit_s))
    assert not job.running
    job.start(500.0)
    assert job.done_s(500.0) == pytest.approx(kept)  # a restart resumes from the kept work


def test_ten_hour_intervals_and_no_lead_save_lose_work_to_a_short_grace() -> None:
    # the old tidal model kept everything whenever grace >= the save cost; here a 60 s save and 30 s grace
    # after 5 h of work without a save loses all 5 h
    job = _job(work_s=50_000.0, save=SaveModel(every_s=36_000.0, save_s=60.0))
    outcome = job.stop(18_000.0, 30.0)
    assert outcome.lost_s == pytest.approx(18_000.0)


# (work, finish): 100 s segments with 10 s saves between them, none after the last
@pytest.mark.parametrize(("work", "finish"), [(50.0, 50.0), (100.0, 100.0), (200.0, 210.0), (250.0, 270.0)])
def test_finish_time_counts_the_saves_between_segments(work: float, finish: float) -> None:
    job = _job(work_s=work)
    assert job.finish_time(0.0) == pytest.approx(finish)
    assert job.done_s(finish) == pytest.approx(work)
    assert job.complete(finish) == pytest.approx(work)


def test_a_lead_save_keeps_the_work_so_far_and_restarts_the_cycle() -> None:
    job = _job()
    job.save_now(50.0)
    assert job.kept_s(59.0) == 0.0 and job.done_s(59.0) == 50.0  # saving: no progress
    assert job.kept_s(60.0) == 50.0
    assert job.done_s(160.0) == pytest.approx(150.0)
    assert job.stop(165.0, 0.0).saved_s == pytest.approx(50.0)  # the periodic save from 160 was cut


@pytest.mark.parametrize("every", [1e-300, 0.5])
def test_a_save_interval_under_a_second_is_refused(every: float) -> None:
    with pytest.raises(ValueError, match="at least 1 s"):
        SaveModel(every_s=every)


def test_a_crash_keeps_only_completed_saves() -> None:
    job = _job()
    outcome = job.crash(165.0)
    assert (outcome.saved_s, outcome.lost_s) == (100.0, pytest.approx(55.0))


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(st.floats(1.0, 400.0), st.floats(0.0, 40.0), st.booleans()), min_size=1,
                       max_size=8),
       every=st.one_of(st.just(0.0), st.floats(1.0, 200.0)), save_s=st.floats(0.0, 30.0))
def test_work_is_conserved_across_stops(events: list[tuple[float, float, bool]], every: float,
                                        save_s: float) -> None:
    """Invariant: each stop's kept + lost = done; the ledger's useful + lost = all the work ever done."""
    job = CheckpointingJob("j", 10_000.0, 2.0, SaveModel(every_s=every, save_s=save_s))
    ledger = WorkLedger()
    now, total_done = 0.0, 0.0
    for run_for, grace, crash in events:
        before = job.saved_s
        job.start(now)
        now += run_for
        outcome = job.crash(now) if crash else job.stop(now, grace)
        assert outcome.saved_s <= outcome.done_s + 1e-9
        assert outcome.saved_s + outcome.lost_s == pytest.approx(outcome.done_s)
        assert outcome.saved_s >= before - 1e-9
        total_done += outcome.done_s - before
        ledger.stopped(job, outcome, "crash" if crash else "evicted")
        now = max(now, outcome.exit_s)
    assert (ledger.useful_gpu_s + sum(ledger.lost_gpu_s.values())) == pytest.approx(total_done * 2.0)


@pytest.mark.parametrize(("text", "seeds"), [("1-10", tuple(range(1, 11))), ("3", (3,)), ("1,4,9", (1, 4, 9)),
                                             ("1-3,2,7", (1, 2, 3, 7))])
def test_parse_seeds(text: str, seeds: tuple[int, ...]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "5-2", "1-"])
def test_bad_seeds_are_named(text: str) -> None:
    with pytest.raises(SeedsError, match="--seeds"):
        parse_seeds(text)


def test_spread_is_the_median_and_range() -> None:
    spread = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (spread.median, spread.low, spread.high, spread.seeds) == (2.5, 1.0, 10.0, 4)


def test_load_curve_has_its_mean_and_its_peak_trough_ratio() -> None:
    model = LoadModel(peak_trough_ratio=3.0, noise_cv=0.0)
    curve = sample_load(model, days=2.0, mean=10.0, rng=np.random.default_rng(1))
    assert float(curve.value.mean()) == pytest.approx(10.0, rel=1e-6)
    # a = (3 - 1) / (3 + 1) = 0.5: peak 1.5 × 10, trough 0.5 × 10
    assert curve.peak() == pytest.approx(15.0, rel=1e-4)
    assert float(curve.value.min()) == pytest.approx(5.0, rel=1e-4)


def test_load_noise_has_mean_one_and_its_cv() -> None:
    model = LoadModel(peak_trough_ratio=1.0, noise_cv=0.2, noise_minutes=1.0)
    curve = sample_load(model, days=20.0, mean=1.0, rng=np.random.default_rng(2))
    assert float(curve.noise.mean()) == pytest.approx(1.0, abs=0.01)
    assert float(curve.noise.std()) == pytest.approx(0.2, abs=0.01)


def test_bursts_multiply_the_load_inside_their_span() -> None:
    model = LoadModel(peak_trough_ratio=1.0, noise_cv=0.0, bursts_per_day=3.0, burst_factor=4.0,
                      burst_ramp_minutes=0.0)
    curve = sample_load(model, days=3.0, mean=1.0, rng=np.random.default_rng(3))
    assert curve.bursts
    start, end = curve.bursts[0]
    assert curve.at(start + 60.0) == pytest.approx(4.0)
    assert math.isclose(curve.at(end + 1.0), 4.0) or curve.at(end + 1.0) < 4.0 or len(curve.bursts) > 1


# ---------------------------------------------------------------------------- kubelet termination time
def _cluster(stop_s: float) -> SimCluster:
    cluster = SimCluster(default_catalog(), [NodeSpec("n0", 8000, 8192, "T4", 1)], loop=EventLoop(), stop_s=stop_s)
    cluster.create_pod(PodRequest(name="p", gpu=WholeCards(1)))
    assert cluster.bind("p", Assignment("n0", (CardShare(0, 1000, 15000, whole=True),))).ok
    return cluster


@pytest.mark.parametrize(("grace", "exit_at", "gone_at"), [
    (30.0, None, 32.0),   # killed at the grace's end, 2 s to stop: 30 + 2
    (30.0, 5.0, 7.0),     # the process exited at 5 s: 5 + 2
    (0.0, None, 2.0),     # grace 0 still takes the stop: 0 + 2
])
def test_termination_takes_grace_then_the_stop(grace: float, exit_at: float | None, gone_at: float) -> None:
    cluster = _cluster(stop_s=2.0)
    kinds: list[tuple[EventKind, float]] = []
    cluster.watch(lambda e: kinds.append((e.kind, e.time)))
    assert cluster.evict("p", grace_s=grace).ok
    assert cluster.get_pod("p").phase is PodPhase.TERMINATING  # type: ignore[union-attr]
    if exit_at is not None:
        cluster.loop.run(until=exit_at)
        assert cluster.container_exited("p").ok
    cluster.loop.run(until=gone_at - 0.01)
    assert cluster.get_pod("p") is not None and "p" in cluster.state.bindings  # cards still held
    cluster.loop.run()
    assert cluster.get_pod("p") is None and "p" not in cluster.state.bindings
    assert kinds[-1] == (EventKind.POD_DELETED, pytest.approx(gone_at))


def test_without_a_stop_time_grace_zero_deletes_at_once() -> None:
    cluster = _cluster(stop_s=0.0)
    assert cluster.evict("p", grace_s=0.0).ok
    assert cluster.get_pod("p") is None


# ---------------------------------------------------------------------------- build_world's quotas
_TEAM = Quotas([QueueQuota("team", min_gpus=1.0, max_gpus=2.0)])


def _world(quotas: Quotas | None, rules: SchedulingRules | None) -> World:
    profile = default_registry().build(PolicyConfig(seed=0))
    return build_world(default_catalog(), [NodeSpec("n0", 8000, 8192, "T4", 4)], profile, seed=0,
                       classes=default_priority_classes(), quotas=quotas, rules=rules)


# (quotas, rules' quotas): the one source both the admission and the scheduler's rules end with
@pytest.mark.parametrize(("quotas", "rules_quotas", "expected"), [
    (_TEAM, None, _TEAM),        # quotas alone: the default rules get them too
    (_TEAM, Quotas(), _TEAM),    # rules without quotas get them
    (_TEAM, _TEAM, _TEAM),       # the same quotas twice agree
    (None, _TEAM, _TEAM),        # rules alone: the admission takes the rules' quotas
    (None, None, Quotas()),      # neither: no queue is known
])
def test_build_world_gives_the_quotas_to_admission_and_scheduler(quotas: Quotas | None,
                                                                 rules_quotas: Quotas | None,
                                                                 expected: Quotas) -> None:
    rules = None if rules_quotas is None else SchedulingRules(quotas=rules_quotas)
    world = _world(quotas, rules)
    assert world.admission is not None
    assert world.admission.quotas == expected
    assert world.scheduler.rules.quotas == expected
    # team's maximum is 2 GPUs: 2 cards are admitted, 3 refused; an unknown queue is refused
    fits = world.cluster.create_pod(PodRequest(name="a", gpu=WholeCards(2), queue="team"))
    over = world.cluster.create_pod(PodRequest(name="b", gpu=WholeCards(3), queue="team"))
    assert fits.ok is bool(expected) and not over.ok
    assert not world.cluster.create_pod(PodRequest(name="c", gpu=WholeCards(1), queue="other")).ok


def test_build_world_refuses_two_different_quotas() -> None:
    other = Quotas([QueueQuota("team", min_gpus=1.0, max_gpus=3.0)])
    with pytest.raises(ValueError, match="give the quotas once"):
        _world(_TEAM, SchedulingRules(quotas=other))
