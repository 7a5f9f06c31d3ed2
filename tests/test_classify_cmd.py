"""gpuplane classify --review (drain3 templates and signature stubs) and gpuplane signatures test."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from gpuplane.cli.classify_cmd import check_signature_file, mine, register, review, stub_pattern, stubs_yaml
from gpuplane.model.failures import load_signature_library, parse_signature_file

LIBRARY = load_signature_library()

# a node's log: a known failure, chatter, and a new problem three times with other numbers
LOG = """\
[2026-12-01 12:00:00] INFO step 100 loss 2.31
[2026-12-01 12:00:01] INFO step 101 loss 2.30
frobnicator: widget 17 failed to attach: handle 0x7f3a lost
frobnicator: widget 23 failed to attach: handle 0x7f3b lost
frobnicator: widget 99 failed to attach: handle 0x1c00 lost
RuntimeError: CUDA error: an illegal memory access was encountered
"""


def test_review_mines_the_unmatched_lines_and_proposes_a_checked_stub(tmp_path: Path) -> None:
    log = tmp_path / "node-1.log"
    log.write_text(LOG)
    result = review([log], LIBRARY)
    # 6 lines, the CUDA error matched: 5 unmatched; the new problem is one template of 3 lines
    assert (result.lines, result.unmatched) == (6, 5)
    new = next(t for t in result.templates if "frobnicator" in t.template)
    assert new.count == 3 and new.candidate and len(new.samples) == 3
    stub = next(s for s in result.stubs if "frobnicator" in s["pattern"])
    # the stub file loads with the bundled library (its examples match, its near miss does not)
    stubs = tmp_path / "stubs.yaml"
    stubs.write_text(stubs_yaml(result.stubs))
    checks, refused = check_signature_file(stubs)
    assert refused is None and any(c.id == stub["id"] and c.ok for c in checks)
    # the INFO chatter is mined but gets no stub (no failure word)
    assert not any("loss" in s["pattern"] for s in result.stubs)


def test_a_stub_pattern_takes_blank_runs_and_bounds_the_variables() -> None:
    pattern = stub_pattern("frobnicator: widget <*> failed to attach: handle <*> lost")
    assert pattern == r"frobnicator:\s+widget.{0,64}?failed\s+to\s+attach:\s+handle.{0,64}?lost"


def test_drain_groups_lines_that_differ_in_their_variables() -> None:
    templates = mine(["job 1 done in 3 s", "job 2 done in 4 s", "disk sda1 full"])
    assert [t.count for t in templates] == [2, 1]


BAD = {"version": 1, "signatures": [{
    "id": "op-widget-lost", "description": "a widget lost its handle", "pattern": "widget \\d+ lost",
    "failure_class": "software", "blame_node": False, "action": "restart-job",
    "examples": ["widget 3 lost"], "near_misses": ["widget 3 found"]}, {
    "id": "op-shadowed", "description": "shadowed by the bundled cuda-illegal-address",
    "pattern": "CUDA error: an illegal", "failure_class": "software", "blame_node": False, "action": "log-only",
    "examples": ["RuntimeError: CUDA error: an illegal memory access was encountered"],
    "near_misses": ["RuntimeError: CUDA error: invalid argument"]}]}


def test_signatures_test_reports_a_shadowed_example(tmp_path: Path) -> None:
    path = tmp_path / "ops.yaml"
    path.write_text(yaml.safe_dump(BAD))
    assert [s.id for s in parse_signature_file(path)[0]] == ["op-widget-lost", "op-shadowed"]
    checks, refused = check_signature_file(path)
    assert refused is None
    by_id = {c.id: c for c in checks}
    assert by_id["op-widget-lost"].ok
    assert not by_id["op-shadowed"].ok and "cuda-illegal-address" in by_id["op-shadowed"].problems[0]


@pytest.mark.parametrize(("change", "code"), [({}, 1), ({"signatures": BAD["signatures"][:1]}, 0)])
def test_the_command_exits_1_when_anything_fails(tmp_path: Path, change: dict[str, object], code: int) -> None:
    path = tmp_path / "ops.yaml"
    path.write_text(yaml.safe_dump({**BAD, **change}))
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a group needs a sibling for typer to keep the group's name
    result = CliRunner().invoke(app, ["signatures", "test", str(path)])
    assert result.exit_code == code, result.output


def test_a_file_the_loader_refuses_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ops.yaml"
    broken = {"version": 1, "signatures": [{**BAD["signatures"][0], "examples": ["widget three lost"]}]}
    path.write_text(yaml.safe_dump(broken))
    checks, refused = check_signature_file(path)
    assert checks == [] and refused is not None and "op-widget-lost" in refused
