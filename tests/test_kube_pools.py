"""GpuPools in effect (`gpuplane.kube.pools`): the plan of pool labels (table-driven and its invariants under
hypothesis), GpuPool objects → the scheduler's pool table, and an extender over KubeCluster + the local API
server that oversubscribes the card memory of a pool's nodes and only theirs, following the GpuPools as they
change; and the `gpuplane extender` command, a real process, reading them."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import CATALOG
from gpuplane.cli.extender_cmd import build_profile
from gpuplane.controllers.tidal import LOAN_LABEL
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.extender import Extender, ExtenderServer
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import ASSIGNMENT, POOL_LABEL, RES_GPU, RES_MEM_PCT, decode_assignment, pod_request
from gpuplane.kube.pools import PoolRule, PoolSync, apply_pools, conflict_message, plan_pools, pool_table
from gpuplane.model import NodeSpec, PoolConfig
from test_kube_extender import Client, args, bind_args

CRS = "/apis/gpuplane.io/v1alpha1/gpupools"


def gpu_pool(name: str, selector: dict[str, str] | None = None, models: tuple[str, ...] = ("A100-40GB",),
             **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": name},
            "spec": {"models": list(models), "nodeSelector": selector or {}, **spec}}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------ GpuPools → the pool table
@pytest.mark.parametrize(("spec", "expected"), [
    ({}, PoolConfig(1.0)),                                          # no oversubscription by default
    ({"oversubscriptionRatio": 2.0}, PoolConfig(2.0)),              # 2 MiB promised per physical MiB
    ({"oversubscriptionRatio": 1.5, "split": 4, "migMode": "off"}, PoolConfig(1.5)),  # the rest: no PoolConfig field
    ({"oversubscriptionRatio": 5.0}, "spec.oversubscriptionRatio: "),  # above the schema's 4
    ({"oversubscriptionRatio": 0.5}, "spec.oversubscriptionRatio: "),  # below 1: would shrink cards
    ({"split": 0}, "spec.split: "),
    ({"models": ["B300-1TB"]}, "spec.models[0]: "),                 # not in the catalog
])
def test_gpu_pools_make_the_pool_table(spec: dict[str, Any], expected: PoolConfig | str) -> None:
    table, invalid = pool_table([gpu_pool("p", {"team": "a"}, **spec), gpu_pool("other")], CATALOG)
    assert table["other"] == PoolConfig(1.0)
    if isinstance(expected, PoolConfig):
        assert table["p"] == expected and invalid == {}
    else:
        assert "p" not in table and invalid["p"].startswith(expected)


def test_a_pool_table_skips_what_is_not_a_gpu_pool() -> None:
    tidal = {"apiVersion": "gpuplane.io/v1alpha1", "kind": "TidalPolicy", "metadata": {"name": "t"}, "spec": {}}
    table, invalid = pool_table([tidal, {"kind": "GpuPool", "metadata": {"name": "x"}}], CATALOG)
    assert table == {} and set(invalid) == {"t", "x"}


# ------------------------------------------------------------------ the plan of labels
def spec(name: str, model: str | None = "A100-40GB", **labels: str) -> NodeSpec:
    return NodeSpec(name, 64_000, 262_144, model, 8 if model else 0,
                    labels=tuple(sorted({k.replace("__", "/"): v for k, v in labels.items()}.items())))


POOL = POOL_LABEL.replace("/", "__")
LOAN = LOAN_LABEL.replace("/", "__")
RULES = {"a": PoolRule({"team": "a"}, frozenset({"A100-40GB"})),
         "dev": PoolRule({"zone": "x"}, frozenset({"A100-40GB", "H100-80GB"}))}


@pytest.mark.parametrize(("node", "change", "members"), [
    (spec("n", team="a"), "a", {"a": ["n"]}),                              # a alone selects it
    (spec("n", team="a", **{POOL: "a"}), None, {"a": ["n"]}),              # already a's: nothing to write
    (spec("n", "H100-80GB", team="a"), None, {}),                          # H100 is not one of a's models
    (spec("n", None, team="a"), None, {}),                                 # no cards
    (spec("n", team="a", zone="x"), None, {}),                             # a and dev: a conflict, neither
    (spec("n", team="a", zone="x", **{POOL: "a"}), None, {"a": ["n"]}),    # ...keeping the label it has
    (spec("n", team="a", **{POOL: "dev"}), "a", {"a": ["n"]}),             # dev let go of it, a takes it
    (spec("n", team="a", **{POOL: "manual"}), None, {}),                   # someone else's label: left
    (spec("n", team="b", **{POOL: "a"}), "-", {}),                         # a let go of it: unlabelled
    (spec("n", team="b", **{POOL: "manual"}), None, {}),                   # not a GpuPool's: left
    (spec("n", team="a", **{POOL: "training", LOAN: "lent"}), None, {}),   # lent: the loan's
    (spec("n", team="b", **{POOL: "a", LOAN: "lent"}), None, {}),          # lent, even with a's label
])
def test_plan(node: NodeSpec, change: str | None, members: dict[str, list[str]]) -> None:
    plan = plan_pools(RULES, [node])
    assert dict(plan.changes) == ({} if change is None else {"n": None if change == "-" else change})
    assert {p: r.nodes for p, r in plan.reports.items() if r.nodes} == members


def test_conflicts_are_named_in_each_pool() -> None:
    nodes = [spec("x1", team="a", zone="x"), spec("x2", team="a", zone="x"), spec("m", team="a", **{POOL: "hand"})]
    plan = plan_pools(RULES, nodes)
    assert plan.changes == {}
    assert conflict_message(plan.reports["dev"]) == (
        "nodes x1, x2 are also selected by GpuPool a: labelled for neither")
    assert conflict_message(plan.reports["a"]) == (
        "nodes x1, x2 are also selected by GpuPool dev: labelled for neither; "
        f"nodes m carry {POOL_LABEL}=hand, which no valid GpuPool manages: left as they are")


LABELS = st.fixed_dictionaries({}, optional={
    "team": st.sampled_from(["a", "b"]), "zone": st.sampled_from(["x", "y"]),
    POOL_LABEL: st.sampled_from(["a", "b", "dev", "manual", "training"]), LOAN_LABEL: st.just("lent")})
NODES = st.lists(st.tuples(st.sampled_from(["A100-40GB", "H100-80GB", "T4", None]), LABELS), max_size=12)
SELECTORS = st.dictionaries(st.sampled_from(["team", "zone"]), st.sampled_from(["a", "b", "x", "y"]), max_size=2)
POOLS = st.dictionaries(st.sampled_from(["a", "b", "dev"]), st.tuples(
    SELECTORS, st.frozensets(st.sampled_from(["A100-40GB", "H100-80GB", "T4"]), min_size=1)), max_size=3)


@settings(max_examples=300, deadline=None)
@given(NODES, POOLS)
def test_plan_invariants(raw_nodes: list[tuple[str | None, dict[str, str]]],
                         raw_pools: dict[str, tuple[dict[str, str], frozenset[str]]]) -> None:
    nodes = [NodeSpec(f"n{i}", 1000, 1024, model, 1 if model else 0, labels=tuple(sorted(labels.items())))
             for i, (model, labels) in enumerate(raw_nodes)]
    rules = {name: PoolRule(selector, models) for name, (selector, models) in raw_pools.items()}
    plan = plan_pools(rules, nodes)
    for node in nodes:
        labels = dict(node.labels)
        current = labels.get(POOL_LABEL)
        selecting = [p for p, rule in rules.items() if rule.selects(node)]
        if node.name not in plan.changes:
            continue
        target = plan.changes[node.name]
        assert LOAN_LABEL not in labels                       # a lent node is never written
        assert current is None or current in rules            # a label no valid pool owns is never written
        if target is None:
            assert current in rules and not selecting         # removed only by its own pool, when it let go
        else:
            assert selecting == [target]                      # set only for the one pool that selects it
    # Each node is counted in at most one pool, and a pool counts only nodes it selects.
    counted = [n for r in plan.reports.values() for n in r.nodes]
    assert len(counted) == len(set(counted))
    by_name = {n.name: n for n in nodes}
    assert all(rules[p].selects(by_name[n]) for p, r in plan.reports.items() for n in r.nodes)
    # Applied, the plan is a fixed point: a second pass (or a restarted operator) writes nothing.
    applied = []
    for node in nodes:
        labels = dict(node.labels)
        if node.name in plan.changes:
            labels.pop(POOL_LABEL, None)
            if (target := plan.changes[node.name]) is not None:
                labels[POOL_LABEL] = target
        applied.append(NodeSpec(node.name, 1000, 1024, node.gpu_model, node.gpus, labels=tuple(sorted(labels.items()))))
    again = plan_pools(rules, applied)
    assert again.changes == {}
    assert {p: r.nodes for p, r in again.reports.items()} == {p: r.nodes for p, r in plan.reports.items()}


# ------------------------------------------------------------------ the extender over the API
def share_pod(name: str) -> dict[str, Any]:
    """One card's share: 60 % of its memory (A100-40GB: 40960 × 60 // 100 = 24576 MiB), no compute asked."""
    return pod_json(name, limits={RES_GPU: "1", RES_MEM_PCT: "60"})


