"""The node's cards as DRA ResourceSlices (`resource.k8s.io/v1`), built from the GPU backend.

One pool per node (pool name = node name, driver `gpu.gpuplane.io`). Field names are those of upstream
`k8s.io/api/resource/v1` (types.go); objects are plain JSON dicts. Per card:

- `gpu-<i>`: the whole card. Attributes (the driver's own domain unless qualified): `type` ("gpu"), `model`
  (the catalog's canonical name), `productName` (NVML's), `uuid`, `index`, `numaNode`, `nvlinkGroup` (the
  index of the card's NVLink group, cards joined over NVLink share it), `driverVersion` (a semantic version),
  and the upstream standard `resource.kubernetes.io/pcieRoot`; each only where known. Capacity `memory`
  (the card's, `<MiB>Mi`) and `compute` (1000 milli-cards).
- `gpu-<i>-mig-<profile id>-<start>`: one device per MIG profile and legal placement (partitionable devices),
  on a MIG-capable model unless the MIG mode is OFF. The card's counter set `gpu-<i>` holds `compute-slices`,
  `memory-slice-<k>` (1 each), `decoders` and `media-extensions`; each MIG device consumes its profile's
  compute slices, the memory slices of its placement, its decoders and (a `+me` profile) the media extension,
  and the whole card consumes all of it, so the allocator cannot give out overlapping instances, nor a MIG
  slice and the card it is part of.
- `gpu-<i>-vgpu`: a fractional share (consumable capacity, `allowMultipleAllocations`), unless the MIG mode is
  ON: capacity `memory` and `compute` with a `requestPolicy` (default: a `split`th of the card; any whole MiB
  or milli-card), and `shares` (`split`, one per allocation: at most `split` holders, as the device plugin's
  units). What keeps a vGPU share off a card given out whole or in MIG slices is the allocator's card-level
  policy (gpuplane-scheduler), not the counters: the vGPU device consumes none.

In v1 a slice holds either devices or shared counters, so the pool is: the counter sets (at most 8 per slice),
then the devices (at most 64 per slice, the limit for devices that consume counters or carry taints), every
slice with `nodeName` and the pool's `resourceSliceCount`. An unhealthy card (`card_health`) is left out with its
counter set (`UnhealthyPolicy.OMIT`) or keeps its devices with taint `gpu.gpuplane.io/unhealthy`, effect
NoSchedule (`UnhealthyPolicy.TAINT`).

`publish_slices` writes the pool to the API server: the node's slices carry label `gpu.gpuplane.io/node`; a pool
that changed is written whole with the next generation, and slices no longer wanted are deleted.
`SlicePublisher.tick` (the node agent's loop) reads the cards and their health and publishes.
"""

from __future__ import annotations

import copy
import enum
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuplane.controllers.health import CRITICAL_XIDS
from gpuplane.kube.api import KubeApi
from gpuplane.kube.dra import DRIVER, PCIE_ROOT, DeviceKind, DeviceRef, device_name, parse_device_name
from gpuplane.model import MILLI_PER_CARD, CardModel, Catalog, MigMode, MigProfile, NodeSpec
from gpuplane.node.device_plugin import _nvlink_groups
from gpuplane.node.dra_health import HealthBook
from gpuplane.node.gpu import CardInfo, GpuBackend, GpuBackendError

__all__ = [
    "API_VERSION",
    "DRIVER",
    "MAX_COUNTER_SETS",
    "MAX_DEVICES",
    "NODE_LABEL",
    "PCIE_ROOT",
    "RESOURCE_SLICES",
    "TAINT_UNHEALTHY",
    "DeviceKind",
    "DeviceRef",
    "SlicePublisher",
    "SliceSettings",
    "UnhealthyPolicy",
    "card_health",
    "counter_set_name",
    "device_health",
    "device_name",
    "parse_device_name",
    "pcie_root",
    "publish_slices",
    "resource_slices",
    "semver",
]

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 64
"""ResourceSliceMaxDevicesWithAdvancedFeatures: devices per slice when any consumes counters or has taints."""
MAX_COUNTER_SETS = 8
"""ResourceSliceMaxCounterSets."""
TAINT_UNHEALTHY = f"{DRIVER}/unhealthy"
NODE_LABEL = f"{DRIVER}/node"
"""The label naming the node on each of its slices (the publisher lists them by it)."""
RESOURCE_SLICES = "/apis/resource.k8s.io/v1/resourceslices"
MIB = 1 << 20


class UnhealthyPolicy(enum.Enum):
    OMIT = "omit"
    TAINT = "taint"


def counter_set_name(card: int) -> str:
    return f"gpu-{card}"


def semver(version: str) -> str | None:
    """A driver version as a semantic version ("535.104.05" → "535.104.5", "550.54" → "550.54.0"); None when
    it is not numbers separated by dots."""
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)


