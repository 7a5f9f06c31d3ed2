"""What keeps the DRA path's cost per pod down (issue 21's throughput, docs/dra.md): a claim is read once, not at
each of its pods' reads (its status writes leave its asks as they were); the pools' models, the asks' digests and
`DraFilter`'s card masks are computed once per version of the pools, not per pod; and the scheduler
process keeps its long-lived caches out of the cycle collector's reach while a term lasts."""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator
from typing import Any

import pytest

from gpuplane.kube.api import JsonObject
from gpuplane.kube.dra import DraBook, DraFilter, claim_manifest
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import ObjectError
from gpuplane.kube.scheduler_mode import SchedulerMode
from gpuplane.kube.standin import node_manifest
from gpuplane.model import ClusterState, Fraction, MigSlice, NodeSpec, PodRequest, WholeCards, default_catalog
from gpuplane.node.dra_slices import spec_slices
from gpuplane.port import WallClock
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.framework import CardCheck, CycleState
from gpuplane.sim.dra_bench import device_classes

CATALOG = default_catalog()
A100 = CATALOG.canonical("A100-80GB")
NODES = [NodeSpec(f"dra-{i}", 96_000, 786_432, A100, 8) for i in range(2)]


def _claim(name: str, gpu: Any) -> JsonObject:
    claim = claim_manifest(PodRequest(f"ns/{name}-pod", gpu=gpu), name)
    claim["metadata"].update(uid=f"uid-{name}", resourceVersion="1")
    return claim


@pytest.fixture
def book() -> DraBook:
    out = DraBook(CATALOG)
    for spec in NODES:
        for piece in spec_slices(spec, CATALOG):
            out.set_slice(piece, None)
    for cls in device_classes():
        out.classes[cls["metadata"]["name"]] = cls
    return out


