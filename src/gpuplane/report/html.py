"""The simulation report: one self-contained HTML file with embedded PNG plots.

Plots: unallocated GPU % against arrived workload (fill) or allocation and utilisation over time
(timed), the card occupancy histogram, and failed pods by reason. Several results (e.g. binpack and
spread on the same trace and seed) are drawn on the same axes so they can be compared.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from pydantic import BaseModel

from gpuplane.sim import ReplayMode, SimulationResult

OCCUPANCY_BINS = np.array([0, 1, 251, 501, 751, 1000, 1001])
OCCUPANCY_LABELS = ("idle", "1–250", "251–500", "501–750", "751–999", "full")


def occupancy_histogram(card_used_milli: np.ndarray) -> list[int]:
    """Cards per occupancy bucket: idle, four quarters of partial use, full (in milli-GPU used)."""
    counts, _ = np.histogram(card_used_milli, bins=OCCUPANCY_BINS)
    return [int(c) for c in counts]


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _label(result: SimulationResult) -> str:
    return f"{result.profile} (seed {result.seed})"


def plot_allocation(results: Sequence[SimulationResult]) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    fill = [r for r in results if r.mode is ReplayMode.FILL]
    if fill:
        for result in fill:
            ax.plot(result.arrived_pct, 100.0 - result.allocation_pct, label=_label(result), linewidth=1.4)
        xs = np.linspace(0, 100, 50)
        ax.plot(xs, 100 - xs, color="grey", linestyle=":", linewidth=1, label="ideal (everything placed)")
        ax.set_xlim(60, max(float(r.arrived_pct[-1]) for r in fill if len(r.arrived_pct)) + 1)
        ax.set_ylim(0, 45)
        ax.set_xlabel("arrived workload (% of cluster GPU capacity)")
        ax.set_ylabel("unallocated GPU (%)")
        ax.axvline(100, color="black", linewidth=0.6, alpha=0.4)
        ax.set_title("Unallocated GPU against arrived workload")
    else:
        for result in results:
            series = result.series
            if series is None:
                continue
            hours = np.asarray(series.time_s) / 3600.0
            ax.plot(hours, series.allocation_pct, label=f"allocation, {_label(result)}", linewidth=1.2)
            ax.plot(hours, series.utilisation_pct, label=f"utilisation, {_label(result)}", linewidth=1.0,
                    linestyle="--")
        start, end = results[0].window_s
        if end > start:
            ax.axvspan(start / 3600.0, end / 3600.0, color="grey", alpha=0.08, label="measurement window")
        ax.set_xlabel("virtual time (hours)")
        ax.set_ylabel("% of cluster GPU capacity")
        ax.set_ylim(0, 100)
        ax.set_title("GPU allocation and utilisation over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def plot_occupancy(results: Sequence[SimulationResult]) -> str:
    fill = bool(results) and results[0].mode is ReplayMode.FILL
    moments = (("at 50 % arrived", "card_used_milli_at_50"), ("at 100 % arrived", "card_used_milli_at_100")) \
        if fill else (("at peak allocation", "card_used_milli_at_100"),)
    fig, axes = plt.subplots(1, len(moments), figsize=(5.2 * len(moments), 4.0), squeeze=False)
    width = 0.8 / max(1, len(results))
    x = np.arange(len(OCCUPANCY_LABELS))
    for ax, (title, attribute) in zip(axes[0], moments, strict=True):
        for i, result in enumerate(results):
            counts = occupancy_histogram(getattr(result, attribute))
            ax.bar(x + i * width - 0.4 + width / 2, counts, width, label=_label(result))
        ax.set_xticks(x, OCCUPANCY_LABELS, fontsize=8)
        ax.set_xlabel("milli-GPU used on the card")
        ax.set_ylabel("cards")
        ax.set_title(f"Card occupancy {title}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return _png(fig)


def plot_failures(results: Sequence[SimulationResult]) -> str:
    reasons = sorted({r for result in results for r in result.failed_by_reason},
                     key=lambda r: -sum(res.failed_by_reason[r] for res in results))[:10]
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.45 * max(1, len(reasons)) * max(1, len(results)) ** 0.5))
    if not reasons:
        ax.text(0.5, 0.5, "no failed pods", ha="center", va="center")
        ax.set_axis_off()
        return _png(fig)
    height = 0.8 / len(results)
    y = np.arange(len(reasons))
    for i, result in enumerate(results):
        ax.barh(y + i * height - 0.4 + height / 2, [result.failed_by_reason[r] for r in reasons], height,
                label=_label(result))
    ax.set_yticks(y, reasons, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("failed pods (dominant reason across nodes)")
    ax.set_title("Failed pods by reason")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def summary_rows(result: SimulationResult) -> list[tuple[str, str]]:
    rows = [
        ("mode", result.mode.value),
        ("trace", result.trace),
        ("policy (node/card)", result.profile),
        ("seed", str(result.seed)),
        ("cluster", f"{result.nodes} nodes, {result.total_gpus} GPUs"),
        ("pods submitted / placed / failed", f"{result.submitted} / {result.placed} / {result.failed}"),
    ]
    if result.mode is ReplayMode.FILL:
        rows += [
            ("allocation at 100 % arrived", f"{result.allocation_at(100):.2f} %"),
            ("allocation at 130 % arrived", f"{result.allocation_at(130):.2f} %"),
            ("unallocated GPU at 100 % / 130 %",
             f"{result.unallocated_at(100):.2f} % / {result.unallocated_at(130):.2f} %"),
        ]
    elif result.series is not None and result.series.allocation_pct:
        waits = np.asarray(result.waits_s) if result.waits_s else np.zeros(1)
        rows += [
            ("measurement window (after warm-up)",
             f"{result.window_s[0] / 3600:.1f} h – {result.window_s[1] / 3600:.1f} h"),
            ("mean allocation / utilisation in the window",
             f"{result.window_mean(result.series.allocation_pct):.2f} % / "
             f"{result.window_mean(result.series.utilisation_pct):.2f} %"),
            ("peak allocation", f"{max(result.series.allocation_pct):.2f} %"),
            ("wait p50 / p95 / max", f"{np.percentile(waits, 50):.0f} s / {np.percentile(waits, 95):.0f} s / "
                                     f"{waits.max():.0f} s"),
            ("never placed", str(result.never_placed)),
        ]
    labels = ", ".join(OCCUPANCY_LABELS)
    if result.mode is ReplayMode.FILL:
        for mark, used in (("50", result.card_used_milli_at_50), ("100", result.card_used_milli_at_100)):
            hist = " / ".join(map(str, occupancy_histogram(used)))
            rows.append((f"cards by occupancy at {mark} % arrived ({labels})", hist))
    else:
        hist = " / ".join(map(str, occupancy_histogram(result.card_used_milli_at_100)))
        rows.append((f"cards by occupancy at peak ({labels})", hist))
    rate = f"{result.decisions_per_s:,.0f} ({result.decisions} in {result.wall_s:.2f} s)"
    rows.append(("decisions per second", rate))
    return rows


def write_report(results: Sequence[SimulationResult], path: Path) -> Path:
    """Write the HTML report for one or more results (drawn together) and return its path."""
    if not results:
        raise ValueError("a report needs at least one result")
    path.parent.mkdir(parents=True, exist_ok=True)
    tables = []
    for result in results:
        body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(result))
        reasons = "".join(f"<tr><td>{html.escape(r)}</td><td>{c}</td></tr>"
                          for r, c in result.failed_by_reason.most_common())
        tables.append(f"<h2>{html.escape(_label(result))}</h2><table>{body}</table>"
                      + (f"<h3>Failed pods by reason</h3><table><tr><th>reason</th><th>pods</th></tr>{reasons}</table>"
                         if reasons else ""))
    images = [
        ("allocation", plot_allocation(results)),
        ("occupancy", plot_occupancy(results)),
        ("failures", plot_failures(results)),
    ]
    figures = "".join(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>'
                      for name, data in images)
    intro = ("<p>Trace: Alibaba GPU cluster trace 2023 (openb), from Weng et al., \"Beware of Fragmentation\", "
             "USENIX ATC '23. Allocation counts milli-GPU; arrived workload counts every submitted pod, including "
             "failed ones.</p>")
    path.write_text(page("gpuplane simulation report", intro + figures + "".join(tables)), encoding="utf-8")
    return path


def page(title: str, body: str) -> str:
    """A self-contained HTML page in the reports' common style."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; font-size: 14px; }}
th {{ background: #f4f4f4; }}
figure {{ margin: 1em 0; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{body}
</body></html>
"""


def settings_table(settings: BaseModel) -> str:
    """A scenario's settings as an HTML table of field and value."""
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in settings.model_dump(mode="json").items())
    return f"<h2>Scenario settings</h2><table>{rows}</table>"


def comparison_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table with one labelled row per figure and one column per run."""
    header = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr><th>" + html.escape(row[0]) + "</th>"
                   + "".join(f"<td>{html.escape(str(v))}</td>" for v in row[1:]) + "</tr>" for row in rows)
    return f"<table><tr><th></th>{header}</tr>{body}</table>"


def image(alt: str, data: str) -> str:
    """A base64 PNG (from `png`) embedded as a figure."""
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></figure>'


def png(fig: Figure) -> str:
    """A figure as base64 PNG, for an <img> data URL."""
    return _png(fig)
