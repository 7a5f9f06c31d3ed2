"""Property tests: ClusterState accounting under framework-made placements, exact release, scoring bounds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import CATALOG, cluster, node, renamed
from gpuplane.model import (
    MILLI_PER_CARD,
    ClusterState,
    Fraction,
    GpuForm,
    MigMode,
    MigSlice,
    PodRequest,
    PoolConfig,
    QoS,
    WholeCards,
)
from gpuplane.port import Code
from gpuplane.scheduler import (
    CardOnlyOneScope,
    Framework,
    PolicyConfig,
    ResourceWeights,
    default_registry,
)
from gpuplane.scheduler.scoring import least_allocated, most_allocated

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# the T4s' pool oversells card memory, and offline pods' compute there has a budget of its own
POOLS = {"dev": PoolConfig(memory_oversell=2.0, offline_compute_oversell=True)}
MODELS = ("A100-40GB", "T4", "H100-80GB", "A30-24GB", "V100-16GB")
# MIG profile IDs of the GA100 layout and of the A30 (IDs 14, 5 and 0 mean different slices on each).
MIG_IDS = (19, 20, 15, 14, 9, 5, 0, 21, 6)


def mixed_cluster() -> ClusterState:
    """A100-40GB (dynamic MIG, NVLink, a NIC), T4 in an oversold pool, H100 with MIG always on,
    A30 (two +me profiles), a CPU-only node."""
    return cluster(
        node("a100").gpus(2, "A100-40GB").cpu(32000).mem(131072).nvlink([[0, 1]])
        .nic("mlx0", switch=0, numa=0, vfs=4).obj(),
        node("t4").gpus(2, "T4").cpu(16000).mem(65536).pool("dev").obj(),
        node("h100").gpus(2, "H100").mig(MigMode.ON).cpu(32000).mem(131072).obj(),
        node("a30").gpus(1, "A30").cpu(16000).mem(65536).obj(),
        node("cpu").cpu(16000).mem(65536).obj(),
        pools=POOLS,
    )


# ---------------------------------------------------------------------------- strategies

@st.composite
def gpu_forms(draw: st.DrawFn) -> GpuForm | None:
    kind = draw(st.sampled_from(["whole", "fraction", "mig", "cpu"]))
    if kind == "whole":
        return WholeCards(draw(st.integers(1, 3)))
    if kind == "mig":
        return MigSlice(draw(st.sampled_from(MIG_IDS)))
    if kind == "cpu":
        return None
    compute = draw(st.sampled_from([0, 100, 250, 500, 750, 1000]))
    memory_mib = memory_pct = 0
    if draw(st.booleans()):
        memory_pct = draw(st.integers(1, 100))
    else:
        memory_mib = draw(st.sampled_from([0, 1024, 4096, 12000, 20000]))
    encoders = draw(st.integers(0, 1))
    decoders = draw(st.integers(0, 2))
    if not (compute or memory_mib or memory_pct or encoders or decoders):
        compute = 100
    return Fraction(compute_milli=compute, memory_mib=memory_mib, memory_pct=memory_pct, encoders=encoders,
                    decoders=decoders)


@st.composite
def requests(draw: st.DrawFn, *, models_required: bool = False) -> PodRequest:
    models_strategy = st.frozensets(st.sampled_from(MODELS), min_size=1)
    models = draw(models_strategy if models_required else st.none() | models_strategy)
    return PodRequest(
        "x",
        cpu_milli=draw(st.sampled_from([0, 500, 2000, 8000])),
        memory_mib=draw(st.sampled_from([0, 1024, 16384])),
        gpu=draw(gpu_forms()),
        models=models,
        workload=draw(st.none() | st.sampled_from(["w1", "w2"])),
        instance=draw(st.none() | st.integers(0, 3)),
        rdma_vfs=draw(st.sampled_from([0, 0, 0, 1, 2])),
        priority=draw(st.integers(0, 3)),
        qos=draw(st.sampled_from(list(QoS))),
    )


@dataclass(frozen=True)
class Policy:
    node_policy: str
    card_policy: str
    scope: CardOnlyOneScope
    weights: ResourceWeights
    seed: int

    def framework(self) -> Framework:
        profile = default_registry().build(PolicyConfig(
            node_policy=self.node_policy, card_policy=self.card_policy, card_only_one_scope=self.scope,
            weights=self.weights))
        return Framework(profile, np.random.default_rng(self.seed))


policies = st.builds(
    Policy,
    node_policy=st.sampled_from(["binpack", "spread"]),
    card_policy=st.sampled_from(["binpack", "spread", "card-only-one"]),
    scope=st.sampled_from(list(CardOnlyOneScope)),
    weights=st.sampled_from([ResourceWeights(), ResourceWeights(gpu=1.0, cpu=1.0, memory=1.0),
                             ResourceWeights(gpu=0.0, cpu=1.0, memory=2.0)]),
    seed=st.integers(0, 2**16),
)

operations = st.lists(st.one_of(st.tuples(st.just("place"), requests()),
                                st.tuples(st.just("release"), st.integers(0, 100))), min_size=1, max_size=30)


# ---------------------------------------------------------------------------- independent accounting

def assert_accounting(state: ClusterState) -> None:
    """Recompute every free amount from the bindings and compare with the state's arrays."""
    assert state.check_invariants() == []
    n, width = state.size, state.width
    cpu = np.zeros(n, np.int64)
    mem = np.zeros(n, np.int64)
    milli = np.zeros((n, width), np.int64)
    offline_milli = np.zeros((n, width), np.int64)
    gmem = np.zeros((n, width), np.int64)
    enc = np.zeros((n, width), np.int64)
    dec = np.zeros((n, width), np.int64)
    holders = np.zeros((n, width), np.int64)
    nic_used = [[0] * len(free) for free in state.nic_free]
    for binding in state.bindings.values():
        row = binding.node
        cpu[row] += binding.request.cpu_milli
        mem[row] += binding.request.memory_mib
        # a fractional share of an offline pod on an offline-oversold node counts against the offline budget
        assert binding.oversold == (binding.request.qos is QoS.OFFLINE and bool(state.offline_oversell[row]))
        for share in binding.assignment.cards:
            budget = offline_milli if binding.oversold and not share.whole else milli
            budget[row, share.card] += share.compute_milli
            gmem[row, share.card] += share.memory_mib
            enc[row, share.card] += share.encoders
            dec[row, share.card] += share.decoders
            holders[row, share.card] += 1
            if share.whole:
                assert holders[row, share.card] == 1 or binding.request.gpu is None
        if binding.assignment.rdma is not None:
            nic_used[row][binding.assignment.rdma.nic] += binding.assignment.rdma.vfs
    valid = state.card_valid[:n]
    assert np.array_equal(state.cpu_free[:n], state.cpu_cap[:n] - cpu)
    assert np.array_equal(state.mem_free[:n], state.mem_cap[:n] - mem)
    assert (cpu <= state.cpu_cap[:n]).all() and (mem <= state.mem_cap[:n]).all()
    # No card over capacity in any dimension.
    assert (milli[valid] <= MILLI_PER_CARD).all() and (offline_milli[valid] <= MILLI_PER_CARD).all()
    assert (gmem <= state.card_mem_cap[:n]).all()
    assert (enc <= state.card_enc_cap[:n]).all() and (dec <= state.card_dec_cap[:n]).all()
    assert np.array_equal(state.card_milli_free[:n][valid], MILLI_PER_CARD - milli[valid])
    assert np.array_equal(state.card_offline_free[:n][valid], MILLI_PER_CARD - offline_milli[valid])
    assert np.array_equal(state.card_mem_free[:n], state.card_mem_cap[:n] - gmem)
    assert np.array_equal(state.card_enc_free[:n], state.card_enc_cap[:n] - enc)
    assert np.array_equal(state.card_dec_free[:n], state.card_dec_cap[:n] - dec)
    assert np.array_equal(state.card_holders[:n], holders)
    assert np.array_equal(state.gpu_milli_used[:n], milli.sum(axis=1))
    for row, spec in enumerate(state.nodes):
        vfs = [nic.vfs for nic in spec.topology.nics]
        assert state.nic_free[row] == [v - u for v, u in zip(vfs, nic_used[row], strict=True)]
        assert min(state.nic_free[row], default=0) >= 0
        # Outside an oversold pool, promised memory never exceeds the physical card.
        if spec.pool not in POOLS:
            assert (gmem[row] <= state.card_mem_phys[row]).all()
    for (row, card), instances in state.mig_instances.items():
        model = state.model_of(row)
        assert model is not None and state.card_mig_allowed[row, card]
        profiles = [model.mig_profiles[i.profile_id] for i in instances]
        assert sum(p.compute_slices for p in profiles) <= model.compute_slices
        assert sum(p.memory_mib for p in profiles) <= model.memory_mib
        assert sum(p.media_extensions for p in profiles) <= 1
        assert holders[row, card] == len(instances)


