"""The node agent's metrics exporter: dcgm-exporter's names, units and labels, scraped over real HTTP."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pynvml
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.node.exporter import (
    DEFAULT_PORT,
    DcgmCollector,
    Exporter,
    PodMapError,
    PodRef,
    StaticPodMapper,
    default_hostname,
    load_pod_map,
)
from gpuplane.node.gpu import GIB, CardReading, FakeGpuBackend
from test_node_gpu import FakeNvml

SERVING = PodRef(pod="llm-7d9f-abcde", namespace="serving", container="server")
DCGM_METRICS = {
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_XID_ERRORS",
}


class ExtrasBackend(FakeGpuBackend):
    """A `FakeGpuBackend` whose readings also carry the fields it leaves at their defaults (temperature, power,
    Xid, ...), or override one (e.g. `util_pct=None`), per card."""

    def __init__(self, cards: int, total_bytes: int | list[int], extras: Mapping[int, Mapping[str, Any]]) -> None:
        super().__init__(cards, total_bytes)
        self.extras = {card: dict(fields) for card, fields in extras.items()}

    def cards(self) -> list[CardReading]:
        return [dataclasses.replace(card, **self.extras.get(card.index, {})) for card in super().cards()]


@dataclasses.dataclass
class DictMapper:
    """A mapping the test changes between scrapes (as a kubelet-backed mapper's would change)."""

    assigned: dict[int, PodRef]

    def pods(self) -> Mapping[int, PodRef]:
        return self.assigned


class FailingMapper:
    def pods(self) -> Mapping[int, PodRef]:
        raise RuntimeError("kubelet pod-resources socket gone")


@contextmanager
def serving(exporter: Exporter) -> Iterator[int]:
    server, _ = exporter.start(0, "127.0.0.1")
    try:
        yield server.server_port
    finally:
        exporter.stop()


def fetch(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        assert response.status == 200
        return str(response.read().decode())


def scrape(port: int) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(fetch(port))}


def by_gpu(families: Mapping[str, Metric], name: str) -> dict[str, tuple[dict[str, str], float]]:
    """gpu label -> (labels, value) of one DCGM metric; {} where the metric is absent."""
    family = families.get(name)
    return {} if family is None else {s.labels["gpu"]: (s.labels, s.value) for s in family.samples}


def counter(families: Mapping[str, Metric], name: str) -> float:
    (sample,) = families[name].samples
    assert sample.name == f"{name}_total"
    return sample.value


def dcgm(families: Mapping[str, Metric]) -> set[str]:
    return {name for name in families if name.startswith("DCGM_")}


def two_cards() -> ExtrasBackend:
    """Card 0: 80 GiB, two processes (3 GiB + 512 KiB, 40 % + 25 % SM), every optional field reported.
    Card 1: 40 GiB, 1 GiB fixed, the card's utilisation unknown but its engine activity reported, the other
    optional fields unknown, a past Xid 79."""
    backend = ExtrasBackend(2, [80 * GIB, 40 * GIB], {
        0: {"pci_bus_id": "00000000:3B:00.0", "temperature_c": 41.0, "power_w": 312.456, "xid_last": 0,
            "enc_util_pct": 7.0, "dec_util_pct": 3.0},
        1: {"util_pct": None, "gr_engine_active": 0.3, "xid_last": 79},
    })
    backend.set_process(0, 4242, 3 * GIB + 512 * 1024, 40.0)
    backend.set_process(0, 4343, None, 25.0)
    backend.set_memory(1, 1 * GIB)
    return backend


# -- names, units, omitted values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("DCGM_FI_DEV_GPU_UTIL", {"0": 65.0}),  # 40 % + 25 %; card 1 cannot tell: no sample, not 0
        # 3 GiB + 512 KiB = 3072.5 MiB, rounded down like DCGM; card 1: 1 GiB = 1024 MiB
        ("DCGM_FI_DEV_FB_USED", {"0": 3072.0, "1": 1024.0}),
        # 80 GiB - 3072.5 MiB = 81920 - 3072.5 = 78847.5 MiB -> 78847; 40 GiB - 1 GiB = 39 * 1024 = 39936 MiB
        ("DCGM_FI_DEV_FB_FREE", {"0": 78847.0, "1": 39936.0}),
        # card 0 reports no engine activity: derived as 65 % / 100; card 1 reports its own 0.3
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", {"0": 0.65, "1": 0.3}),
        ("DCGM_FI_DEV_ENC_UTIL", {"0": 7.0}),
        ("DCGM_FI_DEV_DEC_UTIL", {"0": 3.0}),
        ("DCGM_FI_DEV_GPU_TEMP", {"0": 41.0}),
        ("DCGM_FI_DEV_POWER_USAGE", {"0": 312.456}),  # W
        ("DCGM_FI_DEV_XID_ERRORS", {"0": 0.0, "1": 79.0}),  # the last Xid's value; 0: none seen
    ],
)
def test_a_scrape_exports_each_metric_in_dcgm_units(metric: str, expected: dict[str, float]) -> None:
    exporter = Exporter(two_cards(), hostname="node-a")
    with serving(exporter) as port:
        families = scrape(port)
    assert {gpu: value for gpu, (_, value) in by_gpu(families, metric).items()} == pytest.approx(expected)
    assert families[metric].type == "gauge"


