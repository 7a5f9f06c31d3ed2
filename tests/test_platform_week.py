"""The platform week: the fleet as configured, one world for every controller, vanilla's whole cards, the
ablation flags, and no card over-allocated at any sample."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.controllers.health import QUARANTINE_TAINT
from gpuplane.model import Fraction, WholeCards, default_catalog
from gpuplane.model.priority import BATCH_LOW, DEV, TRAINING
from gpuplane.port import ClusterEvent, EventKind
from gpuplane.sim.platform import CAPABILITIES, SCENARIO, PlatformSettings, build_fleet, run_arm
from gpuplane.sim.platform.fleet import DEV_POOL, INFERENCE_POOL, STABLE_POOL, TIDAL_POOL, TRAINING_POOL, pool_configs
from gpuplane.sim.platform.work import SCALED, TIDAL, Service, build_services, gpu_form, service_pools
from gpuplane.sim.scenario.kit import check_scenario
from gpuplane.sim.scenario.world import World

TINY: dict[str, Any] = {**SCENARIO.quick, "days": 0.5, "warmup_hours": 1.0}


def test_the_scenario_follows_the_rules() -> None:
    assert check_scenario(SCENARIO) == []


def test_the_default_fleet_is_a_mid_size_fleet() -> None:
    nodes = build_fleet(PlatformSettings())
    by_pool: dict[str, int] = defaultdict(int)
    for node in nodes:
        by_pool[node.pool] += node.gpus
    # training: (200 A100 + 200 H100) × 8 = 3,200; inference A10/T4: (150 + 150) × 8 = 2,400;
    # L40S: 200 × 8 = 1,600, a quarter (50 nodes, 400 GPUs) stable and 150 nodes (1,200 GPUs) lendable;
    # dev: 200 × 4 A30 = 800. 1,100 nodes, 8,000 GPUs.
    assert len(nodes) == 1100
    assert sum(by_pool.values()) == 8000
    assert dict(by_pool) == {"training": 3200, "inference": 2400, "inference-stable": 400,
                             "inference-tidal": 1200, "dev": 800}
    catalog = default_catalog()
    assert {n.gpu_model for n in nodes} == {"A100-80GB", "H100-80GB", "A10", "T4", "L40S", "A30-24GB"}
    assert all(catalog.get(n.gpu_model or "") for n in nodes)


@pytest.mark.parametrize(("vgpu", "oversell"), [(True, 2.0), (False, 1.0)])
def test_dev_memory_is_oversold_only_with_vgpu(vgpu: bool, oversell: float) -> None:
    pools = pool_configs(PlatformSettings(vgpu=vgpu))
    assert pools[DEV_POOL].memory_oversell == oversell
    assert pools[TRAINING_POOL].memory_oversell == 1.0


@pytest.mark.parametrize(("vgpu", "milli", "expected"), [
    (True, 500, Fraction(compute_milli=500, memory_mib=11_514)),  # half of an A10's 23,028 MiB
    (False, 500, WholeCards(1)),  # the device plugin rounds a half card up
    (False, 250, WholeCards(1)),
    (True, 1000, WholeCards(1)),
    (False, 8000, WholeCards(8)),
])
def test_a_fraction_is_whole_cards_without_vgpu(vgpu: bool, milli: int, expected: object) -> None:
    assert default_catalog().get("A10").memory_mib == 23_028
    assert gpu_form(PlatformSettings(vgpu=vgpu), "A10", milli) == expected


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_an_ablation_switches_exactly_one_capability(capability: str) -> None:
    base = PlatformSettings()
    moved = base.without(capability)
    before, after = base.model_dump(), moved.model_dump()
    assert [k for k in before if before[k] != after[k]] == [capability]


def test_vanilla_switches_every_capability_and_the_scoring() -> None:
    base, vanilla = PlatformSettings(), PlatformSettings().vanilla()
    before, after = base.model_dump(), vanilla.model_dump()
    assert sorted(k for k in before if before[k] != after[k]) == sorted((*CAPABILITIES, "binpack"))


def _sampler(world: World, every_s: float, seen: list[dict[str, object]]) -> None:
    """Every `every_s`, what the one cluster holds: each card's compute and memory, pools of nodes, kinds."""
    catalog = default_catalog()

    def sample() -> None:
        compute: dict[tuple[str, int], int] = defaultdict(int)
        memory: dict[tuple[str, int], int] = defaultdict(int)
        kinds: set[str] = set()
        whole = True
        for binding in world.cluster.state.bindings.values():
            request = binding.request
            kinds.add(request.workload.split("-svc")[0] if request.workload else str(request.priority_class))
            for share in binding.assignment.cards:
                compute[(binding.assignment.node, share.card)] += share.compute_milli
                memory[(binding.assignment.node, share.card)] += share.memory_mib
                whole &= share.compute_milli == 1000
        nodes = {n.name: n.spec for n in world.cluster.list_nodes()}
        pools = world.cluster.state.pools
        oversell = {name: pools[spec.pool].memory_oversell if spec.pool in pools else 1.0
                    for name, spec in nodes.items()}
        seen.append({
            "over_compute": [k for k, v in compute.items() if v > 1000],
            "over_memory": [k for k, v in memory.items()
                            if v > catalog.get(nodes[k[0]].gpu_model or "").memory_mib * oversell[k[0]]],
            "kinds": kinds, "whole": whole,
            "lent": sum(1 for spec in nodes.values() if spec.name.startswith("l40s-tidal") and spec.pool
                        == TRAINING_POOL),
            "tidal_home": sum(1 for spec in nodes.values() if spec.pool == TIDAL_POOL),
        })
        world.loop.call_later(every_s, sample)

    world.loop.call_later(every_s, sample)


