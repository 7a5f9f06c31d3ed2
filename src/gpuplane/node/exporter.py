"""The node agent's GPU metrics, served in dcgm-exporter's metric names and labels.

A query, an alert or a KEDA trigger written against NVIDIA's dcgm-exporter (`DCGM_FI_DEV_GPU_UTIL{pod=...}`)
works unchanged against this exporter, which reads the cards through a `GpuBackend` (NVML in real use)
instead of DCGM. Each scrape takes one reading of every card; nothing is cached between scrapes.

Metrics (gauges; per card; a value the card or the backend cannot report is left out for that card, never
exported as 0):

| metric | unit | from `CardReading` |
|---|---|---|
| `DCGM_FI_DEV_GPU_UTIL` | % 0–100 | `util_pct` |
| `DCGM_FI_DEV_FB_USED`, `_FB_FREE` | MiB (2**20 bytes), rounded down like DCGM | `used_bytes`, `free_bytes` |
| `DCGM_FI_PROF_GR_ENGINE_ACTIVE` | ratio 0–1 | `gr_engine_active`; where None, **derived** as `util_pct / 100` |
| `DCGM_FI_DEV_ENC_UTIL`, `DCGM_FI_DEV_DEC_UTIL` | % 0–100 | `enc_util_pct`, `dec_util_pct` |
| `DCGM_FI_DEV_GPU_TEMP` | °C | `temperature_c` |
| `DCGM_FI_DEV_POWER_USAGE` | W | `power_w` |
| `DCGM_FI_DEV_XID_ERRORS` | the value of the last Xid, 0 for none (not a count) | `xid_last` |

Labels on every sample: `gpu`, `UUID`, `pci_bus_id` ("" when unknown), `device` (`nvidia<gpu>`), `modelName`,
`Hostname`; plus `container`, `namespace`, `pod` on the cards a `PodMapper` assigns to a pod, and on no other
card (dcgm-exporter leaves them out too rather than exporting them empty). The samples of one metric may
therefore carry different label names, which the text exposition format allows.

A scrape during which the backend (or the pod mapper) fails returns no `DCGM_*` samples at all, so that
Prometheus marks the series stale as it would for a dead dcgm-exporter, and counts the failure in
`gpuplane_exporter_errors_total`; the collector never raises.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from gpuplane.model import GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model, validate_model
from gpuplane.node.gpu import CardReading, GpuBackend, GpuBackendError

__all__ = [
    "DEFAULT_PORT",
    "DcgmCollector",
    "Exporter",
    "PodMapError",
    "PodMapper",
    "PodRef",
    "StaticPodMapper",
    "default_hostname",
    "load_pod_map",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 9400
"""dcgm-exporter's port."""
MIB = 2**20


@dataclass(frozen=True, slots=True)
class PodRef:
    """The pod container a card is assigned to."""

    pod: str
    namespace: str
    container: str


class PodMapper(Protocol):
    def pods(self) -> Mapping[int, PodRef]:
        """Card index -> the pod container using it; a card absent from the mapping belongs to no pod."""
        ...


class PodMapError(GpuplaneError):
    """A pod mapping that cannot be valid; the message names the file (or source) and the field."""


class _PodRefModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pod: str = Field(min_length=1)
    namespace: str = Field(min_length=1)
    container: str = Field(min_length=1)


class _PodMapModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    cards: dict[NonNegativeInt, _PodRefModel] = Field(default_factory=dict)


class StaticPodMapper:
    """A fixed card -> pod mapping, for tests and for nodes whose assignment does not change.

    Its file form (YAML), keyed by card index:

        cards:
          0: {pod: llm-7d9f-abcde, namespace: serving, container: server}
          1: {pod: llm-7d9f-abcde, namespace: serving, container: server}
    """

    def __init__(self, mapping: Mapping[int, PodRef] | None = None) -> None:
        self._mapping = dict(mapping or {})

    @classmethod
    def from_dict(cls, raw: object, source: str = "pods") -> StaticPodMapper:
        """From the file form's parsed content; raises `PodMapError("SOURCE: field: message")`."""
        return cls._from_model(validate_model(raw, _PodMapModel, PodMapError, source))

    @classmethod
    def _from_model(cls, model: _PodMapModel) -> StaticPodMapper:
        return cls({card: PodRef(ref.pod, ref.namespace, ref.container) for card, ref in model.cards.items()})

    def pods(self) -> Mapping[int, PodRef]:
        return self._mapping


def load_pod_map(path: str | Path) -> StaticPodMapper:
    """Read a pod mapping file (YAML, see `StaticPodMapper`); raises `PodMapError("FILE: field: message")`."""
    return StaticPodMapper._from_model(load_yaml_model(path, _PodMapModel, PodMapError))


