"""End to end, with nothing faked but the GPUs: exporter → real Prometheus → GPU scaler → KEDA's calls.

- the node exporter (`gpuplane.node.exporter`) serves `DCGM_FI_DEV_GPU_UTIL` for two `FakeGpuBackend` cards
  whose utilisation the test drives;
- Debian's `prometheus` binary scrapes it every second (a child process on a loopback port);
- the GPU scaler serves two scaled objects over real PromQL: `serving/llm` (production) and `batch/embed`
  (non-production, 3 s idle cooldown);
- the test acts as KEDA: every 0.5 s, `GetMetrics` then `IsActive` for each object, over gRPC.

It checks (a) activation when the load rises above the activation threshold, (b) values tracking the load,
(c) the non-production object going inactive after its idle cooldown while production stays active, and
(d) after the exporter dies and Prometheus marks its series stale: the last good value, then the fallback,
active throughout, never a zero. Skipped only where no `prometheus` binary is installed (CI installs it).
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuplane.node.exporter import Exporter
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.scaler.prometheus import PrometheusClient, PrometheusError
from gpuplane.scaler.service import ExternalScalerClient, GpuScaler, ScaledObjectConfig, ScalerConfig

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus binary on PATH "
                                                           "(apt-get install prometheus; .ci/run installs it)")

POLL_S = 0.5
LLM_FALLBACK = 50 * 2  # target × fallback_replicas
EMBED_FALLBACK = 40 * 1

LLM = ScaledObjectConfig(name="llm", namespace="serving", query='avg(DCGM_FI_DEV_GPU_UTIL{Hostname="node-a"})',
                         target=50, activation_threshold=10, min_replicas=1, max_replicas=8, fallback_replicas=2,
                         failure_threshold=3, query_timeout_s=1)
EMBED = ScaledObjectConfig(name="embed", namespace="batch", query='max(DCGM_FI_DEV_GPU_UTIL{job="dcgm"})',
                           target=40, activation_threshold=10, production=False, min_replicas=0, max_replicas=4,
                           idle_cooldown_s=3, fallback_replicas=1, failure_threshold=3, query_timeout_s=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, detail: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}\n{detail()}")
        time.sleep(0.1)


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else "(no log)"


@pytest.fixture
def gpus() -> FakeGpuBackend:
    return FakeGpuBackend(cards=2)


@pytest.fixture
def exporter(gpus: FakeGpuBackend) -> Iterator[tuple[Exporter, int]]:
    node = Exporter(gpus, hostname="node-a")
    server, _ = node.start(0, "127.0.0.1")
    try:
        yield node, server.server_port
    finally:
        node.stop()


@pytest.fixture
def prometheus(tmp_path: Path, exporter: tuple[Exporter, int]) -> Iterator[Prometheus]:
    assert PROMETHEUS is not None
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: dcgm
    honor_labels: true
    static_configs:
      - targets: ['127.0.0.1:{exporter[1]}']
""")
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=sink, stderr=subprocess.STDOUT,
                                   cwd=tmp_path)
    server = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited with {process.returncode}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        wait_for("prometheus /-/ready", ready, 30, server.log_tail)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Poll:
    at: float
    value: float
    """As KEDA reads it: metricValueFloat when > 0, else metricValue."""
    active: bool
    errors: float
    fallbacks: float


