"""`gpuplane simulate --scenario autoscale`: the JSON, the report, the printed table, every parameter as a
`--set` flag or a YAML field, and bad input.

Real runs are short (0.25 virtual days = 1 440 syncs on six services: ~0.1 s, plus the report's plots); the
parameter and bad-input tests replace the run itself (`capture_settings`) and simulate nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from gpuplane.cli.main import app
from gpuplane.sim.autoscale import POLICIES, AutoscaleScenario, run_autoscale
from scenario_helpers import (
    assert_all_fields_at_once,
    assert_captured_run,
    assert_covers_every_field,
    assert_field_reaches_the_run,
    assert_refused,
    capture_settings,
    flat,
    invoke_scenario,
    num,
)

runner = CliRunner()
SHORT_ARGS = ["--days", "0.25"]


def without_wall_time(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures less the wall-clock times (`wall_s` and every `*_wall_s`) and the report's path."""
    return {k: v for k, v in figures.items() if not k.endswith("wall_s") and k != "report"}


def short_run(out: Path, *more: str) -> Result:
    return runner.invoke(app, ["simulate", "--scenario", "autoscale", *SHORT_ARGS, *more, "--out", str(out)])


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = short_run(tmp_path_factory.mktemp("autoscale"), "--json")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints one JSON object and nothing else on stdout"
    data = json.loads(lines[0])
    assert isinstance(data, dict)
    return data


# ------------------------------------------------------------------------------------------- JSON, report
PER_POLICY = ("shortage_minutes", "gpu_hours", "scale_events", "zero_replica_service_hours",
              "gpu_hours_vs_oracle_pct", "shortage_cut_vs_static_pct")


def test_json_has_every_policy_and_the_verdict(cli_json: dict[str, Any]) -> None:
    for key in ("gpu_scaler_shortage_minutes", "static_average_shortage_minutes", "gpu_scaler_gpu_hours_vs_oracle_pct",
                "gpu_scaler_shortage_cut_vs_static_pct", "oracle_gpu_hours", "cpu_hpa_shortage_minutes",
                "demand_gpu_hours"):
        num(cli_json, key)
    for policy in POLICIES:
        for name in PER_POLICY:
            num(cli_json, f"{policy.replace('-', '_')}_{name}")
    for key in ("goals_met", "goal_shortage_cut_met", "goal_gpu_hours_met"):
        assert isinstance(cli_json[key], bool), key
    assert cli_json["goals_met"] is (cli_json["goal_shortage_cut_met"] and cli_json["goal_gpu_hours_met"])
    assert (cli_json["scenario"], cli_json["days"], cli_json["seed"], cli_json["services"],
            cli_json["non_production_services"]) == ("autoscale", 0.25, 1, 6, 2)
    assert cli_json["oracle_shortage_minutes"] == 0.0 and cli_json["oracle_gpu_hours_vs_oracle_pct"] == 0.0
    assert cli_json["static_average_shortage_cut_vs_static_pct"] == 0.0


def test_json_is_flat(cli_json: dict[str, Any]) -> None:
    for key, value in cli_json.items():
        assert value is None or isinstance(value, str | int | float | bool), (key, value)


def test_json_matches_an_in_process_run(cli_json: dict[str, Any]) -> None:
    """The flags reach the simulation: the same settings in-process give the same figures."""
    figures = run_autoscale(AutoscaleScenario(days=0.25)).figures()
    assert without_wall_time(cli_json) == without_wall_time(figures)


def test_the_report_has_two_plots_and_the_settings(cli_json: dict[str, Any]) -> None:
    report = Path(cli_json["report"])
    assert report.name == "report.html" and report.exists()
    html = report.read_text(encoding="utf-8")
    assert html.count("<img") == 2  # replicas against demand, and the totals
    assert html.count("data:image/png;base64,") == 2
    for name in POLICIES:
        assert f"<th>{name}</th>" in html
    assert "<tr><th>days</th><td>0.25</td></tr>" in html
    assert "<tr><th>working_hours_start</th><td>09:00</td></tr>" in html
    assert "Goals for the GPU scaler" in html


