"""RDMA virtual functions as kubelet sees them: `gpuplane.io/rdma-vf`, steered to the NIC the scheduler chose.

A pod asks for `gpuplane.io/rdma-vf: N` when it is created (requests cannot change later); the scheduler picks
one physical function (PF) near the pod's cards and records it in the assignment (`rdma.nic`, an index into
the node inventory's NICs), and names that PF's Multus network on the pod (`gpuplane.kube.network`). This
plugin makes kubelet's choice of devices agree:

- The rails are the PFs of the pools file, in the SR-IOV network device plugin's own format (`resourceList`,
  one pool per PF: `selectors: [{pfNames: [<pf>], isRdma: true}]`; `load_pfs`). Each PF's VFs are read from
  sysfs (`discover`): `/sys/class/net/<pf>/device/virtfn<i>` (the VF's PCI address), the VF's
  `infiniband_verbs/` and `infiniband_mad/` character devices, the PF's `numa_node`.
- `ListAndWatch` advertises every VF of every PF (device ID: the VF's PCI address, with its NUMA node), so
  kubelet's PodResources shows the PCI address Multus hands the SR-IOV CNI.
- `GetPreferredAllocation` (offered, `get_preferred_allocation_available`) answers with available VFs of the PF
  the waiting pod was assigned; kubelet's device manager (`devicesToAllocate`) takes the preferred devices
  that are available, so with no topology-manager hint narrowing the set it allocates exactly these.
- `Allocate` checks that kubelet's devices are VFs of that PF (a VF of another rail would get the chosen
  rail's IP address: FAILED_PRECONDITION instead), and hands the container the VFs' RDMA character devices,
  `/dev/infiniband/rdma_cm`, and `PCIDEVICE_GPUPLANE_IO_RDMA_VF=<pci>,...` (the SR-IOV device plugin's
  variable, which RDMA tooling reads).

Which pod: kubelet's requests name none (v1beta1), so, as for cards (`gpuplane.node.allocation`), the
allocation is for the oldest pod (by `gpuplane.io/assigned-at`) on this node with an RDMA assignment whose
containers have not started and that this plugin has not yet handed all its VFs, and whose remaining VFs are
at least the count kubelet asks for. Kubelet admits pods one at a time, calling GetPreferredAllocation then
Allocate per container. Progress is kept in memory; a restarted plugin does not match a pod again once any
of its containers has started (a pod allocated but not yet started when the plugin restarts would be matched
again: restart the plugin between pods).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc

from gpuplane.kube.api import PODS_ALL, KubeApi
from gpuplane.kube.objects import (
    ASSIGNMENT,
    RES_RDMA,
    ObjectError,
    annotations_of,
    assigned_at,
    decode_assignment,
    object_key,
    pod_phase,
)
from gpuplane.model import Assignment, GpuplaneError, RdmaNic
from gpuplane.node.device_plugin import DEFAULT_DIR, HEALTHY, KUBELET_SOCKET, VERSION, DevicePluginError, protocol
from gpuplane.port import PodPhase

__all__ = [
    "ENDPOINT", "KubeRdmaPods", "MemoryRdmaPods", "PhysicalFunction", "RdmaDevicePlugin", "RdmaError", "RdmaPod",
    "RdmaPods", "VirtualFunction", "discover", "load_pfs", "match_rdma_pod", "pci_env", "rdma_nics", "rdma_pod",
    "steer",
]

log = logging.getLogger(__name__)

ENDPOINT = "gpuplane-rdma.sock"
RDMA_CM = "/dev/infiniband/rdma_cm"


class RdmaError(GpuplaneError):
    """A pools file or a PF gpuplane cannot use; names the entry or the path."""


@dataclass(frozen=True, slots=True)
class VirtualFunction:
    pci: str
    devices: tuple[str, ...]
    """Its RDMA character devices (`/dev/infiniband/uverbs<N>`, `umad<N>`, `issm<N>`)."""


@dataclass(frozen=True, slots=True)
class PhysicalFunction:
    name: str
    """The Linux interface name: what `pfNames` selects and the node inventory's NIC name."""
    pci: str
    numa: int
    vfs: tuple[VirtualFunction, ...]


