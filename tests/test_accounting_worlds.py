"""Accounting in the two worlds: the same pod create/bind/evict/delete sequence at the same times, through
`SimCluster` and through `KubeCluster` against the local API server, gives the same bookings and the same bill to
the GPU-second (the issue's target)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest

from gpuplane.cli.accounting_cmd import run_ledger
from gpuplane.controllers.accounting import (
    AccountingLedger,
    Booking,
    DcgmReader,
    IdlePolicy,
    IdleRule,
    LedgerFile,
    bill,
    read_ledger,
)
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.localapi import FakeApiServer, node_json
from gpuplane.kube.objects import node_info, parse_time
from gpuplane.model import Assignment, CardShare, Fraction, PodRequest, WholeCards, default_catalog
from gpuplane.port import EventType, ObjectEvent, PodInfo, PodPhase, Timer
from gpuplane.scaler.prometheus import Series
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop

CATALOG = default_catalog()
NODES = (node_json("n1", cards=8), node_json("n2", cards=4, model="T4"))
PRICES = {"A100-40GB": 2.0, "T4": 0.4}


def whole(node: str, *cards: int) -> Assignment:
    return Assignment(node, tuple(CardShare(card=c, compute_milli=1000, memory_mib=40960, whole=True) for c in cards))


def quarter(node: str, card: int) -> Assignment:
    return Assignment(node, (CardShare(card=card, compute_milli=250, memory_mib=4096),))


TRAIN = PodRequest("team-a/train-0", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(2), priority_class="training",
                   queue="team-a")
DEV = PodRequest("lab/dev-0", cpu_milli=1000, memory_mib=1024, gpu=Fraction(compute_milli=250, memory_mib=4096),
                 priority_class="dev", labels=(("gpuplane.io/team", "research"),))
SERVE = PodRequest("web/serve-0", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(1), priority_class="online")

# (time, operation, pod, argument)
SCRIPT: tuple[tuple[float, str, str, object], ...] = (
    (0.0, "create", TRAIN.name, TRAIN),
    (0.0, "create", DEV.name, DEV),
    (10.0, "bind", TRAIN.name, whole("n1", 0, 1)),
    (25.0, "bind", DEV.name, quarter("n2", 0)),
    (70.0, "sample", "", None),
    (130.0, "sample", "", None),
    (150.0, "create", SERVE.name, SERVE),
    (160.0, "bind", SERVE.name, whole("n1", 2)),
    (200.0, "evict", TRAIN.name, 30.0),
    (230.0, "gone", TRAIN.name, None),
    (260.0, "delete", DEV.name, None),
)
END = 400.0
SHARES: dict[str, tuple[tuple[float, float | None], ...]] = {
    TRAIN.name: ((0.0, 0.9), (100.0, 0.5), (200.0, 0.0)),
    DEV.name: ((0.0, None), (60.0, 0.2)),
    SERVE.name: ((0.0, 0.75),),
}


class ScriptedReader:
    """The busy share `shares` (by default `SHARES`) gives a pod at a time (the last entry at or before it)."""

    def __init__(self, shares: Mapping[str, tuple[tuple[float, float | None], ...]] = SHARES) -> None:
        self.shares = shares

    def busy_share(self, pod: PodInfo, now: float) -> float | None:
        share: float | None = None
        for at, value in self.shares.get(pod.name, ()):
            if at <= now:
                share = value
        return share

    def busy_shares(self, pods: Sequence[PodInfo], now: float) -> Mapping[str, float | None]:
        return {pod.name: self.busy_share(pod, now) for pod in pods}


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        raise AssertionError("the ledger samples on explicit calls here (sample_s=0)")


def run_sim() -> list[Booking]:
    loop = EventLoop()
    cluster = SimCluster(CATALOG, [node_info(n, CATALOG).spec for n in NODES], loop=loop)
    ledger = AccountingLedger(cluster, loop, ScriptedReader(), sample_s=0.0)

    def do(op: str, pod: str, arg: object) -> None:
        if op == "create":
            assert isinstance(arg, PodRequest) and cluster.create_pod(arg).ok
        elif op == "bind":
            assert isinstance(arg, Assignment)
            status = cluster.bind(pod, arg)
            assert status.ok, status.message
        elif op == "sample":
            ledger.sample()
        elif op == "evict":
            assert isinstance(arg, float) and cluster.evict(pod, grace_s=arg).ok
        elif op == "gone":  # the container stops when its grace is over (the timer at the same time finds it gone)
            assert cluster.container_exited(pod).ok and cluster.get_pod(pod) is None
        elif op == "delete":
            assert cluster.delete_pod(pod).ok

    for t, op, pod, arg in SCRIPT:
        loop.call_at(t, lambda op=op, pod=pod, arg=arg: do(op, pod, arg))
    loop.run(until=END)
    ledger.close(END)
    return ledger.bookings


@dataclass
class Kube:
    server: FakeApiServer
    cluster: KubeCluster
    clock: ManualClock

    def settle(self, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Pump watch events until `check` holds (a deadline for the watch thread, not a speed assertion)."""
        deadline = time.monotonic() + timeout_s
        while not check():
            assert time.monotonic() < deadline, "the local API server's watch did not deliver in time"
            self.cluster.wait_for_changes(0.05)
            self.cluster.pump()