def assert_honours_request(state: ClusterState, request: PodRequest) -> None:
    """The placed pod got what it asked for, of an allowed model."""
    binding = state.bindings[request.name]
    assignment = binding.assignment
    model = state.model_of(binding.node)
    gpu = request.gpu
    if gpu is not None:
        assert model is not None
        assert request.models is None or model.name in request.models
    if gpu is None:
        assert assignment.cards == ()
    elif isinstance(gpu, WholeCards):
        assert len(assignment.cards) == gpu.count
        assert all(s.whole and s.compute_milli == MILLI_PER_CARD and s.mig_profile is None
                   for s in assignment.cards)
    elif isinstance(gpu, Fraction):
        assert model is not None
        (share,) = assignment.cards
        assert not share.whole and share.mig_profile is None
        assert share.compute_milli == gpu.compute_milli
        assert share.memory_mib == gpu.memory_on(model.memory_mib)
        assert (share.encoders, share.decoders) == (gpu.encoders, gpu.decoders)
    else:
        assert model is not None
        profile = model.mig_profile(gpu.profile)
        assert profile is not None
        (share,) = assignment.cards
        assert share.mig_profile == profile.profile_id and share.mig_start in profile.starts
        assert state.card_mig[binding.node, share.card]
    if request.rdma_vfs:
        assert assignment.rdma is not None and assignment.rdma.vfs == request.rdma_vfs
    else:
        assert assignment.rdma is None


