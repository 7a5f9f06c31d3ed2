"""The training-faults report's own sections: ETTR per seed for both arms next to the closed form, the
closed form against the failure rate (each arm's measured downtime per failure), and where the time went."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.controllers.recovery import DAY_S, daly_interval, first_order_ettr, young_interval
from gpuplane.report.html import comparison_table, image, png
from gpuplane.sim.scenario import Sweep
from gpuplane.sim.training_faults import TrainingFaultsFigures, TrainingFaultsSettings

RATES = (0.001, 0.002, 0.004, 0.01, 0.02)
"""Failures per node-day the closed-form curve is drawn at (the reference's sweep, §8.5)."""


def closed_form_curve(settings: TrainingFaultsSettings, downtime_s: float, *, platform: bool,
                      rates: Sequence[float] = RATES) -> list[float]:
    """ETTR (%) by the first-order model at each rate, both arms at that rate: Young's interval for the
    baseline, Daly's for the platform, the arm's measured mean downtime per failure."""
    out = []
    for rate in rates:
        mtbf = DAY_S / (settings.nodes * rate)
        tau = (daly_interval if platform else young_interval)(settings.save_s, mtbf)
        out.append(100.0 * first_order_ettr(settings.save_s, tau, downtime_s, settings.nodes * rate))
    return out


def _ettr_plot(sweep: Sweep[Any, TrainingFaultsFigures]) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    seeds = np.asarray(sweep.seeds)
    for arm, marker in (("baseline", "o"), ("platform", "s")):
        sim = [getattr(r, f"{arm}_ettr_pct") for r in sweep.runs]
        closed = [getattr(r, f"{arm}_closed_form_ettr_pct") for r in sweep.runs]
        left.scatter(seeds, sim, marker=marker, label=f"{arm}: simulated")
        left.scatter(seeds, closed, marker="x", label=f"{arm}: closed form")
    left.set_xlabel("seed")
    left.set_ylabel("ETTR (%)")
    left.set_title("ETTR per seed, both arms at the same failure rate")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    s = sweep.settings
    for arm in ("baseline", "platform"):
        down = sweep.spreads[f"{arm}_downtime_s"].median
        right.plot(np.asarray(RATES) * 100.0, closed_form_curve(s, down, platform=arm == "platform"), marker="o",
                   label=f"{arm} (closed form, {down / 60:.0f} min down per failure)")
        right.scatter([s.failure_rate_per_node_day * 100.0], [sweep.spreads[f"{arm}_ettr_pct"].median],
                      marker="*", s=120, zorder=3)
    right.set_xscale("log")
    right.set_xlabel("node failures per node-day (%), both arms")
    right.set_ylabel("ETTR (%)")
    right.set_title(f"ETTR against the failure rate ({s.nodes * 8:,} GPUs; ★ simulated median)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    fig.tight_layout()
    return png(fig)


def _time_rows(sweep: Sweep[Any, TrainingFaultsFigures]) -> list[tuple[str, ...]]:
    def cell(name: str) -> str:
        return sweep.spreads[name].show(2)

    parts = (("productive (ETTR)", "ettr_pct"), ("lost to rollbacks", "lost_pct"),
             ("down: failure to training", "down_pct"), ("blocking saves", "save_pct"))
    return [(label, cell(f"baseline_{key}"), cell(f"platform_{key}")) for label, key in parts]


def sections(sweep: Sweep[Any, TrainingFaultsFigures]) -> list[str]:
    s = sweep.settings
    intro = (f"<p>{s.nodes} nodes × 8 GPUs for {s.days:g} days, {s.spare_nodes} more nodes in the cluster, "
             f"{s.failure_rate_per_node_day * 100:g} % failures per node-day for <b>both</b> arms. Medians "
             f"[min–max] over {len(sweep.seeds)} seed(s).</p>")
    return [intro, image("ETTR", _ettr_plot(sweep)),
            "<h2>Where the wall clock went (% of wall)</h2>"
            + comparison_table(("baseline", "platform"), _time_rows(sweep)),
            f"<p>{html.escape('Effective rate: ' + sweep.spreads['platform_rate_per_node_day'].show(4))} "
            f"against {html.escape(sweep.spreads['baseline_rate_per_node_day'].show(4))} failures per trained "
            f"node-day.</p>"]
