"""The co-location report's own plots, from the median run of a seed sweep: online latency per arm and the
card's busy share over the run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import image, png
from gpuplane.sim.colocation import ColocationFigures
from gpuplane.sim.scenario import Sweep


def _latency_plot(figures: ColocationFigures) -> str:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm, sample in figures.latency_series:
        if not sample:
            continue
        ax.plot(sample, np.linspace(0.0, 1.0, len(sample)), label=arm, linewidth=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("online request latency (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0.0, 1.0)
    ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    ax.set_title("Online latency per arm (median run)")
    ax.legend(fontsize=8, loc="lower right")
    return png(fig)


def _busy_plot(figures: ColocationFigures, start_hour: float) -> str:
    fig, ax = plt.subplots(figsize=(8, 4.0))
    for arm, busy in figures.busy_series:
        hours = start_hour + (np.arange(len(busy)) + 0.5) * figures.bucket_minutes / 60.0
        ax.plot(hours, busy, label=arm, linewidth=1.1)
    ax.set_xlabel("hour of the day")
    ax.set_ylabel("card time some kernel ran (%)")
    ax.set_ylim(0.0, 105.0)
    ax.set_title("Card busy share over the run (median run)")
    ax.legend(fontsize=8, loc="lower right")
    return png(fig)


def sections(sweep: Sweep[Any, Any]) -> Sequence[str]:
    """The plots of the run whose guard offline share is the median's."""
    run = sweep.median_run("guard_offline_share_of_idle_pct")
    assert isinstance(run, ColocationFigures)
    start_hour = float(getattr(sweep.settings, "start_hour", 0.0))
    return ("<h2>Online latency and card use</h2>", image("latency per arm", _latency_plot(run)),
            image("card busy share", _busy_plot(run, start_hour)))