def oversubscribed_now(state: ClusterState, request: PodRequest) -> bool:
    binding = state.bindings[request.name]
    row = binding.node
    return any(state.card_mem_cap[row, s.card] - state.card_mem_free[row, s.card] > state.card_mem_phys[row, s.card]
               for s in binding.assignment.cards if not s.whole)


# ---------------------------------------------------------------------------- (1) invariants

@SETTINGS
@given(policy=policies, ops=operations)
def test_framework_placements_keep_invariants(policy: Policy, ops: list[tuple[str, object]]) -> None:
    state = mixed_cluster()
    fw = policy.framework()
    live: list[str] = []
    placed_any = False
    for i, (kind, payload) in enumerate(ops):
        if kind == "place":
            assert isinstance(payload, PodRequest)
            request = renamed(payload, f"p{i}")
            decision = fw.schedule(request, state)
            if decision.assignment is None:
                assert decision.status.code in (Code.UNSCHEDULABLE, Code.UNSCHEDULABLE_AND_UNRESOLVABLE)
                assert decision.status.message.startswith(f"0/{state.size} nodes are available: ")
                continue
            assert decision.status.ok
            assert state.check(decision.assignment, request) is None
            assert state.nodes[decision.node].name == decision.assignment.node
            state.place(request, decision.assignment)
            live.append(request.name)
            placed_any = True
            assert_honours_request(state, request)
            assert decision.assignment.oversubscribed == oversubscribed_now(state, request)
        elif live:
            assert isinstance(payload, int)
            state.release(live.pop(payload % len(live)))
        assert_accounting(state)
    if not placed_any:
        return
    for name in live:
        state.release(name)
    assert_accounting(state)


# ---------------------------------------------------------------------------- (2) exact release

@SETTINGS
@given(policy=policies, reqs=st.lists(requests(), min_size=1, max_size=20), data=st.data())
def test_release_restores_fingerprint(policy: Policy, reqs: list[PodRequest], data: st.DataObject) -> None:
    state = mixed_cluster()
    initial = state.fingerprint()
    initial_nics = [list(free) for free in state.nic_free]
    fw = policy.framework()
    history: list[tuple[str, tuple[bytes, ...]]] = []
    for i, payload in enumerate(reqs):
        request = renamed(payload, f"p{i}")
        decision = fw.schedule(request, state)
        if decision.assignment is None:
            continue
        before = state.fingerprint()
        state.place(request, decision.assignment)
        after = state.fingerprint()
        # Releasing the pod just placed restores the state from just before its placement ...
        state.release(request.name)
        assert state.fingerprint() == before
        # ... and placing it again gives the same state as the first time.
        state.place(request, decision.assignment)
        assert state.fingerprint() == after
        history.append((request.name, before))
    if data.draw(st.booleans(), label="lifo"):
        # Last in, first out: each release restores the state from just before that pod's placement.
        for name, before in reversed(history):
            state.release(name)
            assert state.fingerprint() == before
    else:
        for name in data.draw(st.permutations([name for name, _ in history]), label="order"):
            state.release(name)
    assert state.fingerprint() == initial
    assert state.bindings == {} and state.mig_instances == {} and state.workload_cards == {}
    assert state.nic_free == initial_nics
    assert state.check_invariants() == []


