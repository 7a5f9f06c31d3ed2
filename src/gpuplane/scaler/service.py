"""The GPU scaler: a KEDA external scaler (gRPC) that answers from Prometheus queries, safely.

KEDA calls `GetMetricSpec` once per ScaledObject, then `GetMetrics` and `IsActive` on every poll
(`pollingInterval`, 30 s by default); an `external-push` trigger also holds `StreamIsActive` open. For each
configured scaled object (keyed by the ScaledObjectRef's namespace and name) the scaler

- runs the object's PromQL query (at most once per `min_query_interval_s`: the `GetMetrics` + `IsActive`
  pair of one poll costs one query) and feeds the reading, or the failure, to the object's
  `ScaledObjectScaler` (`gpuplane.controllers.autoscale`, the decision path the autoscaling scenario
  drives): a failed reading (Prometheus down, invalid PromQL, an empty result from a dead exporter) is
  never read as zero: the last good value is reported for `failure_threshold` readings, then the fallback
  `target × fallback_replicas`, and the object stays active; with a `demand_query` (the gateway's request
  rate) the value is the larger of the GPU value and rate × the GPU value per request learnt from readings;
- reports the value in both `metricValue` (int64, rounded) and `metricValueFloat` (KEDA reads the float
  only when it is > 0), and the activity (production objects are always active; a non-production one
  turns inactive after `idle_cooldown_s` without a value above its activation threshold: the value of its
  `activation_query` where it has one, e.g. a gateway's request rate, which sees demand while no replica
  runs, and is read even while the GPU query fails; a failed activation query reads as activity, never as
  idleness);
- computes what the HPA would do with that value (`Hpa` with `average_value_replicas`, tracking its own last
  desired count as the current one; 0 while inactive) and exports it with the value, the activity and the
  error and fallback counts as Prometheus metrics on a per-scaler registry.

Every error and every activity change is logged. Unknown scaled objects get gRPC `NOT_FOUND`.
The protocol is loaded at run time from `externalscaler.proto` (package data) by `grpc.protos_and_services`.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpuplane.controllers.autoscale import (
    MetricSource,
    Poll,
    ReadingSource,
    RiseReserve,
    ScaledObjectScaler,
    ScaledObjectSpec,
    ScalerReport,
    rise_reserve_for,
)
from gpuplane.model import GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model
from gpuplane.scaler.prometheus import PrometheusClient

log = logging.getLogger(__name__)

PROTO = "gpuplane/scaler/externalscaler.proto"
"""The protocol, as a path on `sys.path` (the package's own directory)."""
INT64_MAX = 2**63 - 1


class ScalerError(GpuplaneError):
    """The scaler cannot start (e.g. its port is taken)."""


class ScalerConfigError(GpuplaneError):
    """A scaler configuration that cannot be valid; the message names the file and the field."""


class UnknownScaledObject(GpuplaneError):
    """A ScaledObjectRef the scaler has no configuration for (gRPC `NOT_FOUND`)."""


# -- configuration ------------------------------------------------------------------------------------------


class ScaledObjectConfig(ScaledObjectSpec):
    """A `ScaledObjectSpec` plus the metric name the scaler gives KEDA (default `gpu-<name>`)."""

    metric_name: str | None = Field(default=None, min_length=1, max_length=200,
                                    pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def metric(self) -> str:
        return self.metric_name or f"gpu-{self.name}"


class ScalerConfig(BaseModel):
    """The scaler's YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_url: str = Field(min_length=1, description="e.g. http://prometheus:9090")
    min_query_interval_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """A reading is reused for this long: KEDA's GetMetrics + IsActive pair costs one query."""
    stream_interval_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    """StreamIsActive sends the activity when it changes and at least this often."""
    scaled_objects: tuple[ScaledObjectConfig, ...] = Field(min_length=1)

    @field_validator("prometheus_url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 - raises for a bad port
        except ValueError as exc:
            raise ValueError(f"{value!r}: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"{value!r}: give http(s)://host[:port][/path-prefix]")
        return value

    @field_validator("scaled_objects")
    @classmethod
    def _unique(cls, objects: tuple[ScaledObjectConfig, ...]) -> tuple[ScaledObjectConfig, ...]:
        keys = [o.key for o in objects]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"names must be unique per namespace: {', '.join(twice)} given more than once")
        return objects


def load_scaler_config(path: str | Path) -> ScalerConfig:
    """Read a scaler configuration (YAML); raises `ScalerConfigError("FILE: field: message")`."""
    return load_yaml_model(path, ScalerConfig, ScalerConfigError)


# -- the protocol ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Protocol:
    messages: Any
    services: Any


@functools.cache
def _protocol() -> _Protocol:
    """The runtime-generated `externalscaler_pb2` and `_pb2_grpc` modules (untyped: kept behind this file's
    typed functions)."""
    messages, services = grpc.protos_and_services(PROTO)
    return _Protocol(messages, services)


def _abort(context: Any, code: Any, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("grpc's abort returned")  # pragma: no cover


def _int64(value: float) -> int:
    """`value` rounded (half away from zero) and clamped to int64, for the deprecated integer fields."""
    rounded = math.floor(abs(value) + 0.5) * (1 if value >= 0 else -1)
    return max(-INT64_MAX - 1, min(INT64_MAX, rounded))


# -- the scaler --------------------------------------------------------------------------------------------


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("namespace", "name")
        self.desired = Gauge("gpuplane_scaler_desired_replicas",
                             "Replicas the HPA algorithm wants for the reported value (0 while inactive).", labels,
                             registry=registry)
        self.value = Gauge("gpuplane_scaler_metric_value",
                           "Value reported to KEDA (the reading, the last good one, or the fallback).", labels,
                           registry=registry)
        self.active = Gauge("gpuplane_scaler_active", "1 while the scaled object is reported active.", labels,
                            registry=registry)
        self.errors = Counter("gpuplane_scaler_errors",
                              "Readings that failed (Prometheus, query, no data; activation query).", labels,
                              registry=registry)
        self.fallback = Counter("gpuplane_scaler_fallback",
                                "Reports that gave the fallback value (target × fallback_replicas).", labels,
                                registry=registry)


@dataclass(slots=True)
class _Object:
    spec: ScaledObjectConfig
    scaler: ScaledObjectScaler
    """The decision path (`gpuplane.controllers.autoscale`): readings, the policy, the HPA forecast."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class GpuScaler:
    """The KEDA external-scaler service for the configured scaled objects.

    `prometheus_client_factory(url)` makes the metric source (a `PrometheusClient` by default); `clock` times
    the decisions (idle cooldown, HPA windows, the query cache). Serves gRPC with `start`; its methods named
    like the RPCs are the servicer."""

    def __init__(self, config: ScalerConfig,
                 prometheus_client_factory: Callable[[str], MetricSource] = PrometheusClient,
                 clock: Callable[[], float] = time.monotonic, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.source = prometheus_client_factory(config.prometheus_url)
        self.clock = clock
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        # objects with the same lead, window and target learn their rises of demand together
        reserves: dict[tuple[float, float, float], RiseReserve] = {}
        self._objects: dict[str, _Object] = {}
        for spec in config.scaled_objects:
            reserve = None
            if spec.rise_lead_s > 0:
                shared = (spec.rise_lead_s, spec.rise_window_s, spec.target)
                if shared not in reserves:
                    reserves[shared] = rise_reserve_for(spec)
                reserve = reserves[shared]
            self._objects[spec.key] = _Object(spec, ScaledObjectScaler(spec, config.min_query_interval_s,
                                                                       reserve=reserve))
        for spec in config.scaled_objects:
            self.metrics.errors.labels(spec.namespace, spec.name)
            self.metrics.fallback.labels(spec.namespace, spec.name)
        self._server: Any = None
        self._stopping = threading.Event()
        self._streams: set[threading.Event] = set()
        """One wake-up event per open StreamIsActive."""
        self._streams_lock = threading.Lock()
        self.port: int | None = None
        """The gRPC port, once started."""

    # -- decisions ----------------------------------------------------------------------------------------

    @property
    def objects(self) -> list[str]:
        """The configured scaled objects, as namespace/name."""
        return list(self._objects)

    def spec(self, namespace: str, name: str) -> ScaledObjectConfig:
        return self._object(namespace, name).spec

    def poll(self, namespace: str, name: str) -> ScalerReport:
        """The report for one object now: a fresh reading, or the one taken less than `min_query_interval_s`
        ago. Never raises for a failed reading; raises `UnknownScaledObject` for an unknown object."""
        obj = self._object(namespace, name)
        with obj.lock:
            poll = obj.scaler.poll(self.clock(), self.source)
            if poll.fresh:
                self._record(obj, poll)
            return poll.report

    def desired_replicas(self, namespace: str, name: str) -> int:
        """What the HPA algorithm wanted at the last reading (0: inactive or not polled yet)."""
        return self._object(namespace, name).scaler.replicas

    def _object(self, namespace: str, name: str) -> _Object:
        key = f"{namespace or 'default'}/{name}"
        obj = self._objects.get(key)
        if obj is None:
            raise UnknownScaledObject(f"no scaled object {key} is configured; known: {', '.join(self._objects)}")
        return obj

    def _record(self, obj: _Object, poll: Poll) -> None:
        spec, report = obj.spec, poll.report
        labels = (spec.namespace, spec.name)
        if poll.activation_error is not None:
            self.metrics.errors.labels(*labels).inc()
            log.warning("%s: activation query failed (%s); treated as activity", spec.key, poll.activation_error)
        if poll.demand_error is not None:
            self.metrics.errors.labels(*labels).inc()
            log.warning("%s: demand query failed (%s); reporting the GPU value alone", spec.key, poll.demand_error)
        if report.error is not None:
            self.metrics.errors.labels(*labels).inc()
            log.warning("%s: reading failed (%s); reporting the %s value %g", spec.key, report.error,
                        report.source.value, report.value)
        if report.source is ReadingSource.FALLBACK:
            self.metrics.fallback.labels(*labels).inc()
        if poll.previous is None or poll.previous.active != report.active:
            log.info("%s: %s (value %g, %s)", spec.key, "active" if report.active else "inactive", report.value,
                     report.source.value)
        self.metrics.desired.labels(*labels).set(obj.scaler.replicas)
        self.metrics.value.labels(*labels).set(report.value)
        self.metrics.active.labels(*labels).set(1 if report.active else 0)

    # -- gRPC servicer (request and context are the runtime-generated protobuf and grpc objects) ---------------

    def _lookup(self, ref: Any, context: Any) -> _Object:
        try:
            return self._object(str(ref.namespace), str(ref.name))
        except UnknownScaledObject as exc:
            _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))

    def GetMetricSpec(self, request: Any, context: Any) -> Any:  # the RPCs keep their protocol names
        spec = self._lookup(request, context).spec
        pb = _protocol().messages
        return pb.GetMetricSpecResponse(metricSpecs=[pb.MetricSpec(
            metricName=spec.metric, targetSize=min(INT64_MAX, math.ceil(spec.target)), targetSizeFloat=spec.target)])

    def GetMetrics(self, request: Any, context: Any) -> Any:
        spec = self._lookup(request.scaledObjectRef, context).spec
        report = self.poll(spec.namespace, spec.name)
        pb = _protocol().messages
        return pb.GetMetricsResponse(metricValues=[pb.MetricValue(
            metricName=spec.metric, metricValue=_int64(report.value), metricValueFloat=report.value)])

    def IsActive(self, request: Any, context: Any) -> Any:
        spec = self._lookup(request, context).spec
        return _protocol().messages.IsActiveResponse(result=self.poll(spec.namespace, spec.name).active)

    def StreamIsActive(self, request: Any, context: Any) -> Iterator[Any]:
        """The activity when it changes, and at least every `stream_interval_s`, until the client cancels."""
        spec = self._lookup(request, context).spec
        pb = _protocol().messages
        wake = threading.Event()
        context.add_callback(wake.set)
        with self._streams_lock:
            self._streams.add(wake)
        interval = self.config.stream_interval_s
        check = min(interval, max(self.config.min_query_interval_s, 0.1))
        sent: bool | None = None
        sent_at = -math.inf
        try:
            while context.is_active() and not self._stopping.is_set():
                active = self.poll(spec.namespace, spec.name).active
                at = time.monotonic()
                if active != sent or at - sent_at >= interval:
                    yield pb.IsActiveResponse(result=active)
                    sent, sent_at = active, at
                wake.wait(min(check, max(0.0, sent_at + interval - time.monotonic())))
        finally:
            with self._streams_lock:
                self._streams.discard(wake)

    # -- serving ------------------------------------------------------------------------------------------

    def start(self, port: int = 9091, addr: str = "0.0.0.0", *, max_workers: int = 32) -> int:
        """Serve the external-scaler gRPC API (plain text; port 0: any free port). Returns the port.

        Each open StreamIsActive holds one of the `max_workers` threads."""
        if self._server is not None:
            raise ScalerError("the scaler is already serving")
        server = grpc.server(ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gpuplane-scaler"),
                             options=[("grpc.so_reuseport", 0)])
        _protocol().services.add_ExternalScalerServicer_to_server(self, server)
        address = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        try:
            bound = int(server.add_insecure_port(address))
        except RuntimeError as exc:
            raise ScalerError(f"cannot listen on {address}: {exc}") from None
        if bound == 0:
            raise ScalerError(f"cannot listen on {address}")
        self._stopping.clear()
        server.start()
        self._server, self.port = server, bound
        log.info("GPU scaler serving %d scaled objects on %s (Prometheus %s)", len(self._objects),
                 address.rsplit(":", 1)[0] + f":{bound}", self.config.prometheus_url)
        return bound

    @property
    def server(self) -> Any:
        """The running `grpc.Server`, or None."""
        return self._server

    def stop(self, grace_s: float | None = 1.0) -> None:
        """Stop serving: open streams end, calls in flight get `grace_s` to finish."""
        server, self._server = self._server, None
        self._stopping.set()
        with self._streams_lock:
            for wake in self._streams:
                wake.set()
        if server is not None:
            server.stop(grace_s).wait()

    def start_metrics_server(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve this scaler's metrics over HTTP (port 0: any free port, see `server.server_port`)."""
        return start_http_server(port, addr, registry=self.registry)


def serve(config: ScalerConfig, port: int = 9091, addr: str = "0.0.0.0", *,
          prometheus_client_factory: Callable[[str], MetricSource] = PrometheusClient,
          clock: Callable[[], float] = time.monotonic) -> Any:
    """Start a `GpuScaler` for `config` on `addr:port`; returns the running `grpc.Server`."""
    scaler = GpuScaler(config, prometheus_client_factory, clock)
    scaler.start(port, addr)
    return scaler.server


# -- a client, as KEDA calls the scaler --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricSpecEntry:
    metric_name: str
    target_size: int
    target_size_float: float


@dataclass(frozen=True, slots=True)
class MetricValueEntry:
    metric_name: str
    metric_value: int
    metric_value_float: float

    @property
    def keda_value(self) -> float:
        """What KEDA reads: the float field when it is > 0, else the deprecated integer."""
        return self.metric_value_float if self.metric_value_float > 0 else float(self.metric_value)


class ActivityStream:
    """An open StreamIsActive call: iterate for the activity values; `cancel` ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[bool]:
        return self

    def __next__(self) -> bool:
        return bool(next(self._call).result)

    def cancel(self) -> None:
        self._call.cancel()


class ExternalScalerClient:
    """Calls an external scaler as KEDA does (plain text). gRPC failures raise `grpc.RpcError`."""

    def __init__(self, target: str, *, timeout_s: float = 5.0) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = _protocol().services.ExternalScalerStub(self._channel)
        self.timeout_s = timeout_s

    def __enter__(self) -> ExternalScalerClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    @staticmethod
    def _ref(namespace: str, name: str, metadata: Mapping[str, str] | None) -> Any:
        return _protocol().messages.ScaledObjectRef(name=name, namespace=namespace, scalerMetadata=dict(metadata or {}))

    def get_metric_spec(self, namespace: str, name: str,
                        metadata: Mapping[str, str] | None = None) -> list[MetricSpecEntry]:
        response = self._stub.GetMetricSpec(self._ref(namespace, name, metadata), timeout=self.timeout_s)
        return [MetricSpecEntry(str(s.metricName), int(s.targetSize), float(s.targetSizeFloat))
                for s in response.metricSpecs]

    def get_metrics(self, namespace: str, name: str, metric_name: str,
                    metadata: Mapping[str, str] | None = None) -> list[MetricValueEntry]:
        request = _protocol().messages.GetMetricsRequest(scaledObjectRef=self._ref(namespace, name, metadata),
                                                         metricName=metric_name)
        response = self._stub.GetMetrics(request, timeout=self.timeout_s)
        return [MetricValueEntry(str(v.metricName), int(v.metricValue), float(v.metricValueFloat))
                for v in response.metricValues]

    def is_active(self, namespace: str, name: str, metadata: Mapping[str, str] | None = None) -> bool:
        return bool(self._stub.IsActive(self._ref(namespace, name, metadata), timeout=self.timeout_s).result)

    def stream_is_active(self, namespace: str, name: str, metadata: Mapping[str, str] | None = None, *,
                         timeout_s: float | None = None) -> ActivityStream:
        """Open StreamIsActive; `timeout_s` is the whole stream's deadline (None: none)."""
        return ActivityStream(self._stub.StreamIsActive(self._ref(namespace, name, metadata), timeout=timeout_s))