def pcie_root(bus_id: str | None, sysfs: Path = Path("/sys")) -> str | None:
    """The PCIe root (`pci<domain>:<bus>`) of the device at NVML's bus ID ("00000000:3B:00.0"): the first
    component of its sysfs path under `devices/`, as upstream's `deviceattribute` helper finds it. None when
    unknown."""
    if not bus_id:
        return None
    fields = bus_id.lower().split(":")
    if len(fields) != 3:
        return None
    domain = fields[0][-4:].rjust(4, "0")
    address = f"{domain}:{fields[1]}:{fields[2]}"
    try:
        real = os.path.realpath(sysfs / "bus" / "pci" / "devices" / address, strict=True)
    except OSError:
        return None
    parts = Path(real).parts
    for i, part in enumerate(parts[:-1]):
        if part == "devices" and re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", parts[i + 1]):
            return parts[i + 1]
    return None


def card_health(backend: GpuBackend, infos: Sequence[CardInfo]) -> dict[str, bool]:
    """card UUID → healthy, as the device plugin judges it: every card is unhealthy while the backend cannot
    read the cards, one missing from the reading or whose last Xid is critical is unhealthy."""
    try:
        readings = {r.uuid: r for r in backend.cards()}
    except GpuBackendError:
        return dict.fromkeys((i.uuid for i in infos), False)
    return {i.uuid: i.uuid in readings and (readings[i.uuid].xid_last or 0) not in CRITICAL_XIDS for i in infos}


@dataclass(frozen=True, slots=True)
class SliceSettings:
    node_name: str
    driver: str = DRIVER
    split: int = 10
    """Holders of one card's vGPU device at most (the device plugin's units per card)."""
    mig_mode: MigMode | None = None
    """None: DYNAMIC for a MIG-capable model, else OFF (as the device plugin)."""
    unhealthy: UnhealthyPolicy = UnhealthyPolicy.TAINT
    driver_version: str | None = None
    """NVML's driver version ("550.54.15"); published as `driverVersion` when it reads as a semantic version."""
    node_uid: str | None = None
    """The Node's UID: when given, each slice is owned by the Node (garbage-collected with it)."""

    def __post_init__(self) -> None:
        if self.split < 1:
            raise ValueError(f"split must be at least 1, got {self.split}")


def _string(value: str) -> dict[str, Any]:
    return {"string": value}


def _int(value: int) -> dict[str, Any]:
    return {"int": value}


