"""`gpuplane.sim.whatif`: the replay of a cluster snapshot puts the running pods where they are before anything
else, keeps another stack's cards held, draws the same continuation for every policy, and is reproducible per seed;
`gpuplane replay --snapshot`'s command function."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpuplane.cli import snapshot_cmd
from gpuplane.kube.snapshot import Snapshot, Stack, load_files
from gpuplane.model import GpuplaneError, default_catalog
from gpuplane.sim.whatif import Bind, WhatIfSettings, compare, draw, replay

CATALOG = default_catalog()
FIXTURE = Path(__file__).parent / "fixtures" / "snapshot" / "cluster.json"
QUICK = WhatIfSettings(hours=2.0, sample_every_s=300.0)


def quick(**changes: float) -> WhatIfSettings:
    """The quick settings (2 h, a sample every 5 min) with `changes`."""
    return QUICK.model_copy(update=changes)


@pytest.fixture(scope="module")
def snap() -> Snapshot:
    return load_files(FIXTURE, CATALOG)


@pytest.mark.parametrize("policy", ["binpack", "spread", "fgd-used"])
def test_running_pods_are_bound_where_they_are_before_anything_else(snap: Snapshot, policy: str) -> None:
    result = replay(snap, CATALOG, policy, QUICK, record_binds=True)
    first = result.binds[:len(snap.running)]
    assert [(b.at, b.pod, b.assignment) for b in first] == [(0.0, p.name, p.assignment) for p in snap.running]
    assert not {b.pod for b in result.binds[len(snap.running):]} & {p.name for p in snap.running}


def test_another_stacks_cards_stay_held(snap: Snapshot) -> None:
    # gpu-v100-01's cards 6 and 7 belong to ml/legacy-train-0 (nvidia.com/gpu) for the whole replay.
    result = replay(snap, CATALOG, "spread", WhatIfSettings(hours=8.0, load_scale=3.0), record_binds=True)
    assert len(result.binds) > len(snap.running) + 10  # the continuation did place pods
    assert not [b for b in result.binds if b.assignment.node == "gpu-v100-01" and
                {6, 7} & set(b.assignment.card_indexes)]


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_the_pending_pods_tried_at_once(snap: Snapshot, policy: str) -> None:
    # Capacity 8 + 4 + 8 = 20 GPUs. Held at the start: train-llm-0 4, the two embed halves 1, eval-2 1,
    # notebook-3 0.3, the other stack's 2 cards: 8.3. The 8-card pod fits nowhere (the A100 node has 4 whole cards
    # free); finetune-1 (2 whole), the embed half and the 0.3 notebook fit: 8.3 + 2.8 = 11.1 held, 44.5 % free.
    result = replay(snap, CATALOG, policy, QUICK)
    assert (result.pending_at_start, result.pending_placed_at_once) == (4, 3)
    assert result.unallocated_after_pending_pct == pytest.approx(44.5)


def test_lifetimes_and_the_arrival_rate_come_from_the_running_pods(snap: Snapshot) -> None:
    # Ages of gpuplane's five running pods at 10:00:00: 11993 s, 6267.88 s and 6267.60 s (the embed pods' epoch
    # stamps), 3286 s, 2359 s; mean 30173.48 / 5 = 6034.70 s. Steady arrivals: 5 pods / 6034.70 s = 2.983/h.
    base = draw(snap, QUICK)
    assert base.mean_lifetime_s == pytest.approx(6034.70, abs=0.01)
    assert base.rate_per_s * 3600 == pytest.approx(2.983, abs=0.001)
    assert draw(snap, quick(load_scale=2.0)).rate_per_s == pytest.approx(2 * base.rate_per_s)
    # A known lifetime of 1800 s instead: 5 / 1800 s = 10 pods an hour.
    assert draw(snap, quick(mean_lifetime_s=1800.0)).rate_per_s * 3600 == pytest.approx(10.0)
    running = {p.name for p in snap.running_of(Stack.GPUPLANE)}
    assert set(base.remaining_s) == running and all(t >= 60.0 for t in base.remaining_s.values())


def test_the_continuation_is_drawn_from_the_snapshots_own_pods(snap: Snapshot) -> None:
    draws = draw(snap, WhatIfSettings(hours=24.0, load_scale=4.0))
    sources = {p.request.name for p in snap.running_of(Stack.GPUPLANE)} | {p.name for p in snap.pending}
    assert draws.arrivals
    for arrival in draws.arrivals:
        origin = arrival.request.name.rsplit("-w", 1)[0]
        assert origin in sources
        template = next(p for p in (*[r.request for r in snap.running], *[p.request for p in snap.pending])
                        if p.name == origin)
        assert (arrival.request.gpu, arrival.request.cpu_milli) == (template.gpu, template.cpu_milli)


def test_the_figures_are_reproducible_for_a_seed(snap: Snapshot) -> None:
    policies = ["binpack", "fgd-used"]
    once = compare(snap, CATALOG, policies, quick(seed=7))
    again = compare(snap, CATALOG, policies, quick(seed=7))
    assert once == again
    other = draw(snap, quick(seed=8))
    assert [a.at for a in other.arrivals] != [a.at for a in draw(snap, quick(seed=7)).arrivals]


def test_every_policy_sees_the_same_draws(snap: Snapshot) -> None:
    results = compare(snap, CATALOG, ["binpack", "spread", "fgd"], WhatIfSettings(hours=4.0, seed=3))
    assert len({(r.arrivals, r.arrivals_per_hour, r.mean_lifetime_s) for r in results}) == 1
    assert [r.policy for r in results] == ["binpack/binpack", "spread/spread", "fgd/fgd"]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), load=st.sampled_from([0.5, 1.0, 3.0]))
def test_every_pod_that_arrives_is_placed_pending_or_failed(snap: Snapshot, seed: int, load: float) -> None:
    result = replay(snap, CATALOG, "binpack", WhatIfSettings(hours=3.0, load_scale=load, seed=seed,
                                                             sample_every_s=600.0))
    assert result.placed + result.pending_at_end + result.failed == result.pending_at_start + result.arrivals
    assert 0.0 <= result.unallocated_pct <= 100.0
    assert result.wait_p50_s <= result.wait_p95_s <= 3 * 3600.0


def test_an_unknown_policy_is_refused(snap: Snapshot) -> None:
    with pytest.raises(GpuplaneError, match="no-such-policy"):
        replay(snap, CATALOG, "no-such-policy", QUICK)


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.command("simulate")
    def simulate(snapshot: Path, policy: str = "binpack", compare: list[str] | None = None, seed: int | None = None,
                 hours: float = 8.0, set_: Annotated[list[str] | None, typer.Option("--set")] = None,
                 as_json: Annotated[bool, typer.Option("--json")] = False, seeds: str | None = None) -> None:
        snapshot_cmd.simulate_snapshot(snapshot, policy, compare or [], seed, hours, set_ or [], as_json, seeds)

    @app.command("other")
    def other() -> None:
        """Nothing."""

    return app


def test_simulate_snapshot_reports_each_policy(tmp_path: Path) -> None:
    runner = CliRunner()
    written = runner.invoke(_snapshot_app(), ["snapshot", "--from", str(FIXTURE), "--out", str(tmp_path)])
    assert written.exit_code == 0, written.output
    result = runner.invoke(_app(), ["simulate", str(tmp_path), "--policy", "fgd-used", "--compare", "binpack",
                                    "--hours", "2", "--set", "load_scale=1.5", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["seeds"] == [42] and data["settings"]["load_scale"] == 1.5
    assert [r["policy"] for r in data["results"][0]] == ["fgd-used/fgd", "binpack/binpack"]
    table = runner.invoke(_app(), ["simulate", str(FIXTURE), "--compare", "spread", "--hours", "2"],
                          env={"COLUMNS": "160"})
    assert table.exit_code == 0, table.output
    assert re.search(r"pending placed at once\s*│\s*3\s*│\s*3\s*│", table.output), table.output  # 3 of the 4
    bad = runner.invoke(_app(), ["simulate", str(FIXTURE), "--set", "load_scale=0"])
    assert bad.exit_code == 2 and "load_scale" in bad.output


def test_simulate_snapshot_over_seeds_shows_medians_and_ranges(snap: Snapshot) -> None:
    result = CliRunner().invoke(_app(), ["simulate", str(FIXTURE), "--compare", "spread", "--hours", "2", "--seeds",
                                         "1-3", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["seeds"] == [1, 2, 3] and len(data["results"]) == 3
    # Each seed's figures are that seed's replay, the same as the function gives.
    expected = compare(snap, CATALOG, ["binpack", "spread"], WhatIfSettings(hours=2.0, seed=2))
    assert [r["unallocated_pct"] for r in data["results"][1]] == [r.unallocated_pct for r in expected]
    table = CliRunner().invoke(_app(), ["simulate", str(FIXTURE), "--hours", "2", "--seeds", "1-3"],
                               env={"COLUMNS": "160"})
    assert table.exit_code == 0, table.output
    assert "seeds 1–3 (3): median [min–max]" in table.output


def _snapshot_app() -> typer.Typer:
    app = typer.Typer()
    snapshot_cmd.register(app)

    @app.command("other")
    def other() -> None:
        """Nothing."""

    return app


def test_a_pod_caught_terminating_leaves_and_is_not_drawn_a_lifetime(tmp_path: Path, snap: Snapshot) -> None:
    doc = json.loads(FIXTURE.read_text())
    for item in doc["items"]:
        if item["metadata"]["name"] == "train-llm-0":  # 4 whole A100 cards
            item["metadata"]["deletionTimestamp"] = "2026-11-30T09:59:50Z"
    (tmp_path / "dump.json").write_text(json.dumps(doc))
    ending = load_files(tmp_path / "dump.json", CATALOG)
    assert [p.name for p in ending.running if p.terminating] == ["ml/train-llm-0"]
    assert "ml/train-llm-0" not in draw(ending, QUICK).remaining_s
    # Gone after Kubernetes' 30 s grace and the kubelet's 2 s stop, it frees cards 0-3 of gpu-a100-01: pods land there
    # from then on, never before. Unchanged, the snapshot holds them until train-llm-0's drawn end.
    def on_its_cards(binds: tuple[Bind, ...]) -> list[float]:
        return [b.at for b in binds[len(snap.running):]
                if b.assignment.node == "gpu-a100-01" and {0, 1, 2, 3} & set(b.assignment.card_indexes)]

    freed = on_its_cards(replay(ending, CATALOG, "binpack", QUICK, record_binds=True).binds)
    assert freed and min(freed) >= 32.0
    kept = on_its_cards(replay(snap, CATALOG, "binpack", QUICK, record_binds=True).binds)
    assert all(at >= draw(snap, QUICK).remaining_s["ml/train-llm-0"] for at in kept)