@pytest.fixture
def kube() -> Iterator[Kube]:
    with FakeApiServer(pod_deletion_delay_s=None) as server:
        for node in NODES:
            server.add_node(node)
        clock = ManualClock()
        cluster = KubeCluster(server.api, CATALOG, clock=clock, sleep=lambda _: None, dispatch="manual",
                              watch_timeout_s=30)
        yield Kube(server, cluster, clock)
        cluster.close()


def phase(cluster: KubeCluster, pod: str) -> PodPhase | None:
    info = cluster.get_pod(pod)
    return info.phase if info is not None else None


def run_kube(k: Kube) -> list[Booking]:
    k.settle(lambda: len(k.cluster.list_nodes()) == len(NODES))
    ledger = AccountingLedger(k.cluster, k.clock, ScriptedReader(), sample_s=0.0)
    for t, op, pod, arg in SCRIPT:
        k.clock.t = t
        if op == "create":
            assert isinstance(arg, PodRequest)
            status = k.cluster.create_pod(arg)
            assert status.ok, status.message
            k.settle(lambda pod=pod: phase(k.cluster, pod) is PodPhase.PENDING)
        elif op == "bind":
            assert isinstance(arg, Assignment)
            status = k.cluster.bind(pod, arg)
            assert status.ok, status.message
            k.settle(lambda pod=pod: phase(k.cluster, pod) is PodPhase.RUNNING)
        elif op == "sample":
            ledger.sample()
        elif op == "evict":
            assert k.cluster.evict(pod).ok
            k.settle(lambda pod=pod: phase(k.cluster, pod) is PodPhase.TERMINATING)
        elif op == "gone":  # the kubelet finishes the deletion when the grace is over
            k.server.finish_deletion(pod)
            k.settle(lambda pod=pod: phase(k.cluster, pod) is None)
        elif op == "delete":  # a bound pod's DELETE leaves it Terminating until the kubelet is done: at once here
            assert k.cluster.delete_pod(pod).ok
            k.server.finish_deletion(pod)
            k.settle(lambda pod=pod: phase(k.cluster, pod) is None)
    k.clock.t = END
    ledger.close(END)
    return ledger.bookings


def totals(bookings: Sequence[Booking]) -> dict[tuple[str, ...], tuple[float, float, float, float, float]]:
    return {r.key: (r.allocated_gpu_s, r.used_gpu_s, r.idle_gpu_s, r.unmeasured_gpu_s, r.cost)
            for r in bill(bookings, PRICES)}


def test_the_same_inputs_give_the_same_bill_in_both_worlds(kube: Kube) -> None:
    sim, live = run_sim(), run_kube(kube)
    assert sim == live  # every booked interval: pod, payer, card model, node, milli, times and reading
    # train-0: 2 cards from 10 s until gone at 230 s = 440 GPU-s; read 0.9 at 10 (unchanged at 70), 0.5 at 130,
    #   0.0 when Terminating at 200: used 2×120×0.9 + 2×70×0.5 + 2×30×0 = 216 + 70 = 286; idle 154;
    #   cost 440 / 3600 × 2.0.
    # dev-0: 0.25 card from 25 s to 260 s = 58.75 GPU-s; no reading at 25 (unmeasured 0.25×45 = 11.25), 0.2 from
    #   70: used 0.25×190×0.2 = 9.5; idle 58.75 − 9.5 = 49.25; team from its label, no queue.
    # serve-0: 1 card from 160 s to the end at 400 s = 240 GPU-s at 0.75: used 180, idle 60; team its namespace.
    expected = {
        ("lab", "research", "", "T4", "dev"): (58.75, 9.5, 49.25, 11.25, 58.75 / 3600 * 0.4),
        ("team-a", "team-a", "team-a", "A100-40GB", "training"): (440.0, 286.0, 154.0, 0.0, 440 / 3600 * 2.0),
        ("web", "web", "", "A100-40GB", "online"): (240.0, 180.0, 60.0, 0.0, 240 / 3600 * 2.0),
    }
    for world in (sim, live):
        got = totals(world)
        assert got.keys() == expected.keys()
        for key, figures in expected.items():
            assert got[key] == pytest.approx(figures, abs=1e-9), key
    assert totals(sim) == totals(live)  # exactly, not merely to the GPU-second


