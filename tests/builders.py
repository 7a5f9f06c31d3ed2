"""Small fluent builders for test fixtures.

    node("n1").gpus(8, model="A100-40GB").cpu(64000).mem(262144).nvlink([[0, 1, 2, 3], [4, 5, 6, 7]]).obj()
    pod("p").cpu(1000).fraction(500).workload("w", 0).obj()
    cluster(spec1, spec2, pools={"dev": PoolConfig(memory_oversell=2.0)})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from gpuplane.model import (
    Assignment,
    Catalog,
    ClusterState,
    Fraction,
    GpuForm,
    MigMode,
    MigSlice,
    NodeSpec,
    PodRequest,
    PoolConfig,
    QoS,
    RdmaNic,
    Taint,
    Toleration,
    Topology,
    WholeCards,
    default_catalog,
)
from gpuplane.scheduler import CardOnlyOneScope, Decision, Framework, PolicyConfig, ResourceWeights, TopoConfig
from gpuplane.scheduler import default_registry as _default_registry

CATALOG: Catalog = default_catalog()

EQUAL_WEIGHTS = ResourceWeights(gpu=1.0, cpu=1.0, memory=1.0)
"""GPU, CPU and memory weighted alike (tests state their weights rather than rely on the defaults)."""


class NodeBuilder:
    def __init__(self, name: str) -> None:
        self._name = name
        self._cpu = 64000
        self._mem = 262144
        self._model: str | None = None
        self._gpus = 0
        self._pool = "default"
        self._labels: list[tuple[str, str]] = []
        self._taints: list[Taint] = []
        self._schedulable = True
        self._mig_mode = MigMode.DYNAMIC
        self._numa: tuple[int, ...] | None = None
        self._pcie: tuple[int, ...] | None = None
        self._nvlink: tuple[tuple[int, ...], ...] = ()
        self._nics: list[RdmaNic] = []

    def gpus(self, count: int, model: str | None = "A100-40GB") -> NodeBuilder:
        self._gpus = count
        self._model = model
        return self

    def cpu(self, milli: int) -> NodeBuilder:
        self._cpu = milli
        return self

    def mem(self, mib: int) -> NodeBuilder:
        self._mem = mib
        return self

    def pool(self, name: str) -> NodeBuilder:
        self._pool = name
        return self

    def label(self, key: str, value: str) -> NodeBuilder:
        self._labels.append((key, value))
        return self

    def taint(self, key: str, value: str = "", effect: str = "NoSchedule") -> NodeBuilder:
        self._taints.append(Taint(key, value, effect))
        return self

    def unschedulable(self) -> NodeBuilder:
        self._schedulable = False
        return self

    def mig(self, mode: MigMode) -> NodeBuilder:
        self._mig_mode = mode
        return self

    def numa(self, ids: Sequence[int]) -> NodeBuilder:
        self._numa = tuple(ids)
        return self

    def pcie(self, ids: Sequence[int]) -> NodeBuilder:
        self._pcie = tuple(ids)
        return self

    def nvlink(self, groups: Iterable[Iterable[int]]) -> NodeBuilder:
        self._nvlink = tuple(tuple(g) for g in groups)
        return self

    def nic(self, name: str, *, switch: int, numa: int, vfs: int) -> NodeBuilder:
        self._nics.append(RdmaNic(name, switch, numa, vfs))
        return self

    def obj(self) -> NodeSpec:
        default = Topology.default(self._gpus)
        topology = Topology(
            numa=self._numa if self._numa is not None else default.numa,
            pcie_switch=self._pcie if self._pcie is not None else default.pcie_switch,
            nvlink_groups=self._nvlink,
            nics=tuple(self._nics),
        )
        return NodeSpec(
            name=self._name, cpu_milli=self._cpu, memory_mib=self._mem, gpu_model=self._model, gpus=self._gpus,
            pool=self._pool, labels=tuple(self._labels), taints=tuple(self._taints), schedulable=self._schedulable,
            mig_mode=self._mig_mode, topology=topology,
        )


class PodBuilder:
    def __init__(self, name: str) -> None:
        self._name = name
        self._cpu = 0
        self._mem = 0
        self._gpu: GpuForm | None = None
        self._models: frozenset[str] | None = None
        self._priority = 0
        self._qos = QoS.ONLINE
        self._workload: str | None = None
        self._instance: int | None = None
        self._rdma = 0
        self._pools: frozenset[str] | None = None
        self._tolerations: list[Toleration] = []

    def cpu(self, milli: int) -> PodBuilder:
        self._cpu = milli
        return self

    def mem(self, mib: int) -> PodBuilder:
        self._mem = mib
        return self

    def whole(self, count: int) -> PodBuilder:
        self._gpu = WholeCards(count)
        return self

    def fraction(self, compute_milli: int = 0, *, mem: int = 0, pct: int = 0, enc: int = 0,
                 dec: int = 0) -> PodBuilder:
        self._gpu = Fraction(compute_milli=compute_milli, memory_mib=mem, memory_pct=pct, encoders=enc,
                             decoders=dec)
        return self

    def mig(self, profile: int | str) -> PodBuilder:
        self._gpu = MigSlice(profile)
        return self

    def models(self, *names: str) -> PodBuilder:
        self._models = frozenset(CATALOG.canonical(n) for n in names)
        return self

    def priority(self, value: int) -> PodBuilder:
        self._priority = value
        return self

    def qos(self, value: QoS) -> PodBuilder:
        self._qos = value
        return self

    def workload(self, name: str, instance: int | None = None) -> PodBuilder:
        self._workload = name
        self._instance = instance
        return self

    def rdma(self, vfs: int) -> PodBuilder:
        self._rdma = vfs
        return self

    def pools(self, *names: str) -> PodBuilder:
        self._pools = frozenset(names)
        return self

    def tolerate(self, key: str, value: str | None = None) -> PodBuilder:
        self._tolerations.append(Toleration(key, value))
        return self

    def obj(self) -> PodRequest:
        return PodRequest(
            self._name, cpu_milli=self._cpu, memory_mib=self._mem, gpu=self._gpu, models=self._models,
            priority=self._priority, qos=self._qos, workload=self._workload, instance=self._instance,
            rdma_vfs=self._rdma, pools=self._pools, tolerations=tuple(self._tolerations),
        )


def node(name: str) -> NodeBuilder:
    return NodeBuilder(name)


def pod(name: str) -> PodBuilder:
    return PodBuilder(name)


def cluster(*specs: NodeSpec, pools: Mapping[str, PoolConfig] | None = None) -> ClusterState:
    """A ClusterState over `specs` with the default catalog."""
    return ClusterState(default_catalog(), list(specs), pools)


def renamed(request: PodRequest, name: str) -> PodRequest:
    return replace(request, name=name)


def framework(node_policy: str = "binpack", card_policy: str = "binpack", *, seed: int = 0,
              weights: ResourceWeights = EQUAL_WEIGHTS, scope: CardOnlyOneScope = CardOnlyOneScope.WORKLOAD,
              topo: TopoConfig | None = None) -> Framework:
    """A framework built through the default registry."""
    profile = _default_registry().build(PolicyConfig(node_policy=node_policy, card_policy=card_policy,
                                                     card_only_one_scope=scope, custom_topo=topo, weights=weights))
    return Framework(profile, np.random.default_rng(seed))


def schedule(fw: Framework, state: ClusterState, request: PodRequest) -> Decision:
    """Decide and, on success, place in `state`."""
    decision = fw.schedule(request, state)
    if decision.assignment is not None:
        state.place(request, decision.assignment)
    return decision


def placed(fw: Framework, state: ClusterState, request: PodRequest) -> Assignment:
    """Decide and place; fail the test if the pod does not fit."""
    decision = schedule(fw, state, request)
    assert decision.assignment is not None, decision.status.message
    return decision.assignment
