"""The co-location report: the five policies side by side, online latency CDFs and card utilisation over
the day."""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from gpuplane.report.html import comparison_table, image, page, png, settings_table
from gpuplane.sim.colocation import ColocationComparison, figure_key

ROWS: tuple[tuple[str, str], ...] = (
    ("online p50 latency (ms)", "online_p50_ms"),
    ("online p99 latency (ms)", "online_p99_ms"),
    ("  p99 against exclusive (%)", "online_p99_vs_exclusive_pct"),
    ("online QPS served (per card)", "online_qps"),
    ("  against exclusive (%)", "online_qps_vs_exclusive_pct"),
    ("online out-of-memory events", "online_oom_events"),
    ("  added by sharing (against exclusive)", "online_oom_added"),
    ("offline work, % of the idle card time", "offline_share_of_idle_pct"),
    ("  of the idle time it could use (less when less work is offered)", "offline_share_of_usable_idle_pct"),
    ("offline GPU-hours (net of lost work)", "offline_gpu_hours"),
    ("offline work done, % of the work offered", "offline_done_pct_of_offered"),
    ("offline GPU-hours lost to evictions", "offline_lost_gpu_hours"),
    ("offline jobs finished", "offline_jobs_done"),
    ("offline evictions", "evictions"),
    ("offline suspensions per hour", "suspensions_per_hour"),
    ("daily average card utilisation (%)", "card_utilisation_pct"),
    ("peak card utilisation (%)", "card_utilisation_peak_pct"),
    ("utilisation gain over exclusive (points)", "utilisation_gain_points"),
    ("peak memory in use (GiB)", "peak_memory_gib"),
)


PLACEMENT_ROWS: tuple[tuple[str, str], ...] = (
    ("offline pods placed", "offline_placed"),
    ("online share of the cards offline pods went to", "online_pressure_under_offline"),
    ("offline pods on cards more than half online (%)", "offline_on_busy_cards_pct"),
    ("stranded compute: free on cards without memory for an offline pod (%)", "stranded_compute_pct"),
    ("stranded memory: free on cards without compute for an offline pod (%)", "stranded_memory_pct"),
)


def placement_rows(comparison: ColocationComparison) -> list[tuple[str, ...]]:
    return [(label, *(str(getattr(p, name)) for p in comparison.placement)) for label, name in PLACEMENT_ROWS]


def policy_names(comparison: ColocationComparison) -> list[str]:
    return [p.value for p in comparison.results]


def comparison_rows(comparison: ColocationComparison) -> list[tuple[str, ...]]:
    figures = comparison.figures()
    keys = [figure_key(p) for p in comparison.results]
    return [(label, *(_text(figures.get(f"{k}_{name}")) for k in keys)) for label, name in ROWS]


def _text(value: object) -> str:
    return "–" if value is None else str(value)


def _latency_plot(comparison: ColocationComparison) -> str:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, result in comparison.results.items():
        lat = np.sort(result.latencies_ms)
        if len(lat) == 0:
            continue
        step = max(1, len(lat) // 4000)
        ax.plot(lat[::step], np.arange(1, len(lat) + 1)[::step] / len(lat), label=policy.value, linewidth=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("online request latency (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.0)
    ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    ax.set_title("Online latency CDF per policy")
    ax.legend(fontsize=8, loc="lower right")
    return png(fig)


def _utilisation_plot(comparison: ColocationComparison) -> str:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for policy, result in comparison.results.items():
        util = result.utilisation_pct()
        hours = (np.arange(len(util)) + 0.5) * result.runs[0].bucket_s / 3600.0
        top.plot(hours, util, label=policy.value, linewidth=1.1)
    top.set_ylabel("card utilisation (%)")
    top.set_ylim(0, 105)
    top.set_title("Card utilisation over the day")
    top.legend(fontsize=8, loc="lower right")
    shown = next((p for p in reversed(list(comparison.results)) if p.shares), None)
    if shown is not None:
        result = comparison.results[shown]
        online, offline = result.busy_pct()
        hours = (np.arange(len(online)) + 0.5) * result.runs[0].bucket_s / 3600.0
        bottom.stackplot(hours, online, offline, labels=["online kernels", "offline kernels, online idle"],
                         colors=["#4c72b0", "#dd8452"], alpha=0.85)
        bottom.set_title(f"What kept the card busy under {shown.value}")
        bottom.legend(fontsize=8, loc="lower right")
    bottom.set_ylabel("share of the card's time (%)")
    bottom.set_ylim(0, 105)
    bottom.set_xlabel("hour")
    return png(fig)


def _placement_table(comparison: ColocationComparison) -> str:
    if not comparison.placement:
        return ""
    s = comparison.scenario
    return (f"<h2>Placement of offline pods beside online pods</h2><p>{s.placement_nodes} nodes × "
            f"{s.placement_gpus_per_node} {html.escape(s.placement_gpu_model)}: "
            f"{s.placement_online_pods_per_card:g} online pod(s) per card spread first, then "
            f"{s.placement_offline_pods_per_card:g} offline pod(s) per card, half compute-heavy and half "
            "memory-heavy, placed by each node and card policy.</p>"
            + comparison_table([p.policy for p in comparison.placement], placement_rows(comparison)))


def write_colocation_report(comparison: ColocationComparison, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = comparison.scenario
    figures = comparison.figures()
    goals = ""
    if "goals_met" in figures:
        goals = (f"<p>Goals for priority+memory-guard: online p99 at most {s.goal_p99_over_exclusive_pct:g} % above "
                 f"exclusive: <b>{figures['goal_p99_met']}</b>; offline uses at least "
                 f"{s.goal_offline_share_of_idle_pct:g} % of the idle time (or of the work offered, when less): "
                 f"<b>{figures['goal_offline_share_met']}</b>; "
                 "no online out-of-memory event that exclusive does not have: "
                 f"<b>{figures['goal_zero_online_oom_met']}</b>. Online alone leaves room for the smallest offline "
                 f"job {figures['offline_memory_room_pct']} % of the time: no policy that keeps memory safe can "
                 "give offline more.</p>")
    offline = ("a backlog of offline jobs that never runs dry fills the rest" if s.offline_gpu_hours_per_day == 0
               else f"{s.offline_gpu_hours_per_day:g} GPU-hours of offline jobs arrive per card and day")
    body = (
        f"<p>{s.cards} shared card(s) of {s.card_memory_gib:g} GiB, {s.days:g} virtual day(s), seed {s.seed}. "
        f"Online requests of {s.online_service_ms:g} ms GPU time keep a card {s.online_peak_util * 100:g} % busy "
        f"at the peak (peak/trough {s.peak_trough_ratio:g}, inter-arrival CV {s.arrival_cv:g}); {offline}. "
        "Every policy replays the same requests and jobs.</p>"
        + goals + comparison_table(policy_names(comparison), comparison_rows(comparison))
        + image("latency CDF", _latency_plot(comparison)) + image("utilisation", _utilisation_plot(comparison))
        + _placement_table(comparison) + settings_table(s)
    )
    path.write_text(page("gpuplane: GPU co-location on one card", body), encoding="utf-8")
    return path
