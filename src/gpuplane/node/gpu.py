"""What a node agent reads from its GPU cards: one consistent reading per card, behind a small interface.

`NvmlBackend` reads real cards through NVML (`pynvml`, package nvidia-ml-py); `FakeGpuBackend` holds
readings that tests and benchmarks drive. Every failure reaches callers as `GpuBackendError`, never as
an `NVMLError`, so an agent needs to survive one exception type only.

Both also implement `DeviceBackend`, what the device plugin and the MIG manager need beyond readings: each
card's identity and place (`describe`: UUID, device minor, NUMA node, NVLink peers, MIG mode) and MIG
instances (list, create at a placement with its compute instance, destroy). The fake keeps instances in
memory and refuses what the driver refuses (an illegal start, an overlap, a second `+me`, MIG mode off).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pynvml

from gpuplane.controllers.colocation import GIB
from gpuplane.model import CardModel, GpuplaneError
from gpuplane.model.catalog import slot_mask
from gpuplane.model.mig import mig_layout_problems

__all__ = ["GIB", "CardInfo", "CardReading", "DeviceBackend", "FakeGpuBackend", "GpuBackend", "GpuBackendError",
           "GpuProcess", "MigInstance", "NvmlBackend"]

T = TypeVar("T")
log = logging.getLogger(__name__)
_MAX_EVENTS_PER_READ = 1024
"""Xid events drained per `cards()` call at most; a storm beyond this is read on the next call."""


class GpuBackendError(GpuplaneError):
    """A card could not be read (no driver, a lost GPU, an NVML call failing); the message names the call."""


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a card. `pid` is in the host PID namespace; None means "not reported"."""

    pid: int
    used_bytes: int | None
    sm_util_pct: float | None


