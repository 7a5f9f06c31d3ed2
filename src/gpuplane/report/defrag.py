"""The defragmentation report's own sections: whole-card pending times and unallocated GPU from the median run
of a seed sweep, and each seed's figures."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, png
from gpuplane.sim.defrag import DefragFigures
from gpuplane.sim.scenario import Sweep


def _wait_plot(run: DefragFigures) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for waits, label in ((run.no_defrag_whole_waits_s, "no defragmentation"),
                         (run.defrag_whole_waits_s, "defragmentation")):
        finite = np.sort(np.asarray([w for w in waits if np.isfinite(w)], np.float64))
        if not len(finite):
            continue
        share = np.arange(1, len(finite) + 1) / len(finite) * 100.0
        ax.step(np.maximum(finite, 1.0), share, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("pending time of a whole-card pod, arrival to bind (s, log; 0 drawn at 1)")
    ax.set_ylabel("pods (%)")
    ax.set_ylim(0, 100.5)
    ax.set_title("Whole-card pods: pending-time CDF (the median run)")
    ax.legend(loc="lower right", fontsize=8)
    return png(fig)


def _unallocated_plot(run: DefragFigures) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    hours = np.asarray(run.time_s) / 3600.0
    ax.plot(hours, run.no_defrag_unallocated_series, label="no defragmentation", linewidth=1.2)
    ax.plot(hours, run.defrag_unallocated_series, label="defragmentation", linewidth=1.2)
    start, end = run.window_s
    ax.axvspan(0, start / 3600.0, color="grey", alpha=0.12, label="warm-up (left out)")
    ax.set_xlim(0, end / 3600.0)
    ax.set_xlabel("virtual time (h)")
    ax.set_ylabel("unallocated GPU (%)")
    ax.set_title("Unallocated GPU over time (the median run)")
    ax.legend(loc="upper right", fontsize=8)
    return png(fig)


def seed_rows(sweep: Sweep[Any, DefragFigures]) -> list[tuple[str, ...]]:
    """Per seed: whole-card p50 and p95 pending time (without → with), moves per hour, work lost, unallocated."""
    return [(f"seed {seed}", f"{r.no_defrag_whole_wait_p50_s:.0f} → {r.defrag_whole_wait_p50_s:.0f}",
             f"{r.no_defrag_whole_wait_p95_s:.0f} → {r.defrag_whole_wait_p95_s:.0f}", f"{r.moves_per_hour:.2f}",
             f"{r.moved_lost_gpu_h:.2f}", f"{r.no_defrag_unallocated_pct:.1f} → {r.defrag_unallocated_pct:.1f}")
            for seed, r in zip(sweep.seeds, sweep.runs, strict=True)]


def sections(sweep: Sweep[Any, DefragFigures]) -> Sequence[str]:
    """HTML fragments for the generic scenario report."""
    run = sweep.median_run("whole_wait_p95_cut_pct")
    s = sweep.settings
    note = (f"<p>Every {s.defrag_every_s:g} s the controller moves the fewest fractional pods that free cards "
            f"for a pending whole-card pod, at most {s.max_moves_per_hour} an hour; the freed cards are "
            f"nominated to that pod. A moved pod gets {s.grace_s:g} s of grace (its save takes {s.save_s:g} s), "
            f"its container stops {s.kubelet_stop_s:g} s after it exits, and it resumes from its last kept save "
            "(it saves every " f"{s.save_every_s:g} s). Pods still pending at the end count the time until the "
            "end.</p>")
    table = comparison_table(("whole-card p50 (s)", "whole-card p95 (s)", "moves/h", "lost (GPU-h)",
                              "unallocated (%)"), seed_rows(sweep))
    return (f"<h2>{html.escape('Defragmentation: whole-card pending time and moves')}</h2>" + note,
            image("whole-card pending times", _wait_plot(run)),
            image("unallocated GPU over time", _unallocated_plot(run)), "<h2>Per seed</h2>" + table)


__all__ = ["sections", "seed_rows"]
