"""The tidal report: the week's comparison table, nodes per pool and GPU utilisation over the week."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, page, png, settings_table
from gpuplane.sim.tidal import TidalComparison

ROWS: tuple[tuple[str, str], ...] = (
    ("daily average GPU utilisation (%)", "utilisation_pct"),
    ("daily average GPU allocation (%)", "allocation_pct"),
    ("inference GPU-hours (its cost)", "inference_gpu_hours"),
    ("training GPU-hours", "training_gpu_hours"),
    ("training jobs finished", "training_jobs_done"),
    ("inference SLO violation (service-minutes)", "slo_violation_minutes"),
)


def comparison_rows(comparison: TidalComparison) -> list[tuple[str, str, str]]:
    figures = comparison.figures()
    return [(label, str(figures[f"baseline_{key}"]), str(figures[f"tidal_{key}"])) for label, key in ROWS]


HEADLINE: tuple[tuple[str, str], ...] = (
    ("night conversion (% of inference GPUs lent in the loan window)", "night_conversion_pct"),
    ("utilisation gain (points)", "utilisation_gain_points"),
    ("allocation gain (points)", "allocation_gain_points"),
    ("inference cost cut (%)", "inference_cost_cut_pct"),
    ("training GPU-hours gained", "training_gpu_hours_gained"),
    ("GPU-hours lent", "lent_gpu_hours"),
    ("SLO violation minutes added by tidal (must be 0)", "slo_violation_minutes_added_by_tidal"),
    ("training work lost to reclaim (GPU-hours)", "training_lost_to_reclaim_gpu_hours"),
    ("  as % of lent GPU-hours (goal ≤ 1)", "training_lost_to_reclaim_pct_of_lent"),
    ("loans / early reclaims", "loans"),
    ("nodes emptied per night: fewest-instances first", "drain_nodes_emptied_fewest_instances"),
    ("  newest first (Kubernetes default)", "drain_nodes_emptied_newest"),
    ("  random", "drain_nodes_emptied_random"),
)


def headline_rows(comparison: TidalComparison) -> list[tuple[str, str]]:
    figures = comparison.figures()
    rows = []
    for label, key in HEADLINE:
        value = figures.get(key, "")
        if key == "loans":
            value = f"{figures['loans']} / {figures['early_reclaims']}"
        rows.append((label, str(value)))
    return rows


def _week_plot(comparison: TidalComparison) -> str:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    run = comparison.tidal
    days = np.asarray(run.time_s) / 86400.0
    top.stackplot(days, run.nodes_inference, run.nodes_lent, labels=["inference (own)", "lent to training"],
                  colors=["#4c72b0", "#dd8452"], alpha=0.85)
    top.plot(days, np.asarray(run.nodes_training), color="#55a868", linewidth=1.2, label="training (dedicated + lent)")
    top.set_ylabel("nodes")
    top.set_title("Nodes per pool over the week (tidal)")
    top.legend(loc="upper right", fontsize=8)
    for label, r in (("baseline (no lending)", comparison.baseline), ("tidal", comparison.tidal)):
        bottom.plot(np.asarray(r.time_s) / 86400.0, r.utilisation_pct, label=label, linewidth=1.1)
    start = comparison.tidal.window_s[0] / 86400.0
    bottom.axvspan(0, start, color="grey", alpha=0.12, label="warm-up (left out)")
    bottom.set_ylabel("GPU utilisation (%)")
    bottom.set_xlabel("virtual day")
    bottom.set_ylim(0, 100)
    bottom.legend(loc="lower right", fontsize=8)
    return png(fig)


def write_tidal_report(comparison: TidalComparison, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    scenario = comparison.scenario
    figures = comparison.figures()
    headline = "".join(f"<tr><th>{html.escape(a)}</th><td>{html.escape(b)}</td></tr>"
                       for a, b in headline_rows(comparison))
    body = (
        f"<p>{scenario.inference_nodes} inference nodes ({scenario.stable_nodes} stable, {scenario.tidal_nodes} "
        f"loanable) and {scenario.training_nodes} training nodes × {scenario.gpus_per_node} GPUs "
        f"({figures['gpus']} GPUs), {scenario.days:g} virtual days, seed {scenario.seed}. Window: shrink at "
        f"{scenario.shrink_at}, lend from {scenario.lend_from}, reclaim at {scenario.reclaim_at}. The baseline "
        "runs the same controller with lending off. Figures leave out the first "
        f"{scenario.warmup_hours:g} h.</p>"
        f"<table>{headline}</table>"
        + comparison_table(["baseline", "tidal"], comparison_rows(comparison))
        + image("week", _week_plot(comparison)) + settings_table(scenario)
    )
    path.write_text(page("gpuplane: tidal deployment over a week", body), encoding="utf-8")
    return path