@SETTINGS
@given(policy=policies, reqs=st.lists(requests(), min_size=1, max_size=12), extra=requests())
def test_copy_is_independent_of_the_original(policy: Policy, reqs: list[PodRequest], extra: PodRequest) -> None:
    state = mixed_cluster()
    fw = policy.framework()
    for i, payload in enumerate(reqs):
        request = renamed(payload, f"p{i}")
        decision = fw.schedule(request, state)
        if decision.assignment is not None:
            state.place(request, decision.assignment)
    before = state.fingerprint()
    names = sorted(state.bindings)
    clone = state.copy()
    assert clone.fingerprint() == before
    for name in names[::2]:
        clone.release(name)
    request = renamed(extra, "extra")
    decision = fw.schedule(request, clone)
    if decision.assignment is not None:
        clone.place(request, decision.assignment)
    assert state.fingerprint() == before
    assert sorted(state.bindings) == names
    assert_accounting(state)
    assert_accounting(clone)


# ---------------------------------------------------------------------------- (3) allowed models only

@SETTINGS
@given(policy=policies, reqs=st.lists(requests(models_required=True), min_size=1, max_size=20))
def test_never_placed_on_a_disallowed_model(policy: Policy, reqs: list[PodRequest]) -> None:
    state = mixed_cluster()
    fw = policy.framework()
    present = {spec.gpu_model for spec in state.nodes if spec.gpu_model is not None}
    for i, payload in enumerate(reqs):
        request = renamed(payload, f"p{i}")
        assert request.models is not None
        decision = fw.schedule(request, state)
        if request.gpu is not None and not request.models & present:
            assert decision.assignment is None
            assert decision.status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE
        if decision.assignment is None:
            continue
        model = state.model_of(decision.node)
        if request.gpu is not None:
            assert model is not None and model.name in request.models
        state.place(request, decision.assignment)
        assert_honours_request(state, request)


# ---------------------------------------------------------------------------- (4) scores within 0..100

@st.composite
def score_inputs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    dims = draw(st.integers(1, 3))
    count = draw(st.integers(1, 6))
    capacity = np.array([[draw(st.integers(0, 10**6)) for _ in range(count)] for _ in range(dims)], np.int64)
    used = np.array([[draw(st.integers(0, int(c))) for c in row] for row in capacity], np.int64)
    request = np.array([[draw(st.integers(0, 2 * 10**6))] * count for _ in range(dims)], np.int64)
    weights = np.array([draw(st.floats(0.0, 10.0)) for _ in range(dims)], np.float64)
    return used, request, capacity, weights


@settings(max_examples=100, deadline=None)
@given(inputs=score_inputs())
def test_scores_stay_within_bounds(inputs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
    used, request, capacity, weights = inputs
    most = most_allocated(used, request, capacity, weights)
    least = least_allocated(used, request, capacity, weights)
    for scores in (most, least):
        assert scores.shape == (used.shape[1],)
        assert np.isfinite(scores).all()
        assert ((scores >= 0.0) & (scores <= 100.0)).all()
    # Where the request fits and some weighted dimension exists, the two scores are complements.
    fits = ((used + request) <= capacity).all(axis=0)
    weighted = ((capacity > 0) & (weights[:, None] > 0)).any(axis=0)
    both = fits & weighted
    assert np.allclose(most[both] + least[both], 100.0)
    # Nothing to weigh → 0.
    assert (most[~weighted] == 0).all() and (least[~weighted] == 0).all()


@settings(max_examples=100, deadline=None)
@given(inputs=score_inputs(), more=st.integers(0, 10**6))
def test_scores_are_monotonic_in_the_request(inputs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                                             more: int) -> None:
    used, request, capacity, weights = inputs
    assert (most_allocated(used, request + more, capacity, weights)
            >= most_allocated(used, request, capacity, weights) - 1e-9).all()
    assert (least_allocated(used, request + more, capacity, weights)
            <= least_allocated(used, request, capacity, weights) + 1e-9).all()


def test_catalog_models_used_here_exist() -> None:
    # Guards the strategies above against a catalog rename.
    assert all(m in CATALOG for m in MODELS)
