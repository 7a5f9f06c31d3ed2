"""The accounting ledger, its readers, bills and the idle policy, on `SimCluster` (virtual time)."""

from __future__ import annotations

import csv
import math
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer import Typer
from typer.testing import CliRunner

from gpuplane.cli import accounting_cmd
from gpuplane.controllers.accounting import (
    IDLE_NOTICE,
    IDLE_NOTICED,
    IDLE_WITHDRAWN,
    AccountingLedger,
    Booking,
    DcgmReader,
    Holder,
    IdlePolicy,
    IdleRule,
    LedgerError,
    LedgerFile,
    Notice,
    bill,
    low_efficiency,
    read_ledger,
)
from gpuplane.model import (
    Assignment,
    CardShare,
    Fraction,
    GpuplaneError,
    NodeSpec,
    PodRequest,
    WholeCards,
    default_catalog,
)
from gpuplane.node.exporter import Exporter, PodRef, StaticPodMapper
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.port import EventType, PodInfo, PodPhase, Status
from gpuplane.report.accounting import PriceTable, load_prices, split_by_month, write_bill
from gpuplane.scaler.prometheus import PrometheusClient, PrometheusError, Series
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop
from gpuplane.sim.platform import SCENARIO, PlatformSettings
from test_node_exporter import Prometheus

CATALOG = default_catalog()


def nodes() -> list[NodeSpec]:
    return [NodeSpec("a", 64_000, 262_144, "A100-80GB", 8), NodeSpec("t", 64_000, 262_144, "T4", 4)]


def cards(node: str, *indexes: int) -> Assignment:
    return Assignment(node, tuple(CardShare(card=c, compute_milli=1000, memory_mib=1024, whole=True)
                                  for c in indexes))


def share(node: str, card: int, milli: int) -> Assignment:
    return Assignment(node, (CardShare(card=card, compute_milli=milli, memory_mib=1024),))


def job(name: str, n: int = 1, *, cls: str = "training", queue: str | None = None, workload: str | None = None,
        labels: tuple[tuple[str, str], ...] = ()) -> PodRequest:
    return PodRequest(name, cpu_milli=100, memory_mib=100, gpu=WholeCards(n), priority_class=cls, queue=queue,
                      workload=workload, labels=labels)


def frac(name: str, milli: int, *, cls: str = "dev") -> PodRequest:
    return PodRequest(name, cpu_milli=100, memory_mib=100, gpu=Fraction(compute_milli=milli, memory_mib=1024),
                      priority_class=cls)


class Shares:
    """Busy shares by pod name, changeable during a run (None: no reading)."""

    def __init__(self, values: dict[str, float | None] | None = None) -> None:
        self.values: dict[str, float | None] = dict(values or {})

    def busy_share(self, pod: PodInfo, now: float) -> float | None:
        return self.values.get(pod.name)

    def busy_shares(self, pods: Sequence[PodInfo], now: float) -> Mapping[str, float | None]:
        return {pod.name: self.values.get(pod.name) for pod in pods}


class World:
    def __init__(self, reader: Shares | None = None, *, stop_s: float = 0.0, sample_s: float = 0.0,
                 cluster: type[SimCluster] = SimCluster) -> None:
        self.loop = EventLoop()
        self.cluster = cluster(CATALOG, nodes(), loop=self.loop, stop_s=stop_s)
        self.reader = reader if reader is not None else Shares()
        self.ledger = AccountingLedger(self.cluster, self.loop, self.reader, sample_s=sample_s)

    def at(self, t: float, action: Callable[[], object]) -> None:
        self.loop.call_at(t, lambda: action())

    def run(self, until: float) -> list[Booking]:
        self.loop.run(until=until)
        self.ledger.close(until)
        return self.ledger.bookings


def per_pod(bookings: list[Booking]) -> dict[str, tuple[float, float, float, float]]:
    return {r.key[0]: (r.allocated_gpu_s, r.used_gpu_s, r.idle_gpu_s, r.unmeasured_gpu_s)
            for r in bill(bookings, {}, by=("pod",))}


# ------------------------------------------------------------------------------------------ the ledger


def _bind_delete(w: World) -> None:
    w.cluster.create_pod(job("p", 2))
    w.at(100, lambda: w.cluster.bind("p", cards("a", 0, 1)))
    w.at(400, lambda: w.cluster.delete_pod("p"))


def _evict_with_grace(w: World) -> None:
    w.cluster.create_pod(job("p", 1))
    w.at(0, lambda: w.cluster.bind("p", cards("a", 0)))
    w.at(100, lambda: w.cluster.evict("p", grace_s=50))  # Terminating at 100, gone at 150 + stop_s 30 = 180