@contextmanager
def extender_over(fake: FakeApiServer) -> Iterator[tuple[Extender, PoolSync, Client]]:
    cluster = KubeCluster(fake.api, CATALOG)
    core = Extender(cluster, CATALOG, build_profile("binpack", None), subscribe_lock=cluster.lock)
    sync = PoolSync(fake.api, CATALOG, core, subscribe_lock=cluster.lock)
    server = ExtenderServer(core, port=0).start()
    client = Client(server.address, server.prefix)
    try:
        assert sync.start(20)
        yield core, sync, client
    finally:
        client.close()
        server.close()
        sync.stop()
        core.close()
        cluster.close()


def world(fake: FakeApiServer) -> dict[str, dict[str, Any]]:
    """dev-0 (one A100-40GB, pool dev) and prod-0 (one A100-40GB, no pool); three pending 60 % pods."""
    fake.add_node(node_json("dev-0", cards=1, labels={POOL_LABEL: "dev"}))
    fake.add_node(node_json("prod-0", cards=1))
    return {name: fake.add_pod(share_pod(name)) for name in ("p1", "p2", "p3")}


def card_of(fake: FakeApiServer, pod: str) -> tuple[str, int]:
    stored = fake.get("pods", f"default/{pod}")
    assert stored is not None
    assignment = decode_assignment(stored["metadata"]["annotations"][ASSIGNMENT])
    return assignment.node, assignment.cards[0].card


