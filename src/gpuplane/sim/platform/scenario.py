"""The platform week as a scenario of the kit: vanilla Kubernetes, the platform, and the platform with each
capability off in turn, on the same fleet, workload and seed (`gpuplane scenario platform-week`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np

from gpuplane.model.priority import BATCH_LOW, DEV, ONLINE, TRAINING
from gpuplane.sim.platform.fleet import CAPABILITIES, POOLS, PlatformSettings
from gpuplane.sim.platform.week import ArmRun, run_arm
from gpuplane.sim.scenario import DAY_S, Figures, Goal, Headline, Progress, Table, figure, series

VANILLA = "vanilla"
PLATFORM = "platform"
ABLATIONS = tuple(f"no-{c}" for c in CAPABILITIES)
ARMS = (VANILLA, PLATFORM, *ABLATIONS)
POOL_KEYS = (("training", "training"), ("inference", "inference"), ("stable", "inference-stable"),
             ("tidal", "inference-tidal"), ("dev", "dev"), ("fleet", "fleet"))
WAIT_FLOOR_S = 60.0
"""A class whose vanilla p95 wait is below this is compared against this (a percentage of near zero is noise)."""

REPORTED: tuple[tuple[str, str, str], ...] = (
    ("AI GPU utilisation (vivo: backfill, tidal, vGPU together)", "+5 points", "platform_util_gain_points"),
    ("inference cost (vivo)", "−30 %", "platform_inference_cost_cut_pct"),
    ("daily average utilisation from co-location (Kuaishou)", "+7 points", "no_colocation_fleet_util_pct"),
    ("daily peak utilisation from co-location (Kuaishou)", "+6 points", "platform_peak_util_gain_points"),
    ("daily average utilisation from tidal (Kuaishou)", "+3–5 points", "no_tidal_fleet_util_pct"),
    ("night conversion (Kuaishou)", "20 %+", "platform_night_conversion_pct"),
    ("co-location allocation (Kuaishou)", "~80 %", "platform_inference_alloc_pct"),
    ("ETTR (vivo)", "60 → 99 %", "platform_ettr_pct"),
    ("vGPU density (vivo: one card as three)", "3 pods/card", "platform_vgpu_density"),
)


class PlatformFigures(Figures):
    """One seed's week on every arm; utilisation, allocation, waits and SLO minutes after the warm-up."""

    nodes: int = figure("all", "nodes in the fleet")
    gpus: int = figure("all", "GPUs in the fleet")
    vanilla_training_util_pct: float = figure(VANILLA, "daily average GPU utilisation (SM busy), pool training", "%")
    vanilla_training_util_peak_pct: float = figure(
        VANILLA, "daily peak GPU utilisation, pool training (mean of the days)", "%")
    vanilla_training_alloc_pct: float = figure(VANILLA, "daily average GPU allocation, pool training", "%")
    vanilla_inference_util_pct: float = figure(VANILLA, "daily average GPU utilisation (SM busy), pool inference", "%")
    vanilla_inference_util_peak_pct: float = figure(
        VANILLA, "daily peak GPU utilisation, pool inference (mean of the days)", "%")
    vanilla_inference_alloc_pct: float = figure(VANILLA, "daily average GPU allocation, pool inference", "%")
    vanilla_stable_util_pct: float = figure(
        VANILLA, "daily average GPU utilisation (SM busy), pool inference-stable", "%")
    vanilla_stable_util_peak_pct: float = figure(
        VANILLA, "daily peak GPU utilisation, pool inference-stable (mean of the days)", "%")
    vanilla_stable_alloc_pct: float = figure(VANILLA, "daily average GPU allocation, pool inference-stable", "%")
    vanilla_tidal_util_pct: float = figure(
        VANILLA, "daily average GPU utilisation (SM busy), pool inference-tidal", "%")
    vanilla_tidal_util_peak_pct: float = figure(
        VANILLA, "daily peak GPU utilisation, pool inference-tidal (mean of the days)", "%")
    vanilla_tidal_alloc_pct: float = figure(VANILLA, "daily average GPU allocation, pool inference-tidal", "%")
    vanilla_dev_util_pct: float = figure(VANILLA, "daily average GPU utilisation (SM busy), pool dev", "%")
    vanilla_dev_util_peak_pct: float = figure(VANILLA, "daily peak GPU utilisation, pool dev (mean of the days)", "%")
    vanilla_dev_alloc_pct: float = figure(VANILLA, "daily average GPU allocation, pool dev", "%")
    vanilla_fleet_util_pct: float = figure(VANILLA, "daily average GPU utilisation (SM busy), fleet-wide", "%")
    vanilla_fleet_util_peak_pct: float = figure(
        VANILLA, "daily peak GPU utilisation, fleet-wide (mean of the days)", "%")
    vanilla_fleet_alloc_pct: float = figure(VANILLA, "daily average GPU allocation, fleet-wide", "%")
    vanilla_inference_gpu_h: float = figure(VANILLA, "GPU-hours inference replicas hold", "GPU-h")
    vanilla_inference_cost: float = figure(VANILLA, "cost of the GPU-hours inference holds (price_per_gpu_h)", "$")
    vanilla_training_useful_gpu_h: float = figure(
        VANILLA, "useful training work: progress kept by a save or a completion", "GPU-h")
    vanilla_training_held_gpu_h: float = figure(VANILLA, "GPU-hours training gangs hold", "GPU-h")
    vanilla_ettr_pct: float = figure(VANILLA, "useful training work over the GPU-hours training holds", "%")
    vanilla_training_lost_gpu_h: float = figure(VANILLA, "training work lost, every cause", "GPU-h")
    vanilla_training_jobs_done: int = figure(VANILLA, "training jobs completed", "")
    vanilla_online_wait_p95_s: float = figure(VANILLA, "p95 wait, class online (created to bound)", "s")
    vanilla_training_wait_p95_s: float = figure(
        VANILLA, "p95 wait, class training (a gang member, created to bound)", "s")
    vanilla_dev_wait_p95_s: float = figure(VANILLA, "p95 wait, class dev", "s")
    vanilla_slo_minutes: float = figure(
        VANILLA, "service-minutes with load above the serving replicas' capacity", "min")
    vanilla_shortage_minutes: float = figure(
        VANILLA, "minutes with an online replica pending for want of a card", "min")
    vanilla_vgpu_density: float = figure(VANILLA, "dev pods per physical dev card in use", "pods/card")
    vanilla_dev_mig_pods: float = figure(VANILLA, "dev boxes on a MIG instance, mean over the samples", "pods")
    vanilla_preemptions: int = figure(VANILLA, "pods the scheduler preempted", "")
    vanilla_evictions: int = figure(VANILLA, "pods evicted (preemption and reclaim)", "")
    vanilla_failures: int = figure(VANILLA, "training-node faults", "")
    platform_training_util_pct: float = figure(PLATFORM, "daily average GPU utilisation (SM busy), pool training", "%")
    platform_training_util_peak_pct: float = figure(
        PLATFORM, "daily peak GPU utilisation, pool training (mean of the days)", "%")
    platform_training_alloc_pct: float = figure(PLATFORM, "daily average GPU allocation, pool training", "%")
    platform_inference_util_pct: float = figure(
        PLATFORM, "daily average GPU utilisation (SM busy), pool inference", "%")
    platform_inference_util_peak_pct: float = figure(
        PLATFORM, "daily peak GPU utilisation, pool inference (mean of the days)", "%")
    platform_inference_alloc_pct: float = figure(PLATFORM, "daily average GPU allocation, pool inference", "%")
    platform_stable_util_pct: float = figure(
        PLATFORM, "daily average GPU utilisation (SM busy), pool inference-stable", "%")
    platform_stable_util_peak_pct: float = figure(
        PLATFORM, "daily peak GPU utilisation, pool inference-stable (mean of the days)", "%")
    platform_stable_alloc_pct: float = figure(PLATFORM, "daily average GPU allocation, pool inference-stable", "%")
    platform_tidal_util_pct: float = figure(
        PLATFORM, "daily average GPU utilisation (SM busy), pool inference-tidal", "%")
    platform_tidal_util_peak_pct: float = figure(
        PLATFORM, "daily peak GPU utilisation, pool inference-tidal (mean of the days)", "%")
    platform_tidal_alloc_pct: float = figure(PLATFORM, "daily average GPU allocation, pool inference-tidal", "%")
    platform_dev_util_pct: float = figure(PLATFORM, "daily average GPU utilisation (SM busy), pool dev", "%")
    platform_dev_util_peak_pct: float = figure(PLATFORM, "daily peak GPU utilisation, pool dev (mean of the days)", "%")
    platform_dev_alloc_pct: float = figure(PLATFORM, "daily average GPU allocation, pool dev", "%")
    platform_fleet_util_pct: float = figure(PLATFORM, "daily average GPU utilisation (SM busy), fleet-wide", "%")
    platform_fleet_util_peak_pct: float = figure(
        PLATFORM, "daily peak GPU utilisation, fleet-wide (mean of the days)", "%")
    platform_fleet_alloc_pct: float = figure(PLATFORM, "daily average GPU allocation, fleet-wide", "%")
    platform_inference_gpu_h: float = figure(PLATFORM, "GPU-hours inference replicas hold", "GPU-h")
    platform_inference_cost: float = figure(PLATFORM, "cost of the GPU-hours inference holds (price_per_gpu_h)", "$")
    platform_training_useful_gpu_h: float = figure(
        PLATFORM, "useful training work: progress kept by a save or a completion", "GPU-h")
    platform_training_held_gpu_h: float = figure(PLATFORM, "GPU-hours training gangs hold", "GPU-h")
    platform_ettr_pct: float = figure(PLATFORM, "useful training work over the GPU-hours training holds", "%")
    platform_training_lost_gpu_h: float = figure(PLATFORM, "training work lost, every cause", "GPU-h")
    platform_training_jobs_done: int = figure(PLATFORM, "training jobs completed", "")
    platform_online_wait_p95_s: float = figure(PLATFORM, "p95 wait, class online (created to bound)", "s")
    platform_training_wait_p95_s: float = figure(
        PLATFORM, "p95 wait, class training (a gang member, created to bound)", "s")
    platform_dev_wait_p95_s: float = figure(PLATFORM, "p95 wait, class dev", "s")
    platform_slo_minutes: float = figure(
        PLATFORM, "service-minutes with load above the serving replicas' capacity", "min")
    platform_shortage_minutes: float = figure(
        PLATFORM, "minutes with an online replica pending for want of a card", "min")
    platform_vgpu_density: float = figure(PLATFORM, "dev pods per physical dev card in use", "pods/card")
    platform_dev_mig_pods: float = figure(PLATFORM, "dev boxes on a MIG instance, mean over the samples", "pods")
    platform_preemptions: int = figure(PLATFORM, "pods the scheduler preempted", "")
    platform_evictions: int = figure(PLATFORM, "pods evicted (preemption and reclaim)", "")
    platform_failures: int = figure(PLATFORM, "training-node faults", "")
    platform_batch_wait_p95_s: float = figure(PLATFORM, "p95 wait, class batch-low", "s")
    platform_batch_useful_gpu_h: float = figure(PLATFORM, "batch and near-line work kept", "GPU-h")
    platform_batch_lost_gpu_h: float = figure(
        PLATFORM, "batch and near-line work lost to preemption and reclaim", "GPU-h")
    platform_night_conversion_pct: float = figure(
        PLATFORM, "share of inference GPUs lent to training, mean over the loan windows", "%")
    platform_loans: int = figure(PLATFORM, "nodes lent", "")
    platform_early_reclaims: int = figure(PLATFORM, "lent nodes taken back before the window's end", "")
    platform_util_gain_points: float = figure(PLATFORM, "fleet-wide daily average utilisation over vanilla's", "points")
    platform_peak_util_gain_points: float = figure(
        PLATFORM, "fleet-wide daily peak utilisation over vanilla's", "points")
    platform_inference_gpu_h_cut_pct: float = figure(PLATFORM, "inference GPU-hours below vanilla's", "%")
    platform_inference_cost_cut_pct: float = figure(PLATFORM, "inference cost below vanilla's", "%")
    platform_slo_minutes_added: float = figure(PLATFORM, "SLO minutes over vanilla's", "min")
    platform_worst_wait_p95_added_pct: float = figure(
        PLATFORM, "the worst class's p95 wait over vanilla's (over 60 s where vanilla's is below)", "%")
    platform_training_work_gain_pct: float = figure(PLATFORM, "useful training work over vanilla's", "%")
    no_autoscale_fleet_util_pct: float = figure("no-autoscale", "fleet-wide daily average GPU utilisation", "%")
    no_autoscale_inference_gpu_h: float = figure("no-autoscale", "GPU-hours inference replicas hold", "GPU-h")
    no_autoscale_training_useful_gpu_h: float = figure("no-autoscale", "useful training work", "GPU-h")
    no_autoscale_slo_minutes: float = figure("no-autoscale", "SLO service-minutes", "min")
    no_tidal_fleet_util_pct: float = figure("no-tidal", "fleet-wide daily average GPU utilisation", "%")
    no_tidal_inference_gpu_h: float = figure("no-tidal", "GPU-hours inference replicas hold", "GPU-h")
    no_tidal_training_useful_gpu_h: float = figure("no-tidal", "useful training work", "GPU-h")
    no_tidal_slo_minutes: float = figure("no-tidal", "SLO service-minutes", "min")
    no_backfill_fleet_util_pct: float = figure("no-backfill", "fleet-wide daily average GPU utilisation", "%")
    no_backfill_inference_gpu_h: float = figure("no-backfill", "GPU-hours inference replicas hold", "GPU-h")
    no_backfill_training_useful_gpu_h: float = figure("no-backfill", "useful training work", "GPU-h")
    no_backfill_slo_minutes: float = figure("no-backfill", "SLO service-minutes", "min")
    no_colocation_fleet_util_pct: float = figure("no-colocation", "fleet-wide daily average GPU utilisation", "%")
    no_colocation_inference_gpu_h: float = figure("no-colocation", "GPU-hours inference replicas hold", "GPU-h")
    no_colocation_training_useful_gpu_h: float = figure("no-colocation", "useful training work", "GPU-h")
    no_colocation_slo_minutes: float = figure("no-colocation", "SLO service-minutes", "min")
    no_vgpu_fleet_util_pct: float = figure("no-vgpu", "fleet-wide daily average GPU utilisation", "%")
    no_vgpu_inference_gpu_h: float = figure("no-vgpu", "GPU-hours inference replicas hold", "GPU-h")
    no_vgpu_training_useful_gpu_h: float = figure("no-vgpu", "useful training work", "GPU-h")
    no_vgpu_slo_minutes: float = figure("no-vgpu", "SLO service-minutes", "min")
    no_recovery_fleet_util_pct: float = figure("no-recovery", "fleet-wide daily average GPU utilisation", "%")
    no_recovery_inference_gpu_h: float = figure("no-recovery", "GPU-hours inference replicas hold", "GPU-h")
    no_recovery_training_useful_gpu_h: float = figure("no-recovery", "useful training work", "GPU-h")
    no_recovery_slo_minutes: float = figure("no-recovery", "SLO service-minutes", "min")
    time_h: tuple[float, ...] = series("sample times (h)")
    util_series: tuple[tuple[str, str, tuple[float, ...]], ...] = series("(arm, pool, utilisation % per sample)")
    alloc_series: tuple[tuple[str, str, tuple[float, ...]], ...] = series("(arm, pool, allocation % per sample)")
    nodes_series: tuple[tuple[str, tuple[int, ...]], ...] = series("(pool, nodes per sample), platform arm")
    failure_h: tuple[float, ...] = series("fault times (h), platform arm")
    recovery_h: tuple[float, ...] = series("recovery times (h), platform arm")
    vanilla_recovery_h: tuple[float, ...] = series("recovery times (h), vanilla arm")
    team_cost: tuple[tuple[str, float, float], ...] = series("(team, vanilla cost, platform cost)")
    waits_p95: tuple[tuple[str, float, float], ...] = series("(class, vanilla p95 s, platform p95 s)")
    ablation: tuple[tuple[str, float, float, float, float], ...] = series(
        "(arm, fleet util %, inference GPU-h, useful training GPU-h, SLO min) for every arm run")


