"""A restarted scheduler rebuilds the card-level state from the API alone, and decides as the old one would.

The first scheduler places pods through `KubeCluster` (its binds and assignment annotations go to the local API
server); then it and its port are thrown away, fresh ones start against the same server, and the rebuilt
`ClusterState` must equal the old one array for array, binding for binding, MIG instance for MIG instance.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.kube.objects import assignment_annotations
from gpuplane.model import (
    Assignment,
    CardShare,
    ClusterState,
    Fraction,
    GpuForm,
    MigSlice,
    PodRequest,
    WholeCards,
    default_catalog,
    make_request,
)
from gpuplane.scheduler import Framework, PolicyConfig, Scheduler, default_registry

CATALOG = default_catalog()
PROFILE = default_registry().build(PolicyConfig())
SEED = 7


class Clock:
    def __init__(self) -> None:
        self.t = 5000.0

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback: object) -> object:
        raise AssertionError("not used")


def shapes() -> list[tuple[str, GpuForm, frozenset[str] | None]]:
    a100 = frozenset({"A100-40GB"})
    return [
        ("whole1", WholeCards(1), None), ("whole2", WholeCards(2), None), ("whole4", WholeCards(4), None),
        ("frac30", Fraction(compute_milli=300, memory_mib=8192), None),
        ("frac50", Fraction(compute_milli=500, memory_mib=10240), None),
        ("frac20", Fraction(compute_milli=200, memory_pct=20), None),
        ("mig3g", MigSlice("3g.20gb"), a100), ("mig1g", MigSlice("1g.5gb"), a100),
    ]


def workload(count: int, prefix: str) -> list[PodRequest]:
    forms = shapes()
    return [make_request(CATALOG, f"ml/{prefix}{i:02d}-{forms[i % len(forms)][0]}", cpu_milli=1000,
                         memory_mib=4096, gpu=forms[i % len(forms)][1], models=forms[i % len(forms)][2])
            for i in range(count)]


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with FakeApiServer() as fake:
        # 6 nodes × 8 cards: three A100-40GB (MIG-capable), three H100-80GB.
        for i in range(6):
            fake.add_node(node_json(f"n{i}", model="A100-40GB" if i < 3 else "H100-80GB", cards=8, cpu="96",
                                    memory="1Ti"))
        yield fake


def start(server: FakeApiServer, clock: Clock) -> tuple[KubeCluster, Scheduler]:
    cluster = KubeCluster(server.api, CATALOG, clock=clock, dispatch="manual")
    try:
        return cluster, Scheduler(cluster, CATALOG, PROFILE, seed=SEED, now=clock.now)
    except BaseException:
        cluster.close()
        raise


def summary(state: ClusterState) -> tuple[object, ...]:
    return (state.fingerprint(), [n.name for n in state.nodes],
            {name: (b.node, b.assignment) for name, b in sorted(state.bindings.items())},
            {k: sorted(map(repr, v)) for k, v in sorted(state.mig_instances.items()) if v})


def test_a_restarted_scheduler_rebuilds_the_same_state_and_decides_alike(server: FakeApiServer) -> None:
    clock = Clock()
    old_cluster, old = start(server, clock)
    for request in workload(40, "p"):
        assert old_cluster.create_pod(request).ok
    outcomes = old.run_pending()
    placed = [o for o in outcomes if o.decision.status.ok]
    assert len(placed) >= 30, [o.decision.status.message for o in outcomes if not o.decision.status.ok]
    kinds = {name.rsplit("-", 1)[1] for name in old.state.bindings}
    assert {"whole4", "frac30", "frac20", "mig3g", "mig1g"} <= kinds  # the mix really landed
    assert old.state.check_invariants() == []
    bound_on_server = [k for k in server.keys("pods") if (server.get("pods", k) or {}).get("spec", {}).get("nodeName")]
    assert sorted(bound_on_server) == sorted(old.state.bindings)
    old.close()
    old_cluster.close()

    new_cluster, new = start(server, clock)
    try:
        assert new_cluster.unreadable() == []
        assert summary(new.state) == summary(old.state)
        assert new.state.check_invariants() == []
        # (b) the same decisions for new pods: same seed, same state, no binding.
        old_fw = Framework(PROFILE, np.random.default_rng(SEED))
        new_fw = Framework(PROFILE, np.random.default_rng(SEED))
        decided = 0
        for request in workload(16, "q"):
            before, after = old_fw.schedule(request, old.state), new_fw.schedule(request, new.state)
            assert (before.status.code, before.assignment) == (after.status.code, after.assignment), request.name
            decided += before.assignment is not None
        assert decided >= 4
    finally:
        new.close()
        new_cluster.close()


def test_a_pod_whose_assignment_names_another_node_is_reported(server: FakeApiServer) -> None:
    good = Assignment("n0", (CardShare(card=0, compute_milli=1000, memory_mib=40960, whole=True),))
    wrong = Assignment("n1", (CardShare(card=1, compute_milli=1000, memory_mib=40960, whole=True),))
    server.add_pod(pod_json("good", namespace="ml", limits={"gpuplane.io/gpu": "1"}, node="n0", phase="Running",
                            annotations=assignment_annotations(good, 1.0)))
    server.add_pod(pod_json("torn", namespace="ml", limits={"gpuplane.io/gpu": "1"}, node="n2", phase="Running",
                            annotations=assignment_annotations(wrong, 1.0)))
    cluster, scheduler = start(server, Clock())
    try:
        ((key, error),) = cluster.unreadable()
        assert key == "pod ml/torn" and "names node 'n1' but the pod is bound to 'n2'" in error
        assert sorted(scheduler.state.bindings) == ["ml/good"]  # not placed on n1 or n2 as if it were right
        assert scheduler.state.idle_cards[scheduler.state.node_index["n1"]] == 8
    finally:
        scheduler.close()
        cluster.close()


def test_a_recorded_assignment_that_does_not_match_the_request_does_not_stop_a_restart(
        server: FakeApiServer) -> None:
    # 30 % of a card recorded with 1 MiB more memory than the pod asks for (an edited annotation, say).
    request = make_request(CATALOG, "ml/frac", gpu=Fraction(compute_milli=300, memory_mib=8192))
    torn = Assignment("n0", (CardShare(card=0, compute_milli=300, memory_mib=8193),))
    server.add_pod(pod_json("frac", namespace="ml", node="n0", phase="Running",
                            limits={"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "30", "gpuplane.io/gpumem": "8192"},
                            annotations=assignment_annotations(torn, 1.0)))
    assert request.gpu == Fraction(compute_milli=300, memory_mib=8192)
    cluster, scheduler = start(server, Clock())
    try:
        assert "ml/frac" not in scheduler.state.bindings
        assert [name for name, _ in scheduler.unplaced] == ["ml/frac"]
        assert scheduler.unplaced[0][1].endswith("assignment does not match the requested GPU memory")
    finally:
        scheduler.close()
        cluster.close()