def _card_attributes(info: CardInfo, model: CardModel, kind: DeviceKind, group: int | None, root: str | None,
                     version: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {"type": _string(kind.value), "model": _string(model.name),
                                  "productName": _string(info.name[:64]), "uuid": _string(info.uuid),
                                  "index": _int(info.index)}
    if info.numa is not None:
        attributes["numaNode"] = _int(info.numa)
    if group is not None:
        attributes["nvlinkGroup"] = _int(group)
    if version is not None:
        attributes["driverVersion"] = {"version": version}
    if root is not None:
        attributes[PCIE_ROOT] = _string(root)
    return attributes


def _counters(model: CardModel) -> dict[str, dict[str, str]]:
    counters = {"compute-slices": str(model.compute_slices), "decoders": str(model.decoders),
                "media-extensions": "1"}
    counters |= {f"memory-slice-{k}": "1" for k in range(model.memory_slices)}
    return {name: {"value": value} for name, value in counters.items()}


def _mig_consumes(profile: MigProfile, start: int) -> dict[str, dict[str, str]]:
    counters = {"compute-slices": str(profile.compute_slices)}
    if profile.decoders:
        counters["decoders"] = str(profile.decoders)
    if profile.media_extensions:
        counters["media-extensions"] = "1"
    counters |= {f"memory-slice-{k}": "1" for k in range(start, start + profile.memory_slices)}
    return {name: {"value": value} for name, value in counters.items()}


def _card_devices(info: CardInfo, model: CardModel, settings: SliceSettings, mig: bool, vgpu: bool,
                  group: int | None, root: str | None, taint: bool) -> list[dict[str, Any]]:
    version = semver(settings.driver_version) if settings.driver_version else None
    mib = info.total_bytes // MIB
    whole: dict[str, Any] = {
        "name": device_name(DeviceRef(DeviceKind.CARD, info.index)),
        "attributes": _card_attributes(info, model, DeviceKind.CARD, group, root, version),
        "capacity": {"memory": {"value": f"{mib}Mi"}, "compute": {"value": str(MILLI_PER_CARD)}},
    }
    devices = [whole]
    if mig:
        whole["consumesCounters"] = [{"counterSet": counter_set_name(info.index), "counters": _counters(model)}]
        for profile in sorted(model.mig_profiles.values(), key=lambda p: (p.compute_slices, p.profile_id)):
            for start in profile.starts:
                attributes = _card_attributes(info, model, DeviceKind.MIG, group, root, version)
                attributes["parentUUID"] = attributes.pop("uuid")
                attributes |= {"profile": _string(profile.name), "profileId": _int(profile.profile_id),
                               "placementStart": _int(start), "placementSize": _int(profile.memory_slices)}
                devices.append({
                    "name": device_name(DeviceRef(DeviceKind.MIG, info.index, profile.profile_id, start)),
                    "attributes": attributes,
                    "capacity": {"memory": {"value": f"{profile.memory_mib}Mi"},
                                 "compute": {"value": str(model.mig_compute_milli(profile))}},
                    "consumesCounters": [{"counterSet": counter_set_name(info.index),
                                          "counters": _mig_consumes(profile, start)}],
                })
    if vgpu:
        split = settings.split
        devices.append({
            "name": device_name(DeviceRef(DeviceKind.VGPU, info.index)),
            "attributes": _card_attributes(info, model, DeviceKind.VGPU, group, root, version),
            "capacity": {
                "memory": {"value": f"{mib}Mi", "requestPolicy": {
                    "default": f"{mib // split}Mi", "validRange": {"min": "1Mi", "max": f"{mib}Mi", "step": "1Mi"}}},
                "compute": {"value": str(MILLI_PER_CARD), "requestPolicy": {
                    "default": str(MILLI_PER_CARD // split),
                    "validRange": {"min": "1", "max": str(MILLI_PER_CARD), "step": "1"}}},
                "shares": {"value": str(split), "requestPolicy": {"default": "1", "validValues": ["1"]}},
            },
            "allowMultipleAllocations": True,
        })
    if taint:
        for device in devices:
            device["taints"] = [{"key": TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule"}]
    return devices


def resource_slices(infos: Sequence[CardInfo], model: CardModel, settings: SliceSettings, *, generation: int = 1,
                    health: Mapping[str, bool] | None = None,
                    pcie_roots: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """The node's pool as ResourceSlice objects (`health`: card UUID → healthy, every card healthy when None;
    `pcie_roots`: card index → PCIe root, `pcie_root` of each card's bus ID when None)."""
    mode = settings.mig_mode or (MigMode.DYNAMIC if model.mig_capable else MigMode.OFF)
    mig = model.mig_capable and mode is not MigMode.OFF
    vgpu = mode is not MigMode.ON
    groups = {card: g for g, members in enumerate(_nvlink_groups(infos)) for card in members}
    counter_sets: list[dict[str, Any]] = []
    devices: list[dict[str, Any]] = []
    for info in infos:
        healthy = health is None or health.get(info.uuid, False)
        if not healthy and settings.unhealthy is UnhealthyPolicy.OMIT:
            continue
        root = pcie_roots.get(info.index) if pcie_roots is not None else pcie_root(info.pci_bus_id)
        if mig:
            counter_sets.append({"name": counter_set_name(info.index), "counters": _counters(model)})
        devices += _card_devices(info, model, settings, mig, vgpu, groups.get(info.index), root, not healthy)
    specs: list[dict[str, Any]] = [{"sharedCounters": counter_sets[i:i + MAX_COUNTER_SETS]}
                                   for i in range(0, len(counter_sets), MAX_COUNTER_SETS)]
    specs += [{"devices": devices[i:i + MAX_DEVICES]} for i in range(0, len(devices), MAX_DEVICES)]
    if not specs:
        specs = [{"devices": []}]
    node = settings.node_name
    slices = []
    for k, content in enumerate(specs):
        metadata: dict[str, Any] = {"name": f"{node}-{settings.driver}-{k}",
                                    "labels": {"app.kubernetes.io/managed-by": "gpuplane", NODE_LABEL: node}}
        if settings.node_uid is not None:
            metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node,
                                            "uid": settings.node_uid, "controller": True}]
        spec = {"driver": settings.driver,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": len(specs)},
                "nodeName": node, **content}
        slices.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata, "spec": spec})
    return slices



def _content(obj: Mapping[str, Any]) -> Any:
    """A slice without its pool generation (what changes it)."""
    spec = copy.deepcopy(dict(obj["spec"]))
    spec["pool"] = {**spec["pool"], "generation": 0}
    return obj["metadata"]["name"], spec


def publish_slices(api: KubeApi, node: str, slices: Sequence[Mapping[str, Any]]) -> int | None:
    """Make the node's slices in the cluster (those labelled `NODE_LABEL`=`node`) these: nothing when they are
    already (None); else every slice written with the next pool generation (one above the highest found),
    slices no longer wanted deleted, and that generation returned. A slice is replaced whole (a JSON patch of
    its spec), so a slice that turns from devices to counters keeps nothing of the old."""
    existing = {s["metadata"]["name"]: s for s in api.list(RESOURCE_SLICES, label_selector=f"{NODE_LABEL}={node}")[0]}
    if sorted(map(_content, existing.values())) == sorted(map(_content, slices)):
        return None
    generation = max((int(s["spec"]["pool"]["generation"]) for s in existing.values()), default=0) + 1
    for wanted in slices:
        obj = copy.deepcopy(dict(wanted))
        obj["spec"]["pool"]["generation"] = generation
        name = obj["metadata"]["name"]
        if name in existing:
            api.patch(f"{RESOURCE_SLICES}/{name}", [{"op": "replace", "path": "/spec", "value": obj["spec"]}],
                      patch_type="json")
        else:
            api.create(RESOURCE_SLICES, obj)
    for name in sorted(set(existing) - {s["metadata"]["name"] for s in slices}):
        api.delete(f"{RESOURCE_SLICES}/{name}")
    return generation


class SlicePublisher:
    """Keeps the node's pool in the API server in step with its cards: each `tick` reads the cards (the last
    description stands while the backend cannot describe them) and their health, builds the slices and
    publishes them. `settings` may be replaced between ticks (a new split or MIG mode from the node's GpuPool)."""

    def __init__(self, api: KubeApi, backend: GpuBackend, describe: Callable[[], list[CardInfo]], model: CardModel,
                 settings: SliceSettings, *, pcie_roots: Mapping[int, str] | None = None,
                 health_book: HealthBook | None = None) -> None:
        self.api = api
        self.health_book = health_book
        """Where each tick also records every device's health (kubelet's `dra-health/v1` stream reads it)."""
        self.backend = backend
        self._describe = describe
        self.model = model
        self.settings = settings
        self._pcie_roots = pcie_roots
        self._infos: list[CardInfo] = []

    def tick(self) -> int | None:
        """The generation written, or None when the pool in the cluster was already this."""
        try:
            self._infos = self._describe()
        except GpuBackendError as exc:
            if not self._infos:
                raise
            log.warning("cannot describe the cards (%s): publishing the last description", exc)
        health = card_health(self.backend, self._infos)
        slices = resource_slices(self._infos, self.model, self.settings, health=health, pcie_roots=self._pcie_roots)
        if self.health_book is not None:
            self.health_book.update(self.settings.node_name, device_health(self._infos, self.model, self.settings,
                                                                           health, self._pcie_roots))
        return publish_slices(self.api, self.settings.node_name, slices)


def device_health(infos: Sequence[CardInfo], model: CardModel, settings: SliceSettings, health: Mapping[str, bool],
                  pcie_roots: Mapping[int, str] | None = None) -> dict[str, tuple[bool, str]]:
    """Every device the pool would hold with all cards healthy → (healthy, message) from its card's health, so a
    device the slices leave out (`UnhealthyPolicy.OMIT`) is reported unhealthy rather than vanishing."""
    uuids = {i.index: i.uuid for i in infos}
    out: dict[str, tuple[bool, str]] = {}
    for piece in resource_slices(infos, model, settings, pcie_roots=pcie_roots):
        for device in piece["spec"].get("devices", []):
            ref = parse_device_name(device["name"])
            uuid = uuids.get(ref.card) if ref is not None else None
            ok = uuid is not None and health.get(uuid, False)
            out[device["name"]] = (ok, "" if ok else f"card {uuid}: no NVML reading or a critical Xid")
    return out


def spec_slices(spec: NodeSpec, catalog: Catalog, *, split: int = 10, generation: int = 1) -> list[dict[str, Any]]:
    """The pool a node agent publishes for the cards `spec` describes (the simulator's and the benchmarks' nodes):
    card `i` is `GPU-<node>-<i>` with the spec's NUMA node, PCIe switch (as the PCIe root `pci<domain>:<bus>`,
    switch = domain × 256 + bus) and NVLink groups, the catalog model's memory, and the spec's MIG mode. The DRA
    world reads the same `NodeSpec` back from it (no slices for a node without cards)."""
    if spec.gpu_model is None or not spec.gpus:
        return []
    model = catalog.get(spec.gpu_model)
    peers = {c: tuple(sorted(set(g) - {c})) for g in spec.topology.nvlink_groups for c in g}
    infos = [CardInfo(i, f"GPU-{spec.name}-{i}", model.name, model.memory_mib * MIB, numa=spec.topology.numa[i],
                      nvlink_peers=peers.get(i, ())) for i in range(spec.gpus)]
    roots = {i: f"pci{spec.topology.pcie_switch[i] >> 8:04x}:{spec.topology.pcie_switch[i] & 0xFF:02x}"
             for i in range(spec.gpus)}
    return resource_slices(infos, model, SliceSettings(spec.name, split=split, mig_mode=spec.mig_mode),
                           generation=generation, pcie_roots=roots)