def _reading_changes(w: World) -> None:
    w.cluster.create_pod(job("p", 4))
    w.at(0, lambda: w.cluster.bind("p", cards("a", 0, 1, 2, 3)))
    w.at(60, lambda: w.reader.values.__setitem__("p", 0.25))
    w.at(60, w.ledger.sample)
    w.at(90, lambda: w.reader.values.__setitem__("p", None))
    w.at(90, w.ledger.sample)


def _pending_then_failed(w: World) -> None:
    w.cluster.create_pod(job("p", 1))
    w.at(50, lambda: w.cluster.fail_pod("p", "gang timeout"))


def _same_name_again(w: World) -> None:
    w.cluster.create_pod(frac("p", 500))
    w.at(0, lambda: w.cluster.bind("p", share("t", 0, 500)))
    w.at(10, lambda: w.cluster.delete_pod("p"))
    w.at(20, lambda: w.cluster.create_pod(frac("p", 250)))
    w.at(30, lambda: w.cluster.bind("p", share("t", 1, 250)))


LEDGER_CASES = [
    # (case, setup, busy shares, stop_s, end, pod -> (allocated, used, idle, unmeasured))
    # 2 cards from 100 to 400 s = 600 GPU-s at 0.5: used 300.
    ("bind then delete", _bind_delete, {"p": 0.5}, 0.0, 1000.0, {"p": (600.0, 300.0, 300.0, 0.0)}),
    # A Terminating pod holds its card until it is gone: 0..180 s = 180 GPU-s, used 0.8 × 180 = 144.
    ("eviction holds cards through grace and stop", _evict_with_grace, {"p": 0.8}, 30.0, 1000.0,
     {"p": (180.0, 144.0, 36.0, 0.0)}),
    # 4 cards to the end at 120 s = 480 GPU-s; 0..60 at 0.9 (216), 60..90 at 0.25 (30), 90..120 no reading (120
    # unmeasured): used 246, idle 234.
    ("the reading changes, then goes missing", _reading_changes, {"p": 0.9}, 0.0, 120.0,
     {"p": (480.0, 246.0, 234.0, 120.0)}),
    ("a pod that never binds books nothing", _pending_then_failed, {"p": 1.0}, 0.0, 100.0, {}),
    # 0.5 card for 10 s (5 GPU-s), then 0.25 card from 30 to 100 s (17.5 GPU-s) under the same name: 22.5, all used.
    ("a name bound, deleted and bound again", _same_name_again, {"p": 1.0}, 0.0, 100.0,
     {"p": (22.5, 22.5, 0.0, 0.0)}),
]


@pytest.mark.parametrize(("case", "setup", "shares", "stop_s", "end", "expected"), LEDGER_CASES,
                         ids=[c[0] for c in LEDGER_CASES])
def test_ledger_books_what_each_pod_holds(case: str, setup: Callable[[World], None], shares: dict[str, float],
                                         stop_s: float, end: float,
                                         expected: dict[str, tuple[float, float, float, float]]) -> None:
    w = World(Shares(shares), stop_s=stop_s)
    setup(w)
    got = per_pod(w.run(end))
    assert got.keys() == expected.keys()
    for pod, figures in expected.items():
        assert got[pod] == pytest.approx(figures), pod


def test_pods_holding_cards_before_the_ledger_are_booked_from_its_start() -> None:
    loop = EventLoop()
    cluster = SimCluster(CATALOG, nodes(), loop=loop)
    cluster.create_pod(job("early", 2, queue="q1"))
    cluster.bind("early", cards("a", 0, 1))
    loop.call_at(100, lambda: None)
    loop.run(until=100)
    ledger = AccountingLedger(cluster, loop, Shares({"early": 1.0}), sample_s=0)
    loop.call_at(250, lambda: cluster.delete_pod("early"))
    loop.run(until=300)
    ledger.close(300)
    # From the ledger's start at 100 s to the deletion at 250 s: 2 × 150 = 300 GPU-s (the 100 s before are not known).
    assert per_pod(ledger.bookings) == {"early": (300.0, 300.0, 0.0, 0.0)}
    assert ledger.bookings[0].team == "q1" and ledger.bookings[0].card_model == "A100-80GB"


def test_timer_samples_and_unchanged_readings_extend_one_booking() -> None:
    w = World(Shares({"p": 0.5}), sample_s=60)
    w.cluster.create_pod(job("p", 1))
    w.at(0, lambda: w.cluster.bind("p", cards("a", 0)))
    w.at(150, lambda: w.reader.values.__setitem__("p", 1.0))  # read by the sample at 180
    bookings = w.run(300)
    # Samples at 60, 120 read 0.5 again (one open interval); 180 reads 1.0: 0..180 at 0.5, 180..300 at 1.0.
    assert [(b.start, b.end, b.busy_share) for b in bookings] == [(0.0, 180.0, 0.5), (180.0, 300.0, 1.0)]


