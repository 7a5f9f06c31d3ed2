"""The platform week's page: the comparison with vanilla Kubernetes and the reports' figures (medians over
the seeds, each report in its own column beside ours), utilisation and allocation per pool over time, the
tide with the loans, faults and recoveries on the timeline, waits by class, cost per team, and the ablation
as bars (medians, the range over seeds as whiskers). Plots over time are of the median run, by fleet
utilisation gain. `sections(sweep)` gives the fragments to the generic sweep page; `write_week_report`
writes the week's own page, these first."""

from __future__ import annotations

import argparse
import html
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import matplotlib.pyplot as plt
import numpy as np
import yaml
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from gpuplane.model import GpuplaneError
from gpuplane.report.browser import Chromium, Screenshot, shrink_png
from gpuplane.report.html import comparison_table, image, page, png, settings_table
from gpuplane.sim.platform import SCENARIO, PlatformFigures, PlatformSettings
from gpuplane.sim.platform.fleet import CAPABILITIES, POOLS, TRAINING_POOL
from gpuplane.sim.scenario import Progress, Scenario, Sweep, no_progress
from gpuplane.sim.scenario.sweep import parse_seeds, run_seeds, with_overrides

_COLOURS = {"training": "#dd8452", "inference": "#4c72b0", "inference-stable": "#55a868",
            "inference-tidal": "#8172b3", "dev": "#937860", "fleet": "#222222"}
_VANILLA = "#9a9a9a"
_STYLE = """<style>
.week th, .week td { font-size: 13px; padding: 3px 6px; vertical-align: top; }
.week td.num { white-space: nowrap; }
.week .range { display: block; font-size: 11px; color: #777; }
.week td.report { color: #6a3d9a; }
.week td.met { color: #1a7f37; white-space: nowrap; }
.week td.missed { color: #c0392b; font-weight: 600; white-space: nowrap; }
</style>"""

Measure = Callable[[PlatformFigures], float]


def _fig(name: str) -> Measure:
    return lambda f: float(getattr(f, name))


def _gain_over(arm: str) -> Measure:
    """The platform's fleet utilisation over an ablation arm's: what the capability switched off adds."""
    return lambda f: f.platform_fleet_util_pct - float(getattr(f, f"no_{arm}_fleet_util_pct"))


def _relative(ours: str, base: str) -> Measure:
    return lambda f: (100.0 * (float(getattr(f, ours)) / float(getattr(f, base)) - 1.0)
                      if float(getattr(f, base)) > 0 else math.nan)


@dataclass(frozen=True, slots=True)
class Row:
    """A line of the comparison: vanilla's and our figure, ours against vanilla's, the goal on it, and what
    vivo and Kuaishou report for the same thing."""

    label: str
    vanilla: Measure | None
    ours: Measure | None
    fmt: str = ",.1f"
    delta: Measure | None = None
    delta_spec: str = "+.1f"
    delta_unit: str = ""
    goal: str = ""
    """the `Goal.figure` judged on this row (the goal's verdict is on the median over seeds)"""
    vivo: str = ""
    kuaishou: str = ""


PTS, PCT, MIN = " points", " %", " min"