def test_a_scrape_exports_exactly_the_dcgm_default_metrics_the_cards_can_report() -> None:
    exporter = Exporter(two_cards(), hostname="node-a")
    with serving(exporter) as port:
        text = fetch(port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert dcgm(families) == DCGM_METRICS  # FB_TOTAL is not in dcgm-exporter's defaults: not exported either
    assert "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB)." in text


def test_a_metric_no_card_can_report_is_left_out_entirely() -> None:
    # the plain fake reports no temperature, power, Xid or encoder/decoder use on any card
    exporter = Exporter(FakeGpuBackend(cards=2), hostname="node-a")
    with serving(exporter) as port:
        text = fetch(port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert dcgm(families) == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                              "DCGM_FI_PROF_GR_ENGINE_ACTIVE"}
    assert "DCGM_FI_DEV_GPU_TEMP" not in text  # not even a HELP line for an empty family


# -- labels ----------------------------------------------------------------------------------------------


def test_every_sample_carries_the_card_labels_and_pod_labels_only_on_an_assigned_card() -> None:
    exporter = Exporter(two_cards(), hostname="node-a", pods=StaticPodMapper({0: SERVING, 7: SERVING}))
    with serving(exporter) as port:
        text = fetch(port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    card0 = {"gpu": "0", "UUID": "GPU-fake-0", "pci_bus_id": "00000000:3B:00.0", "device": "nvidia0",
             "modelName": "Fake GPU", "Hostname": "node-a",
             "pod": "llm-7d9f-abcde", "namespace": "serving", "container": "server"}
    card1 = {"gpu": "1", "UUID": "GPU-fake-1", "pci_bus_id": "", "device": "nvidia1", "modelName": "Fake GPU",
             "Hostname": "node-a"}  # unknown bus id: empty; no pod: no pod labels at all, not empty ones
    for name in dcgm(families):
        for sample in families[name].samples:
            assert sample.labels == (card0 if sample.labels["gpu"] == "0" else card1), name
    # the raw exposition, as Prometheus reads it: card 1's lines name no pod label (card 7 has no card)
    card1_lines = [line for line in text.splitlines() if 'UUID="GPU-fake-1"' in line]
    assert card1_lines and not any("pod=" in line or "namespace=" in line for line in card1_lines)
    assert 'gpu="7"' not in text


def test_a_pod_mapping_change_shows_on_the_next_scrape() -> None:
    assigned: dict[int, PodRef] = {}
    exporter = Exporter(FakeGpuBackend(), hostname="node-a", pods=DictMapper(assigned))
    with serving(exporter) as port:
        (labels, _), = by_gpu(scrape(port), "DCGM_FI_DEV_GPU_UTIL").values()
        assert "pod" not in labels
        assigned[0] = SERVING
        (labels, _), = by_gpu(scrape(port), "DCGM_FI_DEV_GPU_UTIL").values()
        assert (labels["pod"], labels["namespace"], labels["container"]) == ("llm-7d9f-abcde", "serving", "server")


def test_the_hostname_defaults_to_node_name_then_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-17")
    assert default_hostname() == "gpu-node-17"
    assert Exporter(FakeGpuBackend()).collector.hostname == "gpu-node-17"
    monkeypatch.delenv("NODE_NAME")
    assert default_hostname() == socket.gethostname()


# -- every scrape reads the cards; failures ----------------------------------------------------------------


def test_each_scrape_is_one_fresh_reading_and_registering_reads_nothing() -> None:
    backend = FakeGpuBackend()
    exporter = Exporter(backend, hostname="node-a")
    assert backend.reads == 0
    with serving(exporter) as port:
        assert by_gpu(scrape(port), "DCGM_FI_DEV_FB_USED")["0"][1] == 0.0
        backend.set_process(0, 4242, 20 * GIB, 90.0)
        families = scrape(port)
        assert by_gpu(families, "DCGM_FI_DEV_FB_USED")["0"][1] == 20 * 1024  # 20 GiB = 20480 MiB
        assert by_gpu(families, "DCGM_FI_DEV_GPU_UTIL")["0"][1] == 90.0
    assert backend.reads == 2
    assert counter(families, "gpuplane_exporter_scrapes") == 2
    (read_s,) = families["gpuplane_exporter_read_seconds"].samples
    assert read_s.value >= 0


@pytest.mark.parametrize("failure", ["backend", "pod-mapper"])
def test_a_failed_scrape_serves_no_dcgm_samples_and_counts_the_error(failure: str) -> None:
    backend = FakeGpuBackend(cards=2)
    mapper = FailingMapper() if failure == "pod-mapper" else StaticPodMapper({0: SERVING})
    exporter = Exporter(backend, hostname="node-a", pods=mapper)
    with serving(exporter) as port:
        backend.fail_next(1)
        families = scrape(port)  # the HTTP answer is still 200: only the GPU series go (stale in Prometheus)
        assert dcgm(families) == set()
        assert (counter(families, "gpuplane_exporter_scrapes"), counter(families, "gpuplane_exporter_errors")) \
            == (1, 1)
        families = scrape(port)
        if failure == "backend":  # recovered
            assert dcgm(families) == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
                                      "DCGM_FI_PROF_GR_ENGINE_ACTIVE"}
            assert counter(families, "gpuplane_exporter_errors") == 1
        else:  # a mapper that keeps failing: still nothing, never half-labelled series
            assert dcgm(families) == set()
            assert counter(families, "gpuplane_exporter_errors") == 2
        assert counter(families, "gpuplane_exporter_scrapes") == 2


def test_the_collector_never_raises() -> None:
    backend = FakeGpuBackend()
    backend.fail_next(1)
    collector = DcgmCollector(backend, "node-a", FailingMapper())
    assert [m.name for m in collector.collect()] == ["gpuplane_exporter_scrapes", "gpuplane_exporter_errors"]
    assert [m.name for m in collector.collect()] == ["gpuplane_exporter_scrapes", "gpuplane_exporter_errors",
                                                     "gpuplane_exporter_read_seconds"]
    assert collector.errors == 2


def test_the_read_duration_is_timed_by_the_collector_clock() -> None:
    ticks = iter([10.0, 10.25])
    collector = DcgmCollector(FakeGpuBackend(), "node-a", None, clock=lambda: next(ticks))
    families = {m.name: m for m in collector.collect()}
    assert families["gpuplane_exporter_read_seconds"].samples[0].value == 0.25


# -- serving -------------------------------------------------------------------------------------------------


def test_stop_closes_the_port_and_the_exporter_can_serve_again() -> None:
    exporter = Exporter(FakeGpuBackend(), hostname="node-a")
    server, thread = exporter.start(0, "127.0.0.1")
    port = server.server_port
    assert "DCGM_FI_DEV_GPU_UTIL" in scrape(port)
    assert "DCGM_FI_DEV_GPU_UTIL" in fetch(port, "/")  # prometheus_client answers on every path
    with pytest.raises(RuntimeError, match="already serving"):
        exporter.start(0, "127.0.0.1")
    exporter.stop()
    exporter.stop()  # idempotent
    assert not thread.is_alive()
    with pytest.raises(urllib.error.URLError) as refused:
        fetch(port)
    assert isinstance(refused.value.reason, ConnectionRefusedError)
    with serving(exporter) as again:
        assert "DCGM_FI_DEV_GPU_UTIL" in scrape(again)


def test_the_default_port_is_dcgm_exporters() -> None:
    assert DEFAULT_PORT == 9400


# -- the pod mapping file ---------------------------------------------------------------------------------


def test_a_pod_mapping_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    path.write_text("cards:\n  0: {pod: llm-7d9f-abcde, namespace: serving, container: server}\n"
                    "  3: {pod: batch-1, namespace: jobs, container: train}\n")
    assert load_pod_map(path).pods() == {0: SERVING, 3: PodRef("batch-1", "jobs", "train")}
    assert StaticPodMapper.from_dict({}).pods() == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cards:\n  0: {pod: a, namespace: b}\n", r"pods\.yaml: cards\.0\.container: Field required"),
        ("cards:\n  -1: {pod: a, namespace: b, container: c}\n", r"pods\.yaml: cards\.-1\.\[key\]: .*greater"),
        ("cards:\n  0: {pod: '', namespace: b, container: c}\n", r"pods\.yaml: cards\.0\.pod: .*at least 1"),
        ("cards:\n  0: {pod: a, namespace: b, container: c, node: x}\n", r"pods\.yaml: cards\.0\.node: Extra"),
        ("pods: {}\n", r"pods\.yaml: pods: Extra"),
        ("cards: [\n", r"pods\.yaml: while parsing"),
    ],
    ids=["missing-field", "negative-card", "empty-name", "unknown-field", "unknown-top-level", "bad-yaml"],
)
def test_a_bad_pod_mapping_file_names_the_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "pods.yaml"
    path.write_text(text)
    with pytest.raises(PodMapError, match=message):
        load_pod_map(path)


