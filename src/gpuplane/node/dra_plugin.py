"""The DRA kubelet plugin: gpuplane's cards as a Dynamic Resource Allocation driver (kubelet's `dra/v1`
`DRAPlugin` service and plugin registration v1, gRPC over Unix sockets).

Registration: the plugin serves `Registration` on `<registry dir>/<driver>-reg.sock` (kubelet's plugin watcher
finds it there) and `DRAPlugin` on `<plugins dir>/<driver>/dra.sock`. `GetInfo` answers type `DRAPlugin`, the
driver name, that endpoint and the service versions (`v1.DRAPlugin`); `NotifyRegistrationStatus` records
kubelet's verdict (`registered`, `registration_error`). `tick` serves again when a socket file is gone.

Prepare: kubelet names a claim (namespace, name, UID); the plugin reads the ResourceClaim (`ClaimSource`), takes
the results of `status.allocation.devices.results` that are this driver's and this node's pool, and turns the
devices (`gpuplane.node.dra_slices` names them) into card shares: a whole card, a MIG instance (created when the
card has none of that profile and placement; MIG mode put on first), or a vGPU share of the `memory` and `compute`
capacity the allocation consumed. The claim's environment, mounts and device nodes are the device plugin's
(`gpuplane.node.allocation.container_allocation`: HAMi-core limits for a share, MPS client variables on an MPS
node, the MIG device's UUID for a MIG share), written as one CDI device (`<cdi dir>/gpuplane-<claim uid>.json`,
kind `gpu.gpuplane.io/claim`, device name the claim UID); every allocated device answers with that CDI ID.
The writable host directories the spec mounts (HAMi-core's per-claim cache, its lock directory, MPS's pipes) are
made before it is written, as the device plugin's Allocate makes them (`allocation.prepare_host`).
A claim with two MIG devices of one card is refused (the environment names one MIG device per card).

Idempotence and restarts: what each claim was given (devices, the CDI spec, the MIG instances made for it) is
kept in a checkpoint file (`<plugins dir>/<driver>/checkpoint.json`, replaced atomically). A claim prepared
before is answered from it (its CDI file written again if it is gone) without reading the claim again; unprepare
removes the CDI file, destroys the MIG instances made for the claim and forgets it; an unknown claim unprepares
successfully. A claim that fails is reported in its own entry; the others are prepared.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc

from gpuplane.kube.api import KubeApi
from gpuplane.kube.objects import ObjectError, quantity
from gpuplane.model import (
    MILLI_PER_CARD,
    Assignment,
    CardModel,
    CardShare,
    Catalog,
    CatalogError,
    GpuplaneError,
    default_catalog,
)
from gpuplane.node.allocation import (
    AllocationSettings,
    ContainerAllocation,
    PendingPod,
    container_allocation,
    prepare_host,
)
from gpuplane.node.device_plugin import Wire, node_model
from gpuplane.node.dra_health import HealthBook, HealthService
from gpuplane.node.dra_slices import DRIVER, DeviceKind, parse_device_name
from gpuplane.node.gpu import CardInfo, DeviceBackend, GpuBackendError

__all__ = [
    "CDI_KIND", "CDI_VERSION", "DRA_PLUGIN_SERVICE", "PLUGIN_TYPE", "ClaimSource", "DraPlugin", "DraPluginError",
    "DraSettings", "KubeClaimSource", "MemoryClaimSource", "Prepared", "cdi_spec", "claim_path", "dra_protocol",
    "registration_protocol",
]

log = logging.getLogger(__name__)

DRA_PROTO = "gpuplane/node/draplugin.proto"
REGISTRATION_PROTO = "gpuplane/node/pluginregistration.proto"
DRA_PLUGIN_SERVICE = "v1.DRAPlugin"
"""Upstream `DRAPluginService` (kubelet/pkg/apis/dra/v1/types.go): the supported version for the v1 service."""
PLUGIN_TYPE = "DRAPlugin"
"""Upstream `pluginregistration.DRAPlugin`."""
CDI_VERSION = "0.6.0"
CDI_KIND = f"{DRIVER}/claim"
REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
CDI_DIR = Path("/var/run/cdi")
MIB = 1 << 20


class DraPluginError(GpuplaneError):
    """The plugin cannot start (no cards, a socket it cannot serve on)."""


class ClaimError(GpuplaneError):
    """One claim cannot be prepared or unprepared (reported in its own response entry)."""


@functools.cache
def dra_protocol() -> Wire:
    messages, services = grpc.protos_and_services(DRA_PROTO)
    return Wire(messages, services)


@functools.cache
def registration_protocol() -> Wire:
    messages, services = grpc.protos_and_services(REGISTRATION_PROTO)
    return Wire(messages, services)


def claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


class ClaimSource(Protocol):
    def claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The ResourceClaim object; raises `GpuplaneError` when it cannot be read."""
        ...