ROWS: tuple[Row, ...] = (
    Row("fleet-wide daily average GPU utilisation (%)", _fig("vanilla_fleet_util_pct"), _fig("platform_fleet_util_pct"),
        delta=_fig("platform_util_gain_points"), delta_unit=PTS, goal="platform_util_gain_points",
        vivo="+5 points (AI GPU utilisation: backfill, tidal, vGPU)",
        kuaishou="+7 points (co-location), +3–5 (tidal)"),
    Row("the same, relative to vanilla's", None, None,
        delta=_relative("platform_fleet_util_pct", "vanilla_fleet_util_pct"), delta_spec="+.0f", delta_unit=PCT,
        vivo="utilisation +20 %"),
    Row("utilisation co-location adds (platform over no-colocation)", None, None, delta=_gain_over("colocation"),
        delta_unit=PTS, kuaishou="+7 points daily average"),
    Row("utilisation tidal lending adds (platform over no-tidal)", None, None, delta=_gain_over("tidal"),
        delta_unit=PTS, kuaishou="+3–5 points daily average"),
    Row("fleet-wide daily peak GPU utilisation (%)", _fig("vanilla_fleet_util_peak_pct"),
        _fig("platform_fleet_util_peak_pct"), delta=_fig("platform_peak_util_gain_points"), delta_unit=PTS,
        kuaishou="peak +6 points (co-location)"),
    Row("fleet-wide daily average GPU allocation (%)", _fig("vanilla_fleet_alloc_pct"),
        _fig("platform_fleet_alloc_pct"), delta=lambda f: f.platform_fleet_alloc_pct - f.vanilla_fleet_alloc_pct,
        delta_unit=PTS),
    Row("co-location allocation: A10/T4 pool allocation (%)", _fig("vanilla_inference_alloc_pct"),
        _fig("platform_inference_alloc_pct"), kuaishou="near 80 %"),
    Row("inference GPU-hours", _fig("vanilla_inference_gpu_h"), _fig("platform_inference_gpu_h"), ",.0f",
        delta=lambda f: -f.platform_inference_gpu_h_cut_pct, delta_unit=PCT, goal="platform_inference_gpu_h_cut_pct"),
    Row("inference cost ($, list prices)", _fig("vanilla_inference_cost"), _fig("platform_inference_cost"), ",.0f",
        delta=lambda f: -f.platform_inference_cost_cut_pct, delta_unit=PCT, vivo="−30 %", kuaishou="−50 %"),
    Row("night conversion: inference GPUs lent at night (%)", None, _fig("platform_night_conversion_pct"),
        kuaishou="20 %+"),
    Row("useful training work (GPU-h)", _fig("vanilla_training_useful_gpu_h"),
        _fig("platform_training_useful_gpu_h"), ",.0f", delta=_fig("platform_training_work_gain_pct"),
        delta_unit=PCT, goal="platform_training_work_gain_pct"),
    Row("ETTR: useful over held training GPU-hours (%)", _fig("vanilla_ettr_pct"), _fig("platform_ettr_pct"),
        vivo="60 → 99 %"),
    Row("training work lost (GPU-h)", _fig("vanilla_training_lost_gpu_h"), _fig("platform_training_lost_gpu_h")),
    Row("SLO minutes (load above serving capacity)", _fig("vanilla_slo_minutes"), _fig("platform_slo_minutes"),
        ",.0f", delta=_fig("platform_slo_minutes_added"), delta_spec="+.0f", delta_unit=MIN,
        goal="platform_slo_minutes_added"),
    Row("shortage minutes (an online replica pending)", _fig("vanilla_shortage_minutes"),
        _fig("platform_shortage_minutes"), ",.0f",
        delta=lambda f: f.platform_shortage_minutes - f.vanilla_shortage_minutes, delta_spec="+.0f",
        delta_unit=MIN, vivo="shortage alerts −80 %"),
    Row("p95 wait, online (s)", _fig("vanilla_online_wait_p95_s"), _fig("platform_online_wait_p95_s"), ",.0f"),
    Row("p95 wait, training (s)", _fig("vanilla_training_wait_p95_s"), _fig("platform_training_wait_p95_s"), ",.0f"),
    Row("p95 wait, dev (s)", _fig("vanilla_dev_wait_p95_s"), _fig("platform_dev_wait_p95_s"), ",.0f"),
    Row("p95 wait, batch-low (s)", None, _fig("platform_batch_wait_p95_s"), ",.0f"),
    Row("the worst class's p95 wait over vanilla's", None, None, delta=_fig("platform_worst_wait_p95_added_pct"),
        delta_unit=PCT, goal="platform_worst_wait_p95_added_pct"),
    Row("vGPU density (dev pods per dev card in use)", _fig("vanilla_vgpu_density"), _fig("platform_vgpu_density"),
        ".2f", vivo="one card as three; a 4-card machine as 16 vGPUs"),
    Row("dev boxes on a MIG instance (mean)", _fig("vanilla_dev_mig_pods"), _fig("platform_dev_mig_pods"), ",.1f"),
    Row("preemptions", _fig("vanilla_preemptions"), _fig("platform_preemptions"), ",.0f"),
    Row("evictions (preemption and reclaim)", _fig("vanilla_evictions"), _fig("platform_evictions"), ",.0f"),
    Row("batch and near-line work kept (GPU-h), and lost", None, _fig("platform_batch_useful_gpu_h"), ",.0f",
        delta=_fig("platform_batch_lost_gpu_h"), delta_spec=",.1f", delta_unit=" lost"),
    Row("training-node faults", _fig("vanilla_failures"), _fig("platform_failures"), ",.0f"),
)
"""The comparison table, top to bottom. A report's figure stands on the row measuring the same thing."""

