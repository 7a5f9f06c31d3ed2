"""`gpuplane scenario colocation`: the declarations follow the rules for figures, the JSON and the report of a
real (quick) sweep, every parameter as a `--set` flag or a YAML field, and bad input.

Real runs are quick (the scenario's own `quick` settings, 15 min of one card's evening: about a second per arm);
the parameter and bad-input tests replace the run itself (`capture_settings`) and simulate nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuplane.report.colocation import sections
from gpuplane.sim.colocation import ARMS, GUARD, SCENARIO, ColocationFigures, ColocationSettings
from gpuplane.sim.scenario import check_scenario, figure_arm, run_seeds
from scenario_helpers import (
    assert_all_fields_at_once,
    assert_captured_run,
    assert_covers_every_field,
    assert_field_reaches_the_run,
    assert_refused,
    capture_settings,
    invoke_scenario,
    num,
)

QUICK = ["--set", "hours=0.25", "--set", "start_hour=20.75"]


def test_the_declarations_follow_the_rules_for_figures() -> None:
    assert check_scenario(SCENARIO) == []
    # every goal is on our arm, the guard; every arm has figures
    assert {figure_arm(ColocationFigures, g.figure) for g in SCENARIO.goals} == {GUARD}
    arms = {figure_arm(ColocationFigures, name) for name, info in ColocationFigures.model_fields.items()
            if not info.exclude}
    assert set(ARMS) <= arms


def test_the_reaction_defaults_are_the_node_guards() -> None:
    from gpuplane.node.guard import GuardOptions

    guard, settings = GuardOptions(), ColocationSettings()
    assert (settings.poll_s, settings.min_slice_s, settings.online_sm_threshold_pct, settings.kill_grace_s) == (
        guard.poll_s, guard.min_slice_s, guard.online_sm_threshold_pct, guard.kill_grace_s)
    policy = settings.guard_settings()
    ours = guard.settings()
    for name in ("safety_margin_bytes", "growth_factor", "min_growth_bytes", "reaction_horizon_s",
                 "admit_hysteresis_bytes", "admit_window_s", "admit_timeout_s", "admission", "min_slice_s"):
        assert getattr(policy, name) == getattr(ours, name), name


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("colocation")
    result = invoke_scenario(out, "colocation", QUICK, seeds="1-2")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data, dict)
    return data


def test_json_has_every_figure_over_the_seeds_and_the_goals(cli_json: dict[str, Any]) -> None:
    assert cli_json["scenario"] == "colocation" and cli_json["seeds"] == [1, 2]
    numeric = [n for n, info in ColocationFigures.model_fields.items() if not info.exclude]
    assert set(cli_json["figures"]) == set(numeric)
    for name in numeric:
        spread = cli_json["figures"][name]
        assert spread["min"] <= spread["median"] <= spread["max"], name
    assert [g["figure"] for g in cli_json["goals"]] == [g.figure for g in SCENARIO.goals]
    assert isinstance(cli_json["goals_met"], bool)
    assert len(cli_json["runs"]) == 2 and cli_json["headline_ready"] is False  # 2 seeds < 10
    for run in cli_json["runs"]:
        assert 0 <= num(run, "guard_offline_share_of_idle_pct") <= 200  # offline also runs beside online
        assert 0 < num(run, "idle_pct") < 100


def test_the_report_has_the_plots(cli_json: dict[str, Any]) -> None:
    text = Path(cli_json["report"]).read_text()
    assert text.count("data:image/png;base64,") >= 3  # the kit's seed plot, and our latency and busy plots
    assert "latency per arm" in text and "card busy share" in text


def test_sections_plot_the_median_run() -> None:
    sweep = run_seeds(SCENARIO, ColocationSettings(hours=0.1, start_hour=21.0), [1])
    html = sections(sweep)
    assert sum("data:image/png;base64," in part for part in html) == 2


# -------------------------------------------------------------------------------------------- parameters
NON_DEFAULT: dict[str, tuple[Any, Any]] = {
    "seed": (3, 3),
    "hours": (0.5, 0.5),
    "start_hour": (3.0, 3.0),
    "cards": (2, 2),
    "card_memory_gib": (40.0, 40.0),
    "bucket_minutes": (5.0, 5.0),
    "online_service_ms": (50.0, 50.0),
    "online_service_cv": (0.0, 0.0),
    "online_peak_util": (0.6, 0.6),
    "arrival_cv": (1.0, 1.0),
    "peak_trough_ratio": (4.0, 4.0),
    "peak_hour": (9.0, 9.0),
    "noise_cv": (0.1, 0.1),
    "bursts_per_day": (0.0, 0.0),
    "burst_factor": (2.0, 2.0),
    "burst_minutes": (5.0, 5.0),
    "online_base_gib": (10.0, 10.0),
    "online_request_gib": (1.0, 1.0),
    "offline_slots": (1, 1),
    "offline_min_gib": (5.0, 5.0),
    "offline_max_gib": (20.0, 20.0),
    "offline_job_minutes": (10.0, 10.0),
    "offline_save_every_minutes": (5.0, 5.0),
    "offline_save_s": (1.0, 1.0),
    "offline_start_s": (0.0, 0.0),
    "offline_restart_s": (5.0, 5.0),
    "offline_exit_s": (2.0, 2.0),
    "share_online_slowdown": (2.0, 2.0),
    "share_offline_rate": (0.25, 0.25),
    "poll_s": (0.1, 0.1),
    "min_slice_s": (0.5, 0.5),
    "online_sm_threshold_pct": (10.0, 10.0),
    "kill_grace_s": (30.0, 30.0),
    "offline_drain_ms": (50.0, 50.0),
    "resume_ms": (2.0, 2.0),
    "admission": (False, False),
    "evictions": (False, False),
    "safety_margin_gib": (4.0, 4.0),
    "growth_factor": (1.0, 1.0),
    "min_growth_gib": (1.0, 1.0),
    "reaction_horizon_s": (1.0, 1.0),
    "admit_hysteresis_gib": (0.5, 0.5),
    "admit_window_s": (60.0, 60.0),
    "admit_timeout_s": (60.0, 60.0),
    "kernel_gate_detect_ms": (5000.0, 5000.0),
    "kernel_gate_drain_ms": (2.0, 2.0),
    "kernel_gate_slice_ms": (20.0, 20.0),
}
"""A valid value other than the default for every field of the scenario."""


def test_the_table_covers_every_field_with_a_value_off_the_default() -> None:
    assert_covers_every_field(ColocationSettings, NON_DEFAULT)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[ColocationSettings]:
    return capture_settings(monkeypatch, ColocationSettings)


@pytest.mark.parametrize("via", ["set", "yaml"])
@pytest.mark.parametrize("field", list(NON_DEFAULT))
def test_every_field_reaches_the_run(tmp_path: Path, captured: list[ColocationSettings], field: str,
                                     via: str) -> None:
    assert_field_reaches_the_run(tmp_path, "colocation", captured, NON_DEFAULT, field, via=via)


def test_all_fields_at_once_from_yaml_and_from_set(tmp_path: Path, captured: list[ColocationSettings]) -> None:
    assert_all_fields_at_once(tmp_path, "colocation", captured, NON_DEFAULT)


def test_set_beats_the_file(tmp_path: Path, captured: list[ColocationSettings]) -> None:
    assert_captured_run(invoke_scenario(tmp_path, "colocation", ["--set", "cards=5"], "cards: 2\npoll_s: 0.1\n"))
    (settings,) = captured
    assert (settings.cards, settings.poll_s) == (5, 0.1)


BAD_INPUT_CASES = [
    pytest.param(None, ["--set", "nosuch=1"], "--set nosuch: no such scenario field", id="unknown-set"),
    pytest.param("nosuch: 3\n", [], "s.yaml: nosuch: no such scenario field", id="unknown-yaml-key"),
    pytest.param(None, ["--set", "offline_min_gib=50", "--set", "offline_max_gib=40"],
                 "offline_min_gib (50.0) is above offline_max_gib (40.0)", id="offline-min-above-max"),
    pytest.param("cards: 0\n", [], "s.yaml: cards: Input should be greater than or equal to 1", id="zero-cards"),
    pytest.param(None, ["--set", "poll_s=0"], "scenario field poll_s: Input should be greater than 0", id="zero-poll"),
    pytest.param(None, ["--set", "online_base_gib=80"], "online_base_gib (80.0) leaves no room on a 80.0 GiB card",
                 id="no-room-for-offline"),
    pytest.param("online_peak_util: 1.2\n", [], "s.yaml: online_peak_util: Input should be less than 1",
                 id="util-above-1"),
]


@pytest.mark.parametrize(("file", "args", "message"), BAD_INPUT_CASES)
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, captured: list[ColocationSettings], file: str | None,
                                            args: list[str], message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "colocation", args, file), captured, message)
