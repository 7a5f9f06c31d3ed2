"""The tidal scenario: what lending inference nodes to training at night buys and costs, a load spike, the
accounting, the report and JSON, and scenario parameters.

Every run is small (20–36 inference nodes, 4 training nodes, 2–3 virtual days, warm-up 6 h) so the file stays
fast; runs are shared between tests through module-scoped fixtures. The default scenario (200 + 40 nodes,
7 days, ~50 s) is never run here.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import gpuplane.report.tidal as tidal_report
from gpuplane.cli.main import app
from gpuplane.controllers import DrainOrder
from gpuplane.model import default_catalog
from gpuplane.report.html import png
from gpuplane.report.tidal import write_tidal_report
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.sim.tidal import TidalComparison, TidalRun, TidalScenario, run_tidal_comparison
from scenario_helpers import assert_refused, capture_settings, flat, invoke_scenario, num, without_wall_time

Figures = dict[str, float | int | str]

runner = CliRunner()
CATALOG = default_catalog()
SMALL: dict[str, Any] = {"days": 2, "inference_nodes": 20, "training_nodes": 4, "services": 3, "warmup_hours": 6}
"""The defaults, shrunk: 20 inference nodes (4 stable, 16 loanable), 4 training nodes, 3 services, 2 virtual
days, the first 6 h left out (~1.4 s a comparison)."""
SMALL_ARGS = ["--days", "2", "--set", "inference_nodes=20", "--set", "training_nodes=4", "--set", "services=3",
              "--set", "warmup_hours=6"]
"""SMALL as command-line flags."""

SETTINGS: dict[str, dict[str, Any]] = {
    "defaults-small": SMALL,
    "seed7-ratio3-5svc-30nodes-3days": SMALL | {"seed": 7, "peak_trough_ratio": 3.0, "services": 5,
                                                "inference_nodes": 30, "days": 3},
    "seed3-whole-cards-short-window-newest": SMALL | {"seed": 3, "fraction_share": 1.0, "lend_from": "00:30",
                                                      "reclaim_at": "06:30", "drain_order": "newest",
                                                      "inference_nodes": 36},
}
"""The claims must hold at the defaults' shape and beyond: another seed, a deeper night trough, more services
and nodes over 3 days; whole cards only, a shorter loan window and Kubernetes' own drain order."""

SPIKE = (26.0, 2.0, 3.0)
"""An unforeseen ×3 load spike from hour 26 (day 2, 02:00) for 2 h: inside the loan window 23:30–07:30."""


def compare(**fields: Any) -> TidalComparison:
    """Run both arms of the scenario in-process, as the CLI does (no typical pods for the profile)."""
    scenario = TidalScenario(**fields)
    profile = default_registry().build(PolicyConfig(node_policy=scenario.node_policy, seed=scenario.seed))
    return run_tidal_comparison(CATALOG, scenario, profile)





def measured_hours(scenario: TidalScenario) -> float:
    return scenario.days * 24.0 - scenario.warmup_hours


@pytest.fixture(scope="module")
def comparisons() -> dict[str, TidalComparison]:
    return {name: compare(**fields) for name, fields in SETTINGS.items()}