_OPS = {">=": "≥", "<=": "≤", ">": ">", "<": "<"}


def _values(runs: Sequence[PlatformFigures], measure: Measure) -> list[float]:
    return [v for v in (measure(run) for run in runs) if not math.isnan(v)]


def number(value: float, spec: str) -> str:
    """`value` formatted by `spec`, with a true minus sign."""
    return format(value, spec).replace("-", "−")


def cell(values: Sequence[float], spec: str, unit: str = "") -> str:
    """The median over seeds and, when the seeds differ, their range: "63.2 [62.5, 63.9]"; "—" when no
    seed measured it."""
    if not values:
        return "—"
    text = number(statistics.median(values), spec) + unit
    low, high = number(min(values), spec), number(max(values), spec)
    return text if low == high else f"{text} [{low}, {high}]"


def comparison_rows(sweep: Sweep[Any, Any]) -> list[tuple[str, ...]]:
    """The comparison table's rows as text: measure, vanilla, ours, ours against vanilla, goal, vivo, Kuaishou."""
    runs = _runs(sweep)
    goals = {g.goal.figure: g for g in sweep.goals}
    rows: list[tuple[str, ...]] = []
    for row in ROWS:
        goal = goals.get(row.goal)
        verdict = (f"{_OPS[goal.goal.op]} {number(goal.goal.target, 'g')}: {'met' if goal.met else 'MISSED'}"
                   if goal else "")
        rows.append((row.label,
                     cell(_values(runs, row.vanilla), row.fmt) if row.vanilla else "",
                     cell(_values(runs, row.ours), row.fmt) if row.ours else "",
                     cell(_values(runs, row.delta), row.delta_spec, row.delta_unit) if row.delta else "",
                     verdict, row.vivo, row.kuaishou))
    return rows


COLUMNS = ("vanilla Kubernetes", "ours (the platform)", "ours against vanilla", "goal", "vivo reports",
           "Kuaishou reports")


def _td(k: int, text: str) -> str:
    if k >= 4:
        return f'<td class="report">{html.escape(text)}</td>'
    if k == 3 and text:
        return f'<td class="{"met" if text.endswith(": met") else "missed"}">{html.escape(text)}</td>'
    median, _, spread = text.partition(" [")
    inner = html.escape(median) + (f' <span class="range">[{html.escape(spread)}</span>' if spread else "")
    return f'<td class="num">{inner}</td>'


def _comparison(sweep: Sweep[Any, Any]) -> str:
    header = "".join(f"<th>{html.escape(c)}</th>" for c in ("", *COLUMNS))
    body = "".join(f"<tr><th>{html.escape(label)}</th>{''.join(_td(k, t) for k, t in enumerate(cells))}</tr>"
                   for label, *cells in comparison_rows(sweep))
    note = (f"<p>Median over {len(sweep.seeds)} seed(s) ({', '.join(map(str, sweep.seeds))}), the range over "
            "the seeds beneath it; vanilla and ours on the same fleet, workload and seeds. The reports' figures "
            "are theirs, on their fleets: they stand beside ours and were not measured here.</p>")
    return f'<h2 id="comparison">The comparison</h2>{note}<table class="week"><tr>{header}</tr>{body}</table>'