def test_a_pool_oversubscribed_2_to_1_holds_two_60_percent_pods_on_one_card_and_only_it() -> None:
    with FakeApiServer() as fake:
        fake.add_object(CRS, gpu_pool("dev", {"team": "dev"}, oversubscriptionRatio=2.0))
        pods = world(fake)
        with extender_over(fake) as (core, sync, client):
            assert core.scheduler.pools == {"dev": PoolConfig(2.0)}
            # dev-0's card promises 40960 × 2 = 81920 MiB; prod-0's card 40960 MiB.
            assert client.post("bind", bind_args(pods["p1"], "dev-0"))[1] == {"Error": ""}  # dev-0: 57344 left
            assert client.post("bind", bind_args(pods["p3"], "prod-0"))[1] == {"Error": ""}  # prod-0: 16384 left
            _, answer = client.post("filter", args(pods["p2"], ["dev-0", "prod-0"]))
            assert answer["NodeNames"] == ["dev-0"]                     # 24576 ≤ 57344; 24576 > 16384
            assert "memory" in answer["FailedNodes"]["prod-0"]
            assert client.post("bind", bind_args(pods["p2"], "dev-0"))[1] == {"Error": ""}  # dev-0: 32768 left
            assert card_of(fake, "p1") == card_of(fake, "p2") == ("dev-0", 0)
            assert sync.invalid == {}