@pytest.fixture
def reads(book: DraBook, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The claims whose spec `book` parses (its per-spec reading, below both caches)."""
    seen: list[str] = []
    parse = book._read_asks

    def spy(claim: Any) -> Any:
        seen.append(claim["metadata"]["name"])
        return parse(claim)

    monkeypatch.setattr(book, "_read_asks", spy)
    return seen


@pytest.mark.parametrize("gpu", [WholeCards(2), Fraction(compute_milli=500, memory_mib=16_384), MigSlice("3g.40gb")])
def test_a_claim_is_read_once_across_its_status_writes(book: DraBook, reads: list[str], gpu: Any) -> None:
    claim = _claim("c1", gpu)
    first = book.read_asks(claim)
    allocated = copy.deepcopy(claim)  # the status write: allocation and reservedFor, a new resourceVersion
    allocated["metadata"]["resourceVersion"] = "2"
    allocated["status"] = {"reservedFor": [{"resource": "pods", "name": "c1-pod", "uid": "p"}]}
    assert book.read_asks(allocated) == first
    assert reads == ["c1"]
    assert [a.claim for a in first] == ["ns/c1"]


def test_claims_of_one_spec_share_a_reading_but_keep_their_names(book: DraBook, reads: list[str]) -> None:
    # Two claims of the same spec (a template's): one parse; each ask names its own claim.
    a, b = book.read_asks(_claim("a", WholeCards(1))), book.read_asks(_claim("b", WholeCards(1)))
    assert reads == ["a"]
    assert ([x.claim for x in a], [x.claim for x in b]) == (["ns/a"], ["ns/b"])
    assert [x.selection for x in a] == [x.selection for x in b]


def test_a_claim_is_read_again_when_its_spec_or_the_classes_change(book: DraBook, reads: list[str]) -> None:
    claim = _claim("c", WholeCards(1))
    book.read_asks(claim)
    changed = copy.deepcopy(claim)
    # The API refuses a change of a claim's spec; the cache does not count on it.
    changed["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    assert [a.count for a in book.read_asks(changed)] == [2]
    book.class_version += 1  # a DeviceClass changed: the selectors may differ
    book.read_asks(changed)
    assert reads == ["c", "c", "c"]


def test_a_claim_gpuplane_cannot_read_raises_each_time_naming_the_field(book: DraBook, reads: list[str]) -> None:
    claim = _claim("bad", WholeCards(1))
    claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "nvidia.com"
    errors = []
    for _ in range(2):
        with pytest.raises(ObjectError) as caught:
            book.read_asks(claim)
        errors.append(caught.value)
    assert reads == ["bad"]
    assert errors[0] is not errors[1]
    assert str(errors[0]) == str(errors[1]) == ("ResourceClaim ns/bad: deviceClassName: "
                                                "DeviceClass 'nvidia.com' not found")
    book.forget_claim("ns/bad")  # deleted: a claim of that name again is answered from the spec's reading
    with pytest.raises(ObjectError, match=r"nvidia\.com"):
        book.read_asks(claim)
    assert reads == ["bad"]


def test_the_pools_models_follow_the_pools(book: DraBook) -> None:
    assert book.models() == {A100}
    h100 = CATALOG.canonical("H100-80GB")
    for piece in spec_slices(NodeSpec("dra-h", 96_000, 786_432, h100, 8), CATALOG):
        book.set_slice(piece, None)
    assert book.models() == {A100, h100}


def test_the_filter_s_card_masks_are_made_once_per_pool_version(book: DraBook) -> None:
    state = ClusterState(CATALOG, NODES)
    [ask] = book.read_asks(_claim("c", MigSlice("3g.40gb")))
    masks = book.masks(ask, state)
    assert book.masks(ask, state) is masks
    codes = book.matrix(ask, state)
    # One mask per check, in order: no device of the class, each selector (the class's, then the request's),
    # tainted; each passes exactly the cards whose code is not that check's.
    assert [reason.split(": ", 1)[1].split(" `")[0] for reason, _ in masks] == (
        ["no device of its class on the card"] + ["no device matches selector"] * len(ask.selectors)
        + ["the matching devices are tainted"])
    for (_, passing), code in zip(masks, [2, *range(4, 4 + len(ask.selectors)), 3], strict=True):
        assert (passing == (codes != code)).all()
    pod = PodRequest("ns/p", gpu=MigSlice("3g.40gb"), labels=(("gpu.gpuplane.io/asks", book.register([ask])),))
    checks = [c for c in DraFilter(book).checks(CycleState(), pod, state) if isinstance(c, CardCheck)]
    assert [c.reason for c in checks] == [reason for reason, _ in masks]
    spec = next(iter(spec_slices(NODES[0], CATALOG)))
    spec["spec"]["pool"]["generation"] = 2  # a new generation of a pool: new masks
    book.set_slice(spec, None)
    assert book.masks(ask, state) is not masks


def test_the_digest_of_asks_alike_is_one(book: DraBook) -> None:
    # Pods asking alike through different claims share a digest (and the core's memory of failures).
    a, b = book.read_asks(_claim("a", WholeCards(2))), book.read_asks(_claim("b", WholeCards(2)))
    c = book.read_asks(_claim("c", WholeCards(1)))
    assert book.register(a) == book.register(b) != book.register(c)
    assert book.asks[book.register(b)][0].claim == "ns/b"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        yield fake


def test_a_term_keeps_its_caches_out_of_the_collector_while_it_lasts(server: FakeApiServer) -> None:
    server.add_node(node_manifest(NODES[0]))
    profile = default_registry().build(PolicyConfig(node_policy="binpack"))
    assert gc.get_freeze_count() == 0
    mode = SchedulerMode(server.api, profile, catalog=CATALOG, clock=WallClock(), bind_workers=0, freeze_gc=True)
    try:
        mode.tick()
        assert mode.leading and gc.get_freeze_count() > 0
    finally:
        mode.shutdown()
    assert gc.get_freeze_count() == 0
    plain = SchedulerMode(server.api, profile, catalog=CATALOG, clock=WallClock(), bind_workers=0)
    try:
        plain.tick()
        assert plain.leading and gc.get_freeze_count() == 0  # off unless asked (tests share a process)
    finally:
        plain.shutdown()