def _runs(sweep: Sweep[Any, Any]) -> list[PlatformFigures]:
    return [run for run in sweep.runs if isinstance(run, PlatformFigures)]


def _median(sweep: Sweep[Any, Any]) -> tuple[PlatformFigures, int]:
    """The median run by fleet utilisation gain, and its seed."""
    run: PlatformFigures = sweep.median_run("platform_util_gain_points")
    index = next(i for i, r in enumerate(sweep.runs) if r is run)
    return run, sweep.seeds[index]


def _days(ax: Axes, hours: np.ndarray) -> None:
    if len(hours):
        for day in range(int(hours[0] // 24) + 1, int(hours[-1] // 24) + 1):
            ax.axvline(24.0 * day, color="#bbbbbb", linewidth=0.6, zorder=0)
    ax.grid(axis="y", alpha=0.25)


def _by_pool(run: PlatformFigures, seed: int) -> str:
    hours = np.asarray(run.time_h)
    pools = (*POOLS, "fleet")
    fig, axes = plt.subplots(2, 3, figsize=(10, 5.6), sharex=True, sharey=True)
    lines = {(arm, pool, what): values for what, data in (("util", run.util_series), ("alloc", run.alloc_series))
             for arm, pool, values in data}
    for ax, pool in zip(axes.flat, pools, strict=True):
        for arm in ("vanilla", "platform"):
            colour = _VANILLA if arm == "vanilla" else _COLOURS[pool]
            for what, style in (("util", "-"), ("alloc", "--")):
                values = lines.get((arm, pool, what), ())
                if len(values) == len(hours):
                    ax.plot(hours, values, color=colour, linestyle=style, linewidth=1.1,
                            label=f"{arm} {'utilisation' if what == 'util' else 'allocation'}")
        ax.set_title(pool, fontsize=9, color=_COLOURS[pool])
        ax.set_ylim(0, 105)
        _days(ax, hours)
    for ax in axes[:, 0]:
        ax.set_ylabel("% of the pool's GPUs")
    for ax in axes[1]:
        ax.set_xlabel("hour of the run")
    handles = [Line2D([], [], color=colour, linestyle=style, linewidth=1.1)
               for colour in (_VANILLA, "#4c72b0") for style in ("-", "--")]
    fig.legend(handles, ["vanilla utilisation", "vanilla allocation", "platform utilisation (the pool's colour)",
                         "platform allocation"], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"GPU utilisation (solid) and allocation (dashed) per pool: platform in colour, vanilla grey "
                 f"(seed {seed}, after the warm-up)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    return image("utilisation and allocation per pool", png(fig))


def lent_nodes(settings: PlatformSettings, run: PlatformFigures) -> list[int]:
    """Nodes on loan at each sample: the training pool's nodes beyond its own A100 and H100 nodes (a lent
    node's pool becomes the training pool until it is reclaimed)."""
    own = settings.a100_nodes + settings.h100_nodes
    return [count - own for count in dict(run.nodes_series).get(TRAINING_POOL, ())]


def _held(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """A sampled count with its last value repeated, so that a post-step draws the last sample's interval."""
    data = np.asarray(values, dtype=float)
    return np.append(data, data[-1]) if len(data) else data


def _tide(sweep: Sweep[Any, Any], run: PlatformFigures, seed: int) -> str:
    hours = np.asarray(run.time_h)
    edges = np.append(hours, hours[-1] + (hours[-1] - hours[-2] if len(hours) > 1 else 0.0)) if len(hours) else hours
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 6.2), sharex=True,
                                        gridspec_kw={"height_ratios": (3.0, 1.6, 1.2)})
    for pool, counts in run.nodes_series:
        if len(counts) == len(hours):
            top.step(edges, _held(counts), where="post", color=_COLOURS.get(pool, "grey"), linewidth=1.3, label=pool)
    top.set_ylabel("nodes in the pool")
    top.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    top.set_ylim(bottom=0)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    _days(top, hours)
    lent = np.asarray(lent_nodes(sweep.settings, run) if isinstance(sweep.settings, PlatformSettings) else [],
                      dtype=float)
    lent = lent if len(lent) == len(hours) else np.zeros(0)
    if len(lent):
        mid.fill_between(edges, _held(lent), step="post", color=_COLOURS["inference-tidal"], alpha=0.45)
        mid.step(edges, _held(lent), where="post", color=_COLOURS["inference-tidal"], linewidth=1.0)
    mid.set_ylabel("nodes on loan\nto training")
    mid.yaxis.set_major_locator(MaxNLocator(integer=True))
    mid.set_ylim(bottom=0, top=max(1.0, float(lent.max()) * 1.2 if len(lent) else 1.0))
    mid.text(0.995, 0.9, f"{run.platform_loans} loans, {run.platform_early_reclaims} taken back early", ha="right",
             va="top", transform=mid.transAxes, fontsize=8)
    _days(mid, hours)
    events = (("faults", run.failure_h, "#c44e52", "x"), ("recovered: platform", run.recovery_h, "#1a7f37", "o"),
              ("recovered: vanilla, by hand", run.vanilla_recovery_h, _VANILLA, "o"))
    for y, (_, times, colour, marker) in enumerate(events):
        low.scatter(times, [y] * len(times), color=colour, marker=marker, s=28, zorder=3)
    low.set_yticks(range(len(events)), [e[0] for e in events], fontsize=8)
    low.set_ylim(-0.6, len(events) - 0.4)
    low.invert_yaxis()
    if not any(len(e[1]) for e in events):
        low.text(0.5, 0.5, "no training-node fault in this run", ha="center", va="center",
                 transform=low.transAxes, fontsize=9, color="#555555")
    for t in run.failure_h:
        for ax in (top, mid, low):
            ax.axvline(t, color="#c44e52", linewidth=0.6, alpha=0.5, zorder=0)
    _days(low, hours)
    low.set_xlabel("hour of the run (red lines: training-node faults)")
    if len(hours):
        low.set_xlim(float(edges[0]), float(edges[-1]))
    fig.suptitle(f"The tide: nodes per pool and the loans, with faults and recoveries (platform, seed {seed})",
                 fontsize=10)
    fig.tight_layout()
    return image("nodes per pool, loans, faults and recoveries", png(fig))


ARMS_DRAWN = (("vanilla", _VANILLA), ("platform", "#4c72b0"))


def duration(seconds: float) -> str:
    """A wait as people say it: "40 s", "25 min", "10.4 h"."""
    if seconds < 120.0:
        return f"{seconds:.0f} s"
    return f"{seconds / 60.0:.0f} min" if seconds < 7200.0 else f"{seconds / 3600.0:.1f} h"


def _paired_bars(ax: Axes, labels: Sequence[str], pairs: Sequence[tuple[float, float]],
                 show: Callable[[float], str]) -> None:
    """Vanilla above the platform for each label, each bar labelled with its value."""
    y = np.arange(len(labels))
    for k, (arm, colour) in enumerate(ARMS_DRAWN):
        bars = ax.barh(y - 0.2 + 0.4 * k, [pair[k] for pair in pairs], 0.4, color=colour, label=arm)
        ax.bar_label(bars, labels=[show(pair[k]) for pair in pairs], padding=3, fontsize=7)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.25)


def _waits_and_costs(run: PlatformFigures, seed: int) -> str:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.7))
    classes = [c for c, _, _ in run.waits_p95]
    _paired_bars(left, classes, [(v / 60.0, p / 60.0) for _, v, p in run.waits_p95], lambda m: duration(60.0 * m))
    left.set_xscale("symlog", linthresh=1.0)
    left.set_xlim(0, max([1.0, *(max(v, p) / 60.0 for _, v, p in run.waits_p95)]) * 4)
    left.set_xlabel("p95 wait, created to bound (minutes; log scale above 1)")
    left.set_title("Waits by class", fontsize=9)
    teams = [t for t, _, _ in run.team_cost] + ["inference (all services)"]
    costs = [(v, p) for _, v, p in run.team_cost] + [(run.vanilla_inference_cost, run.platform_inference_cost)]
    _paired_bars(right, teams, costs, lambda c: "$" + number(c, ",.0f"))
    right.set_xlabel("cost of the GPU-hours held ($, list prices)")
    right.set_title("Cost per team (training queues) and of inference", fontsize=9)
    right.margins(x=0.15)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Waits by class and cost per team (seed {seed})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    waits = comparison_table(("vanilla p95 (s)", "platform p95 (s)"),
                             [(cls, number(v, ",.0f"), number(p, ",.0f")) for cls, v, p in run.waits_p95])
    costs_table = comparison_table(("vanilla ($)", "platform ($)"), [
        (team, number(v, ",.0f"), number(p, ",.0f")) for team, (v, p) in zip(teams, costs, strict=True)])
    return (f'<h2 id="waits">Waits by class and cost per team</h2>{image("waits and costs", png(fig))}'
            f'<div style="display:flex; gap:2em">{waits}{costs_table}</div>')


