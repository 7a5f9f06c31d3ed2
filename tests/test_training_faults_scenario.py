"""`gpuplane scenario training-faults`: the declarations, equal failure rates for both arms, the simulated ETTR
against the closed-form model, what quarantine does to the rate the job meets, and settings through the CLI.

The headline directions are held for every scenario by tests/test_scenario_rules.py; here the closed form
is the cross-check the issue keeps: reference §2, ETTR ≈ 1 − C/τ − (τ/2 + R)/M.
"""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import pytest

from gpuplane.controllers.recovery import DAY_S, first_order_ettr, young_interval
from gpuplane.report.training_faults import closed_form_curve, sections
from gpuplane.sim.scenario import check_scenario, run_seeds, with_overrides
from gpuplane.sim.training_faults import SCENARIO, TrainingFaultsFigures, TrainingFaultsSettings
from scenario_helpers import capture_settings, flat, invoke_scenario

QUICK = with_overrides(TrainingFaultsSettings(), dict(SCENARIO.quick))
GPU_ONLY = {"mix_gpu": 1.0, "mix_software": 0.0, "mix_network": 0.0, "mix_host_maintenance": 0.0,
            "mix_host_hardware": 0.0, "mix_unknown_nccl": 0.0}


def test_the_declarations_follow_the_rules() -> None:
    assert check_scenario(SCENARIO) == []
    assert SCENARIO.ours == "platform" and all(g.figure.startswith("platform_") for g in SCENARIO.goals)


def test_both_arms_run_at_one_failure_rate() -> None:
    # one rate setting for the fleet, none per arm: an arm cannot be given a better fleet
    fields = TrainingFaultsSettings.model_fields
    assert [name for name in fields if "rate_per" in name or "failure_rate" in name] == ["failure_rate_per_node_day"]
    assert not [name for name in fields if name.startswith(("platform_", "baseline_")) and "lemon" in name]


def test_the_baseline_saves_at_its_best_fixed_interval() -> None:
    # Young's interval for its save cost and the fleet's rate: 64 nodes x 0.004 = 0.256 failures a day,
    # M = 86,400 / 0.256 = 337,500 s, tau = sqrt(2 x 10 x 337,500) = 2,598 s
    run = SCENARIO.run(with_overrides(QUICK, {"nodes": 64, "failure_rate_per_node_day": 0.004, "days": 5.0}),
                       lambda *a: None)
    assert run.baseline_interval_s == pytest.approx(young_interval(10.0, 337_500.0)) == pytest.approx(2598.1, abs=0.1)


@pytest.fixture(scope="module")
def long_run() -> TrainingFaultsFigures:
    """One year, 16 nodes, 2 % failures per node-day, GPU faults only, no lemons and no silent nodes: about
    16 x 0.02 x 365 = 117 failures per arm, nothing but the recovery path between them."""
    s = with_overrides(QUICK, {"days": 365.0, "failure_rate_per_node_day": 0.02, "lemon_fraction": 0.0,
                               "silent_share": 0.0, "accuracy_incidents": 20, **GPU_ONLY})
    return SCENARIO.run(s, lambda *a: None)


def test_the_simulation_agrees_with_the_closed_form(long_run: TrainingFaultsFigures) -> None:
    # The closed form from the settings alone: M = 86,400 / (16 x 0.02) = 270,000 s.
    # Baseline: R = 1,200 + 3,600 + 7,200 (people) + 120 + 300 (restart, load) = 12,420 s, tau = Young's
    # sqrt(2 x 10 x 270,000) = 2,324 s: waste = 10/2,324 + (1,162 + 12,420)/270,000 = 0.43 + 5.03 = 5.46 %.
    # Its noise: ~117 failures, each costing (tau/2 + R) = 13,582 s of a 31.5 Ms year:
    # sd = sqrt(117) x 13,582 / 31.5e6 = 0.47 points; the tolerance is 3 sd = 1.4 points.
    m = DAY_S / (16 * 0.02)
    base = 100.0 * first_order_ettr(10.0, young_interval(10.0, m), 12_420.0, 16 * 0.02)
    assert base == pytest.approx(94.54, abs=0.01)
    assert long_run.baseline_ettr_pct == pytest.approx(base, abs=1.4)
    # Platform: R = 10 + 30 (detect, classify) + 2 (kubelet stop) + 120 + 300 = 462 s at tau ~ 2,324 s:
    # waste = 0.43 + (1,162 + 462)/270,000 = 1.03 %; sd = sqrt(117) x 1,624 / 31.5e6 = 0.06 points. The
    # tolerance, 0.4 points, also covers the few restarts a verdict gets wrong and the planner's interval
    # drifting with the failures it observes.
    plat = 100.0 * first_order_ettr(10.0, young_interval(10.0, m), 462.0, 16 * 0.02)
    assert long_run.platform_ettr_pct == pytest.approx(plat, abs=0.4)
    # and each arm's own closed form (its measured rate, interval and downtime) is closer still
    assert long_run.baseline_closed_form_ettr_pct == pytest.approx(long_run.baseline_ettr_pct, abs=0.6)
    assert long_run.platform_closed_form_ettr_pct == pytest.approx(long_run.platform_ettr_pct, abs=0.2)


