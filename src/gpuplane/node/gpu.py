"""What a node agent reads from its GPU cards: one consistent reading per card, behind a small interface.

`NvmlBackend` reads real cards through NVML (`pynvml`, package nvidia-ml-py); `FakeGpuBackend` holds
readings that tests and benchmarks drive. Every failure reaches callers as `GpuBackendError`, never as
an `NVMLError`, so an agent needs to survive one exception type only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pynvml

from gpuplane.controllers.colocation import GIB
from gpuplane.model import GpuplaneError

__all__ = ["GIB", "CardReading", "FakeGpuBackend", "GpuBackend", "GpuBackendError", "GpuProcess", "NvmlBackend"]

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


class GpuBackend(Protocol):
    def cards(self) -> list[CardReading]:
        """A reading of every card, in index order; raises `GpuBackendError` when any card cannot be read."""
        ...

    def close(self) -> None:
        """Release the backend; idempotent."""
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


def _text(value: str | bytes) -> str:
    """pynvml hands out C strings as str or bytes depending on the field and the version."""
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class _FakeCard:
    total_bytes: int
    used_bytes: int | None = None
    processes: dict[int, GpuProcess] = field(default_factory=dict)


class FakeGpuBackend:
    """Cards whose readings a test sets. Memory used is the sum of the processes' memory unless
    `set_memory` fixed it. Safe to drive from one thread while another reads."""

    def __init__(self, cards: int = 1, total_bytes: int | Sequence[int] = 80 * GIB) -> None:
        totals = [total_bytes] * cards if isinstance(total_bytes, int) else list(total_bytes)
        if len(totals) != cards:
            raise ValueError(f"total_bytes: {len(totals)} values for {cards} cards")
        self._cards = [_FakeCard(total) for total in totals]
        self._lock = threading.Lock()
        self._failures = 0
        self.reads = 0
        """How many readings `cards()` has returned or failed."""

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

    def _reading(self, index: int, card: _FakeCard) -> CardReading:
        processes = tuple(card.processes.values())
        used = card.used_bytes
        if used is None:
            used = sum(p.used_bytes or 0 for p in processes)
        utils = [p.sm_util_pct for p in processes if p.sm_util_pct is not None]
        return CardReading(
            index=index,
            uuid=f"GPU-fake-{index}",
            name="Fake GPU",
            total_bytes=card.total_bytes,
            used_bytes=used,
            free_bytes=max(0, card.total_bytes - used),
            util_pct=min(100.0, sum(utils)),
            enc_util_pct=None,
            dec_util_pct=None,
            processes=processes,
        )
