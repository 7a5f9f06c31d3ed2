"""The report of a seed sweep: goals, every figure's median and spread, the median run's tables, the
headlines' assumptions, and the scenario's own plots (a `sections(sweep)` function in its report module)."""

from __future__ import annotations

import html
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, page, png, settings_table
from gpuplane.sim.scenario import Scenario, Sweep, figure_arm, numeric_figures
from gpuplane.sim.scenario.kit import figure_unit

SectionWriter = Callable[[Sweep[Any, Any]], Sequence[str]]

REPORT_MODULES: dict[str, str] = {
    "colocation": "gpuplane.report.colocation",
    "training-faults": "gpuplane.report.training_faults",
    "tidal": "gpuplane.report.tidal",
    "autoscale": "gpuplane.report.autoscale",
    "training-backfill": "gpuplane.report.backfill",
    "defrag": "gpuplane.report.defrag",
    "platform-week": "gpuplane.report.platform",
}
"""Where each scenario's own plots come from: the module's `sections(sweep)` returns HTML fragments."""


def scenario_sections(name: str) -> SectionWriter | None:
    module = REPORT_MODULES.get(name)
    if module is None:
        return None
    writer: SectionWriter | None = getattr(importlib.import_module(module), "sections", None)
    return writer


def _goals(sweep: Sweep[Any, Any]) -> str:
    rows = [(g.goal.name, g.goal.describe(), f"{g.value:.3g}", "met" if g.met else "MISSED") for g in sweep.goals]
    return "<h2>Goals (on the median over seeds)</h2>" + comparison_table(("goal", "median", "verdict"), rows)


def _spreads(scenario: Scenario[Any, Any], sweep: Sweep[Any, Any]) -> str:
    rows = []
    for name in numeric_figures(scenario.figures):
        s = sweep.spreads[name]
        unit = figure_unit(scenario.figures, name)
        rows.append((name, figure_arm(scenario.figures, name), unit, f"{s.median:.4g}", f"{s.q1:.4g}–{s.q3:.4g}",
                     f"{s.low:.4g}–{s.high:.4g}"))
    return (f"<h2>Figures over {len(sweep.seeds)} seed(s)</h2>"
            + comparison_table(("arm", "unit", "median", "quartiles", "range"), rows))


def _headlines(scenario: Scenario[Any, Any]) -> str:
    rows = [(h.figure, h.assumption, f"{h.knob} → {h.moved}: {h.direction}") for h in scenario.headlines]
    return "<h2>Headlines and the assumptions they rest on</h2>" + comparison_table(
        ("assumption", "a test moves it"), rows)


def _seed_plot(scenario: Scenario[Any, Any], sweep: Sweep[Any, Any]) -> str:
    names = [h.figure for h in scenario.headlines] or list(numeric_figures(scenario.figures))[:6]
    names = list(dict.fromkeys(names))
    fig, axes = plt.subplots(1, len(names), figsize=(max(3.0, 2.6 * len(names)), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        values = np.array([float(getattr(run, name)) for run in sweep.runs])
        ax.scatter(np.zeros(len(values)) + np.linspace(-0.1, 0.1, len(values)), values, s=14)
        ax.axhline(float(np.median(values)), color="black", linewidth=1)
        ax.set_xticks([])
        ax.set_title(name, fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("headline figures, one dot per seed (line: median)", fontsize=9)
    return image("headline figures per seed", png(fig))


def write_scenario_report(scenario: Scenario[Any, Any], sweep: Sweep[Any, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    median_run = sweep.median_run(scenario.headlines[0].figure) if scenario.headlines else sweep.runs[0]
    tables = "".join(f"<h2>{html.escape(t.title)}</h2>" + comparison_table(t.columns, t.rows)
                     for t in scenario.tables(median_run))
    writer = scenario_sections(scenario.name)
    extra = "".join(writer(sweep)) if writer is not None else ""
    body = (f"<p>{html.escape(scenario.summary(median_run))}</p>" + _goals(sweep) + _spreads(scenario, sweep)
            + _seed_plot(scenario, sweep) + "<h2>The median run</h2>" + tables + extra + _headlines(scenario)
            + settings_table(sweep.settings))
    path.write_text(page(f"{scenario.title}: {len(sweep.seeds)} seed(s)", body), encoding="utf-8")
    return path