def test_who_pays_team_label_then_queue_then_namespace() -> None:
    w = World(Shares())
    for request, node, index in ((job("ns1/a", labels=(("gpuplane.io/team", "red"),), queue="q"), "a", 0),
                                 (job("ns1/b", queue="q"), "a", 1), (job("ns2/c"), "a", 2), (job("bare"), "a", 3)):
        w.cluster.create_pod(request)
        w.cluster.bind(request.name, cards(node, index))
    bookings = w.run(10)
    assert {b.pod: (b.namespace, b.team, b.queue) for b in bookings} == {
        "ns1/a": ("ns1", "red", "q"), "ns1/b": ("ns1", "q", "q"), "ns2/c": ("ns2", "ns2", ""),
        "bare": ("default", "default", "")}


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[int, int, int, int, float | None]]:
    """Pods as (milli, bind at, held for, card, share); each on its own card of node a (8) or t (4)."""
    count = draw(st.integers(1, 10))
    out = []
    for card in range(count):
        milli = draw(st.sampled_from((100, 250, 500, 1000)))
        out.append((milli, draw(st.integers(0, 500)), draw(st.integers(1, 800)), card,
                    draw(st.one_of(st.none(), st.floats(0.0, 1.0)))))
    return out


@settings(max_examples=60, deadline=None)
@given(scripts(), st.lists(st.integers(1, 1300), max_size=6), st.floats(0.0, 1.0))
def test_allocated_is_used_plus_idle_and_sums_to_the_cards_held(script: list[tuple[int, int, int, int, float | None]],
                                                               samples: list[int], later: float) -> None:
    reader = Shares()
    w = World(reader)
    end = 1400.0
    held = 0.0
    for i, (milli, start, length, card, busy) in enumerate(script):
        name = f"p{i}"
        node, index = ("a", card) if card < 8 else ("t", card - 8)
        w.cluster.create_pod(frac(name, milli) if milli < 1000 else job(name))
        reader.values[name] = busy
        assignment = share(node, index, milli) if milli < 1000 else cards(node, index)
        w.at(start, lambda name=name, assignment=assignment: w.cluster.bind(name, assignment))
        w.at(start + length, lambda name=name: w.cluster.delete_pod(name))
        held += milli / 1000 * length
    for t in samples:  # readings change at sample times
        w.at(t, lambda: reader.values.update({k: later for k in reader.values}))
        w.at(t, w.ledger.sample)
    rows = bill(w.run(end), {}, by=("pod", "team", "card_model"))
    for row in rows:
        assert row.allocated_gpu_s == pytest.approx(row.used_gpu_s + row.idle_gpu_s)
        assert -1e-9 <= row.used_gpu_s <= row.allocated_gpu_s + 1e-9
        assert row.unmeasured_gpu_s <= row.idle_gpu_s + 1e-9
    assert sum(r.allocated_gpu_s for r in rows) == pytest.approx(held)


# ------------------------------------------------------------------------------------------ readers


class Source:
    def __init__(self, value: float | None) -> None:
        self.value = value
        self.queries: list[str] = []

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        self.queries.append(query)
        if self.value is None:
            raise GpuplaneError(f"query {query!r}: no data")
        return self.value


DCGM_CASES = [
    # (metric, value, assignment, share): GPU_UTIL is a percent over the pod's cards; SM_ACTIVE a ratio.
    ("DCGM_FI_DEV_GPU_UTIL", 45.0, cards("a", 0, 1), 0.45),
    ("DCGM_FI_PROF_SM_ACTIVE", 0.3, cards("a", 0), 0.3),
    # A quarter card on a card 20 % busy: 200 milli of its 250 = 0.8; 40 % busy is more than it holds: 1.
    ("DCGM_FI_DEV_GPU_UTIL", 20.0, share("t", 0, 250), 0.8),
    ("DCGM_FI_DEV_GPU_UTIL", 40.0, share("t", 0, 250), 1.0),
    ("DCGM_FI_DEV_GPU_UTIL", None, cards("a", 0), None),  # no data is no reading, never 0
]


@pytest.mark.parametrize(("metric", "value", "assignment", "expected"), DCGM_CASES)
def test_dcgm_reader(metric: str, value: float | None, assignment: Assignment, expected: float | None) -> None:
    source = Source(value)
    pod = PodInfo(job("ml/train-7"), PodPhase.RUNNING, assignment)
    got = DcgmReader(source, metric).busy_share(pod, 0.0)
    assert got == (pytest.approx(expected) if expected is not None else None)
    assert source.queries == [f'avg({metric}{{namespace="ml",pod="train-7"}})']


