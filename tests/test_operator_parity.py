"""The operator against the local API server through a compressed day (24 h in 288 ticks of 300 s), next to
the simulator's controllers on the same inputs: both take the same decisions (loans and reclaims, replica
counts, isolations and health labels, restarts, pool labels, co-location policies, evictions), and the
comparison sees a difference when the operator's inputs differ."""

from __future__ import annotations

import pytest

from gpuplane.report.operator_parity import ParityResult, Snapshot, decisions, main, run_parity


@pytest.fixture(scope="module")
def day() -> ParityResult:
    return run_parity(24.0, 300.0)


def test_the_operator_and_the_simulator_take_the_same_decisions_all_day(day: ParityResult) -> None:
    assert day.ticks == 288  # 24 h / 300 s
    assert day.differences == () and day.sim == day.kube
    kinds = day.counts()
    # every kind of decision is exercised, not just compared
    assert set(kinds) == {"colocation", "health", "lifecycle", "loan", "pod-gone", "pool", "replicas", "restart",
                          "tainted"}
    assert day.compared == len(day.sim) == sum(kinds.values())


def test_the_days_decisions_are_the_policy_s(day: ParityResult) -> None:
    by = {}
    for hour, what, subject, value in day.sim:
        by.setdefault((what, subject), []).append((hour, value))
    # the four tidal nodes: lent in the window at midnight, back at 07:30 (reclaimAt), lent again at 23:30
    for i in range(4):
        assert by[("loan", f"tidal-{i}")] == [(0.0, "lent"), (7.5, ""), (23.5, "lent")]
        assert by[("pool", f"tidal-{i}")] == [(0.0, "training"), (7.5, "inference-tidal"), (23.5, "training")]
        assert by[("pod-gone", f"ml/borrow-tidal-{i}")] == [(7.5, "")]  # the borrowed pods evicted at reclaim
    # recovery: Xid 79 at 03:00 isolates member 1's node and restarts; the illegal address at 10:00 restarts only
    assert by[("restart", "train")] == [(3.0, "xid-79 isolated=train-1"), (10.0, "cuda-illegal-address isolated=")]
    # quarantined, and drained in the same pass (the gang's pods deleted): its repair asked for, and with nobody
    # answering it, still repairing at the end of the day
    assert by[("health", "train-1")] == [(3.0, "repairing")] and by[("tainted", "train-1")] == [(3.0, "True")]
    assert by[("lifecycle", "train-1")] == [(3.0, "repairing")]
    # the failed check tier at 05:00 makes stable-1 a suspect (tainted), the passing one at 05:30 clears it
    assert by[("health", "stable-1")] == [(5.0, "suspect"), (5.5, "")]
    assert by[("tainted", "stable-1")] == [(5.0, "True"), (5.5, "False")]
    # Xid 79 on the spare (no gang there) at 14:00: the node alone is isolated
    assert by[("health", "spare-0")] == [(14.0, "repairing")] and ("restart", "spare-0") not in by
    assert by[("lifecycle", "spare-0")] == [(14.0, "repairing")]
    # the GpuPool "spares" arrives at 12:00; the second ColocationPolicy at 18:00 conflicts on the stable nodes
    assert by[("pool", "spare-0")] == [(12.0, "spares")]
    assert by[("colocation", "stable-0")] == [(0.0, "ml/near-line"), (18.0, "conflict: ml/near-line, ml/stable-only")]
    # chat's tidal subset: the day floor at the reclaim (4 - the stable subset's 2 = 2), up with the day's load
    # (the peak, 1,260 requests/s at 50 per replica, needs 26 in all) and down, then 0 at the shrink (22:30:
    # the night floor of 2 is the stable subset's)
    tidal = by[("replicas", "ml/chat-tidal")]
    assert tidal[0] == (7.5, "2") and max(int(v) for _, v in tidal) > 20 and tidal[-1] == (22.5, "0")
    assert by[("replicas", "ml/chat-stable")] == [(0.0, "2")]


def test_the_comparison_sees_a_difference_when_the_inputs_differ() -> None:
    # the operator reads 10 % more load than the simulator: some replica decision comes at another time
    skewed = run_parity(12.0, 300.0, operator_load_factor=1.1)
    assert skewed.differences
    assert {d[1] for _, d in skewed.differences} >= {"replicas"}


def snap(pool: str = "a", replicas: int = 1, pods: frozenset[str] = frozenset({"p"})) -> Snapshot:
    view = {"pool": pool, "loan": "", "health": "", "tainted": "False", "colocation": ""}
    return Snapshot({"n": view}, {"w": replicas}, set(pods))


@pytest.mark.parametrize(("before", "after", "expected"), [
    (snap(), snap(), []),
    (snap(), snap(pool="b"), [(1.0, "pool", "n", "b")]),
    (snap(), snap(replicas=3), [(1.0, "replicas", "w", "3")]),
    (snap(), snap(pods=frozenset()), [(1.0, "pod-gone", "p", "")]),
    # a pod that appears is the owner's doing, not a decision
    (snap(pods=frozenset()), snap(), []),
])
def test_decisions_are_what_changed(before: Snapshot, after: Snapshot, expected: list[tuple]) -> None:
    assert decisions(before, after, 1.0) == expected


def test_the_command_prints_the_figures_and_fails_on_a_difference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hours", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"decisions_compared"' in out and '"differences": []' in out


def test_gpuplane_operator_parity_prints_the_result() -> None:
    from typer import Typer
    from typer.testing import CliRunner

    from gpuplane.cli.operator_cmd import register

    app = Typer()
    register(app)
    result = CliRunner().invoke(app, ["operator", "--parity"])
    assert result.exit_code == 0, result.output
    assert "decisions compared: 108" in result.output and "differences: 0" in result.output