class KubeClaimSource:
    def __init__(self, api: KubeApi) -> None:
        self.api = api

    def claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            return self.api.get(claim_path(namespace, name))
        except Exception as exc:  # ApiError, or the transport's own errors
            raise GpuplaneError(f"cannot read ResourceClaim {namespace}/{name}: {exc}") from exc


class MemoryClaimSource:
    """Claims held in memory (tests): (namespace, name) → object; `reads` counts lookups."""

    def __init__(self, claims: Sequence[Mapping[str, Any]] = ()) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.reads = 0
        for claim in claims:
            self.add(claim)

    def add(self, claim: Mapping[str, Any]) -> None:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    def claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.reads += 1
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise GpuplaneError(f"ResourceClaim {namespace}/{name} not found") from None


@dataclass(frozen=True, slots=True)
class DraSettings:
    node_name: str
    driver: str = DRIVER
    registry_dir: Path = REGISTRY_DIR
    plugins_dir: Path = PLUGINS_DIR
    cdi_dir: Path = CDI_DIR
    allocation: AllocationSettings = field(default_factory=AllocationSettings)

    @property
    def pool(self) -> str:
        """The pool of this node's ResourceSlices (`dra_slices.resource_slices`)."""
        return self.node_name

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver}-reg.sock"

    @property
    def plugin_dir(self) -> Path:
        return self.plugins_dir / self.driver

    @property
    def endpoint(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def checkpoint(self) -> Path:
        return self.plugin_dir / "checkpoint.json"


@dataclass(frozen=True, slots=True)
class Prepared:
    """What one claim was given (kept in the checkpoint)."""

    namespace: str
    name: str
    devices: tuple[tuple[str, str, str], ...]
    """(request, pool, device) per allocated device."""
    spec: Mapping[str, Any]
    """The CDI spec written for it."""
    created_mig: tuple[tuple[int, int], ...] = ()
    """(card, GPU instance ID) of the MIG instances made for this claim."""

    def encode(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "devices": [list(d) for d in self.devices],
                "spec": self.spec, "createdMig": [list(m) for m in self.created_mig]}

    @staticmethod
    def decode(raw: Mapping[str, Any]) -> Prepared:
        return Prepared(raw["namespace"], raw["name"], tuple((str(r), str(p), str(d)) for r, p, d in raw["devices"]),
                        raw["spec"], tuple((int(c), int(g)) for c, g in raw.get("createdMig", ())))


def cdi_spec(claim_uid: str, edits: ContainerAllocation) -> dict[str, Any]:
    """One CDI device named for the claim with the container edits of `edits` (CDI spec: env as `K=V`,
    device nodes with their host path, bind mounts)."""
    container_edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in sorted(edits.envs.items())]}
    if edits.devices:
        container_edits["deviceNodes"] = [{"path": d.container_path, "hostPath": d.host_path,
                                           "permissions": d.permissions} for d in edits.devices]
    if edits.mounts:
        container_edits["mounts"] = [{"hostPath": m.host_path, "containerPath": m.container_path,
                                      "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"]}
                                     for m in edits.mounts]
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND,
            "devices": [{"name": claim_uid, "containerEdits": container_edits}]}