# ------------------------------------------------------------------ the idle policy in both worlds
BOX_0 = PodRequest("lab/box-0", cpu_milli=1000, memory_mib=1024, gpu=WholeCards(1), priority_class="dev")
BOX_1 = PodRequest("lab/box-1", cpu_milli=1000, memory_mib=1024, gpu=Fraction(compute_milli=250, memory_mib=4096),
                   priority_class="dev")
IDLE_RULE = IdleRule("dev", window_s=600, max_efficiency=0.05, grace_s=900)
IDLE_SHARES: dict[str, tuple[tuple[float, float | None], ...]] = {
    BOX_0.name: ((0.0, 0.0), (1000.0, 0.9)),  # busy again within the grace
    BOX_1.name: ((0.0, 0.01),),  # idle throughout
}
# (time, operation): both boxes bound at 0; the ledger samples at 1000 (box-0's reading changes) and before each
# reconcile, every 300 s.
IDLE_SCRIPT = [(0.0, "bind"), (1000.0, "sample")] + [(float(t), "reconcile") for t in range(300, 2400, 300)]
IDLE_SCRIPT.sort()
IDLE_END = 2400.0


def run_idle_sim() -> tuple[list[tuple[float, str, str]], list[ObjectEvent]]:
    loop = EventLoop()
    cluster = SimCluster(CATALOG, [node_info(n, CATALOG).spec for n in NODES], loop=loop)
    ledger = AccountingLedger(cluster, loop, ScriptedReader(IDLE_SHARES), sample_s=0.0)
    policy = IdlePolicy(cluster, ledger, loop, [IDLE_RULE])
    assert cluster.create_pod(BOX_0).ok and cluster.create_pod(BOX_1).ok

    def do(op: str) -> None:
        if op == "bind":
            assert cluster.bind(BOX_0.name, whole("n1", 0)).ok and cluster.bind(BOX_1.name, quarter("n2", 0)).ok
        elif op == "sample":
            ledger.sample()
        else:
            ledger.sample()
            policy.reconcile()

    for t, op in IDLE_SCRIPT:
        loop.call_at(t, lambda op=op: do(op))
    loop.run(until=IDLE_END)
    return [(a.time, a.pod, a.kind) for a in policy.actions], cluster.events


def posted(server: FakeApiServer, namespace: str) -> list[ObjectEvent]:
    """The core/v1 Events in `namespace`, read back as the port's `ObjectEvent`s."""
    events: list[ObjectEvent] = []
    for raw in server.api.list(f"/api/v1/namespaces/{namespace}/events")[0]:
        assert kubernetes_validate.validate(raw, "1.34", strict=True) == "1.34"
        involved, stamp = raw["involvedObject"], parse_time(raw["firstTimestamp"])
        assert stamp is not None and raw["lastTimestamp"] == raw["firstTimestamp"] and raw["count"] == 1
        events.append(ObjectEvent(involved["kind"], f"{involved['namespace']}/{involved['name']}",
                                  EventType(raw["type"]), raw["reason"], raw["message"], stamp))
    return events


def run_idle_kube(k: Kube) -> tuple[list[tuple[float, str, str]], list[ObjectEvent]]:
    k.settle(lambda: len(k.cluster.list_nodes()) == len(NODES))
    ledger = AccountingLedger(k.cluster, k.clock, ScriptedReader(IDLE_SHARES), sample_s=0.0)
    policy = IdlePolicy(k.cluster, ledger, k.clock, [IDLE_RULE])
    for request in (BOX_0, BOX_1):
        assert k.cluster.create_pod(request).ok
        k.settle(lambda name=request.name: phase(k.cluster, name) is PodPhase.PENDING)
    for t, op in IDLE_SCRIPT:
        k.clock.t = t
        if op == "bind":
            assert k.cluster.bind(BOX_0.name, whole("n1", 0)).ok and k.cluster.bind(BOX_1.name, quarter("n2", 0)).ok
            k.settle(lambda: phase(k.cluster, BOX_0.name) is phase(k.cluster, BOX_1.name) is PodPhase.RUNNING)
        elif op == "sample":
            ledger.sample()
        else:
            ledger.sample()
            for action in policy.reconcile():
                if action.kind == "evict":
                    k.settle(lambda name=action.pod: phase(k.cluster, name) is PodPhase.TERMINATING)
    return [(a.time, a.pod, a.kind) for a in policy.actions], posted(k.server, "lab")