ABLATION_MEASURES = (("fleet utilisation (%)", "fleet_util_pct", ".1f"), ("inference GPU-h", "inference_gpu_h", ",.0f"),
                     ("useful training GPU-h", "training_useful_gpu_h", ",.0f"), ("SLO minutes", "slo_minutes", ",.1f"))


def _ablation(sweep: Sweep[Any, Any]) -> str:
    runs = _runs(sweep)
    arms = ["vanilla", "platform", *(f"no-{c}" for c in CAPABILITIES)]
    fig, axes = plt.subplots(1, len(ABLATION_MEASURES), figsize=(10.5, 3.6), sharey=True)
    y = np.arange(len(arms))
    for ax, (title, suffix, fmt) in zip(axes, ABLATION_MEASURES, strict=True):
        data = [_values(runs, _fig(f"{arm.replace('-', '_')}_{suffix}")) for arm in arms]
        medians = [statistics.median(d) if d else 0.0 for d in data]
        err = np.array([[m - min(d) if d else 0.0 for m, d in zip(medians, data, strict=True)],
                        [max(d) - m if d else 0.0 for m, d in zip(medians, data, strict=True)]])
        colours = [_VANILLA if a == "vanilla" else "#4c72b0" if a == "platform" else "#a6bddb" for a in arms]
        ax.barh(y, medians, color=colours, xerr=err, error_kw={"elinewidth": 0.8, "capsize": 2})
        right = max([1e-9, *(max(d) for d in data if d)])
        for k, (m, d) in enumerate(zip(medians, data, strict=True)):  # each label past its whisker
            ax.text((max(d) if d else 0.0) + 0.03 * right, k, number(m, fmt) if d else "not run", va="center",
                    fontsize=7)
        ax.axvline(medians[1], color="#4c72b0", linewidth=0.8, linestyle=":")
        ax.set_title(title, fontsize=9)
        ax.margins(x=0.25)
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="x", alpha=0.25)
    axes[0].set_yticks(y, arms, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"The ablation: the platform with one capability off in turn (median over {len(runs)} seed(s), "
                 "whiskers the range; dotted: the platform)", fontsize=10)
    fig.tight_layout()
    return f'<h2 id="ablation">The ablation</h2>{image("ablation", png(fig))}'