def test_the_printed_table(tmp_path: Path) -> None:
    result = short_run(tmp_path)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "autoscale: 6 services, 0.25 day(s)" in text
    # five policy columns; a narrow terminal may cut a long name short with an ellipsis
    headers = [line for line in text.splitlines() if line.startswith("┃")]
    assert len(headers) == 1, "one table"
    columns = [c.strip() for c in headers[0].split("┃")[1:-1]][1:]
    assert len(columns) == 5
    for cell, name in zip(columns, POLICIES, strict=True):
        assert cell == name or (cell.endswith("…") and name.startswith(cell[:-1])), (cell, name)
    # row labels wrap inside the first column: read that column top to bottom
    labels = flat("".join(line.split("│")[1] for line in text.splitlines() if line.startswith("│")))
    # (rich may cut a word too long for the column short: "service-minu…")
    for label in ("shortage (service-", "with demand above ready capacity)", "cut against static provisioning",
                  "GPU-hours", "against the oracle (%)", "scale events", "service-hours at zero replicas"):
        assert flat(label) in labels, label
    assert "goals met:" in " ".join(text.split())
    assert "report:" in text and (tmp_path / "report.html").exists()


def test_days_and_seed_flags_reach_the_run(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--scenario", "autoscale", "--days", "0.1", "--seed", "4", "--json",
                                 "--set", "services=2", "--set", "non_production_services=0", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["days"], data["seed"], data["services"], data["non_production_services"]) == (0.1, 4, 2, 0)
    expected = run_autoscale(AutoscaleScenario(days=0.1, seed=4, services=2, non_production_services=0)).figures()
    assert without_wall_time(data) == without_wall_time(expected)


# ------------------------------------------------------------------------------------------- parameters
NON_DEFAULT: dict[str, tuple[Any, Any]] = {
    # field: (value as written in --set / YAML (JSON), the validated value)
    "days": (0.5, 0.5),
    "seed": (7, 7),
    "services": (9, 9),
    "non_production_services": (3, 3),
    "mean_gpus": (4.0, 4.0),
    "service_size_spread": (0.25, 0.25),
    "peak_trough_ratio": (4.0, 4.0),
    "peak_hour": (9.5, 9.5),
    "noise_cv": (0.2, 0.2),
    "noise_minutes": (10.0, 10.0),
    "bursts_per_day": (0.0, 0.0),
    "burst_factor": (5.0, 5.0),
    "burst_minutes": (20.0, 20.0),
    "burst_ramp_minutes": (0.0, 0.0),
    "mix_drift_cv": (0.3, 0.3),
    "working_hours_start": ("08:30", "08:30"),
    "working_hours_end": ("18:00", "18:00"),
    "startup_s": (180.0, 180.0),
    "sync_s": (30.0, 30.0),
    "metric_delay_s": (0.0, 0.0),
    "target_util_pct": (80.0, 80.0),
    "max_replicas": (50, 50),
    "keda_polling_s": (15.0, 15.0),
    "keda_cooldown_s": (600.0, 600.0),
    "idle_cooldown_s": (120.0, 120.0),
    "cpu_at_gpu_saturation_pct": (60.0, 60.0),
    "cpu_target_pct": (50.0, 50.0),
    "goal_shortage_cut_pct": (95.0, 95.0),
    "goal_gpu_hours_over_oracle_pct": (10.0, 10.0),
}
"""A valid value other than the default for every field of the scenario."""


def test_the_table_covers_every_field_with_a_value_off_the_default() -> None:
    assert_covers_every_field(AutoscaleScenario, NON_DEFAULT)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[AutoscaleScenario]:
    return capture_settings(monkeypatch, "run_autoscale_scenario", AutoscaleScenario)


