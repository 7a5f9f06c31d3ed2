"""The tidal scenario's own sections of the sweep report: the median run over time (who holds the GPUs,
lent nodes, services in SLO violation at each 1-minute check) and per-seed work kept and lost."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, png
from gpuplane.sim.scenario import Sweep
from gpuplane.sim.tidal import TidalFigures


def _timeline(run: TidalFigures) -> str:
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True,
                                              gridspec_kw={"height_ratios": [3, 1.4, 1.2]})
    hours = np.asarray(run.time_h)
    top.stackplot(hours, run.tidal_inference_gpus, run.tidal_training_gpus, labels=["inference", "training"],
                  colors=["#4c72b0", "#dd8452"], alpha=0.85)
    top.plot(hours, run.baseline_training_gpus, color="black", linewidth=1.0, label="training, baseline (no lending)")
    top.set_ylabel("GPUs held (tidal arm)")
    top.legend(loc="upper right", fontsize=8)
    middle.plot(hours, run.nodes_lent, color="#dd8452", linewidth=1.1, label="nodes lent")
    twin = middle.twinx()
    twin.plot(hours, np.asarray(run.load_share) * 100.0, color="#4c72b0", linewidth=0.8, label="load")
    twin.set_ylabel("load, % of peak capacity", fontsize=8)
    middle.set_ylabel("nodes lent")
    bottom.step(hours, run.baseline_violations, where="post", color="grey", linewidth=1.0, label="baseline")
    bottom.step(hours, run.tidal_violations, where="post", color="#c44e52", linewidth=1.0, label="tidal")
    bottom.set_ylabel("services in\nviolation")
    bottom.set_xlabel("hour of the run (measured part)")
    bottom.legend(loc="upper right", fontsize=8)
    fig.suptitle("The median run, checked every minute", fontsize=10)
    return image("tidal timeline", png(fig))


def _per_seed(sweep: Sweep[Any, TidalFigures]) -> str:
    rows = [(str(seed), f"{run.useful_training_gain_gpu_h:.1f}", f"{run.lent_gpu_h:.1f}",
             f"{run.slo_minutes_added:.1f}", f"{run.lost_to_reclaim_gpu_h:.2f}", f"{run.early_reclaims}")
            for seed, run in zip(sweep.seeds, sweep.runs, strict=True)]
    return "<h2>Per seed</h2>" + comparison_table(
        ("useful training gained (GPU-h)", "lent (GPU-h)", "SLO minutes added", "lost to reclaim (GPU-h)",
         "early reclaims"), rows)


def sections(sweep: Sweep[Any, Any]) -> Sequence[str]:
    runs = [run for run in sweep.runs if isinstance(run, TidalFigures)]
    if not runs:
        return []
    median = sweep.median_run("useful_training_gain_gpu_h")
    return [_timeline(median), _per_seed(sweep)]
