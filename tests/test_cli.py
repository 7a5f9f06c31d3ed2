"""The command line end to end: simulate (JSON, report, placements audit), explain, bench, bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.sim import bundled_path

runner = CliRunner()
PLACEMENT_COLUMNS = ["seq", "pod", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "node", "cards",
                     "outcome"]
TIMING_KEYS = {"decisions_per_s", "wall_s", "report"}


def _simulate(tmp: Path, *args: str) -> dict[str, object]:
    result = runner.invoke(app, ["replay", "--json", "--out", str(tmp), *args])
    assert result.exit_code == 0, result.output
    data: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], Path, Path]:
    tmp = tmp_path_factory.mktemp("sim")
    placements = tmp / "placements.csv"
    data = _simulate(tmp, "--seed", "42", "--placements", str(placements))
    return data, placements, tmp / "report.html"


def test_simulate_json_has_the_documented_figures(default_run: tuple[dict[str, object], Path, Path]) -> None:
    data, _, report = default_run
    for key in ("allocation_at_100", "allocation_at_130", "failed_pods", "decisions_per_s"):
        assert key in data
    assert 80.0 < float(data["allocation_at_100"]) <= 100.0  # type: ignore[arg-type]
    assert float(data["allocation_at_130"]) >= float(data["allocation_at_100"])  # type: ignore[arg-type]
    assert data["nodes"] == 1213 and data["gpus"] == 6212
    failed_by_reason = data["failed_by_reason"]
    assert isinstance(failed_by_reason, dict)
    assert sum(failed_by_reason.values()) == data["failed_pods"]
    assert data["placed_pods"] + data["failed_pods"] == data["submitted_pods"]  # type: ignore[operator]
    html = report.read_text()
    assert html.count("data:image/png;base64,") == 3


def test_placements_csv_audits_independently(default_run: tuple[dict[str, object], Path, Path]) -> None:
    """Recompute every card's and node's load from the CSV alone: nothing is over capacity."""
    data, placements, _ = default_run
    with bundled_path("nodes").open() as handle:
        nodes = {row["sn"]: row for row in csv.DictReader(handle)}
    card_milli: dict[tuple[str, int], int] = defaultdict(int)
    node_cpu: dict[str, int] = defaultdict(int)
    placed = 0
    with placements.open() as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == PLACEMENT_COLUMNS
        rows = list(reader)
    for row in rows:
        if row["outcome"] != "placed":
            assert row["node"] == "" and "nodes are available" in row["outcome"]
            continue
        placed += 1
        cards = [int(c) for c in row["cards"].split(";")] if row["cards"] else []
        assert len(cards) == int(row["num_gpu"])
        node = nodes[row["node"]]
        node_cpu[row["node"]] += int(row["cpu_milli"])
        for card in cards:
            assert 0 <= card < int(node["gpu"])
            card_milli[(row["node"], card)] += int(row["gpu_milli"])
    assert placed == data["placed_pods"]
    assert len(rows) == data["submitted_pods"]
    assert max(card_milli.values()) <= 1000
    assert all(cpu <= int(nodes[name]["cpu_milli"]) for name, cpu in node_cpu.items())


def test_same_seed_same_result(tmp_path: Path, default_run: tuple[dict[str, object], Path, Path]) -> None:
    first, first_placements, _ = default_run
    placements = tmp_path / "again.csv"
    second = _simulate(tmp_path, "--seed", "42", "--placements", str(placements))
    assert {k: v for k, v in first.items() if k not in TIMING_KEYS} == \
        {k: v for k, v in second.items() if k not in TIMING_KEYS}
    assert placements.read_bytes() == first_placements.read_bytes()


def test_binpack_and_spread_differ(tmp_path: Path, default_run: tuple[dict[str, object], Path, Path]) -> None:
    binpack, _, _ = default_run
    spread = _simulate(tmp_path, "--seed", "42", "--node-policy", "spread", "--card-policy", "spread")
    assert binpack["card_occupancy_at_50"] != spread["card_occupancy_at_50"]
    # binpack keeps more cards idle half way through: it fills used cards before touching new ones
    assert binpack["card_occupancy_at_50"][0] > spread["card_occupancy_at_50"][0]  # type: ignore[index]


def test_explain_lists_per_node_reasons(default_run: tuple[dict[str, object], Path, Path]) -> None:
    _, placements, _ = default_run
    with placements.open() as handle:
        failed = next(row["pod"] for row in csv.DictReader(handle) if row["outcome"] != "placed")
    result = runner.invoke(app, ["explain", failed, "--seed", "42"])
    assert result.exit_code == 0, result.output
    assert "nodes are available" in result.output
    assert "per-node reasons" in result.output


def test_explain_unknown_pod_fails() -> None:
    result = runner.invoke(app, ["explain", "no-such-pod", "--trace", "gpushare100", "--seed", "1"])
    assert result.exit_code == 1
    assert "not submitted" in result.output


def _write_pods(path: Path, rows: list[str]) -> Path:
    header = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
              "scheduled_time")
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_bad_row_stops_with_file_line_and_column(tmp_path: Path) -> None:
    pods = _write_pods(tmp_path / "pods.csv", ["p0,1000,1024,1,500,,LS,Running,0,10,0",
                                               "p1,1000,1024,2,500,,LS,Running,0,10,0"])
    result = runner.invoke(app, ["replay", "--trace", str(pods), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert f"{pods}:3: gpu_milli" in " ".join(result.output.split())


def test_skip_bad_rows_reports_what_was_skipped(tmp_path: Path) -> None:
    pods = _write_pods(tmp_path / "pods.csv", ["p0,1000,1024,1,500,,LS,Running,0,10,0",
                                               "p1,abc,1024,1,500,,LS,Running,0,10,0",
                                               "p2,1000,1024,1,250,X9000,LS,Running,0,10,0"])
    data = _simulate(tmp_path, "--trace", str(pods), "--skip-bad-rows")
    skipped = data["skipped_rows"]
    assert isinstance(skipped, list) and "2 skipped" in skipped[0]
    assert "cpu_milli" in skipped[0] and "gpu_spec" in skipped[0]


def test_timed_mode_reports_waits(tmp_path: Path) -> None:
    data = _simulate(tmp_path, "--trace", "gpushare100", "--mode", "timed", "--load", "1.2", "--seed", "3",
                     "--hours", "3")
    assert data["mode"] == "timed"
    assert 0 < float(data["mean_allocation_pct"]) <= 100  # type: ignore[arg-type]
    assert float(data["wait_p95_s"]) >= float(data["wait_p50_s"]) >= 0  # type: ignore[arg-type]


def test_unknown_policy_is_a_clear_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["replay", "--node-policy", "tetris", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown node policy 'tetris'" in result.output


def test_bench_schedule_json() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuplane.cli.main", "bench", "schedule", "--nodes", "300",
                             "--json"], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(result.stdout)
    assert figures["trace"]["nodes"] == 1213
    assert figures["synthetic"]["nodes"] == 300
    for row in figures.values():
        assert row["decisions_per_s"] > 0 and row["peak_rss_mb"] > 0


def test_console_script_is_installed() -> None:
    result = subprocess.run(["gpuplane", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "simulate" in result.stdout and "explain" in result.stdout and "bench" in result.stdout


def test_oversold_dev_pool_places_more_memory_than_exists(tmp_path: Path) -> None:
    """One A30 (24576 MiB) in a dev pool oversold 1:2 takes three 12000 MiB pods; the third is oversold."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model,pool\ndev-0,64000,262144,1,A30,dev\n")
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  dev: {memory_oversell: 2.0}\n")
    rows = [f"p{i},1000,1024,1,100,,LS,Running,0,10,0,12000" for i in range(5)]
    header = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,"
              "scheduled_time,gpu_memory_mib")
    pods = tmp_path / "pods.csv"
    pods.write_text("\n".join([header, *rows]) + "\n")
    data = _simulate(tmp_path, "--trace", str(pods), "--nodes", str(nodes), "--pools", str(pools))
    # Fill tunes 5 × 100 milli up to 1.3 cards: 13 pods arrive. 2 × 24576 = 49152 MiB can be promised:
    # four 12000 MiB pods (48000) fit, the rest do not. Physical 24576 MiB holds two; two are oversold.
    assert data["submitted_pods"] == 13
    assert data["placed_pods"] == 4
    assert data["oversubscribed_pods"] == 2
    assert data["failed_by_reason"] == {"insufficient GPU memory": 9}


def test_pools_file_errors_name_the_field(tmp_path: Path) -> None:
    pools = tmp_path / "pools.yaml"
    pools.write_text("pools:\n  dev: {memory_oversell: 0.5}\n")
    result = runner.invoke(app, ["replay", "--pools", str(pools), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "pools.dev.memory_oversell" in " ".join(result.output.split())


def test_bench_preempt_json() -> None:
    result = runner.invoke(app, ["bench", "preempt", "--preemptors", "60", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["nodes"] == 1213
    assert figures["median_fill_pct"] >= 95.0
    # Some of the 60 high-priority pods need preemption at 95 % full; each plan evicts at least one pod.
    assert figures["preemption_plans"] > 0
    assert figures["victims"] >= figures["preemption_plans"]
    assert figures["unschedulable"] == 0
    assert figures["median_preemption_decisions_per_s"] > 0


@pytest.mark.parametrize("args", [["--fill-pct", "0"], ["--preemptors", "0"], ["--victim-order", "oldest"]])
def test_bench_preempt_rejects_bad_flags(args: list[str]) -> None:
    result = runner.invoke(app, ["bench", "preempt", "--repeats", "1", *args])
    assert result.exit_code == 2
    assert "--" in result.output
