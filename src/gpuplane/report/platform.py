"""The platform week's own sections of the sweep report: utilisation and allocation per pool over time, nodes
per pool (the tide), waits by class, faults and recoveries on the timeline, cost per team, the ablation as a
bar chart and the comparison with the reports' figures (the median run, by fleet utilisation gain)."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, png
from gpuplane.sim.platform import SCENARIO, PlatformFigures
from gpuplane.sim.scenario import Sweep

_COLOURS = {"training": "#dd8452", "inference": "#4c72b0", "inference-stable": "#55a868",
            "inference-tidal": "#8172b3", "dev": "#937860", "fleet": "black"}


def _by_pool(run: PlatformFigures, which: str) -> str:
    data = run.util_series if which == "utilisation" else run.alloc_series
    hours = np.asarray(run.time_h)
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, sharey=True)
    for ax, arm in zip(axes, ("vanilla", "platform"), strict=True):
        for name, pool, values in data:
            if name == arm and len(values) == len(hours):
                ax.plot(hours, values, color=_COLOURS.get(pool, "grey"), linewidth=1.4 if pool == "fleet" else 0.9,
                        label=pool)
        ax.set_ylabel(f"{arm}: GPU {which} (%)")
        ax.set_ylim(0, 105)
    axes[0].legend(loc="lower right", fontsize=7, ncol=3)
    axes[1].set_xlabel("hour of the week")
    fig.suptitle(f"GPU {which} per pool, the median run", fontsize=10)
    return image(f"{which} per pool", png(fig))


def _tide(run: PlatformFigures) -> str:
    hours = np.asarray(run.time_h)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for pool, counts in run.nodes_series:
        if len(counts) == len(hours):
            ax.plot(hours, counts, color=_COLOURS.get(pool, "grey"), linewidth=1.0, label=pool)
    for t in run.failure_h:
        ax.axvline(t, color="#c44e52", linewidth=0.6, alpha=0.6)
    for t in run.recovery_h:
        ax.axvline(t, color="#55a868", linewidth=0.6, alpha=0.6, linestyle="--")
    ax.set_ylabel("nodes in the pool")
    ax.set_xlabel("hour of the week (red: faults, green dashed: recoveries)")
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    fig.suptitle("Nodes per pool (the tide) with faults and recoveries, platform arm", fontsize=10)
    return image("nodes per pool", png(fig))


def _ablation(run: PlatformFigures) -> str:
    arms = [row[0] for row in run.ablation]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    for ax, k, label in zip(axes, (1, 2, 3), ("fleet utilisation (%)", "inference GPU-h", "useful training GPU-h"),
                            strict=True):
        values = [row[k] for row in run.ablation]
        ax.bar(range(len(arms)), values, color=["grey" if a == "vanilla" else "#4c72b0" if a == "platform"
                                                 else "#8da0cb" for a in arms])
        ax.set_xticks(range(len(arms)), arms, rotation=60, fontsize=7, ha="right")
        ax.set_title(label, fontsize=9)
    fig.suptitle("The ablation: the platform with one capability off in turn", fontsize=10)
    fig.tight_layout()
    return image("ablation", png(fig))


def _waits_and_costs(run: PlatformFigures) -> str:
    waits = comparison_table(("vanilla p95 (s)", "platform p95 (s)"),
                             [(cls, f"{v:.0f}", f"{p:.0f}") for cls, v, p in run.waits_p95])
    costs = comparison_table(("vanilla ($)", "platform ($)"),
                             [(team, f"{v:.0f}", f"{p:.0f}") for team, v, p in run.team_cost])
    return f"<h2>Waits by class</h2>{waits}<h2>Training cost per team</h2>{costs}"


def _tables(run: PlatformFigures) -> str:
    parts = []
    for table in SCENARIO.tables(run):
        parts.append(f"<h2>{html.escape(table.title)}</h2>" + comparison_table(table.columns, table.rows))
    return "".join(parts)


def sections(sweep: Sweep[Any, Any]) -> Sequence[str]:
    runs = [run for run in sweep.runs if isinstance(run, PlatformFigures)]
    if not runs:
        return []
    median: PlatformFigures = sweep.median_run("platform_util_gain_points")
    out = [_by_pool(median, "utilisation"), _by_pool(median, "allocation"), _tide(median), _waits_and_costs(median)]
    if len(median.ablation) > 2:
        out.append(_ablation(median))
    out.append(_tables(median))
    return out