def default_hostname() -> str:
    """dcgm-exporter's choice: `$NODE_NAME` (a DaemonSet sets it from `spec.nodeName`), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    help: str
    value: Callable[[CardReading], float | None]


def _mib(n: int) -> float:
    return float(n // MIB)


def _engine_active(card: CardReading) -> float | None:
    if card.gr_engine_active is not None:
        return card.gr_engine_active
    return None if card.util_pct is None else card.util_pct / 100.0


_FIELDS: tuple[_Field, ...] = (
    _Field("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", lambda c: c.temperature_c),
    _Field("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", lambda c: c.power_w),
    _Field("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda c: c.util_pct),
    _Field("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", lambda c: c.enc_util_pct),
    _Field("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", lambda c: c.dec_util_pct),
    _Field("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.",
           lambda c: None if c.xid_last is None else float(c.xid_last)),
    _Field("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", lambda c: _mib(c.free_bytes)),
    _Field("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda c: _mib(c.used_bytes)),
    _Field("DCGM_FI_PROF_GR_ENGINE_ACTIVE",
           "Ratio of time the graphics engine is active (derived as GPU utilization / 100 where the card "
           "does not report it).", _engine_active),
)
"""What is exported, in dcgm-exporter's default-counters order."""


class DcgmCollector(Collector):
    """A prometheus_client collector: one `backend.cards()` reading per scrape, as dcgm-exporter metrics.

    Scrapes are serialised (a backend need not be thread-safe). `clock` times each reading, exported as
    `gpuplane_exporter_read_seconds`."""

    def __init__(self, backend: GpuBackend, hostname: str, pods: PodMapper | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.hostname = hostname
        self.pod_mapper = pods
        self.clock = clock
        self._lock = threading.Lock()
        self.scrapes = 0
        self.errors = 0
        self.last_read_s: float | None = None

    def describe(self) -> Iterable[Metric]:
        """Nothing to pre-register: the registry must not read the cards when the collector is registered."""
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.scrapes += 1
            families: list[Metric] = []
            try:
                started = self.clock()
                cards = self.backend.cards()
                self.last_read_s = max(0.0, self.clock() - started)
                assigned = dict(self.pod_mapper.pods()) if self.pod_mapper is not None else {}
                families = self._families(cards, assigned)
            except GpuBackendError as exc:
                self.errors += 1
                families = []
                log.warning("GPU reading failed, no DCGM samples served: %s", exc)
            except Exception:  # a pod mapper's (or a backend's) bug: still no exception out of a scrape
                self.errors += 1
                families = []
                log.exception("GPU metrics scrape failed, no DCGM samples served")
            families.extend(self._own_metrics())
        yield from families

    def _families(self, cards: list[CardReading], assigned: Mapping[int, PodRef]) -> list[Metric]:
        labels = [self._labels(card, assigned.get(card.index)) for card in cards]
        families: list[Metric] = []
        for spec in _FIELDS:
            family = Metric(spec.name, spec.help, "gauge")
            for card, card_labels in zip(cards, labels, strict=True):
                value = spec.value(card)
                if value is not None:
                    family.add_sample(spec.name, card_labels, value)
            if family.samples:
                families.append(family)
        return families

    def _labels(self, card: CardReading, pod: PodRef | None) -> dict[str, str]:
        labels = {
            "gpu": str(card.index),
            "UUID": card.uuid,
            "pci_bus_id": card.pci_bus_id or "",
            "device": f"nvidia{card.index}",
            "modelName": card.name,
            "Hostname": self.hostname,
        }
        if pod is not None:
            labels |= {"container": pod.container, "namespace": pod.namespace, "pod": pod.pod}
        return labels

    def _own_metrics(self) -> list[Metric]:
        own: list[Metric] = [
            CounterMetricFamily("gpuplane_exporter_scrapes", "Scrapes served, failed ones included.",
                                value=self.scrapes),
            CounterMetricFamily("gpuplane_exporter_errors", "Scrapes that served no GPU samples because the "
                                "GPU backend or the pod mapping failed.", value=self.errors),
        ]
        if self.last_read_s is not None:
            own.append(GaugeMetricFamily("gpuplane_exporter_read_seconds",
                                         "How long the last successful reading of the cards took.",
                                         value=self.last_read_s))
        return own


class Exporter:
    """A `DcgmCollector` on its own registry, served over HTTP by `start` until `stop`.

    The backend stays the caller's: `stop` does not close it."""

    def __init__(self, backend: GpuBackend, *, hostname: str | None = None, pods: PodMapper | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = DcgmCollector(backend, hostname if hostname is not None else default_hostname(), pods,
                                       clock)
        self.registry.register(self.collector)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, port: int = DEFAULT_PORT, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve the metrics on `addr:port` (port 0: any free port, see `server.server_port`); every path
        answers, `/metrics` included. Raises `OSError` when the port cannot be bound."""
        if self._server is not None:
            raise RuntimeError("the exporter is already serving; stop() it first")
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return self._server, self._thread

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the listening socket; idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=timeout_s)
