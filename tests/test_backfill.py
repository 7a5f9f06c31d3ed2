"""The training-backfill scenario on the kit's world: what backfill buys, what its evictions cost the normal
pods in the kubelet's real termination time, the lost-work ledger, the settings, the CLI and the report.

Every run uses the scenario's quick settings (16 nodes, half a virtual day, 2 h warm-up, about 3 s a
run); runs are shared between tests through module-scoped fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.report.backfill import sections
from gpuplane.sim import bundled_path
from gpuplane.sim.backfill import SCENARIO, BackfillFigures, BackfillSettings
from gpuplane.sim.scenario import check_scenario, get_scenario, no_progress, summarise
from gpuplane.sim.scenario_file import ScenarioError
from gpuplane.sim.trace import TraceError

QUICK: dict[str, Any] = dict(SCENARIO.quick)


def run(**fields: Any) -> BackfillFigures:
    return SCENARIO.run(BackfillSettings(**(QUICK | fields)), no_progress)


CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    # the old world: a victim is gone the instant it is evicted (grace 0 s, no container stop)
    "instant-evictions": {"batch_grace_s": 0.0, "kubelet_stop_s": 0.0},
    "exit-at-once": {"batch_saves_on_signal": False},
    "save-longer-than-grace": {"batch_save_s": 45.0},
    "seed2-spread": {"seed": 2, "node_policy": "spread"},
    "headroom": {"backfill_headroom_milli": 1000},
    "idle-nodes-only": {"backfill_headroom_milli": 10**6},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, BackfillFigures]:
    return {name: run(**fields) for name, fields in CASES.items()}


def test_the_scenario_keeps_the_rules_for_figures() -> None:
    assert check_scenario(SCENARIO) == []
    assert get_scenario("training-backfill") is SCENARIO
    assert {g.figure for g in SCENARIO.goals} <= {n for n, f in BackfillFigures.model_fields.items()
                                                 if (f.json_schema_extra or {}).get("arm") == SCENARIO.ours}


# ------------------------------------------------------------------------------------ what backfill buys
@pytest.mark.parametrize("case", ["defaults", "seed2-spread"])
def test_backfill_fills_idle_cards(runs: dict[str, BackfillFigures], case: str) -> None:
    f = runs[case]
    assert f.no_backfill_allocation_pct < 75.0 < f.backfill_allocation_pct <= 100.0
    assert f.allocation_gain_points >= 15.0
    assert f.batch_useful_gpu_h > 0 and f.batch_preemptions > 0


@pytest.mark.parametrize("case", ["defaults", "seed2-spread"])
def test_normal_pods_keep_their_share_of_the_cards(runs: dict[str, BackfillFigures], case: str) -> None:
    """Normal pods are placed as if backfill were not there; they lose only the time they wait for victims."""
    f = runs[case]
    assert abs(f.backfill_normal_allocation_pct - f.no_backfill_allocation_pct) <= 2.5
    assert f.no_backfill_normal_lost_gpu_h == 0 and f.backfill_normal_lost_gpu_h == 0  # no online pods here


# ----------------------------------------------------------------------- what its evictions cost, honestly
def test_with_instant_evictions_normal_pods_wait_exactly_as_without(runs: dict[str, BackfillFigures]) -> None:
    """The old figure, and why it held: a victim that leaves at once costs the normal pod nothing."""
    f = runs["instant-evictions"]
    assert f.normal_pods_waited_for_victims_pct == 0.0  # nothing to wait for: bound at once
    assert f.backfill_waits_s == f.no_backfill_waits_s
    assert f.normal_pods_waited_longer_pct == 0.0


# (case, median wait of a normal pod that displaced batch pods): a batch victim with unsaved work saves for
# batch_save_s (20 s), or is killed when its grace (30 s) runs out, then its container stops in 2 s
VICTIM_WAITS = [
    ("defaults", 20.0 + 2.0),                # it saves (20 s ≤ 30 s of grace) and exits, then the stop
    ("exit-at-once", 0.0 + 2.0),             # no SIGTERM handler: the process ends at once
    ("save-longer-than-grace", 30.0 + 2.0),  # a 45 s save does not fit: SIGKILL at 30 s
]


@pytest.mark.parametrize(("case", "wait_s"), VICTIM_WAITS)
def test_a_normal_pod_waits_for_its_victims_termination(runs: dict[str, BackfillFigures], case: str,
                                                         wait_s: float) -> None:
    f = runs[case]
    assert f.normal_wait_for_victims_p50_s == pytest.approx(wait_s)
    # most normal pods land on cards backfill holds (allocation ~94 %), so most wait for victims
    assert f.normal_pods_waited_for_victims_pct > 50.0
    assert f.normal_pods_waited_longer_pct > 50.0
    assert f.backfill_normal_wait_p50_s == pytest.approx(wait_s)
    assert f.no_backfill_normal_wait_p50_s == 0.0


def test_normal_pods_wait_longer_with_backfill(runs: dict[str, BackfillFigures]) -> None:
    f = runs["defaults"]
    assert f.normal_wait_added_mean_s > 10.0
    assert f.backfill_normal_wait_mean_s > f.no_backfill_normal_wait_mean_s


@pytest.mark.parametrize("case", ["headroom", "idle-nodes-only"])
def test_headroom_beside_normal_pods_trades_allocation_for_waits(runs: dict[str, BackfillFigures],
                                                                 case: str) -> None:
    """The scheduler's backfill_headroom_milli: room left beside normal pods for the next ones."""
    fill_all, spared = runs["defaults"], runs[case]
    assert spared.normal_pods_waited_for_victims_pct < fill_all.normal_pods_waited_for_victims_pct * 0.75
    assert spared.normal_wait_added_mean_s < fill_all.normal_wait_added_mean_s
    assert 15.0 <= spared.allocation_gain_points < fill_all.allocation_gain_points