class Card:
    """One dcgm series: a card's figure, labelled with the pod that holds it (none: the card is free)."""

    def __init__(self, value: float, pod: str | None = None) -> None:
        self.value = value
        ns, _, name = (pod or "").rpartition("/")
        self.labels = {"gpu": "0"} | ({"namespace": ns or "default", "pod": name} if pod else {})


class Cards:
    """A Prometheus over a table of dcgm series that answers both reads as PromQL would: a pod's own query
    averages its cards (no series: no data; NaN or ±Inf: not a finite number); the vector query groups every
    labelled card by (namespace, pod)."""

    def __init__(self, series: list[Card], *, fail: str | None = None) -> None:
        self.series = series
        self.fail = fail
        self.queries: list[str] = []

    def _groups(self) -> dict[tuple[str, str], list[float]]:
        groups: dict[tuple[str, str], list[float]] = {}
        for card in self.series:
            if "pod" in card.labels:
                groups.setdefault((card.labels["namespace"], card.labels["pod"]), []).append(card.value)
        return groups

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        self.queries.append(query)
        for (ns, pod), values in self._groups().items():
            if f'namespace="{ns}",pod="{pod}"' in query:
                mean = sum(values) / len(values)
                if not math.isfinite(mean):
                    raise GpuplaneError(f"query {query!r} returned {mean}, not a finite number")
                return mean
        raise GpuplaneError(f"query {query!r}: no data")

    def vector(self, query: str, *, timeout_s: float | None = None) -> list[Series]:
        self.queries.append(query)
        if self.fail is not None:
            raise GpuplaneError(f"query {query!r} failed: HTTP 422: {self.fail}")
        return [Series({"namespace": ns, "pod": pod}, sum(values) / len(values), 0.0)
                for (ns, pod), values in self._groups().items()]


# The pods of the vector tests and what dcgm says of their cards (percent).
VECTOR_PODS = [
    PodInfo(job("ml/train-7", 2), PodPhase.RUNNING, cards("a", 0, 1)),  # (45 + 55.5) / 2 = 50.25 % → 0.5025
    PodInfo(frac("dev/box-1", 250), PodPhase.RUNNING, share("t", 0, 250)),  # 20 % of a card, 250 of 1000: 0.8
    PodInfo(job("web/serve"), PodPhase.RUNNING, cards("a", 2)),  # 33.3 % → 0.333
    PodInfo(job("ml/serve"), PodPhase.RUNNING, cards("a", 3)),  # the same name in another namespace: 70 % → 0.7
    PodInfo(job("ml/gone"), PodPhase.RUNNING, cards("a", 4)),  # no series: no reading
    PodInfo(job("serve"), PodPhase.RUNNING, cards("a", 5)),  # a bare name is in default: no series there
    PodInfo(job("ml/nan"), PodPhase.RUNNING, cards("a", 6)),  # NaN: no reading
    PodInfo(job("ml/hot"), PodPhase.RUNNING, cards("a", 7)),  # +Inf: no reading
]
VECTOR_CARDS = [Card(45.0, "ml/train-7"), Card(55.5, "ml/train-7"), Card(20.0, "dev/box-1"), Card(33.3, "web/serve"),
                Card(70.0, "ml/serve"), Card(90.0), Card(math.nan, "ml/nan"), Card(math.inf, "ml/hot")]
VECTOR_SHARES = {"ml/train-7": 0.5025, "dev/box-1": 0.8, "web/serve": 0.333, "ml/serve": 0.7, "ml/gone": None,
                 "serve": None, "ml/nan": None, "ml/hot": None}


def test_a_sample_reads_every_pod_with_one_vector_query_and_agrees_with_the_per_pod_reads() -> None:
    source = Cards(VECTOR_CARDS)
    reader = DcgmReader(source)
    together = reader.busy_shares(VECTOR_PODS, 0.0)
    assert source.queries == ['avg by (namespace, pod) (DCGM_FI_DEV_GPU_UTIL{pod!=""})']
    one_by_one = {pod.name: reader.busy_share(pod, 0.0) for pod in VECTOR_PODS}
    assert len(source.queries) == 1 + len(VECTOR_PODS)
    assert together == one_by_one
    assert together == {k: pytest.approx(v) if v is not None else None for k, v in VECTOR_SHARES.items()}