def _p95(values: Sequence[float]) -> float:
    return float(np.percentile(values, 95)) if len(values) else 0.0


def _daily_peak(time_h: Sequence[float], values: Sequence[float]) -> float:
    if not values:
        return 0.0
    days: dict[int, float] = {}
    for t, v in zip(time_h, values, strict=True):
        day = int(t * 3600.0 // DAY_S)
        days[day] = max(days.get(day, 0.0), v)
    return float(np.mean(list(days.values())))


def _arm_figures(prefix: str, r: ArmRun) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for key, pool in POOL_KEYS:
        util, alloc = r.util.get(pool, []), r.alloc.get(pool, [])
        out[f"{prefix}_{key}_util_pct"] = float(np.mean(util)) if util else 0.0
        out[f"{prefix}_{key}_util_peak_pct"] = _daily_peak(r.time_h, util)
        out[f"{prefix}_{key}_alloc_pct"] = float(np.mean(alloc)) if alloc else 0.0
    held = r.training_held_gpu_h
    out.update({
        f"{prefix}_inference_gpu_h": r.inference_gpu_h, f"{prefix}_inference_cost": r.inference_cost,
        f"{prefix}_training_useful_gpu_h": r.ledger.useful_gpu_h, f"{prefix}_training_held_gpu_h": held,
        f"{prefix}_ettr_pct": 100.0 * r.ledger.useful_gpu_h / held if held > 0 else 0.0,
        f"{prefix}_training_lost_gpu_h": r.ledger.lost_gpu_h(), f"{prefix}_training_jobs_done": r.jobs_done,
        f"{prefix}_online_wait_p95_s": _p95(r.waits.get(ONLINE, [])),
        f"{prefix}_training_wait_p95_s": _p95(r.waits.get(TRAINING, [])),
        f"{prefix}_dev_wait_p95_s": _p95(r.waits.get(DEV, [])),
        f"{prefix}_slo_minutes": r.slo_minutes, f"{prefix}_shortage_minutes": r.shortage_minutes,
        f"{prefix}_vgpu_density": float(np.mean(r.density)) if r.density else 0.0,
        f"{prefix}_dev_mig_pods": float(np.mean(r.mig_pods)) if r.mig_pods else 0.0,
        f"{prefix}_preemptions": r.preemptions, f"{prefix}_evictions": r.evictions,
        f"{prefix}_failures": len(r.failures),
    })
    return out


def _pct_below(ours: float, base: float) -> float:
    return 100.0 * (base - ours) / base if base > 0 else 0.0


def _worst_wait_added(vanilla: ArmRun, ours: ArmRun) -> float:
    worst = -math.inf
    for cls in (ONLINE, TRAINING, DEV):
        base, mine = _p95(vanilla.waits.get(cls, [])), _p95(ours.waits.get(cls, []))
        worst = max(worst, 100.0 * (mine - base) / max(base, WAIT_FLOOR_S))
    return worst


def run_week(settings: PlatformSettings, progress: Progress) -> PlatformFigures:
    arms: dict[str, PlatformSettings] = {VANILLA: settings.vanilla(), PLATFORM: settings}
    if settings.ablation:
        arms.update({f"no-{c}": settings.without(c) for c in CAPABILITIES})
    runs: dict[str, ArmRun] = {}
    for done, (arm, arm_settings) in enumerate(arms.items()):
        progress("arms", done, len(arms))
        runs[arm] = run_arm(arm_settings)
    progress("arms", len(arms), len(arms))
    v, p = runs[VANILLA], runs[PLATFORM]
    values: dict[str, float | int] = {**_arm_figures("vanilla", v), **_arm_figures("platform", p)}
    values.update({
        "nodes": settings.a100_nodes + settings.h100_nodes + settings.a10_nodes + settings.t4_nodes
        + settings.l40s_nodes + settings.a30_nodes,
        "gpus": (settings.a100_nodes + settings.h100_nodes + settings.a10_nodes + settings.t4_nodes
                 + settings.l40s_nodes) * settings.gpus_per_node + settings.a30_nodes * settings.dev_gpus_per_node,
        "platform_batch_wait_p95_s": _p95(p.waits.get(BATCH_LOW, [])),
        "platform_batch_useful_gpu_h": p.batch.useful_gpu_h, "platform_batch_lost_gpu_h": p.batch.lost_gpu_h(),
        "platform_night_conversion_pct": float(np.mean(p.lent_share)) if p.lent_share else 0.0,
        "platform_loans": p.loans, "platform_early_reclaims": p.early_reclaims,
        "platform_util_gain_points": values["platform_fleet_util_pct"] - values["vanilla_fleet_util_pct"],
        "platform_peak_util_gain_points": (values["platform_fleet_util_peak_pct"]
                                           - values["vanilla_fleet_util_peak_pct"]),
        "platform_inference_gpu_h_cut_pct": _pct_below(p.inference_gpu_h, v.inference_gpu_h),
        "platform_inference_cost_cut_pct": _pct_below(p.inference_cost, v.inference_cost),
        "platform_slo_minutes_added": p.slo_minutes - v.slo_minutes,
        "platform_worst_wait_p95_added_pct": _worst_wait_added(v, p),
        "platform_training_work_gain_pct": -_pct_below(p.ledger.useful_gpu_h, v.ledger.useful_gpu_h),
    })
    for cap in CAPABILITIES:
        r = runs.get(f"no-{cap}")
        values[f"no_{cap}_fleet_util_pct"] = float(np.mean(r.util["fleet"])) if r is not None else math.nan
        values[f"no_{cap}_inference_gpu_h"] = r.inference_gpu_h if r is not None else math.nan
        values[f"no_{cap}_training_useful_gpu_h"] = r.ledger.useful_gpu_h if r is not None else math.nan
        values[f"no_{cap}_slo_minutes"] = r.slo_minutes if r is not None else math.nan
    arms_series = ((VANILLA, v), (PLATFORM, p))
    teams = sorted(set(v.team_cost) | set(p.team_cost))
    return PlatformFigures(
        **values,  # type: ignore[arg-type]
        time_h=tuple(p.time_h),
        util_series=tuple((a, pool, tuple(r.util[pool])) for a, r in arms_series for pool in (*POOLS, "fleet")),
        alloc_series=tuple((a, pool, tuple(r.alloc[pool])) for a, r in arms_series for pool in (*POOLS, "fleet")),
        nodes_series=tuple((pool, tuple(p.nodes[pool])) for pool in POOLS),
        failure_h=tuple(p.failures), recovery_h=tuple(p.recoveries), vanilla_recovery_h=tuple(v.recoveries),
        team_cost=tuple((team, v.team_cost.get(team, 0.0), p.team_cost.get(team, 0.0)) for team in teams),
        waits_p95=tuple((cls, _p95(v.waits.get(cls, [])), _p95(p.waits.get(cls, []))) for cls in
                        (ONLINE, TRAINING, DEV, BATCH_LOW)),
        ablation=tuple((arm, float(np.mean(r.util["fleet"])), r.inference_gpu_h, r.ledger.useful_gpu_h, r.slo_minutes)
                       for arm, r in runs.items()),
    )


def _f(value: float, fmt: str = ".1f") -> str:
    return "—" if isinstance(value, float) and math.isnan(value) else format(value, fmt)


def _reported(f: PlatformFigures, name: str) -> str:
    """Our figure beside a report's; an ablation's utilisation is read as the platform's gain over it."""
    value = float(getattr(f, name))
    if name.startswith("no_"):
        return "ablation off" if math.isnan(value) else f"{f.platform_fleet_util_pct - value:+.1f} points"
    return _f(value)


class _PlatformWeek:
    name = "platform-week"
    title = "The platform week: every capability on one fleet, against vanilla Kubernetes"
    settings = PlatformSettings
    figures = PlatformFigures
    ours = PLATFORM
    arms = ARMS
    goals = (
        Goal("fleet-wide daily average utilisation +15 points over vanilla", "platform_util_gain_points", ">=", 15.0),
        Goal("inference GPU-hours −30 % or better", "platform_inference_gpu_h_cut_pct", ">=", 30.0),
        Goal("no SLO minutes added", "platform_slo_minutes_added", "<=", 0.0),
        Goal("no class's p95 wait worse than vanilla's by more than 5 %", "platform_worst_wait_p95_added_pct", "<=",
             5.0),
        Goal("training work done above vanilla's", "platform_training_work_gain_pct", ">", 0.0),
    )
    headlines = (
        Headline("platform_inference_gpu_h_cut_pct", "an A10/T4 replica needs replica_milli of a card (a small "
                 "model), which vanilla's device plugin rounds up to a whole card", "replica_milli", 1000, "down"),
        Headline("platform_util_gain_points", "a standing low-priority batch backlog fills idle training cards",
                 "backfill", False, "down"),
        Headline("platform_night_conversion_pct", "the tidal controller lends emptied L40S nodes at night",
                 "tidal", False, "down"),
        Headline("platform_vgpu_density", "dev boxes ask for a quarter card and dev memory is oversold 1:2",
                 "vgpu", False, "down"),
    )
    quick: Mapping[str, object] = MappingProxyType({
        "a100_nodes": 6, "h100_nodes": 6, "a10_nodes": 4, "t4_nodes": 4, "l40s_nodes": 8, "a30_nodes": 4,
        "days": 0.5, "warmup_hours": 1.0, "services_per_pool": 2, "dev_boxes": 12, "training_backlog": 3,
        "batch_backlog": 4, "nearline_backlog": 4, "ablation": False})

    def run(self, settings: PlatformSettings, progress: Progress) -> PlatformFigures:
        return run_week(settings, progress)

    def tables(self, figures: PlatformFigures) -> Sequence[Table]:
        f = figures
        rows: list[tuple[str, ...]] = []
        for key, pool in POOL_KEYS:
            for what, suffix in (("utilisation, daily average (%)", "util_pct"), ("utilisation, daily peak (%)",
                                                                                   "util_peak_pct"),
                                 ("allocation, daily average (%)", "alloc_pct")):
                rows.append((f"{pool}: {what}", _f(getattr(f, f"vanilla_{key}_{suffix}")),
                             _f(getattr(f, f"platform_{key}_{suffix}"))))
        for label, name, fmt in (
                ("inference GPU-hours", "inference_gpu_h", ".0f"), ("inference cost ($)", "inference_cost", ".0f"),
                ("useful training work (GPU-h)", "training_useful_gpu_h", ".0f"), ("ETTR (%)", "ettr_pct", ".1f"),
                ("training work lost (GPU-h)", "training_lost_gpu_h", ".1f"),
                ("training jobs done", "training_jobs_done", "d"),
                ("p95 wait online (s)", "online_wait_p95_s", ".0f"), ("p95 wait training (s)", "training_wait_p95_s",
                                                                       ".0f"),
                ("p95 wait dev (s)", "dev_wait_p95_s", ".0f"), ("SLO minutes", "slo_minutes", ".0f"),
                ("shortage minutes", "shortage_minutes", ".0f"),
                ("vGPU density (dev pods per card)", "vgpu_density", ".2f"),
                ("dev boxes on MIG (mean)", "dev_mig_pods", ".1f"),
                ("preemptions", "preemptions", "d"), ("evictions", "evictions", "d"), ("faults", "failures", "d")):
            rows.append((label, _f(getattr(f, f"vanilla_{name}"), fmt), _f(getattr(f, f"platform_{name}"), fmt)))
        rows.append(("night conversion (%)", "", _f(f.platform_night_conversion_pct)))
        rows.append(("batch work kept / lost (GPU-h)", "",
                     f"{f.platform_batch_useful_gpu_h:.0f} / {f.platform_batch_lost_gpu_h:.1f}"))
        main = Table(f"{f.nodes} nodes, {f.gpus} GPUs", ("vanilla", "platform"), tuple(rows))
        reported = Table("beside the reports' figures", ("the reports", "ours"),
                         tuple((label, claim, _reported(f, name)) for label, claim, name in REPORTED))
        ablation = Table("ablation: the platform with one capability off",
                         ("fleet util (%)", "inference GPU-h", "useful training GPU-h", "SLO min"),
                         tuple((arm, _f(util), _f(inf, ".0f"), _f(train, ".0f"), _f(slo, ".0f"))
                               for arm, util, inf, train, slo in f.ablation))
        return (main, reported, ablation)

    def summary(self, figures: PlatformFigures) -> str:
        f = figures
        return (f"platform week: fleet utilisation {f.vanilla_fleet_util_pct:.1f} → {f.platform_fleet_util_pct:.1f} % "
                f"({f.platform_util_gain_points:+.1f} points); inference GPU-h "
                f"{f.platform_inference_gpu_h_cut_pct:.0f} % below vanilla; SLO minutes added "
                f"{f.platform_slo_minutes_added:.0f}; useful training "
                f"{f.platform_training_work_gain_pct:+.1f} %; night conversion {f.platform_night_conversion_pct:.1f} %")


SCENARIO = _PlatformWeek()
