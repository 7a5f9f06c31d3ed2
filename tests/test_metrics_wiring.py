"""The metrics wired into the processes that schedule: `SchedulerMode` and the extender against the local API
server, scraped over real HTTP from `PlaneMetrics.serve` and parsed with prometheus_client's parser; the
observer's view of a scheduling process (`OwnPods`), kube-scheduler's Lease as the extender follows it, and the
commands' `--metrics-port`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from builders import CATALOG, node, pod
from gpuplane.cli.extender_cmd import build_profile, follow_lease
from gpuplane.controllers.observer import ClusterObserver
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.extender import Extender, ExtenderServer, FilterAnswers
from gpuplane.kube.lease import LeaseConfig, LeaseElector
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import SCHEDULER_NAME, format_time
from gpuplane.kube.observed import KubeSchedulerLease, OwnPods, scheduled_by
from gpuplane.kube.scheduler_mode import SchedulerMode
from gpuplane.model import default_catalog
from gpuplane.port import PodPhase
from gpuplane.port.metrics import (
    ATTEMPTS,
    EXTENDER_DURATION,
    EXTENDER_REQUESTS,
    GPUS,
    LEADER,
    OLDEST_PENDING,
    PENDING_PODS,
    POD_SCHEDULING_DURATION,
    UNSCHEDULABLE_PODS,
    PlaneMetrics,
)
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry
from gpuplane.sim import SimCluster
from test_kube_scheduler_mode import Clock, events

PODS = "/api/v1/namespaces/default/pods"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/gpuplane-system/leases"
T0 = 1_764_374_400.0
"""2025-11-29T00:00:00Z: the fake clock's start, in epoch seconds like the API's timestamps."""
WAIT_S = 20.0
"""How long a test waits for the watches and the scheduler to get somewhere (never a timing assertion)."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def scrape(port: int) -> Samples:
    """GET /metrics over HTTP; every sample keyed by (sample name, sorted labels). A family exported twice fails."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = re.findall(r"^# TYPE (\S+) ", text, re.M)
    assert len(names) == len(set(names)), f"families exported twice: {sorted(n for n in names if names.count(n) > 1)}"
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def gpu_pod(name: str, cards: int, *, cls: str | None = None, scheduler: str = "gpuplane", created: float = T0,
            ) -> dict[str, Any]:
    obj = pod_json(name, limits={"gpuplane.io/gpu": str(cards)})
    obj["spec"]["schedulerName"] = scheduler
    if cls is not None:
        obj["spec"]["priorityClassName"] = cls
    obj["metadata"]["creationTimestamp"] = format_time(created)
    return obj


def wait_for(done: Callable[[], bool], step: Callable[[], object] = lambda: time.sleep(0.02)) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "never got there"
        step()


# ------------------------------------------------------------------ scheduler mode, end to end
def test_scheduler_mode_exports_its_queue_decisions_latency_and_leadership(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=4))
    clock = Clock()
    config = LeaseConfig("gpuplane-system", "gpuplane-scheduler", "a")
    metrics = PlaneMetrics()
    port = metrics.serve(0, addr="127.0.0.1")
    mode = SchedulerMode(server.api, build_profile("binpack", None), seed=42, bind_workers=0, clock=clock,
                         elector=LeaseElector(server.api, config, clock.now), identity="a", metrics=metrics)

    def step() -> None:
        mode.tick()
        if mode.cluster is not None:
            mode.cluster.wait_for_changes(0.02)

    mode.tick()
    assert mode.leading
    # a and b were created 100 s before the clock's now; they take 2 + 2 of n0's 4 cards.
    for name, cls in (("a", "prod"), ("b", "batch")):
        server.api.create(PODS, gpu_pod(name, 2, cls=cls, created=T0 - 100))
    wait_for(lambda: all(events(server, n, "Scheduled") for n in ("a", "b")), step)
    # big asks 8 cards of a 4-card node; c asks 1 of none left: both stay pending, created 30 s ago.
    server.api.create(PODS, gpu_pod("big", 8, cls="batch", created=T0 - 30))
    server.api.create(PODS, gpu_pod("c", 1, cls="prod", created=T0 - 30))
    # Another scheduler's pending pod (CPU only) is not gpuplane's queue.
    theirs = pod_json("theirs", limits={"cpu": "1"})
    theirs["spec"].update(schedulerName="default-scheduler", priorityClassName="prod")
    theirs["metadata"]["creationTimestamp"] = format_time(T0 - 500)
    server.api.create(PODS, theirs)
    wait_for(lambda: all(events(server, n, "FailedScheduling") for n in ("big", "c")), step)
    wait_for(lambda: mode.cluster is not None and mode.cluster.get_pod("default/theirs") is not None, step)
    mode.tick()

    s = scrape(port)
    assert get(s, LEADER, component="scheduler") == 1
    assert get(s, PENDING_PODS, priority_class="batch", queue="none") == 1  # big
    assert get(s, PENDING_PODS, priority_class="prod", queue="none") == 1   # c, not theirs
    assert total(s, PENDING_PODS) == 2
    assert get(s, OLDEST_PENDING, priority_class="batch", queue="none") == 30  # T0 − (T0 − 30)
    assert get(s, OLDEST_PENDING, priority_class="prod", queue="none") == 30
    # Every decision counted once by result: 2 binds, the rest (big and c, tried at least once each) failures.
    assert get(s, ATTEMPTS, result="scheduled") == 2
    assert get(s, ATTEMPTS, result="waiting") == 0 and get(s, ATTEMPTS, result="error") == 0
    unschedulable = get(s, ATTEMPTS, result="unschedulable")
    assert unschedulable is not None and unschedulable >= 2
    assert total(s, ATTEMPTS) == mode.outcomes
    assert total(s, UNSCHEDULABLE_PODS) == 2
    # Latency: a and b bound at T0, created at T0 − 100: 100 s each, in the 120 s bucket, not the 60 s one.
    assert get(s, POD_SCHEDULING_DURATION + "_count") == 2
    assert get(s, POD_SCHEDULING_DURATION + "_sum") == 200
    assert get(s, POD_SCHEDULING_DURATION + "_bucket", le="60.0") == 0
    assert get(s, POD_SCHEDULING_DURATION + "_bucket", le="120.0") == 2
    # n0's 4 cards are all held (2 + 2).
    assert total(s, GPUS) == 4 and sum(v for (n, labels), v in s.items()
                                       if n == GPUS and ("state", "full") in labels) == 4
    # The other scheduler binds its pod (500 s after creation): not gpuplane's latency, and still not pending.
    server.api.create(f"{PODS}/theirs/binding", {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "theirs"},
                                                 "target": {"apiVersion": "v1", "kind": "Node", "name": "n0"}})

    def theirs_bound() -> bool:
        info = mode.cluster.get_pod("default/theirs") if mode.cluster is not None else None
        return info is not None and info.phase is not PodPhase.PENDING

    wait_for(theirs_bound, step)
    s = scrape(port)
    assert get(s, POD_SCHEDULING_DURATION + "_count") == 2 and total(s, PENDING_PODS) == 2

    # Another replica takes the lease: this one stands down, says so, and its cluster figures leave the scrape
    # (the counts it made stay).
    def taken(lease: dict[str, Any]) -> None:
        lease["spec"]["holderIdentity"] = "b"

    server.mutate("leases", "gpuplane-system/gpuplane-scheduler", taken)
    clock.t += config.retry_period_s
    mode.tick()
    assert not mode.leading
    s = scrape(port)
    assert get(s, LEADER, component="scheduler") == 0
    assert total(s, PENDING_PODS) == 0 and total(s, GPUS) == 0
    assert get(s, ATTEMPTS, result="scheduled") == 2

    # The lease comes back (b released it): a new observer under the same key, no family exported twice.
    def released(lease: dict[str, Any]) -> None:
        lease["spec"]["holderIdentity"] = ""

    server.mutate("leases", "gpuplane-system/gpuplane-scheduler", released)
    clock.t += config.retry_period_s
    mode.tick()
    assert mode.leading
    s = scrape(port)
    assert get(s, LEADER, component="scheduler") == 1
    assert total(s, PENDING_PODS) == 2
    mode.shutdown()
    assert get(scrape(port), LEADER, component="scheduler") == 0


# ------------------------------------------------------------------ the extender, end to end
def _extender(server: FakeApiServer, metrics: PlaneMetrics, *, observe: bool | None = None,
              ) -> tuple[KubeCluster, Extender, ExtenderServer]:
    catalog = default_catalog()
    cluster = KubeCluster(server.api, catalog)
    core = Extender(cluster, catalog, build_profile("binpack", None), now=Clock().now, subscribe_lock=cluster.lock,
                    filter_answers=FilterAnswers.CHOSEN, metrics=metrics, observe=observe,
                    own_pods=scheduled_by(cluster.pods.get, SCHEDULER_NAME))
    return cluster, core, ExtenderServer(core, port=0).start()


def _post(url: str, verb: str, body: bytes) -> tuple[int, Any]:
    request = urllib.request.Request(f"{url}/{verb}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_extender_counts_requests_by_verb_and_result_and_observes_its_pods(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=4))
    metrics = PlaneMetrics()
    port = metrics.serve(0, addr="127.0.0.1")
    for name, cards, scheduler in (("small", 1, SCHEDULER_NAME), ("big", 8, SCHEDULER_NAME),
                                   ("theirs", 1, "default-scheduler")):
        server.api.create(PODS, gpu_pod(name, cards, scheduler=scheduler, created=T0 - 60))
    cluster, core, http = _extender(server, metrics)
    try:
        wait_for(lambda: all(cluster.get_pod(f"default/{n}") is not None for n in ("small", "big", "theirs")))
        small, big = (server.get("pods", f"default/{n}") for n in ("small", "big"))
        code, answer = _post(http.url, "filter", json.dumps({"Pod": small, "NodeNames": ["n0"]}).encode())
        assert code == 200 and answer["NodeNames"] == ["n0"] and not answer["Error"]
        code, answer = _post(http.url, "filter", json.dumps({"Pod": big, "NodeNames": ["n0"]}).encode())
        assert code == 200 and answer["NodeNames"] == [] and not answer["Error"]  # answered: no node fits
        code, answer = _post(http.url, "filter", b"not json")
        assert code == 200 and answer["Error"].startswith("body is not JSON")
        code, answer = _post(http.url, "prioritize", b"[]")
        assert code == 400
        s = scrape(port)
        # filter: small and big answered (2 ok), the unreadable body in Error (1 error); prioritize: HTTP 400.
        assert get(s, EXTENDER_REQUESTS, verb="filter", result="ok") == 2
        assert get(s, EXTENDER_REQUESTS, verb="filter", result="error") == 1
        assert get(s, EXTENDER_REQUESTS, verb="prioritize", result="error") == 1
        assert get(s, EXTENDER_REQUESTS, verb="prioritize", result="ok") is None
        assert get(s, EXTENDER_DURATION + "_count", verb="filter") == 3
        # Each answered filter is one attempt: small placed, big not; big's reason is kept while it is pending.
        assert get(s, ATTEMPTS, result="scheduled") == 1 and get(s, ATTEMPTS, result="unschedulable") == 1
        assert total(s, UNSCHEDULABLE_PODS) == 1
        # Pending: small and big are gpuplane's; theirs is another scheduler's.
        assert get(s, PENDING_PODS, priority_class="none", queue="none") == 2
        assert get(s, OLDEST_PENDING, priority_class="none", queue="none") == 60  # T0 − (T0 − 60)
        assert get(s, LEADER, component="scheduler") is None  # kube-scheduler's own metric stands in
        assert core.stop_observing() and not core.stop_observing()
        s = scrape(port)
        assert total(s, PENDING_PODS) == 0
        assert get(s, EXTENDER_REQUESTS, verb="filter", result="ok") == 2  # the request counts stay
        assert core.start_observing() and not core.start_observing()
        assert get(scrape(port), PENDING_PODS, priority_class="none", queue="none") == 2
    finally:
        http.close()
        core.close()
        cluster.close()


def _lease(holder: str, renew: str = "2025-11-29T00:00:00.000000Z") -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "gpuplane-scheduler", "namespace": "gpuplane-system"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": renew}}


def test_the_extender_follows_its_kube_schedulers_lease(server: FakeApiServer) -> None:
    clock = Clock(0.0)  # the follower's own clock (never compared with the Lease's timestamps)
    lease = KubeSchedulerLease(server.api, "gpuplane-system", "gpuplane-scheduler", now=clock.now,
                               hostname="sched-0")
    assert not lease.leads()  # no Lease yet (404)
    server.api.create(LEASES, _lease("sched-0_6f1c"))
    assert lease.leads()

    def renewed(at: str, holder: str = "sched-0_6f1c") -> Callable[[dict[str, Any]], None]:
        def change(obj: dict[str, Any]) -> None:
            obj["spec"].update(holderIdentity=holder, renewTime=at)
        return change

    steps: list[tuple[float, Callable[[dict[str, Any]], None] | None, bool]] = [
        (14.0, None, True),                                   # 14 s since the record changed: < 15 s
        (1.0, None, False),                                   # 15 s without a renewal seen: a dead holder
        (0.0, renewed("2025-11-29T00:00:15.000000Z"), True),  # renewed: seen now
        (0.0, renewed("2025-11-29T00:00:17.000000Z", "sched-1_aa01"), False),  # another pod's kube-scheduler
        (0.0, renewed("2025-11-29T00:00:19.000000Z", "sched-00_b"), False),  # a prefix, not this hostname
        (0.0, renewed("2025-11-29T00:00:21.000000Z", ""), False),  # released
    ]
    for advance, change, leads in steps:
        clock.t += advance
        if change is not None:
            server.mutate("leases", "gpuplane-system/gpuplane-scheduler", change)
        assert lease.leads() is leads, (clock.t, change)


def test_follow_lease_starts_and_stops_the_observer(server: FakeApiServer) -> None:
    server.add_node(node_json("n0", cards=4))
    server.api.create(PODS, gpu_pod("p", 1, scheduler=SCHEDULER_NAME))
    metrics = PlaneMetrics()
    port = metrics.serve(0, addr="127.0.0.1")
    cluster, core, http = _extender(server, metrics, observe=False)
    stop = threading.Event()
    lease = KubeSchedulerLease(server.api, "gpuplane-system", "gpuplane-scheduler", now=time.monotonic,
                               hostname="sched-0")
    follower = threading.Thread(target=follow_lease, args=(core, lease, stop, 0.01), daemon=True)
    try:
        assert core.observer is None and total(scrape(port), PENDING_PODS) == 0  # a standby exports none
        follower.start()
        server.api.create(LEASES, _lease("sched-0_6f1c"))
        wait_for(lambda: core.observer is not None)
        wait_for(lambda: get(scrape(port), PENDING_PODS, priority_class="none", queue="none") == 1)
        server.mutate("leases", "gpuplane-system/gpuplane-scheduler", lambda o: o["spec"].update(holderIdentity="x_1"))
        wait_for(lambda: core.observer is None)
        assert total(scrape(port), PENDING_PODS) == 0
    finally:
        stop.set()
        follower.join(timeout=5)
        http.close()
        core.close()
        cluster.close()


# ------------------------------------------------------------------ the observer's view: OwnPods
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), min_size=1, max_size=10))
def test_own_pods_counts_only_our_queue_and_latency_but_every_card(pods: list[tuple[bool, int]]) -> None:
    """Whoever binds them, every bound pod holds its cards; only our pods are pending or timed."""
    cluster = SimCluster(CATALOG, [node("n0").gpus(4).obj(), node("n1").gpus(4).obj()])
    scheduler = Scheduler(cluster, CATALOG, default_registry().build(PolicyConfig()), seed=0, now=cluster.loop.now)
    ours = {f"p{i}" for i, (mine, _) in enumerate(pods) if mine}
    metrics = PlaneMetrics()
    observer = ClusterObserver(OwnPods(cluster, lambda name: name in ours), metrics, now=cluster.loop.now)
    for i, (_, cards) in enumerate(pods):
        assert cluster.create_pod(pod(f"p{i}").cpu(100).mem(256).whole(cards).obj()).ok
    cluster.loop.run(until=5.0)
    scheduler.run_pending()
    cluster.loop.run(until=10.0)
    infos = cluster.list_pods()
    bound = [p for p in infos if p.assignment is not None]
    snap = observer.snapshot()
    assert sum(snap.pending.values()) == sum(1 for p in infos if p.assignment is None and p.name in ours)
    assert sum(v for (_, state), v in snap.gpus.items() if state != "free") == \
        len({(p.assignment.node, s.card) for p in bound if p.assignment is not None for s in p.assignment.cards})
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value
         for f in text_string_to_metric_families(metrics.exposition().decode()) for x in f.samples}
    assert s[(POD_SCHEDULING_DURATION + "_count", ())] == sum(1 for p in bound if p.name in ours)
    observer.close()
    scheduler.close()


# ------------------------------------------------------------------ the command
def test_the_scheduler_command_serves_its_metrics(server: FakeApiServer, tmp_path: Path) -> None:
    server.add_node(node_json("n0", cards=4))
    server.api.create(PODS, gpu_pod("huge", 9, cls="batch"))
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    child = subprocess.Popen(
        [sys.executable, "-m", "gpuplane.cli.main", "scheduler", "--kubeconfig", str(kubeconfig),
         "--no-leader-elect", "--metrics-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stderr is not None
        port = None
        for line in child.stderr:
            found = re.search(r"metrics on :(\d+)/metrics", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "the command never said where its metrics are"
        wait_for(lambda: get(scrape(port), ATTEMPTS, result="unschedulable") == 1, lambda: time.sleep(0.1))
        s = scrape(port)
        assert get(s, LEADER, component="scheduler") == 1  # no election: always the leader
        assert get(s, PENDING_PODS, priority_class="batch", queue="none") == 1
    finally:
        child.terminate()
        child.wait(timeout=WAIT_S)
    assert child.returncode == 0


def test_the_extender_command_serves_its_metrics(server: FakeApiServer, tmp_path: Path) -> None:
    server.add_node(node_json("n0", cards=4))
    server.api.create(PODS, gpu_pod("p", 1, scheduler=SCHEDULER_NAME, created=T0))
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    child = subprocess.Popen(
        [sys.executable, "-m", "gpuplane.cli.main", "extender", "--kubeconfig", str(kubeconfig), "--port", "0",
         "--metrics-port", "0", "--observe", "always"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stderr is not None
        url = port = None
        for line in child.stderr:
            if (found := re.search(r"metrics on :(\d+)/metrics", line)) is not None:
                port = int(found.group(1))
            if (served := re.search(r"extender on (http://\S+)", line)) is not None:
                url = served.group(1)
            if url is not None and port is not None:
                break
        assert url is not None and port is not None, "the command never said where it serves"
        assert get(scrape(port), PENDING_PODS, priority_class="none", queue="none") == 1
        code, answer = _post(url, "filter", json.dumps({"Pod": server.get("pods", "default/p"),
                                                        "NodeNames": ["n0"]}).encode())
        assert code == 200 and answer["NodeNames"] == ["n0"]
        s = scrape(port)
        assert get(s, EXTENDER_REQUESTS, verb="filter", result="ok") == 1
        assert get(s, ATTEMPTS, result="scheduled") == 1
    finally:
        child.terminate()
        child.wait(timeout=WAIT_S)
