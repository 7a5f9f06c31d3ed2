"""A fake kubelet for device-plugin tests: the kubelet's half of the device plugin API v1beta1 over real
unix-socket gRPC (shared/reference/protocols.md §2.4).

It serves `Registration` on `<dir>/kubelet.sock`; `Register` refuses any version but `v1beta1`
(INVALID_ARGUMENT, as kubelet does) and then, as kubelet does in the background, dials the plugin back on
`<dir>/<endpoint>`, calls `GetDevicePluginOptions` and holds `ListAndWatch` open, queueing every device list
it receives. `allocate` calls the plugin's `Allocate` as kubelet does at container creation. `restart`
behaves like a kubelet restart: the socket directory is wiped (kubelet deletes every socket there, the
plugin's included) and a new `kubelet.sock` appears.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpuplane.node.device_plugin import HEALTHY, KUBELET_SOCKET, VERSION, protocol

WAIT_S = 10.0
"""How long a test waits for something the plugin must do (a safety net, not a speed assertion)."""


@dataclass(frozen=True)
class Registration:
    version: str
    endpoint: str
    resource_name: str
    pre_start_required: bool
    get_preferred_allocation_available: bool


@dataclass(frozen=True)
class Device:
    id: str
    health: str
    numa: tuple[int, ...]


class FakeKubelet:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registrations: list[Registration] = []
        self.refused: list[str] = []
        """Versions Register refused."""
        self.options: list[Any] = []
        """What GetDevicePluginOptions answered, per dial-back."""
        self.dial_failures: list[str] = []
        self.lists: queue.Queue[list[Device]] = queue.Queue()
        self.latest: list[Device] = []
        self._server: Any = None
        self._channels: list[Any] = []
        self._streams: list[Any] = []
        self._registered = threading.Condition()

    @property
    def socket(self) -> Path:
        return self.directory / KUBELET_SOCKET

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        protocol().services.add_RegistrationServicer_to_server(self, server)
        assert server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        for stream in self._streams:
            stream.cancel()
        for channel in self._channels:
            channel.close()
        self._streams, self._channels = [], []
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None

    def restart(self) -> None:
        """A kubelet restart: stop, delete every socket in the directory, serve a new kubelet.sock."""
        self.stop()
        for path in self.directory.glob("*.sock"):
            path.unlink()
        self.start()

    # -- Registration (served) --------------------------------------------------------------------------------

    def Register(self, request: Any, context: Any) -> Any:
        pb = protocol().messages
        if request.version != VERSION:
            self.refused.append(request.version)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unsupported API version {request.version!r}, kubelet speaks {VERSION}")
        registration = Registration(request.version, request.endpoint, request.resource_name,
                                    request.options.pre_start_required,
                                    request.options.get_preferred_allocation_available)
        threading.Thread(target=self._dial_back, args=(registration,), daemon=True).start()
        return pb.Empty()

    def _dial_back(self, registration: Registration) -> None:
        channel = grpc.insecure_channel(f"unix://{self.directory / registration.endpoint}")
        stub = protocol().services.DevicePluginStub(channel)
        self._channels.append(channel)
        try:
            self.options.append(stub.GetDevicePluginOptions(protocol().messages.Empty(), timeout=WAIT_S))
        except grpc.RpcError as exc:  # the plugin went away before kubelet dialled back: kubelet logs and drops it
            self.dial_failures.append(str(exc.details()))
            return
        stream = stub.ListAndWatch(protocol().messages.Empty())
        self._streams.append(stream)
        with self._registered:
            self.registrations.append(registration)
            self._registered.notify_all()
        try:
            for response in stream:
                devices = [Device(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in response.devices]
                self.latest = devices
                self.lists.put(devices)
        except grpc.RpcError:
            pass  # cancelled by stop(), or the plugin went away

    # -- what tests call ------------------------------------------------------------------------------------

    def wait_registered(self, count: int = 1) -> Registration:
        with self._registered:
            assert self._registered.wait_for(lambda: len(self.registrations) >= count, WAIT_S), \
                f"{len(self.registrations)} registrations, expected {count}"
            return self.registrations[count - 1]

    def next_list(self) -> list[Device]:
        """The next device list ListAndWatch sent."""
        return self.lists.get(timeout=WAIT_S)

    def drain(self) -> list[Device]:
        """Skip to the newest list received so far (waiting for one if none is queued)."""
        devices = self.next_list()
        while True:
            try:
                devices = self.lists.get_nowait()
            except queue.Empty:
                return devices

    @property
    def allocatable(self) -> int:
        """What kubelet publishes as the node's allocatable units: the healthy devices."""
        return sum(1 for d in self.latest if d.health == HEALTHY)

    def allocate(self, container_requests: Sequence[Sequence[str]], endpoint: str | None = None) -> Any:
        """Allocate on the plugin, one request entry per container; raises grpc.RpcError when refused."""
        endpoint = endpoint or self.registrations[-1].endpoint
        pb = protocol().messages
        with grpc.insecure_channel(f"unix://{self.directory / endpoint}") as channel:
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids))
                                                             for ids in container_requests])
            return protocol().services.DevicePluginStub(channel).Allocate(request, timeout=WAIT_S)

    def register_raw(self, version: str, endpoint: str, resource: str) -> None:
        """Call Register on this kubelet as a plugin would (to check what it refuses)."""
        pb = protocol().messages
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            protocol().services.RegistrationStub(channel).Register(
                pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource), timeout=WAIT_S)
