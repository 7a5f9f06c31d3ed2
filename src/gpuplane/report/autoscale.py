"""The autoscaling report's own sections: ready replicas against demand in the median run, and each arm's
GPU-hours and shortage over the seeds."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import image, png
from gpuplane.sim.autoscale import ARMS, AutoscaleFigures
from gpuplane.sim.scenario import Sweep

COLOURS = {"static-peak": "#8172b2", "cpu-hpa": "#dd8452", "gpu-scaler": "#4c72b0", "oracle": "#55a868"}


def _replica_plot(figures: AutoscaleFigures) -> str:
    shown = len(figures.trace_names)
    fig, axes = plt.subplots(shown, 1, figsize=(9, 3.2 * shown), sharex=True, squeeze=False)
    for ax, name, demand, ready in zip(axes[:, 0], figures.trace_names, figures.trace_demand, figures.trace_ready,
                                       strict=True):
        hours = np.arange(len(demand)) / 60.0
        ax.fill_between(hours, demand, color="#cccccc", step="post", label="demand (cards busy)")
        for arm, line in zip(ARMS, ready, strict=True):
            ax.step(hours, line, where="post", linewidth=0.9, color=COLOURS[arm], label=f"{arm} (ready)")
        ax.set_title(name + ("" if name.startswith("svc") else " (non-production: may scale to zero)"))
        ax.set_ylabel("cards")
        ax.legend(fontsize=7, loc="upper left", ncols=3)
    axes[-1, 0].set_xlabel("hour")
    return png(fig)


def _seed_bars(runs: Sequence[AutoscaleFigures]) -> str:
    arms = ("static-peak", "cpu-hpa", "gpu-scaler", "oracle")
    hours = {"static-peak": [r.static_peak_gpu_hours for r in runs], "cpu-hpa": [r.cpu_hpa_gpu_hours for r in runs],
             "gpu-scaler": [r.gpu_scaler_gpu_hours for r in runs], "oracle": [r.oracle_gpu_hours for r in runs]}
    short = {"cpu-hpa": [r.cpu_hpa_shortage_minutes for r in runs],
             "gpu-scaler": [r.gpu_scaler_shortage_minutes for r in runs]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, arm in enumerate(arms):
        values = hours[arm]
        left.scatter(np.full(len(values), i) + np.linspace(-0.15, 0.15, len(values)), values, s=12,
                     color=COLOURS[arm])
        left.hlines(float(np.median(values)), i - 0.3, i + 0.3, color="black", linewidth=1)
    left.set_xticks(range(len(arms)), arms, fontsize=8)
    left.set_ylabel("GPU-hours (dot: seed, line: median)")
    for i, (arm, values) in enumerate(short.items()):
        right.scatter(np.full(len(values), i) + np.linspace(-0.15, 0.15, len(values)), values, s=12,
                      color=COLOURS[arm])
        right.hlines(float(np.median(values)), i - 0.3, i + 0.3, color="black", linewidth=1)
    right.set_xticks(range(len(short)), list(short), fontsize=8)
    right.set_ylabel("shortage service-minutes (static-peak and oracle: 0)")
    fig.tight_layout()
    return png(fig)


def sections(sweep: Sweep[Any, Any]) -> list[str]:
    runs: list[AutoscaleFigures] = [r for r in sweep.runs if isinstance(r, AutoscaleFigures)]
    if not runs:
        return []
    median = sweep.median_run("gpu_scaler_shortage_minutes")
    assert isinstance(median, AutoscaleFigures)
    out = [f"<h2>Each arm over {len(runs)} seed(s)</h2>", image("GPU-hours and shortage per seed", _seed_bars(runs))]
    if median.trace_names:
        out += [f"<h2>Ready replicas against demand (the median run: {html.escape(', '.join(median.trace_names))})"
                "</h2>", image("replicas", _replica_plot(median))]
    return out
