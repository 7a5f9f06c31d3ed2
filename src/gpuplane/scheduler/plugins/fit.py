"""Fit filters: node constraints and resources (`NodeFit`) and card resources (`GpuFit`), vectorised over the cluster.

`NodeFit` applies kube-scheduler's node filters in its order: NodeUnschedulable, TaintToleration, NodeAffinity
(node selector and required node affinity), then the resources. A pod that uses a placement constraint gpuplane
does not implement (`PodRequest.unsupported`) is refused on every node, unresolvably, the fields named.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np

from gpuplane.model import ClusterState, Fraction, MigSlice, PodRequest, QoS, WholeCards
from gpuplane.model.cluster import RowIndex
from gpuplane.scheduler.framework import BoolArray, CardCheck, Check, CycleState, NodeCheck

# Reason strings are constants so that messages aggregate and tests can name them.
UNSCHEDULABLE_NODE = "node(s) were unschedulable"
POOL_MISMATCH = "node(s) in another pool"
UNTOLERATED_TAINT = "node(s) had untolerated taints"
AFFINITY_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
UNSUPPORTED_PREFIX = "gpuplane does not implement the pod's "
NO_GPU = "node(s) have no GPU"
MODEL_MISMATCH = "GPU model mismatch"
INSUFFICIENT_CPU = "insufficient cpu"
INSUFFICIENT_MEMORY = "insufficient memory"
INSUFFICIENT_RDMA = "insufficient RDMA virtual functions"
INSUFFICIENT_IDLE_GPUS = "insufficient idle GPUs"
CARDS_IN_MIG_MODE = "cards in MIG mode"
INSUFFICIENT_GPU_COMPUTE = "insufficient GPU compute"
INSUFFICIENT_GPU_MEMORY = "insufficient GPU memory"
INSUFFICIENT_CODECS = "insufficient GPU encoders/decoders"
NO_MIG_PROFILE = "MIG profile not offered by the node's GPU model"
NO_MIG_CARD = "no card free for MIG"
NO_MIG_SLOT = "no free MIG slot for the profile"


class NodeFit:
    """Node-level predicates: supported constraints, schedulable, pool, taints, node affinity, GPU model, CPU,
    memory, RDMA."""

    name = "NodeFit"

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        n = state.size
        if pod.unsupported:
            yield NodeCheck(unsupported_reason(pod.unsupported), np.zeros(n, np.bool_), resolvable=False)
        if not pod.tolerates_unschedulable:
            yield NodeCheck(UNSCHEDULABLE_NODE, state.schedulable[:n], resolvable=False)
        if pod.pools is not None:
            yield NodeCheck(POOL_MISMATCH, state.pools_mask(pod.pools), resolvable=False)
        tolerated = state.taint_mask(pod)
        if tolerated is not None:
            yield NodeCheck(UNTOLERATED_TAINT, tolerated, resolvable=False)
        selected = state.affinity_mask(pod)
        if selected is not None:
            yield NodeCheck(AFFINITY_MISMATCH, selected, resolvable=False)
        if pod.gpu is not None:
            model_idx = state.model_idx[:n]
            yield NodeCheck(NO_GPU, model_idx >= 0, resolvable=False)
            if pod.models is not None:
                yield NodeCheck(MODEL_MISMATCH, state.model_allowed(pod.models)[model_idx], resolvable=False)
        if pod.cpu_milli:
            yield NodeCheck(INSUFFICIENT_CPU, state.cpu_free[:n] >= pod.cpu_milli)
        if pod.memory_mib:
            yield NodeCheck(INSUFFICIENT_MEMORY, state.mem_free[:n] >= pod.memory_mib)
        if pod.rdma_vfs:
            yield NodeCheck(INSUFFICIENT_RDMA, state.rdma_max_free[:n] >= pod.rdma_vfs)


def unsupported_reason(fields: tuple[str, ...]) -> str:
    """The refusal of a pod using constraints gpuplane does not implement, naming the fields."""
    return f"{UNSUPPORTED_PREFIX}{', '.join(fields)}"


class GpuFit:
    """Card-level predicates for the pod's GPU form (whole cards, a fraction or a MIG slice)."""

    name = "GpuFit"

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        gpu = pod.gpu
        # Each card mask depends on its node's own state only: kept per node version (`ClusterState.node_mask`).
        if isinstance(gpu, WholeCards):
            yield CardCheck(INSUFFICIENT_IDLE_GPUS, state.node_mask(_IDLE, partial(_idle_cards, state)))
        elif isinstance(gpu, Fraction):
            yield CardCheck(CARDS_IN_MIG_MODE, state.node_mask(_NOT_MIG, partial(_not_mig, state)))
            if gpu.compute_milli:
                offline = pod.qos is QoS.OFFLINE and bool(state.offline_oversell[: state.size].any())
                yield CardCheck(INSUFFICIENT_GPU_COMPUTE, state.node_mask(
                    (_COMPUTE, gpu.compute_milli, offline), partial(_compute_at_least, state, gpu.compute_milli,
                                                                    pod if offline else None)))
            if gpu.memory_mib:
                yield CardCheck(INSUFFICIENT_GPU_MEMORY, state.node_mask(
                    (_MEMORY, gpu.memory_mib), partial(_memory_at_least, state, gpu.memory_mib)))
            elif gpu.memory_pct:
                yield CardCheck(INSUFFICIENT_GPU_MEMORY, state.node_mask(
                    (_MEMORY_PCT, gpu.memory_pct), partial(_memory_pct_at_least, state, gpu.memory_pct)))
            if gpu.encoders or gpu.decoders:
                yield CardCheck(INSUFFICIENT_CODECS, state.node_mask(
                    (_CODECS, gpu.encoders, gpu.decoders), partial(_codecs_at_least, state, gpu.encoders,
                                                                    gpu.decoders)))
        elif isinstance(gpu, MigSlice):
            yield from self._mig_checks(gpu, state)

    @staticmethod
    def _mig_checks(gpu: MigSlice, state: ClusterState) -> Iterator[Check]:
        n = state.size
        model_idx = state.model_idx[:n]
        offered = np.zeros(n, np.bool_)
        slot_ok = np.zeros((n, state.width), np.bool_)
        slots = state.card_mig_slots[:n]
        compute = state.card_mig_compute[:n]
        for index, model in enumerate(state.models):
            profile = model.mig_profile(gpu.profile)
            if profile is None:
                continue
            rows = model_idx == index
            if not rows.any():
                continue
            offered |= rows
            room = (compute[rows] + profile.compute_slices <= model.compute_slices)
            if profile.media_extensions:
                room &= ~state.card_mig_me[:n][rows]
            free_start = np.zeros_like(room)
            for start in profile.starts:
                free_start |= (slots[rows] & profile.slot_mask(start)) == 0
            slot_ok[rows] = room & free_start
        yield NodeCheck(NO_MIG_PROFILE, offered, resolvable=False)
        usable = state.card_mig_allowed[:n] & (state.card_mig[:n] | (state.card_holders[:n] == 0))
        yield CardCheck(NO_MIG_CARD, usable)
        yield CardCheck(NO_MIG_SLOT, slot_ok)


