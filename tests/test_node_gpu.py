"""The GPU backends: the fake that tests drive, and the NVML one against a monkeypatched pynvml."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpuplane.model import GpuplaneError
from gpuplane.node.gpu import GIB, CardReading, FakeGpuBackend, GpuBackendError, GpuProcess, NvmlBackend

# -- the fake -------------------------------------------------------------------------------------------


def test_fake_memory_is_the_sum_of_its_processes_unless_set() -> None:
    backend = FakeGpuBackend(cards=2, total_bytes=[80 * GIB, 40 * GIB])
    backend.set_process(0, 100, 3 * GIB, 50.0)
    backend.set_process(0, 101, None, 20.0)
    backend.set_process(1, 200, 1 * GIB, None)
    card0, card1 = backend.cards()
    # card 0: 3 GiB + unknown (counted 0) = 3 GiB used, 80 - 3 = 77 GiB free; utilisation 50 + 20 = 70 %
    assert (card0.used_bytes, card0.free_bytes, card0.util_pct) == (3 * GIB, 77 * GIB, 70.0)
    assert card0.processes == (GpuProcess(100, 3 * GIB, 50.0), GpuProcess(101, None, 20.0))
    assert (card1.total_bytes, card1.free_bytes) == (40 * GIB, 39 * GIB)

    backend.set_memory(0, 79 * GIB)
    backend.remove_process(0, 101)
    backend.remove_process(0, 999)  # absent: nothing happens
    card0 = backend.cards()[0]
    assert (card0.used_bytes, card0.free_bytes) == (79 * GIB, 1 * GIB)
    backend.set_memory(0, None)
    assert backend.cards()[0].used_bytes == 3 * GIB


def test_fake_defaults_to_one_80_gib_card() -> None:
    (card,) = FakeGpuBackend().cards()
    assert card == CardReading(0, "GPU-fake-0", "Fake GPU", 80 * GIB, 0, 80 * GIB, 0.0, None, None, ())


def test_fake_fails_the_next_n_readings() -> None:
    backend = FakeGpuBackend()
    backend.fail_next(2)
    for _ in range(2):
        with pytest.raises(GpuBackendError, match="injected"):
            backend.cards()
    assert len(backend.cards()) == 1
    assert backend.reads == 3


def test_fake_rejects_totals_that_do_not_match_the_cards() -> None:
    with pytest.raises(ValueError, match="total_bytes"):
        FakeGpuBackend(cards=2, total_bytes=[GIB])


def test_fake_readings_stay_consistent_while_another_thread_writes() -> None:
    backend = FakeGpuBackend()
    done = threading.Event()

    def churn() -> None:
        pid = 1
        while not done.is_set():
            backend.set_process(0, pid, GIB)
            backend.remove_process(0, pid - 1)
            pid += 1

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _ in range(2000):
            card = backend.cards()[0]
            assert card.used_bytes == sum(p.used_bytes or 0 for p in card.processes)
    finally:
        done.set()
        writer.join()


# -- NVML, with pynvml's functions replaced ---------------------------------------------------------------


@dataclass
class FakeNvml:
    """One card as NVML would show it; `errors` maps a pynvml function name to the error it raises."""

    samples: list[SimpleNamespace] = field(default_factory=list)
    errors: dict[str, pynvml.NVMLError] = field(default_factory=dict)
    timestamps_asked: list[int] = field(default_factory=list)
    shutdowns: int = 0
    events: list[SimpleNamespace] = field(default_factory=list)
    """Xid events waiting in the (one) event set, oldest first."""
    registered: list[str] = field(default_factory=list)
    event_sets_freed: int = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def fn(name: str, result: Callable[..., Any]) -> None:
            def call(*args: Any) -> Any:
                if name in self.errors:
                    raise self.errors[name]
                return result(*args)

            monkeypatch.setattr(pynvml, name, call)

        fn("nvmlInit", lambda: None)
        fn("nvmlShutdown", self._shutdown)
        fn("nvmlDeviceGetCount", lambda: 1)
        fn("nvmlDeviceGetHandleByIndex", lambda index: f"handle-{index}")
        fn("nvmlDeviceGetUUID", lambda h: "GPU-5a1b")
        fn("nvmlDeviceGetName", lambda h: "NVIDIA H100 80GB HBM3")
        fn("nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=80 * GIB, used=30 * GIB, free=50 * GIB))
        fn("nvmlDeviceGetUtilizationRates", lambda h: SimpleNamespace(gpu=64, memory=20))
        fn("nvmlDeviceGetEncoderUtilization", lambda h: [7, 167000])
        fn("nvmlDeviceGetDecoderUtilization", lambda h: [3, 167000])
        fn("nvmlDeviceGetComputeRunningProcesses", lambda h: [
            SimpleNamespace(pid=4242, usedGpuMemory=20 * GIB, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF),
            SimpleNamespace(pid=4343, usedGpuMemory=None, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF),
        ])
        fn("nvmlDeviceGetProcessUtilization", self._utilisation)
        fn("nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId="00000000:3B:00.0", busIdLegacy="0000:3B:00.0"))
        fn("nvmlDeviceGetTemperature", lambda h, sensor: 41 if sensor == pynvml.NVML_TEMPERATURE_GPU else -1)
        fn("nvmlDeviceGetPowerUsage", lambda h: 312_456)  # milliwatts
        fn("nvmlEventSetCreate", lambda: "event-set")
        fn("nvmlDeviceRegisterEvents", lambda h, types, event_set: self.registered.append(h))
        fn("nvmlEventSetWait_v2", self._wait)
        fn("nvmlEventSetFree", self._free)
        fn("nvmlDeviceGetIndex", lambda h: int(h.removeprefix("handle-")))
        fn("nvmlSystemGetDriverVersion", lambda: "550.54.15")

    def _shutdown(self) -> None:
        self.shutdowns += 1

    def _wait(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the backend must never block on events"
        if not self.events:
            raise pynvml.NVMLError_Timeout()
        return self.events.pop(0)

    def _free(self, event_set: str) -> None:
        self.event_sets_freed += 1

    def _utilisation(self, handle: str, since: int) -> list[SimpleNamespace]:
        self.timestamps_asked.append(since)
        return [s for s in self.samples if s.timeStamp > since]


def xid(card: int, value: int, event_type: int = pynvml.nvmlEventTypeXidCriticalError) -> SimpleNamespace:
    return SimpleNamespace(device=f"handle-{card}", eventType=event_type, eventData=value, gpuInstanceId=0xFFFFFFFF,
                           computeInstanceId=0xFFFFFFFF)


def sample(pid: int, stamp: int, sm: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, timeStamp=stamp, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)


@dataclass
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


def test_nvml_reading_maps_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(samples=[sample(4242, 1000, 40), sample(4242, 2000, 85), sample(4343, 1500, 10)])
    nvml.install(monkeypatch)
    (card,) = NvmlBackend().cards()
    assert card == CardReading(
        index=0, uuid="GPU-5a1b", name="NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, used_bytes=30 * GIB,
        free_bytes=50 * GIB, util_pct=64.0, enc_util_pct=7.0, dec_util_pct=3.0,
        # 4242: the newer of its two samples (t=2000: 85 %); 4343: memory not reported
        processes=(GpuProcess(4242, 20 * GIB, 85.0), GpuProcess(4343, None, 10.0)),
        # 312 456 mW -> 312.456 W; Xids are not watched unless asked for
        pci_bus_id="00000000:3B:00.0", temperature_c=41.0, power_w=312.456, gr_engine_active=None, xid_last=None,
    )


def test_nvml_driver_version_is_the_system_call_and_a_failure_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml().install(monkeypatch)
    assert NvmlBackend().driver_version() == "550.54.15"
    FakeNvml(errors={"nvmlSystemGetDriverVersion": pynvml.NVMLError_Uninitialized()}).install(monkeypatch)
    with pytest.raises(GpuBackendError, match="nvmlSystemGetDriverVersion"):
        NvmlBackend().driver_version()


def test_nvml_not_supported_reads_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(errors={name: pynvml.NVMLError_NotSupported() for name in (
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
        "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetPciInfo", "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage")})
    nvml.install(monkeypatch)
    (card,) = NvmlBackend().cards()
    assert (card.util_pct, card.enc_util_pct, card.dec_util_pct) == (None, None, None)
    assert (card.pci_bus_id, card.temperature_c, card.power_w) == (None, None, None)
    assert [p.sm_util_pct for p in card.processes] == [None, None]


@pytest.mark.parametrize("error", [pynvml.NVMLError_NotFound(), pynvml.NVMLError(pynvml.NVML_SUCCESS)],
                         ids=["not-found", "success-without-samples"])
def test_nvml_no_process_samples_reads_as_none(monkeypatch: pytest.MonkeyPatch, error: pynvml.NVMLError) -> None:
    FakeNvml(errors={"nvmlDeviceGetProcessUtilization": error}).install(monkeypatch)
    assert [p.sm_util_pct for p in NvmlBackend().cards()[0].processes] == [None, None]


def test_nvml_asks_for_samples_since_the_newest_and_holds_them_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(samples=[sample(4242, 1000, 90)])
    nvml.install(monkeypatch)
    clock = Clock()
    backend = NvmlBackend(sample_hold_s=1.0, clock=clock)

    def sm() -> list[float | None]:
        return [p.sm_util_pct for p in backend.cards()[0].processes]

    assert sm() == [90.0, None]
    clock.t = 1.0  # no sample newer than t=1000 µs; the one read at 0 s is 1.0 s old: still held
    assert sm() == [90.0, None]
    clock.t = 1.5  # 1.5 s old: dropped
    assert sm() == [None, None]
    nvml.samples.append(sample(4343, 3000, 55))
    assert sm() == [None, 55.0]
    assert nvml.timestamps_asked == [0, 1000, 1000, 1000]


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ("nvmlDeviceGetCount", pynvml.NVMLError_Uninitialized()),
        ("nvmlDeviceGetHandleByIndex", pynvml.NVMLError_GpuIsLost()),
        ("nvmlDeviceGetMemoryInfo", pynvml.NVMLError_GpuIsLost()),
        ("nvmlDeviceGetUtilizationRates", pynvml.NVMLError_Unknown()),
        ("nvmlDeviceGetComputeRunningProcesses", pynvml.NVMLError_NoPermission()),
        ("nvmlDeviceGetProcessUtilization", pynvml.NVMLError_Timeout()),
        ("nvmlDeviceGetUUID", pynvml.NVMLError_GpuIsLost()),
        ("nvmlDeviceGetPciInfo", pynvml.NVMLError_GpuIsLost()),
        ("nvmlDeviceGetTemperature", pynvml.NVMLError_Unknown()),
        ("nvmlDeviceGetPowerUsage", pynvml.NVMLError_GpuIsLost()),
    ],
)
def test_nvml_errors_become_backend_errors_naming_the_call(monkeypatch: pytest.MonkeyPatch, function: str,
                                                           error: pynvml.NVMLError) -> None:
    FakeNvml(errors={function: error}).install(monkeypatch)
    backend = NvmlBackend()
    with pytest.raises(GpuBackendError, match=f"^{function}: ") as caught:
        backend.cards()
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)


def test_nvml_busid_as_bytes_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml().install(monkeypatch)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda h: SimpleNamespace(busId=b"00000000:C1:00.0"))
    assert NvmlBackend().cards()[0].pci_bus_id == "00000000:C1:00.0"


def test_nvml_xid_events_give_the_last_xid_without_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    backend = NvmlBackend(xid_events=True)
    assert nvml.registered == ["handle-0"]
    assert backend.cards()[0].xid_last == 0  # watched, nothing seen yet
    nvml.events += [xid(0, 79), xid(0, 13)]
    assert backend.cards()[0].xid_last == 13  # both drained in one reading; the last one wins
    nvml.events.append(xid(0, 999, event_type=pynvml.nvmlEventTypeSingleBitEccError))  # not an Xid: ignored
    assert backend.cards()[0].xid_last == 13
    assert nvml.events == []
    backend.close()
    backend.close()
    assert (nvml.event_sets_freed, nvml.shutdowns) == (1, 1)


def test_nvml_xid_events_not_supported_read_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(errors={"nvmlDeviceRegisterEvents": pynvml.NVMLError_NotSupported()}).install(monkeypatch)
    assert NvmlBackend(xid_events=True).cards()[0].xid_last is None


@pytest.mark.parametrize("function", ["nvmlEventSetCreate", "nvmlDeviceRegisterEvents"])
def test_nvml_xid_setup_failure_fails_the_backend_and_shuts_nvml_down(monkeypatch: pytest.MonkeyPatch,
                                                                       function: str) -> None:
    nvml = FakeNvml(errors={function: pynvml.NVMLError_NoPermission()})
    nvml.install(monkeypatch)
    with pytest.raises(GpuBackendError, match=f"^{function}: "):
        NvmlBackend(xid_events=True)
    assert nvml.shutdowns == 1


def test_nvml_xid_wait_failure_is_a_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    backend = NvmlBackend(xid_events=True)
    nvml.errors["nvmlEventSetWait_v2"] = pynvml.NVMLError_GpuIsLost()
    with pytest.raises(GpuBackendError, match=r"^nvmlEventSetWait_v2: "):
        backend.cards()


def test_nvml_init_failure_is_a_gpuplane_error(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(errors={"nvmlInit": pynvml.NVMLError_LibraryNotFound()}).install(monkeypatch)
    with pytest.raises(GpuplaneError, match=r"^nvmlInit: .*Library Not Found"):
        NvmlBackend()


def test_nvml_close_shuts_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    backend = NvmlBackend()
    backend.close()
    backend.close()
    assert nvml.shutdowns == 1


# -- gpuplane node-read: what the node agent reads, printed ---------------------------------------------


def test_node_read_prints_what_nvml_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from gpuplane.cli.main import app

    nvml = FakeNvml(samples=[sample(4242, 1000, 40)])
    nvml.install(monkeypatch)
    result = CliRunner().invoke(app, ["node-read", "--json"])
    assert result.exit_code == 0, result.output
    (card,) = json.loads(result.output)["cards"]
    # 30 of 80 GiB used, 64 % busy; process 4242 holds 20 GiB at 40 % SM, 4343 does not report memory
    assert (card["uuid"], card["used_bytes"], card["total_bytes"], card["util_pct"]) == (
        "GPU-5a1b", 30 * GIB, 80 * GIB, 64.0)
    assert card["processes"] == [{"pid": 4242, "used_bytes": 20 * GIB, "sm_util_pct": 40.0},
                                 {"pid": 4343, "used_bytes": None, "sm_util_pct": None}]
    assert nvml.shutdowns == 1
    table = CliRunner().invoke(app, ["node-read"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "GPU-5a1b" in table.output and "30.0 / 80.0" in table.output


def test_node_read_without_nvml_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from gpuplane.cli.main import app

    FakeNvml(errors={"nvmlInit": pynvml.NVMLError_LibraryNotFound()}).install(monkeypatch)
    result = CliRunner().invoke(app, ["node-read"])
    assert result.exit_code == 2
    assert "nvmlInit" in result.output