@pytest.fixture(scope="module")
def runs(comparisons: dict[str, TidalComparison]) -> dict[str, Figures]:
    return {name: comparison.figures() for name, comparison in comparisons.items()}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tidal")
    result = runner.invoke(app, ["simulate", "--scenario", "tidal", *SMALL_ARGS, "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "--json prints one JSON object and nothing else on stdout"
    data: dict[str, Any] = json.loads(lines[0])
    return data


# ------------------------------------------------------------------------------------ what lending buys
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tidal_lends_a_fifth_of_inference_gpus_at_night(runs: dict[str, Figures], setting: str) -> None:
    f = runs[setting]
    # Seen: 47.645, 53.441, 52.030 % of inference GPUs lent, on average, over the loan window's samples.
    # Lending broken (nothing lent) gives 0; 20 leaves more than half of that margin.
    assert num(f, "night_conversion_pct") >= 20.0
    assert num(f, "night_conversion_pct") <= 100.0 * (1 - SETTINGS[setting].get("stable_share", 0.2)) + 1e-9
    assert num(f, "loans") > 0 and num(f, "lent_gpu_hours") > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_lending_raises_utilisation_and_cuts_inference_cost(runs: dict[str, Figures], setting: str) -> None:
    f = runs[setting]
    # Seen (utilisation gain points, cost cut %, training GPU-h gained): defaults-small 9.535, 11.564, 856.0;
    # seed7 11.706, 14.775, 2338.0; seed3 8.153, 8.212, 1220.0. Lending broken gives 0 (or less) for each.
    gain = num(f, "utilisation_gain_points")
    assert gain > 0
    # each side is rounded to 3 places
    assert gain == pytest.approx(num(f, "tidal_utilisation_pct") - num(f, "baseline_utilisation_pct"), abs=0.002)
    assert num(f, "allocation_gain_points") > 0
    assert num(f, "inference_cost_cut_pct") > 0
    assert num(f, "training_gpu_hours_gained") > 0
    assert num(f, "training_gpu_hours_gained") == pytest.approx(
        num(f, "tidal_training_gpu_hours") - num(f, "baseline_training_gpu_hours"), abs=0.11)
    assert num(f, "tidal_training_jobs_done") >= num(f, "baseline_training_jobs_done")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_lending_costs_no_slo_minutes_and_little_training_work(runs: dict[str, Figures], setting: str) -> None:
    f = runs[setting]
    # Seen: SLO service-minutes equal in both arms (10/10, 45/45, 15/15; all from the load noise,
    # the noise-free defaults-small run below has none);
    # training work lost to reclaim 0.0 GPU-h in all three (jobs checkpoint ahead of the planned reclaim).
    assert f["slo_violation_minutes_added_by_tidal"] == 0
    assert num(f, "tidal_slo_violation_minutes") <= num(f, "baseline_slo_violation_minutes")
    assert num(f, "training_lost_to_reclaim_pct_of_lent") <= 1.0
    assert num(f, "training_lost_to_reclaim_gpu_hours") <= 0.01 * num(f, "lent_gpu_hours") + 0.005


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fewest_instances_drain_empties_the_most_nodes(runs: dict[str, Figures], setting: str) -> None:
    f = runs[setting]
    # Seen (fewest-instances / newest / random nodes emptied per night): 14.5 / 7.5 / 0.0; 11.0 / 1.0 / 0.2;
    # 17.7 / 17.0 / 0.7 (the last run drains newest-first itself; the counts compare orders on the same pods).
    fewest = num(f, "drain_nodes_emptied_fewest_instances")
    assert fewest > 0
    assert fewest >= num(f, "drain_nodes_emptied_newest")
    assert fewest >= num(f, "drain_nodes_emptied_random")
    assert f["drain_order"] == SETTINGS[setting].get("drain_order", DrainOrder.FEWEST_INSTANCES.value)


# ------------------------------------------------------------------------------------------ the baseline
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_baseline_lends_nothing(comparisons: dict[str, TidalComparison], runs: dict[str, Figures],
                                    setting: str) -> None:
    base, tidal = comparisons[setting].baseline, comparisons[setting].tidal
    assert not base.lend and tidal.lend
    assert base.loans == 0 and base.early_reclaims == 0
    assert set(base.nodes_lent) == {0} and set(base.lent_gpus) == {0}
    assert base.lent_gpu_hours == 0 and base.training_gpu_hours_on_lent == 0
    assert base.slo_violation_minutes_while_lent == 0
    # lent GPU-hours, loans and training on lent nodes come from the tidal run only
    f = runs[setting]
    assert f["lent_gpu_hours"] == round(tidal.lent_gpu_hours, 1)
    assert f["training_gpu_hours_on_lent_nodes"] == round(tidal.training_gpu_hours_on_lent, 1)
    assert f["loans"] == tidal.loans and f["early_reclaims"] == tidal.early_reclaims


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_baseline_inference_gpu_hours_are_all_inference_gpus_over_the_measured_hours(
        comparisons: dict[str, TidalComparison], runs: dict[str, Figures], setting: str) -> None:
    scenario = comparisons[setting].scenario
    gpus = scenario.inference_nodes * scenario.gpus_per_node
    assert num(runs[setting], "baseline_inference_gpu_hours") == pytest.approx(
        gpus * measured_hours(scenario), abs=0.051)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_baseline_keeps_every_inference_gpu_at_every_sample(comparisons: dict[str, TidalComparison],
                                                            setting: str) -> None:
    """Without the warm-up off-by-one above, the baseline's inference GPU-hours are all its GPUs all along:
    within one sample interval of inference GPUs × measured hours."""
    scenario, base = comparisons[setting].scenario, comparisons[setting].baseline
    gpus = scenario.inference_nodes * scenario.gpus_per_node
    assert base.inference_gpus == gpus
    assert set(base.nodes_inference) == {scenario.inference_nodes}
    low = gpus * measured_hours(scenario)
    assert low - 1e-6 <= base.inference_gpu_hours <= low + gpus * scenario.sample_every_s / 3600.0 + 1e-6


# ---------------------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_gpu_hours_add_up(runs: dict[str, Figures], setting: str) -> None:
    f = runs[setting]
    # e.g. defaults-small: 5954.7 + 778.7 = 6733.4 against 6733.3; three figures each rounded to 1 place
    assert num(f, "tidal_inference_gpu_hours") + num(f, "lent_gpu_hours") == pytest.approx(
        num(f, "baseline_inference_gpu_hours"), abs=0.151)
    assert num(f, "inference_cost_cut_pct") == pytest.approx(
        num(f, "lent_gpu_hours") * 100.0 / num(f, "baseline_inference_gpu_hours"), abs=0.01)
    # training runs on a lent node only while it is lent (seen 684.7 of 778.7, 2205.3 of 2343.3, 946.7 of 995.3)
    assert 0 < num(f, "training_gpu_hours_on_lent_nodes") <= num(f, "lent_gpu_hours")
    assert num(f, "training_gpu_hours_on_lent_nodes") <= num(f, "tidal_training_gpu_hours")


def _check_series(run: TidalRun, scenario: TidalScenario) -> None:
    samples = len(run.time_s)
    assert samples == int(scenario.days * 86400 / scenario.sample_every_s) + 1
    for series in (run.utilisation_pct, run.allocation_pct, run.nodes_inference, run.nodes_lent,
                   run.nodes_training, run.lent_gpus, run.night_mask):
        assert len(series) == samples
    for own, lent, training, gpus in zip(run.nodes_inference, run.nodes_lent, run.nodes_training, run.lent_gpus,
                                         strict=True):
        assert own + lent == scenario.inference_nodes
        assert training == scenario.training_nodes + lent
        assert gpus == lent * scenario.gpus_per_node
        assert 0 <= lent <= scenario.tidal_nodes  # stable nodes are never lent
    assert all(0 <= u <= 100 for u in run.utilisation_pct)
    assert all(0 <= a <= 100 + 1e-9 for a in run.allocation_pct)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_node_series_add_up(comparisons: dict[str, TidalComparison], setting: str) -> None:
    comparison = comparisons[setting]
    for run in (comparison.baseline, comparison.tidal):
        _check_series(run, comparison.scenario)
    # nodes are lent only in the lend phase, never during the day (a loan may outlive the sample at reclaim_at
    # by one reconcile, so look a minute away from the window's edges)
    tidal, window = comparison.tidal, comparison.scenario.window()
    day = [lent for t, lent in zip(tidal.time_s, tidal.nodes_lent, strict=True)
           if window.phase(t - 60) == "day" and window.phase(t) == "day"]
    assert day and set(day) == {0}


# ------------------------------------------------------------------------------------- an unforeseen spike
@pytest.fixture(scope="module")
def spike_runs() -> dict[str, TidalComparison]:
    return {
        "spike": compare(**SMALL, spikes=(SPIKE,)),
        "noise-free": compare(**SMALL, noise_cv=0),
        "noise-free-spike": compare(**SMALL, noise_cv=0, spikes=(SPIKE,)),
    }


def test_the_spike_lands_inside_the_loan_window() -> None:
    scenario = TidalScenario(**SMALL, spikes=(SPIKE,))
    window = scenario.window()
    assert (window.shrink_at, window.lend_from, window.reclaim_at) == ("22:30", "23:30", "07:30")
    start, length, _ = SPIKE
    # hour 26 is 02:00 of day 2 and the spike ends at 04:00, both in the night that began at 23:30 on day 1
    assert window.phase(start * 3600.0) == "lend"
    assert window.phase((start + length) * 3600.0 - 1.0) == "lend"
    assert window.phase(23.5 * 3600.0) == "lend" and window.phase(31.5 * 3600.0) == "day"
    assert start >= scenario.warmup_hours and start + length <= scenario.days * 24.0


def test_a_spike_triggers_early_reclaims(spike_runs: dict[str, TidalComparison],
                                         runs: dict[str, Figures]) -> None:
    spiked, calm = spike_runs["spike"].figures(), runs["defaults-small"]
    # Seen: 17 early reclaims with the spike against 7 without (the forecast's horizon reaching the morning
    # ramp and noise reclaim a few anyway).
    assert num(spiked, "early_reclaims") > 0
    assert num(spiked, "early_reclaims") > num(calm, "early_reclaims")
    # the nodes come back at the spike: seen 11 lent at 26:00, 0 at 26:05 and until the spike ends, 9 at 28:05
    run = spike_runs["spike"].tidal
    lent = dict(zip(run.time_s, run.nodes_lent, strict=True))
    start, length, _ = SPIKE
    before = lent[start * 3600.0]  # the sample at the onset: the controller has not seen the spike yet
    during = [n for t, n in lent.items() if start * 3600.0 + 300.0 <= t < (start + length) * 3600.0]
    assert before > 0
    assert during and max(during) < before
    # the tidal run lends less that night than without the spike (seen 36.074 against 47.645 %)
    assert num(spiked, "night_conversion_pct") < num(calm, "night_conversion_pct")


def test_a_spike_adds_no_slo_minutes_beyond_the_baseline(spike_runs: dict[str, TidalComparison],
                                                         runs: dict[str, Figures]) -> None:
    spiked, calm = spike_runs["spike"].figures(), runs["defaults-small"]
    # The spike itself costs both arms the same: seen 50.0 service-minutes in each against 10.0 without it.
    assert num(spiked, "baseline_slo_violation_minutes") > num(calm, "baseline_slo_violation_minutes")
    assert spiked["slo_violation_minutes_added_by_tidal"] == 0
    assert num(spiked, "tidal_slo_violation_minutes") <= num(spiked, "baseline_slo_violation_minutes")
    assert num(spiked, "training_lost_to_reclaim_pct_of_lent") <= 1.0


def test_the_spike_costs_both_arms_only_its_onset_sample(spike_runs: dict[str, TidalComparison]) -> None:
    """Why both arms violate during the spike: it is unforeseen (the forecast is the noise-free curve and the
    load now), and it starts exactly on a sample (26 h = 312 × 300 s), where every service's load is ×3 against
    replicas sized before it. Without noise that single sample is all: services × 5 min = 15 service-minutes in
    each arm, against 0 without the spike. (With the default noise both arms see more, 50 each, equally.)"""
    calm, spiked = spike_runs["noise-free"].figures(), spike_runs["noise-free-spike"].figures()
    assert calm["baseline_slo_violation_minutes"] == 0 and calm["tidal_slo_violation_minutes"] == 0
    onset = SMALL["services"] * spike_runs["noise-free-spike"].scenario.sample_every_s / 60.0
    assert spiked["baseline_slo_violation_minutes"] == onset
    assert spiked["tidal_slo_violation_minutes"] == onset
    assert spiked["slo_violation_minutes_added_by_tidal"] == 0
    assert num(spiked, "early_reclaims") > num(calm, "early_reclaims")  # seen 14 against 5


# ----------------------------------------------------------------------------------------- determinism
def test_same_settings_give_identical_figures(runs: dict[str, Figures], cli_run: dict[str, Any]) -> None:
    """The CLI run and the in-process run of the same settings are two independent runs."""
    assert without_wall_time(cli_run) == without_wall_time(runs["defaults-small"])


def test_a_rerun_gives_identical_figures_and_other_settings_differ(comparisons: dict[str, TidalComparison],
                                          runs: dict[str, Figures]) -> None:
    """Re-running one of the settings gives the same figures; the settings themselves differ."""
    name = "seed3-whole-cards-short-window-newest"
    again = compare(**SETTINGS[name]).figures()
    assert without_wall_time(again) == without_wall_time(runs[name])
    assert without_wall_time(runs[name]) != without_wall_time(runs["defaults-small"])


# ------------------------------------------------------------------------------------------ JSON, report
COUNT_KEYS = {"gpus", "days", "inference_nodes", "training_nodes", "loans", "early_reclaims"}
"""Numeric keys whose name is itself the unit (a count of GPUs, days, nodes, loans, reclaims). Other keys end
in a unit, or in a unit and a qualifier (`training_gpu_hours_on_lent_nodes`, `..._pct_of_lent`)."""
UNIT_PATTERN = re.compile(
    r".*(_pct|_points|_gpu_hours|_minutes|_s|_jobs_done)(_gained|_on_lent_nodes|_while_lent|_added_by_tidal|_of_lent)?$"
    r"|drain_nodes_emptied_.*")


def test_json_is_one_flat_object_with_units_in_the_keys(cli_run: dict[str, Any]) -> None:
    for key in ("night_conversion_pct", "utilisation_gain_points", "slo_violation_minutes_added_by_tidal",
                "training_lost_to_reclaim_pct_of_lent", "inference_cost_cut_pct", "training_gpu_hours_gained",
                "lent_gpu_hours", "early_reclaims", "drain_nodes_emptied_fewest_instances",
                "drain_nodes_emptied_newest", "drain_nodes_emptied_random", "report"):
        assert key in cli_run, key
    for key, value in cli_run.items():
        assert isinstance(value, str | int | float | bool), (key, value)  # no nested dicts or lists
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "seed":
            assert key in COUNT_KEYS or UNIT_PATTERN.fullmatch(key), f"{key} carries no unit"
    assert cli_run["scenario"] == "tidal" and cli_run["drain_order"] == "fewest-instances"
    assert (cli_run["days"], cli_run["seed"], cli_run["inference_nodes"], cli_run["training_nodes"]) == (2, 42, 20, 4)
    assert cli_run["gpus"] == (20 + 4) * 8


def test_report_holds_the_comparison_table_and_a_plot(cli_run: dict[str, Any]) -> None:
    report = Path(cli_run["report"])
    assert report.name == "report.html" and report.exists()
    html = report.read_text(encoding="utf-8")
    assert "<tr><th></th><th>baseline</th><th>tidal</th></tr>" in html
    # the table's cells are the JSON's figures
    row = (f"<tr><th>inference GPU-hours (its cost)</th><td>{cli_run['baseline_inference_gpu_hours']}</td>"
           f"<td>{cli_run['tidal_inference_gpu_hours']}</td></tr>")
    assert row in html
    row = (f"<tr><th>daily average GPU utilisation (%)</th><td>{cli_run['baseline_utilisation_pct']}</td>"
           f"<td>{cli_run['tidal_utilisation_pct']}</td></tr>")
    assert row in html
    assert (f"<tr><th>night conversion (% of inference GPUs lent in the loan window)</th>"
            f"<td>{cli_run['night_conversion_pct']}</td></tr>") in html
    assert (f"<tr><th>SLO violation minutes added by tidal (must be 0)</th>"
            f"<td>{cli_run['slo_violation_minutes_added_by_tidal']}</td></tr>") in html
    assert f"<tr><th>loans / early reclaims</th><td>{cli_run['loans']} / {cli_run['early_reclaims']}</td></tr>" in html
    assert "<tr><th>inference_nodes</th><td>20</td></tr>" in html  # the settings table
    # one embedded PNG: nodes per pool and utilisation over the week
    assert html.count("data:image/png;base64,") == 1
    match = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert match is not None
    data = base64.b64decode(match.group(1))
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_the_plot_shows_nodes_per_pool_and_utilisation(comparisons: dict[str, TidalComparison], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def spy(fig: Any) -> str:
        seen.append({"titles": [ax.get_title() for ax in fig.axes], "ylabels": [ax.get_ylabel() for ax in fig.axes],
                     "legends": [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]})
        return png(fig)

    monkeypatch.setattr(tidal_report, "png", spy)
    write_tidal_report(comparisons["defaults-small"], tmp_path / "report.html")
    (plot,) = seen
    assert plot["ylabels"] == ["nodes", "GPU utilisation (%)"]
    assert plot["titles"][0] == "Nodes per pool over the week (tidal)"
    nodes_legend, utilisation_legend = plot["legends"]
    assert {"inference (own)", "lent to training", "training (dedicated + lent)"} <= set(nodes_legend)
    assert {"baseline (no lending)", "tidal"} <= set(utilisation_legend)


# ------------------------------------------------------------------------------------------ parameters
SCENARIO_FILE = """\
inference_nodes: 24
training_nodes: 4
services: 3
warmup_hours: 6
days: 3
"""


def test_scenario_file_then_set_then_days(tmp_path: Path, runs: dict[str, Figures]) -> None:
    """A real run: the file sets fields, --set overrides the file, --days overrides both; tables are printed.
    The result is defaults-small, so the printed figures are that run's."""
    path = tmp_path / "tidal.yaml"
    path.write_text(SCENARIO_FILE)
    out = tmp_path / "out"
    result = runner.invoke(app, ["simulate", "--scenario", "tidal", "--scenario-file", str(path),
                                 "--set", "inference_nodes=20", "--set", "days=2.5", "--days", "2",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "tidal: 20 inference + 4 training nodes, 2 day(s)" in text, text
    assert "baseline" in text and "inference GPU-hours (its cost)" in text
    f = runs["defaults-small"]
    assert (f"night conversion {f['night_conversion_pct']} %, utilisation gain {f['utilisation_gain_points']} "
            f"points, SLO minutes added {f['slo_violation_minutes_added_by_tidal']}") in text
    html = (out / "report.html").read_text(encoding="utf-8")
    settings = {"inference_nodes": "20", "training_nodes": "4", "services": "3", "warmup_hours": "6.0",
                "days": "2.0"}  # file: 24 nodes, 3 days; --set: 20 nodes, 2.5 days; --days: 2
    for field, value in settings.items():
        assert f"<tr><th>{field}</th><td>{value}</td></tr>" in html, field


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[TidalScenario]:
    """Replace the run itself: the CLI's settings are recorded and nothing is simulated."""
    return capture_settings(monkeypatch, "run_tidal_scenario", TidalScenario)


PRECEDENCE_CASES = [
    pytest.param(True, [], {"inference_nodes": 24, "training_nodes": 4, "services": 3, "warmup_hours": 6.0,
                            "days": 3.0}, id="file"),
    pytest.param(True, ["--set", "inference_nodes=20", "--set", "services=5"],
                 {"inference_nodes": 20, "services": 5, "days": 3.0, "training_nodes": 4}, id="set-beats-file"),
    pytest.param(True, ["--set", "days=2.5", "--days", "2"], {"days": 2.0}, id="days-beats-set-and-file"),
    pytest.param(True, ["--seed", "11", "--node-policy", "spread"], {"seed": 11, "node_policy": "spread"},
                 id="flags-beat-file"),
    pytest.param(False, ["--set", "seed=9", "--seed", "11"], {"seed": 11}, id="seed-flag-beats-set"),
    pytest.param(False, ["--set", "peak-trough-ratio=3", "--set", "drain_order=random",
                         "--set", "reclaim_at=06:00", "--set", "fraction_share=1"],
                 {"peak_trough_ratio": 3.0, "drain_order": DrainOrder.RANDOM, "reclaim_at": "06:00",
                  "fraction_share": 1.0}, id="set-parses-types-and-dashes"),
    pytest.param("spikes: [[26, 2, 3.0]]\njob_nodes: [1, 2]\njob_work_hours: [1, 4]\n", [],
                 {"spikes": ((26.0, 2.0, 3.0),), "job_nodes": (1, 2), "job_work_hours": (1.0, 4.0)},
                 id="file-sets-tuples"),
    pytest.param(False, [], {"days": 7.0, "inference_nodes": 200, "training_nodes": 40, "seed": 42,
                             "node_policy": "binpack", "drain_order": DrainOrder.FEWEST_INSTANCES}, id="defaults"),
    pytest.param("days: 0.25\n", ["--days", "2"], {"days": 2.0, "warmup_hours": 12.0},
                 id="days-flag-rescues-file"),
    pytest.param(False, ["--set", "spikes=[[26,2,3.0]]", "--set", "job_nodes=[1,2]",
                         "--set", "job_work_hours=[1,4]"],
                 {"spikes": ((26.0, 2.0, 3.0),), "job_nodes": (1, 2), "job_work_hours": (1.0, 4.0)},
                 id="set-sets-tuples"),
]


@pytest.mark.parametrize(("file", "args", "expected"), PRECEDENCE_CASES)
def test_settings_precedence(tmp_path: Path, captured: list[TidalScenario], file: bool | str, args: list[str],
                             expected: dict[str, Any]) -> None:
    """Defaults, then the YAML file, then --set, then --days/--seed/--node-policy."""
    text = (file if isinstance(file, str) else SCENARIO_FILE) if file else None
    result = invoke_scenario(tmp_path, "tidal", args, text)
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert {k: getattr(settings, k) for k in expected} == expected
    assert json.loads(result.stdout) == {"captured": True}


SMALL_FILE = "inference_nodes: 20\ntraining_nodes: 4\n"
"""20 inference nodes (16 loanable) and 4 training nodes: no job above 20 nodes can ever run."""

BAD_INPUT_CASES = [
    # (YAML file or None, flags, what the message must say)
    pytest.param(None, ["--set", "nosuch=1"], "--set nosuch: no such scenario field", id="unknown-set"),
    pytest.param("inference_nodes: 20\nnosuch: 3\n", [], "s.yaml: nosuch: Extra inputs are not permitted",
                 id="unknown-yaml-key"),
    pytest.param(None, ["--set", "reclaim_at=25:00"], "scenario field reclaim_at: Value error, '25:00' is not a "
                 "time of day HH:MM", id="reclaim-at-25h"),
    pytest.param(None, ["--set", "lend_from=12:00"],
                 "lend_from 12:00 is not between shrink_at 22:30 and reclaim_at 07:30", id="lend-from-outside"),
    pytest.param(None, ["--set", "shrink_at=07:30"], "shrink_at and reclaim_at are the same time",
                 id="empty-window"),
    pytest.param(SMALL_FILE + "job_nodes: [1, 64]\n", [], "job_nodes: a job of 64 nodes can never run",
                 id="yaml-job-too-big"),
    pytest.param(SMALL_FILE, ["--set", "job_nodes=[64]"], "job_nodes: a job of 64 nodes can never run",
                 id="set-job-too-big"),
    pytest.param("training_nodes: 0\ninference_nodes: 10\njob_nodes: [9]\n", [],
                 "job_nodes: a job of 9 nodes can never run", id="no-training-nodes-job-too-big"),
    pytest.param("job_work_hours: [5, 1]\n", [], "job_work_hours must be 0 < low <= high, got (5.0, 1.0)",
                 id="yaml-work-low-above-high"),
    pytest.param(None, ["--set", "job_work_hours=[5,1]"], "job_work_hours must be 0 < low <= high, got (5.0, 1.0)",
                 id="set-work-low-above-high"),
    pytest.param("job_nodes: [0, 2]\n", [], "job_nodes: every gang needs at least one node", id="zero-node-job"),
    # 48 h of warm-up × 3600 = 172800 s = 2 days × 86400: nothing left to measure
    pytest.param(None, ["--set", "warmup_hours=48", "--days", "2"],
                 "warmup_hours 48.0 leaves nothing of 2.0 day(s) to measure", id="warmup-equals-run"),
    pytest.param(None, ["--days", "0.25"], "warmup_hours 12.0 leaves nothing of 0.25 day(s)",
                 id="default-warmup-beyond-run"),
    pytest.param(None, ["--set", "stable_share=1.5"], "scenario field stable_share: Input should be less than 1",
                 id="stable-share-above-1"),
    pytest.param(None, ["--set", "inference_nodes=1"], "scenario field inference_nodes: Input should be greater "
                 "than or equal to 2", id="one-inference-node"),
    pytest.param(None, ["--days", "0"], "scenario field days: Input should be greater than 0", id="zero-days"),
    pytest.param(None, ["--set", "drain_order=oldest"], "scenario field drain_order", id="bad-drain-order"),
    pytest.param(None, ["--set", "peak_trough_ratio=abc"], "scenario field peak_trough_ratio: Input should be a "
                 "valid number", id="not-a-number"),
    pytest.param("stable_share: 1.5\n", [], "s.yaml: stable_share: Input should be less than 1",
                 id="yaml-stable-share"),
]


@pytest.mark.parametrize(("file", "args", "message"), BAD_INPUT_CASES)
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, captured: list[TidalScenario], file: str | None,
                                            args: list[str], message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "tidal", args, file), captured, message)


def test_unknown_node_policy_is_refused_before_any_run(tmp_path: Path) -> None:
    """The real run (no stub): the policy is checked against the registry before simulating."""
    result = runner.invoke(app, ["simulate", "--scenario", "tidal", *SMALL_ARGS, "--node-policy", "tetris",
                                 "--json", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert flat("scenario field node_policy: unknown policy 'tetris'") in flat(result.output)
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("fields", [
    {"job_nodes": (4,), "inference_nodes": 20, "training_nodes": 4},  # 4 training nodes: the baseline's limit
    {"job_nodes": (16,), "inference_nodes": 20, "training_nodes": 0},
    {"lend_from": "22:30"},  # lending may start as the window opens
    {"shrink_at": "01:00", "lend_from": "02:00", "reclaim_at": "05:00"},  # a window not crossing midnight
    {"days": 0.6, "warmup_hours": 14.39},
])
def test_valid_edge_scenarios(fields: dict[str, Any]) -> None:
    scenario = TidalScenario(**fields)
    assert {k: getattr(scenario, k) for k in fields} == fields
