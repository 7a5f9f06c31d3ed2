"""The Grafana dashboards of deploy/grafana/, run against a real Prometheus.

A simulated cluster (SimCluster, the core scheduler, gpuplane's metrics through `ClusterObserver`) is served
over HTTP while it runs; two gpuplane node exporters on fake cards serve dcgm-exporter's metrics, and one
target is dead (for `up == 0`). `/usr/bin/prometheus` scrapes them every second with gpuplane's rule files
loaded. Then every panel's query (the dashboards' variables set to All, `$__rate_interval` to 1m) runs through
the HTTP API: each must succeed and return finite samples, since the feed gives every panel data; the
variables' `label_values` queries must list values; the rules must evaluate without error, and the alerts
the feed provokes (a lent node past its reclaim deadline, a dead exporter) must be active."""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from builders import CATALOG, node, pod
from gpuplane.controllers.observer import ClusterObserver, scheduler_counters
from gpuplane.controllers.recovery import HEALTH_LABEL
from gpuplane.controllers.tidal import LOAN_ANNOTATION, LOAN_LABEL, RECLAIM_ANNOTATION, RECLAIM_REASON
from gpuplane.model import PodRequest, QueueQuota, Quotas
from gpuplane.model.priority import default_priority_classes
from gpuplane.node.exporter import Exporter
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.port import PodPhase
from gpuplane.port.metrics import PlaneMetrics
from gpuplane.scheduler import PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.sim import SimCluster

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
RULES = sorted((ROOT / "deploy" / "monitoring" / "rules").glob("*.yaml"))
H100 = "H100-80GB"
CLASSES = default_priority_classes()
STEP_S = 60.0
"""Simulated seconds per feed step."""
STEPS = 16
VARIABLES = {"$__rate_interval": "1m", "$queue": ".*", "$pool": ".*"}
"""What the dashboards' variables stand for in the queries here: All (`allValue` .*), a 1-minute rate window
(at least four 1 s scrapes, as Grafana's $__rate_interval asks)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------------ the feed
class Feed:
    """Four 8 × H100 nodes (a0, a1 in pool inference; b0, b1 in pool training) under a steady load: fractional
    dev pods that complete two steps later, training pods of queue team-a (cap 8 GPUs), a 9-card pod each step
    that never fits, an online 8-card pod every third step that preempts; b0 lent and taken back by turns,
    b1 lent once with its reclaim deadline 2 minutes on (so it is late from step 7), a1 through quarantine,
    probation and back; an extender whose filter fails one request in five."""

    def __init__(self, metrics: PlaneMetrics) -> None:
        self.metrics = metrics
        nodes = [node(n).gpus(8, H100).pool(p).obj()
                 for n, p in (("a0", "inference"), ("a1", "inference"), ("b0", "training"), ("b1", "training"))]
        self.cluster = SimCluster(CATALOG, nodes)
        quotas = Quotas([QueueQuota("team-a", max_gpus=8), QueueQuota("team-b", min_gpus=4)])
        self.scheduler = Scheduler(self.cluster, CATALOG, default_registry().build(PolicyConfig()), seed=0,
                                   now=self.cluster.loop.now,
                                   rules=SchedulingRules(quotas=quotas, default_victim_grace_s=30.0))
        self.observer = ClusterObserver(self.cluster, metrics, now=self.cluster.loop.now, quotas=quotas)
        metrics.counters(scheduler_counters(self.scheduler))
        metrics.set_leader("scheduler", True)
        self.step_no = 0

    def _create(self, request: PodRequest, cls: str, queue: str | None = None) -> None:
        assert self.cluster.create_pod(CLASSES.resolve(replace(request, priority_class=cls, queue=queue))).ok

    def _lend(self, name: str, reclaim_at: float) -> None:
        note = json.dumps({"since": self.cluster.loop.now(), "window": "night", "home_pool": "training"})
        assert self.cluster.patch_node(name, labels={LOAN_LABEL: "lent"},
                                       annotations={LOAN_ANNOTATION: note, RECLAIM_ANNOTATION: f"{reclaim_at:.0f}"}).ok

    def step(self) -> None:
        i, cluster, now = self.step_no, self.cluster, self.cluster.loop.now()
        for k in range(3):
            self._create(replace(pod(f"dev-{i}-{k}").cpu(100).mem(512).fraction(300, mem=4096).obj(),
                                 pools=frozenset({"inference"})), "dev")
        self._create(pod(f"train-{i}").cpu(100).mem(512).whole(2).obj(), "training", "team-a")
        self._create(pod(f"huge-{i}").cpu(100).mem(512).whole(9).obj(), "training")
        if i % 3 == 2:
            self._create(pod(f"online-{i}").cpu(100).mem(512).whole(8).obj(), "online")
        for k in range(3):
            done = next((p for p in cluster.list_pods() if p.name == f"dev-{i - 2}-{k}"), None)
            if done is not None and done.phase is PodPhase.RUNNING:
                assert cluster.evict(done.name, grace_s=5.0, reason="completed").ok
        if i == 0:
            self._lend("b1", now + 120.0)
        if i % 4 == 1:
            self._lend("b0", now + 3600.0)
        elif i % 4 == 3:
            for running in cluster.list_pods():
                if running.assignment is not None and running.assignment.node == "b0" \
                        and running.phase is PodPhase.RUNNING:
                    assert cluster.evict(running.name, grace_s=10.0, reason=RECLAIM_REASON).ok
            assert cluster.patch_node("b0", labels={LOAN_LABEL: None},
                                      annotations={LOAN_ANNOTATION: None, RECLAIM_ANNOTATION: None}).ok
        health = {2: "quarantined", 4: "probation", 6: None, 9: "quarantined"}
        if i in health:
            assert cluster.patch_node("a1", labels={HEALTH_LABEL: health[i]}).ok
        self.metrics.extender_request("filter", ok=i % 5 != 0, seconds=0.002 + 0.001 * (i % 3))
        self.metrics.extender_request("bind", ok=True, seconds=0.004)
        self.observer.run_pending(self.scheduler)
        cluster.loop.run(until=now + STEP_S)
        self.step_no += 1


# ------------------------------------------------------------------------------------------------ Prometheus
@dataclass
class Prom:
    url: str
    feed: Feed

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result


def _wait(what: str, ready: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prom]:
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus is missing: scripts/test installs it (Debian package prometheus)"
    tmp = tmp_path_factory.mktemp("prometheus")
    metrics = PlaneMetrics()
    feed = Feed(metrics)
    plane_port = metrics.serve(0, addr="127.0.0.1")
    exporters, gpu_targets = [], []
    for host in ("gpu-a0", "gpu-a1"):
        backend = FakeGpuBackend(8, 80 * GIB, name="NVIDIA H100 80GB HBM3", uuid_prefix=host)
        for card in range(4):
            backend.set_process(card, 1000 + card, used_bytes=(card + 1) * 4 * GIB, sm_util_pct=20.0 * (card + 1))
        backend.set_xid(0, 13 if host == "gpu-a0" else 0)
        exporter = Exporter(backend, hostname=host)
        server, _thread = exporter.start(0, addr="127.0.0.1")
        exporters.append(exporter)
        gpu_targets.append(f"127.0.0.1:{server.server_port}")
    dead = f"127.0.0.1:{free_port()}"
    web = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in RULES],
        "scrape_configs": [
            {"job_name": "gpuplane-scheduler", "static_configs": [{"targets": [f"127.0.0.1:{plane_port}"]}]},
            {"job_name": "gpuplane-node-exporter", "static_configs": [{"targets": gpu_targets}]},
            {"job_name": "gpuplane-operator", "static_configs": [{"targets": [dead]}]},
        ],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = (tmp / "prometheus.log").open("w")
    process = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        prom = Prom(f"http://127.0.0.1:{web}", feed)
        _wait("Prometheus ready", lambda: urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).status == 200)
        _wait("the first scrapes", lambda: len(prom.query("up")) == 4)
        for _ in range(STEPS):
            feed.step()
            time.sleep(0.5)
        # at least 5 scrapes of the plane's metrics in the last minute, after the feed's last step
        time.sleep(1.5)
        _wait("5 scrapes", lambda: all(float(s["value"][1]) >= 5 for s in prom.query(
            'count_over_time(up{job="gpuplane-scheduler"}[1m])')))
        yield prom
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
        for exporter in exporters:
            exporter.stop()


# ------------------------------------------------------------------------------------------------ the boards
def boards() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in DASHBOARDS]


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def targets() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every query of every panel."""
    return [(b["uid"], p["title"], t["expr"]) for b in boards() for p in panels(b) for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable this test does not set: {expr}"
    return expr


def test_dashboards_are_well_formed() -> None:
    assert len(DASHBOARDS) == 2
    uids = [b["uid"] for b in boards()]
    assert len(set(uids)) == len(uids)
    for board in boards():
        defined = {v["name"] for v in board["templating"]["list"]}
        assert "datasource" in defined
        ids = [p["id"] for p in panels(board)]
        assert len(set(ids)) == len(ids), board["uid"]
        cells: set[tuple[int, int]] = set()
        for panel in panels(board):
            pos = panel["gridPos"]
            assert pos["x"] + pos["w"] <= 24, panel["title"]
            mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not mine & cells, f"{board['uid']}: {panel['title']} overlaps another panel"
            cells |= mine
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["expr"] and target["refId"]
                used = {name.lstrip("$") for name in VARIABLES if name in target["expr"] and name != "$__rate_interval"}
                assert used <= defined, (panel["title"], used - defined)


def test_every_panel_query_returns_data(prom: Prom) -> None:
    exprs = targets()
    assert len(exprs) == 31  # 19 on the scheduler board, 12 on the fleet board
    empty: list[str] = []
    bad: list[str] = []
    for uid, title, expr in exprs:
        result = prom.query(substitute(expr))
        if not result:
            empty.append(f"{uid} / {title}: {expr}")
        bad.extend(f"{uid} / {title}: {expr} = {s['value'][1]}" for s in result
                   if not math.isfinite(float(s["value"][1])))
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not bad, "queries with non-finite values:\n" + "\n".join(bad)


def test_panel_figures_match_the_feed(prom: Prom) -> None:
    snap = prom.feed.observer.snapshot()
    # 16 steps, one 9-card pod each: all 16 still pending, counted under class training.
    pending = {s["metric"]["priority_class"]: float(s["value"][1])
               for s in prom.query("sum by (priority_class) (gpuplane_scheduler_pending_pods)")}
    assert pending["training"] == sum(v for (cls, _q), v in snap.pending.items() if cls == "training")
    assert pending["training"] >= STEPS
    cards = sum(float(s["value"][1]) for s in prom.query("sum by (state) (gpuplane_cluster_gpus)"))
    assert cards == 32  # 4 nodes × 8 cards
    # b1 lent at 0 s with its deadline at 120 s; the feed ran 16 × 60 s = 960 s: 840 s late.
    late = prom.query('gpuplane_tidal_loan_overdue_seconds{node="b1"}')
    assert float(late[0]["value"][1]) == STEPS * STEP_S - 120.0
    assert {s["metric"]["Hostname"] for s in prom.query("DCGM_FI_DEV_XID_ERRORS > 0")} == {"gpu-a0"}


def test_template_variables_list_values(prom: Prom) -> None:
    for board in boards():
        for variable in board["templating"]["list"]:
            if variable["type"] != "query":
                continue
            definition = variable["definition"]
            metric, label = definition.removeprefix("label_values(").removesuffix(")").split(", ")
            values = prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
            assert values, f"{board['uid']}: variable {variable['name']} lists nothing"


def test_rules_evaluate_and_the_provoked_alerts_are_active(prom: Prom) -> None:
    def active() -> set[str]:
        return {a["labels"]["alertname"] for a in prom.get("/api/v1/alerts")["alerts"]}

    _wait("the alerts", lambda: {"GpuplaneTidalReclaimLate", "GpuMetricsScrapeFailing"} <= active(), 30.0)
    groups = prom.get("/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 19  # 8 recording rules, 11 alerts
    errors = [f"{r['name']}: {r.get('lastError')}" for r in rules if r.get("health") == "err"]
    assert not errors, errors
    alerts = {a["labels"]["alertname"]: a for a in prom.get("/api/v1/alerts")["alerts"]}
    assert alerts["GpuplaneTidalReclaimLate"]["state"] == "firing"  # no `for`: firing at once
    assert alerts["GpuplaneTidalReclaimLate"]["labels"]["node"] == "b1"
    assert alerts["GpuMetricsScrapeFailing"]["state"] == "pending"  # `for: 5m` has not passed
    assert alerts["GpuMetricsScrapeFailing"]["labels"]["job"] == "gpuplane-operator"
