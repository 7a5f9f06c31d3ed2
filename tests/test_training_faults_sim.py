"""The training-faults simulation's parts: the incident streams the classifier reads
(`gpuplane.sim.fault_streams`), the controller's decisions on them, and one arm run through the recovery
controller, the simulated cluster and the production scheduler.

Streams: noise, near misses and tolerated events around a root cause and its cascade, on every node, each
node's clock off by a draw of `clock_skew_s` (reference: shared/reference/fault-tolerance.md §4).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.controllers.classifier import Classification, FailureClassifier
from gpuplane.controllers.health import HealthEvent, NodeHealth
from gpuplane.controllers.recovery import QUARANTINE_TAINT, classify_incident, hang_suspects, nodes_to_isolate
from gpuplane.model.failures import FailureAction
from gpuplane.sim.fault_streams import (
    APP_ERRORS,
    CATEGORIES,
    ECHOES,
    IB_PEER,
    PEER_ERRORS,
    PERSISTENT,
    ROOT_CAUSES,
    TOLERATED,
    Incident,
    StreamMaker,
    StreamModel,
    decision_correct,
    vary,
)
from gpuplane.sim.scenario import with_overrides
from gpuplane.sim.training_faults import (
    SCENARIO,
    TrainingFaultsSettings,
    _Arm,
    bundled_library,
    measure_accuracy,
)

LIBRARY = bundled_library()
NODES = [f"node-{i:04d}" for i in range(8)]
CLEAN = StreamModel(noise_lines=0, tolerated_lines=0, clock_skew_s=0.0, silent_share=0.0, silent_hang_share=0.0)
"""A stream with the root cause and its cascade only: no noise, no skew, no silent node."""


@pytest.fixture(scope="module")
def maker() -> StreamMaker:
    return StreamMaker(LIBRARY, StreamModel())


def _verdict_on(stream_model: StreamModel, category: str, root: str | None,
                seed: int = 1) -> tuple[Incident, Classification]:
    maker = StreamMaker(LIBRARY, stream_model)
    incident = Incident(category, NODES[3], root)
    rng = np.random.default_rng(seed)
    verdict = classify_incident(FailureClassifier(LIBRARY), maker.stream(rng, incident, NODES, 1e6), 1e6)
    return incident, verdict


def test_noise_and_near_misses_match_no_signature(maker: StreamMaker) -> None:
    checker = FailureClassifier(LIBRARY)
    assert maker.noise and maker.near_misses
    assert [line for line in maker.noise if checker.feed_line("n", line) is not None] == []
    assert [line for line in maker.near_misses if checker.feed_line("n", line) is not None] == []
    # many near misses do pass the prefilter: they look like signatures (27 of 72 with the bundled library)
    assert sum(checker.prefilter.regex.search(line.encode()) is not None for line in maker.near_misses) \
        >= len(maker.near_misses) // 4


def test_every_root_cause_is_in_the_bundled_library_and_every_category_has_a_mix_field() -> None:
    assert set(ROOT_CAUSES) == set(CATEGORIES)
    assert all(signature in LIBRARY for ids in ROOT_CAUSES.values() for signature in ids)
    assert set(TrainingFaultsSettings().mix()) == set(CATEGORIES)


STREAM_SIGNATURES = sorted({*(r for ids in ROOT_CAUSES.values() for r in ids), *TOLERATED, *APP_ERRORS,
                            *PEER_ERRORS, IB_PEER, *ECHOES})


@pytest.mark.parametrize("signature", STREAM_SIGNATURES)
def test_varied_lines_are_new_and_still_their_signatures(signature: str) -> None:
    rng = np.random.default_rng(11)
    checker = FailureClassifier(LIBRARY)
    lines = [vary(example, rng) for example in LIBRARY[signature].examples for _ in range(10)]
    for line in lines:
        match = checker.feed_line("n", line)
        assert match is not None and match.signature.id == signature, line


def test_vary_draws_the_variable_fields_only() -> None:
    rng = np.random.default_rng(3)
    line = "[rank5]:[E501 12:03:11.204 ProcessGroupNCCL.cpp:616] NVRM: Xid (PCI:0000:3b:00): 79, pid=2417, gpu-node-017"
    varied = vary(line, rng)
    assert varied != line
    # the Xid code, the file and line, the message stay; pid, bus, node number, rank, minutes, seconds move
    for kept in ("Xid (PCI:0000:", "): 79, pid=", "ProcessGroupNCCL.cpp:616]", "gpu-node-", "[E501 12:"):
        assert kept in varied


@pytest.mark.parametrize(("category", "root"), [(c, r) for c in CATEGORIES for r in ROOT_CAUSES[c]])
def test_a_clean_cascade_is_decided_right(category: str, root: str) -> None:
    # the root on node-0003, its rank's CUDA error within ±2 s, peers' remote errors, every rank's echoes:
    # the controller takes out exactly node-0003 when the category is the node's fault, no node otherwise
    incident, verdict = _verdict_on(CLEAN, category, root)
    assert decision_correct(incident, nodes_to_isolate(verdict)), (verdict.signature, verdict.blamed_nodes)


def test_a_silent_network_hang_is_localised_by_the_rank_behind() -> None:
    # nothing blames a node: every rank times out; node-0003's ranks completed one NCCL op fewer
    incident, verdict = _verdict_on(CLEAN, "network", None)
    assert nodes_to_isolate(verdict) == ()
    assert verdict.action is FailureAction.RESTART_JOB
    assert hang_suspects(verdict) == (incident.node,)


def test_a_skewed_peer_can_log_the_first_error() -> None:
    # 30 s of clock skew: over 20 incidents, some peer's remote error carries a time before the root's line
    maker = StreamMaker(LIBRARY, CLEAN.model_copy(update={"clock_skew_s": 30.0}))
    rng = np.random.default_rng(7)
    peer_errors = ("remote process", "ncclRemoteError", "Connection reset", "Broken pipe")
    earlier = 0
    for k in range(20):
        stream = maker.stream(rng, Incident("gpu", NODES[3], "xid-79"), NODES, 1e6 + k)
        root = next(e for e in stream if e.node == NODES[3] and "Xid" in str(e.line))
        assert root.t is not None
        earlier += any(e.node != NODES[3] and e.t is not None and e.t < root.t
                       and any(p in str(e.line) for p in peer_errors) for e in stream)
    assert 0 < earlier < 20


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(CATEGORIES), st.floats(0.0, 60.0), st.integers(2, 12))
def test_every_stream_is_in_time_order_on_the_jobs_nodes(seed: int, category: str, skew: float, n: int) -> None:
    maker = StreamMaker(LIBRARY, StreamModel(noise_lines=50, clock_skew_s=skew))
    rng = np.random.default_rng(seed)
    nodes = NODES[:n] if n <= len(NODES) else [f"node-{i:04d}" for i in range(n)]
    incident = maker.incident(rng, category, nodes[0])
    stream = maker.stream(rng, incident, nodes, 1e6)
    times = [e.t for e in stream]
    assert all(t is not None for t in times) and times == sorted(times)  # type: ignore[type-var]
    assert {e.node for e in stream} <= set(nodes)
    # every node's ranks end the same way: each node logs one -6 exit
    assert sorted(e.node for e in stream if e.exit_code == -6) == sorted(nodes)
    if incident.root is not None:  # a line of the root cause's signature is on the failing node
        checker = FailureClassifier(LIBRARY)
        assert any(e.node == nodes[0] and e.line is not None and (m := checker.feed_line("n", e.line)) is not None
                   and m.signature.id == incident.root for e in stream)


# (category, isolated, correct)
@pytest.mark.parametrize(("category", "isolated", "correct"), [
    ("gpu", ("node-0003",), True),
    ("gpu", (), False),                          # the broken node stays: its restart fails again
    ("gpu", ("node-0003", "node-0001"), False),  # a healthy peer taken out too
    ("software", (), True),
    ("software", ("node-0003",), False),         # a transient job failure needs no isolation
    ("unknown_nccl", (), True),
])
def test_decision_correct(category: str, isolated: tuple[str, ...], correct: bool) -> None:
    assert decision_correct(Incident(category, "node-0003", None), isolated) is correct
    assert (category in PERSISTENT) is (category == "gpu")


def test_the_cause_window_is_worth_its_keep() -> None:
    # the same incidents with the first error taken at an instant (window 0): the failing rank's CUDA error
    # often beats the kernel's Xid line by a second, and the job restarts on a broken GPU
    s = TrainingFaultsSettings(accuracy_incidents=150)
    maker = StreamMaker(LIBRARY, s.streams())
    window = measure_accuracy(s, LIBRARY, maker)
    instant = measure_accuracy(s, LIBRARY, maker, cause_window_s=0.0)
    assert window.correct_pct > instant.correct_pct + 10.0, (window, instant)
    assert window.culprit_pct > instant.culprit_pct


def test_more_noise_and_skew_do_not_help() -> None:
    s = TrainingFaultsSettings(accuracy_incidents=150)
    clean = s.model_copy(update={"noise_lines": 0, "clock_skew_s": 0.0, "silent_share": 0.0,
                                 "silent_hang_share": 0.0, "tolerated_lines": 0})
    messy = measure_accuracy(s, LIBRARY, StreamMaker(LIBRARY, s.streams()))
    tidy = measure_accuracy(clean, LIBRARY, StreamMaker(LIBRARY, clean.streams()))
    assert tidy.correct_pct >= messy.correct_pct
    assert tidy.correct_pct > 95.0


# ------------------------------------------------------------------------------------------------ an arm


@pytest.fixture(scope="module")
def platform_arm() -> _Arm:
    s = with_overrides(TrainingFaultsSettings(), dict(SCENARIO.quick) | {"lemon_fraction": 0.2, "seed": 2})
    arm = _Arm(s, platform=True, library=LIBRARY, streams=StreamMaker(LIBRARY, s.streams()))
    arm.run()
    return arm


def test_the_arm_runs_the_recovery_controller_through_the_cluster(platform_arm: _Arm) -> None:
    arm = platform_arm
    assert arm.controller is not None and arm.result.decisions > 0
    assert arm.job.attempt >= arm.result.decisions  # every decision ended an attempt
    # verdicts isolated nodes through the book, and every node out of service in the book carries the
    # quarantine taint in the cluster
    assert arm.result.isolated > 0
    assert any(r.event is HealthEvent.CRITICAL_FAILURE for r in arm.book.history)
    out = {node for node, state in arm.book.states().items()
           if state in (NodeHealth.QUARANTINED, NodeHealth.REPAIRING, NodeHealth.PROBATION)}
    tainted = {n.name for n in arm.cluster.list_nodes() if QUARANTINE_TAINT in n.spec.taints}
    assert out <= tainted
    # the job's pods of the current attempt run only on untainted nodes
    placed = {p.assignment.node for p in arm.cluster.list_pods() if p.assignment is not None}
    assert not placed & tainted


def test_the_arm_books_work_once(platform_arm: _Arm) -> None:
    arm = platform_arm
    r = arm.result
    # productive + lost + down + saves = the wall clock, and none is negative
    assert min(r.ettr_pct, r.lost_pct, r.down_pct, r.save_pct) >= 0.0
    assert r.ettr_pct + r.lost_pct + r.down_pct <= 100.0 + 1e-9
    assert arm.ledger.lost_gpu_h() > 0.0 and r.failures >= r.train_failures > 0
