"""Device health for kubelet over `dra-health/v1` (`DRAResourceHealth.NodeWatchResources`, KEP-4680's DRA part).

`HealthBook` holds the node's devices and their health as the slice publisher last judged them (the device
plugin's rule, `card_health`); `HealthService` streams the whole list to each watcher when it changes, and again
every `resend_s` so that kubelet's health timeout never marks a quiet, healthy device Unknown. A device whose card
is unhealthy is UNHEALTHY whether the slices taint it or leave it out.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from gpuplane.node.device_plugin import Wire

__all__ = ["HEALTH_PROTO", "DeviceState", "HealthBook", "HealthService", "health_protocol"]

HEALTH_PROTO = "gpuplane/node/drahealth.proto"
MESSAGE_MAX = 1024
"""kubelet's limit on a device's health message."""


@functools.cache
def health_protocol() -> Wire:
    messages, services = grpc.protos_and_services(HEALTH_PROTO)
    return Wire(messages, services)


@dataclass(frozen=True, slots=True)
class DeviceState:
    healthy: bool
    since: float
    """Unix seconds of the judgement that set this state."""
    message: str = ""


class HealthBook:
    """The pool's devices and their health; `update` replaces the whole set (a device no longer listed is gone)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._pool = ""
        self._devices: dict[str, DeviceState] = {}
        self.version = 0
        self._closed = False

    def update(self, pool: str, devices: Mapping[str, tuple[bool, str]]) -> bool:
        """device name → (healthy, message); True when anything changed (watchers are then woken)."""
        now = self._clock()
        with self._cond:
            fresh = {}
            for name, (healthy, message) in devices.items():
                old = self._devices.get(name)
                same = old is not None and old.healthy == healthy and old.message == message
                fresh[name] = old if same and old is not None else DeviceState(healthy, now, message[:MESSAGE_MAX])
            if pool == self._pool and fresh == self._devices:
                return False
            self._pool, self._devices = pool, fresh
            self.version += 1
            self._cond.notify_all()
            return True

    def snapshot(self) -> tuple[int, str, dict[str, DeviceState]]:
        with self._cond:
            return self.version, self._pool, dict(self._devices)

    def wait(self, version: int, timeout_s: float) -> bool:
        """Until the book is past `version`, closed, or `timeout_s` passed; True when it moved on."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != version or self._closed, timeout_s)
            return self.version != version

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


class HealthService:
    """The `DRAResourceHealth` servicer over a `HealthBook`."""

    def __init__(self, book: HealthBook, *, resend_s: float = 10.0, poll_s: float = 0.5) -> None:
        if resend_s <= 0 or poll_s <= 0:
            raise ValueError(f"resend_s and poll_s must be positive, got {resend_s} and {poll_s}")
        self.book = book
        self.resend_s = resend_s
        self.poll_s = poll_s

    def response(self) -> tuple[int, Any]:
        """The book's version and the whole list as one `NodeWatchResourcesResponse`, by device name."""
        m = health_protocol().messages
        version, pool, devices = self.book.snapshot()
        out = m.NodeWatchResourcesResponse()
        for name in sorted(devices):
            state = devices[name]
            out.devices.append(m.DeviceHealth(
                device=m.DeviceIdentifier(pool_name=pool, device_name=name),
                health=m.HEALTHY if state.healthy else m.UNHEALTHY,
                last_updated_time=int(state.since), message=state.message))
        return version, out

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        version, response = self.response()
        yield response
        quiet = 0.0
        while context.is_active() and not self.book.closed:
            moved = self.book.wait(version, self.poll_s)
            quiet += self.poll_s if not moved else 0.0
            if moved or quiet >= self.resend_s:
                version, response = self.response()
                quiet = 0.0
                yield response

    def add_to(self, server: grpc.Server) -> None:
        health_protocol().services.add_DRAResourceHealthServicer_to_server(self, server)
