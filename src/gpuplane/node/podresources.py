"""Cards held by other GPU stacks, seen from the node: kubelet's PodResources API (v1, unix-socket gRPC) says which
devices each container holds; `foreign_report` maps the GPU ones to this node's card indexes and
`ForeignCardsReporter` publishes them on the node (annotation `gpuplane.io/foreign-cards`, `gpuplane.kube.foreign`),
one PATCH per change.

How device IDs become cards (`CardIds`, from the GPU backend):

- device-plugin resources (`ContainerDevices`): the NVIDIA device plugin names a card by its UUID (`GPU-…`), a
  time-slicing replica `GPU-…::<n>`, a MIG device by its MIG UUID (`MIG-…`, counted as its parent card);
- DRA claims (`DynamicResource`) of the NVIDIA DRA driver (`gpu.nvidia.com`): a CDI device name whose device part
  is a GPU or MIG UUID, else the driver's device name `gpu-<minor>` / `gpu-<minor>-mig-…` (older drivers used the
  index; the card whose minor, else index, is `<n>`);
- gpuplane's own resources (`gpuplane.io/*`) are never foreign; a device of another resource that names none of
  the cards (an RDMA function, a NIC) is not a GPU and is left out, unless the resource is a known GPU resource
  (`nvidia.com/*`) or a GPU DRA driver: then it is reported `unmapped` and the codec counts every card as held.

The protocol is loaded at run time from `podresources.proto` (package data) by `grpc.protos_and_services`.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gpuplane.kube.api import ApiError, KubeApi, node_path
from gpuplane.kube.foreign import (
    DRA_GPU_DRIVERS,
    FOREIGN_CARDS,
    ForeignHold,
    ForeignReport,
    UnmappedDevice,
    foreign_gpu_resource,
)
from gpuplane.kube.objects import DOMAIN, annotations_of
from gpuplane.model import GpuplaneError
from gpuplane.node.device_plugin import Wire
from gpuplane.node.gpu import DeviceBackend, GpuBackendError

__all__ = [
    "DEFAULT_SOCKET", "CardIds", "ForeignCardsReporter", "HeldDevices", "PodResourcesClient", "PodResourcesError",
    "foreign_report", "held_devices", "protocol",
]

log = logging.getLogger(__name__)

PROTO = "gpuplane/node/podresources.proto"
"""The protocol, as a path on `sys.path` (the package's own directory)."""
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
_DRA_DEVICE = re.compile(r"^gpu-(\d+)(?:-mig-.*)?$")


@functools.cache
def protocol() -> Wire:
    messages, services = grpc.protos_and_services(PROTO)
    return Wire(messages, services)


class PodResourcesError(GpuplaneError):
    """The kubelet's PodResources API could not be read."""


@dataclass(frozen=True, slots=True)
class HeldDevices:
    """Devices one container holds through one resource (device plugin) or one DRA claim's device."""

    pod: str
    """namespace/name"""
    container: str
    resource: str
    """The extended resource, or the DRA driver's name."""
    device_ids: tuple[str, ...]
    """Device-plugin IDs; for DRA the device name, then its CDI device names."""
    dra: bool = False


def held_devices(response: Any) -> list[HeldDevices]:
    """What a `ListPodResourcesResponse` says each container holds, flattened."""
    out: list[HeldDevices] = []
    for pod in response.pod_resources:
        key = f"{pod.namespace}/{pod.name}"
        for container in pod.containers:
            for devices in container.devices:
                out.append(HeldDevices(key, container.name, devices.resource_name, tuple(devices.device_ids)))
            for claim in container.dynamic_resources:
                for resource in claim.claim_resources:
                    names = (resource.device_name, *(c.name for c in resource.cdi_devices))
                    out.append(HeldDevices(key, container.name, resource.driver_name, names, dra=True))
    return out


class PodResourcesClient:
    """A client of the kubelet's `PodResourcesLister` on its unix socket."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = protocol().services.PodResourcesListerStub(self._channel)

    def list(self) -> list[HeldDevices]:
        """Every container's devices. Raises `PodResourcesError` when the kubelet does not answer."""
        try:
            response = self._stub.List(protocol().messages.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise PodResourcesError(f"PodResources List on {self.socket_path}: {exc.code().name}: "
                                    f"{exc.details()}") from None
        return held_devices(response)

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True, slots=True)
class CardIds:
    """How other stacks name this node's cards: GPU UUIDs, MIG device UUIDs (to their parent card), minors."""

    by_uuid: Mapping[str, int]
    by_mig_uuid: Mapping[str, int]
    by_minor: Mapping[int, int]

    @staticmethod
    def from_backend(backend: DeviceBackend) -> CardIds:
        """Read from the backend: every card's UUID and minor, and the MIG devices of cards in MIG mode. Raises
        `GpuBackendError`."""
        infos = backend.describe()
        migs: dict[str, int] = {}
        for info in infos:
            if info.mig_enabled:
                migs.update((m.uuid, info.index) for m in backend.mig_instances(info.index) if m.uuid)
        return CardIds({i.uuid: i.index for i in infos}, migs,
                       {(i.minor if i.minor is not None else i.index): i.index for i in infos})

    def card_of(self, device_id: str) -> int | None:
        """The card a device-plugin ID names (a UUID, a `<uuid>::<n>` replica, a MIG UUID), or None."""
        base = device_id.split("::", 1)[0]
        card = self.by_uuid.get(base)
        return card if card is not None else self.by_mig_uuid.get(base)

    def dra_card(self, names: Sequence[str]) -> int | None:
        """The card a DRA device names: by a CDI device (`vendor/class=<uuid>`), else by `gpu-<minor>[-mig-…]`."""
        device, *cdi = names
        for name in cdi:
            card = self.card_of(name.rpartition("=")[2])
            if card is not None:
                return card
        match = _DRA_DEVICE.match(device)
        return self.by_minor.get(int(match.group(1))) if match else None


def foreign_report(held: Iterable[HeldDevices], ids: CardIds) -> ForeignReport:
    """The cards other stacks hold, with their pods and resources; GPU devices naming no card are `unmapped`."""
    pods: dict[int, set[str]] = {}
    resources: dict[int, set[str]] = {}
    unmapped: set[UnmappedDevice] = set()
    for entry in held:
        if entry.resource.startswith(f"{DOMAIN}/"):
            continue  # gpuplane's own
        if entry.dra:
            if entry.resource not in DRA_GPU_DRIVERS:
                continue
            found = [ids.dra_card(entry.device_ids)]
            gpu = True
        else:
            found = [ids.card_of(d) for d in entry.device_ids]
            gpu = foreign_gpu_resource(entry.resource)
        for device, card in zip(entry.device_ids, found, strict=False):
            if card is None:
                if gpu:
                    unmapped.add(UnmappedDevice(entry.pod, entry.resource, device))
                continue
            pods.setdefault(card, set()).add(entry.pod)
            resources.setdefault(card, set()).add(entry.resource)
    holds = tuple(ForeignHold(c, tuple(sorted(pods[c])), tuple(sorted(resources[c]))) for c in sorted(pods))
    return ForeignReport(holds, tuple(sorted(unmapped, key=lambda u: (u.pod, u.resource, u.device))))


class ForeignCardsReporter:
    """Publishes what other stacks hold on this node (`tick`, every `interval_s` by `run`), only when it changes.

    A round whose PodResources listing or card reading fails publishes nothing (the last report stands; kubelet
    keeps handing out what it recorded). The first round reads the node's annotation, so a restarted agent does
    not write an unchanged report again."""

    def __init__(self, api: KubeApi, node: str, client: PodResourcesClient, backend: DeviceBackend) -> None:
        self.api = api
        self.node = node
        self.client = client
        self.backend = backend
        self.published: str | None = None
        """The report on the node, as last read or written."""
        self.patches = 0

    def report(self) -> ForeignReport:
        """This round's report. Raises `PodResourcesError` or `GpuBackendError`."""
        return foreign_report(self.client.list(), CardIds.from_backend(self.backend))

    def tick(self) -> bool:
        """One round; True when it wrote the annotation."""
        try:
            encoded = self.report().encode()
        except (PodResourcesError, GpuBackendError) as exc:
            log.warning("foreign cards not refreshed: %s", exc)
            return False
        if self.published is None:
            self.published = annotations_of(self.api.get(node_path(self.node))).get(FOREIGN_CARDS, "")
        if encoded == self.published:
            return False
        self.api.patch(node_path(self.node), {"metadata": {"annotations": {FOREIGN_CARDS: encoded}}})
        self.published = encoded
        self.patches += 1
        log.info("node %s: foreign cards %s", self.node, encoded)
        return True

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        while not stop.is_set():
            try:
                self.tick()
            except (GpuplaneError, ApiError, OSError) as exc:  # the API server may be away: the next round retries
                log.warning("foreign cards not published: %s", exc)
            stop.wait(interval_s)