@pytest.mark.parametrize("via", ["set", "yaml"])
@pytest.mark.parametrize("field", list(NON_DEFAULT))
def test_every_field_reaches_the_run(tmp_path: Path, captured: list[AutoscaleScenario], field: str,
                                     via: str) -> None:
    assert_field_reaches_the_run(tmp_path, "autoscale", captured, NON_DEFAULT, field, via=via)


def test_all_fields_at_once_from_yaml_and_from_set(tmp_path: Path, captured: list[AutoscaleScenario]) -> None:
    assert_all_fields_at_once(tmp_path, "autoscale", captured, NON_DEFAULT)


def test_times_of_day_need_no_quotes_on_the_command_line(tmp_path: Path, captured: list[AutoscaleScenario]) -> None:
    # 10:30 is not JSON: it stays text, and pydantic validates it as a time of day
    assert_captured_run(invoke_scenario(tmp_path, "autoscale", ["--set", "working_hours_start=10:30", "--set",
                                                "working_hours_end=22:00:30"]))
    (settings,) = captured
    assert (settings.working_hours_start, settings.working_hours_end) == ("10:30", "22:00:30")


PRECEDENCE_CASES = [
    pytest.param(None, ["--days", "0.25"], {"days": 0.25}, id="days-flag"),
    pytest.param(None, ["--set", "days=2", "--days", "0.5"], {"days": 0.5}, id="days-beats-set"),
    pytest.param("days: 3\nservices: 8\n", ["--days", "0.5"], {"days": 0.5, "services": 8}, id="days-beats-file"),
    pytest.param("services: 8\nseed: 4\n", ["--set", "services=5"], {"services": 5, "seed": 4}, id="set-beats-file"),
    pytest.param(None, ["--set", "seed=9", "--seed", "11"], {"seed": 11}, id="seed-flag-beats-set"),
    pytest.param(None, ["--set", "peak-trough-ratio=3", "--set", "cpu-target-pct=null"],
                 {"peak_trough_ratio": 3.0, "cpu_target_pct": None}, id="dashes-and-null"),
    pytest.param(None, [], {"days": 2.0, "services": 6, "seed": 1, "non_production_services": 2}, id="defaults"),
]


@pytest.mark.parametrize(("file", "args", "expected"), PRECEDENCE_CASES)
def test_settings_precedence(tmp_path: Path, captured: list[AutoscaleScenario], file: str | None, args: list[str],
                             expected: dict[str, Any]) -> None:
    assert_captured_run(invoke_scenario(tmp_path, "autoscale", args, file))
    (settings,) = captured
    assert {k: getattr(settings, k) for k in expected} == expected


