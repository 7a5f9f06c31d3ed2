"""`gpuplane simulate --scenario colocation`: the JSON, the report, the printed tables, every parameter as a
`--set` flag or a YAML field, and bad input.

Real runs are tiny (0.01 virtual days = 14.4 min on one card, 4 placement nodes: ~1 s each); the parameter and
bad-input tests replace the run itself (`capture_settings`) and simulate nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import gpuplane.sim.colocation as colocation_sim
from gpuplane.cli.main import app
from gpuplane.sim.colocation import ALL_POLICIES, ColocationPolicy, ColocationScenario, figure_key, run_colocation
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
TINY_ARGS = ["--days", "0.01", "--set", "placement_nodes=4"]
TINY: dict[str, Any] = {"days": 0.01, "placement_nodes": 4}
POLICY_NAMES = [p.value for p in ALL_POLICIES]


def tiny_run(out: Path, *more: str) -> Result:
    return runner.invoke(app, ["simulate", "--scenario", "colocation", *TINY_ARGS, *more, "--out", str(out)])


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = tiny_run(tmp_path_factory.mktemp("colocation"), "--json")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints one JSON object and nothing else on stdout"
    data = json.loads(lines[0])
    assert isinstance(data, dict)
    return data


# ------------------------------------------------------------------------------------------- JSON, report
PER_POLICY = ("online_p99_ms", "online_oom_events", "offline_share_of_idle_pct", "card_utilisation_pct")


def test_json_has_every_policy_and_the_verdict(cli_json: dict[str, Any]) -> None:
    for policy in ALL_POLICIES:
        for name in PER_POLICY:
            key = f"{figure_key(policy)}_{name}"
            assert key in cli_json, key
            num(cli_json, key)
    for key in ("goals_met", "goal_p99_met", "goal_zero_online_oom_met", "goal_offline_share_met"):
        assert isinstance(cli_json[key], bool), key
    assert 0 <= num(cli_json, "offline_memory_room_pct") <= 100
    assert 0 <= num(cli_json, "placement_colocation_stranded_compute_pct") <= 100
    assert 0 <= num(cli_json, "placement_binpack_stranded_compute_pct") <= 100
    assert (cli_json["scenario"], cli_json["days"], cli_json["cards"], cli_json["seed"]) == ("colocation", 0.01, 1, 1)
    # the keys are the five policies' (time-slice -> time_slice, priority+memory-guard -> priority_memory_guard)
    assert {figure_key(p) for p in ALL_POLICIES} == {"exclusive", "time_slice", "mps", "priority",
                                                      "priority_memory_guard"}


def test_json_is_flat(cli_json: dict[str, Any]) -> None:
    for key, value in cli_json.items():
        assert value is None or isinstance(value, str | int | float | bool), (key, value)


def test_json_matches_an_in_process_run(cli_json: dict[str, Any]) -> None:
    """The flags reach the simulation: the same settings in-process give the same figures."""
    figures = run_colocation(ColocationScenario(**TINY)).figures()
    def strip(f: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in f.items() if not k.endswith("wall_s") and k != "report"}

    assert strip(cli_json) == strip(figures)


def test_the_report_has_two_plots_and_the_settings(cli_json: dict[str, Any]) -> None:
    report = Path(cli_json["report"])
    assert report.name == "report.html" and report.exists()
    html = report.read_text(encoding="utf-8")
    assert html.count("<img") == 2  # latency CDF and utilisation over the day
    assert html.count("data:image/png;base64,") == 2
    for name in POLICY_NAMES:
        assert f"<th>{name}</th>" in html
    assert "<tr><th>days</th><td>0.01</td></tr>" in html
    assert "<tr><th>placement_nodes</th><td>4</td></tr>" in html


def test_the_printed_tables(tmp_path: Path) -> None:
    result = tiny_run(tmp_path)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "colocation: 1 card(s), 0.01 day(s)" in text
    # five policy columns; a narrow terminal may cut a long name short with an ellipsis
    headers = [line for line in text.splitlines() if line.startswith("┃")]
    assert len(headers) == 2, "the comparison table and the placement table"
    policy_columns = [c for c in headers[0].split("┃")[1:-1]][1:]
    assert len(policy_columns) == 5
    for cell, name in zip(policy_columns, POLICY_NAMES, strict=True):
        cell = cell.strip()
        assert cell == name or (cell.endswith("…") and name.startswith(cell[:-1])), (cell, name)
    placement_columns = [c.strip() for c in headers[1].split("┃")[1:-1]][1:]
    assert placement_columns == ["binpack", "colocation"]
    # row labels wrap inside the first column: read that column top to bottom
    labels = flat("".join(line.split("│")[1] for line in text.splitlines() if line.startswith("│")))
    for label in ("online p99 latency (ms)", "online out-of-memory events", "daily average card utilisation (%)",
                  "offline pods placed", "stranded compute"):
        assert flat(label) in labels, label
    assert "placement of offline pods beside online pods" in text
    assert "goals met:" in " ".join(text.split())
    assert "report:" in text and (tmp_path / "report.html").exists()


# ------------------------------------------------------------------------------------------- parameters
NON_DEFAULT: dict[str, tuple[Any, Any]] = {
    # field: (value as written in --set / YAML (JSON), the validated value)
    "days": (0.5, 0.5),
    "cards": (3, 3),
    "seed": (7, 7),
    "policies": (["mps", "priority+memory-guard"], (ColocationPolicy.MPS, ColocationPolicy.PRIORITY_MEMORY_GUARD)),
    "card_memory_gib": (96.0, 96.0),
    "bucket_minutes": (15.0, 15.0),
    "online_service_ms": (7.5, 7.5),
    "online_service_cv": (0.0, 0.0),
    "online_peak_util": (0.6, 0.6),
    "peak_trough_ratio": (4.0, 4.0),
    "peak_hour": (2.5, 2.5),
    "arrival_cv": (1.0, 1.0),
    "bursts_per_day": (0.0, 0.0),
    "burst_factor": (2.0, 2.0),
    "burst_minutes": (5.0, 5.0),
    "online_base_gib": (10.0, 10.0),
    "online_request_gib": (1.5, 1.5),
    "offline_min_gib": (30.0, 30.0),
    "offline_max_gib": (40.0, 40.0),
    "offline_job_minutes": (12.0, 12.0),
    "offline_checkpoint_minutes": (3.0, 3.0),
    "offline_restart_s": (0.0, 0.0),
    "offline_gpu_hours_per_day": (6.0, 6.0),
    "timeslice_ms": (4.0, 4.0),
    "mps_online_slowdown": (1.1, 1.1),
    "mps_offline_rate_busy": (0.25, 0.25),
    "suspend_latency_ms": (2.0, 2.0),
    "min_slice_ms": (0.0, 0.0),
    "resume_overhead_ms": (1.5, 1.5),
    "guard_period_ms": (50.0, 50.0),
    "eviction_ms": (250.0, 250.0),
    "safety_margin_gib": (4.0, 4.0),
    "growth_factor": (2.0, 2.0),
    "min_growth_gib": (1.0, 1.0),
    "admit_hysteresis_gib": (0.5, 0.5),
    "growth_window_minutes": (5.0, 5.0),
    "admit_window_minutes": (0.0, 0.0),
    "placement_nodes": (4, 4),
    "placement_gpu_model": ("A100-40GB", "A100-40GB"),
    "placement_gpus_per_node": (4, 4),
    "placement_online_pods_per_card": (0.5, 0.5),
    "placement_offline_pods_per_card": (2.0, 2.0),
    "goal_p99_over_exclusive_pct": (10.0, 10.0),
    "goal_offline_share_of_idle_pct": (75.0, 75.0),
}
"""A valid value other than the default for every field of the scenario."""


def test_the_table_covers_every_field_with_a_value_off_the_default() -> None:
    assert_covers_every_field(ColocationScenario, NON_DEFAULT)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[ColocationScenario]:
    return capture_settings(monkeypatch, "run_colocation_scenario", ColocationScenario)


@pytest.mark.parametrize("via", ["set", "yaml"])
@pytest.mark.parametrize("field", list(NON_DEFAULT))
def test_every_field_reaches_the_run(tmp_path: Path, captured: list[ColocationScenario], field: str,
                                     via: str) -> None:
    assert_field_reaches_the_run(tmp_path, "colocation", captured, NON_DEFAULT, field, via=via)


def test_all_fields_at_once_from_yaml_and_from_set(tmp_path: Path, captured: list[ColocationScenario]) -> None:
    assert_all_fields_at_once(tmp_path, "colocation", captured, NON_DEFAULT)


PRECEDENCE_CASES = [
    pytest.param(None, ["--days", "0.25"], {"days": 0.25}, id="days-flag"),
    pytest.param(None, ["--set", "days=2", "--days", "0.5"], {"days": 0.5}, id="days-beats-set"),
    pytest.param("days: 3\ncards: 2\n", ["--days", "0.5"], {"days": 0.5, "cards": 2}, id="days-beats-file"),
    pytest.param("cards: 2\nseed: 4\n", ["--set", "cards=5"], {"cards": 5, "seed": 4}, id="set-beats-file"),
    pytest.param(None, ["--set", "seed=9", "--seed", "11"], {"seed": 11}, id="seed-flag-beats-set"),
    pytest.param(None, ["--set", "peak-trough-ratio=3", "--set", "policies=[\"exclusive\"]"],
                 {"peak_trough_ratio": 3.0, "policies": (ColocationPolicy.EXCLUSIVE,)}, id="dashes-and-lists"),
    pytest.param(None, [], {"days": 1.0, "cards": 1, "seed": 1, "policies": ALL_POLICIES}, id="defaults"),
]


@pytest.mark.parametrize(("file", "args", "expected"), PRECEDENCE_CASES)
def test_settings_precedence(tmp_path: Path, captured: list[ColocationScenario], file: str | None, args: list[str],
                             expected: dict[str, Any]) -> None:
    assert_captured_run(invoke_scenario(tmp_path, "colocation", args, file))
    (settings,) = captured
    assert {k: getattr(settings, k) for k in expected} == expected


# ------------------------------------------------------------------------------------------------ bad input
BAD_INPUT_CASES = [
    # (YAML file or None, flags, what the message must say)
    pytest.param(None, ["--set", "nosuch=1"], "--set nosuch: no such scenario field", id="unknown-set"),
    pytest.param("nosuch: 3\n", [], "s.yaml: nosuch: Extra inputs are not permitted", id="unknown-yaml-key"),
    pytest.param(None, ["--set", "offline_min_gib=50", "--set", "offline_max_gib=40"],
                 "offline_min_gib (50.0) is above offline_max_gib (40.0)", id="offline-min-above-max"),
    pytest.param(None, ["--set", "offline_min_gib=60"], "offline_min_gib (60.0) is above offline_max_gib (56.0)",
                 id="offline-min-above-default-max"),
    pytest.param(None, ["--set", 'policies=["exclusive","fair-share"]'],
                 "scenario field policies.1: Input should be 'exclusive', 'time-slice', 'mps', 'priority' or "
                 "'priority+memory-guard'", id="unknown-policy"),
    pytest.param("policies: [exclusive, fair-share]\n", [], "s.yaml: policies.1: Input should be 'exclusive'",
                 id="yaml-unknown-policy"),
    pytest.param(None, ["--set", "policies=[]"], "policies: name at least one policy", id="no-policies"),
    pytest.param("cards: 0\n", [], "s.yaml: cards: Input should be greater than or equal to 1", id="yaml-zero-cards"),
    pytest.param("online_peak_util: 1.2\n", [], "s.yaml: online_peak_util: Input should be less than 1",
                 id="yaml-util-above-1"),
    pytest.param("arrival_cv: lots\n", [], "s.yaml: arrival_cv: Input should be a valid number",
                 id="yaml-not-a-number"),
    pytest.param(None, ["--set", "online_base_gib=80"], "online_base_gib (80.0) leaves no room on a 80.0 GiB card",
                 id="no-room-for-offline"),
    pytest.param(None, ["--days", "0"], "scenario field days: Input should be greater than 0", id="zero-days"),
    pytest.param(None, ["--days", "15"], "scenario field days: Input should be less than or equal to 14",
                 id="too-many-days"),
    pytest.param(None, ["--set", "goal_offline_share_of_idle_pct=120"],
                 "scenario field goal_offline_share_of_idle_pct: Input should be less than or equal to 100",
                 id="goal-above-100"),
    pytest.param(None, ["--node-policy", "spread"], "scenario field node_policy: Extra inputs are not permitted",
                 id="node-policy-is-not-a-field"),
]


@pytest.mark.parametrize(("file", "args", "message"), BAD_INPUT_CASES)
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, captured: list[ColocationScenario], file: str | None,
                                            args: list[str], message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "colocation", args, file), captured, message)


def test_a_bad_pair_in_the_yaml_file_names_the_file(tmp_path: Path, captured: list[ColocationScenario]) -> None:
    result = invoke_scenario(tmp_path, "colocation", [], "offline_min_gib: 50\noffline_max_gib: 40\n")
    assert_refused(result, captured, "offline_min_gib (50.0) is above offline_max_gib (40.0)")
    assert "s.yaml" in flat(result.output)


def test_an_unknown_card_model_is_refused(tmp_path: Path) -> None:
    """The real run: exit 2, the model named, no traceback."""
    result = tiny_run(tmp_path, "--set", "placement_gpu_model=Z100", "--json")
    assert result.exit_code == 2, result.output
    assert "'Z100'" in result.output and "Traceback" not in result.output


def test_an_unknown_card_model_is_refused_before_any_run_naming_the_field(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    simulated: list[str] = []
    real = colocation_sim.run_card

    def spy(*args: Any, **kwargs: Any) -> colocation_sim.CardRun:
        simulated.append("card")
        return real(*args, **kwargs)

    monkeypatch.setattr(colocation_sim, "run_card", spy)
    result = tiny_run(tmp_path, "--set", "placement_gpu_model=Z100", "--json")
    assert result.exit_code == 2, result.output
    assert flat("placement_gpu_model") in flat(result.output)
    assert not simulated, "bad input must be refused before the run"