def _has_ablation(sweep: Sweep[Any, Any]) -> bool:
    return any(len(run.ablation) > 2 for run in _runs(sweep))


def sections(sweep: Sweep[Any, Any]) -> Sequence[str]:
    """The week's fragments, in reading order: the comparison, utilisation and allocation per pool, the tide
    with the loans and the faults, waits and costs, and the ablation (when the sweep ran it)."""
    if not _runs(sweep):
        return []
    run, seed = _median(sweep)
    out = [_STYLE + _comparison(sweep), '<h2 id="pools">Utilisation and allocation per pool</h2>' + _by_pool(run, seed),
           '<h2 id="tide">The tide, the loans, faults and recoveries</h2>' + _tide(sweep, run, seed),
           _waits_and_costs(run, seed)]
    if _has_ablation(sweep):
        out.append(_ablation(sweep))
    else:
        out.append('<h2 id="ablation">The ablation</h2><p>Not run: this sweep\'s settings have '
                   "<code>ablation</code> off.</p>")
    return out


def write_week_report(sweep: Sweep[Any, Any], path: Path) -> Path:
    """The week's own page: the summary, `sections`, then the median run's tables and the settings folded."""
    run, seed = _median(sweep)
    tables = "".join(f"<h3>{html.escape(t.title)}</h3>" + comparison_table(t.columns, t.rows)
                     for t in SCENARIO.tables(run))
    body = (f"<p>{html.escape(SCENARIO.summary(run))} (seed {seed}, the median run of {len(sweep.seeds)})</p>"
            + "".join(sections(sweep))
            + f"<details><summary>The median run's tables (seed {seed})</summary>{tables}</details>"
            + f"<details><summary>Settings</summary>{settings_table(sweep.settings)}</details>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(f"{SCENARIO.title}: {len(sweep.seeds)} seed(s)", body), encoding="utf-8")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """`python3 -m gpuplane.report.platform`: a sweep on the quick settings (the ablation on), its week page,
    and a headless-Chromium screenshot of the page (the docs' image)."""
    parser = argparse.ArgumentParser(prog="python3 -m gpuplane.report.platform", description=main.__doc__)
    parser.add_argument("--seeds", default="2-3", help="seeds to sweep (default 2-3)")
    parser.add_argument("--days", type=float, default=None, help="simulated days (default: the quick settings')")
    parser.add_argument("--no-ablation", action="store_true", help="leave out the ablation arms")
    parser.add_argument("--out", type=Path, default=Path("out/platform-week"), help="folder for index.html")
    parser.add_argument("--png", type=Path, default=None, help="write a screenshot of the page here")
    parser.add_argument("--width", type=int, default=1100, help="the screenshot's width in pixels")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a settings field over the quick settings (repeatable), e.g. "
                             "--set failure_rate_per_node_day=0.5")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {"ablation": not args.no_ablation}
    if args.days is not None:
        overrides["days"] = args.days
    for assignment in args.set:
        field, sep, value = assignment.partition("=")
        if not sep:
            parser.error(f"--set {assignment!r}: write FIELD=VALUE")
        overrides[field.strip()] = yaml.safe_load(value)
    try:
        settings = with_overrides(PlatformSettings.model_validate(dict(SCENARIO.quick)), overrides)
        seeds = parse_seeds(args.seeds)
    except GpuplaneError as exc:
        parser.error(str(exc))

    def progress(label: str, done: int, total: int) -> None:
        print(f"{label} {done}/{total}", file=sys.stderr, flush=True)

    sweep, path, shot = make_week(settings, seeds, args.out, args.png, args.width, progress)
    print(SCENARIO.summary(_median(sweep)[0]))
    print(path)
    if shot is not None:
        print(f"{shot.path}: {shot.width} × {shot.height}, {shot.size_bytes / 1024:.0f} KiB")
    return 0


def make_week(settings: PlatformSettings, seeds: Sequence[int], out: Path, png: Path | None = None,
              width: int = 1100, progress: Progress = no_progress) -> tuple[Sweep[Any, Any], Path, Screenshot | None]:
    """Sweep `seeds`, write the week page to `out`/index.html and, given `png`, its full-page screenshot
    (shrunk to a palette)."""
    scenario = cast("Scenario[PlatformSettings, PlatformFigures]", SCENARIO)
    sweep = run_seeds(scenario, settings, seeds, progress)
    path = write_week_report(sweep, out / "index.html")
    shot = None
    if png is not None:
        Chromium.find(timeout_s=120.0).full_page(path, png, width)
        shot = shrink_png(png)
    return sweep, path, shot


if __name__ == "__main__":
    raise SystemExit(main())
