"""The fault drills: their checks catch what they claim to, and every drill leaves nothing lost."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from gpuplane.cli import drill_cmd
from gpuplane.controllers.tidal import LOAN_LABEL, LOAN_TAINT
from gpuplane.kube.api import ApiError
from gpuplane.kube.drills import (
    DRILLS,
    Component,
    FaultyApiServer,
    double_booking,
    lent_twice,
    lifecycle_problems,
    nothing_lost,
    run_drill,
)
from gpuplane.kube.localapi import node_json, pod_json
from gpuplane.kube.objects import ASSIGNMENT

LEASES = "/apis/coordination.k8s.io/v1/namespaces/gpuplane-system/leases"


@pytest.fixture
def server() -> Iterator[FaultyApiServer]:
    running = FaultyApiServer(seed=1)
    running.start()
    running.add_node(node_json("n0", cards=2))
    yield running
    running.stop()


def held(name: str, *cards: tuple[int, int, int, bool], node: str = "n0", bound: str | None = "n0",
         phase: str = "Running", over: bool = False) -> dict[str, Any]:
    """A pod whose assignment holds `cards` as (card, milli, MiB, whole)."""
    doc: dict[str, Any] = {"node": node, "cards": [{"card": c, "milli": m, "mib": b, **({"whole": True} if w else {})}
                                                   for c, m, b, w in cards]}
    if over:
        doc["oversubscribed"] = True
    return pod_json(name, node=bound, phase=phase, annotations={ASSIGNMENT: json.dumps(doc)})


WHOLE0 = (0, 1000, 40960, True)
CASES: list[tuple[str, list[dict[str, Any]], list[str]]] = [
    ("two pods on two cards", [held("a", WHOLE0), held("b", (1, 1000, 40960, True))], []),
    ("one card held whole twice", [held("a", WHOLE0), held("b", WHOLE0)],
     ["n0 card 0: held whole by default/a, default/b"]),
    ("a whole card also shared", [held("a", WHOLE0), held("b", (0, 300, 1024, False))],
     ["n0 card 0: held whole by default/a and shared by default/b"]),
    # 500 + 500 = 1000 milli and 20480 + 20480 = 40960 MiB: exactly full, not over.
    ("shares exactly filling a card", [held("a", (0, 500, 20480, False)), held("b", (0, 500, 20480, False))], []),
    # 600 + 500 = 1100 milli > 1000.
    ("shares over a card's compute", [held("a", (0, 600, 1024, False)), held("b", (0, 500, 1024, False))],
     ["n0 card 0: 1100 milli / 2048 MiB by default/a, default/b"]),
    # 30000 + 20000 = 50000 MiB > 40960 unless both are oversubscribed.
    ("shares over a card's memory", [held("a", (1, 100, 30000, False)), held("b", (1, 100, 20000, False))],
     ["n0 card 1: 200 milli / 50000 MiB by default/a, default/b"]),
    ("oversold memory is allowed", [held("a", (1, 100, 30000, False), over=True),
                                    held("b", (1, 100, 20000, False), over=True)], []),
    ("a finished pod holds nothing", [held("a", WHOLE0), held("b", WHOLE0, phase="Succeeded")], []),
    ("bound elsewhere than assigned", [held("a", WHOLE0, bound="n9")],
     ["default/a: bound to n9 but its assignment names n0"]),
    ("a card the node does not have", [held("a", (2, 1000, 40960, True))], ["default/a: card 2 of n0, which has 2"]),
]


@pytest.mark.parametrize(("case", "pods", "problems"), CASES, ids=[c[0] for c in CASES])
def test_double_booking_names_every_overbooked_card(server: FaultyApiServer, case: str, pods: list[dict[str, Any]],
                                                    problems: list[str]) -> None:
    for pod in pods:
        server.add_pod(pod)
    assert double_booking(server) == problems


@pytest.mark.parametrize(("labels", "taints", "problems"), [
    ({}, [], []),
    ({LOAN_LABEL: "lent"}, [LOAN_TAINT], []),
    ({LOAN_LABEL: "lent"}, [LOAN_TAINT, LOAN_TAINT], ["n1: 2 loan taints"]),
    ({LOAN_LABEL: "lent"}, [], ["n1: loan label without the loan taint"]),
    ({}, [LOAN_TAINT], ["n1: loan label missing beside the loan taint"]),
])
def test_lent_twice(server: FaultyApiServer, labels: dict[str, str], taints: list[Any], problems: list[str]) -> None:
    server.add_node(node_json("n1", labels=labels,
                              taints=[{"key": t.key, "value": t.value, "effect": t.effect} for t in taints]))
    assert lent_twice(server) == problems


def steps(*names: str) -> list[dict[str, str]]:
    """A lifecycle history of `names`, each `name` or `name:detail`."""
    return [{"step": n.split(":")[0], "detail": n.partition(":")[2], "t": "0"} for n in names]


@pytest.mark.parametrize(("history", "problems"), [
    (steps("cordoned", "drain-blocked:p2", "draining:1 evicted", "draining:0 evicted", "drained", "repairing"), []),
    (steps("cordoned", "drained", "repairing"), []),  # no pods: drained in the pass after the cordon
    # the cordon's step missing (a leader killed between the cordon and its step)
    (steps("draining:2 evicted", "drained", "repairing"), ["step 0 'draining' after 'nothing'"]),
    (steps("cordoned", "cordoned", "drained", "repairing"), ["step 1 'cordoned' () repeated"]),
    (steps("cordoned", "draining:x", "draining:x", "drained", "repairing"), ["step 2 'draining' (x) repeated"]),
    (steps("cordoned", "repairing"), ["step 1 'repairing' after 'cordoned'"]),  # drained skipped
    (steps("cordoned", "draining:1 evicted", "drained"), ["ends at 'drained', not 'repairing'"]),
    ([], ["ends at 'nothing', not 'repairing'"]),
])
def test_lifecycle_problems_name_every_repeated_or_skipped_step(history: list[dict[str, str]],
                                                                problems: list[str]) -> None:
    assert lifecycle_problems(history) == problems


def test_a_stopped_process_or_a_dead_leader_is_caught(server: FaultyApiServer, tmp_path: Path) -> None:
    alive = Component("a", ["--help"], tmp_path, lease="gpuplane-system/l")
    dead = Component("b", ["--help"], tmp_path, lease="gpuplane-system/l")
    server.api.create(LEASES, {"metadata": {"name": "l", "namespace": "gpuplane-system"},
                               "spec": {"holderIdentity": "b"}})
    alive.process = _Sleeper()  # type: ignore[assignment]
    checks = {c.name: c for c in nothing_lost(server, [alive, dead])}
    assert not checks["no process left stopped"].ok
    assert checks["no process left stopped"].detail == "b; gpuplane-system/l held by 'b', not a running replica"
    assert checks["no card double-booked"].ok and checks["no node lent twice"].ok


class _Sleeper:
    """Stands for a running child process."""

    def poll(self) -> None:
        return None


def test_the_faulty_server_delays_and_refuses(server: FaultyApiServer) -> None:
    server.latency_s = 0.2
    started = time.monotonic()
    server.api.get("/api/v1/nodes/n0")
    assert time.monotonic() - started >= 0.2
    server.latency_s = 0.0
    server.error_rate, server.error_status = 1.0, 429
    with pytest.raises(ApiError) as refused:
        server.api.get("/api/v1/nodes/n0")
    assert refused.value.status == 429 and server.harmed >= 1
    server.error_rate = 0.0
    assert server.api.get("/api/v1/nodes/n0")["metadata"]["name"] == "n0"


# -- the drills themselves -------------------------------------------------------------------------------------------

DIRECT = [name for name in DRILLS if name != "stale-cache"]


@pytest.mark.parametrize("name", DIRECT)
def test_every_drill_leaves_nothing_lost(name: str, tmp_path: Path) -> None:
    result = run_drill(name, tmp_path)
    assert result.ok, result.text()
    names = [c.name for c in result.checks]
    assert {"no card double-booked", "no node lent twice", "no process left stopped"} <= set(names)
    assert result.did, "a drill says what it did"


def test_the_drill_command_prints_what_it_did_and_checked(tmp_path: Path) -> None:
    app = typer.Typer()
    drill_cmd.register(app)
    app.command("noop")(lambda: None)  # a second command, so typer keeps `drill` as a subcommand
    result = CliRunner().invoke(app, ["drill", "stale-cache", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "drill stale-cache: PASS" in result.output and "did: restarted it" in result.output
    assert "ok   no card double-booked" in result.output and "1 of 1 drills passed" in result.output
    saved = json.loads((tmp_path / "drills.json").read_text())
    assert saved[0]["name"] == "stale-cache" and saved[0]["ok"] is True
    assert (tmp_path / "stale-cache" / "sched-a.log").read_text()


@pytest.mark.parametrize(("args", "code", "says"), [
    (["drill", "--list"], 0, "kill-scheduler: SIGKILL the leading scheduler"),
    (["drill", "kill-everything"], 2, "unknown drill kill-everything"),
])
def test_the_drill_command_lists_and_refuses(args: list[str], code: int, says: str) -> None:
    app = typer.Typer()
    drill_cmd.register(app)
    app.command("noop")(lambda: None)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == code and says in result.output, result.output