# ------------------------------------------------------------------------------------------------ bad input
BAD_INPUT_CASES = [
    # (YAML file or None, flags, what the message must say)
    pytest.param(None, ["--set", "nosuch=1"], "--set nosuch: no such scenario field", id="unknown-set"),
    pytest.param(None, ["--set", "startup_s"], "--set 'startup_s': write field=value", id="set-without-value"),
    pytest.param("nosuch: 3\n", [], "s.yaml: nosuch: Extra inputs are not permitted", id="unknown-yaml-key"),
    pytest.param(None, ["--set", "non_production_services=7"], "non_production_services (7) is above services (6)",
                 id="non-production-above-services"),
    pytest.param(None, ["--set", "services=2", "--set", "non_production_services=3"],
                 "non_production_services (3) is above services (2)", id="non-production-above-set-services"),
    pytest.param(None, ["--set", "working_hours_start=25:00"],
                 "scenario field working_hours_start: Value error, '25:00' is not a time of day HH:MM",
                 id="bad-clock"),
    pytest.param(None, ["--set", "working_hours_end=9h"],
                 "scenario field working_hours_end: Value error, '9h' is not a time of day HH:MM", id="bad-clock-text"),
    pytest.param("working_hours_end: \"19:61\"\n", [], "s.yaml: working_hours_end: Value error, '19:61' is not a time",
                 id="yaml-bad-clock"),
    # YAML 1.1 reads an unquoted 10:30 as the base-60 integer 630: refused, naming the file and the field
    pytest.param("working_hours_start: 10:30\n", [], "s.yaml: working_hours_start: Input should be a valid string",
                 id="yaml-unquoted-clock"),
    pytest.param(None, ["--set", "startup_s=-1"],
                 "scenario field startup_s: Input should be greater than or equal to 0", id="negative-startup"),
    pytest.param("startup_s: -5\n", [], "s.yaml: startup_s: Input should be greater than or equal to 0",
                 id="yaml-negative-startup"),
    pytest.param("services: 0\n", [], "s.yaml: services: Input should be greater than or equal to 1",
                 id="yaml-zero-services"),
    pytest.param("mean_gpus: lots\n", [], "s.yaml: mean_gpus: Input should be a valid number", id="yaml-not-a-number"),
    pytest.param(None, ["--set", "target_util_pct=0"], "scenario field target_util_pct: Input should be greater than 0",
                 id="zero-target"),
    pytest.param(None, ["--set", "target_util_pct=120"],
                 "scenario field target_util_pct: Input should be less than or equal to 100", id="target-above-100"),
    pytest.param(None, ["--set", "service_size_spread=1"],
                 "scenario field service_size_spread: Input should be less than 1", id="spread-1"),
    pytest.param(None, ["--set", "peak_hour=24"], "scenario field peak_hour: Input should be less than 24",
                 id="peak-hour-24"),
    pytest.param(None, ["--set", "peak_trough_ratio=0.5"],
                 "scenario field peak_trough_ratio: Input should be greater than or equal to 1", id="ratio-below-1"),
    pytest.param(None, ["--set", "sync_s=0"], "scenario field sync_s: Input should be greater than 0", id="zero-sync"),
    pytest.param(None, ["--set", "max_replicas=0"],
                 "scenario field max_replicas: Input should be greater than or equal to 1", id="zero-max-replicas"),
    pytest.param(None, ["--set", "noise_cv=nan"], "scenario field noise_cv: Input should be a finite number",
                 id="nan"),
    pytest.param(None, ["--days", "0"], "scenario field days: Input should be greater than 0", id="zero-days"),
    pytest.param(None, ["--days", "31"], "scenario field days: Input should be less than or equal to 30",
                 id="too-many-days"),
    pytest.param(None, ["--set", "goal_shortage_cut_pct=120"],
                 "scenario field goal_shortage_cut_pct: Input should be less than or equal to 100",
                 id="goal-above-100"),
    pytest.param(None, ["--node-policy", "spread"], "scenario field node_policy: Extra inputs are not permitted",
                 id="node-policy-is-not-a-field"),
]


@pytest.mark.parametrize(("file", "args", "message"), BAD_INPUT_CASES)
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, captured: list[AutoscaleScenario], file: str | None,
                                            args: list[str], message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "autoscale", args, file), captured, message)


def test_a_bad_pair_in_the_yaml_file_names_the_file(tmp_path: Path, captured: list[AutoscaleScenario]) -> None:
    result = invoke_scenario(tmp_path, "autoscale", [], "services: 3\nnon_production_services: 4\n")
    assert_refused(result, captured, "non_production_services (4) is above services (3)")
    assert "s.yaml" in flat(result.output)


INFINITE = ["mean_gpus", "peak_trough_ratio", "burst_factor", "noise_cv", "mix_drift_cv", "sync_s", "metric_delay_s"]
"""Fields without an upper bound whose infinity crashes the run (OverflowError / ValueError tracebacks)."""


@pytest.mark.parametrize("field", INFINITE)
def test_an_infinite_value_is_refused(tmp_path: Path, captured: list[AutoscaleScenario], field: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "autoscale", ["--set", f"{field}=inf"]), captured, field)


def test_an_infinite_mean_is_refused_by_the_real_run(tmp_path: Path) -> None:
    result = short_run(tmp_path, "--set", "mean_gpus=inf", "--json")
    assert result.exit_code == 2, result.output
    assert "mean_gpus" in flat(result.output) and "Traceback" not in result.output
