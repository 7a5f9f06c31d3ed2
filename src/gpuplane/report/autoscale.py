"""The autoscaling report: the policies side by side, replicas against demand, shortage and GPU-hours."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, page, png, settings_table
from gpuplane.sim.autoscale import AutoscaleComparison

ROWS: tuple[tuple[str, str], ...] = (
    ("shortage (service-minutes with demand above ready capacity)", "shortage_minutes"),
    ("  cut against static provisioning for the average (%)", "shortage_cut_vs_static_pct"),
    ("GPU-hours", "gpu_hours"),
    ("  against the oracle (%)", "gpu_hours_vs_oracle_pct"),
    ("scale events", "scale_events"),
    ("service-hours at zero replicas", "zero_replica_service_hours"),
)


def comparison_rows(comparison: AutoscaleComparison) -> list[tuple[str, ...]]:
    figures = comparison.figures()
    keys = [p.replace("-", "_") for p in comparison.runs]
    return [(label, *("–" if figures.get(f"{k}_{name}") is None else str(figures[f"{k}_{name}"]) for k in keys))
            for label, name in ROWS]


def _replica_plot(comparison: AutoscaleComparison) -> str:
    s = comparison.scenario
    shown = [i for i, load in enumerate(comparison.loads) if load.production][:1] + \
            [i for i, load in enumerate(comparison.loads) if not load.production][:1]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 3.4 * len(shown)), sharex=True, squeeze=False)
    for ax, index in zip(axes[:, 0], shown, strict=True):
        load = comparison.loads[index]
        hours = np.arange(len(load.demand)) * s.sync_s / 3600.0
        ax.fill_between(hours, load.demand, color="#cccccc", label="demand (GPUs at 100 %)", step="post")
        for policy, run in comparison.runs.items():
            if policy == "static-peak":
                continue
            ax.step(hours, run.services[index].ready, where="post", linewidth=1.0, label=f"{policy} (ready)")
        kind = "production" if load.production else "non-production (scales to zero)"
        ax.set_title(f"{load.name}: {kind}")
        ax.set_ylabel("GPUs")
        ax.legend(fontsize=7, loc="upper left", ncols=3)
    axes[-1, 0].set_xlabel("hour")
    return png(fig)


def _bars(comparison: AutoscaleComparison) -> str:
    figures = comparison.figures()
    names = list(comparison.runs)
    keys = [p.replace("-", "_") for p in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, [figures[f"{k}_shortage_minutes"] for k in keys], color="#c44e52")
    left.set_ylabel("shortage service-minutes")
    left.set_yscale("symlog")
    right.bar(names, [figures[f"{k}_gpu_hours"] for k in keys], color="#4c72b0")
    right.set_ylabel("GPU-hours")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    return png(fig)


def write_autoscale_report(comparison: AutoscaleComparison, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = comparison.scenario
    figures = comparison.figures()
    goals = ""
    if "goals_met" in figures:
        goals = (f"<p>Goals for the GPU scaler: shortage at least {s.goal_shortage_cut_pct:g} % below static "
                 f"provisioning for the average: <b>{figures['goal_shortage_cut_met']}</b> "
                 f"({figures['gpu_scaler_shortage_cut_vs_static_pct']} %); GPU-hours within "
                 f"{s.goal_gpu_hours_over_oracle_pct:g} % of the oracle: <b>{figures['goal_gpu_hours_met']}</b> "
                 f"({figures['gpu_scaler_gpu_hours_vs_oracle_pct']} %).</p>")
    body = (
        f"<p>{s.services} services ({s.non_production_services} non-production, loaded "
        f"{html.escape(s.working_hours_start)}–{html.escape(s.working_hours_end)} only), mean demand "
        f"{s.mean_gpus:g} GPUs each, peak/trough {s.peak_trough_ratio:g}, {s.bursts_per_day:g} flash crowds a day "
        f"of ×{s.burst_factor:g}, request-mix drift {s.mix_drift_cv:g}; {s.days:g} virtual day(s), seed {s.seed}. "
        f"A replica serves after {s.startup_s:g} s; the GPU metric is {s.metric_delay_s:g} s old.</p>"
        + goals + comparison_table(list(comparison.runs), comparison_rows(comparison))
        + image("replicas", _replica_plot(comparison)) + image("totals", _bars(comparison))
        + settings_table(s)
    )
    path.write_text(page("gpuplane: GPU-metric autoscaling", body), encoding="utf-8")
    return path