def test_an_error_answer_to_the_vector_query_leaves_every_pod_unread_and_names_the_query(
        caplog: pytest.LogCaptureFixture) -> None:
    reader = DcgmReader(Cards(VECTOR_CARDS, fail="execution: query processing would load too many samples"))
    with caplog.at_level("WARNING", "gpuplane.controllers.accounting"):
        assert reader.busy_shares(VECTOR_PODS, 0.0) == {pod.name: None for pod in VECTOR_PODS}
    assert """'avg by (namespace, pod) (DCGM_FI_DEV_GPU_UTIL{pod!=""})' failed: HTTP 422: execution""" in caplog.text
    assert DcgmReader(Cards([])).busy_shares([], 0.0) == {}  # no pod, no query


def test_the_ledger_samples_with_one_query_for_every_pod() -> None:
    loop = EventLoop()
    cluster = SimCluster(CATALOG, nodes(), loop=loop)
    source = Cards([Card(50.0, "ml/a"), Card(10.0, "ml/b"), Card(80.0, "ml/c")])
    ledger = AccountingLedger(cluster, loop, DcgmReader(source), sample_s=60.0)
    for index, name in enumerate(("ml/a", "ml/b", "ml/c")):
        assert cluster.create_pod(job(name)).ok
        assert cluster.bind(name, cards("a", index)).ok
    assert len(source.queries) == 3  # one per bind, each its own pod's query
    loop.run(until=185.0)  # samples at 60, 120 and 180 s: one vector query each
    assert source.queries[3:] == ['avg by (namespace, pod) (DCGM_FI_DEV_GPU_UTIL{pod!=""})'] * 3
    source.series[1] = Card(30.0, "ml/b")
    loop.run(until=245.0)  # the sample at 240 s books ml/b's first reading and goes on with the new one
    ledger.close(300.0)
    # ml/b: 0..240 s at 0.1, 240..300 s at 0.3 = 24 + 18 = 42 used of 300; the others one booking each
    assert [(b.pod, b.start, b.end, b.busy_share) for b in ledger.bookings] == [
        ("ml/b", 0.0, 240.0, 0.1), ("ml/a", 0.0, 300.0, 0.5), ("ml/b", 240.0, 300.0, 0.3), ("ml/c", 0.0, 300.0, 0.8)]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary (Debian: prometheus)")