def test_the_idle_policy_acts_and_posts_the_same_events_in_both_worlds(kube: Kube) -> None:
    (sim_actions, sim_events), (live_actions, live_events) = run_idle_sim(), run_idle_kube(kube)
    # box-1 at 1 %: noticed at 600, evicted when due at 600 + 900 = 1500. box-0 at 0 % until 1000, then 90 %:
    #   noticed at 600; at 1200 the window 600..1200 averages (400 × 0 + 200 × 0.9) / 600 = 30 %: withdrawn.
    assert sorted(sim_actions) == sorted(live_actions) == [
        (600.0, BOX_0.name, "notice"), (600.0, BOX_1.name, "notice"), (1200.0, BOX_0.name, "withdraw"),
        (1500.0, BOX_1.name, "evict")]
    key = lambda e: (e.time, e.name, e.reason)  # noqa: E731
    assert sorted(sim_events, key=key) == sorted(live_events, key=key)  # kind, pod, type, reason, message, time
    assert [(e.time, e.name, e.type, e.reason) for e in sorted(live_events, key=key)] == [
        (600.0, BOX_0.name, EventType.WARNING, "IdleGpuNotice"),
        (600.0, BOX_1.name, EventType.WARNING, "IdleGpuNotice"),
        (1200.0, BOX_0.name, EventType.NORMAL, "IdleGpuNoticeWithdrawn")]
    assert sorted(live_events, key=key)[1].message == (
        "GPU efficiency 1.0% over the last 600 s is at most 5.0%: evict due at 1970-01-01T00:25:00Z unless the pod's "
        "cards turn busy")


class Dcgm:
    """A Prometheus answering every dcgm query with one card utilisation (percent)."""

    def __init__(self, percent: float) -> None:
        self.percent = percent
        self.queries: list[str] = []

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        self.queries.append(query)
        return self.percent

    def vector(self, query: str, *, timeout_s: float | None = None) -> list[Series]:
        """Every pod of the test on one card at `percent`."""
        self.queries.append(query)
        return [Series({"namespace": "team-a", "pod": "train-0"}, self.percent, 0.0)]


def test_accounting_ledger_command_books_a_live_cluster(tmp_path: Path) -> None:
    """`gpuplane accounting-ledger`'s loop on a `KubeCluster` whose dispatcher thread delivers the events, while
    this thread binds and deletes through the port and the loop samples every 50 ms."""
    with FakeApiServer() as server:
        for node in NODES:
            server.add_node(node)
        clock = ManualClock()
        clock.t = 1_000.0
        cluster = KubeCluster(server.api, CATALOG, clock=clock, sleep=lambda _: None, watch_timeout_s=30)
        source = Dcgm(50.0)
        stop = threading.Event()
        path = tmp_path / "ledger.jsonl"
        loop = threading.Thread(target=run_ledger, args=(cluster, DcgmReader(source), LedgerFile(path), stop, 0.05,
                                                         clock))
        loop.start()
        try:
            assert cluster.create_pod(TRAIN).ok
            deadline = time.monotonic() + 10
            while cluster.get_pod(TRAIN.name) is None:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            clock.t = 1_100.0
            assert cluster.bind(TRAIN.name, whole("n1", 0, 1)).ok
            while not source.queries:  # read at the bind
                assert time.monotonic() < deadline
                time.sleep(0.02)
            clock.t = 1_400.0
            assert cluster.delete_pod(TRAIN.name).ok
            while cluster.get_pod(TRAIN.name) is not None:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        finally:
            stop.set()
            loop.join(10)
            cluster.close()
    assert not loop.is_alive()
    bookings = read_ledger(path)
    # Two cards from 1,100 to 1,400 s = 600 GPU-s; dcgm says 50 % on each: used 300.
    assert [(b.pod, b.start, b.end, b.allocated_gpu_s, b.used_gpu_s) for b in bookings] == [
        (TRAIN.name, 1_100.0, 1_400.0, 600.0, 300.0)]
    assert source.queries[0] == 'avg(DCGM_FI_DEV_GPU_UTIL{namespace="team-a",pod="train-0"})'
