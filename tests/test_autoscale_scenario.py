"""`gpuplane scenario autoscale`: the scenario's declarations, the JSON over seeds, the report's own
sections, settings from --set and YAML, and bad input refused before any run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuplane.report.autoscale import sections
from gpuplane.sim.autoscale import ARMS, OURS, SCENARIO, AutoscaleSettings
from gpuplane.sim.scenario import check_scenario, figure_arm, get_scenario, no_progress, run_seeds, with_overrides
from scenario_helpers import assert_refused, capture_settings, invoke_scenario

QUICK = with_overrides(AutoscaleSettings(), dict(SCENARIO.quick))
FLAGS = [arg for key, value in SCENARIO.quick.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def test_the_scenario_follows_the_rules_and_is_registered() -> None:
    assert check_scenario(SCENARIO) == []
    assert get_scenario("autoscale") is SCENARIO
    assert SCENARIO.ours == OURS and set(SCENARIO.arms) == {"static-peak", "cpu-hpa", "gpu-scaler", "oracle"}


def test_goals_are_on_the_gpu_scaler_and_no_baseline_is_the_old_mean_sized_one() -> None:
    assert {figure_arm(SCENARIO.figures, g.figure) for g in SCENARIO.goals} == {OURS}
    assert not any("average" in name for name in SCENARIO.figures.model_fields)


def test_every_headline_names_a_signal_or_world_assumption_and_a_knob() -> None:
    knobs = {h.knob for h in SCENARIO.headlines}
    # the measured signal's lag (exporter, scrape, KEDA's poll) and noise each carry a headline
    assert {"dcgm_collect_interval_s", "scrape_interval_s", "keda_polling_s", "signal_noise_cv"} <= knobs
    for h in SCENARIO.headlines:
        assert getattr(QUICK, h.knob) != h.moved


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("autoscale")
    result = invoke_scenario(out, "autoscale", FLAGS, seeds="1-2")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints one JSON object and nothing else on stdout"
    data = json.loads(lines[0])
    assert isinstance(data, dict)
    return data


def test_the_json_has_every_figure_as_a_spread_and_every_goal(cli_json: dict[str, Any]) -> None:
    assert cli_json["seeds"] == [1, 2]
    figures = cli_json["figures"]
    for name in ("static_peak_gpu_hours", "cpu_hpa_shortage_minutes", "gpu_scaler_unserved_pct",
                 "gpu_scaler_signal_age_s", "oracle_gpu_hours"):
        assert set(figures[name]) == {"median", "q1", "q3", "min", "max"}
        assert figures[name]["min"] <= figures[name]["median"] <= figures[name]["max"]
    assert [g["name"] for g in cli_json["goals"]] == [g.name for g in SCENARIO.goals]
    assert cli_json["goals_met"] == all(g["met"] for g in cli_json["goals"])
    assert not cli_json["headline_ready"]  # two seeds: a headline needs ten


def test_the_json_runs_match_an_in_process_sweep(cli_json: dict[str, Any]) -> None:
    sweep = run_seeds(SCENARIO, QUICK, (1, 2))
    for seed, run, ours in zip((1, 2), cli_json["runs"], sweep.runs, strict=True):
        assert run["seed"] == seed
        assert run["gpu_scaler_gpu_hours"] == pytest.approx(ours.gpu_scaler_gpu_hours)
        assert "trace_ready" not in run  # plot series stay out of the JSON


def test_the_report_page_has_the_scenarios_own_sections(cli_json: dict[str, Any]) -> None:
    page = Path(cli_json["report"]).read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") >= 3  # the kit's seed plot, the seed bars, the replica traces
    assert "Ready replicas against demand" in page
    for arm in ARMS:
        assert arm in page


def test_sections_draw_the_seeds_and_the_median_runs_traces() -> None:
    sweep = run_seeds(SCENARIO, QUICK, (1,))
    parts = sections(sweep)
    assert len(parts) == 4 and sum("<img" in p for p in parts) == 2
    assert "svc-0" in parts[2] and "dev-3" in parts[2]


def test_tables_and_summary_name_every_arm() -> None:
    f = SCENARIO.run(QUICK, no_progress)
    [arms, signal] = SCENARIO.tables(f)
    assert arms.columns == ARMS and len(arms.rows) == 5
    assert all(len(row) == 1 + len(ARMS) for row in arms.rows)
    assert signal.columns == ("gpu-scaler",)
    assert "static peak" in SCENARIO.summary(f) and "CPU-style HPA" in SCENARIO.summary(f)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[AutoscaleSettings]:
    return capture_settings(monkeypatch, AutoscaleSettings)


def test_settings_reach_the_run_from_set_and_yaml(tmp_path: Path, captured: list[AutoscaleSettings]) -> None:
    result = invoke_scenario(tmp_path, "autoscale", ["--set", "dcgm_collect_interval_s=60", "--set",
                                                     "dcgm_field=DCGM_FI_PROF_SM_ACTIVE"],
                             "keda_polling_s: 15\nworking_hours_start: 08:30\n")
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert (settings.dcgm_collect_interval_s, settings.dcgm_field, settings.keda_polling_s,
            settings.working_hours_start) == (60.0, "DCGM_FI_PROF_SM_ACTIVE", 15.0, "08:30")


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "non_production_services=9"], "non_production_services (9) is above services (6)"),
    (["--set", "dcgm_field=DCGM_FI_DEV_FB_FREE"], "dcgm_field"),
    (["--set", "keda_polling_s=0"], "keda_polling_s"),
    (["--set", "mean_gpus=inf"], "mean_gpus"),
    (["--set", "static_average=1"], "no such scenario field"),
])
def test_bad_input_is_refused_naming_the_field(tmp_path: Path, captured: list[AutoscaleSettings], args: list[str],
                                               message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "autoscale", args), captured, message)