def test_the_extender_follows_the_gpu_pools_and_skips_invalid_ones(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuplane.kube.pools")
    with FakeApiServer() as fake:
        fake.add_object(CRS, gpu_pool("dev", {"team": "dev"}, oversubscriptionRatio=9.0))  # invalid: above 4
        pods = world(fake)
        with extender_over(fake) as (core, sync, client):
            assert core.scheduler.pools is None or dict(core.scheduler.pools) == {}   # no oversell for dev-0
            assert "GpuPool dev is invalid" in caplog.text and "spec.oversubscriptionRatio" in caplog.text
            assert client.post("bind", bind_args(pods["p1"], "dev-0"))[1] == {"Error": ""}
            # dev-0 at 1:1: 40960 − 24576 = 16384 left, p2's 24576 does not fit
            assert client.post("filter", args(pods["p2"], ["dev-0"]))[1]["NodeNames"] == []

            fake.mutate("gpupools", "dev", lambda obj: obj["spec"].update(oversubscriptionRatio=2.0))  # fixed
            wait_for(lambda: sync.applied >= 1, "the fixed pool applied")
            assert core.scheduler.pools == {"dev": PoolConfig(2.0)}
            # dev-0 at 2:1: 81920 − 24576 = 57344 left, p2 fits; p1 (running) kept its card through the rebuild
            assert client.post("filter", args(pods["p2"], ["dev-0"]))[1]["NodeNames"] == ["dev-0"]
            assert "default/p1" in core.scheduler.state.bindings

            fake.api.delete(f"{CRS}/dev")                                   # gone: dev-0 back to 1:1
            wait_for(lambda: sync.applied >= 2, "the pool's removal applied")
            assert dict(core.scheduler.pools or {}) == {}
            assert client.post("filter", args(pods["p2"], ["dev-0"]))[1]["NodeNames"] == []


def test_gpu_pools_that_cannot_be_listed_yet_are_applied_when_they_can() -> None:
    with FakeApiServer() as fake:
        fake.add_object(CRS, gpu_pool("dev", oversubscriptionRatio=2.0))
        world(fake)
        fake.fail_next("GET", r"/gpupools$", 404, "NotFound")   # the CRD not there yet: the first list fails
        cluster = KubeCluster(fake.api, CATALOG)
        core = Extender(cluster, CATALOG, build_profile("binpack", None), subscribe_lock=cluster.lock)
        sync = PoolSync(fake.api, CATALOG, core, subscribe_lock=cluster.lock)
        try:
            assert not sync.start(20)                             # not synced, and it did not wait the 20 s out
            assert "404" in sync.informer.last_error
            wait_for(lambda: sync.applied == 1, "the retried list applied")
            assert core.scheduler.pools == {"dev": PoolConfig(2.0)}
        finally:
            sync.stop()
            core.close()
            cluster.close()


def test_a_new_pool_table_keeps_the_cards_of_binds_in_flight() -> None:
    with FakeApiServer() as fake:
        pods = world(fake)
        with extender_over(fake) as (core, _, client):
            request = pod_request(pods["p1"], CATALOG)
            decision = core.placement(request, "dev-0")
            assert decision.assignment is not None
            with core.state_lock:
                core.scheduler.assume(request, decision.assignment)  # decided, its Binding not posted yet
            assert apply_pools(core, {"dev": PoolConfig(2.0)})
            assert core.scheduler.state.bindings["default/p1"].assignment == decision.assignment
            # dev-0 at 2:1 with p1 held: 81920 − 24576 = 57344 left, p2 then 32768 left, p3 then 8192 left;
            # had the rebuild dropped the hold, the card would show 81920 − 2 × 24576 = 32768 free after p2, p3.
            assert client.post("bind", bind_args(pods["p2"], "dev-0"))[1] == {"Error": ""}
            assert client.post("bind", bind_args(pods["p3"], "dev-0"))[1] == {"Error": ""}
            assert int(core.scheduler.state.card_mem_free[core.scheduler.state.node_index["dev-0"], 0]) == 8192
            assert not apply_pools(core, {"dev": PoolConfig(2.0)})  # the same table: nothing rebuilt


# ------------------------------------------------------------------ the command
def test_the_extender_command_reads_the_gpu_pools(tmp_path: Path) -> None:
    with FakeApiServer() as fake:
        fake.add_object(CRS, gpu_pool("dev", oversubscriptionRatio=2.0))
        fake.add_object(CRS, gpu_pool("broken", split=0))
        world(fake)
        kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
        script = ("import typer; from gpuplane.cli.extender_cmd import register; app = typer.Typer(); "
                  "app.callback()(lambda: None); register(app); app()")
        env = {**os.environ, "KUBERNETES_SERVICE_HOST": ""}
        proc = subprocess.Popen([sys.executable, "-c", script, "extender", "--port", "0", "--kubeconfig",
                                 str(kubeconfig)], env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if "gpuplane extender on" in line:
                    break
            banner = "".join(lines)
            assert re.search(r"GpuPools: dev ×2\)", banner), banner
            assert "GpuPool broken is invalid" in banner and "spec.split" in banner
        finally:
            proc.kill()
            proc.communicate(timeout=20)