def test_vanilla_gets_whole_cards_only() -> None:
    seen: list[dict[str, object]] = []
    run_arm(PlatformSettings(**TINY).vanilla(), lambda w: _sampler(w, 1800.0, seen))
    assert seen and all(s["whole"] for s in seen)
    assert not any(s["lent"] for s in seen)  # vanilla lends nothing


def test_every_controller_acts_on_the_one_cluster() -> None:
    """On the one SimCluster: the GPU scaler's and the tidal controller's replicas, training gangs, dev
    boxes, batch backfill and near-line pods, and (at night) L40S nodes lent into the training pool."""
    seen: list[dict[str, object]] = []
    run = run_arm(PlatformSettings(**{**TINY, "days": 1.0}), lambda w: _sampler(w, 1800.0, seen))
    kinds = set().union(*(s["kinds"] for s in seen))  # type: ignore[arg-type]
    assert {"a10", "t4", "l40s", TRAINING, DEV, BATCH_LOW} <= kinds
    assert max(int(s["lent"]) for s in seen) > 0  # type: ignore[call-overload]
    assert run.loans > 0
    assert not all(s["whole"] for s in seen)  # vGPU fractions were placed


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), vgpu=st.booleans(), binpack=st.booleans())
def test_no_card_is_over_allocated_at_any_sample(seed: int, vgpu: bool, binpack: bool) -> None:
    seen: list[dict[str, object]] = []
    run_arm(PlatformSettings(**{**TINY, "days": 0.25, "warmup_hours": 0.5, "seed": seed, "vgpu": vgpu,
                                "binpack": binpack}), lambda w: _sampler(w, 600.0, seen))
    assert seen
    assert all(not s["over_compute"] for s in seen)
    assert all(not s["over_memory"] for s in seen)


def test_a_sweep_without_the_ablation_reports_its_figures_as_absent() -> None:
    """The quick settings run no ablation arms: their figures are NaN (absent), never a made-up 0, and the
    sweep's JSON and tables still come out."""
    import math

    from gpuplane.sim.scenario.sweep import run_seeds

    sweep = run_seeds(SCENARIO, PlatformSettings(**{**TINY, "days": 0.25, "warmup_hours": 0.5}), (1,))
    run = sweep.runs[0]
    assert math.isnan(run.no_tidal_fleet_util_pct)
    assert not math.isnan(run.platform_fleet_util_pct)
    data = sweep.to_json()
    json.dumps(data, allow_nan=False)  # plain JSON: an absent figure is null, not NaN
    assert data["figures"]["no_tidal_fleet_util_pct"]["median"] is None
    assert data["runs"][0]["no_tidal_fleet_util_pct"] is None
    assert [t.title for t in SCENARIO.tables(run)][1:] == ["beside the reports' figures",
                                                         "ablation: the platform with one capability off"]
    from gpuplane.report.platform import sections

    page = sections(sweep)
    # utilisation and allocation per pool, the tide, waits and costs, the tables (no ablation bars without it)
    assert len(page) == 5
    assert sum("<img" in part for part in page) == 3
    assert "The comparison" in page[0] and "Waits by class" in page[3] and "Not run" in page[4]


FAULTY = {**TINY, "days": 0.25, "warmup_hours": 0.5, "failure_rate_per_node_day": 2.0, "seed": 2}


