"""The tidal scenario on the kit: the shipping controller with the learnt forecaster, 1-minute SLO checks,
and training work booked by the kit's save model (useful when kept, lost to the cause that stopped it)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuplane.report.tidal import sections
from gpuplane.sim.scenario import check_scenario, get_scenario, run_seeds, with_overrides
from gpuplane.sim.tidal import SCENARIO, TidalFigures, TidalSettings, build_inputs, run_arm
from scenario_helpers import assert_refused, capture_settings, invoke_scenario

QUICK = with_overrides(TidalSettings(), dict(SCENARIO.quick))


@functools.cache
def quick(**changes: Any) -> TidalFigures:
    return SCENARIO.run(with_overrides(QUICK, changes), lambda label, done, total: None)


def test_the_scenario_follows_the_rules_and_is_registered() -> None:
    assert check_scenario(SCENARIO) == []
    assert get_scenario("tidal") is SCENARIO


def test_lending_turns_lent_hours_into_kept_training_work_without_adding_slo_minutes() -> None:
    f = quick()
    assert f.loans > 0 and f.lent_gpu_h > 0
    # Work is what a save kept, not occupancy: saves cost time (60 s per 30 min), so useful < held.
    assert f.tidal_useful_training_gpu_h < f.tidal_training_held_gpu_h
    assert f.baseline_useful_training_gpu_h < f.baseline_training_held_gpu_h
    assert 0 < f.useful_training_gain_gpu_h <= f.lent_gpu_h
    # Inference holds what its load needs in both arms: lending moves idle hours to training, nothing else.
    assert f.tidal_inference_held_gpu_h == pytest.approx(f.baseline_inference_held_gpu_h, rel=0.02)
    assert f.tidal_idle_gpu_h < f.baseline_idle_gpu_h
    assert f.slo_minutes_added <= 0.0
    assert f.baseline_lost_gpu_h == 0.0  # nothing evicts training in the baseline


@pytest.mark.parametrize(("changes", "lost"), [
    # grace 120 s covers a 60 s save started at SIGTERM: everything is kept.
    ({}, False),
    # The case: grace 0. No save fits, the work since the last save is lost, and it is reclaim's.
    ({"reclaim_grace_s": 0.0}, True),
    # A save of 300 s does not fit a 120 s grace.
    ({"checkpoint_cost_s": 300.0}, True),
    # A job that ignores SIGTERM keeps only its lead and periodic saves.
    ({"save_on_signal": False}, True),
])
def test_lost_work_follows_the_save_model_and_is_attributed_to_reclaim(changes: dict[str, Any], lost: bool) -> None:
    f = quick(**changes)
    if lost:
        assert f.lost_to_reclaim_gpu_h > 0
        assert f.tidal_lost_gpu_h == pytest.approx(f.lost_to_reclaim_gpu_h)  # reclaim is the only cause here
        assert f.lost_to_reclaim_pct_of_lent > 0
    else:
        assert f.tidal_lost_gpu_h == 0.0


def test_a_longer_checkpoint_interval_loses_more_when_the_signal_save_does_not_fit() -> None:
    # No save on SIGTERM, no lead save: an evicted job loses what it did since its last periodic save, on
    # average half an interval, so 4 h intervals lose more than 30 min ones.
    short = quick(save_on_signal=False, checkpoint_lead_s=0.0, checkpoint_every_s=1800.0)
    long = quick(save_on_signal=False, checkpoint_lead_s=0.0, checkpoint_every_s=14400.0)
    assert long.lost_to_reclaim_gpu_h > short.lost_to_reclaim_gpu_h > 0


def test_slos_are_checked_every_minute() -> None:
    f = quick()
    measured_min = QUICK.days * 24 * 60 - QUICK.warmup_hours * 60  # 2 days − 12 h = 2160 checks
    assert len(f.time_h) == measured_min
    assert np.allclose(np.diff(f.time_h), 1 / 60)


def test_the_forecaster_never_sees_the_future() -> None:
    """Change the load from 30 h on: every decision before 30 h is the same, some after differ."""
    inputs = build_inputs(QUICK)
    cut = 30 * 3600.0
    changed = {}
    for name, curve in inputs.curves.items():
        value = curve.value.copy()
        value[curve.t >= cut + inputs.offset_s] *= 1.8
        changed[name] = dataclasses.replace(curve, value=value)
    future = dataclasses.replace(inputs, curves=changed)
    a = run_arm(QUICK, inputs, lend=True)
    b = run_arm(QUICK, future, lend=True)
    before = np.asarray(a.time_h) < cut / 3600.0
    assert a.nodes_lent[: before.sum()] == b.nodes_lent[: before.sum()]
    assert a.inference_gpus[: before.sum()] == b.inference_gpus[: before.sum()]
    assert a.inference_gpus != b.inference_gpus  # it does react once the load it sees has changed


def test_the_report_sections_plot_the_median_run() -> None:
    sweep = run_seeds(SCENARIO, QUICK, (1,))
    html = "".join(sections(sweep))
    assert html.count("<img") == 1 and "Per seed" in html


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[TidalSettings]:
    return capture_settings(monkeypatch, TidalSettings)


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "slo_check_s=300"], "slo_check_s"),
    (["--set", "warmup_hours=100"], "warmup_hours 100.0 leaves nothing"),
    (["--set", "job_nodes=[16]"], "a job of 16 nodes can never run"),
    (["--set", "reclaim_at=25:00"], "reclaim_at"),
])
def test_bad_settings_are_refused_naming_the_field(tmp_path: Path, captured: list[TidalSettings], args: list[str],
                                                   message: str) -> None:
    assert_refused(invoke_scenario(tmp_path, "tidal", args), captured, message)


def test_settings_reach_the_run(tmp_path: Path, captured: list[TidalSettings]) -> None:
    result = invoke_scenario(tmp_path, "tidal", ["--set", "reclaim_grace_s=0", "--set", "history_days=0"],
                             "checkpoint_cost_s: 240\n")
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert (settings.reclaim_grace_s, settings.history_days, settings.checkpoint_cost_s) == (0.0, 0, 240.0)