def load_pfs(text: str) -> tuple[str, ...]:
    """The PFs of an SR-IOV network device plugin config (`config.json`) with one RDMA pool per PF.

    Every pool must select exactly one PF by name (`selectors: [{"pfNames": ["<pf>"], "isRdma": true}]`, no
    `#` VF ranges): gpuplane steers whole PFs. `RdmaError` naming the pool otherwise."""
    try:
        pools = json.loads(text)["resourceList"]
        if not isinstance(pools, list):
            raise TypeError("resourceList is not a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise RdmaError(f"not an SR-IOV device plugin config with a resourceList ({exc})") from None
    pfs: list[str] = []
    for i, pool in enumerate(pools):
        where = f"resourceList[{i}]"
        selectors = pool.get("selectors") if isinstance(pool, dict) else None
        if isinstance(selectors, dict):
            selectors = [selectors]  # the device plugin takes one object as a one-element list
        if not isinstance(selectors, list) or len(selectors) != 1 or not isinstance(selectors[0], dict):
            raise RdmaError(f"{where}.selectors: one selector per pool (one PF), got {selectors!r}")
        names = selectors[0].get("pfNames")
        if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str) or "#" in names[0]:
            raise RdmaError(f"{where}.selectors[0].pfNames: exactly one PF name, no VF range, got {names!r}")
        if selectors[0].get("isRdma") is not True:
            raise RdmaError(f"{where}.selectors[0].isRdma: must be true (gpuplane serves RDMA VFs)")
        if names[0] in pfs:
            raise RdmaError(f"{where}: PF {names[0]} is in another pool too")
        pfs.append(names[0])
    return tuple(pfs)


def _char_devices(function: Path) -> tuple[str, ...]:
    found = [f"/dev/infiniband/{entry.name}" for sub in ("infiniband_verbs", "infiniband_mad")
             if (function / sub).is_dir() for entry in (function / sub).iterdir()]
    return tuple(sorted(found))


def discover(pfs: Sequence[str], sysfs: Path = Path("/sys")) -> tuple[PhysicalFunction, ...]:
    """Each PF's PCI address, NUMA node (0 when the kernel reports none) and VFs, in `virtfn` order.
    `RdmaError` naming the path for a PF that is absent, has no VFs, or has a VF without RDMA devices."""
    found = []
    for pf in pfs:
        device = sysfs / "class" / "net" / pf / "device"
        if not device.exists():
            raise RdmaError(f"PF {pf}: {device} does not exist (not a PCI network interface on this node)")
        try:
            numa = max(0, int((device / "numa_node").read_text().strip() or 0))
        except (OSError, ValueError):
            numa = 0
        links = sorted(device.glob("virtfn*"), key=lambda p: int(p.name[len("virtfn"):] or 0))
        if not links:
            raise RdmaError(f"PF {pf}: no VFs ({device}/sriov_numvfs is 0?)")
        vfs = []
        for link in links:
            function = link.resolve()
            devices = _char_devices(function)
            if not devices:
                raise RdmaError(f"PF {pf}: VF {function.name} has no RDMA devices ({function}/infiniband_verbs)")
            vfs.append(VirtualFunction(function.name, devices))
        found.append(PhysicalFunction(pf, device.resolve().name, numa, tuple(vfs)))
    return tuple(found)


def rdma_nics(pfs: Sequence[PhysicalFunction]) -> tuple[RdmaNic, ...]:
    """The node inventory's NICs (`NodeInventory.nics`), in the pools file's order: the index the scheduler
    records. The PCIe switch is the NUMA node, as the inventory reports cards (`node_inventory`)."""
    return tuple(RdmaNic(pf.name, pf.numa, pf.numa, len(pf.vfs)) for pf in pfs)


def pci_env(resource: str) -> str:
    """The SR-IOV device plugin's variable for a resource's PCI addresses: `PCIDEVICE_` + the name upper-cased,
    with `.` and `/` (and, for a usable variable name, `-`) as `_`."""
    return "PCIDEVICE_" + re.sub(r"[^A-Z0-9_]", "_", resource.upper())


