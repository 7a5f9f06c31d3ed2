"""What the device plugin's `Allocate` hands a container: find the pod the allocation is for, then turn its
card assignment into environment, mounts and device nodes.

Kubelet picks `gpuplane.io/gpu` units (`<card uuid>::<k>`) by count only, so, as in HAMi, the units it names
do not say which cards the container gets: the scheduler's assignment on the pod does. The allocation is for
the oldest pod (by `gpuplane.io/assigned-at`) on this node whose `gpuplane.io/bind-phase` is `allocating` and
whose next GPU container asks for as many units as kubelet requested.

Progress is kept on the pod, not in the plugin: `gpuplane.io/allocated-containers` (`ALLOCATED_CONTAINERS`)
counts the GPU containers already handed their cards (absent: none), and a restarted plugin resumes from it.
The bind phase stays `allocating` until the last GPU container's cards are handed, when one write sets the
count and turns the phase `allocated`. The count is written before the RPC answers; a failed write fails the
RPC, and kubelet's retry matches the same container again. An answer lost after the write is not undone:
kubelet's request names no container, so its retry cannot be told from the next container's request.

What a container gets (`container_allocation`):

- `NVIDIA_VISIBLE_DEVICES`: the assigned cards' UUIDs, or the MIG device's UUID for a MIG share (read by the
  NVIDIA container runtime, which also adds the MIG capability devices);
- a fraction of a card, outside MPS mode: HAMi-core's limits (`CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m` per
  visible card, `CUDA_DEVICE_SM_LIMIT=<percent>`, `CUDA_DEVICE_MEMORY_SHARED_CACHE`, `CUDA_OVERSUBSCRIBE=true`
  for an oversubscribed assignment, `CUDA_TASK_PRIORITY` 0 online / 1 offline) with `libvgpu.so` mounted and
  preloaded through a mounted `/etc/ld.so.preload`, the per-container cache directory and the lock directory;
- on a node in MPS mode: the MPS client variables instead (`CUDA_MPS_PIPE_DIRECTORY`, and for a fraction
  `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<i>=<MiB>M`), with the pipe
  directory and `/dev/shm` mounted; MPS enforces the limits, so HAMi-core is not loaded twice over it;
- device nodes `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` and `/dev/nvidia<minor>` per card
  (the parent card for MIG), as the NVIDIA plugin passes with `PASS_DEVICE_SPECS=true`.

A pod's GPU containers are those that ask for the resource (requests, limits standing in: `container_units`), init
containers first, in the order kubelet allocates devices: a native sidecar's cards are its own run, and a plain init
container asking as many units as the pod's cards gets them all, as kubelet hands them on to the next container.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpuplane.kube.api import PODS_ALL, KubeApi, pod_path
from gpuplane.kube.objects import (
    ALLOCATED_CONTAINERS,
    ASSIGNMENT,
    BIND_PHASE,
    PHASE_ALLOCATED,
    PHASE_ALLOCATING,
    RES_GPU,
    ObjectError,
    annotations_of,
    assigned_at,
    container_units,
    decode_assignment,
    object_key,
    parse_count,
    pod_phase,
    pod_qos,
    split_key,
)
from gpuplane.model import MILLI_PER_CARD, Assignment, CardShare, GpuplaneError, QoS
from gpuplane.node.gpu import CardInfo
from gpuplane.port import PodPhase

__all__ = [
    "ALLOCATED_CONTAINERS", "AllocationSettings", "AssignmentSource", "BoundPod", "ContainerAllocation", "DeviceNode",
    "KubeAssignmentSource", "MemoryAssignmentSource", "Mount", "PendingPod", "bound_pod", "container_allocation",
    "match_pod", "pending_pod", "prepare_host",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingPod:
    """A pod on this node waiting for its devices (bind phase `allocating`)."""

    key: str
    """namespace/name"""
    uid: str
    assignment: Assignment
    assigned_at: float
    qos: QoS = QoS.ONLINE
    containers: tuple[tuple[str, int], ...] = ()
    """(name, units of the GPU resource) of each container that asks for it, init containers first (kubelet's
    order; `container_units`)."""
    handed: int = 0
    """GPU containers already handed their cards (`ALLOCATED_CONTAINERS`)."""

    @property
    def gpu_containers(self) -> tuple[tuple[str, int], ...]:
        """The containers, or one unnamed container holding every card when the spec named none."""
        return self.containers or (("", len(self.assignment.cards)),)


@dataclass(frozen=True, slots=True)
class BoundPod:
    """A pod on this node that holds (or is about to hold) the cards of its assignment."""

    key: str
    assignment: Assignment


class AssignmentSource(Protocol):
    """Where the device plugin finds the pods waiting for devices, records their progress, and sees which pods
    hold cards on the node."""

    def pending(self) -> list[PendingPod]:
        """Pods on this node in bind phase `allocating` (any order), with their recorded progress."""
        ...

    def mark_handed(self, pod: PendingPod, handed: int) -> None:
        """Record that the pod's first `handed` GPU containers have their devices; when that is all of them the
        bind phase turns `allocated`. Raises `GpuplaneError` when it cannot be recorded."""
        ...

    def holders(self) -> list[BoundPod]:
        """Every pod on this node that may hold cards: it has an assignment and has not finished (phase neither
        Succeeded nor Failed; a terminating pod still holds them). Raises `GpuplaneError` when that cannot be
        known in full (the pods cannot be listed, or one's assignment cannot be read)."""
        ...


def pending_pod(pod: Mapping[str, Any], node: str, resource: str = RES_GPU) -> PendingPod | None:
    """The pod as a `PendingPod` when it is on `node`, neither terminating nor finished, and in bind phase
    `allocating`; None otherwise. Raises `ObjectError` for an unreadable assignment, stamp, progress, QoS label or
    container (a count of units that is not whole, say)."""
    spec = pod.get("spec")
    annotations = annotations_of(pod)
    if (annotations.get(BIND_PHASE) != PHASE_ALLOCATING or not isinstance(spec, Mapping)
            or spec.get("nodeName") != node or pod_phase(pod) is not PodPhase.RUNNING):
        return None
    key = object_key(pod)
    raw = annotations.get(ASSIGNMENT)
    if not raw:
        raise ObjectError(key, f"metadata.annotations[{ASSIGNMENT}]", "missing while the bind phase is allocating")
    assignment = decode_assignment(raw, key)
    stamp = assigned_at(pod)
    raw_handed = annotations.get(ALLOCATED_CONTAINERS, "0")
    handed = parse_count(raw_handed)
    if handed is None:
        raise ObjectError(key, f"metadata.annotations[{ALLOCATED_CONTAINERS}]",
                          f"{raw_handed!r} is not a count of containers")
    meta = pod.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return PendingPod(key, str(uid or key), assignment, float("inf") if stamp is None else stamp, pod_qos(pod),
                      container_units(pod, resource), handed)


def bound_pod(pod: Mapping[str, Any], node: str) -> BoundPod | None:
    """The pod as a `BoundPod` when it is on `node`, has an assignment and has not finished; None otherwise.
    Raises `ObjectError` for an unreadable assignment."""
    spec = pod.get("spec")
    raw = annotations_of(pod).get(ASSIGNMENT)
    if (not isinstance(spec, Mapping) or spec.get("nodeName") != node or not raw
            or pod_phase(pod) in (PodPhase.SUCCEEDED, PodPhase.FAILED)):
        return None
    key = object_key(pod)
    return BoundPod(key, decode_assignment(raw, key))


class KubeAssignmentSource:
    """Pods through the API: a list with `fieldSelector=spec.nodeName=<node>` (a consistent read, so it shows
    the plugin's own last write); progress is a merge PATCH of `ALLOCATED_CONTAINERS` (and, with the last
    container, of the bind phase)."""

    def __init__(self, api: KubeApi, node: str, resource: str = RES_GPU) -> None:
        self.api = api
        self.node = node
        self.resource = resource

    def pending(self) -> list[PendingPod]:
        pods, _ = self.api.list(PODS_ALL, field_selector=f"spec.nodeName={self.node}")
        found = []
        for pod in pods:
            try:
                pending = pending_pod(pod, self.node, self.resource)
            except ObjectError as exc:
                log.warning("skipping a pod waiting for devices: %s", exc)
                continue
            if pending is not None:
                found.append(pending)
        return found

    def mark_handed(self, pod: PendingPod, handed: int) -> None:
        namespace, name = split_key(pod.key)
        annotations = {ALLOCATED_CONTAINERS: str(handed)}
        if handed >= len(pod.gpu_containers):
            annotations[BIND_PHASE] = PHASE_ALLOCATED
        try:
            self.api.patch(pod_path(namespace, name), {"metadata": {"annotations": annotations}})
        except Exception as exc:  # ApiError, or the transport's own errors
            what = ", ".join(f"{k}={v}" for k, v in annotations.items())
            raise GpuplaneError(f"{pod.key}: cannot record {what}: {exc}") from exc

    def holders(self) -> list[BoundPod]:
        try:
            pods, _ = self.api.list(PODS_ALL, field_selector=f"spec.nodeName={self.node}")
        except Exception as exc:  # ApiError, or the transport's own errors
            raise GpuplaneError(f"cannot list the pods on {self.node}: {exc}") from exc
        found = []
        for pod in pods:
            bound = bound_pod(pod, self.node)  # an ObjectError (a GpuplaneError) goes to the caller
            if bound is not None:
                found.append(bound)
        return found


class MemoryAssignmentSource:
    """Pods held in memory (tests, `--fake-cards` dry runs): `pods` wait (with their progress), `allocated`
    have every container's cards."""

    def __init__(self, pods: Sequence[PendingPod] = ()) -> None:
        self.pods = list(pods)
        self.allocated: list[PendingPod] = []

    def add(self, pod: PendingPod) -> None:
        self.pods.append(pod)

    def delete(self, key: str) -> None:
        """The pod is gone (deleted, or finished)."""
        self.pods = [p for p in self.pods if p.key != key]
        self.allocated = [p for p in self.allocated if p.key != key]

    def pending(self) -> list[PendingPod]:
        return list(self.pods)

    def mark_handed(self, pod: PendingPod, handed: int) -> None:
        if handed >= len(pod.gpu_containers):
            self.pods = [p for p in self.pods if p.uid != pod.uid]
            self.allocated.append(pod)
        else:
            self.pods = [replace(p, handed=handed) if p.uid == pod.uid else p for p in self.pods]

    def holders(self) -> list[BoundPod]:
        return [BoundPod(p.key, p.assignment) for p in self.pods + self.allocated]


def match_pod(pending: Sequence[PendingPod], units: int,
              handed: Mapping[str, int] | None = None) -> tuple[PendingPod, int, tuple[CardShare, ...]] | None:
    """(pod, container number, the container's cards) for an allocation of `units` units, or None.

    A pod's next container is the first of its GPU containers not yet handed its cards: `PendingPod.handed`,
    or `handed[uid]` when that is more. When the containers' units add up to the pod's cards, each container
    gets its own run of cards in spec order; otherwise (one card shared by the pod's containers) every
    container gets all of the pod's cards."""
    for pod in sorted(pending, key=lambda p: (p.assigned_at, p.key)):
        containers = pod.gpu_containers
        number = max(pod.handed, (handed or {}).get(pod.uid, 0))
        if number >= len(containers) or containers[number][1] != units:
            continue
        cards = pod.assignment.cards
        counts = [n for _, n in containers]
        if sum(counts) == len(cards):
            offset = sum(counts[:number])
            return pod, number, cards[offset:offset + units]
        if len(cards) == units or len(cards) == 1:
            return pod, number, cards
    return None


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True, slots=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True, slots=True)
class AllocationSettings:
    """Where things are on the host; the node's sharing mode."""

    mps: bool = False
    """The node's cards run an MPS daemon (`nvidia-cuda-mps-control -d`, EXCLUSIVE_PROCESS)."""
    mps_pipe_dir: str = "/tmp/nvidia-mps"
    """The daemon's `CUDA_MPS_PIPE_DIRECTORY`; mounted at the same path."""
    vgpu_dir: str = "/usr/local/vgpu"
    """Host directory with HAMi-core's `libvgpu.so`, an `ld.so.preload` naming it, and `containers/` (the
    per-container shared-region directories)."""
    lock_dir: str = "/tmp/vgpulock"
    dev_dir: str = "/dev"
    device_specs: bool = True
    """Pass the device nodes (else leave them to the NVIDIA container runtime)."""

    @property
    def libvgpu(self) -> str:
        return f"{self.vgpu_dir}/libvgpu.so"

    @property
    def ld_preload(self) -> str:
        return f"{self.vgpu_dir}/ld.so.preload"

    def cache_dir(self, pod_uid: str, container: str) -> str:
        return f"{self.vgpu_dir}/containers/{pod_uid}_{container}"


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    envs: dict[str, str]
    mounts: tuple[Mount, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] | None = None


