"""Plots and tables of the fragmentation experiment."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gpuplane.sim.experiment import ARRIVED_POINTS, PUBLISHED, Summary

TABLE_POINTS = (100, 110, 120, 130)


def plot_trace(summary: Summary, trace: str, path: Path) -> Path:
    """Unallocated GPU % against arrived workload: median line, 25–75 % band, per policy."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for policy, median in summary.median[trace].items():
        line = ax.plot(ARRIVED_POINTS, median, label=policy, linewidth=1.4)[0]
        ax.fill_between(ARRIVED_POINTS, summary.p25[trace][policy], summary.p75[trace][policy],
                        color=line.get_color(), alpha=0.2, linewidth=0)
    xs = np.linspace(0, 100, 50)
    ax.plot(xs, 100 - xs, color="grey", linestyle=":", linewidth=1, label="ideal")
    ax.set_xlim(75, 130)
    ax.set_ylim(0, 30)
    ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
    ax.set_ylabel("unallocated GPU (%)")
    ax.set_title(f"Unallocated GPU, trace {trace} (median over seeds, 25–75 % band)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def medians_markdown(summary: Summary) -> str:
    """A markdown table of medians at 100/110/120/130 % arrived, with the published 100 % figure."""
    lines = ["| trace | policy | " + " | ".join(f"{x} %" for x in TABLE_POINTS) + " | published at 100 % |",
             "|---|---|" + "---:|" * (len(TABLE_POINTS) + 1)]
    for trace, by_policy in summary.median.items():
        for policy in by_policy:
            values = " | ".join(f"{summary.at(trace, policy, x):.2f}" for x in TABLE_POINTS)
            published = PUBLISHED.get(trace, {}).get(policy)
            lines.append(f"| {trace} | {policy} | {values} | {'' if published is None else published} |")
    return "\n".join(lines) + "\n"
