"""The rules for every figure, held for every registered scenario:

- a goal is on our arm, never on a baseline (each figure declares its arm);
- a headline is a median over at least 10 seeds, with its spread (the CLI's default sweep, the JSON);
- each headline names the assumption it rests on, and moving that assumption moves the headline the
  declared way (quick settings, the median over seeds 1-3, default against moved).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpuplane.cli.main import app, scenario_cmd
from gpuplane.sim.scenario import (
    MIN_HEADLINE_SEEDS,
    Headline,
    check_scenario,
    get_scenario,
    numeric_figures,
    parse_seeds,
    run_seeds,
    scenario_names,
    with_overrides,
)

NAMES = scenario_names()
DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADLINE_SEEDS = (1, 2, 3)


def _quick(name: str) -> Any:
    scenario = get_scenario(name)
    return with_overrides(scenario.settings(), dict(scenario.quick))


@pytest.mark.parametrize("name", NAMES)
def test_declarations_follow_the_rules(name: str) -> None:
    scenario = get_scenario(name)
    assert scenario.name == name
    assert check_scenario(scenario) == []
    assert scenario.headlines, f"{name} declares no headline"
    assert scenario.goals, f"{name} declares no goal"


def test_the_default_sweep_is_a_headline_sweep() -> None:
    default = inspect.signature(scenario_cmd).parameters["seeds"].default
    assert len(parse_seeds(default)) >= MIN_HEADLINE_SEEDS


def _headlines() -> list[tuple[str, Headline]]:
    return [(name, h) for name in NAMES for h in get_scenario(name).headlines]


@pytest.mark.parametrize(("name", "headline"), _headlines(),
                         ids=[f"{n}:{h.figure}:{h.knob}" for n, h in _headlines()])
def test_moving_a_headlines_assumption_moves_it_the_declared_way(name: str, headline: Headline) -> None:
    scenario = get_scenario(name)
    base = _quick(name)
    moved = with_overrides(base, {headline.knob: headline.moved})
    assert getattr(moved, headline.knob) != getattr(base, headline.knob), "the move must change the setting"
    before = run_seeds(scenario, base, HEADLINE_SEEDS).spreads[headline.figure].median
    after = run_seeds(scenario, moved, HEADLINE_SEEDS).spreads[headline.figure].median
    if headline.direction == "up":
        assert after > before, (headline, before, after)
    else:
        assert after < before, (headline, before, after)


@pytest.mark.parametrize("name", NAMES)
def test_the_cli_reports_medians_spreads_goals_and_a_page(name: str, tmp_path: Path) -> None:
    scenario = get_scenario(name)
    flags = [arg for key, value in scenario.quick.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    result = CliRunner().invoke(app, ["scenario", name, "--seeds", "1-2", "--json", "--out", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["seeds"] == [1, 2] and data["headline_ready"] is False
    assert set(data["figures"]) == set(numeric_figures(scenario.figures))
    for spread in data["figures"].values():
        if spread["median"] is None:  # a figure no run measured (an ablation arm the quick settings skip)
            assert set(spread.values()) == {None}
        else:
            assert spread["min"] <= spread["median"] <= spread["max"]
    assert [g["name"] for g in data["goals"]] == [g.name for g in scenario.goals]
    assert len(data["runs"]) == 2
    page = Path(data["report"]).read_text(encoding="utf-8")
    assert "<img" in page and "Goals" in page


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_setting_is_refused_with_its_name(name: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["scenario", name, "--seeds", "1", "--set", "no_such_field=1",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "no_such_field" in result.output and "Traceback" not in result.output


def test_an_unknown_scenario_names_the_choices(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["scenario", "nope", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert all(name in "".join(result.output.split()) for name in NAMES)


def test_simulate_scenario_points_to_the_new_command(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", "--scenario", "tidal", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "gpuplane scenario tidal" in result.output


def test_the_rules_are_written_down() -> None:
    text = (DOCS / "figures.md").read_text(encoding="utf-8")
    for rule in ("never on a baseline", "best honest configuration", "median over", "assumption"):
        assert rule in text, rule
