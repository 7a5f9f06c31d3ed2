"""A fake kubelet PodResources API v1 for node-agent tests: `PodResourcesLister` over real unix-socket gRPC, answering
from a settable list of pods (`set_pods`), as kubelet answers from its device manager and DRA manager."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpuplane.node.podresources import protocol


@dataclass(frozen=True)
class Claim:
    """One DRA device a claim gave a container."""

    driver: str
    device: str
    cdi: tuple[str, ...] = ()
    claim: str = "claim"
    pool: str = "pool"


@dataclass(frozen=True)
class Container:
    name: str
    devices: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """resource name → device IDs"""
    claims: tuple[Claim, ...] = ()


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    containers: tuple[Container, ...]


class FakePodResources:
    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.lists = 0
        self._pods: list[Pod] = []
        self._lock = threading.Lock()
        self._server: Any = None

    def start(self) -> FakePodResources:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        protocol().services.add_PodResourcesListerServicer_to_server(self, server)
        assert server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
            self._server = None

    def set_pods(self, *pods: Pod) -> None:
        with self._lock:
            self._pods = list(pods)

    # -- the service ------------------------------------------------------------------------------------------------

    def _message(self, pod: Pod) -> Any:
        m = protocol().messages
        containers = []
        for c in pod.containers:
            devices = [m.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in c.devices.items()]
            claims = [m.DynamicResource(claim_name=d.claim, claim_namespace=pod.namespace, claim_resources=[
                m.ClaimResource(driver_name=d.driver, pool_name=d.pool, device_name=d.device,
                                cdi_devices=[m.CDIDevice(name=n) for n in d.cdi])]) for d in c.claims]
            containers.append(m.ContainerResources(name=c.name, devices=devices, dynamic_resources=claims))
        return m.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    def List(self, request: Any, context: Any) -> Any:  # the RPCs keep their protocol names
        with self._lock:
            self.lists += 1
            pods = list(self._pods)
        return protocol().messages.ListPodResourcesResponse(pod_resources=[self._message(p) for p in pods])

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        return protocol().messages.AllocatableResourcesResponse()

    def Get(self, request: Any, context: Any) -> Any:
        with self._lock:
            found = [p for p in self._pods if (p.namespace, p.name) == (request.pod_namespace, request.pod_name)]
        if not found:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        return protocol().messages.GetPodResourcesResponse(pod_resources=self._message(found[0]))
