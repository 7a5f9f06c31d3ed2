"""gpuplane-scheduler allocates DRA ResourceClaims (`resource.k8s.io/v1`) of gpuplane's driver `gpu.gpuplane.io`.

A DRA node is one whose cards are published as ResourceSlices (`gpuplane.node.dra_slices`); a device-plugin
node describes them in its `gpuplane.io/gpu-inventory` annotation. Both kinds run side by side: the same
`Scheduler`, the same policies, decide for both, because a claim is translated here into the scheduler's own
request model before it reaches the core:

- **Nodes.** A node with a complete pool of the driver's slices is read from them (`NodePool`): model, cards,
  NUMA nodes (standing in for PCIe switches, as the node agent's inventory does), NVLink groups, MIG mode (MIG
  devices and vGPU devices published: DYNAMIC; MIG only: ON; no MIG: OFF) and the vGPU split (`shares`). A
  card left out of the pool (an unhealthy card, `UnhealthyPolicy.OMIT`) is held, never offered.
- **Pods.** A pod's `spec.resourceClaims` name claims (directly or, once the resourceclaim controller made it,
  through `status.resourceClaimStatuses`). Each request (`exactly`) of a claim is an `Ask`: its DeviceClass's
  selectors then its own, the kind of device the class selects (a whole card, a MIG slice, a vGPU share), the
  count and (vGPU) the capacity asked, else the device's request policy default. The pod's asks become one GPU
  form: `WholeCards(sum of counts)`, `Fraction(compute, memory, count)`, or `MigSlice(profile)` (one MIG device
  a pod; among the profiles the selectors admit, the smallest). Asks of several kinds in one pod are refused.
- **Cards.** `DraFilter` (a filter plugin added to the profile) keeps a claim's pod to DRA nodes and to the
  cards that have a device of its kind passing every selector (untainted), evaluated with cel-python
  (`gpuplane.kube.dra_cel`), and a device-plugin pod off DRA nodes. Each failing selector is its own reason, so
  the FailedScheduling message names the claim, the request and the selector. The card policy (binpack,
  spread, …) then picks among those cards exactly as for a device-plugin pod. A vGPU share never lands on a card
  given out whole or in MIG slices, nor a MIG slice on a card holding shares: the core's card model already
  refuses to mix them (a card in MIG mode holds MIG instances only), and the vGPU device consumes no counters
  for the API to refuse it. A vGPU device holds at most `shares` allocations.
- **Binding.** Before the Binding, each claim's `status` gets `allocation` (`devices.results`: request, driver,
  pool, device; `consumedCapacity` and `shareID` for a vGPU share; `nodeSelector` naming the node) and
  `reservedFor` (the pod), guarded by the claim's resourceVersion; then the Binding and the `Scheduled` event
  (no assignment annotation: the claims are the record, and a restarted scheduler reads the cards back from
  them). A Binding refused takes the allocation back.
- **Shared claims.** A claim already allocated is shared: a pod reserving it asks for no new cards and is
  pinned to the claim's node; it is appended to `reservedFor`. While two pending pods name one unallocated
  claim, only the first (by name) is decided; the other waits for the allocation. The pod that holds the cards
  (the first in `reservedFor`) stays in the scheduler's view until the last pod reserving its claim is gone,
  and evicting it evicts the others (they share its devices).
- **Release.** When a pod is gone, it is taken off `reservedFor` of its claims, and a claim reserved by nobody
  loses its allocation.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuplane.kube.api import ApiError, JsonObject, KubeApi, pod_path
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.dra_cel import SelectorCache, SelectorError, cel_quantity
from gpuplane.kube.informer import DELETED, MODIFIED, Informer
from gpuplane.kube.objects import (
    MIG_PROFILE,
    ObjectError,
    node_info,
    object_key,
    pod_info,
    pod_request,
    resource_version,
    split_key,
)
from gpuplane.model import (
    MILLI_PER_CARD,
    Assignment,
    CardModel,
    CardShare,
    Catalog,
    CatalogError,
    ClusterState,
    Fraction,
    GpuForm,
    MigMode,
    MigSlice,
    NodeSelectorTerm,
    PodRequest,
    Requirement,
    SelectorOp,
    Topology,
    WholeCards,
)
from gpuplane.model.request import NODE_NAME_FIELD
from gpuplane.port import Clock, ClusterEvent, EventKind, Handler, NodeInfo, PodInfo, PodPhase, Status
from gpuplane.scheduler.framework import BoolArray, CardCheck, Check, CycleState, NodeCheck, Profile

log = logging.getLogger(__name__)

__all__ = [
    "ASK_LABEL",
    "DRIVER",
    "Ask",
    "DeviceKind",
    "DeviceRef",
    "DraBook",
    "DraFilter",
    "DraKubeCluster",
    "NodePool",
    "claim_from_template",
    "claim_path",
    "device_name",
    "dra_profile",
    "parse_device_name",
]

DRIVER = "gpu.gpuplane.io"
RESOURCE_API = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_API}/resourceslices"
CLASSES = f"{RESOURCE_API}/deviceclasses"
CLAIMS = f"{RESOURCE_API}/resourceclaims"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
ASK_LABEL = f"{DRIVER}/asks"
"""A label-like entry of the `PodRequest` (not on the pod): the digest of the pod's asks. Two pods asking the
same form through different selectors are different requests (the core remembers failures by request)."""
CLAIM_WAIT_S = 5.0
"""How long a new pod whose claim is not in the cache is held back before it is reported (claim not found)."""
NO_EXECUTE = frozenset({"NoSchedule", "NoExecute"})


def claim_path(namespace: str, name: str | None = None, sub: str = "") -> str:
    path = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims"
    if name is not None:
        path += f"/{name}"
    return f"{path}/{sub}" if sub else path


# ------------------------------------------------------------------ device names
class DeviceKind(enum.Enum):
    CARD = "gpu"
    MIG = "mig"
    VGPU = "vgpu"


@dataclass(frozen=True, slots=True)
class DeviceRef:
    """What a published device name stands for (the inverse of `device_name`)."""

    kind: DeviceKind
    card: int
    profile_id: int | None = None
    start: int | None = None


def device_name(ref: DeviceRef) -> str:
    """`gpu-<i>`, `gpu-<i>-vgpu` or `gpu-<i>-mig-<profile id>-<start>` (DNS labels)."""
    if ref.kind is DeviceKind.CARD:
        return f"gpu-{ref.card}"
    if ref.kind is DeviceKind.VGPU:
        return f"gpu-{ref.card}-vgpu"
    return f"gpu-{ref.card}-mig-{ref.profile_id}-{ref.start}"


_NAME = re.compile(r"gpu-(\d+)(?:-(vgpu)|-mig-(\d+)-(\d+))?")


def parse_device_name(name: str) -> DeviceRef | None:
    """The device a name of `device_name`'s stands for; None for any other name."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    card, vgpu, profile, start = match.groups()
    if vgpu:
        return DeviceRef(DeviceKind.VGPU, int(card))
    if profile is not None:
        return DeviceRef(DeviceKind.MIG, int(card), int(profile), int(start))
    return DeviceRef(DeviceKind.CARD, int(card))


