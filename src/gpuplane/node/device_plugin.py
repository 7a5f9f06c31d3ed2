"""The device plugin: gpuplane's cards as kubelet sees them (kubelet device plugin API v1beta1, gRPC).

Lifecycle (shared/reference/protocols.md §2.4): the plugin serves `DevicePlugin` on `<dir>/gpuplane.sock`,
then calls `Registration/Register` on `<dir>/kubelet.sock` (version `v1beta1`, its endpoint file name, the
resource `gpuplane.io/gpu`); kubelet dials back, asks `GetDevicePluginOptions` and holds `ListAndWatch` open.
A restarted kubelet deletes the directory's sockets and creates a new `kubelet.sock`: `tick` (called every
`interval_s` by `run`, or directly by tests) notices the new `kubelet.sock` (a different inode) and
re-registers, and serves again first when its own socket file is gone.

`ListAndWatch` advertises `split` shareable units per card, `<card uuid>::<k>` for k < split (HAMi's
deviceSplitCount), each with the card's NUMA node, and sends the whole list again whenever a card's health
changes: a card is Unhealthy while the backend cannot read the cards, when it is missing from a reading, or
when its last Xid is critical (`gpuplane.controllers.health.CRITICAL_XIDS`); it turns Healthy again when the
reading recovers.

Split and MIG mode (`Sharing`) are the flags' (`PluginSettings`) until `set_sharing` gives others: the command
takes them from the node's GpuPool (`gpuplane.node.pool_follow`). A new split sends the new list at once and is
published in the inventory; a new MIG mode is published and applied by the next MIG reconcile. A smaller split
takes units away; kubelet copes (its device manager, `genericDeviceUpdateCallback`, `devicesToAllocate`): each
list replaces its set of the resource's devices, so the vanished units leave the node's capacity and allocatable
at its next status update, while the units already allocated stay recorded against their containers (kubelet's
checkpoint) until their pods end. Running containers keep running and keep what Allocate handed them (nothing is
revoked or evicted; a restarted container reuses its recorded units without a new Allocate), and new pods get
only units still listed and not in use. Until those pods end, the node may hold more containers than the new
split allows (kube-scheduler then sees allocatable below what is requested there and places no more), and one
caveat: a pod kubelet admits again (after a kubelet restart with its container not running, or a node reboot)
is refused with "previously allocated devices are no longer healthy", as for a unit turned Unhealthy; drain the
node first where that matters. Allocate still accepts a unit up to the largest split advertised, for a pick
kubelet made from a list sent before the split shrank (the unit names no card slot: what a container gets is the
scheduler's assignment). `Allocate` hands each container what the scheduler assigned (`gpuplane.node.allocation`),
creating a MIG instance the assignment names when it does not exist yet; an unknown unit fails with
`NOT_FOUND`, an unhealthy one or no pod to match with `FAILED_PRECONDITION`, and either pushes a fresh
`ListAndWatch` update. When the assigned instance cannot be placed next to the instances present, instances no
live pod holds make way for it (those overlapping it first, then all of them).

MIG reconcile (`reconcile_mig`, every `tick`, in every mode while a card is in MIG mode, or ought to be (ON)): each
MIG-mode card's instances are compared with the MIG shares of the pods bound to this node that have not finished
(`AssignmentSource.holders`).
An instance no such pod holds is destroyed once it has been unheld for `mig_grace_s` (a pod being created, or a
new pod placed where a deleted one was, is not raced); in DYNAMIC and OFF mode a card left without instances that
no live pod has wanted for `mig_grace_s` leaves MIG mode; in ON mode a card stays in MIG mode, and one found out
of it is put back. An instance a live pod holds is never destroyed, and nothing is destroyed while the pods
cannot be listed in full, so a card is never forced out of MIG mode: under OFF, a card whose instances live pods
hold (or want) stays in MIG mode, logged once, and leaves it in the round after they end. `Allocate` puts a card
into MIG mode for a MIG share in DYNAMIC and ON mode, never in OFF (refused, FAILED_PRECONDITION: the scheduler
places no MIG share on an OFF node); on a card still in MIG mode it serves the share, assigned before the mode
changed. A backend error leaves the card as it is; it is logged and tried again next round.

The node inventory (annotation `gpuplane.io/gpu-inventory`) is built from the backend (`node_inventory`) and
published at start and whenever it changes. The protocol is loaded at run time from `deviceplugin.proto`
(package data) by `grpc.protos_and_services`.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import grpc

from gpuplane.controllers.health import CRITICAL_XIDS
from gpuplane.kube.api import KubeApi, node_path
from gpuplane.kube.objects import INVENTORY, RES_GPU, CardInventory, NodeInventory
from gpuplane.model import CardModel, Catalog, CatalogError, GpuplaneError, MigMode, RdmaNic, default_catalog
from gpuplane.node.allocation import (
    AllocationSettings,
    AssignmentSource,
    ContainerAllocation,
    container_allocation,
    match_pod,
    prepare_host,
)
from gpuplane.node.gpu import CardInfo, DeviceBackend, GpuBackendError, MigInstance
from gpuplane.node.mig import MigPlan, Wanted, apply_plan, held_instances, plan_layout, wanted_from_assignments

__all__ = [
    "DEFAULT_DIR", "ENDPOINT", "HEALTHY", "KUBELET_SOCKET", "UNHEALTHY", "VERSION", "AdvertisedDevice",
    "DevicePlugin", "DevicePluginError", "MigReconcile", "PluginSettings", "Sharing", "Wire", "canonical_model",
    "node_inventory", "node_model", "protocol", "publish_inventory",
]

log = logging.getLogger(__name__)

PROTO = "gpuplane/node/deviceplugin.proto"
"""The protocol, as a path on `sys.path` (the package's own directory)."""
VERSION = "v1beta1"
DEFAULT_DIR = "/var/lib/kubelet/device-plugins/"
KUBELET_SOCKET = "kubelet.sock"
ENDPOINT = "gpuplane.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class DevicePluginError(GpuplaneError):
    """The plugin cannot start (no cards, a socket it cannot serve on)."""


@dataclass(frozen=True, slots=True)
class Wire:
    """The runtime-generated `deviceplugin_pb2` (messages) and `_pb2_grpc` (services) modules (untyped: kept
    behind this module's typed functions)."""

    messages: Any
    services: Any


@functools.cache
def protocol() -> Wire:
    messages, services = grpc.protos_and_services(PROTO)
    return Wire(messages, services)


def _abort(context: Any, code: Any, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("grpc's abort returned")  # pragma: no cover


# -- the inventory ------------------------------------------------------------------------------------------


def canonical_model(nvml_name: str, total_bytes: int, catalog: Catalog) -> str:
    """The catalog's name for a card NVML calls `nvml_name` ("NVIDIA H100 80GB HBM3" → "H100-80GB"): the models
    whose family ("H100", "A100", "L40S") is a word of the name, the closest in memory when several are.
    Raises `CatalogError` when none is."""
    if nvml_name in catalog:
        return catalog.canonical(nvml_name)
    words = {w for w in re.split(r"[\s\-_/]+", nvml_name.upper()) if w} - {"NVIDIA", "TESLA"}
    candidates = [m for m in catalog if m.name.split("-")[0].upper() in words
                  or any(a.upper() in words for a in m.aliases)]
    if not candidates:
        raise CatalogError(f"no catalog model for the card {nvml_name!r} (known: {', '.join(catalog.names)})")
    mib = total_bytes / (1 << 20)
    return min(candidates, key=lambda m: (abs(m.memory_mib - mib), m.name)).name


def _nvlink_groups(infos: Sequence[CardInfo]) -> tuple[tuple[int, ...], ...]:
    """Connected groups (of two or more cards) of the NVLink peer graph."""
    seen: set[int] = set()
    groups = []
    for info in infos:
        if info.index in seen or not info.nvlink_peers:
            continue
        group: set[int] = set()
        todo = [info.index]
        while todo:
            card = todo.pop()
            if card in group:
                continue
            group.add(card)
            todo += [p for p in infos[card].nvlink_peers if p not in group]
        seen |= group
        if len(group) > 1:
            groups.append(tuple(sorted(group)))
    return tuple(groups)


def node_model(infos: Sequence[CardInfo], catalog: Catalog) -> CardModel:
    """The catalog model of the node's cards (every card canonicalised: one model per node). Raises
    `CatalogError` for no cards, a model the catalog lacks, or cards of several models."""
    if not infos:
        raise CatalogError("no cards to describe")
    names = {canonical_model(i.name, i.total_bytes, catalog) for i in infos}
    if len(names) > 1:
        raise CatalogError(f"one model per node, found {', '.join(sorted(names))}")
    return catalog.get(names.pop())


def node_inventory(infos: Sequence[CardInfo], catalog: Catalog, *, split: int = 10,
                   mig_mode: MigMode | None = None, model: CardModel | None = None,
                   nics: Sequence[RdmaNic] = ()) -> NodeInventory:
    """The node's `NodeInventory` from its cards: model (canonical; `node_model` unless given), index, UUID,
    NUMA (0 when unknown), NVLink groups, and the RDMA `nics`. NVML does not name PCIe switches: a card's NUMA
    node stands in for its switch. `mig_mode` defaults to DYNAMIC for a MIG-capable model, OFF otherwise. Raises
    `CatalogError` as `node_model` does."""
    if model is None:
        model = node_model(infos, catalog)
    if mig_mode is None:
        mig_mode = MigMode.DYNAMIC if model.mig_capable else MigMode.OFF
    cards = tuple(CardInventory(i.index, i.uuid, i.numa or 0, i.numa or 0) for i in infos)
    return NodeInventory(model.name, cards, _nvlink_groups(infos), tuple(nics), mig_mode=mig_mode, split=split)


def publish_inventory(api: KubeApi, node: str, inventory: NodeInventory) -> None:
    """Write the inventory on the node (a merge PATCH of annotation `gpuplane.io/gpu-inventory`)."""
    api.patch(node_path(node), {"metadata": {"annotations": {INVENTORY: inventory.encode()}}})


# -- the plugin ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginSettings:
    node_name: str
    directory: Path = Path(DEFAULT_DIR)
    endpoint: str = ENDPOINT
    resource: str = RES_GPU
    split: int = 10
    """Units per card: containers that may share one card (until `set_sharing` gives another)."""
    allocation: AllocationSettings = field(default_factory=AllocationSettings)
    mig_mode: MigMode | None = None
    """The MIG mode (None: DYNAMIC for MIG-capable models, else OFF), until `set_sharing` gives another."""
    register_timeout_s: float = 5.0
    nics: tuple[RdmaNic, ...] = ()
    """The RDMA NICs published in the inventory (`gpuplane.node.rdma.rdma_nics`: the PFs the RDMA plugin serves)."""
    mig_grace_s: float = 60.0
    """How long a MIG instance no live pod holds (and a MIG card no live pod wants) is left before the reconcile
    destroys it (turns MIG mode off)."""

    def __post_init__(self) -> None:
        if self.split < 1:
            raise ValueError(f"split must be at least 1, got {self.split}")
        if self.mig_grace_s < 0:
            raise ValueError(f"mig_grace_s must not be negative, got {self.mig_grace_s}")
        if "/" in self.endpoint or self.endpoint == KUBELET_SOCKET:
            raise ValueError(f"endpoint {self.endpoint!r}: a socket file name in the directory, not kubelet.sock")


@dataclass(frozen=True, slots=True)
class Sharing:
    """How the node's cards are shared: units per card and the MIG mode (None: DYNAMIC for MIG-capable models,
    else OFF). The flags' (`PluginSettings`) until `DevicePlugin.set_sharing` gives the node's GpuPool's."""

    split: int
    mig_mode: MigMode | None = None

    def __post_init__(self) -> None:
        if self.split < 1:
            raise ValueError(f"split must be at least 1, got {self.split}")

    def describe(self) -> str:
        return f"split {self.split}, MIG mode {self.mig_mode.value if self.mig_mode else 'by card model'}"


@dataclass(frozen=True, slots=True)
class AdvertisedDevice:
    id: str
    healthy: bool
    numa: int | None


@dataclass(frozen=True, slots=True)
class MigReconcile:
    """What one MIG reconcile round did."""

    destroyed: tuple[MigInstance, ...] = ()
    mig_off: tuple[int, ...] = ()
    """Cards that left MIG mode."""
    mig_on: tuple[int, ...] = ()
    """Cards put back into MIG mode (ON)."""
    errors: tuple[str, ...] = ()
    """What failed (left as it was, tried again next round)."""

    def __add__(self, other: MigReconcile) -> MigReconcile:
        return MigReconcile(self.destroyed + other.destroyed, self.mig_off + other.mig_off,
                            self.mig_on + other.mig_on, self.errors + other.errors)

    @staticmethod
    def failed(message: str) -> MigReconcile:
        """A failure, logged: the card is left as it is and tried again next round."""
        log.warning("MIG reconcile: %s (left as it is; tried again next round)", message)
        return MigReconcile(errors=(message,))


class DevicePlugin:
    """The `DevicePlugin` service and its registration with kubelet. Methods named like the RPCs are the
    servicer; `start`, `tick`, `run` and `stop` drive it; `set_sharing` (any thread) changes the split and MIG
    mode. `clock` (seconds) times the MIG grace period."""

    def __init__(self, settings: PluginSettings, backend: DeviceBackend, source: AssignmentSource, *,
                 catalog: Catalog | None = None, publish: Callable[[NodeInventory], None] | None = None,
                 max_workers: int = 16, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.backend = backend
        self.source = source
        self.catalog = catalog if catalog is not None else default_catalog()
        self._clock = clock
        self._publish = publish
        self._max_workers = max_workers
        self._cards: list[CardInfo] = []
        self.model: CardModel | None = None
        """The node's card model (`node_model`, worked out once by `start`); None when it cannot be."""
        self._model_error = "the cards are not read yet"
        self._health: dict[str, bool] = {}
        """card UUID -> healthy"""
        self._version = 0
        """Bumped on every change ListAndWatch must send."""
        self._cond = threading.Condition()
        self._stopping = False
        self._alloc_lock = threading.Lock()
        """Held by Allocate and the MIG reconcile: one changes the MIG layout at a time."""
        self._unheld: dict[tuple[int, int, int, int], float] = {}
        """(card, GPU instance ID, profile ID, start) -> when the reconcile first found no live pod holding it."""
        self._unwanted: dict[int, float] = {}
        """card -> when the reconcile first found no live pod with a MIG share on it."""
        self._mig_pending: set[int] = set()
        """Cards whose MIG mode change waits for a GPU reset (logged once)."""
        self._server: Any = None
        self._served_inode: int | None = None
        self._registered_with: tuple[int, int] | None = None
        """(inode, ctime) of the kubelet.sock registered with."""
        self._published: str | None = None
        self._publish_lock = threading.Lock()
        self._sharing = Sharing(settings.split, settings.mig_mode)
        """In force now (guarded by `_cond`)."""
        self._max_split = settings.split
        """The largest split advertised since start: units up to it are still accepted by Allocate."""
        self._kept_in_mig: set[int] = set()
        """Cards whose leaving MIG mode (mode OFF) waits for their live instances to end (logged once)."""
        self.registrations = 0
        """Successful Register calls (tests count re-registrations)."""

    # -- paths and state --------------------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        return self.settings.directory / self.settings.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return self.settings.directory / KUBELET_SOCKET

    @property
    def cards(self) -> list[CardInfo]:
        return list(self._cards)

    @property
    def sharing(self) -> Sharing:
        """The split and MIG mode in force."""
        with self._cond:
            return self._sharing

    def set_sharing(self, sharing: Sharing) -> bool:
        """Use `sharing` from now on (the node's GpuPool's, or the flags'); whether it changed anything. A new split
        is sent to kubelet at once (a ListAndWatch update) and published in the inventory with the MIG mode; the
        MIG reconcile (`tick`) applies a new MIG mode. Safe from any thread."""
        with self._cond:
            old = self._sharing
            if sharing == old:
                return False
            self._sharing = sharing
            self._max_split = max(self._max_split, sharing.split)
            if sharing.split != old.split:
                self._version += 1
                self._cond.notify_all()
        log.info("sharing: %s (was %s)", sharing.describe(), old.describe())
        self._publish_inventory()
        return True

    def devices(self) -> list[AdvertisedDevice]:
        """What ListAndWatch advertises now."""
        with self._cond:
            return self._devices()

    def _devices(self) -> list[AdvertisedDevice]:
        return [AdvertisedDevice(f"{card.uuid}::{k}", self._health.get(card.uuid, False), card.numa)
                for card in self._cards for k in range(self._sharing.split)]

    def _bump(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    # -- driving ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Read the cards, publish the inventory, serve, and register (a kubelet not there yet is retried by
        `tick`). Raises `DevicePluginError` when the cards cannot be read or the socket cannot be served."""
        try:
            self._cards = self.backend.describe()
        except GpuBackendError as exc:
            raise DevicePluginError(f"cannot read the cards: {exc}") from exc
        if not self._cards:
            raise DevicePluginError("no GPU cards on this node")
        try:
            self.model = node_model(self._cards, self.catalog)
        except CatalogError as exc:
            self.model, self._model_error = None, str(exc)
            log.warning("no inventory published and no MIG instances made: %s", exc)
        self.settings.directory.mkdir(parents=True, exist_ok=True)
        self._stopping = False
        self._check_health()
        self._publish_inventory()
        self._serve()
        self._register()

    def tick(self) -> None:
        """One round of watching: card health, the inventory, our socket and kubelet's, the MIG instances."""
        self._check_health()
        try:
            cards = self.backend.describe()
        except GpuBackendError as exc:
            log.debug("describe failed: %s", exc)
        else:
            if cards and [c.uuid for c in cards] == [c.uuid for c in self._cards]:
                self._cards = cards
                self._publish_inventory()
        if self._server is None or self._inode(self.socket_path) != self._served_inode:
            log.warning("%s is gone: serving again", self.socket_path)
            self._serve()
            self._registered_with = None
        identity = self._identity(self.kubelet_socket)
        if identity is not None and identity != self._registered_with:
            self._register()
        self.reconcile_mig()

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """`tick` every `interval_s` until `stop` is set."""
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:  # keep watching: one bad round must not end the plugin
                log.exception("device plugin round failed")

    def stop(self, grace_s: float | None = 1.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait()
        self._served_inode = None

    @staticmethod
    def _inode(path: Path) -> int | None:
        try:
            return path.stat().st_ino
        except OSError:
            return None

    @staticmethod
    def _identity(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        path = self.socket_path
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise DevicePluginError(f"cannot remove the stale socket {path}: {exc}") from exc
        server = grpc.server(ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="gpuplane-dp"))
        protocol().services.add_DevicePluginServicer_to_server(self, server)
        if not server.add_insecure_port(f"unix://{path.absolute()}"):
            raise DevicePluginError(f"cannot serve on {path}")
        server.start()
        with self._cond:
            self._stopping = False
        self._server = server
        self._served_inode = self._inode(path)
        log.info("device plugin serving %s on %s", self.settings.resource, path)

    def _register(self) -> bool:
        identity = self._identity(self.kubelet_socket)
        if identity is None:
            log.info("no %s yet: registering when it appears", self.kubelet_socket)
            return False
        pb = protocol().messages
        request = pb.RegisterRequest(version=VERSION, endpoint=self.settings.endpoint,
                                     resource_name=self.settings.resource,
                                     options=pb.DevicePluginOptions(pre_start_required=False,
                                                                    get_preferred_allocation_available=False))
        with grpc.insecure_channel(f"unix://{self.kubelet_socket.absolute()}") as channel:
            try:
                protocol().services.RegistrationStub(channel).Register(request,
                                                                       timeout=self.settings.register_timeout_s)
            except grpc.RpcError as exc:
                log.warning("Register with %s failed: %s %s", self.kubelet_socket, exc.code(), exc.details())
                return False
        self._registered_with = identity
        self.registrations += 1
        log.info("registered %s with kubelet (%s)", self.settings.resource, self.kubelet_socket)
        return True

    def _check_health(self) -> None:
        try:
            readings = {r.uuid: r for r in self.backend.cards()}
        except GpuBackendError as exc:
            health = dict.fromkeys((c.uuid for c in self._cards), False)
            failure: str | None = str(exc)
        else:
            health = {c.uuid: c.uuid in readings and (readings[c.uuid].xid_last or 0) not in CRITICAL_XIDS
                      for c in self._cards}
            failure = None
        with self._cond:
            if health == self._health:
                return
            for card in self._cards:
                if health[card.uuid] != self._health.get(card.uuid):
                    log.log(logging.INFO if health[card.uuid] else logging.WARNING, "card %d (%s): %s%s",
                            card.index, card.uuid, HEALTHY if health[card.uuid] else UNHEALTHY,
                            f" ({failure})" if failure and not health[card.uuid] else "")
            self._health = health
            self._version += 1
            self._cond.notify_all()

    def _publish_inventory(self) -> None:
        if self._publish is None or self.model is None:
            return
        with self._publish_lock:  # tick and set_sharing may both publish: one at a time, the newest last
            sharing = self.sharing
            inventory = node_inventory(self._cards, self.catalog, split=sharing.split, mig_mode=sharing.mig_mode,
                                       model=self.model, nics=self.settings.nics)
            encoded = inventory.encode()
            if encoded == self._published:
                return
            try:
                self._publish(inventory)
            except Exception as exc:  # the API server may be away; try again next round
                log.warning("publishing the inventory failed: %s", exc)
                return
            self._published = encoded

    # -- gRPC servicer (requests and contexts are the runtime-generated protobuf and grpc objects) ------------

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:  # the RPCs keep their protocol names
        return protocol().messages.DevicePluginOptions(pre_start_required=False,
                                                       get_preferred_allocation_available=False)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        """The full list now, then again after every change, until kubelet hangs up or the plugin stops."""
        pb = protocol().messages
        context.add_callback(self._wake)
        with self._cond:
            version, devices = self._version, self._devices()
        while True:
            yield pb.ListAndWatchResponse(devices=[
                pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY,
                          topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa)]) if d.numa is not None else None)
                for d in devices])
            with self._cond:
                while self._version == version and not self._stopping and context.is_active():
                    self._cond.wait()
                if self._stopping or not context.is_active():
                    return
                version, devices = self._version, self._devices()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        """Not offered (`get_preferred_allocation_available` is false); answers with kubelet's own choice."""
        pb = protocol().messages
        return pb.PreferredAllocationResponse(container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=list(r.must_include_deviceIDs) + [
                d for d in r.available_deviceIDs if d not in r.must_include_deviceIDs
            ][:max(0, r.allocation_size - len(r.must_include_deviceIDs))])
            for r in request.container_requests])

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return protocol().messages.PreStartContainerResponse()

    def Allocate(self, request: Any, context: Any) -> Any:
        pb = protocol().messages
        responses = []
        with self._alloc_lock:
            for number, container_request in enumerate(request.container_requests):
                ids = list(container_request.devices_ids)
                allocation = self._allocate(ids, number, context)
                responses.append(pb.ContainerAllocateResponse(
                    envs=allocation.envs,
                    mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                            for m in allocation.mounts],
                    devices=[pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path,
                                           permissions=d.permissions) for d in allocation.devices],
                    annotations=allocation.annotations or {}))
        return pb.AllocateResponse(container_responses=responses)

    def _fail(self, context: Any, code: Any, message: str) -> NoReturn:
        log.warning("Allocate refused: %s", message)
        self._check_health()
        self._bump()  # kubelet gets a fresh list with the failure
        _abort(context, code, message)

    def _allocate(self, ids: Sequence[str], number: int, context: Any) -> ContainerAllocation:
        by_uuid = {c.uuid: c for c in self._cards}
        with self._cond:
            health = dict(self._health)
            split, units = self._sharing.split, self._max_split
        for device in ids:
            uuid, sep, k = device.rpartition("::")
            if not sep or uuid not in by_uuid or not k.isdigit() or int(k) >= units:
                self._fail(context, grpc.StatusCode.NOT_FOUND,
                           f"container request {number}: unknown device {device!r} (this plugin advertises "
                           f"<card uuid>::<0..{split - 1}>)")
            if not health.get(uuid, False):
                self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                           f"container request {number}: device {device!r} is {UNHEALTHY}")
        try:
            pending = self.source.pending()
        except Exception as exc:  # the API server may be away: kubelet retries the container
            self._fail(context, grpc.StatusCode.UNAVAILABLE, f"cannot list the pods waiting for devices: {exc}")
        match = match_pod(pending, len(ids))
        if match is None:
            self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                       f"container request {number}: no pod on node {self.settings.node_name} is waiting "
                       f"(bind phase allocating) for {len(ids)} {self.settings.resource}")
        pod, container_number, shares = match
        cards = {c.index: c for c in self._cards}
        for share in shares:
            if share.card not in cards:
                self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                           f"{pod.key}: assigned card {share.card}, this node has {len(cards)}")
            if not health.get(cards[share.card].uuid, False):
                self._fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                           f"{pod.key}: assigned card {share.card} ({cards[share.card].uuid}) is {UNHEALTHY}")
        mig_uuids: dict[int, str] = {}
        for share in shares:
            if share.mig_profile is not None:
                mig_uuid, why = self._mig_device(share.card, share.mig_profile, share.mig_start)
                if mig_uuid is None:
                    self._fail(context, grpc.StatusCode.FAILED_PRECONDITION, f"{pod.key}: {why}")
                mig_uuids[share.card] = mig_uuid
        container = pod.gpu_containers[container_number][0]
        allocation = container_allocation(pod, container, shares, cards, mig_uuids, self.settings.allocation)
        prepare_host(allocation)
        try:
            self.source.mark_handed(pod, container_number + 1)
        except GpuplaneError as exc:  # not recorded: kubelet retries, and this container matches again
            self._fail(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("allocated %s container %s: %s", pod.key, container or "(unnamed)",
                 allocation.envs.get("NVIDIA_VISIBLE_DEVICES"))
        return allocation

    def _mig_device(self, card: int, profile_id: int, start: int | None) -> tuple[str | None, str]:
        """(MIG device UUID, "") of the instance at (profile, start), created if absent; (None, why) if not."""
        try:
            present = self.backend.mig_instances(card)
            for instance in present:
                if instance.profile_id == profile_id and start in (None, instance.start) and instance.uuid:
                    return instance.uuid, ""
            model = self.model
            if model is None:
                return None, f"card {card}: MIG instance (profile {profile_id} at {start}): {self._model_error}"
            info = self._cards[card]
            if not info.mig_enabled and self.mig_mode() is MigMode.OFF:
                return None, (f"card {card}: MIG instance (profile {profile_id} at {start}): the node's MIG mode is "
                              "off and the card is not in MIG mode")
            wanted = Wanted(profile_id, start)
            plan, status = plan_layout(model, card, [Wanted(m.profile_id, m.start) for m in present] + [wanted],
                                       present, info.mig_enabled)
            if plan is None:
                plan = self._plan_over_unheld(model, card, wanted, present, info.mig_enabled)
            if plan is None:
                return None, f"card {card}: {status.message}"
            result = apply_plan(self.backend, plan)
            for instance in result.destroyed:
                log.info("card %d: destroyed GPU instance %d (profile %d at %d, held by no live pod) to make way",
                         card, instance.gpu_instance_id, instance.profile_id, instance.start)
            if not result.status.ok:
                return None, f"card {card}: {result.status.message}"
            for instance in result.created:
                if instance.profile_id == profile_id and instance.uuid:
                    self._cards[card] = replace(info, mig_enabled=True)
                    self._mig_pending.discard(card)
                    return instance.uuid, ""
        except GpuBackendError as exc:
            return None, f"card {card}: MIG instance (profile {profile_id} at {start}): {exc}"
        return None, f"card {card}: no MIG device for profile {profile_id} at {start}"

    def _plan_over_unheld(self, model: CardModel, card: int, wanted: Wanted, present: Sequence[MigInstance],
                          mig_enabled: bool | None) -> MigPlan | None:
        """A plan that places `wanted` by destroying instances no live pod holds: those overlapping it first,
        then all of them; None when there is none, or when the pods cannot be listed in full."""
        try:
            holders = self.source.holders()
        except Exception as exc:  # the API server may be away: destroy nothing blind
            log.warning("card %d: cannot tell which MIG instances are free: %s", card, exc)
            return None
        held = held_instances(present, wanted_from_assignments([h.assignment for h in holders], card))
        profile = model.mig_profile(wanted.profile_id)
        mask = profile.slot_mask(wanted.start) if profile is not None and wanted.start is not None else -1
        apart = [m for m in present if m not in held and not m.mask & mask]
        for keep in (list(held) + apart, list(held)):
            plan, _ = plan_layout(model, card, [Wanted(m.profile_id, m.start) for m in keep] + [wanted], present,
                                  mig_enabled)
            if plan is not None:
                return plan
        return None

    # -- MIG reconcile ------------------------------------------------------------------------------------------

    def mig_mode(self) -> MigMode:
        """The node's MIG mode: the one in force (`sharing`), or DYNAMIC when the cards have MIG and OFF when they
        do not."""
        mode = self.sharing.mig_mode
        if mode is not None:
            return mode
        return MigMode.DYNAMIC if any(c.mig_enabled is not None for c in self._cards) else MigMode.OFF

    def reconcile_mig(self) -> MigReconcile:
        """One round of making the MIG-mode cards' instances those of the live pods' MIG shares (the module
        docstring has the rules). Lists the pods only when some card is in MIG mode, or ought to be (ON)."""
        mode = self.mig_mode()
        cards = [c for c in self._cards if c.mig_enabled is not None]
        if mode is not MigMode.OFF:
            self._kept_in_mig.clear()
        if not cards or (mode is not MigMode.ON and not any(c.mig_enabled for c in cards)):
            self._unheld.clear()
            self._unwanted.clear()
            self._kept_in_mig.clear()
            return MigReconcile()
        with self._alloc_lock:
            try:
                holders = self.source.holders()
            except Exception as exc:  # GpuplaneError, or a source's own failure: destroy nothing blind
                log.warning("MIG reconcile skipped: cannot tell which pods hold MIG instances: %s", exc)
                return MigReconcile(errors=(f"holders: {exc}",))
            now = self._clock()
            assignments = [h.assignment for h in holders]
            done = MigReconcile()
            for card in cards:
                done += self._reconcile_card(card.index, mode, wanted_from_assignments(assignments, card.index), now)
            return done

    def _reconcile_card(self, index: int, mode: MigMode, wanted: Sequence[Wanted], now: float) -> MigReconcile:
        grace = self.settings.mig_grace_s
        if wanted:
            self._unwanted.pop(index, None)
        else:
            self._unwanted.setdefault(index, now)
        if not self._cards[index].mig_enabled:
            self._forget_unheld(index, set())
            return self._set_mig_mode(index, True) if mode is MigMode.ON else MigReconcile()
        try:
            present = self.backend.mig_instances(index)
        except GpuBackendError as exc:
            return MigReconcile.failed(f"card {index}: {exc}")
        held = held_instances(present, wanted)
        keys = {(index, m.gpu_instance_id, m.profile_id, m.start) for m in present}
        self._forget_unheld(index, keys)
        done = MigReconcile()
        remaining = len(present)
        for instance in present:
            key = (index, instance.gpu_instance_id, instance.profile_id, instance.start)
            if instance in held:
                self._unheld.pop(key, None)
                continue
            if now - self._unheld.setdefault(key, now) < grace:
                continue
            try:
                self.backend.destroy_mig_instance(index, instance.gpu_instance_id)
            except GpuBackendError as exc:
                done += MigReconcile.failed(f"card {index}: destroying GPU instance {instance.gpu_instance_id}: {exc}")
                continue
            del self._unheld[key]
            remaining -= 1
            done += MigReconcile(destroyed=(instance,))
            log.info("card %d: destroyed GPU instance %d (profile %d at %d): no live pod holds it",
                     index, instance.gpu_instance_id, instance.profile_id, instance.start)
        if mode is MigMode.ON:
            return done
        if not remaining and index in self._unwanted and now - self._unwanted[index] >= grace:
            self._kept_in_mig.discard(index)
            done += self._set_mig_mode(index, False)
        elif mode is MigMode.OFF and index not in self._kept_in_mig and (held or wanted):
            self._kept_in_mig.add(index)
            log.warning("card %d: stays in MIG mode although the node's MIG mode is off: live pods hold or want MIG "
                        "instances on it (%d present); it leaves MIG mode once they end (checked every round)",
                        index, remaining)
        return done

    def _forget_unheld(self, card: int, present: set[tuple[int, int, int, int]]) -> None:
        for key in [k for k in self._unheld if k[0] == card and k not in present]:
            del self._unheld[key]

    def _set_mig_mode(self, index: int, enabled: bool) -> MigReconcile:
        word = "on" if enabled else "off"
        try:
            in_effect = self.backend.set_mig_mode(index, enabled)
        except GpuBackendError as exc:
            return MigReconcile.failed(f"card {index}: MIG mode {word}: {exc}")
        if not in_effect:
            if index not in self._mig_pending:
                log.warning("card %d: MIG mode %s waits for a GPU reset", index, word)
                self._mig_pending.add(index)
            return MigReconcile()
        self._mig_pending.discard(index)
        self._cards[index] = replace(self._cards[index], mig_enabled=enabled)
        log.info("card %d: MIG mode %s", index, word)
        return MigReconcile(mig_on=(index,)) if enabled else MigReconcile(mig_off=(index,))