def test_by_hand_a_fault_hangs_the_gang_for_the_manual_delay() -> None:
    """At 2 faults per training node-day on 12 training nodes a quarter day draws about 6 faults. By hand, a
    gang a fault hits holds its cards until a person restarts it `manual_recovery_s` (4,800 s) later."""
    run = run_arm(PlatformSettings(**{**FAULTY, "recovery": False}))
    assert len(run.failures) >= 2 and run.recoveries
    assert run.recovery_delays_s == pytest.approx([4800.0] * len(run.recoveries))
    assert not run.isolated  # nobody isolates: the faulty node is cordoned for its repair
    assert run.ledger.lost_gpu_h() > 0  # work since the last save was lost to the fault


def test_with_recovery_the_controller_diagnoses_isolates_and_restarts() -> None:
    """With recovery on, the production RecoveryController adopted every gang: its verdict comes after the
    detection and diagnosis delays (10 s + 30 s, plus the 600 s NCCL timeout for a hang), far sooner than a
    person's 4,800 s, and the nodes it isolates go through the health book's repair cycle."""
    seen: list[World] = []
    run = run_arm(PlatformSettings(**FAULTY), on_world=seen.append)
    assert len(run.failures) >= 2 and run.recoveries
    for delay_s in run.recovery_delays_s:
        assert delay_s == pytest.approx(40.0) or delay_s == pytest.approx(640.0)
    assert run.isolated  # persistent faults (87 % of the mix) get their node isolated
    quarantined = {n.spec.name for n in seen[0].cluster.list_nodes()
                   if any(t.key == QUARANTINE_TAINT.key for t in n.spec.taints)}
    assert quarantined <= set(run.isolated)  # only the controller's isolations carry its taint
    assert run.ledger.lost_gpu_h() > 0


@pytest.mark.parametrize(("flag", "value"), [("--trace", "gpushare40"), ("--mode", "timed"), ("--policy", "fgd"),
                                             ("--snapshot", "snap")])
def test_simulate_points_a_replay_flag_to_replay(flag: str, value: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["simulate", flag, value, "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert f"gpuplane replay {flag}" in result.output
    assert not list(tmp_path.iterdir())  # it failed before running anything


def test_simulate_runs_the_platform_week(tmp_path: Path) -> None:
    sets = [arg for key, value in TINY.items() for arg in ("--set", f"{key}={str(value).lower()}")]
    result = CliRunner().invoke(app, ["simulate", *sets, "--seeds", "2", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["scenario"] == "platform-week"
    assert data["seeds"] == [2]
    assert (tmp_path / "platform-week.html").exists()


def test_the_backlogs_stay_full_within_a_step() -> None:
    """With one refill a step a backlog of 4 near-line pods submits at most 4 a minute, however much room the
    inference cards have; refilled until the scheduler places none, the near-line work fills the room the
    scaled-down services leave, and inference allocation rises. (One pod a near-line task, so that the pods
    turn over as fast as the refill matters: a worker stays, and the backlog's rate matters less.)"""
    churn = {**TINY, "nearline_worker": False}
    capped = run_arm(PlatformSettings(**{**churn, "backlog_rounds": 1}))
    full = run_arm(PlatformSettings(**churn))
    assert sum(full.alloc["inference"]) > sum(capped.alloc["inference"])
    assert sum(full.util["inference"]) > sum(capped.util["inference"])


def _count_nearline_pods(world: World, counts: list[int]) -> None:
    def on_event(event: ClusterEvent) -> None:
        if event.kind is EventKind.POD_ADDED and event.pod is not None and event.pod.name.startswith("nearline-"):
            counts[0] += 1

    world.cluster.watch(on_event)


def test_a_nearline_worker_takes_its_next_task_in_place() -> None:
    """The assumption that near-line pods are queue workers, moved: with one pod a task every completion
    deletes a pod and schedules a new one (a tenth of a card-hour's task is ~2 pods an hour a slot); a worker
    stays, so far fewer near-line pods are created, and the share it held is not left empty between tasks,
    so the inference cards' utilisation is not lower."""
    per_task, worker = [0], [0]
    one = run_arm(PlatformSettings(**{**TINY, "nearline_worker": False}), lambda w: _count_nearline_pods(w, per_task))
    kept = run_arm(PlatformSettings(**{**TINY, "nearline_worker": True}), lambda w: _count_nearline_pods(w, worker))
    assert 0 < worker[0] < per_task[0] / 2
    assert sum(kept.util["inference"]) >= sum(one.util["inference"])
    assert kept.batch.useful_gpu_h > 0


def _nearline_on_lent_nodes(world: World, landed: list[str]) -> None:
    """Every near-line pod bound onto a node of the training pool (a lent tidal node) is recorded."""
    def on_event(event: ClusterEvent) -> None:
        pod = event.pod
        if event.kind is EventKind.POD_BOUND and pod is not None and pod.name.startswith("nearline-") \
                and pod.assignment is not None:
            (info,) = [n for n in world.cluster.list_nodes() if n.name == pod.assignment.node]
            if info.spec.pool == TRAINING_POOL:
                landed.append(pod.name)

    world.cluster.watch(on_event)


def test_nearline_work_on_the_l40s_cards_fills_them_and_leaves_lending_alone() -> None:
    """The assumption of where near-line work co-locates, moved: on the A10/T4 cards only, the L40S cards
    the tidal services leave by day sit empty; on the stable subset's too (the default), those are allocated
    and busy and nothing is lent differently; on the tidal subset's too, its cards are as well, the tidal
    controller still lends its nodes at night (it evicts the near-line pods there), and no near-line pod is
    ever bound onto a lent node. The tidal replicas stay on their own subset here (no overflow onto the stable
    nodes, whose free cards near-line work changes), so the tidal subset's cards see near-line placement alone."""
    landed: list[str] = []
    confined: dict[str, Any] = {**TINY, "tidal_overflow": False}
    narrow = run_arm(PlatformSettings(**{**confined, "nearline_l40s": "none"}))
    stable = run_arm(PlatformSettings(**{**confined, "nearline_l40s": "stable"}))
    wide = run_arm(PlatformSettings(**{**confined, "nearline_l40s": "all"}),
                   lambda w: _nearline_on_lent_nodes(w, landed))
    assert sum(stable.alloc["inference-stable"]) > sum(narrow.alloc["inference-stable"])
    assert sum(stable.util["inference-stable"]) > sum(narrow.util["inference-stable"])
    # the tidal subset's cards as without (their replicas follow the same load; the training draws may differ)
    assert sum(stable.alloc[TIDAL_POOL]) == pytest.approx(sum(narrow.alloc[TIDAL_POOL]), rel=0.01)
    assert stable.lend_displaced == 0
    assert sum(wide.alloc[TIDAL_POOL]) > sum(stable.alloc[TIDAL_POOL])
    assert sum(wide.util[TIDAL_POOL]) > sum(stable.util[TIDAL_POOL])
    assert wide.loans > 0 and wide.lend_displaced > 0 and landed == []
    assert narrow.lend_displaced == 0
    assert sum(narrow.util["fleet"]) < sum(stable.util["fleet"]) < sum(wide.util["fleet"])


def test_the_rise_reserve_serves_flash_crowds_at_the_cost_of_replicas() -> None:
    """The SLO figure's assumption, moved: flash crowds (six a day per service here, ×1.6 over two minutes)
    outrun a replica's start (120 s plus a step) at a 70 % target (1/0.7 ≈ 1.43× headroom). Without the
    reserve they cost SLO minutes; with it the scaler holds the largest rise it saw, fewer minutes are
    short and more inference GPU-hours are held. Bigger crowds teach a bigger reserve: more GPU-hours."""
    crowded: dict[str, Any] = {**TINY, "days": 1.0, "bursts_per_day": 6.0}
    plain = run_arm(PlatformSettings(**{**crowded, "rise_reserve": False}))
    held = run_arm(PlatformSettings(**{**crowded, "rise_reserve": True}))
    bigger = run_arm(PlatformSettings(**{**crowded, "rise_reserve": True, "burst_factor": 2.4}))
    assert plain.slo_minutes > 0
    assert held.slo_minutes < plain.slo_minutes
    assert held.inference_gpu_h > plain.inference_gpu_h
    assert bigger.inference_gpu_h > held.inference_gpu_h


def test_a_tidal_peak_beyond_the_tidal_nodes_takes_the_stable_nodes_spare_cards() -> None:
    """The assumption of where a tidal service's replicas may run, moved: confined to the tidal subset, a peak
    (or a flash crowd) beyond its cards waits while the stable subset's cards hold batch fillers; allowed the
    stable subset too, those replicas preempt the fillers at once, so fewer minutes are short of capacity and
    pending online pods (shortage), at about the same inference GPU-hours."""
    crowded: dict[str, Any] = {**TINY, "days": 1.0, "bursts_per_day": 6.0}
    confined = run_arm(PlatformSettings(**{**crowded, "tidal_overflow": False}))
    spilled = run_arm(PlatformSettings(**{**crowded, "tidal_overflow": True}))
    assert spilled.slo_minutes < confined.slo_minutes
    assert spilled.shortage_minutes < confined.shortage_minutes
    assert spilled.inference_gpu_h == pytest.approx(confined.inference_gpu_h, rel=0.05)


# (kind, lending, overflow) -> the pools of the service's workloads (name suffix -> pools)
BOTH = {STABLE_POOL, TIDAL_POOL}
POOLS_OF = [
    (TIDAL, True, True, {"-stable": {STABLE_POOL}, "-tidal": BOTH}),  # the floor at home, the rest spills over
    (TIDAL, True, False, {"-stable": {STABLE_POOL}, "-tidal": {TIDAL_POOL}}),  # confined to each subset
    (TIDAL, False, True, {"-stable": BOTH, "-tidal": BOTH}),  # nothing lent: one pool to both workloads
    (TIDAL, False, False, {"-stable": BOTH, "-tidal": BOTH}),
    (SCALED, True, True, {"": {INFERENCE_POOL}}),  # A10/T4 services: one workload on the inference pool
    (SCALED, False, False, {"": {INFERENCE_POOL}}),
]


@pytest.mark.parametrize(("kind", "lending", "overflow", "expected"), POOLS_OF)
def test_where_a_services_replicas_may_run(kind: str, lending: bool, overflow: bool,
                                           expected: dict[str, set[str]]) -> None:
    svc: Service = next(x for x in build_services(PlatformSettings(**TINY), np.random.default_rng(1)) if x.kind == kind)
    pools = service_pools(svc, lending=lending, overflow=overflow)
    assert {name.removeprefix(svc.name): set(allowed) for name, allowed in pools.items()} == expected


def _dev_cards(world: World, seen: list[dict[tuple[str, int], list[tuple[str, int | None, int | None]]]]) -> None:
    """Every 1800 s, each dev card's holders: (form, MIG profile, MIG start) per pod on it."""

    def sample() -> None:
        cards: dict[tuple[str, int], list[tuple[str, int | None, int | None]]] = defaultdict(list)
        for binding in world.cluster.state.bindings.values():
            if binding.request.priority_class != DEV:
                continue
            form = type(binding.request.gpu).__name__
            for share in binding.assignment.cards:
                cards[(binding.assignment.node, share.card)].append((form, share.mig_profile, share.mig_start))
        seen.append(cards)
        world.loop.call_later(1800.0, sample)

    world.loop.call_later(1800.0, sample)


@pytest.mark.parametrize(("vgpu", "mig_share", "expect_mig"), [
    (True, 0.5, True),    # half the dev boxes ask for a 2g.12gb instance
    (True, 0.0, False),   # none asks
    (False, 0.5, False),  # vanilla's device plugin gives whole cards, MIG share or not
])
def test_dev_boxes_take_mig_instances_at_legal_starts_beside_vgpu_fractions(vgpu: bool, mig_share: float,
                                                                            expect_mig: bool) -> None:
    seen: list[dict[tuple[str, int], list[tuple[str, int | None, int | None]]]] = []
    run = run_arm(PlatformSettings(**{**TINY, "vgpu": vgpu, "dev_mig_share": mig_share}),
                  lambda w: _dev_cards(w, seen))
    a30 = default_catalog().get("A30-24GB")
    profile = a30.mig_profile("2g.12gb")
    assert profile is not None
    holders = [h for cards in seen for card in cards.values() for h in card]
    migs = [h for h in holders if h[0] == "MigSlice"]
    assert bool(migs) == expect_mig
    assert (max(run.mig_pods) > 0) == expect_mig
    for _, prof, start in migs:
        assert prof == profile.profile_id and start in profile.starts  # 2g.12gb starts at memory slice 0 or 2
    for cards in seen:
        for holders_ in cards.values():
            forms = {h[0] for h in holders_}
            assert not ("MigSlice" in forms and len(forms) > 1)  # a card in MIG mode takes no vGPU fraction
            starts = sorted(h[2] for h in holders_ if h[0] == "MigSlice")
            assert len(starts) == len(set(starts)) <= 2  # two 2g.12gb instances at most, never overlapping
    if not vgpu:
        assert all(h[0] == "WholeCards" for h in holders)


def test_a_dev_mig_profile_the_a30_lacks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"dev_mig_profile: the A30 has no MIG profile '3g.40gb' \(one of 1g.6gb"):
        PlatformSettings(dev_mig_profile="3g.40gb")