# ------------------------------------------------------------------ pools
@dataclass(frozen=True, slots=True)
class PoolDevice:
    name: str
    ref: DeviceRef
    raw: Mapping[str, Any]
    tainted: bool


@dataclass(frozen=True, slots=True)
class NodePool:
    """A node's complete pool of the driver's devices (its highest generation)."""

    node: str
    model: str
    cards: int
    numa: tuple[int, ...]
    pcie_switch: tuple[int, ...]
    """From the PCIe root `pci<domain>:<bus>` (domain × 256 + bus); the NUMA node where unknown, as the node
    agent's inventory has it."""
    nvlink_groups: tuple[tuple[int, ...], ...]
    mig_mode: MigMode
    split: int
    devices: tuple[PoolDevice, ...]
    missing: frozenset[int]
    """Card indexes below `cards` with no devices (left out of the pool): held, never offered."""
    generation: int


def _attribute(device: Mapping[str, Any], name: str) -> Any:
    raw = (device.get("attributes") or {}).get(name)
    if not isinstance(raw, Mapping) or len(raw) != 1:
        return None
    return next(iter(raw.values()))


def _switch(root: object, numa: int) -> int:
    match = re.fullmatch(r"pci([0-9a-f]{4}):([0-9a-f]{2})", str(root)) if root is not None else None
    return int(match.group(1), 16) * 256 + int(match.group(2), 16) if match else numa


def read_pool(node: str, slices: Sequence[Mapping[str, Any]], catalog: Catalog) -> NodePool | None:
    """The node's pool from its slices of the driver; None while no generation of it is complete (Kubernetes
    ignores an incomplete pool too). Raises `ObjectError` for a pool gpuplane cannot read."""
    if not slices:
        return None
    generation = max(int(s["spec"]["pool"].get("generation", 0)) for s in slices)
    current = [s for s in slices if int(s["spec"]["pool"].get("generation", 0)) == generation]
    if len(current) < int(current[0]["spec"]["pool"].get("resourceSliceCount", 1)):
        return None
    devices: list[PoolDevice] = []
    for piece in sorted(current, key=object_key):
        for raw in piece["spec"].get("devices") or []:
            ref = parse_device_name(str(raw.get("name", "")))
            if ref is None:
                continue
            tainted = any(t.get("effect") in NO_EXECUTE for t in raw.get("taints") or [])
            devices.append(PoolDevice(raw["name"], ref, raw, tainted))
    whole = {d.ref.card: d for d in devices if d.ref.kind is DeviceKind.CARD}
    if not whole:
        return None
    obj = f"ResourceSlices of node {node}"
    models = {str(_attribute(d.raw, "model")) for d in whole.values()}
    if len(models) != 1:
        raise ObjectError(obj, "devices[].attributes.model", f"one model per node, found {sorted(models)}")
    try:
        model = catalog.canonical(models.pop())
    except CatalogError as exc:
        raise ObjectError(obj, "devices[].attributes.model", str(exc)) from None
    cards = max(whole) + 1
    numa = tuple(int(_attribute(whole[c].raw, "numaNode") or 0) if c in whole else 0 for c in range(cards))
    switches = tuple(_switch(_attribute(whole[c].raw, PCIE_ROOT), numa[c]) if c in whole else 0
                     for c in range(cards))
    groups: dict[int, list[int]] = {}
    for c, device in sorted(whole.items()):
        group = _attribute(device.raw, "nvlinkGroup")
        if group is not None:
            groups.setdefault(int(group), []).append(c)
    kinds = {d.ref.kind for d in devices}
    mode = MigMode.OFF if DeviceKind.MIG not in kinds else (
        MigMode.DYNAMIC if DeviceKind.VGPU in kinds else MigMode.ON)
    split = 10
    for d in devices:
        if d.ref.kind is DeviceKind.VGPU:
            split = int(cel_quantity(d.raw["capacity"]["shares"]["value"]))
            break
    nvlink = tuple(tuple(g) for _, g in sorted(groups.items()) if len(g) > 1)
    return NodePool(node, model, cards, numa, switches, nvlink, mode, split, tuple(devices),
                    frozenset(range(cards)) - set(whole), generation)


# ------------------------------------------------------------------ asks
@dataclass(frozen=True, slots=True)
class Ask:
    """One request of one claim, as gpuplane reads it."""

    claim: str
    """`namespace/name` of the ResourceClaim."""
    request: str
    class_name: str
    selectors: tuple[str, ...]
    """The DeviceClass's CEL expressions, then the request's own."""
    kind: DeviceKind
    count: int = 1
    memory_mib: int = 0
    compute_milli: int = 0
    profile: str | None = None
    """MIG: the profile chosen among those the selectors admit."""

    def label(self) -> str:
        return f"request {self.request!r} (class {self.class_name})"

    @property
    def selection(self) -> tuple[Any, ...]:
        """What decides which devices fit (not the claim's name): the key of the cached verdicts."""
        return self.request, self.class_name, self.selectors, self.kind, self.profile


def _content(asks: Sequence[Ask]) -> tuple[Any, ...]:
    """What of the asks decides a placement: all but their claims' names."""
    return tuple((a.selection, a.count, a.memory_mib, a.compute_milli) for a in asks)


def _digest(asks: Sequence[Ask]) -> str:
    """The asks without their claims' names: pods asking alike share it (and the core's memory of failures)."""
    return hashlib.sha1(repr(_content(asks)).encode()).hexdigest()[:16]


CODE_PASS, CODE_NOT_DRA, CODE_NO_KIND, CODE_TAINTED = 0, 1, 2, 3
CODE_SELECTOR = 4
"""Per card: passes, not a DRA node, no device of the ask's kind, only tainted ones, and from `CODE_SELECTOR`
on, the first selector (its index added) that no device of the card passes."""


