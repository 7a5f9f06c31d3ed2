"""`gpuplane experiment frag`: argument parsing, sweep determinism, outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.model import GpuplaneError
from gpuplane.sim import bundled_path
from gpuplane.sim.experiment import FRAG_POLICIES, RunKey, parse_policies, parse_seeds, summarise, sweep

runner = CliRunner()


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("42-45", [42, 43, 44, 45]), ("42", [42]), ("1,5-6", [1, 5, 6]), (" 7 , 8 ", [7, 8])],
)
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "x", "5-1", "1-x"])
def test_parse_seeds_rejects(text: str) -> None:
    with pytest.raises(GpuplaneError, match="--seeds"):
        parse_seeds(text)


def test_parse_policies() -> None:
    known = [*FRAG_POLICIES, "binpack"]
    assert parse_policies("all", known) == list(FRAG_POLICIES)
    assert parse_policies("fgd,bestfit", known) == ["fgd", "bestfit"]
    with pytest.raises(GpuplaneError, match="unknown tetris"):
        parse_policies("fgd,tetris", known)


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The first 40 bundled nodes and the first 400 default pods, as files."""
    tmp = tmp_path_factory.mktemp("frag")
    nodes, pods = tmp / "nodes.csv", tmp / "pods.csv"
    nodes.write_text("".join(bundled_path("nodes").read_text().splitlines(keepends=True)[:41]))
    pods.write_text("".join(bundled_path("default").read_text().splitlines(keepends=True)[:401]))
    return nodes, pods


def test_sweep_is_deterministic_in_and_across_processes(small_inputs: tuple[Path, Path]) -> None:
    nodes, pods = small_inputs
    args = ([str(pods)], ["bestfit", "fgd", "fgd-online"], [1, 2])
    serial = sweep(*args, nodes_path=str(nodes), workers=1)
    pooled = sweep(*args, nodes_path=str(nodes), workers=2)
    assert [r.key for r in serial] == [RunKey(str(pods), p, s) for p in args[1] for s in args[2]]
    assert [r.allocation_pct for r in serial] == [r.allocation_pct for r in pooled]
    # different seeds shuffle differently
    assert serial[0].allocation_pct != serial[1].allocation_pct
    summary = summarise(serial)
    for policy in args[1]:
        curve = summary.median[str(pods)][policy]
        assert len(curve) == 131 and curve[0] == 100.0  # nothing arrived, everything unallocated
        assert (summary.p25[str(pods)][policy] <= summary.p75[str(pods)][policy]).all()


def test_experiment_command_writes_csv_plots_and_json(tmp_path: Path, small_inputs: tuple[Path, Path]) -> None:
    nodes, pods = small_inputs
    out = tmp_path / "out"
    result = runner.invoke(app, ["experiment", "frag", "--traces", str(pods), "--nodes", str(nodes), "--policies",
                                 "random,fgd", "--seeds", "3-4", "--out", str(out), "--json", "--workers", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(data[str(pods)]) == {"random", "fgd"}
    assert set(data[str(pods)]["fgd"]) == {"100", "110", "120", "130"}
    with (out / "runs.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 2 * 131
    assert {r["seed"] for r in rows} == {"3", "4"}
    assert (out / "unallocated-pods.png").stat().st_size > 10_000
    assert "| " + str(pods) + " | fgd |" in (out / "medians.md").read_text()


def test_experiment_rejects_unknown_trace(tmp_path: Path) -> None:
    result = runner.invoke(app, ["experiment", "frag", "--traces", "nope", "--seeds", "1", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "nope" in result.output