def steer(wanted: Sequence[str], available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """The preferred allocation: kubelet's must-include devices, then available devices of `wanted` (the VFs of
    the assigned PF) in their order, `size` in all (fewer when the PF has not enough available)."""
    free = set(available)
    chosen = list(must_include)
    chosen += [d for d in wanted if d in free and d not in chosen][:max(0, size - len(chosen))]
    return chosen


# -- which pod -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RdmaPod:
    """A pod on this node with an RDMA assignment whose containers have not started."""

    key: str
    uid: str
    assignment: Assignment
    assigned_at: float


class RdmaPods(Protocol):
    def waiting(self) -> list[RdmaPod]:
        """Pods on this node with an RDMA assignment, not finished, none of whose containers has started."""
        ...


def rdma_pod(pod: Mapping[str, Any], node: str) -> RdmaPod | None:
    """The pod as an `RdmaPod`, or None when it is elsewhere, finished, started or has no RDMA share. Raises
    `ObjectError` for an unreadable assignment or stamp."""
    spec = pod.get("spec")
    raw = annotations_of(pod).get(ASSIGNMENT)
    if (not raw or not isinstance(spec, Mapping) or spec.get("nodeName") != node
            or pod_phase(pod) is not PodPhase.RUNNING):
        return None
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    assert isinstance(status, Mapping)
    for statuses in ("initContainerStatuses", "containerStatuses"):
        for s in status.get(statuses) or []:
            state = s.get("state") if isinstance(s, Mapping) else None
            if isinstance(state, Mapping) and ("running" in state or "terminated" in state):
                return None
    key = object_key(pod)
    assignment = decode_assignment(raw, key)
    if assignment.rdma is None:
        return None
    meta = pod.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    stamp = assigned_at(pod)
    return RdmaPod(key, str(uid or key), assignment, float("inf") if stamp is None else stamp)


class KubeRdmaPods:
    """Pods through the API: a list with `fieldSelector=spec.nodeName=<node>`."""

    def __init__(self, api: KubeApi, node: str) -> None:
        self.api = api
        self.node = node

    def waiting(self) -> list[RdmaPod]:
        pods, _ = self.api.list(PODS_ALL, field_selector=f"spec.nodeName={self.node}")
        found = []
        for pod in pods:
            try:
                waiting = rdma_pod(pod, self.node)
            except ObjectError as exc:
                log.warning("skipping a pod waiting for RDMA functions: %s", exc)
                continue
            if waiting is not None:
                found.append(waiting)
        return found


class MemoryRdmaPods:
    """Pods held in memory (tests, dry runs without an API server)."""

    def __init__(self, *pods: RdmaPod) -> None:
        self.pods = list(pods)

    def waiting(self) -> list[RdmaPod]:
        return list(self.pods)


def match_rdma_pod(waiting: Sequence[RdmaPod], handed: Mapping[str, int], size: int) -> RdmaPod | None:
    """The oldest waiting pod (by assigned-at, then key) with at least `size` of its VFs not yet handed."""
    for pod in sorted(waiting, key=lambda p: (p.assigned_at, p.key)):
        assert pod.assignment.rdma is not None
        if pod.assignment.rdma.vfs - handed.get(pod.uid, 0) >= size:
            return pod
    return None


# -- the plugin ------------------------------------------------------------------------------------------------


def _abort(context: Any, code: Any, message: str) -> NoReturn:
    log.warning("RDMA: %s", message)
    context.abort(code, message)
    raise AssertionError("grpc's abort returned")  # pragma: no cover


class RdmaDevicePlugin:
    """The `DevicePlugin` service for `gpuplane.io/rdma-vf` and its registration with kubelet (`start`, `tick`,
    `stop`, as the GPU plugin's). `pfs`: the rails, in the node inventory's NIC order."""

    def __init__(self, pfs: Sequence[PhysicalFunction], pods: RdmaPods, *, directory: Path = Path(DEFAULT_DIR),
                 endpoint: str = ENDPOINT, resource: str = RES_RDMA, register_timeout_s: float = 5.0) -> None:
        if not pfs:
            raise DevicePluginError("no RDMA PFs to serve")
        self.pfs = tuple(pfs)
        self.pods = pods
        self.directory = directory
        self.endpoint = endpoint
        self.resource = resource
        self.register_timeout_s = register_timeout_s
        self._pf_of = {vf.pci: pf for pf in self.pfs for vf in pf.vfs}
        self._handed: dict[str, int] = {}
        """pod UID -> VFs handed so far."""
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._registered_with: tuple[int, int] | None = None
        self.registrations = 0

    # -- driving ----------------------------------------------------------------------------------------------
    @property
    def socket_path(self) -> Path:
        return self.directory / self.endpoint

    def start(self) -> None:
        """Serve on the socket and register (a kubelet not there yet is retried by `tick`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._serve()
        self._register()

    def tick(self) -> None:
        """Serve again when our socket is gone (a kubelet restart wipes it); register with a new kubelet.sock."""
        if self._server is None or not self.socket_path.exists():
            self._serve()
            self._registered_with = None
        identity = _identity(self.directory / KUBELET_SOCKET)
        if identity is not None and identity != self._registered_with:
            self._register()

    def run(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """`tick` every `interval_s` until `stop` is set."""
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:  # keep watching: one bad round must not end the plugin
                log.exception("RDMA device plugin round failed")

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._stopping.set()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait()

    def _serve(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpuplane-rdma"))
        protocol().services.add_DevicePluginServicer_to_server(self, server)
        if not server.add_insecure_port(f"unix://{self.socket_path.absolute()}"):
            raise DevicePluginError(f"cannot serve on {self.socket_path}")
        server.start()
        self._stopping.clear()
        self._server = server
        log.info("RDMA device plugin serving %s on %s", self.resource, self.socket_path)

    def _register(self) -> bool:
        kubelet = self.directory / KUBELET_SOCKET
        identity = _identity(kubelet)
        if identity is None:
            return False
        pb = protocol().messages
        request = pb.RegisterRequest(version=VERSION, endpoint=self.endpoint, resource_name=self.resource,
                                     options=self._options())
        with grpc.insecure_channel(f"unix://{kubelet.absolute()}") as channel:
            try:
                protocol().services.RegistrationStub(channel).Register(request, timeout=self.register_timeout_s)
            except grpc.RpcError as exc:
                log.warning("Register with %s failed: %s %s", kubelet, exc.code(), exc.details())
                return False
        self._registered_with = identity
        self.registrations += 1
        return True

    # -- gRPC servicer ---------------------------------------------------------------------------------------
    @staticmethod
    def _options() -> Any:
        return protocol().messages.DevicePluginOptions(pre_start_required=False,
                                                       get_preferred_allocation_available=True)

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:  # the RPCs keep their protocol names
        return self._options()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        """Every VF of every PF, once; the stream stays open until kubelet hangs up or the plugin stops."""
        pb = protocol().messages
        yield pb.ListAndWatchResponse(devices=[
            pb.Device(ID=vf.pci, health=HEALTHY, topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=pf.numa)]))
            for pf in self.pfs for vf in pf.vfs])
        while context.is_active() and not self._stopping.wait(1.0):
            pass

    def _assigned(self, size: int, context: Any) -> tuple[RdmaPod, PhysicalFunction]:
        try:
            waiting = self.pods.waiting()
        except Exception as exc:  # the API server may be away: kubelet retries the container
            _abort(context, grpc.StatusCode.UNAVAILABLE, f"cannot list the pods waiting for RDMA functions: {exc}")
        uids = {p.uid for p in waiting}
        self._handed = {uid: n for uid, n in self._handed.items() if uid in uids}  # started or gone: forgotten
        pod = match_rdma_pod(waiting, self._handed, size)
        if pod is None:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                   f"no pod on this node waits for {size} {self.resource} (an RDMA assignment not yet handed)")
        assert pod.assignment.rdma is not None
        if not 0 <= pod.assignment.rdma.nic < len(self.pfs):
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                   f"{pod.key}: assigned RDMA NIC {pod.assignment.rdma.nic}, this node serves {len(self.pfs)}")
        return pod, self.pfs[pod.assignment.rdma.nic]

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        pb = protocol().messages
        responses = []
        with self._lock:
            for r in request.container_requests:
                pod, pf = self._assigned(r.allocation_size, context)
                chosen = steer([vf.pci for vf in pf.vfs], r.available_deviceIDs, r.must_include_deviceIDs,
                               r.allocation_size)
                log.info("preferring %s of %s for %s", ",".join(chosen), pf.name, pod.key)
                responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return protocol().messages.PreStartContainerResponse()

    def Allocate(self, request: Any, context: Any) -> Any:
        pb = protocol().messages
        responses = []
        with self._lock:
            for r in request.container_requests:
                ids = list(r.devices_ids)
                unknown = [d for d in ids if d not in self._pf_of]
                if unknown:
                    _abort(context, grpc.StatusCode.NOT_FOUND, f"unknown device(s) {unknown} (VF PCI addresses)")
                pod, pf = self._assigned(len(ids), context)
                wrong = [d for d in ids if self._pf_of[d].name != pf.name]
                if wrong:
                    _abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                           f"{pod.key}: assigned PF {pf.name}; kubelet allocated {wrong} of another PF")
                vfs = [vf for vf in pf.vfs if vf.pci in ids]
                devices = [*(d for vf in vfs for d in vf.devices), RDMA_CM]
                responses.append(pb.ContainerAllocateResponse(
                    envs={pci_env(self.resource): ",".join(vf.pci for vf in vfs)},
                    devices=[pb.DeviceSpec(container_path=d, host_path=d, permissions="rw") for d in devices]))
                self._handed[pod.uid] = self._handed.get(pod.uid, 0) + len(ids)
                log.info("allocated %s of %s to %s", ",".join(ids), pf.name, pod.key)
        return pb.AllocateResponse(container_responses=responses)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns
