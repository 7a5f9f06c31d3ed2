"""`gpuplane simulate --scenario training-faults`: the JSON, the report, the printed table, every parameter as a
`--set` flag or a YAML field, and bad input.

Real runs are short (2 virtual days, 2 replications: ~0.1 s of simulation plus the report's plot); the parameter
and bad-input tests replace the run itself (`capture_settings`) and simulate nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from gpuplane.cli.main import app
from gpuplane.sim.training_faults import TrainingFaultsScenario, run_training_faults
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
SCENARIO = "training-faults"
SHORT_ARGS = ["--days", "2", "--set", "replications=2"]
CASES = ("baseline", "platform", "llama")
PARTS = ("productive", "checkpoint", "lost", "detection", "diagnosis", "reschedule", "restart", "checkpoint_load",
         "manual")
SWEEP_KEYS = [f"sweep_{kind}_{rate}_ettr_pct" for kind in ("baseline", "platform")
              for rate in ("0_001", "0_002", "0_004", "0_01", "0_02")]


def without_wall_time(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures less the wall-clock time and the report's path."""
    return {k: v for k, v in figures.items() if not k.endswith("wall_s") and k != "report"}


def short_run(out: Path, *more: str) -> Result:
    return runner.invoke(app, ["simulate", "--scenario", SCENARIO, *SHORT_ARGS, *more, "--out", str(out)])


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = short_run(tmp_path_factory.mktemp("training-faults"), "--json")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints one JSON object and nothing else on stdout"
    data = json.loads(lines[0])
    assert isinstance(data, dict)
    return data


# ------------------------------------------------------------------------------------------- JSON, report
def test_json_has_every_case_its_decomposition_the_sweep_and_the_verdict(cli_json: dict[str, Any]) -> None:
    for case in CASES:
        assert 0.0 < num(cli_json, f"{case}_ettr_pct") <= 100.0
        for name in ("rate_per_node_day", "gpus", "ettr_min_pct", "failures_per_run", "isolated_nodes_per_run"):
            num(cli_json, f"{case}_{name}")
        # the decomposition of the wall clock: nine shares that add up to 100 %
        assert sum(num(cli_json, f"{case}_{part}_pct") for part in PARTS) == pytest.approx(100.0, abs=0.01)
    for key in SWEEP_KEYS:
        assert 0.0 < num(cli_json, key) <= 100.0
    assert len([k for k in cli_json if k.startswith("sweep_")]) == len(SWEEP_KEYS)
    for key in ("goals_met", "goal_baseline_near_60_met", "goal_platform_met", "goal_llama_met"):
        assert isinstance(cli_json[key], bool), key
    assert cli_json["goals_met"] is (cli_json["goal_baseline_near_60_met"] and cli_json["goal_platform_met"]
                                     and cli_json["goal_llama_met"])
    assert (cli_json["scenario"], cli_json["days"], cli_json["replications"], cli_json["seed"],
            cli_json["job_gpus"], cli_json["llama_gpus"]) == (SCENARIO, 2.0, 2, 1, 1024, 16_384)
    # the headline keys
    assert cli_json["platform_ettr_pct"] > cli_json["baseline_ettr_pct"]
    num(cli_json, "platform_lost_pct")
    num(cli_json, "baseline_reschedule_pct")
    num(cli_json, "wall_s")


def test_json_is_flat(cli_json: dict[str, Any]) -> None:
    for key, value in cli_json.items():
        assert value is None or isinstance(value, str | int | float | bool), (key, value)


def test_json_matches_an_in_process_run(cli_json: dict[str, Any]) -> None:
    """The flags reach the simulation: the same settings in-process give the same figures."""
    figures = run_training_faults(TrainingFaultsScenario(days=2.0, replications=2)).figures()
    assert without_wall_time(cli_json) == without_wall_time(figures)


def test_the_report_has_one_plot_and_the_settings(cli_json: dict[str, Any]) -> None:
    report = Path(cli_json["report"])
    assert report.name == "report.html" and report.exists()
    html = report.read_text(encoding="utf-8")
    assert html.count("<img") == 1  # the sweep and the stacked decomposition, side by side in one figure
    assert html.count("data:image/png;base64,") == 1
    assert "<tr><th>days</th><td>2.0</td></tr>" in html
    assert "<tr><th>replications</th><td>2</td></tr>" in html
    assert "<tr><th>interval_formula</th><td>daly</td></tr>" in html
    assert "Goals met:" in html
    for label in ("baseline (manual, no culling)", "platform, Llama 3 rate"):
        assert label in html


def test_the_printed_table(tmp_path: Path) -> None:
    result = short_run(tmp_path)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "training-faults: 2 days, 2 runs" in text
    # the header wraps its long case names over several lines: read each column top to bottom
    headers = [line.split("┃")[1:-1] for line in text.splitlines() if line.startswith("┃")]
    assert headers and all(len(h) == 4 for h in headers), "a label column and three case columns"
    columns = [flat("".join(h[i] for h in headers)) for i in range(1, 4)]
    for column, expected in zip(columns, ["baseline (manual, no culling): 1,024 GPUs at 2 %/node-day",
                                          "platform: 1,024 GPUs at 0.1 %/node-day",
                                          "platform, Llama 3 rate: 16,384 GPUs at 0.38 %/node-day"], strict=True):
        assert column == flat(expected) or (column.endswith("…") and flat(expected).startswith(column[:-1])), column
    labels = flat("".join(line.split("│")[1] for line in text.splitlines() if line.startswith("│")))
    for label in ("ETTR (%)", "lowest run (%)", "failures per run", "nodes isolated per run",
                  "productive (% of wall)", "checkpoint load (% of wall)", "manual (% of wall)"):
        assert flat(label) in labels, label
    summary = " ".join(text.split())
    assert "ETTR: baseline" in summary and "goals met:" in summary
    assert "report:" in text and (tmp_path / "report.html").exists()


@pytest.mark.parametrize("days", ["1", "3.5"])
def test_the_days_and_seed_flags_reach_the_run(tmp_path: Path, days: str) -> None:
    result = runner.invoke(app, ["simulate", "--scenario", SCENARIO, "--days", days, "--seed", "4", "--json",
                                 "--set", "replications=1", "--set", "sweep_rates_per_node_day=[0.01]",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["days"], data["seed"], data["replications"]) == (float(days), 4, 1)
    assert [k for k in data if k.startswith("sweep_")] == ["sweep_baseline_0_01_ettr_pct",
                                                           "sweep_platform_0_01_ettr_pct"]
    expected = run_training_faults(TrainingFaultsScenario(days=float(days), seed=4, replications=1,
                                                          sweep_rates_per_node_day=(0.01,))).figures()
    assert without_wall_time(data) == without_wall_time(expected)


# ------------------------------------------------------------------------------------------- parameters
NON_DEFAULT: dict[str, tuple[Any, Any]] = {
    # field: (value as written in --set / YAML (JSON), the validated value)
    "days": (7.5, 7.5),
    "seed": (7, 7),
    "replications": (3, 3),
    "nodes": (64, 64),
    "gpus_per_node": (4, 4),
    "spare_fraction": (0.1, 0.1),
    "baseline_rate_per_node_day": (0.016, 0.016),
    "platform_rate_per_node_day": (0.002, 0.002),
    "llama_rate_per_node_day": (0.0045, 0.0045),
    "llama_gpus": (8192, 8192),
    "sweep_rates_per_node_day": ([0.005, 0.05], (0.005, 0.05)),
    "lemon_fraction": (0.05, 0.05),
    "lemon_factor": (20.0, 20.0),
    "lemon_persist": (0.5, 0.5),
    "preflight_catch": (0.3, 0.3),
    "repair_days": (1.0, 1.0),
    "probation_days": (7.0, 7.0),
    "mix_gpu": (0.42, 0.42),
    "mix_software": (0.2, 0.2),
    "mix_network": (0.3, 0.3),
    "mix_host_maintenance": (0.0, 0.0),
    "mix_host_hardware": (0.1, 0.1),
    "mix_unknown_nccl": (0.05, 0.05),
    "baseline_detection_crash_s": (600.0, 600.0),
    "baseline_detection_hang_s": (1800.0, 1800.0),
    "baseline_diagnosis_s": (1800.0, 1800.0),
    "baseline_reschedule_s": (3600.0, 3600.0),
    "baseline_restart_s": (60.0, 60.0),
    "baseline_checkpoint_load_s": (600.0, 600.0),
    "baseline_checkpoint_cost_s": (120.0, 120.0),
    "baseline_checkpoint_interval_s": (7200.0, 7200.0),
    "detection_crash_s": (5.0, 5.0),
    "detection_hang_s": (300.0, 300.0),
    "diagnosis_s": (60.0, 60.0),
    "reschedule_spare_s": (0.0, 0.0),
    "reschedule_cold_s": (7200.0, 7200.0),
    "restart_s": (120.0, 120.0),
    "checkpoint_load_s": (300.0, 300.0),
    "checkpoint_cost_s": (10.0, 10.0),
    "checkpoint_cost_cv": (0.0, 0.0),
    "interval_formula": ("young", "young"),
    "manual_probability": (0.01, 0.01),
    "manual_s": (14400.0, 14400.0),
    "goal_baseline_ettr_pct": (40.0, 40.0),
    "goal_platform_ettr_pct": (99.0, 99.0),
    "goal_llama_ettr_pct": (95.0, 95.0),
}
"""A valid value other than the default for every field of the scenario."""


def test_the_table_covers_every_field_with_a_value_off_the_default() -> None:
    assert_covers_every_field(TrainingFaultsScenario, NON_DEFAULT)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[TrainingFaultsScenario]:
    return capture_settings(monkeypatch, "run_training_faults_scenario", TrainingFaultsScenario)


@pytest.mark.parametrize("via", ["set", "yaml"])
@pytest.mark.parametrize("field", list(NON_DEFAULT))
def test_every_field_reaches_the_run(tmp_path: Path, captured: list[TrainingFaultsScenario], field: str,
                                     via: str) -> None:
    assert_field_reaches_the_run(tmp_path, "training-faults", captured, NON_DEFAULT, field, via=via)


def test_all_fields_at_once_from_yaml_and_from_set(tmp_path: Path, captured: list[TrainingFaultsScenario]) -> None:
    assert_all_fields_at_once(tmp_path, "training-faults", captured, NON_DEFAULT)


PRECEDENCE_CASES = [
    pytest.param(None, ["--days", "5"], {"days": 5.0}, id="days-flag"),
    pytest.param(None, ["--set", "days=2", "--days", "9"], {"days": 9.0}, id="days-beats-set"),
    pytest.param("days: 3\nnodes: 32\n", ["--days", "4"], {"days": 4.0, "nodes": 32}, id="days-beats-file"),
    pytest.param("nodes: 32\nseed: 4\n", ["--set", "nodes=16"], {"nodes": 16, "seed": 4}, id="set-beats-file"),
    pytest.param(None, ["--set", "seed=9", "--seed", "11"], {"seed": 11}, id="seed-flag-beats-set"),
    pytest.param(None, ["--set", "interval-formula=young", "--set", "mix-gpu=0.5"],
                 {"interval_formula": "young", "mix_gpu": 0.5}, id="dashes-and-bare-words"),
    pytest.param(None, ["--set", "sweep_rates_per_node_day=[0.01]"], {"sweep_rates_per_node_day": (0.01,)},
                 id="one-rate-sweep"),
    pytest.param("sweep_rates_per_node_day:\n  - 0.003\n  - 0.03\n", [], {"sweep_rates_per_node_day": (0.003, 0.03)},
                 id="yaml-block-list"),
    pytest.param(None, [], {"days": 30.0, "nodes": 128, "seed": 1, "replications": 20, "interval_formula": "daly"},
                 id="defaults"),
]


@pytest.mark.parametrize(("file", "args", "expected"), PRECEDENCE_CASES)
def test_settings_precedence(tmp_path: Path, captured: list[TrainingFaultsScenario], file: str | None,
                             args: list[str], expected: dict[str, Any]) -> None:
    assert_captured_run(invoke_scenario(tmp_path, SCENARIO, args, file))
    (settings,) = captured
    assert {k: getattr(settings, k) for k in expected} == expected


# ------------------------------------------------------------------------------------------------ bad input
ZERO_MIX_FLAGS = [arg for name in ("gpu", "software", "network", "host_maintenance", "host_hardware", "unknown_nccl")
                  for arg in ("--set", f"mix_{name}=0")]
ZERO_MIX_YAML = "".join(f"mix_{name}: 0\n" for name in ("gpu", "software", "network", "host_maintenance",
                                                         "host_hardware", "unknown_nccl"))

BAD_INPUT_CASES = [
    # (YAML file or None, flags, what the message must say)
    pytest.param(None, ["--set", "nosuch=1"], "--set nosuch: no such scenario field", id="unknown-set"),
    pytest.param(None, ["--set", "nodes"], "--set 'nodes': write field=value", id="set-without-value"),
    pytest.param("nosuch: 3\n", [], "s.yaml: nosuch: Extra inputs are not permitted", id="unknown-yaml-key"),
    pytest.param(None, ZERO_MIX_FLAGS, "the failure category mix must not be all zero", id="all-zero-mix"),
    pytest.param(None, ["--set", "mix_gpu=-0.1"], "scenario field mix_gpu: Input should be greater than or equal to 0",
                 id="negative-mix"),
    pytest.param(None, ["--set", "interval_formula=foo"],
                 "scenario field interval_formula: String should match pattern '^(young|daly)$'", id="formula-foo"),
    pytest.param("interval_formula: foo\n", [], "s.yaml: interval_formula: String should match pattern",
                 id="yaml-formula-foo"),
    pytest.param(None, ["--set", "baseline_rate_per_node_day=-0.1"],
                 "scenario field baseline_rate_per_node_day: Input should be greater than 0", id="negative-rate"),
    pytest.param(None, ["--set", "platform_rate_per_node_day=0"],
                 "scenario field platform_rate_per_node_day: Input should be greater than 0", id="zero-rate"),
    pytest.param(None, ["--set", "llama_rate_per_node_day=1"],
                 "scenario field llama_rate_per_node_day: Input should be less than 1", id="rate-1"),
    pytest.param(None, ["--set", "sweep_rates_per_node_day=[]"],
                 "sweep_rates_per_node_day: give rates above 0 and below 1", id="empty-sweep"),
    pytest.param(None, ["--set", "sweep_rates_per_node_day=[0.01,-0.02]"],
                 "sweep_rates_per_node_day: give rates above 0 and below 1", id="negative-sweep-rate"),
    pytest.param(None, ["--set", "sweep_rates_per_node_day=[0.01,0]"],
                 "sweep_rates_per_node_day: give rates above 0 and below 1", id="zero-sweep-rate"),
    pytest.param("sweep_rates_per_node_day: []\n", [],
                 "s.yaml: Value error, sweep_rates_per_node_day: give rates above 0",
                 id="yaml-empty-sweep"),
    pytest.param("sweep_rates_per_node_day: 0.01\n", [], "s.yaml: sweep_rates_per_node_day: Input should be a valid "
                 "tuple", id="yaml-sweep-not-a-list"),
    pytest.param(None, ["--set", "sweep_rates_per_node_day=[0.01,\"x\"]"],
                 "scenario field sweep_rates_per_node_day.1: Input should be a valid number", id="sweep-not-a-number"),
    pytest.param(None, ["--days", "0"], "scenario field days: Input should be greater than 0", id="zero-days"),
    pytest.param(None, ["--days", "400"], "scenario field days: Input should be less than or equal to 365",
                 id="too-many-days"),
    pytest.param(None, ["--set", "replications=0"],
                 "scenario field replications: Input should be greater than or equal to 1", id="zero-replications"),
    pytest.param(None, ["--set", "nodes=0"], "scenario field nodes: Input should be greater than or equal to 1",
                 id="zero-nodes"),
    pytest.param("nodes: 0\n", [], "s.yaml: nodes: Input should be greater than or equal to 1", id="yaml-zero-nodes"),
    pytest.param("nodes: lots\n", [], "s.yaml: nodes: Input should be a valid integer", id="yaml-not-a-number"),
    pytest.param(None, ["--set", "spare_fraction=1.5"],
                 "scenario field spare_fraction: Input should be less than or equal to 1", id="spares-above-1"),
    pytest.param(None, ["--set", "lemon_fraction=1"], "scenario field lemon_fraction: Input should be less than 1",
                 id="all-lemons"),
    pytest.param(None, ["--set", "lemon_factor=0.5"],
                 "scenario field lemon_factor: Input should be greater than or equal to 1", id="lemon-factor-below-1"),
    pytest.param(None, ["--set", "preflight_catch=-0.1"],
                 "scenario field preflight_catch: Input should be greater than or equal to 0", id="negative-catch"),
    pytest.param(None, ["--set", "checkpoint_cost_s=0"], "scenario field checkpoint_cost_s: Input should be greater "
                 "than 0", id="free-platform-checkpoints"),
    pytest.param(None, ["--set", "baseline_checkpoint_interval_s=0"],
                 "scenario field baseline_checkpoint_interval_s: Input should be greater than 0", id="zero-interval"),
    pytest.param(None, ["--set", "restart_s=-1"], "scenario field restart_s: Input should be greater than or equal "
                 "to 0", id="negative-time"),
    pytest.param("baseline_reschedule_s: -5\n", [], "s.yaml: baseline_reschedule_s: Input should be greater than or "
                 "equal to 0", id="yaml-negative-time"),
    pytest.param(None, ["--set", "manual_probability=2"],
                 "scenario field manual_probability: Input should be less than or equal to 1", id="probability-2"),
    pytest.param(None, ["--set", "manual_s=inf"], "scenario field manual_s: Input should be a finite number",
                 id="infinite"),
    pytest.param(None, ["--set", "lemon_factor=nan"], "scenario field lemon_factor: Input should be a finite number",
                 id="nan"),
    pytest.param(None, ["--node-policy", "spread"], "scenario field node_policy: Extra inputs are not permitted",
                 id="node-policy-is-not-a-field"),
]


@pytest.mark.parametrize(("file", "args", "message"), BAD_INPUT_CASES)
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, captured: list[TrainingFaultsScenario], file: str | None,
                                            args: list[str], message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, SCENARIO, args, file), captured, message)


def test_a_bad_yaml_field_names_the_file(tmp_path: Path, captured: list[TrainingFaultsScenario]) -> None:
    result = invoke_scenario(tmp_path, SCENARIO, [], "days: 3\ninterval_formula: foo\n")
    assert_refused(result, captured, "interval_formula: String should match pattern")
    assert flat(str(tmp_path / "s.yaml")) in flat(result.output)


def test_an_all_zero_mix_in_the_yaml_file_names_the_file(tmp_path: Path,
                                                         captured: list[TrainingFaultsScenario]) -> None:
    result = invoke_scenario(tmp_path, SCENARIO, [], ZERO_MIX_YAML)
    assert_refused(result, captured, "must not be all zero")
    assert "s.yaml" in flat(result.output)


def test_a_negative_seed_is_refused(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--scenario", SCENARIO, "--days", "1", "--seed", "-1", "--json",
                                 "--set", "replications=1", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "seed" in flat(result.output) and "Traceback" not in result.output