def _write_atomically(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _quantity_mib(raw: object, what: str) -> int:
    """A memory quantity in whole MiB ("10Gi" → 10240); raises `ClaimError` as `_quantity_int`."""
    return _quantity_int(raw, what) // MIB


def _quantity_int(raw: object, what: str) -> int:
    """A quantity as a whole number (rounded down); raises `ClaimError` for no quantity."""
    try:
        value = quantity(raw, "claim", what)
    except ObjectError as exc:
        raise ClaimError(str(exc)) from None
    return int(value)


class DraPlugin:
    """The `Registration`, `DRAPlugin` and `DRAResourceHealth` services. Methods named like the RPCs are the
    servicers (the health stream's is `HealthService`'s); `start`, `tick` and `stop` drive them."""

    def __init__(self, settings: DraSettings, backend: DeviceBackend, claims: ClaimSource, *,
                 catalog: Catalog | None = None, max_workers: int = 8, clock: Callable[[], float] = time.time,
                 health_resend_s: float = 10.0) -> None:
        self.settings = settings
        self.health_book = HealthBook(clock)
        """The devices' health, filled by the slice publisher and streamed to kubelet (`DRAResourceHealth`)."""
        self._health = HealthService(self.health_book, resend_s=health_resend_s)
        self.backend = backend
        self.claims = claims
        self.catalog = catalog if catalog is not None else default_catalog()
        self._max_workers = max_workers
        self._cards: dict[int, CardInfo] = {}
        self.model: CardModel | None = None
        self._lock = threading.Lock()
        self._prepared: dict[str, Prepared] = {}
        self._server: Any = None
        self._inodes: dict[Path, int | None] = {}
        self.registered: bool | None = None
        """kubelet's last verdict (None: none yet)."""
        self.registration_error = ""

    # -- driving ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Read the cards and the checkpoint, then serve both sockets. Raises `DraPluginError`."""
        try:
            cards = self.backend.describe()
        except GpuBackendError as exc:
            raise DraPluginError(f"cannot read the cards: {exc}") from exc
        if not cards:
            raise DraPluginError("no GPU cards on this node")
        self._cards = {c.index: c for c in cards}
        try:
            self.model = node_model(cards, self.catalog)
        except CatalogError as exc:
            self.model = None
            log.warning("no MIG devices can be prepared: %s", exc)
        self._load_checkpoint()
        self._serve()

    def tick(self) -> None:
        """Serve again when a socket file is gone (kubelet's plugin watcher then registers the plugin anew)."""
        if self._server is None or any(self._inode(p) != i for p, i in self._inodes.items()):
            log.warning("a plugin socket is gone: serving again")
            self._serve()

    def stop(self) -> None:
        self.health_book.close()
        if self._server is not None:
            self._server.stop(grace=1.0).wait()
            self._server = None
        for path in (self.settings.registration_socket, self.settings.endpoint):
            path.unlink(missing_ok=True)

    @property
    def prepared(self) -> dict[str, Prepared]:
        """claim UID → what it was given."""
        with self._lock:
            return dict(self._prepared)

    @staticmethod
    def _inode(path: Path) -> int | None:
        try:
            return path.stat().st_ino
        except OSError:
            return None

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)
        paths = (self.settings.registration_socket, self.settings.endpoint)
        server = grpc.server(ThreadPoolExecutor(max_workers=self._max_workers))
        registration, dra = registration_protocol(), dra_protocol()
        registration.services.add_RegistrationServicer_to_server(self, server)
        dra.services.add_DRAPluginServicer_to_server(self, server)
        self._health.add_to(server)
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            try:
                server.add_insecure_port(f"unix://{path}")
            except RuntimeError as exc:
                raise DraPluginError(f"cannot serve on {path}: {exc}") from exc
        server.start()
        self._server = server
        self._inodes = {p: self._inode(p) for p in paths}

    # -- checkpoint ---------------------------------------------------------------------------------------

    def _load_checkpoint(self) -> None:
        path = self.settings.checkpoint
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            prepared = {uid: Prepared.decode(entry) for uid, entry in raw["claims"].items()}
        except FileNotFoundError:
            prepared = {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DraPluginError(f"cannot read the checkpoint {path}: {exc}") from exc
        with self._lock:
            self._prepared = prepared

    def _save_checkpoint(self) -> None:
        _write_atomically(self.settings.checkpoint,
                          {"version": 1, "claims": {u: p.encode() for u, p in sorted(self._prepared.items())}})

    def _cdi_file(self, uid: str) -> Path:
        return self.settings.cdi_dir / f"gpuplane-{uid}.json"

    # -- Registration -------------------------------------------------------------------------------------

    def GetInfo(self, request: Any, context: Any) -> Any:
        return registration_protocol().messages.PluginInfo(
            type=PLUGIN_TYPE, name=self.settings.driver, endpoint=str(self.settings.endpoint),
            supported_versions=[DRA_PLUGIN_SERVICE])

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.registered, self.registration_error = bool(request.plugin_registered), str(request.error)
        if self.registered:
            log.info("registered with kubelet as %s", self.settings.driver)
        else:
            log.error("kubelet refused the registration: %s", self.registration_error)
        return registration_protocol().messages.RegistrationStatusResponse()

    # -- DRAPlugin ----------------------------------------------------------------------------------------

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        messages = dra_protocol().messages
        response = messages.NodePrepareResourcesResponse()
        with self._lock:
            for claim in request.claims:
                entry = response.claims[claim.uid]
                try:
                    prepared = self._prepare(claim.namespace, claim.name, claim.uid)
                except (GpuplaneError, OSError) as exc:
                    log.warning("claim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, exc)
                    entry.error = str(exc)
                    continue
                cdi_id = f"{CDI_KIND}={claim.uid}"
                for request_name, pool, device in prepared.devices:
                    entry.devices.append(messages.Device(request_names=[request_name], pool_name=pool,
                                                         device_name=device, cdi_device_ids=[cdi_id]))
        return response

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = dra_protocol().messages.NodeUnprepareResourcesResponse()
        with self._lock:
            for claim in request.claims:
                entry = response.claims[claim.uid]
                try:
                    self._unprepare(claim.uid)
                except (GpuplaneError, OSError) as exc:
                    log.warning("claim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, exc)
                    entry.error = str(exc)
        return response

    # -- the work (under _lock) ---------------------------------------------------------------------------

    def _prepare(self, namespace: str, name: str, uid: str) -> Prepared:
        known = self._prepared.get(uid)
        if known is not None:
            path = self._cdi_file(uid)
            if not path.exists():
                _write_atomically(path, known.spec)
            return known
        claim = self.claims.claim(namespace, name)
        found_uid = (claim.get("metadata") or {}).get("uid")
        if found_uid != uid:
            raise ClaimError(f"ResourceClaim {namespace}/{name} has UID {found_uid}, kubelet asked for {uid}")
        results = self._results(claim)
        shares: list[CardShare] = []
        created: list[tuple[int, int]] = []
        mig_uuids: dict[int, str] = {}
        try:
            for _request, device, consumed in results:
                share, made = self._share(device, consumed, mig_uuids)
                shares.append(share)
                created += made
        except (GpuplaneError, GpuBackendError):
            self._destroy(created)
            raise
        pod = PendingPod(f"{namespace}/{name}", uid, Assignment(self.settings.node_name, tuple(shares)), 0.0)
        edits = container_allocation(pod, "claim", shares, self._cards, mig_uuids, self.settings.allocation)
        prepare_host(edits)  # the cache and lock directories the CDI spec mounts must exist on the host
        spec = cdi_spec(uid, edits)
        prepared = Prepared(namespace, name, tuple((r, self.settings.pool, d) for r, d, _ in results), spec,
                            tuple(created))
        _write_atomically(self._cdi_file(uid), spec)
        self._prepared[uid] = prepared
        self._save_checkpoint()
        return prepared

    def _results(self, claim: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
        """(request, device, consumedCapacity) of this driver's and this pool's allocated devices."""
        allocation = (claim.get("status") or {}).get("allocation")
        if not isinstance(allocation, Mapping):
            raise ClaimError("the claim is not allocated")
        found = []
        for result in (allocation.get("devices") or {}).get("results") or ():
            if result.get("driver") != self.settings.driver:
                continue
            if result.get("pool") != self.settings.pool:
                raise ClaimError(f"device {result.get('device')} is in pool {result.get('pool')}, "
                                 f"this node's is {self.settings.pool}")
            found.append((str(result.get("request", "")), str(result.get("device", "")),
                          result.get("consumedCapacity") or {}))
        return found

    def _share(self, device: str, consumed: Mapping[str, Any],
               mig_uuids: dict[int, str]) -> tuple[CardShare, list[tuple[int, int]]]:
        ref = parse_device_name(device)
        if ref is None or ref.card not in self._cards:
            raise ClaimError(f"no device {device} on this node")
        card = self._cards[ref.card]
        mib = card.total_bytes // MIB
        if ref.kind is DeviceKind.CARD:
            return CardShare(ref.card, MILLI_PER_CARD, mib, whole=True), []
        if ref.kind is DeviceKind.VGPU:
            memory = _quantity_mib(consumed["memory"], "memory") if "memory" in consumed else mib
            compute = _quantity_int(consumed["compute"], "compute") if "compute" in consumed else MILLI_PER_CARD
            return CardShare(ref.card, compute, memory), []
        model = self.model
        profile = model.mig_profile(ref.profile_id or 0) if model is not None else None
        if model is None or profile is None or ref.start not in profile.starts:
            raise ClaimError(f"device {device}: no such MIG profile and placement on this card's model")
        if ref.card in mig_uuids:
            raise ClaimError(f"device {device}: a second MIG device of card {ref.card} in one claim")
        created: list[tuple[int, int]] = []
        instance = next((m for m in self.backend.mig_instances(ref.card)
                         if m.profile_id == profile.profile_id and m.start == ref.start), None)
        if instance is None:
            if not self._mig_enabled(ref.card) and not self.backend.set_mig_mode(ref.card, True):
                raise ClaimError(f"card {ref.card}: MIG mode waits for a GPU reset")
            instance = self.backend.create_mig_instance(ref.card, profile.profile_id, ref.start)
            created.append((ref.card, instance.gpu_instance_id))
        if instance.uuid is None:
            self._destroy(created)
            raise ClaimError(f"device {device}: the MIG instance has no compute instance")
        mig_uuids[ref.card] = instance.uuid
        share = CardShare(ref.card, model.mig_compute_milli(profile), profile.memory_mib,
                          decoders=profile.decoders, mig_profile=profile.profile_id, mig_start=ref.start)
        return share, created

    def _mig_enabled(self, card: int) -> bool:
        return any(c.index == card and c.mig_enabled for c in self.backend.describe())

    def _destroy(self, instances: Sequence[tuple[int, int]]) -> None:
        for card, gi in instances:
            self.backend.destroy_mig_instance(card, gi)

    def _unprepare(self, uid: str) -> None:
        prepared = self._prepared.get(uid)
        if prepared is None:
            return
        present = {(m.card, m.gpu_instance_id) for card in {c for c, _ in prepared.created_mig}
                   for m in self.backend.mig_instances(card)}
        self._destroy([m for m in prepared.created_mig if m in present])
        self._cdi_file(uid).unlink(missing_ok=True)
        del self._prepared[uid]
        self._save_checkpoint()
