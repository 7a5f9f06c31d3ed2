"""The training-faults report: ETTR and where the time went, and ETTR against the failure rate."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, page, png, settings_table
from gpuplane.sim.training_faults import TrainingFaultsComparison

PARTS = ("productive", "checkpoint", "lost", "detection", "diagnosis", "reschedule", "restart",
         "checkpoint_load", "manual")


def case_columns(comparison: TrainingFaultsComparison) -> list[str]:
    gpus = comparison.scenario.gpus_per_node
    return [f"{c.label}: {c.nodes * gpus:,} GPUs at {c.rate_per_node_day * 100:g} %/node-day"
            for c in comparison.cases.values()]


def ettr_rows(comparison: TrainingFaultsComparison) -> list[tuple[str, ...]]:
    figures = comparison.figures()
    keys = list(comparison.cases)
    rows: list[tuple[str, ...]] = [("ETTR (%)", *(str(figures[f"{k}_ettr_pct"]) for k in keys)),
                                   ("  lowest run (%)", *(str(figures[f"{k}_ettr_min_pct"]) for k in keys)),
                                   ("failures per run", *(str(figures[f"{k}_failures_per_run"]) for k in keys)),
                                   ("nodes isolated per run", *(str(figures[f"{k}_isolated_nodes_per_run"])
                                                                for k in keys))]
    rows += [(f"{part.replace('_', ' ')} (% of wall)", *(str(figures[f"{k}_{part}_pct"]) for k in keys))
             for part in PARTS]
    return rows


def _sweep_plot(comparison: TrainingFaultsComparison) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, points in comparison.sweep.items():
        rates = [r * 100 for r, _ in points]
        left.plot(rates, [e for _, e in points], marker="o", label=kind)
    left.set_xscale("log")
    left.set_xlabel("node failures per node-day (%)")
    left.set_ylabel("ETTR (%)")
    left.set_title(f"ETTR against the failure rate ({comparison.scenario.nodes * comparison.scenario.gpus_per_node:,}"
                   " GPUs)")
    left.set_ylim(0, 100)
    left.grid(alpha=0.3)
    left.legend()
    cases = list(comparison.cases.values())
    bottom = np.zeros(len(cases))
    shares = [c.account.shares_pct() for c in cases]
    for part in PARTS[1:]:
        values = np.array([share[part] for share in shares])
        right.bar(range(len(cases)), values, bottom=bottom, label=part.replace("_", " "))
        bottom += values
    for i, total in enumerate(bottom):
        right.annotate(f"{total:.2f} %", (i, total), ha="center", va="bottom", fontsize=8)
    right.set_xticks(range(len(cases)), [c.label for c in cases], fontsize=8, rotation=10)
    right.set_ylabel("% of wall clock not productive")
    right.set_title("Where the rest of the time went")
    right.legend(fontsize=7)
    fig.tight_layout()
    return png(fig)


def write_training_faults_report(comparison: TrainingFaultsComparison, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = comparison.scenario
    figures = comparison.figures()
    body = (
        f"<p>A job of {s.nodes} nodes × {s.gpus_per_node} GPUs for {s.days:g} days ({s.replications} runs), "
        f"{s.lemon_fraction * 100:g} % lemons failing {s.lemon_factor:g}× as often. Baseline: manual recovery, "
        f"no culling, {s.baseline_checkpoint_interval_s / 3600:g} h checkpoints of {s.baseline_checkpoint_cost_s:g} s. "
        f"Platform: pre-flight culling, classifier, isolation, warm spares, Daly/Young intervals. Goals met: "
        f"<b>{figures['goals_met']}</b>.</p>"
        + comparison_table(case_columns(comparison), ettr_rows(comparison))
        + image("ETTR", _sweep_plot(comparison)) + settings_table(s)
    )
    path.write_text(page("gpuplane: training fault tolerance", body), encoding="utf-8")
    return path