@dataclass(frozen=True, slots=True)
class CardReading:
    """One card at one moment; memory in bytes, utilisation in percent (None where the card cannot tell).

    The fields after `processes` are optional for a backend: None means "this backend does not report it"."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    util_pct: float | None
    enc_util_pct: float | None
    dec_util_pct: float | None
    processes: tuple[GpuProcess, ...]
    pci_bus_id: str | None = None
    """NVML's and DCGM's form, e.g. "00000000:3B:00.0"."""
    temperature_c: float | None = None
    """GPU core temperature, °C."""
    power_w: float | None = None
    """Board power draw, W."""
    gr_engine_active: float | None = None
    """Ratio 0–1 of time the graphics/compute engine was active (DCGM's profiling field 1001); `NvmlBackend`
    does not read it (NVML has it only through GPM sampling, Hopper and newer)."""
    xid_last: int | None = None
    """The last Xid error seen on the card since the backend started, 0 for none; None when Xids are not
    watched (see `NvmlBackend`'s `xid_events`)."""


@dataclass(frozen=True, slots=True)
class CardInfo:
    """A card's identity and place, which do not change while the node runs (`DeviceBackend.describe`)."""

    index: int
    uuid: str
    name: str
    """As NVML reports it, e.g. "NVIDIA H100 80GB HBM3"."""
    total_bytes: int
    minor: int | None = None
    """The device node is `/dev/nvidia<minor>`; None: unknown (the index is the usual guess)."""
    numa: int | None = None
    """The NUMA node the card hangs off; None: unknown (or a single-node machine)."""
    pci_bus_id: str | None = None
    nvlink_peers: tuple[int, ...] = ()
    """Cards reached over NVLink (directly or through the same NVSwitch fabric)."""
    mig_enabled: bool | None = None
    """Current MIG mode; None on a card that has no MIG."""


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One GPU instance (and its compute instance) on a card in MIG mode.

    `start`/`size` count memory slices (`nvmlGpuInstancePlacement_t`); `uuid` is the MIG device's
    (`MIG-…`), None while the GPU instance has no compute instance."""

    card: int
    profile_id: int
    start: int
    size: int
    gpu_instance_id: int
    compute_instance_id: int | None = None
    uuid: str | None = None

    @property
    def mask(self) -> int:
        """Bitmask of the memory slices the instance occupies (bit i: memory slice i)."""
        return slot_mask(self.start, self.size)


class GpuBackend(Protocol):
    def cards(self) -> list[CardReading]:
        """A reading of every card, in index order; raises `GpuBackendError` when any card cannot be read."""
        ...

    def close(self) -> None:
        """Release the backend; idempotent."""
        ...


class DeviceBackend(GpuBackend, Protocol):
    """A `GpuBackend` that also describes its cards and manages MIG instances (the device plugin's and the MIG
    manager's view). Every failure is a `GpuBackendError` whose message names the call."""

    def describe(self) -> list[CardInfo]:
        """Every card's identity and place, in index order."""
        ...

    def driver_version(self) -> str:
        """The kernel driver's version as NVML reports it ("550.54.15")."""
        ...

    def set_mig_mode(self, card: int, enabled: bool) -> bool:
        """Ask for MIG mode on or off; True when it is in effect now, False while it waits for a GPU reset."""
        ...

    def mig_instances(self, card: int) -> list[MigInstance]:
        """The GPU instances on the card, by start; [] when MIG mode is off."""
        ...

    def create_mig_instance(self, card: int, profile_id: int, start: int) -> MigInstance:
        """Create a GPU instance of `profile_id` (the real ID, e.g. 9 for 3g) at memory slice `start`, with one
        compute instance spanning it."""
        ...

    def destroy_mig_instance(self, card: int, gpu_instance_id: int) -> None:
        """Destroy the GPU instance and its compute instances."""
        ...


def _nvml(call: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise GpuBackendError(f"{call}: {exc}") from exc


def _nvml_optional(call: str, fn: Callable[..., T], *args: Any) -> T | None:
    """None where the card does not support the call (e.g. utilisation on a MIG handle)."""
    try:
        return fn(*args)
    except pynvml.NVMLError_NotSupported:
        return None
    except pynvml.NVMLError as exc:
        raise GpuBackendError(f"{call}: {exc}") from exc


def _nvml_absent(call: str, fn: Callable[..., T], *args: Any) -> T | None:
    """None where the card, the driver or the library lacks the call or the object (MIG on a non-MIG card)."""
    try:
        return fn(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_InvalidArgument):
        return None
    except pynvml.NVMLError as exc:
        raise GpuBackendError(f"{call}: {exc}") from exc


def _sysfs_numa(bus_id: str) -> int | None:
    """The NUMA node Linux reports for a PCI device (`-1`: none), for drivers without nvmlDeviceGetNumaNodeId."""
    domain, _, rest = bus_id.lower().partition(":")
    path = f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/numa_node"
    try:
        with open(path) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


_CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
"""Compute slices of a GPU instance -> the NVML_COMPUTE_INSTANCE_PROFILE_* index of a compute instance spanning it."""
_MAX_PLACEMENTS = 16


class NvmlBackend:
    """Cards read through NVML.

    Per-process SM utilisation comes from `nvmlDeviceGetProcessUtilization`, which returns only the samples
    taken since the last call's newest timestamp; a process with no new sample keeps its last one for
    `sample_hold_s` (by `clock`), so that a reading between two driver samples does not show a busy
    process as idle.

    With `xid_events`, the backend registers for NVML's Xid critical-error events on every card that
    supports them and drains them, without waiting, on each `cards()` call: `xid_last` is the last Xid seen
    since the backend started (0 for none; None on a card that cannot deliver Xid events). Without it,
    `xid_last` is None on every card."""

    def __init__(self, *, sample_hold_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 xid_events: bool = False) -> None:
        _nvml("nvmlInit", pynvml.nvmlInit)
        self._open = True
        self._hold_s = sample_hold_s
        self._clock = clock
        self._last_timestamp: dict[int, int] = {}
        self._samples: dict[int, dict[int, tuple[float, float]]] = {}
        """card -> pid -> (SM %, when it was read)."""
        self._event_set: Any = None
        self._xid: dict[int, int] = {}
        """card -> last Xid (0: none yet), for the cards registered for Xid events."""
        if xid_events:
            try:
                self._watch_xids()
            except GpuBackendError:
                self.close()
                raise

    def cards(self) -> list[CardReading]:
        if self._event_set is not None:
            self._drain_xids()
        count = int(_nvml("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))
        return [self._card(index) for index in range(count)]

    def close(self) -> None:
        if self._open:
            self._open = False
            if self._event_set is not None:
                event_set, self._event_set = self._event_set, None
                try:
                    pynvml.nvmlEventSetFree(event_set)
                except pynvml.NVMLError as exc:
                    log.warning("nvmlEventSetFree: %s", exc)
            _nvml("nvmlShutdown", pynvml.nvmlShutdown)

    def _watch_xids(self) -> None:
        self._event_set = _nvml("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        count = int(_nvml("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))
        for index in range(count):
            handle = _nvml("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._event_set)
            except pynvml.NVMLError_NotSupported:
                log.info("card %d: Xid events not supported; its last Xid is not reported", index)
                continue
            except pynvml.NVMLError as exc:
                raise GpuBackendError(f"nvmlDeviceRegisterEvents: {exc}") from exc
            self._xid[index] = 0

    def _drain_xids(self) -> None:
        for _ in range(_MAX_EVENTS_PER_READ):
            try:
                event = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as exc:
                raise GpuBackendError(f"nvmlEventSetWait_v2: {exc}") from exc
            if int(event.eventType) & pynvml.nvmlEventTypeXidCriticalError:
                index = int(_nvml("nvmlDeviceGetIndex", pynvml.nvmlDeviceGetIndex, event.device))
                self._xid[index] = int(event.eventData)
                log.warning("card %d: Xid %d", index, int(event.eventData))

    def _card(self, index: int) -> CardReading:
        handle = _nvml("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
        memory = _nvml("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle)
        rates = _nvml_optional("nvmlDeviceGetUtilizationRates", pynvml.nvmlDeviceGetUtilizationRates, handle)
        encoder = _nvml_optional("nvmlDeviceGetEncoderUtilization", pynvml.nvmlDeviceGetEncoderUtilization, handle)
        decoder = _nvml_optional("nvmlDeviceGetDecoderUtilization", pynvml.nvmlDeviceGetDecoderUtilization, handle)
        running = _nvml("nvmlDeviceGetComputeRunningProcesses", pynvml.nvmlDeviceGetComputeRunningProcesses, handle)
        pci = _nvml_optional("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
        temperature = _nvml_optional("nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperature, handle,
                                     pynvml.NVML_TEMPERATURE_GPU)
        power_mw = _nvml_optional("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle)
        sm = self._sm_util(index, handle)
        processes = tuple(
            GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory), sm.get(int(p.pid)))
            for p in running
        )
        return CardReading(
            index=index,
            uuid=str(_nvml("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle)),
            name=str(_nvml("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle)),
            total_bytes=int(memory.total),
            used_bytes=int(memory.used),
            free_bytes=int(memory.free),
            util_pct=None if rates is None else float(rates.gpu),
            enc_util_pct=None if encoder is None else float(encoder[0]),
            dec_util_pct=None if decoder is None else float(decoder[0]),
            processes=processes,
            pci_bus_id=None if pci is None else _text(pci.busId),
            temperature_c=None if temperature is None else float(temperature),
            power_w=None if power_mw is None else float(power_mw) / 1000.0,
            xid_last=self._xid.get(index),
        )

    def _sm_util(self, index: int, handle: object) -> dict[int, float]:
        """SM % per PID: the newest sample since the last call, else one read within the hold."""
        since = self._last_timestamp.get(index, 0)
        try:
            samples: Sequence[Any] = pynvml.nvmlDeviceGetProcessUtilization(handle, since)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_NotSupported):
            samples = []
        except pynvml.NVMLError as exc:
            # pynvml raises NVMLError(NVML_SUCCESS) when the driver answers with no samples at all.
            if exc.value != pynvml.NVML_SUCCESS:
                raise GpuBackendError(f"nvmlDeviceGetProcessUtilization: {exc}") from exc
            samples = []
        now = self._clock()
        held = self._samples.setdefault(index, {})
        newest: dict[int, tuple[int, float]] = {}
        for sample in samples:
            pid, stamp = int(sample.pid), int(sample.timeStamp)
            if pid not in newest or stamp > newest[pid][0]:
                newest[pid] = (stamp, float(sample.smUtil))
        for pid, (stamp, util) in newest.items():
            held[pid] = (util, now)
            self._last_timestamp[index] = max(self._last_timestamp.get(index, 0), stamp)
        for pid in [p for p, (_, seen) in held.items() if now - seen > self._hold_s]:
            del held[pid]
        return {pid: util for pid, (util, _) in held.items()}

    # -- identity, topology and MIG (DeviceBackend) ---------------------------------------------------------

    def describe(self) -> list[CardInfo]:
        count = int(_nvml("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount))
        handles = [_nvml("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
        infos = []
        for index, handle in enumerate(handles):
            memory = _nvml("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle)
            pci = _nvml_absent("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
            bus = None if pci is None else _text(pci.busId)
            numa = _nvml_absent("nvmlDeviceGetNumaNodeId", pynvml.nvmlDeviceGetNumaNodeId, handle)
            if numa is None and bus is not None:
                numa = _sysfs_numa(bus)
            minor = _nvml_absent("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, handle)
            mig = _nvml_absent("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
            infos.append(CardInfo(
                index=index, uuid=str(_nvml("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle)),
                name=str(_nvml("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle)),
                total_bytes=int(memory.total), minor=None if minor is None else int(minor),
                numa=None if numa is None or int(numa) < 0 else int(numa), pci_bus_id=bus,
                mig_enabled=None if mig is None else bool(mig[0])))
        peers = self._nvlink_peers(handles, [i.pci_bus_id for i in infos])
        return [CardInfo(i.index, i.uuid, i.name, i.total_bytes, i.minor, i.numa, i.pci_bus_id, peers[i.index],
                         i.mig_enabled) for i in infos]

    @staticmethod
    def _nvlink_peers(handles: Sequence[Any], buses: Sequence[str | None]) -> list[tuple[int, ...]]:
        """Per card, the cards it reaches over NVLink: a link whose far end is another card joins the two; links
        whose far end is no card (an NVSwitch) join all cards that have such links."""
        by_bus = {bus.lower(): i for i, bus in enumerate(buses) if bus}
        direct: list[set[int]] = [set() for _ in handles]
        switched: set[int] = set()
        for index, handle in enumerate(handles):
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        continue
                    remote = _text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId).lower()
                except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument,
                        pynvml.NVMLError_FunctionNotFound):
                    break
                except pynvml.NVMLError as exc:
                    raise GpuBackendError(f"nvmlDeviceGetNvLinkState: {exc}") from exc
                peer = by_bus.get(remote)
                if peer is None:
                    switched.add(index)
                elif peer != index:
                    direct[index].add(peer)
                    direct[peer].add(index)
        return [tuple(sorted((direct[i] | (switched if i in switched else set())) - {i})) for i in range(len(handles))]

    def driver_version(self) -> str:
        return _text(_nvml("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))

    def set_mig_mode(self, card: int, enabled: bool) -> bool:
        handle = self._handle(card)
        wanted = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        _nvml("nvmlDeviceSetMigMode", pynvml.nvmlDeviceSetMigMode, handle, wanted)
        current, _pending = _nvml("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
        return bool(int(current) == wanted)

    def mig_instances(self, card: int) -> list[MigInstance]:
        handle = self._handle(card)
        mode = _nvml_absent("nvmlDeviceGetMigMode", pynvml.nvmlDeviceGetMigMode, handle)
        if mode is None or not int(mode[0]):
            return []
        devices = self._mig_devices(handle)
        found: dict[int, MigInstance] = {}
        for _, info in self._gi_profiles(handle):
            if int(info.instanceCount) <= 0:
                continue
            array = (pynvml.c_nvmlGpuInstance_t * int(info.instanceCount))()
            count = ctypes.c_uint(int(info.instanceCount))
            _nvml("nvmlDeviceGetGpuInstances", pynvml.nvmlDeviceGetGpuInstances, handle, int(info.id), array,
                  ctypes.byref(count))
            for gpu_instance in array[:count.value]:
                gi = _nvml("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gpu_instance)
                ci, uuid = devices.get(int(gi.id), (None, None))
                found[int(gi.id)] = MigInstance(card, int(gi.profileId), int(gi.placement.start),
                                                int(gi.placement.size), int(gi.id), ci, uuid)
        return sorted(found.values(), key=lambda m: (m.start, m.gpu_instance_id))

    def create_mig_instance(self, card: int, profile_id: int, start: int) -> MigInstance:
        handle = self._handle(card)
        info = next((info for _, info in self._gi_profiles(handle) if int(info.id) == profile_id), None)
        if info is None:
            raise GpuBackendError(f"card {card}: no MIG GPU-instance profile with ID {profile_id}")
        size = self._placement_size(handle, profile_id, start)
        if size is None:
            raise GpuBackendError(f"card {card}: profile {profile_id} cannot start at memory slice {start}")
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, size)
        gpu_instance = _nvml("nvmlDeviceCreateGpuInstanceWithPlacement",
                             pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, handle, profile_id,
                             ctypes.byref(placement))
        gi = _nvml("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gpu_instance)
        try:
            ci_index = _CI_PROFILE_BY_SLICES[int(info.sliceCount)]
            ci_info = _nvml("nvmlGpuInstanceGetComputeInstanceProfileInfo",
                            pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gpu_instance, ci_index,
                            pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            _nvml("nvmlGpuInstanceCreateComputeInstance", pynvml.nvmlGpuInstanceCreateComputeInstance, gpu_instance,
                  int(ci_info.id))
        except (GpuBackendError, KeyError) as exc:
            try:
                _nvml("nvmlGpuInstanceDestroy", pynvml.nvmlGpuInstanceDestroy, gpu_instance)
            except GpuBackendError as undo:
                log.warning("card %d: GPU instance %d left without a compute instance: %s", card, int(gi.id), undo)
            raise GpuBackendError(f"card {card}: compute instance for GPU instance {int(gi.id)}: {exc}") from exc
        ci, uuid = self._mig_devices(handle).get(int(gi.id), (None, None))
        return MigInstance(card, profile_id, int(gi.placement.start), int(gi.placement.size), int(gi.id), ci, uuid)

    def destroy_mig_instance(self, card: int, gpu_instance_id: int) -> None:
        handle = self._handle(card)
        gpu_instance = _nvml("nvmlDeviceGetGpuInstanceById", pynvml.nvmlDeviceGetGpuInstanceById, handle,
                             gpu_instance_id)
        for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            ci_info = _nvml_absent("nvmlGpuInstanceGetComputeInstanceProfileInfo",
                                   pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gpu_instance, index,
                                   pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            if ci_info is None or int(ci_info.instanceCount) <= 0:
                continue
            array = (pynvml.c_nvmlComputeInstance_t * int(ci_info.instanceCount))()
            count = ctypes.c_uint(int(ci_info.instanceCount))
            _nvml("nvmlGpuInstanceGetComputeInstances", pynvml.nvmlGpuInstanceGetComputeInstances, gpu_instance,
                  int(ci_info.id), array, ctypes.byref(count))
            for compute_instance in array[:count.value]:
                _nvml("nvmlComputeInstanceDestroy", pynvml.nvmlComputeInstanceDestroy, compute_instance)
        _nvml("nvmlGpuInstanceDestroy", pynvml.nvmlGpuInstanceDestroy, gpu_instance)

    def _handle(self, card: int) -> Any:
        return _nvml("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, card)

    @staticmethod
    def _gi_profiles(handle: Any) -> list[tuple[int, Any]]:
        """(index constant, profile info) for every GPU-instance profile the card has."""
        found = []
        seen: set[int] = set()
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = _nvml_absent("nvmlDeviceGetGpuInstanceProfileInfo", pynvml.nvmlDeviceGetGpuInstanceProfileInfo,
                                handle, index)
            if info is not None and int(info.id) not in seen:
                seen.add(int(info.id))
                found.append((index, info))
        return found

    @staticmethod
    def _placement_size(handle: Any, profile_id: int, start: int) -> int | None:
        """The placement's size for a legal start (as the driver lists it), else None."""
        array = (pynvml.c_nvmlGpuInstancePlacement_t * _MAX_PLACEMENTS)()
        count = ctypes.c_uint(_MAX_PLACEMENTS)
        _nvml("nvmlDeviceGetGpuInstancePossiblePlacements", pynvml.nvmlDeviceGetGpuInstancePossiblePlacements,
              handle, profile_id, array, ctypes.byref(count))
        return next((int(p.size) for p in array[:count.value] if int(p.start) == start), None)

    @staticmethod
    def _mig_devices(handle: Any) -> dict[int, tuple[int, str]]:
        """GPU instance ID -> (compute instance ID, MIG device UUID), for the instances that have a MIG device."""
        found: dict[int, tuple[int, str]] = {}
        for i in range(int(_nvml("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle))):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except pynvml.NVMLError_NotFound:
                continue
            except pynvml.NVMLError as exc:
                raise GpuBackendError(f"nvmlDeviceGetMigDeviceHandleByIndex: {exc}") from exc
            gi = int(_nvml("nvmlDeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, mig))
            ci = int(_nvml("nvmlDeviceGetComputeInstanceId", pynvml.nvmlDeviceGetComputeInstanceId, mig))
            found[gi] = (ci, str(_nvml("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, mig)))
        return found


def _text(value: str | bytes) -> str:
    """pynvml hands out C strings as str or bytes depending on the field and the version."""
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class _FakeCard:
    total_bytes: int
    used_bytes: int | None = None
    processes: dict[int, GpuProcess] = field(default_factory=dict)
    xid_last: int | None = None
    mig_enabled: bool | None = None
    instances: dict[int, MigInstance] = field(default_factory=dict)
    """GPU instance ID -> instance."""
    next_gi: int = 1


class FakeGpuBackend:
    """Cards whose readings a test sets. Memory used is the sum of the processes' memory unless
    `set_memory` fixed it. Safe to drive from one thread while another reads.

    Card `i` is `GPU-fake-<i>` (a `uuid_prefix` changes the `fake` part), named `name`. With `mig_model`
    (a catalog `CardModel` with MIG profiles) the cards take MIG instances, starting with MIG mode off (or on,
    with `mig_enabled`); creating one refuses what the driver refuses (`gpuplane.model.mig.mig_layout_problems`
    of the instances present and the new one): Invalid Argument for a profile or start the card never takes,
    Insufficient Resources for one that does not fit next to the others. `numa` gives each card's NUMA
    node, `nvlink_groups` the cards joined by NVLink, `driver_version` what NVML's system call returns."""

    def __init__(self, cards: int = 1, total_bytes: int | Sequence[int] = 80 * GIB, *, name: str = "Fake GPU",
                 uuid_prefix: str = "fake", numa: Sequence[int] | None = None,
                 nvlink_groups: Sequence[Sequence[int]] = (), mig_model: CardModel | None = None,
                 mig_enabled: bool = False, driver_version: str = "550.54.15") -> None:
        totals = [total_bytes] * cards if isinstance(total_bytes, int) else list(total_bytes)
        if len(totals) != cards:
            raise ValueError(f"total_bytes: {len(totals)} values for {cards} cards")
        if numa is not None and len(numa) != cards:
            raise ValueError(f"numa: {len(numa)} values for {cards} cards")
        if mig_model is not None and not mig_model.mig_capable:
            raise ValueError(f"mig_model: {mig_model.name} has no MIG profiles")
        mig = None if mig_model is None else mig_enabled
        self._cards = [_FakeCard(total, mig_enabled=mig) for total in totals]
        self._name = name
        self._prefix = uuid_prefix
        self._numa = list(numa) if numa is not None else None
        self._peers: list[set[int]] = [set() for _ in range(cards)]
        for group in nvlink_groups:
            for card in group:
                self._peers[card] |= set(group) - {card}
        self._mig_model = mig_model
        self._driver_version = driver_version
        self._lock = threading.Lock()
        self._failures = 0
        self.reads = 0
        """How many readings `cards()` has returned or failed."""

    def uuid(self, card: int) -> str:
        return f"GPU-{self._prefix}-{card}"

    def set_memory(self, card: int, used_bytes: int | None) -> None:
        """Fix the card's used memory; None goes back to the sum of its processes."""
        with self._lock:
            self._cards[card].used_bytes = used_bytes

    def set_process(self, card: int, pid: int, used_bytes: int | None = 0, sm_util_pct: float | None = 0.0) -> None:
        with self._lock:
            self._cards[card].processes[pid] = GpuProcess(pid, used_bytes, sm_util_pct)

    def remove_process(self, card: int, pid: int) -> None:
        with self._lock:
            self._cards[card].processes.pop(pid, None)

    def set_xid(self, card: int, xid: int | None) -> None:
        """The card's last Xid, as `NvmlBackend` with Xid events reports it (0: none; None: not watched)."""
        with self._lock:
            self._cards[card].xid_last = xid

    def fail_next(self, n: int) -> None:
        """Make the next `n` calls of `cards()` raise `GpuBackendError`."""
        with self._lock:
            self._failures = n

    def cards(self) -> list[CardReading]:
        with self._lock:
            self.reads += 1
            if self._failures > 0:
                self._failures -= 1
                raise GpuBackendError("fake: injected failure")
            return [self._reading(i, card) for i, card in enumerate(self._cards)]

    def close(self) -> None:
        """Nothing to release."""

    def describe(self) -> list[CardInfo]:
        with self._lock:
            return [CardInfo(i, self.uuid(i), self._name, card.total_bytes, minor=i,
                             numa=None if self._numa is None else self._numa[i],
                             nvlink_peers=tuple(sorted(self._peers[i])), mig_enabled=card.mig_enabled)
                    for i, card in enumerate(self._cards)]

    def driver_version(self) -> str:
        return self._driver_version

    def set_mig_mode(self, card: int, enabled: bool) -> bool:
        with self._lock:
            state = self._card(card)
            if state.mig_enabled is None:
                raise GpuBackendError(f"nvmlDeviceSetMigMode: card {card}: Not Supported")
            if not enabled and state.instances:
                raise GpuBackendError(f"nvmlDeviceSetMigMode: card {card}: In use by another client "
                                      f"({len(state.instances)} GPU instances)")
            state.mig_enabled = enabled
            return True

    def mig_instances(self, card: int) -> list[MigInstance]:
        with self._lock:
            state = self._card(card)
            return sorted(state.instances.values(), key=lambda m: (m.start, m.gpu_instance_id))

    def create_mig_instance(self, card: int, profile_id: int, start: int) -> MigInstance:
        call = "nvmlDeviceCreateGpuInstanceWithPlacement"
        with self._lock:
            state = self._card(card)
            model = self._mig_model
            if model is None or not state.mig_enabled:
                raise GpuBackendError(f"{call}: card {card}: MIG mode is not enabled (Invalid State)")
            alone = mig_layout_problems(model, [(profile_id, start)])
            if alone:
                raise GpuBackendError(f"{call}: card {card}: {'; '.join(alone)} (Invalid Argument)")
            layout = [(m.profile_id, m.start) for m in state.instances.values()] + [(profile_id, start)]
            clashes = mig_layout_problems(model, layout)
            if clashes:
                raise GpuBackendError(f"{call}: card {card}: {'; '.join(clashes)} (Insufficient Resources)")
            profile = model.mig_profiles[profile_id]
            gi = state.next_gi
            state.next_gi += 1
            instance = MigInstance(card, profile_id, start, profile.memory_slices, gi, 0,
                                   f"MIG-{self._prefix}-{card}-{gi}")
            state.instances[gi] = instance
            return instance

    def destroy_mig_instance(self, card: int, gpu_instance_id: int) -> None:
        with self._lock:
            state = self._card(card)
            if state.instances.pop(gpu_instance_id, None) is None:
                raise GpuBackendError(f"nvmlDeviceGetGpuInstanceById: card {card}: no GPU instance "
                                      f"{gpu_instance_id} (Not Found)")

    def _card(self, card: int) -> _FakeCard:
        if not 0 <= card < len(self._cards):
            raise GpuBackendError(f"nvmlDeviceGetHandleByIndex: card {card}: Invalid Argument")
        return self._cards[card]

    def _reading(self, index: int, card: _FakeCard) -> CardReading:
        processes = tuple(card.processes.values())
        used = card.used_bytes
        if used is None:
            used = sum(p.used_bytes or 0 for p in processes)
        utils = [p.sm_util_pct for p in processes if p.sm_util_pct is not None]
        return CardReading(
            index=index,
            uuid=self.uuid(index),
            name=self._name,
            total_bytes=card.total_bytes,
            used_bytes=used,
            free_bytes=max(0, card.total_bytes - used),
            util_pct=min(100.0, sum(utils)),
            enc_util_pct=None,
            dec_util_pct=None,
            processes=processes,
            xid_last=card.xid_last,
        )