def test_a_bad_pod_mapping_dict_names_its_source() -> None:
    with pytest.raises(PodMapError, match=r"^inline: cards\.0\.namespace: Field required"):
        StaticPodMapper.from_dict({"cards": {0: {"pod": "a", "container": "c"}}}, source="inline")


# -- gpuplane node-exporter ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_node_exporter_without_nvml_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(errors={"nvmlInit": pynvml.NVMLError_LibraryNotFound()}).install(monkeypatch)
    result = CliRunner().invoke(app, ["node-exporter", "--port", "0"])
    assert result.exit_code == 2
    assert "nvmlInit" in result.output


def test_node_exporter_with_a_bad_pod_file_exits_2_naming_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    path.write_text("cards:\n  0: {pod: a, namespace: b}\n")
    result = CliRunner().invoke(app, ["node-exporter", "--pods", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 2  # read before NVML: reported even on a node without a driver
    assert "pods.yaml: cards.0.container: Field required" in result.output


def test_node_exporter_on_a_taken_port_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["node-exporter", "--addr", "127.0.0.1", "--port", str(port)],
                                    env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert f"--port {port}:" in result.output
    assert nvml.shutdowns == 1


@pytest.fixture
def sigterm_guard() -> Iterator[list[int]]:
    """A SIGTERM that reaches the test process while the command is not running must not end pytest."""
    seen: list[int] = []

    def note(sig: int, frame: FrameType | None) -> None:
        seen.append(sig)

    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_node_exporter_serves_nvml_readings_until_sigterm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          sigterm_guard: list[int]) -> None:
    nvml = FakeNvml()
    nvml.install(monkeypatch)
    pods = tmp_path / "pods.yaml"
    pods.write_text("cards:\n  0: {pod: llm-7d9f-abcde, namespace: serving, container: server}\n")
    port = free_port()
    scraped: list[dict[str, Metric]] = []

    def scrape_then_terminate() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                scraped.append(scrape(port))
                break
            except OSError:
                time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    client = threading.Thread(target=scrape_then_terminate)
    client.start()
    result = CliRunner().invoke(app, ["node-exporter", "--addr", "127.0.0.1", "--port", str(port),
                                      "--hostname", "gpu-node-17", "--pods", str(pods)])
    client.join()
    assert result.exit_code == 0, result.output
    assert sigterm_guard == []  # the command's own handler took it ...
    os.kill(os.getpid(), signal.SIGTERM)
    assert sigterm_guard == [signal.SIGTERM]  # ... and put the previous one back
    (families,) = scraped
    # FakeNvml's card: 30 GiB used = 30720 MiB, 64 %, 41 °C, 312 456 mW = 312.456 W, Xids watched: 0
    values = {name: by_gpu(families, name)["0"][1] for name in dcgm(families)}
    assert values == pytest.approx({
        "DCGM_FI_DEV_GPU_UTIL": 64.0, "DCGM_FI_DEV_FB_USED": 30720.0, "DCGM_FI_DEV_FB_FREE": 51200.0,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.64, "DCGM_FI_DEV_ENC_UTIL": 7.0, "DCGM_FI_DEV_DEC_UTIL": 3.0,
        "DCGM_FI_DEV_GPU_TEMP": 41.0, "DCGM_FI_DEV_POWER_USAGE": 312.456, "DCGM_FI_DEV_XID_ERRORS": 0.0,
    })
    labels, _ = by_gpu(families, "DCGM_FI_DEV_GPU_UTIL")["0"]
    assert labels == {"gpu": "0", "UUID": "GPU-5a1b", "pci_bus_id": "00000000:3B:00.0", "device": "nvidia0",
                      "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-node-17",
                      "pod": "llm-7d9f-abcde", "namespace": "serving", "container": "server"}
    assert (nvml.registered, nvml.event_sets_freed, nvml.shutdowns) == (["handle-0"], 1, 1)
    with pytest.raises(urllib.error.URLError):
        fetch(port)


# -- a real Prometheus scraping the exporter (skipped where the binary is not installed) -----------------------


class Prometheus:
    """A throwaway Prometheus (1 s scrapes, `honor_labels: true`) scraping one target."""

    def __init__(self, tmp: Path, target_port: int) -> None:
        config = tmp / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          "scrape_configs:\n"
                          "- job_name: dcgm\n"
                          "  honor_labels: true\n"
                          f"  static_configs: [{{targets: ['127.0.0.1:{target_port}']}}]\n")
        self.port = free_port()
        self.log_path = tmp / "prometheus.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as response:
            result: list[dict[str, Any]] = json.load(response)["data"]["result"]
            return result

    def wait_for(self, expr: str, until: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30) -> float:
        """Seconds until `until(query(expr))` holds."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log_path.read_text()[-2000:]}")
            try:
                if until(self.query(expr)):
                    return time.monotonic() - start
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        raise AssertionError(f"{expr}: condition not met within {timeout_s} s")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs the prometheus binary (Debian: prometheus)")
def test_a_real_prometheus_stores_the_series_and_loses_them_on_failure_and_on_stop(tmp_path: Path) -> None:
    backend = FakeGpuBackend(cards=2)
    backend.set_process(0, 4242, 2 * GIB, 55.0)
    exporter = Exporter(backend, hostname="node-a", pods=StaticPodMapper({0: SERVING}))
    server, _ = exporter.start(0, "127.0.0.1")
    prometheus = Prometheus(tmp_path, server.server_port)
    try:
        prometheus.wait_for("DCGM_FI_DEV_GPU_UTIL", lambda r: len(r) == 2)
        (series,) = prometheus.query('DCGM_FI_DEV_FB_USED{pod="llm-7d9f-abcde"}')
        # honor_labels: the exporter's pod labels kept as they are, no exported_pod; 2 GiB = 2048 MiB
        assert series["metric"] | {"instance": "-"} == {
            "__name__": "DCGM_FI_DEV_FB_USED", "gpu": "0", "UUID": "GPU-fake-0", "device": "nvidia0",
            "modelName": "Fake GPU", "Hostname": "node-a", "pod": "llm-7d9f-abcde", "namespace": "serving",
            "container": "server", "job": "dcgm", "instance": "-"}  # pci_bus_id="" is no label to Prometheus
        assert series["value"][1] == "2048"

        backend.fail_next(10**9)  # the backend fails on every scrape: the target is up, the GPU series go stale
        prometheus.wait_for("count(DCGM_FI_DEV_GPU_UTIL)", lambda r: r == [], timeout_s=15)
        assert prometheus.query("up")[0]["value"][1] == "1"
        assert float(prometheus.query("gpuplane_exporter_errors_total")[0]["value"][1]) >= 1
        backend.fail_next(0)
        prometheus.wait_for("DCGM_FI_DEV_GPU_UTIL", lambda r: len(r) == 2, timeout_s=15)

        exporter.stop()  # a dead exporter: the series go stale at once, not after the 5-minute lookback
        prometheus.wait_for("count(DCGM_FI_DEV_GPU_UTIL)", lambda r: r == [], timeout_s=15)
        assert prometheus.query("up")[0]["value"][1] == "0"
    finally:
        exporter.stop()
        prometheus.close()