def test_more_headroom_fewer_waits_less_allocation(runs: dict[str, BackfillFigures]) -> None:
    one_card, idle_only = runs["headroom"], runs["idle-nodes-only"]
    assert idle_only.normal_pods_waited_for_victims_pct < one_card.normal_pods_waited_for_victims_pct
    assert idle_only.allocation_gain_points < one_card.allocation_gain_points


# ------------------------------------------------------------------------------------------- work lost
def test_a_save_that_fits_the_grace_keeps_the_batch_work(runs: dict[str, BackfillFigures]) -> None:
    assert runs["defaults"].batch_lost_gpu_h == 0.0  # every victim's 20 s save ends within its 30 s grace


@pytest.mark.parametrize("case", ["exit-at-once", "save-longer-than-grace", "instant-evictions"])
def test_a_victim_that_cannot_save_loses_at_most_one_interval(runs: dict[str, BackfillFigures], case: str) -> None:
    f = runs[case]
    assert f.batch_lost_gpu_h > 0
    # a victim loses what it did since its last periodic save: under batch_save_every_s (600 s) of work on at
    # most one card (batch pods take the trace's one-card-or-less shapes)
    assert f.batch_lost_gpu_h <= f.batch_preemptions * 600.0 / 3600.0
    assert 0.0 < f.batch_lost_pct < 100.0


# ----------------------------------------------------------------------------------------- determinism
def test_same_seed_same_figures_another_seed_others(runs: dict[str, BackfillFigures]) -> None:
    again = run()
    assert again.model_dump() == runs["defaults"].model_dump()
    assert run(seed=5).model_dump() != runs["defaults"].model_dump()


# ------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize(("fields", "message"), [
    ({"min_duration_s": 500, "max_duration_s": 100}, "min_duration_s 500.0 is above max_duration_s 100.0"),
    # 12 h of warm-up × 3600 = 43200 s = 0.5 day × 86400: nothing left to measure
    ({"days": 0.5, "warmup_hours": 12}, "warmup_hours 12.0 leaves nothing of 0.5 day(s)"),
    ({"node_policy": "tetris"}, "unknown node_policy 'tetris'"),
    ({"batch_grace_s": -1}, "greater than or equal to 0"),
    ({"nosuch": 1}, "Extra inputs are not permitted"),
])
def test_invalid_settings_name_the_problem(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BackfillSettings(**fields)


def test_the_trace_and_node_list_are_settings(tmp_path: Path) -> None:
    lines = bundled_path("nodes").read_text(encoding="utf-8").splitlines()
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("\n".join(lines[:13]) + "\n", encoding="utf-8")  # the header and 12 nodes
    f = run(nodes=str(nodes), node_count=0, trace="gpushare40")
    assert f.nodes == 12


def test_a_missing_trace_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nosuch\.csv"):
        run(trace=str(tmp_path / "nosuch.csv"))


def test_a_trace_without_small_pods_has_no_batch_shape(tmp_path: Path) -> None:
    lines = bundled_path("default").read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    gpu = header.index("num_gpu")
    big = [row for row in lines[1:] if row.split(",")[gpu] not in ("0", "1")]
    trace = tmp_path / "big.csv"
    trace.write_text("\n".join([lines[0], *big]) + "\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match="no pod of one card or less"):
        run(trace=str(trace), node_count=0)


# -------------------------------------------------------------------------------------- CLI and report
@pytest.fixture(scope="module")
def cli_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("backfill")
    flags = [arg for key, value in QUICK.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    result = CliRunner().invoke(app, ["scenario", "training-backfill", *flags, "--seeds", "1", "--json",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_the_cli_runs_the_same_scenario(cli_json: dict[str, Any], runs: dict[str, BackfillFigures]) -> None:
    (one,) = cli_json["runs"]
    assert one["seed"] == 1
    assert one["allocation_gain_points"] == runs["defaults"].allocation_gain_points
    assert cli_json["figures"]["backfill_normal_wait_p50_s"]["median"] == runs["defaults"].backfill_normal_wait_p50_s
    assert "backfill_waits_s" not in one  # series stay out of the JSON


def test_the_report_has_the_plots_and_a_row_per_seed(cli_json: dict[str, Any]) -> None:
    text = Path(cli_json["report"]).read_text(encoding="utf-8")
    assert "Backfill: allocation and normal-pod waits" in text
    assert "<tr><th>seed 1</th>" in text


def test_sections_draw_two_plots_and_a_row_per_seed(runs: dict[str, BackfillFigures]) -> None:
    settings = BackfillSettings(**QUICK)
    sweep = summarise(SCENARIO, settings, (1, 2), (runs["defaults"], runs["seed2-spread"]))
    html = "".join(sections(sweep))
    assert html.count("data:image/png;base64,") == 2
    assert "<tr><th>seed 1</th>" in html and "<tr><th>seed 2</th>" in html