_IDLE, _NOT_MIG, _COMPUTE, _MEMORY, _MEMORY_PCT, _CODECS = (
    "GpuFit/idle", "GpuFit/not-mig", "GpuFit/compute", "GpuFit/memory", "GpuFit/memory-pct", "GpuFit/codecs")
"""`ClusterState.node_mask` keys of GpuFit's card masks (with the pod's amounts)."""


def _idle_cards(state: ClusterState, rows: RowIndex) -> BoolArray:
    out: BoolArray = (state.card_holders[rows] == 0) & ~state.card_mig[rows]
    return out


def _not_mig(state: ClusterState, rows: RowIndex) -> BoolArray:
    out: BoolArray = ~state.card_mig[rows]
    return out


def _compute_at_least(state: ClusterState, milli: int, offline: PodRequest | None, rows: RowIndex) -> BoolArray:
    """Cards with `milli` compute free; for an offline pod, of the offline budget on oversold nodes."""
    free = state.card_milli_free[rows] if offline is None else state.milli_free_for(offline, rows)
    out: BoolArray = free >= milli
    return out


def _memory_at_least(state: ClusterState, mib: int, rows: RowIndex) -> BoolArray:
    out: BoolArray = state.card_mem_free[rows] >= mib
    return out


def _memory_pct_at_least(state: ClusterState, pct: int, rows: RowIndex) -> BoolArray:
    out: BoolArray = state.card_mem_free[rows] >= state.card_mem_phys[rows] * pct // 100
    return out


def _codecs_at_least(state: ClusterState, encoders: int, decoders: int, rows: RowIndex) -> BoolArray:
    out: BoolArray = (state.card_enc_free[rows] >= encoders) & (state.card_dec_free[rows] >= decoders)
    return out
