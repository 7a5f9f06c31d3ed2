"""The MIG manager: plans on the catalog's geometry, applied to the fake backend (which refuses what the driver
refuses) and through NVML with pynvml's functions replaced (the real pynvml error classes and ctypes types); and
the device plugin's MIG reconcile on the fake backend, in virtual time, with instances created by real gRPC
`Allocate` calls."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pynvml
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.fake_kubelet import FakeKubelet
from typer.testing import CliRunner

from gpuplane.cli.device_plugin_cmd import register
from gpuplane.model import Assignment, CardModel, CardShare, GpuplaneError, MigMode, QoS, default_catalog
from gpuplane.model.mig import mig_layout_problems
from gpuplane.node.allocation import BoundPod, MemoryAssignmentSource, PendingPod
from gpuplane.node.device_plugin import DevicePlugin, MigReconcile, PluginSettings
from gpuplane.node.gpu import GIB, DeviceBackend, FakeGpuBackend, GpuBackendError, MigInstance, NvmlBackend
from gpuplane.node.mig import (
    Placement,
    Wanted,
    apply_plan,
    held_instances,
    layout_is_legal,
    parse_profiles,
    plan_layout,
    wanted_from_assignments,
)

CATALOG = default_catalog()
H100 = CATALOG.get("H100-80GB")
A30 = CATALOG.get("A30-24GB")


def mig_card(model: CardModel = H100, enabled: bool = False) -> FakeGpuBackend:
    return FakeGpuBackend(1, model.memory_mib << 20, name=model.name, mig_model=model, mig_enabled=enabled)


def plan_and_apply(backend: DeviceBackend, model: CardModel, wanted: Sequence[Wanted]) -> list[tuple[int, int]]:
    plan, status = plan_layout(model, 0, wanted, backend.mig_instances(0), backend.describe()[0].mig_enabled)
    assert plan is not None, status.message
    result = apply_plan(backend, plan)
    assert result.status.ok, result.status.message
    return [(m.profile_id, m.start) for m in backend.mig_instances(0)]


# -- planning and applying on the fake ---------------------------------------------------------------------------


# The zero-waste layouts of protocols.md §5.2 (7 compute slices used, nothing stranded), by profile ID:
# 7g = 0; 4g = 5, 3g = 9; 2g = 14; 1g = 19.
ZERO_WASTE = {
    "7g": [0],
    "4g+3g": [5, 9],
    "3g+2×2g": [9, 14, 14],
    "3g+2g+2×1g": [9, 14, 19, 19],
}


@pytest.mark.parametrize("model_name", ["A100-40GB", "H100-80GB", "H200-141GB"])
@pytest.mark.parametrize("layout", list(ZERO_WASTE))
def test_every_zero_waste_layout_is_reachable_from_empty_and_from_a_full_card(model_name: str, layout: str) -> None:
    model = CATALOG.get(model_name)
    wanted = [Wanted(p) for p in ZERO_WASTE[layout]]
    backend = mig_card(model)
    got = plan_and_apply(backend, model, wanted)
    used = sum(model.mig_profiles[p].compute_slices for p, _ in got)
    assert sorted(p for p, _ in got) == sorted(ZERO_WASTE[layout]) and used == 7
    # from 7 × 1g (every compute slice taken): the old instances make way
    full = mig_card(model, enabled=True)
    for start in range(7):
        full.create_mig_instance(0, 19, start)
    got = plan_and_apply(full, model, wanted)
    assert sorted(p for p, _ in got) == sorted(ZERO_WASTE[layout])


def test_the_plan_keeps_what_it_can_and_says_so() -> None:
    backend = mig_card(H100, enabled=True)
    kept = backend.create_mig_instance(0, 9, 4)  # 3g.40gb at [4, 8)
    gone = backend.create_mig_instance(0, 14, 0)  # 2g.20gb at [0, 2)
    wanted, status = parse_profiles(H100, "4g.40gb,3g.40gb")
    assert status.ok and wanted == [Wanted(5), Wanted(9)]
    plan, _ = plan_layout(H100, 0, wanted, backend.mig_instances(0), True)
    assert plan is not None
    # 4g must start at 0, which the 2g holds: destroy the 2g, keep the 3g at 4
    assert plan.destroy == (gone,) and plan.keep == (kept,) and plan.create == (Placement(0, 5),)
    assert plan.lines(H100) == ["card 0: destroy GPU instance 2: 2g.20gb (ID 14) at 0",
                                "card 0: create 4g.40gb (ID 5) at memory slice 0",
                                "card 0: keep GPU instance 1: 3g.40gb (ID 9) at 4"]
    assert apply_plan(backend, plan).status.ok
    again, _ = plan_layout(H100, 0, wanted, backend.mig_instances(0), True)
    assert again is not None and again.empty and again.lines(H100)[0].startswith("card 0: keep")


def test_fixed_starts_from_the_scheduler_are_honoured() -> None:
    assignments = [Assignment("n", (CardShare(0, 285, 20091, mig_profile=14, mig_start=4),)),
                   Assignment("n", (CardShare(0, 142, 9984, mig_profile=19, mig_start=6),
                                    CardShare(1, 142, 9984, mig_profile=19, mig_start=0)))]
    wanted = wanted_from_assignments(assignments, 0)
    assert wanted == [Wanted(14, 4), Wanted(19, 6)]
    assert plan_and_apply(mig_card(H100), H100, wanted) == [(14, 4), (19, 6)]


@pytest.mark.parametrize(("text", "reason"), [
    ("4g.40gb,4g.40gb", "no legal layout"),  # one 4g at most: it can only start at 0
    ("7g.80gb,1g.10gb", "no legal layout"),  # 7 + 1 > 7 compute slices
    ("1g.10gb+me,1g.10gb+me", "no legal layout"),  # +me at most once
    ("3g.40gb@2", "cannot start at 2"),  # 3g starts at 0 or 4
    ("5g.50gb", "no MIG profile"),
])
def test_impossible_layouts_are_refused_with_a_reason(text: str, reason: str) -> None:
    wanted, status = parse_profiles(H100, text)
    if status.ok:
        plan, status = plan_layout(H100, 0, wanted, [], False)
        assert plan is None
    assert reason in status.message


def test_a_card_without_mig_gets_no_plan() -> None:
    t4 = CATALOG.get("T4")
    plan, status = plan_layout(t4, 0, [], [], None)
    assert plan is None and "has no MIG" in status.message


def test_the_fake_refuses_what_the_driver_refuses() -> None:
    backend = mig_card(H100)
    with pytest.raises(GpuBackendError, match="MIG mode is not enabled"):
        backend.create_mig_instance(0, 19, 0)
    assert backend.set_mig_mode(0, True)
    backend.create_mig_instance(0, 9, 0)
    for profile, start, match in [(9, 2, "cannot start at 2"), (14, 2, "overlaps"), (99, 0, "no GPU-instance"),
                                  (5, 0, "overlaps")]:
        with pytest.raises(GpuBackendError, match=match):
            backend.create_mig_instance(0, profile, start)
    backend.create_mig_instance(0, 20, 4)  # 1g+me
    with pytest.raises(GpuBackendError, match=r"media extensions|maximum"):
        backend.create_mig_instance(0, 20, 5)
    with pytest.raises(GpuBackendError, match="In use"):
        backend.set_mig_mode(0, False)
    with pytest.raises(GpuBackendError, match="no GPU instance 42"):
        backend.destroy_mig_instance(0, 42)
    with pytest.raises(GpuBackendError, match="Not Supported"):
        FakeGpuBackend(1).set_mig_mode(0, True)


# H100 (7 compute, 8 memory slices) by profile ID: 0 = 7g [0, 8); 5 = 4g (4 compute) at 0; 9 = 3g (3 compute, 4
# memory) at 0 or 4; 14 = 2g at 0, 2, 4; 15 = 1g.20gb (1 compute, 2 memory) at 0, 2, 4, 6; 19 = 1g at 0..6;
# 20 = 1g+me (one at most).
@pytest.mark.parametrize(("layout", "problems"), [
    ([], []),
    ([(5, 0), (9, 4)], []),  # 4 + 3 = 7 compute, [0, 4) and [4, 8)
    ([(9, 4), (14, 0), (19, 2), (19, 3)], []),  # 3 + 2 + 1 + 1 = 7
    ([(19, s) for s in range(7)], []),  # 7 × 1g: [0, 7)
    ([(99, 0)], ["H100-80GB has no GPU-instance profile ID 99"]),
    ([(9, 2)], ["3g.40gb cannot start at 2 (legal: [0, 4])"]),
    ([(9, 0), (14, 2)], ["2g.20gb at 2 overlaps another instance"]),  # [0, 4) and [2, 4)
    ([(19, 7)], ["1g.10gb cannot start at 7 (legal: [0, 1, 2, 3, 4, 5, 6])"]),
    ([(20, 0), (20, 1)], ["more than 1 × 1g.10gb+me", "2 instances with media extensions (+me), at most 1"]),
    ([(0, 0), (19, 0)], ["1g.10gb at 0 overlaps another instance", "8 compute slices, the card has 7"]),
])
def test_mig_layout_problems(layout: list[tuple[int, int]], problems: list[str]) -> None:
    assert mig_layout_problems(H100, layout) == problems
    assert layout_is_legal(H100, [Placement(start, pid) for pid, start in layout]).ok == (not problems)


@pytest.mark.parametrize(("present", "profile_id", "start", "code"), [
    ([], 99, 0, "Invalid Argument"),  # the card has no such profile
    ([], 9, 2, "Invalid Argument"),  # never a legal start for 3g
    ([(9, 0)], 14, 2, "Insufficient Resources"),  # legal alone, overlaps the 3g at [0, 4)
    ([(20, 0)], 20, 1, "Insufficient Resources"),  # the media extensions are taken
    ([(14, 0), (14, 2), (14, 4)], 14, 6, "Invalid Argument"),  # 2g starts at 0, 2, 4 only
])
def test_the_fake_answers_the_drivers_error_codes(present: list[tuple[int, int]], profile_id: int, start: int,
                                                  code: str) -> None:
    backend = mig_card(H100, enabled=True)
    for pid, at in present:
        backend.create_mig_instance(0, pid, at)
    with pytest.raises(GpuBackendError, match=rf"^nvmlDeviceCreateGpuInstanceWithPlacement: card 0: .*\({code}\)$"):
        backend.create_mig_instance(0, profile_id, start)
    assert [(m.profile_id, m.start) for m in backend.mig_instances(0)] == present


def test_a_mig_instances_mask_is_its_memory_slices() -> None:
    backend = mig_card(H100, enabled=True)
    three = backend.create_mig_instance(0, 9, 4)  # [4, 8): bits 4..7
    assert three.mask == 0b1111_0000 == H100.mig_profiles[9].slot_mask(4)


def test_a30_geometry() -> None:
    # A30: 4 compute and 4 memory slices; 2g.12gb (ID 5) at 0 or 2, 1g.6gb (ID 14) at 0..3. The largest instance
    # is placed first, at its lowest legal start: 2g at [0, 2), the 1gs at 2 and 3 (4 of 4 slices used)
    assert plan_and_apply(mig_card(A30), A30, [Wanted(5), Wanted(14), Wanted(14)]) == [(5, 0), (14, 2), (14, 3)]
    plan, status = plan_layout(A30, 0, [Wanted(0), Wanted(14)], [], False)  # 4g + 1g > 4 slices
    assert plan is None and "no legal layout" in status.message


# -- properties --------------------------------------------------------------------------------------------------

PROFILE_IDS = sorted(H100.mig_profiles)


@st.composite
def wanted_lists(draw: st.DrawFn) -> list[Wanted]:
    ids = draw(st.lists(st.sampled_from(PROFILE_IDS), min_size=0, max_size=5))
    out = []
    for profile_id in ids:
        starts = H100.mig_profiles[profile_id].starts
        fixed = draw(st.one_of(st.none(), st.sampled_from(starts)))
        out.append(Wanted(profile_id, fixed))
    return out


@st.composite
def present_cards(draw: st.DrawFn) -> FakeGpuBackend:
    backend = mig_card(H100, enabled=True)
    for profile_id, start in draw(st.lists(st.tuples(st.sampled_from(PROFILE_IDS), st.integers(0, 7)), max_size=6)):
        with contextlib.suppress(GpuBackendError):  # illegal with what is there: the driver refuses it too
            backend.create_mig_instance(0, profile_id, start)
    return backend


def brute_force_feasible(wanted: Sequence[Wanted]) -> bool:
    """Whether some choice of starts is legal (an oracle independent of the planner's search)."""
    options = [[w.start] if w.start is not None else list(H100.mig_profiles[w.profile_id].starts) for w in wanted]
    return any(layout_is_legal(H100, [Placement(s, w.profile_id) for s, w in zip(starts, wanted, strict=True)]).ok
               for starts in itertools.product(*options))


@settings(max_examples=150, deadline=None)
@given(wanted=wanted_lists(), backend=present_cards())
def test_plans_are_legal_complete_and_idempotent(wanted: list[Wanted], backend: FakeGpuBackend) -> None:
    present = backend.mig_instances(0)
    plan, status = plan_layout(H100, 0, wanted, present, True)
    assert (plan is not None) == brute_force_feasible(wanted), status.message
    if plan is None:
        return
    layout = plan.layout
    assert layout_is_legal(H100, layout).ok  # no overlap, legal starts, ≤ 7 compute slices, +me at most once
    assert sum(H100.mig_profiles[p.profile_id].compute_slices for p in layout) <= 7
    assert sum(H100.mig_profiles[p.profile_id].media_extensions for p in layout) <= 1
    assert Counter(p.profile_id for p in layout) == Counter(w.profile_id for w in wanted)
    for w in wanted:
        if w.start is not None:
            assert Placement(w.start, w.profile_id) in layout
    assert set(plan.keep) | set(plan.destroy) == set(present) and not set(plan.keep) & set(plan.destroy)
    result = apply_plan(backend, plan)
    assert result.status.ok, result.status.message  # the fake (the driver's rules) accepts every step
    assert sorted((m.start, m.profile_id) for m in backend.mig_instances(0)) == \
        [(p.start, p.profile_id) for p in layout]
    again, _ = plan_layout(H100, 0, wanted, backend.mig_instances(0), True)
    assert again is not None and again.empty


# -- NVML, with pynvml's functions replaced ----------------------------------------------------------------------

# NVML_GPU_INSTANCE_PROFILE_* index constant -> the H100's real profile ID
H100_INDEX_TO_ID = {0: 19, 7: 20, 9: 15, 1: 14, 2: 9, 3: 5, 4: 0}


def _pointer(token: int, kind: Any) -> Any:
    return ctypes.cast(ctypes.c_void_p(token), kind)


def _token(pointer: Any) -> int:
    return int(ctypes.cast(pointer, ctypes.c_void_p).value or 0)


@dataclass
class FakeNvmlMig:
    """One H100 in NVML: MIG mode, GPU instances at placements, compute instances, MIG device handles."""

    mig_mode: int = 0
    instances: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """GI id -> (profile id, start, size)."""
    compute: dict[int, int] = field(default_factory=dict)
    """GI id -> CI profile id (one compute instance per GI)."""
    calls: list[str] = field(default_factory=list)
    fail_ci: bool = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def fn(name: str, result: Any) -> None:
            def call(*args: Any) -> Any:
                self.calls.append(name)
                return result(*args)

            monkeypatch.setattr(pynvml, name, call)

        fn("nvmlInit", lambda: None)
        fn("nvmlShutdown", lambda: None)
        fn("nvmlDeviceGetCount", lambda: 1)
        fn("nvmlDeviceGetHandleByIndex", lambda i: "gpu-0")
        fn("nvmlDeviceGetUUID", lambda h: "GPU-5a1b" if h == "gpu-0" else f"MIG-{h}")
        fn("nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
        fn("nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=80 * GIB, used=0, free=80 * GIB))
        fn("nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId=b"00000000:3B:00.0"))
        fn("nvmlDeviceGetNumaNodeId", self._raise(pynvml.NVMLError_FunctionNotFound))
        fn("nvmlDeviceGetMinorNumber", lambda h: 3)
        fn("nvmlDeviceGetNvLinkState", self._raise(pynvml.NVMLError_NotSupported))
        fn("nvmlDeviceGetMigMode", lambda h: [self.mig_mode, self.mig_mode])
        fn("nvmlDeviceSetMigMode", self._set_mode)
        fn("nvmlDeviceGetGpuInstanceProfileInfo", self._profile_info)
        fn("nvmlDeviceGetGpuInstancePossiblePlacements", self._placements)
        fn("nvmlDeviceCreateGpuInstanceWithPlacement", self._create)
        fn("nvmlGpuInstanceGetInfo", self._gi_info)
        fn("nvmlGpuInstanceGetComputeInstanceProfileInfo", self._ci_profile)
        fn("nvmlGpuInstanceCreateComputeInstance", self._create_ci)
        fn("nvmlDeviceGetGpuInstances", self._list_gi)
        fn("nvmlDeviceGetMaxMigDeviceCount", lambda h: 7)
        fn("nvmlDeviceGetMigDeviceHandleByIndex", self._mig_handle)
        fn("nvmlDeviceGetGpuInstanceId", lambda mig: int(mig.removeprefix("mig-gi")))
        fn("nvmlDeviceGetComputeInstanceId", lambda mig: 0)
        fn("nvmlDeviceGetGpuInstanceById", self._gi_by_id)
        fn("nvmlGpuInstanceGetComputeInstances", self._list_ci)
        fn("nvmlComputeInstanceDestroy", self._destroy_ci)
        fn("nvmlGpuInstanceDestroy", self._destroy_gi)

    @staticmethod
    def _raise(error: type[pynvml.NVMLError]) -> Any:
        def call(*args: Any) -> Any:
            raise error()

        return call

    def _set_mode(self, handle: str, mode: int) -> int:
        self.mig_mode = mode
        return 0

    @staticmethod
    def _profile_info(handle: str, index: int) -> SimpleNamespace:
        if index not in H100_INDEX_TO_ID:
            raise pynvml.NVMLError_NotSupported()
        profile = H100.mig_profiles[H100_INDEX_TO_ID[index]]
        return SimpleNamespace(id=profile.profile_id, sliceCount=profile.compute_slices,
                               instanceCount=profile.max_count, memorySizeMB=profile.memory_mib)

    @staticmethod
    def _placements(handle: str, profile_id: int, array: Any, count_ref: Any) -> int:
        profile = H100.mig_profiles[profile_id]
        for i, start in enumerate(profile.starts):
            array[i].start, array[i].size = start, profile.memory_slices
        count_ref._obj.value = len(profile.starts)
        return 0

    def _create(self, handle: str, profile_id: int, placement_ref: Any) -> Any:
        placement = placement_ref._obj
        assert isinstance(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        start, size = int(placement.start), int(placement.size)
        for _, other_start, other_size in self.instances.values():
            if start < other_start + other_size and other_start < start + size:
                raise pynvml.NVMLError_InsufficientResources()
        gi = max(self.instances, default=0) + 1
        self.instances[gi] = (profile_id, start, size)
        return _pointer(gi, pynvml.c_nvmlGpuInstance_t)

    def _gi_info(self, gpu_instance: Any) -> SimpleNamespace:
        gi = _token(gpu_instance)
        profile_id, start, size = self.instances[gi]
        return SimpleNamespace(id=gi, profileId=profile_id, placement=SimpleNamespace(start=start, size=size))

    @staticmethod
    def _ci_profile(gpu_instance: Any, index: int, engine: int) -> SimpleNamespace:
        assert engine == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        return SimpleNamespace(id=100 + index, instanceCount=1)

    def _create_ci(self, gpu_instance: Any, ci_profile_id: int) -> Any:
        if self.fail_ci:
            raise pynvml.NVMLError_InsufficientResources()
        self.compute[_token(gpu_instance)] = ci_profile_id
        return _pointer(_token(gpu_instance), pynvml.c_nvmlComputeInstance_t)

    def _list_gi(self, handle: str, profile_id: int, array: Any, count_ref: Any) -> int:
        found = [gi for gi, (p, _, _) in sorted(self.instances.items()) if p == profile_id]
        for i, gi in enumerate(found):
            array[i] = _pointer(gi, pynvml.c_nvmlGpuInstance_t)
        count_ref._obj.value = len(found)
        return 0

    def _mig_handle(self, handle: str, index: int) -> str:
        with_ci = sorted(self.compute)
        if index >= len(with_ci):
            raise pynvml.NVMLError_NotFound()
        return f"mig-gi{with_ci[index]}"

    def _gi_by_id(self, handle: str, gi: int) -> Any:
        if gi not in self.instances:
            raise pynvml.NVMLError_NotFound()
        return _pointer(gi, pynvml.c_nvmlGpuInstance_t)

    def _list_ci(self, gpu_instance: Any, ci_profile_id: int, array: Any, count_ref: Any) -> int:
        gi = _token(gpu_instance)
        found = [gi] if self.compute.get(gi) == ci_profile_id else []
        for i, token in enumerate(found):
            array[i] = _pointer(token, pynvml.c_nvmlComputeInstance_t)
        count_ref._obj.value = len(found)
        return 0

    def _destroy_ci(self, compute_instance: Any) -> int:
        del self.compute[_token(compute_instance)]
        return 0

    def _destroy_gi(self, gpu_instance: Any) -> int:
        gi = _token(gpu_instance)
        if gi in self.compute:
            raise pynvml.NVMLError_InUse()
        del self.instances[gi]
        return 0


def test_nvml_describe_reads_identity_and_place(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvmlMig().install(monkeypatch)
    backend = NvmlBackend()
    (info,) = backend.describe()
    # no nvmlDeviceGetNumaNodeId in this driver and no such PCI device in sysfs here: NUMA unknown
    assert (info.uuid, info.name, info.minor, info.pci_bus_id, info.numa, info.nvlink_peers, info.mig_enabled) == \
        ("GPU-5a1b", "NVIDIA H100 80GB HBM3", 3, "00000000:3B:00.0", None, (), False)
    assert backend.mig_instances(0) == []


def test_nvml_plan_apply_and_list(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvmlMig()
    nvml.install(monkeypatch)
    backend = NvmlBackend()
    wanted = [Wanted(9), Wanted(14), Wanted(19), Wanted(19)]  # 3g + 2g + 2 × 1g: zero waste
    # created by start: GPU instance 1 = 2g at 0, 2 and 3 = 1g at 2 and 3, 4 = 3g at 4
    assert plan_and_apply(backend, H100, wanted) == [(14, 0), (19, 2), (19, 3), (9, 4)]
    assert nvml.mig_mode == 1 and "nvmlDeviceSetMigMode" in nvml.calls
    # one compute instance per GPU instance, of the index matching its slices (3g → 2, 2g → 1, 1g → 0)
    assert sorted(nvml.compute.values()) == [100, 100, 101, 102]
    listed = backend.mig_instances(0)
    assert [(m.profile_id, m.start, m.size, m.uuid) for m in listed] == [
        (14, 0, 2, "MIG-mig-gi1"), (19, 2, 1, "MIG-mig-gi2"), (19, 3, 1, "MIG-mig-gi3"), (9, 4, 4, "MIG-mig-gi4")]
    # 4g + 3g: the 2g and the 1gs go (compute instances first), the 3g stays
    assert plan_and_apply(backend, H100, [Wanted(5), Wanted(9)]) == [(5, 0), (9, 4)]
    assert sorted(nvml.instances) == [4, 5] and sorted(nvml.compute) == [4, 5]


def test_nvml_errors_become_backend_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvmlMig(mig_mode=1)
    nvml.install(monkeypatch)
    backend = NvmlBackend()
    with pytest.raises(GpuBackendError, match="cannot start at memory slice 2"):
        backend.create_mig_instance(0, 9, 2)  # not among the driver's placements for 3g
    with pytest.raises(GpuBackendError, match="no MIG GPU-instance profile with ID 42"):
        backend.create_mig_instance(0, 42, 0)
    backend.create_mig_instance(0, 9, 0)
    with pytest.raises(GpuBackendError, match="nvmlDeviceCreateGpuInstanceWithPlacement"):
        backend.create_mig_instance(0, 14, 2)  # overlaps [0, 4): the driver's InsufficientResources
    nvml.fail_ci = True
    with pytest.raises(GpuBackendError, match="compute instance"):
        backend.create_mig_instance(0, 9, 4)
    assert sorted(nvml.instances) == [1]  # the GPU instance without a compute instance was undone
    with pytest.raises(GpuBackendError, match="nvmlDeviceGetGpuInstanceById"):
        backend.destroy_mig_instance(0, 77)


# -- the command -------------------------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_mig_apply_dry_run_prints_the_plan() -> None:
    result = CliRunner().invoke(_app(), ["mig-apply", "--card", "0", "--profiles", "3g.40gb,2g.20gb,1g.10gb,19",
                                         "--dry-run", "--fake-model", "H100-80GB"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "plan for card 0 (H100-80GB), not applied (--dry-run):",
        "card 0: enable MIG mode",
        "card 0: create 2g.20gb (ID 14) at memory slice 0",
        "card 0: create 1g.10gb (ID 19) at memory slice 2",
        "card 0: create 1g.10gb (ID 19) at memory slice 3",
        "card 0: create 3g.40gb (ID 9) at memory slice 4",
    ]


def test_mig_apply_applies_on_the_fake_card() -> None:
    result = CliRunner().invoke(_app(), ["mig-apply", "--card", "0", "--profiles", "7g.80gb", "--fake-model", "H100"])
    assert result.exit_code == 0, result.output
    assert "card 0: created GPU instance 1 at 0: MIG-fake-0-1" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--profiles", "9g.90gb"], "--profiles"),
    (["--profiles", "4g.40gb,4g.40gb"], "no legal layout"),
    (["--profiles", "7g.80gb", "--card", "3"], "--card"),
    (["--profiles", "1g.5gb", "--fake-model", "T4"], "has no MIG"),
    (["--profiles", "1g.5gb", "--fake-model", "Z9"], "--fake-model"),
])
def test_mig_apply_refuses_with_exit_2(args: list[str], message: str) -> None:
    base = ["mig-apply", "--dry-run"] + ([] if "--card" in args else ["--card", "0"])
    if "--fake-model" not in args:
        args = [*args, "--fake-model", "H100-80GB"]
    result = CliRunner().invoke(_app(), base + args)
    assert result.exit_code == 2 and message in result.output, result.output


# -- the device plugin's MIG reconcile -------------------------------------------------------------------------

NODE = "mig-node"
GRACE_S = 60.0


class FlakyBackend(FakeGpuBackend):
    """Fake MIG cards whose next `destroy_failures` destroys and `mode_failures` MIG-mode changes fail as NVML
    would."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.destroy_failures = 0
        self.mode_failures = 0

    def destroy_mig_instance(self, card: int, gpu_instance_id: int) -> None:
        if self.destroy_failures:
            self.destroy_failures -= 1
            raise GpuBackendError(f"nvmlGpuInstanceDestroy: card {card}: In use by another client")
        super().destroy_mig_instance(card, gpu_instance_id)

    def set_mig_mode(self, card: int, enabled: bool) -> bool:
        if self.mode_failures:
            self.mode_failures -= 1
            raise GpuBackendError(f"nvmlDeviceSetMigMode: card {card}: Unknown Error")
        return super().set_mig_mode(card, enabled)


class CountingSource(MemoryAssignmentSource):
    """Counts `holders` calls; raises while `down`."""

    def __init__(self) -> None:
        super().__init__()
        self.holder_calls = 0
        self.down = False

    def holders(self) -> list[BoundPod]:
        self.holder_calls += 1
        if self.down:
            raise GpuplaneError("cannot list the pods on mig-node: API server away")
        return super().holders()


class MigNode:
    """A device plugin on fake H100s with MIG, on a virtual clock. Pods are allocated as kubelet does, by a
    real gRPC `Allocate` on the plugin's socket (no registration needed for that)."""

    def __init__(self, cards: int = 1, *, mode: MigMode | None = None, enabled: bool = False) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="gpmig-", dir="/tmp"))  # unix socket paths ≤ 107 bytes
        self.backend = FlakyBackend(cards, H100.memory_mib << 20, name="NVIDIA H100 80GB HBM3", mig_model=H100,
                                    mig_enabled=enabled)
        self.source = CountingSource()
        self.now = 0.0
        self.plugin = DevicePlugin(PluginSettings(NODE, self.directory, mig_mode=mode, mig_grace_s=GRACE_S),
                                   self.backend, self.source, clock=lambda: self.now)
        self.kubelet = FakeKubelet(self.directory)

    def __enter__(self) -> MigNode:
        self.plugin.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.plugin.stop(0)
        shutil.rmtree(self.directory, ignore_errors=True)

    def add(self, name: str, card: int, profile_id: int, start: int) -> str:
        """A pod with one MIG share, bound and allocated: its MIG device's UUID."""
        share = CardShare(card, 0, 0, mig_profile=profile_id, mig_start=start)
        self.bind(name, share)
        response = self.kubelet.allocate([[f"{self.backend.uuid(card)}::0"]], endpoint=self.plugin.settings.endpoint)
        return str(response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"])

    def bind(self, name: str, share: CardShare) -> None:
        """A pod bound to the node, not allocated yet."""
        self.source.add(PendingPod(f"default/{name}", f"uid-{name}", Assignment(NODE, (share,)), self.now, QoS.ONLINE,
                                   (("main", 1),)))

    def delete(self, name: str) -> None:
        self.source.delete(f"default/{name}")

    def at(self, now: float) -> MigReconcile:
        self.now = now
        return self.plugin.reconcile_mig()

    def layout(self, card: int = 0) -> list[tuple[int, int]]:
        return [(m.profile_id, m.start) for m in self.backend.mig_instances(card)]

    def uuids(self, card: int = 0) -> list[str | None]:
        return [m.uuid for m in self.backend.mig_instances(card)]

    def mig_enabled(self, card: int = 0) -> bool | None:
        return self.backend.describe()[card].mig_enabled


@pytest.fixture
def node() -> Iterator[MigNode]:
    with MigNode() as mig_node:
        yield mig_node


def test_a_deleted_pods_instance_goes_after_the_grace_and_a_live_pods_stays(node: MigNode) -> None:
    big = node.add("big", 0, 9, 4)  # 3g.40gb at [4, 8)
    small = node.add("small", 0, 14, 0)  # 2g.20gb at [0, 2)
    assert node.layout() == [(14, 0), (9, 4)]
    node.delete("big")
    assert node.at(0.0) == MigReconcile()  # first seen unheld at 0: destroyed at 0 + 60
    assert node.at(59.9) == MigReconcile()
    done = node.at(60.0)
    assert [m.uuid for m in done.destroyed] == [big] and done.mig_off == () and done.errors == ()
    assert node.uuids() == [small]
    assert node.at(10_000.0) == MigReconcile() and node.uuids() == [small] and node.mig_enabled()


def test_a_dynamic_card_leaves_mig_mode_with_its_last_instance_and_enters_it_again(node: MigNode) -> None:
    node.add("one", 0, 19, 3)  # 1g.10gb at 3; the card entered MIG mode for it
    assert node.mig_enabled() is True
    node.delete("one")
    assert node.at(0.0) == MigReconcile()
    done = node.at(60.0)  # unheld and unwanted since 0: destroyed, and the empty card leaves MIG mode
    assert [(m.profile_id, m.start) for m in done.destroyed] == [(19, 3)] and done.mig_off == (0,)
    assert node.mig_enabled() is False and node.layout() == []
    calls = node.source.holder_calls
    assert node.at(1000.0) == MigReconcile() and node.source.holder_calls == calls  # no MIG card: no pod list
    uuid = node.add("next", 0, 0, 0)  # 7g.80gb: Allocate enters MIG mode again
    assert node.mig_enabled() is True and node.uuids() == [uuid]


def test_an_empty_mig_card_leaves_mig_mode_only_when_no_live_pod_wants_it() -> None:
    with MigNode(enabled=True) as node:
        # bound, not allocated yet: wants 2g at 2 on card 0, which has no instance yet
        node.bind("coming", CardShare(0, 0, 0, mig_profile=14, mig_start=2))
        assert node.at(0.0) == MigReconcile() and node.at(1000.0) == MigReconcile()
        assert node.mig_enabled() is True
        node.delete("coming")
        assert node.at(1001.0) == MigReconcile()  # unwanted since 1001
        assert node.at(1060.9) == MigReconcile() and node.mig_enabled() is True
        assert node.at(1061.0).mig_off == (0,) and node.mig_enabled() is False


def test_on_mode_keeps_mig_on_and_puts_a_card_back() -> None:
    with MigNode(mode=MigMode.ON) as node:
        assert node.at(0.0).mig_on == (0,) and node.mig_enabled() is True  # ON: the cards are always in MIG mode
        node.add("one", 0, 9, 0)
        node.delete("one")
        node.at(1.0)
        done = node.at(61.0)
        assert len(done.destroyed) == 1 and done.mig_off == ()
        assert node.at(10_000.0) == MigReconcile() and node.mig_enabled() is True and node.layout() == []


def test_a_failed_destroy_or_mode_change_is_left_logged_and_retried_next_round(node: MigNode,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    uuid = node.add("gone", 0, 14, 4)
    node.delete("gone")
    node.at(0.0)
    node.backend.destroy_failures = 1
    node.backend.mode_failures = 1
    with caplog.at_level(logging.WARNING, logger="gpuplane.node.device_plugin"):
        failed = node.at(60.0)
    assert failed.destroyed == () and failed.mig_off == () and len(failed.errors) == 1
    assert "In use by another client" in failed.errors[0] and "In use by another client" in caplog.text
    assert node.uuids() == [uuid] and node.mig_enabled() is True  # left as it was
    retried = node.at(65.0)  # destroyed now; MIG mode off fails once (injected)
    assert [m.uuid for m in retried.destroyed] == [uuid] and retried.mig_off == ()
    assert "Unknown Error" in retried.errors[0] and node.mig_enabled() is True
    assert node.at(70.0).mig_off == (0,) and node.mig_enabled() is False


def test_nothing_is_destroyed_while_the_pods_cannot_be_listed(node: MigNode) -> None:
    uuid = node.add("gone", 0, 5, 0)
    node.source.down = True
    node.delete("gone")
    for t in (0.0, 60.0, 10_000.0):
        assert node.at(t).errors == ("holders: cannot list the pods on mig-node: API server away",)
    assert node.uuids() == [uuid]
    node.source.down = False
    assert node.at(10_001.0) == MigReconcile()  # unheld seen first now: the grace runs from here
    assert len(node.at(10_061.0).destroyed) == 1


def test_instances_no_live_pod_holds_make_way_for_a_new_pod_within_the_grace(node: MigNode) -> None:
    node.add("old-3g", 0, 9, 4)  # [4, 8)
    node.add("old-1g", 0, 19, 0)  # [0, 1)
    live = node.add("live-1g", 0, 19, 1)  # [1, 2)
    node.delete("old-3g")
    node.delete("old-1g")
    node.at(0.0)
    # the scheduler freed [4, 8) at once; the new 2g at [4, 6) overlaps only old-3g's instance: that one goes,
    # old-1g's (apart from it) waits for its grace
    new = node.add("new-2g", 0, 14, 4)
    assert node.layout() == [(19, 0), (19, 1), (14, 4)] and live in node.uuids() and new in node.uuids()
    # a live pod's instance never makes way, even for an assignment that overlaps it
    with pytest.raises(grpc.RpcError) as info:
        node.add("clash", 0, 14, 0)  # [0, 2): old-1g's instance could go, live-1g's cannot
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "no legal layout" in str(info.value.details())
    assert live in node.uuids()


def instance(profile_id: int, start: int, gi: int) -> MigInstance:
    return MigInstance(0, profile_id, start, H100.mig_profiles[profile_id].memory_slices, gi, 0, f"MIG-{gi}")


@pytest.mark.parametrize(("wanted", "held"), [
    ([Wanted(19, 1)], [2]),  # the 1g at 1 only
    ([Wanted(19)], [1, 2]),  # a 1g anywhere: which one it got is not recorded, so both are held
    ([Wanted(14, 0)], []),  # no 2g at 0: nothing held
    ([Wanted(9, 4), Wanted(19, 0)], [1, 3]),
    ([], []),
])
def test_held_instances(wanted: list[Wanted], held: list[int]) -> None:
    present = [instance(19, 0, 1), instance(19, 1, 2), instance(9, 4, 3)]
    assert [m.gpu_instance_id for m in held_instances(present, wanted)] == held


CANDIDATES = [(card, profile_id, start) for card in (0, 1) for profile_id in (0, 5, 9, 14, 19)
              for start in H100.mig_profiles[profile_id].starts]
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(CANDIDATES) - 1)),
    st.tuples(st.just("delete"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 1.0, 30.0, 59.0, 60.0, 250.0])),
), max_size=16)


@settings(max_examples=80, deadline=None)
@given(ops=OPS, mode=st.sampled_from([MigMode.DYNAMIC, MigMode.ON]))
def test_after_any_history_the_instances_are_exactly_the_live_pods_shares(ops: list[tuple[str, float]],
                                                                          mode: MigMode) -> None:
    with MigNode(2, mode=mode) as node:
        live: dict[str, tuple[int, int, int, str]] = {}
        """pod -> (card, profile, start, MIG device UUID)"""
        for i, (op, arg) in enumerate(ops):
            if op == "add":
                card, profile_id, start = CANDIDATES[int(arg)]
                layout = [Placement(s, p) for c, p, s, _ in live.values() if c == card] + [Placement(start, profile_id)]
                if not layout_is_legal(H100, layout).ok:
                    continue  # the scheduler places a MIG share only beside the live ones
                live[f"p{i}"] = (card, profile_id, start, node.add(f"p{i}", card, profile_id, start))
            elif op == "delete" and live:
                name = sorted(live)[int(arg) % len(live)]
                del live[name]
                node.delete(name)
            elif op == "tick":
                node.now += arg
                node.plugin.tick()
            for card, _, _, uuid in live.values():  # never destroyed under a live pod
                assert uuid in node.uuids(card)
        node.now += 1.0
        node.plugin.tick()  # every dead instance is seen unheld by now ...
        node.now += GRACE_S
        node.plugin.tick()  # ... and its grace is over
        for card in (0, 1):
            shares = sorted((p, s) for c, p, s, _ in live.values() if c == card)
            assert sorted(node.layout(card)) == shares
            assert sorted(u for c, _, _, u in live.values() if c == card) == sorted(map(str, node.uuids(card)))
            assert node.mig_enabled(card) is (mode is MigMode.ON or bool(shares))