LIBVGPU_IN_CONTAINER = "/usr/local/vgpu/libvgpu.so"
"""Where the container finds HAMi-core (the path the mounted /etc/ld.so.preload names)."""


def _percent(milli: int) -> int | None:
    """A compute share as HAMi-core's and MPS's whole percent; None for no limit (none or a whole card)."""
    return milli * 100 // MILLI_PER_CARD if 0 < milli < MILLI_PER_CARD else None


def container_allocation(pod: PendingPod, container: str, shares: Sequence[CardShare], cards: Mapping[int, CardInfo],
                         mig_uuids: Mapping[int, str], settings: AllocationSettings) -> ContainerAllocation:
    """The environment, mounts and device nodes for one container holding `shares` (the cards of `cards` by
    index; `mig_uuids` the MIG device UUID for each MIG share's card)."""
    visible = [mig_uuids[s.card] if s.mig_profile is not None else cards[s.card].uuid for s in shares]
    envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(visible)}
    mounts: list[Mount] = []
    fractions = [s for s in shares if not s.whole and s.mig_profile is None]
    if settings.mps:
        envs["CUDA_MPS_PIPE_DIRECTORY"] = settings.mps_pipe_dir
        mounts += [Mount(settings.mps_pipe_dir, settings.mps_pipe_dir, False), Mount("/dev/shm", "/dev/shm", False)]
        percents = {p for s in fractions if (p := _percent(s.compute_milli)) is not None}
        if percents:
            envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(min(percents))
        limits = [f"{i}={s.memory_mib}M" for i, s in enumerate(shares) if s in fractions and s.memory_mib > 0]
        if limits:
            envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(limits)
    elif fractions:
        for i, share in enumerate(shares):
            if share in fractions and share.memory_mib > 0:
                envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{share.memory_mib}m"
        percents = {p for s in fractions if (p := _percent(s.compute_milli)) is not None}
        if percents:
            envs["CUDA_DEVICE_SM_LIMIT"] = str(min(percents))
        cache = settings.cache_dir(pod.uid, container)
        envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"{cache}/vgpu.cache"
        if pod.assignment.oversubscribed:
            envs["CUDA_OVERSUBSCRIBE"] = "true"
        envs["CUDA_TASK_PRIORITY"] = "0" if pod.qos is QoS.ONLINE else "1"
        mounts += [
            Mount(LIBVGPU_IN_CONTAINER, settings.libvgpu, True),
            Mount("/etc/ld.so.preload", settings.ld_preload, True),
            Mount(cache, cache, False),
            Mount(settings.lock_dir, settings.lock_dir, False),
        ]
    devices: list[DeviceNode] = []
    if settings.device_specs:
        dev = settings.dev_dir
        devices = [DeviceNode("/dev/nvidiactl", f"{dev}/nvidiactl"), DeviceNode("/dev/nvidia-uvm", f"{dev}/nvidia-uvm"),
                   DeviceNode("/dev/nvidia-uvm-tools", f"{dev}/nvidia-uvm-tools")]
        for card in dict.fromkeys(s.card for s in shares):
            minor = cards[card].minor if cards[card].minor is not None else card
            devices.append(DeviceNode(f"/dev/nvidia{minor}", f"{dev}/nvidia{minor}"))
    return ContainerAllocation(envs, tuple(mounts), tuple(devices), {"gpuplane.io/pod": pod.key})


def prepare_host(allocation: ContainerAllocation) -> None:
    """Create the writable host directories `allocation` mounts (HAMi-core's shared-region cache, its lock
    directory, MPS's pipe directory), which the runtime needs to exist before it bind-mounts them; a directory
    that cannot be made is logged (the container's start then reports it)."""
    for mount in allocation.mounts:
        if not mount.read_only and mount.host_path != "/dev/shm":
            try:
                os.makedirs(mount.host_path, mode=0o777, exist_ok=True)
            except OSError as exc:
                log.warning("cannot create %s: %s", mount.host_path, exc)
