"""The training-backfill report's own sections: allocation over time and the normal pods' waits, from the
median run of a seed sweep, and each seed's wait change."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, png
from gpuplane.sim.backfill import BackfillFigures
from gpuplane.sim.scenario import Sweep


def _allocation_plot(run: BackfillFigures) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    hours = np.asarray(run.time_s) / 3600.0
    ax.plot(hours, run.no_backfill_allocation_series, label="no backfill", linewidth=1.3)
    ax.plot(hours, run.backfill_allocation_series, label="backfill: all pods", linewidth=1.3)
    ax.plot(hours, run.backfill_normal_allocation_series, ":", label="backfill: normal pods only", linewidth=1.2)
    start, end = run.window_s
    ax.axvspan(0, start / 3600.0, color="grey", alpha=0.12, label="warm-up (left out)")
    ax.set_xlim(0, end / 3600.0)
    ax.set_ylim(0, 105)
    ax.set_xlabel("virtual time (h)")
    ax.set_ylabel("GPU allocation (% of capacity)")
    ax.set_title("GPU allocation over time (the median run)")
    ax.legend(loc="lower right", fontsize=8)
    return png(fig)


def _wait_plot(run: BackfillFigures) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for waits, label in ((run.no_backfill_waits_s, "no backfill"), (run.backfill_waits_s, "backfill")):
        finite = np.sort(np.asarray([w for w in waits if np.isfinite(w)], np.float64))
        if not len(finite):
            continue
        share = np.arange(1, len(finite) + 1) / len(finite) * 100.0
        ax.step(np.maximum(finite, 0.1), share, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("wait of a normal pod, arrival to bind (s, log; 0 drawn at 0.1)")
    ax.set_ylabel("pods (%)")
    ax.set_ylim(0, 100.5)
    ax.set_title("Normal pods: wait CDF (the median run)")
    ax.legend(loc="lower right", fontsize=8)
    return png(fig)


def seed_rows(sweep: Sweep[Any, BackfillFigures]) -> list[tuple[str, ...]]:
    """Per seed: allocation gain, mean and p95 wait without and with backfill, share of pods that waited longer."""
    return [(f"seed {seed}", f"{run.allocation_gain_points:.1f}",
             f"{run.no_backfill_normal_wait_mean_s:.1f} → {run.backfill_normal_wait_mean_s:.1f}",
             f"{run.no_backfill_normal_wait_p95_s:.1f} → {run.backfill_normal_wait_p95_s:.1f}",
             f"{run.normal_pods_waited_longer_pct:.1f}", f"{run.batch_lost_gpu_h:.2f}")
            for seed, run in zip(sweep.seeds, sweep.runs, strict=True)]


def sections(sweep: Sweep[Any, BackfillFigures]) -> Sequence[str]:
    """HTML fragments for the generic scenario report."""
    run = sweep.median_run("allocation_gain_points")
    settings = sweep.settings
    note = (f"<p>Victims get their class's grace (batch {settings.batch_grace_s:g} s); a batch pod that traps "
            f"SIGTERM saves ({settings.batch_save_s:g} s) and exits, then the container takes "
            f"{settings.kubelet_stop_s:g} s to stop. A normal pod that displaces batch pods is bound when the "
            "last of them is gone, so its wait includes that termination.</p>")
    table = comparison_table(("allocation gain (points)", "mean wait (s)", "p95 wait (s)", "waited longer (%)",
                              "batch lost (GPU-h)"), seed_rows(sweep))
    return (f"<h2>{html.escape('Backfill: allocation and normal-pod waits')}</h2>" + note,
            image("allocation over time", _allocation_plot(run)), image("normal-pod waits", _wait_plot(run)),
            "<h2>Per seed</h2>" + table)


__all__ = ["sections", "seed_rows"]