class DraBook:
    """What the DRA world knows: the pools by node, the DeviceClasses, the ResourceClaims, the asks by digest,
    and the per-card verdicts of each ask, cached by pool generation. Thread-safe."""

    def __init__(self, catalog: Catalog, driver: str = DRIVER) -> None:
        self.catalog = catalog
        self.driver = driver
        self.cel = SelectorCache()
        self.lock = threading.RLock()
        self.slices: dict[str, dict[str, JsonObject]] = {}
        """node → slice name → slice (the driver's)."""
        self.pools: dict[str, NodePool] = {}
        self.pool_errors: dict[str, str] = {}
        self.classes: dict[str, JsonObject] = {}
        self.claims: dict[str, JsonObject] = {}
        self.asks: dict[str, tuple[Ask, ...]] = {}
        """digest → asks."""
        self.version = 0
        """Incremented whenever a pool changes (verdict matrices are rebuilt)."""
        self._verdicts: dict[tuple[Any, str, int], np.ndarray] = {}
        self._matrices: dict[tuple[Any, int, int, int], np.ndarray] = {}
        self._dra_rows: dict[tuple[int, int, int], BoolArray] = {}
        self._splits: dict[tuple[int, int, int], np.ndarray] = {}
        self._spec_asks: dict[tuple[str, int, int], list[Ask] | ObjectError] = {}
        self._claim_asks: dict[str, tuple[Any, int, int, list[Ask] | ObjectError]] = {}
        """claim → (its `spec.devices`, pool and class versions, its asks): a claim's spec does not change (the
        API refuses it), so each is read once, not at each of its pods' reads (two a pod: created, bound)."""
        self._digests: dict[tuple[Any, ...], str] = {}
        self._models: tuple[int, frozenset[str]] = (-1, frozenset())
        self._masks: dict[tuple[Any, ...], tuple[tuple[str, BoolArray], ...]] = {}
        self.class_version = 0

    # -------------------------------------------------------------- pools
    def set_slice(self, obj: JsonObject | None, old: JsonObject | None) -> str | None:
        """Take in a slice change; the node whose pool changed, or None."""
        current = obj if obj is not None else old
        if current is None:
            return None
        spec = current.get("spec") or {}
        if spec.get("driver") != self.driver or not spec.get("nodeName"):
            return None
        node = str(spec["nodeName"])
        name = object_key(current)
        with self.lock:
            mine = self.slices.setdefault(node, {})
            if obj is None:
                mine.pop(name, None)
            else:
                mine[name] = obj
            try:
                pool = read_pool(node, list(mine.values()), self.catalog)
                self.pool_errors.pop(node, None)
            except (ObjectError, KeyError, ValueError, TypeError) as exc:
                pool = None
                self.pool_errors[node] = str(exc)
            before = self.pools.get(node)
            if pool is None:
                self.pools.pop(node, None)
            else:
                self.pools[node] = pool
            if before != pool:
                self.version += 1
                self._matrices.clear()
                self._masks.clear()
                self._dra_rows.clear()
                self._splits.clear()
                return node
        return None

    def pool(self, node: str) -> NodePool | None:
        with self.lock:
            return self.pools.get(node)

    def models(self) -> frozenset[str]:
        """The canonical card models of the pools (read once per version of the pools)."""
        with self.lock:
            version, models = self._models
            if version != self.version:
                models = frozenset(p.model for p in self.pools.values())
                self._models = (self.version, models)
            return models

    # -------------------------------------------------------------- verdicts
    def _class_selectors(self, name: str, obj: str) -> tuple[str, ...]:
        cls = self.classes.get(name)
        if cls is None:
            raise ObjectError(obj, "deviceClassName", f"DeviceClass {name!r} not found")
        return tuple(str(s["cel"]["expression"]) for s in (cls.get("spec") or {}).get("selectors") or []
                     if isinstance(s, Mapping) and "cel" in s)

    def _passes(self, selectors: Sequence[str], device: PoolDevice) -> int:
        """-1 when the device passes every selector, else the index of the first it fails."""
        for i, expression in enumerate(selectors):
            if not self.cel.matches(expression, self.driver, device.raw):
                return i
        return -1

    def verdicts(self, ask: Ask, pool: NodePool) -> np.ndarray:
        """Per card of the pool, the ask's code (`CODE_*`)."""
        key = (ask.selection, pool.node, pool.generation)
        with self.lock:
            cached = self._verdicts.get(key)
            if cached is not None:
                return cached
            best = np.full(pool.cards, -1, np.int64)  # furthest selector reached by a device of the kind
            tainted = np.zeros(pool.cards, np.bool_)
            passed = np.zeros(pool.cards, np.bool_)
            for device in pool.devices:
                if device.ref.kind is not ask.kind:
                    continue
                if ask.profile is not None and _profile_name(device) != ask.profile:
                    continue
                c = device.ref.card
                try:
                    failed = self._passes(ask.selectors, device)
                except SelectorError:
                    failed = 0
                if failed < 0:
                    if device.tainted:
                        tainted[c] = True
                    else:
                        passed[c] = True
                best[c] = max(best[c], len(ask.selectors) if failed < 0 else failed)
            codes = np.where(best < 0, CODE_NO_KIND, CODE_SELECTOR + best)
            codes[tainted] = CODE_TAINTED
            codes[passed] = CODE_PASS
            self._verdicts[key] = codes
            return codes

    def matrix(self, ask: Ask, state: ClusterState) -> np.ndarray:
        """(nodes × card slots) codes of `ask` over the state's nodes."""
        n = state.size
        key = (ask.selection, id(state.node_index), n, self.version)
        with self.lock:
            cached = self._matrices.get(key)
            if cached is not None:
                return cached
            codes = np.full((n, state.width), CODE_NOT_DRA, np.int64)
            for i, spec in enumerate(state.nodes[:n]):
                pool = self.pools.get(spec.name)
                if pool is not None:
                    codes[i, :pool.cards] = self.verdicts(ask, pool)
            if len(self._matrices) > 256:
                self._matrices.clear()
            self._matrices[key] = codes
            return codes

    def dra_rows(self, state: ClusterState) -> BoolArray:
        """Which of the state's nodes are DRA nodes."""
        n = state.size
        key = (id(state.node_index), n, self.version)
        with self.lock:
            cached = self._dra_rows.get(key)
            if cached is None:
                cached = np.array([spec.name in self.pools for spec in state.nodes[:n]], np.bool_)
                if len(self._dra_rows) > 64:
                    self._dra_rows.clear()
                self._dra_rows[key] = cached
            return cached

    def split_of(self, state: ClusterState) -> np.ndarray:
        """Per node of the state, its vGPU devices' shares (0 off DRA nodes)."""
        n = state.size
        key = (id(state.node_index), n, self.version)
        with self.lock:
            cached = self._splits.get(key)
            if cached is None:
                cached = np.array([self.pools[s.name].split if s.name in self.pools else 0
                                   for s in state.nodes[:n]], np.int64)
                if len(self._splits) > 64:
                    self._splits.clear()
                self._splits[key] = cached
            return cached

    # -------------------------------------------------------------- asks of a claim
    def read_asks(self, claim: Mapping[str, Any]) -> list[Ask]:
        """The claim's requests as asks; `ObjectError` naming the field for one gpuplane cannot allocate.
        Each claim is read once per version of the pools and classes (its status writes leave its asks as they
        were), and claims of the same spec (a template's) share one reading."""
        key = object_key(claim)
        devices = (claim.get("spec") or {}).get("devices")
        with self.lock:
            known = self._claim_asks.get(key)
            if known is not None and known[1] == self.version and known[2] == self.class_version \
                    and known[0] == devices:
                asks = known[3]
            else:
                asks = None
        if asks is None:
            try:
                asks = self._read_spec_asks(claim, key, devices)
            except ObjectError as exc:
                asks = exc
            with self.lock:
                if len(self._claim_asks) > 65536:
                    self._claim_asks.clear()
                self._claim_asks[key] = (devices, self.version, self.class_version, asks)
        if isinstance(asks, ObjectError):  # a new one each time: a raised exception keeps its traceback
            raise ObjectError(asks.obj, asks.field, str(asks)[len(asks.obj) + len(asks.field) + 4:])
        return list(asks)

    def forget_claim(self, key: str) -> None:
        """Drop a deleted claim's reading."""
        with self.lock:
            self._claim_asks.pop(key, None)

    def _read_spec_asks(self, claim: Mapping[str, Any], key: str, devices: Any) -> list[Ask]:
        spec_key = (repr(devices), self.version, self.class_version)
        with self.lock:
            known = self._spec_asks.get(spec_key)
        if known is None:
            try:
                known = self._read_asks(claim)
            except ObjectError as exc:
                known = exc
            with self.lock:
                if len(self._spec_asks) > 1024:
                    self._spec_asks.clear()
                self._spec_asks[spec_key] = known
        if isinstance(known, ObjectError):
            raise ObjectError(f"ResourceClaim {key}", known.field, str(known).rpartition(": ")[2])
        return [dataclasses.replace(a, claim=key) for a in known]

    def _read_asks(self, claim: Mapping[str, Any]) -> list[Ask]:
        key = object_key(claim)
        obj = f"ResourceClaim {key}"
        devices = (claim.get("spec") or {}).get("devices") or {}
        if devices.get("constraints"):
            raise ObjectError(obj, "spec.devices.constraints", "not supported by gpuplane-scheduler")
        asks = []
        for i, raw in enumerate(devices.get("requests") or []):
            field = f"spec.devices.requests[{i}]"
            exactly = raw.get("exactly")
            if not isinstance(exactly, Mapping):
                raise ObjectError(obj, f"{field}.firstAvailable", "only `exactly` requests are supported")
            mode = exactly.get("allocationMode") or "ExactCount"
            if mode != "ExactCount":
                raise ObjectError(obj, f"{field}.exactly.allocationMode", f"{mode} is not supported (ExactCount)")
            if exactly.get("adminAccess"):
                raise ObjectError(obj, f"{field}.exactly.adminAccess", "not supported")
            class_name = str(exactly.get("deviceClassName") or "")
            selectors = self._class_selectors(class_name, f"{obj}: {field}.exactly") + tuple(
                str(s["cel"]["expression"]) for s in exactly.get("selectors") or [] if "cel" in s)
            ask = Ask(key, str(raw.get("name") or f"request-{i}"), class_name, selectors,
                      self._kind_of(class_name, selectors, obj), int(exactly.get("count") or 1))
            asks.append(self._sized(ask, exactly.get("capacity") or {}, obj, field))
        if not asks:
            raise ObjectError(obj, "spec.devices.requests", "no requests")
        return asks

    def _kind_of(self, class_name: str, selectors: Sequence[str], obj: str) -> DeviceKind:
        """The one kind of device the class's selectors pick on the first pool (by node name)."""
        with self.lock:
            pools = [self.pools[n] for n in sorted(self.pools)]
        if not pools:
            raise ObjectError(obj, "deviceClassName", f"no ResourceSlices of driver {self.driver} yet")
        class_selectors = self._class_selectors(class_name, obj)
        kinds: set[DeviceKind] = set()
        for pool in pools[:1]:
            seen: set[DeviceKind] = set()
            for device in pool.devices:
                if device.ref.kind in seen:
                    continue
                seen.add(device.ref.kind)
                try:
                    if self._passes(class_selectors, device) < 0:
                        kinds.add(device.ref.kind)
                except SelectorError as exc:
                    raise ObjectError(obj, f"DeviceClass {class_name}", str(exc)) from None
        if len(kinds) != 1:
            found = "none" if not kinds else ", ".join(sorted(k.value for k in kinds))
            raise ObjectError(obj, f"DeviceClass {class_name}",
                              f"selects devices of one kind of {self.driver}'s (gpu, mig, vgpu) for "
                              f"gpuplane-scheduler; found {found}")
        return kinds.pop()

    def _sized(self, ask: Ask, capacity: Mapping[str, Any], obj: str, field: str) -> Ask:
        if ask.kind is DeviceKind.MIG:
            if ask.count != 1:
                raise ObjectError(obj, f"{field}.exactly.count", "one MIG device per request")
            return dataclasses.replace(ask, profile=self._profile_for(ask, obj, field))
        if ask.kind is DeviceKind.CARD:
            if capacity:
                raise ObjectError(obj, f"{field}.exactly.capacity", "a whole card takes no capacity request")
            return ask
        asked = capacity.get("requests") or {}
        unknown = sorted(set(asked) - {"memory", "compute"})
        if unknown:
            raise ObjectError(obj, f"{field}.exactly.capacity.requests", f"unknown capacity {unknown}")
        policy = self._vgpu_policy()
        memory = cel_quantity(asked["memory"]) if "memory" in asked else cel_quantity(policy["memory"])
        compute = cel_quantity(asked["compute"]) if "compute" in asked else cel_quantity(policy["compute"])
        return dataclasses.replace(ask, memory_mib=-(-memory // (1 << 20)), compute_milli=compute)

    def _vgpu_policy(self) -> dict[str, str]:
        """The request policy defaults of the first pool's vGPU device."""
        with self.lock:
            for node in sorted(self.pools):
                for device in self.pools[node].devices:
                    if device.ref.kind is DeviceKind.VGPU:
                        return {k: device.raw["capacity"][k]["requestPolicy"]["default"] for k in ("memory", "compute")}
        return {"memory": "0", "compute": "0"}

    def _profile_for(self, ask: Ask, obj: str, field: str) -> str:
        """The smallest MIG profile (compute slices, then memory) of a device passing the selectors."""
        candidates: dict[str, tuple[int, int]] = {}
        with self.lock:
            pools = list(self.pools.values())
        for pool in pools:
            model = self.catalog.get(pool.model)
            for device in pool.devices:
                name = _profile_name(device)
                if device.ref.kind is not DeviceKind.MIG or name is None or name in candidates:
                    continue
                try:
                    if self._passes(ask.selectors, device) < 0:
                        profile = model.mig_profile(name)
                        if profile is not None:
                            candidates[name] = (profile.compute_slices, profile.memory_mib)
                except SelectorError as exc:
                    raise ObjectError(obj, f"{field}.exactly.selectors", str(exc)) from None
        if not candidates:
            selector = ask.selectors[-1] if ask.selectors else ""
            raise ObjectError(obj, f"{field}.exactly.selectors",
                              f"no MIG device of any node matches selector {selector!r}")
        return min(candidates, key=lambda n: (candidates[n], n))

    def register(self, asks: Sequence[Ask]) -> str:
        content = _content(asks)
        with self.lock:
            digest = self._digests.get(content)
            if digest is None:
                digest = _digest(asks)
                if len(self._digests) > 4096:
                    self._digests.clear()
                self._digests[content] = digest
            self.asks[digest] = tuple(asks)
        return digest

    def masks(self, ask: Ask, state: ClusterState) -> tuple[tuple[str, BoolArray], ...]:
        """`DraFilter`'s card checks of `ask` over the state's nodes, as (reason, cards passing), computed once
        per matrix (the same pools, the same nodes), not once per pod."""
        key = (ask.selection, id(state.node_index), state.size, self.version)
        with self.lock:
            cached = self._masks.get(key)
            if cached is not None:
                return cached
            codes = self.matrix(ask, state)
            label = ask.label()
            out = [(f"cannot allocate {label}: no device of its class on the card", codes != CODE_NO_KIND)]
            out.extend((f"cannot allocate {label}: no device matches selector `{expression}`",
                        codes != CODE_SELECTOR + i) for i, expression in enumerate(ask.selectors))
            out.append((f"cannot allocate {label}: the matching devices are tainted", codes != CODE_TAINTED))
            masks = tuple(out)
            if len(self._masks) > 256:
                self._masks.clear()
            self._masks[key] = masks
            return masks


def _profile_name(device: PoolDevice) -> str | None:
    value = _attribute(device.raw, "profile")
    return str(value) if value is not None else None


def gpu_form(asks: Sequence[Ask], obj: str) -> GpuForm:
    """The pod's asks as one GPU form of the scheduler's request model."""
    kinds = {a.kind for a in asks}
    if len(kinds) != 1:
        raise ObjectError(obj, "spec.resourceClaims", "gpuplane-scheduler allocates one kind of device per pod "
                                                      f"(asked: {', '.join(sorted(k.value for k in kinds))})")
    kind = kinds.pop()
    count = sum(a.count for a in asks)
    if kind is DeviceKind.CARD:
        return WholeCards(count)
    if kind is DeviceKind.MIG:
        if count != 1:
            raise ObjectError(obj, "spec.resourceClaims", "one MIG device per pod")
        assert asks[0].profile is not None
        return MigSlice(asks[0].profile)
    shapes = {(a.memory_mib, a.compute_milli) for a in asks}
    if len(shapes) != 1:
        raise ObjectError(obj, "spec.resourceClaims", "every vGPU share of a pod takes the same capacity")
    memory, compute = shapes.pop()
    if compute > MILLI_PER_CARD:
        raise ObjectError(obj, "spec.resourceClaims", f"compute {compute} is more than one card")
    return Fraction(compute_milli=compute, memory_mib=memory, count=count)


# ------------------------------------------------------------------ the filter
class DraFilter:
    """Keeps claims' pods to the cards whose devices pass their asks, and device-plugin pods off DRA nodes."""

    name = "DynamicResources"

    def __init__(self, book: DraBook) -> None:
        self.book = book

    def checks(self, cycle: CycleState, pod: PodRequest, state: ClusterState) -> Iterator[Check]:
        digest = next((v for k, v in pod.labels if k == ASK_LABEL), None)
        if digest is None:
            if pod.gpu is not None and self.book.pools:
                yield NodeCheck(f"node(s) offer {self.book.driver}'s GPUs through ResourceClaims only",
                                ~self.book.dra_rows(state), resolvable=False)
            return
        asks = self.book.asks.get(digest)
        if asks is None:
            return
        if pod.gpu is None:  # a pod sharing an allocated claim: pinned to its node by node affinity
            return
        n = state.size
        yield NodeCheck(f"node(s) had no ResourceSlices of driver {self.book.driver}", self.book.dra_rows(state),
                        resolvable=False)
        for ask in asks:
            for reason, passing in self.book.masks(ask, state):
                yield CardCheck(reason, passing, resolvable=False)
            if ask.kind is DeviceKind.VGPU:
                split = self.book.split_of(state)
                yield CardCheck(f"cannot allocate {ask.label()}: the card's vGPU device has no share left",
                                state.card_holders[:n] < split[:, None])


def dra_profile(profile: Profile, book: DraBook) -> Profile:
    """`profile` with `DraFilter` after its filters."""
    return dataclasses.replace(profile, filters=(*profile.filters, DraFilter(book)))


# ------------------------------------------------------------------ the pods' claims
@dataclass(frozen=True, slots=True)
class ClaimUse:
    """What a pod does with its claims: holds their devices (`holder`) or shares allocated ones (`node`)."""

    claims: tuple[str, ...]
    asks: tuple[Ask, ...]
    holder: bool
    node: str | None = None


def _pod_claim_names(pod: Mapping[str, Any]) -> list[str]:
    """The ResourceClaims the pod uses (`namespace/name`); `ObjectError` while one made from a template is not
    named in the pod's status yet."""
    obj = object_key(pod)
    namespace, _ = split_key(obj)
    statuses = {s.get("name"): s.get("resourceClaimName")
                for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    names = []
    for i, entry in enumerate((pod.get("spec") or {}).get("resourceClaims") or []):
        if entry.get("resourceClaimName"):
            names.append(f"{namespace}/{entry['resourceClaimName']}")
        elif entry.get("resourceClaimTemplateName"):
            made = statuses.get(entry.get("name"))
            if not made:
                raise ObjectError(obj, f"spec.resourceClaims[{i}]", "waiting for the ResourceClaim of template "
                                                                    f"{entry['resourceClaimTemplateName']!r}")
            names.append(f"{namespace}/{made}")
        else:
            raise ObjectError(obj, f"spec.resourceClaims[{i}]", "names no claim or template")
    return names


def _without_claims(pod: Mapping[str, Any]) -> JsonObject:
    spec = {k: v for k, v in (pod.get("spec") or {}).items() if k != "resourceClaims"}
    return {**pod, "spec": spec}


def _reserved(claim: Mapping[str, Any]) -> list[str]:
    return [str(r.get("name")) for r in (claim.get("status") or {}).get("reservedFor") or []
            if r.get("resource") == "pods"]


def _allocated_node(claim: Mapping[str, Any]) -> str | None:
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return None
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == NODE_NAME_FIELD and field.get("values"):
                return str(field["values"][0])
    results = (allocation.get("devices") or {}).get("results") or []
    return str(results[0]["pool"]) if results else None


def claim_from_template(template: Mapping[str, Any], pod: Mapping[str, Any], entry: str) -> JsonObject:
    """The ResourceClaim the resourceclaim controller makes for the pod's `entry` from `template`
    (`<pod>-<entry>-<suffix>`, owned by the pod, annotated with the pod claim name)."""
    meta = pod.get("metadata") or {}
    suffix = uuid.uuid4().hex[:5]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": f"{meta['name']}-{entry}-{suffix}", "namespace": meta.get("namespace", "default"),
                         "annotations": {"resource.kubernetes.io/pod-claim-name": entry},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                              "uid": meta.get("uid", ""), "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": dict((template.get("spec") or {}).get("spec") or {})}


# ------------------------------------------------------------------ the cluster
class DraKubeCluster(KubeCluster):
    """`KubeCluster` that also reads ResourceSlices, DeviceClasses and ResourceClaims: DRA nodes from their
    slices, claims' pods as requests, their cards from the claims' allocations; `send_bind` allocates the claims
    first; a pod gone releases its claims. `book` is shared with the profile's `DraFilter`."""

    def __init__(self, api: KubeApi, catalog: Catalog, book: DraBook, *, clock: Clock | None = None,
                 start: bool = True, **kwargs: Any) -> None:
        self.book = book
        self._uses: dict[str, ClaimUse] = {}
        """Pod → its claims, as last read."""
        self._claim_pods: dict[str, set[str]] = {}
        """Claim → the pods that name it."""
        self._phantoms: dict[str, tuple[PodInfo, tuple[str, ...]]] = {}
        """Holders gone while others still reserve their claims: kept in the view until those are gone."""
        self._releases: list[tuple[str, tuple[str, ...]]] = []
        self._deferred: dict[str, tuple[float, list[str]]] = {}
        """New pods held back until their claims are in the cache: since when, and the claims missing."""
        self._release_lock = threading.Lock()
        super().__init__(api, catalog, clock=clock, start=False, **kwargs)
        watch = kwargs.get("watch_timeout_s", 300)
        self.slice_informer = Informer(api, SLICES, watch_timeout_s=watch, name="resourceslices")
        self.class_informer = Informer(api, CLASSES, watch_timeout_s=watch, name="deviceclasses")
        self.claim_informer = Informer(api, CLAIMS, watch_timeout_s=watch, name="resourceclaims")
        self.slice_informer.add_handler(self._on_slice)
        self.class_informer.add_handler(self._on_class)
        self.claim_informer.add_handler(self._on_claim)
        if start:
            self.start()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        informers = (self.slice_informer, self.class_informer, self.claim_informer)
        for informer in informers:
            informer.start()
        for informer in informers:
            if not informer.wait_synced(self.sync_timeout_s):
                self.close()  # a leader retries with a new cluster: these informers must not live on
                raise TimeoutError(f"the API server did not answer the first list of {informer.name} within "
                                   f"{self.sync_timeout_s}s ({informer.last_error or 'no answer'})")
        super().start()

    def close(self) -> None:
        for informer in (self.slice_informer, self.class_informer, self.claim_informer):
            informer.stop()
        super().close()

    # -------------------------------------------------------------- informer handlers (their threads)
    def _on_slice(self, event_type: str, old: JsonObject | None, new: JsonObject | None) -> None:
        node = self.book.set_slice(new, old if new is None else None)
        if node is None:
            return
        obj = self.nodes.get(node)
        if obj is not None:
            self._queue("node", MODIFIED, obj, obj)
        self._reread_pending(lambda key: f"pod {key}" in self._unreadable)

    def _on_class(self, event_type: str, old: JsonObject | None, new: JsonObject | None) -> None:
        current = new if new is not None else old
        if current is None:
            return
        with self.book.lock:
            if new is None:
                self.book.classes.pop(object_key(current), None)
            else:
                self.book.classes[object_key(current)] = new
            self.book.class_version += 1
        self._reread_pending(lambda key: True)

    def _on_claim(self, event_type: str, old: JsonObject | None, new: JsonObject | None) -> None:
        current = new if new is not None else old
        if current is None:
            return
        key = object_key(current)
        with self.book.lock:
            if new is None:
                self.book.claims.pop(key, None)
                self.book.forget_claim(key)
            else:
                self.book.claims[key] = new
        reserved = set(_reserved(current)) if new is not None else set()
        with self.book.lock:
            waiting = {p for p in self._claim_pods.get(key, ()) if split_key(p)[1] not in reserved}
        waiting |= {p for p, (_, missing) in list(self._deferred.items()) if key in missing}
        for pod in sorted(waiting):  # the pods naming the claim (an unreadable one registered it too)
            obj = self.pods.get(pod)
            if obj is not None and not (obj.get("spec") or {}).get("nodeName"):
                self._queue("pod", MODIFIED, None, obj)

    def _reread_pending(self, which: Callable[[str], bool]) -> None:
        """Read again the pending pods with claims that `which` names (by `namespace/name`)."""
        for obj in self.pods.objects():
            spec = obj.get("spec") or {}
            if spec.get("nodeName") or not spec.get("resourceClaims"):
                continue
            key = object_key(obj)
            if which(key):
                self._queue("pod", MODIFIED, None, obj)

    # -------------------------------------------------------------- reading
    def _read_node(self, obj: JsonObject) -> NodeInfo:
        info = node_info(obj, self.catalog)
        pool = self.book.pool(object_key(obj))
        if pool is None:
            return info
        base = info.spec
        topology = Topology(pool.numa, pool.pcie_switch, pool.nvlink_groups, base.topology.nics)
        spec = dataclasses.replace(base, gpu_model=pool.model, gpus=pool.cards, mig_mode=pool.mig_mode,
                                   topology=topology, foreign_cards=pool.missing)
        return dataclasses.replace(info, spec=spec)

    def _read_pod(self, obj: JsonObject, request: PodRequest | None) -> PodInfo:
        spec = obj.get("spec") or {}
        if not spec.get("resourceClaims"):
            return super()._read_pod(obj, request)
        key = object_key(obj)
        plain = _without_claims(obj)
        use = self._claim_use(obj)
        if request is None or self._uses.get(key) != use:
            request = self._claim_request(plain, use)
        self._uses[key] = use
        info = pod_info(plain, self.catalog, request=request)
        if info.assignment is not None and use.holder:
            info = dataclasses.replace(info, assignment=self._allocated(key, info.assignment.node, use))
        return info

    def _claim_use(self, pod: Mapping[str, Any]) -> ClaimUse:
        obj = object_key(pod)
        names = _pod_claim_names(pod)
        with self.book.lock:
            for name in names:
                self._claim_pods.setdefault(name, set()).add(obj)
        asks: list[Ask] = []
        holder, node = True, None
        with self.book.lock:
            for name in names:
                claim = self.book.claims.get(name)
                if claim is None:
                    raise ObjectError(obj, "spec.resourceClaims", f"ResourceClaim {name} not found")
                asks.extend(self.book.read_asks(claim))
                allocated = _allocated_node(claim)
                reserved = _reserved(claim)
                pod_name = split_key(obj)[1]
                if allocated is not None and (not reserved or reserved[0] != pod_name):
                    holder, node = False, allocated
                elif allocated is None:
                    first = min((p for p in self._claim_pods.get(name, ()) if self._is_pending(p)), default=obj)
                    if first < obj:
                        raise ObjectError(obj, "spec.resourceClaims", f"ResourceClaim {name} is shared: waiting "
                                                                      f"for its allocation for pod {first}")
        return ClaimUse(tuple(names), tuple(asks), holder, node)

    def _is_pending(self, key: str) -> bool:
        raw = self.pods.get(key)
        return raw is not None and not (raw.get("spec") or {}).get("nodeName")

    def _claim_request(self, plain: JsonObject, use: ClaimUse) -> PodRequest:
        obj = object_key(plain)
        base = pod_request(plain, self.catalog)
        if base.gpu is not None:
            raise ObjectError(obj, "spec.containers[].resources", "a pod asks for GPUs through its claims or its "
                                                                  "resources, not both")
        digest = self.book.register(use.asks)
        labels = (*base.labels, (ASK_LABEL, digest))
        if not use.holder:
            assert use.node is not None
            pinned = NodeSelectorTerm(fields=(Requirement(NODE_NAME_FIELD, SelectorOp.IN, (use.node,)),))
            terms = (pinned,) if base.required_terms is None else tuple(
                NodeSelectorTerm(t.expressions, (*t.fields, *pinned.fields)) for t in base.required_terms)
            return dataclasses.replace(base, labels=labels, required_terms=terms)
        form = gpu_form(use.asks, obj)
        model = self.book.models()
        models = base.models
        if isinstance(form, MigSlice) and model:
            having = frozenset(m for m in model if self.catalog.get(m).mig_profile(form.profile) is not None)
            models = having if models is None else models & having
            if not models:
                raise ObjectError(obj, "spec.resourceClaims", f"no node's model has MIG profile {form.profile}")
        return dataclasses.replace(base, gpu=form, labels=labels, models=models)

    def _allocated(self, pod: str, node: str, use: ClaimUse) -> Assignment:
        """The cards the pod's claims were allocated on `node` (none while they are not)."""
        pool = self.book.pool(node)
        model = self.catalog.get(pool.model) if pool is not None else None
        shares: list[CardShare] = []
        with self.book.lock:
            for name in use.claims:
                claim = self.book.claims.get(name) or {}
                allocation = (claim.get("status") or {}).get("allocation") or {}
                for result in (allocation.get("devices") or {}).get("results") or []:
                    ref = parse_device_name(str(result.get("device", "")))
                    if result.get("driver") != self.book.driver or ref is None or model is None:
                        continue
                    shares.append(_share(ref, result, model))
        return Assignment(node, tuple(sorted(shares, key=lambda s: s.card)))

    # -------------------------------------------------------------- events: phantoms and releases
    def _pod_change(self, event_type: str, obj: JsonObject | None,
                    before: JsonObject | None = None) -> list[tuple[ClusterEvent, tuple[Handler, ...]]]:
        if obj is not None and event_type != DELETED and self._defer(obj):
            return []
        events = super()._pod_change(event_type, obj, before)
        out = []
        for event, handlers in events:
            pod = event.pod
            if pod is None or event.kind not in (EventKind.POD_DELETED, EventKind.POD_FAILED):
                out.append((event, handlers))
                continue
            use = self._uses.pop(pod.name, None)
            claims = use.claims if use is not None else ()
            with self.book.lock:
                for claim in claims:
                    pods = self._claim_pods.get(claim)
                    if pods is not None:
                        pods.discard(pod.name)
                        if not pods:
                            del self._claim_pods[claim]
            if use is not None and pod.assignment is not None:
                with self._release_lock:
                    self._releases.append((pod.name, claims))
            if use is not None and use.holder and pod.assignment is not None and pod.assignment.cards \
                    and self._sharing(claims):
                self._phantoms[pod.name] = (pod, claims)
                self._pods[pod.name] = dataclasses.replace(pod, phase=PodPhase.RUNNING)
                continue  # its devices stay held while others share them
            out.append((event, handlers))
            for name, (phantom, held) in list(self._phantoms.items()):
                if name != pod.name and not self._sharing(held):
                    del self._phantoms[name]
                    self._pods.pop(name, None)
                    out.append(self._event(EventKind.POD_DELETED, pod=phantom))
        return out

    def _defer(self, obj: JsonObject) -> bool:
        """Whether a new pod's claims are not in the cache yet (the claim's create and the pod's come on two
        watch streams): then it is held back, and read when they come (or after `CLAIM_WAIT_S`, and reported)."""
        key = object_key(obj)
        if not (obj.get("spec") or {}).get("resourceClaims") or key in self._pods:
            return False
        try:
            names = _pod_claim_names(obj)
        except ObjectError:
            return False
        with self.book.lock:
            missing = [n for n in names if n not in self.book.claims]
        if not missing:
            self._deferred.pop(key, None)
            return False
        first = self._deferred.get(key, (self.clock.now(), missing))[0]
        if self.clock.now() - first >= CLAIM_WAIT_S:
            return False
        self._deferred[key] = (first, missing)
        return True

    def _sharing(self, claims: Sequence[str]) -> set[str]:
        """The pods in the view (phantoms aside) that use one of `claims`."""
        with self.book.lock:
            users = {p for c in claims for p in self._claim_pods.get(c, ())}
        return {p for p in users if p in self._pods and p not in self._phantoms}

    def pump(self) -> int:
        delivered = super().pump()
        self._release_claims()
        now = self.clock.now()
        for key, (first, _) in list(self._deferred.items()):
            obj = self.pods.get(key)
            if obj is None:
                del self._deferred[key]
            elif now - first >= CLAIM_WAIT_S:
                self._queue("pod", MODIFIED, None, obj)
        return delivered

    def _release_claims(self) -> None:
        with self._release_lock:
            work, self._releases = self._releases, []
        for pod, claims in work:
            for claim in claims:
                self._unreserve(claim, split_key(pod)[1])

    def _unreserve(self, claim: str, pod_name: str, *, attempts: int = 3) -> None:
        """Take `pod_name` off the claim's `reservedFor`; a claim reserved by nobody loses its allocation."""
        namespace, name = split_key(claim)
        for _ in range(attempts):
            current = self.claim_informer.get(claim)
            if current is None:
                return
            status = current.get("status") or {}
            reserved = [r for r in status.get("reservedFor") or [] if r.get("name") != pod_name]
            if len(reserved) == len(status.get("reservedFor") or []):
                return
            patch: JsonObject = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                                 "status": {"reservedFor": reserved or None}}
            if not reserved:
                patch["status"]["allocation"] = None
            try:
                self.claim_informer.offer(self.api.patch(claim_path(namespace, name, "status"), patch))
                return
            except ApiError as exc:
                if exc.status == 404:
                    return
                if exc.status != 409:
                    log.warning("could not release ResourceClaim %s of pod %s: %s", claim, pod_name, exc)
                    return
                self.claim_informer.offer(self.api.get(claim_path(namespace, name)))

    # -------------------------------------------------------------- writes
    def bind(self, pod: str, assignment: Assignment, *, node_version: int | None = None) -> Status:
        """`KubeCluster.bind` for a claims' pod: checked against the view, the claims allocated, the Binding
        posted (`send_bind`), and the bound pod in the view when the call returns."""
        namespace, name = split_key(pod)
        key = f"{namespace}/{name}"
        if key not in self._uses:
            return super().bind(pod, assignment, node_version=node_version)
        with self.lock:
            info, node = self._pods.get(key), self._nodes.get(assignment.node)
        if info is None or info.phase is not PodPhase.PENDING:
            return Status.error(f"conflict: pod {pod} is not pending" if info else f"pod {pod} not found")
        if node is None or (node_version is not None and node.resource_version != node_version):
            return Status.error(f"conflict: node {assignment.node} not found or changed")
        raw = self.pods.get(key)
        status = self.send_bind(key, assignment)
        if status.ok and raw is not None:
            bound = copy.deepcopy(raw)
            bound.setdefault("spec", {})["nodeName"] = assignment.node
            self.pods.assume(bound, resource_version(raw))
            self.pump()
        return status

    def send_bind(self, pod: str, assignment: Assignment) -> Status:
        """Allocate and reserve the pod's claims (each guarded by its resourceVersion), then post the Binding; a
        refusal of either takes back what was written. Pods without claims bind as `KubeCluster` binds them."""
        use = self._uses.get(pod)
        if use is None:
            return super().send_bind(pod, assignment)
        namespace, name = split_key(pod)
        raw = self.pods.get(pod) or {}
        uid = str((raw.get("metadata") or {}).get("uid", ""))
        written: list[str] = []
        status = self._reserve(name, uid, assignment, use, written)
        if status.ok:
            binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": assignment.node}}
            try:
                self.api.create(pod_path(namespace, name, "binding"), binding)
                return status
            except ApiError as exc:
                prefix = "conflict: " if exc.status == 409 else ""
                status = Status.error(f"{prefix}binding {pod} to {assignment.node} refused: {exc}")
        for claim in written:
            self._unreserve(claim, name)
        return status

    def _results(self, use: ClaimUse, assignment: Assignment) -> dict[str, list[JsonObject]]:
        """Per claim, its `devices.results` for the pod's cards (asks take the cards in order)."""
        shares = iter(assignment.cards)
        out: dict[str, list[JsonObject]] = {}
        for ask in use.asks:
            for _ in range(ask.count):
                share = next(shares)
                result: JsonObject = {"request": ask.request, "driver": self.book.driver, "pool": assignment.node}
                if share.mig_profile is not None:
                    ref = DeviceRef(DeviceKind.MIG, share.card, share.mig_profile, share.mig_start)
                elif share.whole:
                    ref = DeviceRef(DeviceKind.CARD, share.card)
                else:
                    ref = DeviceRef(DeviceKind.VGPU, share.card)
                    result["shareID"] = str(uuid.uuid4())
                    result["consumedCapacity"] = {"memory": f"{share.memory_mib}Mi",
                                                  "compute": str(share.compute_milli), "shares": "1"}
                result["device"] = device_name(ref)
                out.setdefault(ask.claim, []).append(result)
        return out

    def _reserve(self, name: str, uid: str, assignment: Assignment, use: ClaimUse, written: list[str]) -> Status:
        results = self._results(use, assignment) if use.holder else {}
        me = {"resource": "pods", "name": name, "uid": uid}
        for claim in use.claims:
            namespace, claim_name = split_key(claim)
            current = self.claim_informer.get(claim)
            if current is None:
                return Status.error(f"conflict: ResourceClaim {claim} not found")
            status = dict(current.get("status") or {})
            reserved = list(status.get("reservedFor") or [])
            if any(r.get("name") == name for r in reserved):
                continue
            patch: JsonObject = {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]}}
            if use.holder:
                if status.get("allocation"):
                    return Status.error(f"conflict: ResourceClaim {claim} was allocated meanwhile")
                selector = {"nodeSelectorTerms": [{"matchFields": [
                    {"key": NODE_NAME_FIELD, "operator": "In", "values": [assignment.node]}]}]}
                patch["status"] = {"allocation": {"devices": {"results": results.get(claim, [])},
                                                  "nodeSelector": selector},
                                   "reservedFor": [*reserved, me]}
            else:
                if _allocated_node(current) != assignment.node:
                    return Status.error(f"conflict: ResourceClaim {claim} is not allocated on {assignment.node}")
                patch["status"] = {"reservedFor": [*reserved, me]}
            try:
                self.claim_informer.offer(self.api.patch(claim_path(namespace, claim_name, "status"), patch))
            except ApiError as exc:
                prefix = "conflict: " if exc.status in (404, 409) else ""
                return Status.error(f"{prefix}ResourceClaim {claim} could not be reserved for {name}: {exc}")
            written.append(claim)
        return Status.success()

    def evict(self, pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        """Evict the pod; one holding a shared claim's devices takes the pods sharing them along."""
        status = super().evict(pod, grace_s=grace_s, reason=reason)
        use = self._uses.get(pod)
        if status.ok and use is not None and use.holder:
            for other in sorted(self._sharing(use.claims) - {pod}):
                super().evict(other, grace_s=grace_s, reason=reason or f"shares a ResourceClaim with {pod}")
        return status


def _share(ref: DeviceRef, result: Mapping[str, Any], model: CardModel) -> CardShare:
    """The card share an allocated device stands for (as the card policy gives it)."""
    if ref.kind is DeviceKind.CARD:
        return CardShare(ref.card, MILLI_PER_CARD, model.memory_mib, model.encoders, model.decoders, whole=True)
    if ref.kind is DeviceKind.MIG:
        assert ref.profile_id is not None
        profile = model.mig_profiles[ref.profile_id]
        return CardShare(ref.card, model.mig_compute_milli(profile), profile.memory_mib, 0, 0,
                         mig_profile=profile.profile_id, mig_start=ref.start)
    consumed = result.get("consumedCapacity") or {}
    return CardShare(ref.card, cel_quantity(consumed.get("compute", "0")),
                     -(-cel_quantity(consumed.get("memory", "0")) // (1 << 20)))


def dra_scheduler(api: KubeApi, profile: Profile, *, catalog: Catalog, clock: Clock,
                  scheduler_name: str, sync_timeout_s: float = 300.0, **kwargs: Any) -> Any:
    """A `SchedulerMode` that allocates claims: its profile with `DraFilter`, its cluster a `DraKubeCluster`
    (`sync_timeout_s`: for the first lists; a pool of a thousand MIG-capable nodes is a large list)."""
    from gpuplane.kube.scheduler_mode import SchedulerMode

    book = DraBook(catalog)
    return SchedulerMode(api, dra_profile(profile, book), catalog=catalog, clock=clock,
                         scheduler_name=scheduler_name, cluster_factory=lambda: DraKubeCluster(
                             api, catalog, book, clock=clock, dispatch="manual", eviction_attempts=1,
                             scheduler_name=scheduler_name, sync_timeout_s=sync_timeout_s), **kwargs)


# ------------------------------------------------------------------ a request as a claim (tests, bench, parity)
GPU_CLASS, MIG_CLASS, VGPU_CLASS = DRIVER, f"mig.{DRIVER}", f"vgpu.{DRIVER}"
"""gpuplane's DeviceClasses (deploy/dra/deviceclasses.yaml)."""


def claim_manifest(request: PodRequest, claim_name: str) -> JsonObject:
    """The ResourceClaim that asks for `request`'s GPU form through gpuplane's classes: whole cards (count),
    a vGPU share (count, memory and compute), a MIG slice (a selector on the profile). Raises ValueError for a
    form a claim cannot say the same way (memory in percent, a share without memory, codec units)."""
    gpu = request.gpu
    namespace, _ = split_key(request.name)
    exactly: dict[str, Any]
    if isinstance(gpu, WholeCards):
        exactly = {"deviceClassName": GPU_CLASS, "count": gpu.count}
    elif isinstance(gpu, Fraction):
        if gpu.memory_pct or not gpu.memory_mib or gpu.encoders or gpu.decoders:
            raise ValueError(f"{request.name}: a vGPU claim asks memory in MiB and compute, no codec units")
        exactly = {"deviceClassName": VGPU_CLASS, "count": gpu.count,
                   "capacity": {"requests": {"memory": f"{gpu.memory_mib}Mi", "compute": str(gpu.compute_milli)}}}
    elif isinstance(gpu, MigSlice):
        exactly = {"deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": (
            f'device.attributes["{DRIVER}"].profile == "{gpu.profile}"' if isinstance(gpu.profile, str)
            else f'device.attributes["{DRIVER}"].profileId == {gpu.profile}')}}]}
    else:
        raise ValueError(f"{request.name}: asks for no GPU")
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": claim_name, "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def with_claim(pod: JsonObject, claim_name: str, *, template: bool = False) -> JsonObject:
    """`pod` (a manifest asking for gpuplane's resources) asking through the claim instead: its GPU resources
    dropped, `spec.resourceClaims` naming the claim (or template) and each container using it."""
    out = dict(pod)
    meta = dict(pod.get("metadata") or {})
    meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k != MIG_PROFILE}
    out["metadata"] = meta
    spec = dict(pod["spec"])
    containers = []
    for container in spec["containers"]:
        resources = {k: {r: v for r, v in values.items() if not r.startswith("gpuplane.io/")}
                     for k, values in (container.get("resources") or {}).items()}
        containers.append({**container, "resources": {**resources, "claims": [{"name": "gpu"}]}})
    entry = {"name": "gpu", ("resourceClaimTemplateName" if template else "resourceClaimName"): claim_name}
    spec["containers"] = containers
    spec["resourceClaims"] = [entry]
    out["spec"] = spec
    return out