class Keda:
    """Polls like KEDA (GetMetrics, then IsActive, for each object) every `POLL_S`, keeping the history."""

    def __init__(self, client: ExternalScalerClient, scaler: GpuScaler) -> None:
        self.client, self.scaler = client, scaler
        self.history: dict[str, list[Poll]] = {LLM.key: [], EMBED.key: []}

    def poll(self) -> None:
        for spec in (LLM, EMBED):
            [value] = self.client.get_metrics(spec.namespace, spec.name, spec.metric)
            active = self.client.is_active(spec.namespace, spec.name)
            labels = {"namespace": spec.namespace, "name": spec.name}
            registry = self.scaler.registry
            self.history[spec.key].append(Poll(time.monotonic(), value.keda_value, active,
                                               registry.get_sample_value("gpuplane_scaler_errors_total", labels) or 0,
                                               registry.get_sample_value("gpuplane_scaler_fallback_total", labels)
                                               or 0))

    def last(self, spec: ScaledObjectConfig) -> Poll:
        return self.history[spec.key][-1]

    def until(self, what: str, done: Callable[[Keda], bool], timeout_s: float) -> float:
        """Poll until `done`; returns when it became true (monotonic seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if done(self):
                return time.monotonic()
            if time.monotonic() > deadline:
                tail = {k: [(round(p.value, 1), p.active) for p in v[-12:]] for k, v in self.history.items()}
                pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}; last polls: {tail}")
            time.sleep(POLL_S)

    def since(self, spec: ScaledObjectConfig, at: float) -> list[Poll]:
        return [p for p in self.history[spec.key] if p.at >= at]


def test_gpu_load_drives_the_scaler_through_a_real_prometheus(gpus: FakeGpuBackend,
                                                               exporter: tuple[Exporter, int],
                                                               prometheus: Prometheus) -> None:
    started = time.monotonic()

    def load(pct: float) -> None:
        for card in (0, 1):
            gpus.set_process(card, 4000 + card, used_bytes=GIB, sm_util_pct=pct)

    load(0)
    source = PrometheusClient(prometheus.url)

    def scraped() -> bool:
        try:
            return source.query("count(DCGM_FI_DEV_GPU_UTIL)") == 2
        except PrometheusError:
            return False

    wait_for("the first scrape of both cards", scraped, 20, prometheus.log_tail)

    scaler = GpuScaler(ScalerConfig(prometheus_url=prometheus.url, min_query_interval_s=0.25, stream_interval_s=1,
                                    scaled_objects=(LLM, EMBED)))
    port = scaler.start(0, "127.0.0.1")
    try:
        with ExternalScalerClient(f"127.0.0.1:{port}") as client:
            keda = Keda(client, scaler)

            # (a) idle: the non-production object is inactive, production active; load above the threshold
            # activates it
            keda.until("two idle polls", lambda k: len(k.history[EMBED.key]) >= 2, 5)
            assert [(p.value, p.active) for p in keda.history[EMBED.key]] == [(0.0, False)] * 2
            assert [(p.value, p.active) for p in keda.history[LLM.key]] == [(0.0, True)] * 2
            load(20)
            keda.until("activation at 20 %", lambda k: k.last(EMBED).active and k.last(EMBED).value == 20
                       and k.last(LLM).value == 20, 10)
            assert keda.last(LLM) == Poll(keda.last(LLM).at, 20.0, True, 0, 0)
            assert all(p.value in (0, 20) for spec in (LLM, EMBED) for p in keda.history[spec.key])

            # (b) the values track the load
            mark = time.monotonic()
            load(80)
            keda.until("80 % in both", lambda k: k.last(LLM).value == 80 and k.last(EMBED).value == 80, 10)
            assert {p.value for p in keda.since(LLM, mark)} <= {20.0, 80.0}
            assert scaler.desired_replicas("serving", "llm") == 2  # ceil(80 / 50)
            assert scaler.desired_replicas("batch", "embed") == 2  # ceil(80 / 40)

            # (c) no load: the non-production object goes inactive after its 3 s idle cooldown, production never
            mark = time.monotonic()
            load(0)
            zero_at = keda.until("0 % read", lambda k: k.last(EMBED).value == 0, 10)
            idle_at = keda.until("the idle cooldown", lambda k: not k.last(EMBED).active, 10)
            assert idle_at - zero_at >= EMBED.idle_cooldown_s - 2 * POLL_S
            assert all(p.active for p in keda.since(LLM, mark))
            assert keda.last(LLM).value == 0 and scaler.desired_replicas("batch", "embed") == 0

            # (d) the exporter dies: Prometheus drops the series, the scaler never reports a zero
            load(30)
            keda.until("30 % in both", lambda k: k.last(LLM).value == 30 and k.last(EMBED).value == 30
                       and k.last(EMBED).active, 10)
            errors_before = {spec.key: keda.last(spec).errors for spec in (LLM, EMBED)}
            exporter[0].stop()
            stopped = time.monotonic()
            keda.until("the fallback values",
                       lambda k: k.last(LLM).value == LLM_FALLBACK and k.last(EMBED).value == EMBED_FALLBACK, 20)
            fallback_after = time.monotonic() - stopped
            for spec, fallback in ((LLM, LLM_FALLBACK), (EMBED, EMBED_FALLBACK)):
                after = keda.since(spec, stopped)
                assert all(p.active for p in after), after
                assert all(p.value > 0 for p in after), after
                values = [p.value for p in after]
                assert set(values) == {30.0, float(fallback)}, values
                assert values == sorted(values, key=lambda v: v == fallback)  # 30 …, then the fallback only
                # the last good value was served while the readings were already failing
                assert any(p.value == 30 and p.errors > errors_before[spec.key] for p in after), after
                assert after[-1].fallbacks > 0
            with pytest.raises(PrometheusError, match="no data"):
                source.query("count(DCGM_FI_DEV_GPU_UTIL)")  # stale, not 5 minutes of lookback
            assert source.query('up{job="dcgm"}') == 0
    finally:
        scaler.stop(0)
    runtime = time.monotonic() - started
    print(f"integration: exporter -> prometheus -> scaler in {runtime:.1f} s; fallback {fallback_after:.1f} s "
          f"after the exporter stopped")
    assert runtime < 60
    assert math.isfinite(fallback_after)