def test_the_recovery_path_is_what_the_settings_say(long_run: TrainingFaultsFigures) -> None:
    # crash-type faults only: the baseline's downtime is exactly the people's 12,000 s plus restart and load
    # (the kubelet's stop happens while people work); the platform's is at least its 462 s
    assert long_run.baseline_downtime_s == pytest.approx(12_420.0, abs=1.0)
    assert 462.0 <= long_run.platform_downtime_s < 1_000.0
    # both arms meet the same fleet: 0.02 per trained node-day, within Poisson noise of ~117 failures (10 %)
    for rate in (long_run.baseline_rate_per_node_day, long_run.platform_rate_per_node_day):
        assert rate == pytest.approx(0.02, rel=0.3)


def test_quarantine_cuts_the_rate_a_lemon_heavy_fleet_gives_the_job() -> None:
    # 15 % lemons failing 15x as often (the fleet's mean rate unchanged): the platform takes failing nodes
    # out and keeps lemons the book recognises off the job; people give the same node back
    s = with_overrides(QUICK, {"lemon_fraction": 0.15})
    sweep = run_seeds(SCENARIO, s, (1, 2, 3))
    # (a quick fleet of 18 nodes meets a handful of failures a run: the cut is noisy, its sign is not)
    assert sweep.spreads["platform_rate_per_node_day"].median < sweep.spreads["baseline_rate_per_node_day"].median
    assert sweep.spreads["rate_cut_pct"].median > 0.0


def test_the_platform_beats_people_at_equal_rates() -> None:
    sweep = run_seeds(SCENARIO, QUICK, (1, 2, 3))
    runs = sweep.runs
    assert all(r.platform_ettr_pct > r.baseline_ettr_pct for r in runs)
    assert all(r.platform_downtime_s < r.baseline_downtime_s / 5 for r in runs)
    assert statistics.median(r.classification_accuracy_pct for r in runs) > 85.0


def test_the_report_sections_draw_the_closed_form(tmp_path: Path) -> None:
    sweep = run_seeds(SCENARIO, with_overrides(QUICK, {"days": 5.0}), (1, 2))
    html = "".join(sections(sweep))
    assert "<img" in html and "both</b> arms" in html
    # the curve falls as the rate grows, for both arms
    for platform in (False, True):
        curve = closed_form_curve(QUICK, 600.0, platform=platform)
        assert all(a > b for a, b in itertools.pairwise(curve)) and not any(math.isnan(c) for c in curve)


# ------------------------------------------------------------------------------------------------ the CLI


def test_settings_reach_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = capture_settings(monkeypatch, TrainingFaultsSettings)
    result = invoke_scenario(tmp_path, "training-faults", ["--set", "failure_rate_per_node_day=0.01",
                                                           "--set", "clock_skew_s=5"],
                             file_text="nodes: 32\nbaseline_reschedule_s: 3600\n")
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert (settings.failure_rate_per_node_day, settings.clock_skew_s, settings.nodes,
            settings.baseline_reschedule_s) == (0.01, 5.0, 32, 3600.0)


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "failure_rate_per_node_day=1.5"], "failure_rate_per_node_day"),
    (["--set", "mix_gpu=0", "--set", "mix_software=0", "--set", "mix_network=0", "--set", "mix_host_maintenance=0",
      "--set", "mix_host_hardware=0", "--set", "mix_unknown_nccl=0"], "must not be all zero"),
    (["--set", "interval_formula=fancy"], "interval_formula"),
])
def test_bad_settings_are_refused_with_their_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str],
                                                  message: str) -> None:
    seen = capture_settings(monkeypatch, TrainingFaultsSettings)
    result = invoke_scenario(tmp_path, "training-faults", args)
    assert result.exit_code == 2 and not seen
    assert flat(message) in flat(result.output) and "Traceback" not in result.output