@pytest.mark.parametrize("metric", ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"])
def test_the_vector_read_agrees_with_the_per_pod_reads_on_a_real_prometheus(tmp_path: Path, metric: str) -> None:
    """gpuplane's node exporter (dcgm-exporter's series, labelled with the pods `StaticPodMapper` gives it) for the
    cards of VECTOR_CARDS that a real exporter can report, scraped by the real Prometheus."""
    backend = FakeGpuBackend(cards=6)
    holders: dict[int, PodRef] = {}
    for index, card in enumerate(VECTOR_CARDS[:6]):
        backend.set_process(index, 1000 + index, GIB, card.value)
        if "pod" in card.labels:
            holders[index] = PodRef(pod=card.labels["pod"], namespace=card.labels["namespace"], container="main")
    exporter = Exporter(backend, hostname="a", pods=StaticPodMapper(holders))
    server, _ = exporter.start(0, "127.0.0.1")
    prometheus = Prometheus(tmp_path, server.server_port)
    try:
        prometheus.wait_for(f"count({metric})", lambda r: bool(r) and r[0]["value"][1] == "6")
        client = PrometheusClient(f"http://127.0.0.1:{prometheus.port}")
        reader = DcgmReader(client, metric)
        pods = VECTOR_PODS[:6]
        together = reader.busy_shares(pods, 0.0)
        assert together == {pod.name: reader.busy_share(pod, 0.0) for pod in pods}  # exactly
        assert together == {pod.name: pytest.approx(VECTOR_SHARES[pod.name]) if VECTOR_SHARES[pod.name] is not None
                            else None for pod in pods}
        # Prometheus' own errors name the query: invalid PromQL (HTTP 400), and many-to-many matching (HTTP 422)
        with pytest.raises(PrometheusError, match=r"query 'avg by \(pod\) \(x' failed: HTTP 400: bad_data: "):
            client.vector("avg by (pod) (x")
        clash = f"{metric} + on(Hostname) {metric}"
        with pytest.raises(PrometheusError, match=rf"query '{re.escape(clash)}' failed: HTTP 422: execution: "):
            client.vector(clash)
    finally:
        prometheus.close()
        exporter.stop()


# ------------------------------------------------------------------------------------------ the idle policy


IDLE_CASES = [
    # (case, class, busy share over time [(t, share)], rule, pod of a workload?, expected actions [(t, kind)])
    # Window 600 s: judged from 600 s on (reconciles every 300 s); idle at 600 → notice, due at 600 + 900 = 1500.
    ("idle dev box: notice then evict", "dev", [(0, 0.01)], IdleRule("dev", 600, 0.05, 900), False,
     [(600, "notice"), (1500, "evict")]),
    ("busy training is left alone", "training", [(0, 0.9)], IdleRule("training", 600, 0.05, 900), False, []),
    ("a class without a rule is left alone", "online", [(0, 0.0)], IdleRule("dev", 600, 0.05, 900), False, []),
    # Busy again at 1000: the window 600..1200 at 1200 averages (400 × 0 + 200 × 0.9) / 600 = 0.3 > 0.05: withdrawn.
    ("busy again within the grace: notice withdrawn", "dev", [(0, 0.0), (1000, 0.9)],
     IdleRule("dev", 600, 0.05, 900), False, [(600, "notice"), (1200, "withdraw")]),
    ("a workload's replica: scale its workload to zero", "dev", [(0, 0.0)],
     IdleRule("dev", 600, 0.05, 300, "scale-to-zero"), True, [(600, "notice"), (900, "scale-to-zero")]),
    ("scale-to-zero of a pod outside a workload evicts it", "dev", [(0, 0.0)],
     IdleRule("dev", 600, 0.05, 300, "scale-to-zero"), False, [(600, "notice"), (900, "evict")]),
]


@pytest.mark.parametrize(("case", "cls", "timeline", "rule", "in_workload", "expected"), IDLE_CASES,
                         ids=[c[0] for c in IDLE_CASES])
def test_idle_policy_announces_then_acts(case: str, cls: str, timeline: list[tuple[float, float]], rule: IdleRule,
                                         in_workload: bool, expected: list[tuple[float, str]]) -> None:
    reader = Shares()
    w = World(reader)
    if in_workload:
        assert w.cluster.create_workload("box", job("box-template", cls=cls), 1).ok
        name = "box-0"
    else:
        name = "box"
        w.cluster.create_pod(job(name, cls=cls))
    w.at(0, lambda: w.cluster.bind(name, cards("a", 0)))
    for t, value in timeline:
        w.at(t, lambda value=value: reader.values.__setitem__(name, value))
        w.at(t, w.ledger.sample)
    policy = IdlePolicy(w.cluster, w.ledger, w.loop, [rule], evict_grace_s=0)
    notices: list[Notice | None] = []

    def reconcile() -> None:
        before = w.cluster.get_pod(name)
        for action in policy.reconcile():
            if action.kind in ("evict", "scale-to-zero"):  # announced before it happened
                raw = dict(before.annotations).get(IDLE_NOTICE) if before is not None else None
                notices.append(Notice.decode(raw) if raw is not None else None)

    for t in range(300, 2400, 300):
        w.at(t, reconcile)
    w.run(2400)
    assert [(a.time, a.kind) for a in policy.actions] == expected
    assert all(a.ok for a in policy.actions)
    # an Event about the pod at each notice (Warning) and each withdrawal (Normal), none for the action itself
    kinds = {"notice": (EventType.WARNING, IDLE_NOTICED), "withdraw": (EventType.NORMAL, IDLE_WITHDRAWN)}
    assert [(e.time, e.kind, e.name, e.type, e.reason) for e in w.cluster.events] == [
        (t, "Pod", name, *kinds[kind]) for t, kind in expected if kind in kinds]
    acted = [a for a in policy.actions if a.kind in ("evict", "scale-to-zero")]
    assert len(notices) == len(acted) and all(n is not None and n.at <= a.time for n, a in zip(notices, acted,
                                                                                               strict=True))
    if acted:
        assert w.cluster.get_pod(name) is None
        if in_workload:
            assert w.cluster.workloads["box"].replicas == 0


def idle_box(rule: IdleRule, timeline: list[tuple[float, float]], *,
             cluster: type[SimCluster] = SimCluster) -> tuple[World, IdlePolicy]:
    """A dev box `box` on one card whose busy share follows `timeline`, reconciled every 300 s until 2400 s."""
    reader = Shares()
    w = World(reader, cluster=cluster)
    w.cluster.create_pod(job("box", cls="dev"))
    w.at(0, lambda: w.cluster.bind("box", cards("a", 0)))
    for t, value in timeline:
        w.at(t, lambda value=value: reader.values.__setitem__("box", value))
        w.at(t, w.ledger.sample)
    policy = IdlePolicy(w.cluster, w.ledger, w.loop, [rule], evict_grace_s=0)
    for t in range(300, 2400, 300):
        w.at(t, policy.reconcile)
    return w, policy


def test_the_idle_events_say_what_is_due_when_and_why() -> None:
    w, _ = idle_box(IdleRule("dev", 600, 0.05, 900), [(0, 0.02), (1000, 0.9)])
    w.run(2400)
    # idle at 600 (2 %): evict due at 600 + 900 = 1500 s; busy from 1000: at 1200 the window 600..1200 averages
    # (400 × 0.02 + 200 × 0.9) / 600 = 188 / 600 = 31.3 %
    assert [(e.type, e.reason, e.message) for e in w.cluster.events] == [
        (EventType.WARNING, "IdleGpuNotice", "GPU efficiency 2.0% over the last 600 s is at most 5.0%: evict due at "
         "1970-01-01T00:25:00Z unless the pod's cards turn busy"),
        (EventType.NORMAL, "IdleGpuNoticeWithdrawn", "GPU efficiency 31.3% over the last 600 s is above 5.0%: the "
         "idle notice is withdrawn (evict was due at 1970-01-01T00:25:00Z)")]


class RefusingEvents(SimCluster):
    def record_event(self, kind: Literal["Pod", "Node"], name: str, *, type_: EventType, reason: str,
                     message: str) -> Status:
        return Status.error("events: forbidden")


def test_an_event_not_recorded_is_logged_and_the_notice_stands(caplog: pytest.LogCaptureFixture) -> None:
    w, policy = idle_box(IdleRule("dev", 600, 0.05, 900), [(0, 0.0)], cluster=RefusingEvents)
    with caplog.at_level("WARNING", "gpuplane.controllers.accounting"):
        w.run(2400)
    assert [(a.time, a.kind, a.ok) for a in policy.actions] == [(600, "notice", True), (1500, "evict", True)]
    assert "the IdleGpuNotice event of box: events: forbidden" in caplog.text


# ------------------------------------------------------------------------------------------ bills and files


def booking(pod: str, team: str, model: str, start: float, end: float, share_: float | None, *,
            milli: int = 1000, cls: str = "training") -> Booking:
    return Booking.of(Holder(pod, "ns", team, "", model, cls, "n", milli), start, end, share_)


def test_bill_costs_allocated_hours_at_the_card_price() -> None:
    rows = bill([booking("a", "red", "H100-80GB", 0, 7200, 0.5), booking("b", "red", "T4", 0, 3600, None, milli=500),
                 booking("c", "blue", "XYZ", 0, 3600, 1.0)], {"H100-80GB": 4.0, "T4": 0.4}, by=("team",))
    # red: 2 h of an H100 at 4.0 (8.0) + half a T4 for 1 h at 0.4 (0.2) = 8.2; blue: an unpriced model costs 0.
    assert [(r.key, r.allocated_gpu_s, r.used_gpu_s, r.unmeasured_gpu_s, r.cost) for r in rows] == [
        (("blue",), 3600.0, 3600.0, 0.0, 0.0), (("red",), 9000.0, 3600.0, 1800.0, pytest.approx(8.2))]


def test_month_split_at_the_end_of_a_month() -> None:
    epoch = 1_764_547_200.0  # 2025-12-01T00:00Z
    parts = split_by_month([booking("a", "red", "T4", -3600, 7200, 1.0)], epoch)
    # One hour in November, two in December.
    assert [(m, b.seconds) for m, b in parts] == [("2025-11", 3600.0), ("2025-12", 7200.0)]


def test_bundled_prices_are_the_platform_weeks() -> None:
    table = load_prices()
    assert table.per_card_hour == PlatformSettings().price_per_gpu_h
    assert table.currency == "USD"


def test_low_efficiency_names_idle_jobs_most_idle_first() -> None:
    found = low_efficiency([booking("busy", "r", "T4", 0, 7200, 0.9), booking("idle", "r", "T4", 0, 7200, 0.1),
                            booking("idler", "r", "T4", 0, 10800, 0.0), booking("short", "r", "T4", 0, 600, 0.0),
                            booking("web", "r", "T4", 0, 7200, 0.0, cls="online")], {"T4": 0.4},
                           max_efficiency=0.3, min_gpu_s=3600, classes=frozenset({"training"}))
    # idler: 3 h idle; idle: 2 h × 0.9 = 1.8 h idle; busy uses 90 %; short held under an hour; web is not governed.
    assert [(r.pod, r.allocated_gpu_s - r.used_gpu_s) for r in found] == [("idler", 10800.0),
                                                                         ("idle", pytest.approx(6480.0))]


def test_ledger_file_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    sink = LedgerFile(path)
    written = [booking("a", "red", "T4", 0, 10.5, None, milli=250), booking("b", "x", "L40S", 3, 4, 0.125)]
    for b in written:
        sink(b)
    sink.close()
    assert read_ledger(path) == written
    path.write_text('{"pod": "a"}\n', encoding="utf-8")
    with pytest.raises(LedgerError, match=r"ledger\.jsonl:1"):
        read_ledger(path)


def test_write_bill_writes_csv_and_page(tmp_path: Path) -> None:
    epoch = 1_764_547_200.0  # 2025-12-01T00:00Z
    bookings = [booking("a", "red", "H100-80GB", 0, 7200, 0.5), booking("b", "blue", "T4", 3600, 7200, 0.0)]
    result = write_bill(bookings, PriceTable(per_card_hour={"H100-80GB": 4.0}), 1800, 7200, tmp_path, epoch=epoch)
    with (tmp_path / "bill.csv").open(encoding="utf-8") as handle:
        rows = {r["team"]: r for r in csv.DictReader(handle)}
    # Clipped to 1800..7200: red 1.5 h at 0.5 used (cost 1.5 × 4.0 = 6.00); blue 1 h idle, T4 unpriced.
    assert (rows["red"]["allocated_gpu_h"], rows["red"]["used_gpu_h"], rows["red"]["cost_USD"]) == (
        "1.500", "0.750", "6.00")
    assert (rows["blue"]["idle_gpu_h"], rows["blue"]["cost_USD"]) == ("1.000", "0.00")
    assert result.missing_prices == ("T4",)
    assert [r.key for r in result.monthly] == [("2025-12", "blue"), ("2025-12", "red")]
    page = (tmp_path / "accounting.html").read_text(encoding="utf-8")
    assert "Monthly bills per team" in page and page.count("data:image/png;base64,") == 3
    assert "No price for:</strong> T4" in page


def cli() -> Typer:
    app = Typer()
    accounting_cmd.register(app)
    return app


def test_cli_bills_a_ledger_file(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.jsonl"
    sink = LedgerFile(ledger)
    start = 1_764_547_200.0  # 2025-12-01T00:00Z: a live ledger books Unix seconds
    sink(booking("a", "red", "A100-80GB", start, start + 36_000, 0.25))
    sink.close()
    result = CliRunner().invoke(cli(), ["accounting", "--from", "2025-12-01", "--to", "2026-01-01", "--out",
                                        str(tmp_path / "out"), "--ledger", str(ledger)])
    assert result.exit_code == 0, result.output
    # 10 h of an A100-80GB at 2.5 = 25.00; used a quarter: 2.5 h; idle 7.5 h (25 % ≤ 30 %: low efficiency).
    assert "allocated 10.000 GPU-h, used 2.500, idle 7.500" in result.output
    assert "cost 25.00 USD; 1 low-efficiency pod(s)" in result.output
    assert (tmp_path / "out" / "low-efficiency.csv").read_text(encoding="utf-8").count("\n") == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--from", "2025-12-02", "--to", "2025-12-01", "--simulate"], "is not after"),
    (["--from", "2025-12-01", "--to", "2025-12-02"], "give one source"),
    (["--from", "yesterday", "--to", "2025-12-02", "--simulate"], "give a date"),
])
def test_cli_refuses_bad_flags(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli(), ["accounting", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2 and message in result.output


# ------------------------------------------------------------------------------------------ the simulation


def test_simulated_ledger_agrees_with_the_weeks_own_book() -> None:
    from gpuplane.controllers.accounting import clip
    from gpuplane.sim.accounting import simulate

    # every dev box a vGPU quarter card (no MIG half cards), so the dev row's efficiency is one figure, 0.15 / 0.25
    s = PlatformSettings.model_validate(dict(SCENARIO.quick) | {"dev_mig_share": 0.0})
    run = simulate(s)
    warm = s.warmup_hours * 3600.0
    rows = {r.key[0]: r for r in bill(clip(run.bookings, warm, run.horizon_s), s.price_per_gpu_h,
                                      by=("namespace",))}
    # The week books what its pods hold every sample_s (600 s) after the warm-up; the ledger books every bind and
    # deletion as it happens: the two agree within a sample's worth of changes.
    assert rows["training"].allocated_gpu_s / 3600 == pytest.approx(run.run.training_held_gpu_h, rel=0.02)
    assert rows["serving"].allocated_gpu_s / 3600 == pytest.approx(run.run.inference_gpu_h, rel=0.02)
    assert rows["serving"].cost == pytest.approx(run.run.inference_cost, rel=0.02)
    assert {"training", "serving", "batch", "dev"} <= rows.keys()
    assert all(b.busy_share is not None and 0.0 <= b.busy_share <= 1.0 for b in run.bookings)
    # The busy model's shares: a training card 0.9 while its gang runs, a dev box 0.15 of a card on its 0.25 (0.6),
    # less the seconds a closed box stays Terminating (kubelet_stop_s) at 0.
    assert rows["training"].used_gpu_s < 0.9 * rows["training"].allocated_gpu_s + 1e-6
    assert 0.59 < rows["dev"].efficiency < 0.6
