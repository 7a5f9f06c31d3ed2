"""Kubernetes objects ↔ gpuplane's model: the wire contract of the Kubernetes world.

Everything that reads or writes a pod or node in the Kubernetes API goes through this module, so the
extender, the cluster port, the device plugin and the admission webhook agree on one encoding.

How a pod asks for GPUs (container `resources.limits`, summed over containers; HAMi's conventions):

- `gpuplane.io/gpu`: cards wanted. Alone, whole cards.
- `gpuplane.io/gpucores` (percent of one card's compute, 100 = exclusive) and/or `gpuplane.io/gpumem`
  (MiB) or `gpuplane.io/gpumem-percentage`: with `gpuplane.io/gpu: N`, that share on each of N distinct cards
  (HAMi's reading; N = 1 is a fraction of one card).
- `gpuplane.io/gpu-encoders`, `gpuplane.io/gpu-decoders`: video codec units on the card.
- annotation `gpuplane.io/mig-profile` (`3g.40gb` or a profile ID): one MIG instance.
- `gpuplane.io/rdma-vf`: RDMA virtual functions.

Everything else comes from the pod: `spec.priority`/`priorityClassName`/`preemptionPolicy`, label
`gpuplane.io/qos`, label `gpuplane.io/queue`, the gang label `scheduling.x-k8s.io/pod-group` with annotation
`gpuplane.io/gang-size`, annotation `gpuplane.io/gpu-models`, node selector `gpuplane.io/pool`, tolerations.

What the scheduler records on the pod before binding (`ASSIGNMENT`, `ASSIGNED_AT`, `BIND_PHASE`) is the
whole card-level state: a restarted scheduler rebuilds it from pods alone. Users must never set these
(the admission webhook rejects them: `SCHEDULER_ANNOTATIONS`).

A node describes its cards in annotation `gpuplane.io/gpu-inventory`, written by the node agent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from gpuplane.model import (
    Assignment,
    CardShare,
    Catalog,
    CatalogError,
    Fraction,
    GpuForm,
    GpuplaneError,
    MigMode,
    MigSlice,
    NodeSpec,
    NodeSpecError,
    PodRequest,
    QoS,
    RdmaLocality,
    RdmaNic,
    RdmaShare,
    RequestError,
    Taint,
    Toleration,
    Topology,
    WholeCards,
    make_request,
)
from gpuplane.port import NodeInfo, PodInfo, PodPhase

DOMAIN = "gpuplane.io"

# Resources a container asks for (extended resources; all but GPU are `ignoredByScheduler`).
RES_GPU = f"{DOMAIN}/gpu"
RES_CORES = f"{DOMAIN}/gpucores"
RES_MEM = f"{DOMAIN}/gpumem"
RES_MEM_PCT = f"{DOMAIN}/gpumem-percentage"
RES_ENCODERS = f"{DOMAIN}/gpu-encoders"
RES_DECODERS = f"{DOMAIN}/gpu-decoders"
RES_RDMA = f"{DOMAIN}/rdma-vf"
MANAGED_RESOURCES = (RES_GPU, RES_CORES, RES_MEM, RES_MEM_PCT, RES_ENCODERS, RES_DECODERS, RES_RDMA)

# Pod labels and annotations a user sets.
QOS_LABEL = f"{DOMAIN}/qos"
QUEUE_LABEL = f"{DOMAIN}/queue"
WORKLOAD_LABEL = f"{DOMAIN}/workload"
INSTANCE_LABEL = f"{DOMAIN}/instance"
GANG_LABEL = "scheduling.x-k8s.io/pod-group"
GANG_SIZE = f"{DOMAIN}/gang-size"
MIG_PROFILE = f"{DOMAIN}/mig-profile"
GPU_MODELS = f"{DOMAIN}/gpu-models"
CHECKPOINT_EVERY = f"{DOMAIN}/checkpoint-every-s"
POOL_LABEL = f"{DOMAIN}/pool"

# Pod annotations only the scheduler writes.
ASSIGNMENT = f"{DOMAIN}/assignment"
ASSIGNED_AT = f"{DOMAIN}/assigned-at"
BIND_PHASE = f"{DOMAIN}/bind-phase"
ALLOCATED_CONTAINERS = f"{DOMAIN}/allocated-containers"
"""GPU containers of the pod the device plugin has handed their cards so far (durable across its restarts)."""
SCHEDULER_ANNOTATIONS = frozenset({ASSIGNMENT, ASSIGNED_AT, BIND_PHASE, ALLOCATED_CONTAINERS})
"""Annotations only gpuplane writes; the device plugin may write `BIND_PHASE` and `ALLOCATED_CONTAINERS`."""
PHASE_ALLOCATING = "allocating"
"""Recorded, bound, not yet handed to a container by the device plugin."""
PHASE_ALLOCATED = "allocated"
PHASE_FAILED = "failed"

# Node annotations and labels the node agent writes.
INVENTORY = f"{DOMAIN}/gpu-inventory"
SCHEDULER_NAME = "gpuplane-scheduler"


class ObjectError(GpuplaneError):
    """A Kubernetes object gpuplane cannot read; names the object and the field."""

    def __init__(self, obj: str, field: str, message: str) -> None:
        super().__init__(f"{obj}: {field}: {message}")
        self.obj = obj
        self.field = field


# ------------------------------------------------------------------ small readers
def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def object_key(obj: Mapping[str, Any]) -> str:
    """`namespace/name` for namespaced objects, `name` for cluster-scoped ones."""
    meta = _meta(obj)
    name = str(meta.get("name") or "")
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if namespace else name


def split_key(key: str, default_namespace: str = "default") -> tuple[str, str]:
    """`ns/name` → (ns, name); a bare name is in `default_namespace`."""
    namespace, _, name = key.rpartition("/")
    return (namespace or default_namespace), name


def _str_map(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): str(v) for k, v in value.items()}


def labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(_meta(obj).get("labels"))


def annotations_of(obj: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(_meta(obj).get("annotations"))


def parse_time(value: object) -> float | None:
    """RFC 3339 (`2026-11-29T15:31:00Z`, optionally with fractions) → epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):  # OverflowError, OSError: a date the platform cannot place
        return None


def resource_version_number(raw: object) -> int:
    """A resourceVersion as a non-negative integer, -1 when absent or not one. Kubernetes calls it opaque; etcd's
    revisions (and the test server's) are decimal integers, which is what ordering assumed writes needs."""
    if not isinstance(raw, str) or not (raw.isascii() and raw.isdigit()):
        return -1
    try:
        return int(raw)
    except ValueError:  # past Python's digit limit
        return -1


def resource_version(obj: Mapping[str, Any] | None) -> int:
    """An object's `metadata.resourceVersion` as `resource_version_number` reads it (-1 for no object)."""
    return -1 if obj is None else resource_version_number(_meta(obj).get("resourceVersion"))


def format_time(epoch_s: float, *, micro: bool = False) -> str:
    """Epoch seconds → RFC 3339 in UTC (`micro`: MicroTime, as Lease fields use)."""
    moment = datetime.fromtimestamp(epoch_s, UTC)
    if micro:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


QUANTITY_LIMIT = Decimal(2**63)
"""Kubernetes keeps quantities within int64; past it (or not finite) a value is no quantity."""


def quantity(value: object, obj: str, field: str) -> Decimal:
    try:
        parsed = Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]
        if not parsed.is_finite() or abs(parsed) >= QUANTITY_LIMIT:
            raise ValueError("out of range")
        return parsed
    except (ValueError, TypeError, ArithmeticError):  # ArithmeticError: decimal's InvalidOperation, Overflow
        raise ObjectError(obj, field, f"not a Kubernetes quantity: {value!r}") from None


def _whole(value: Decimal, obj: str, field: str) -> int:
    if value != value.to_integral_value() or value < 0:
        raise ObjectError(obj, field, f"must be a whole non-negative number, got {value}")
    return int(value)


def _int_annotation(annotations: Mapping[str, str], key: str, obj: str) -> int | None:
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ObjectError(obj, f"metadata.annotations[{key}]", f"not an integer: {raw!r}") from None


def parse_count(raw: str) -> int | None:
    """A decimal count (`0`, `12`), or None for anything else (`-1`, `²`, digits past Python's limit)."""
    if not (raw.isascii() and raw.isdigit()):
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _seconds(raw: str) -> float | None:
    """Epoch seconds (`1700000000.5`) or RFC 3339; None for anything else, or a value not finite."""
    try:
        value = float(raw)
    except ValueError:
        return parse_time(raw)
    return value if math.isfinite(value) else None


def assigned_at(pod: Mapping[str, Any]) -> float | None:
    """When the scheduler recorded the pod's assignment (annotation `ASSIGNED_AT`: epoch seconds or RFC 3339);
    None when not recorded. Raises `ObjectError` for a stamp that is neither."""
    raw = annotations_of(pod).get(ASSIGNED_AT)
    if raw is None:
        return None
    stamp = _seconds(raw)
    if stamp is None:
        raise ObjectError(object_key(pod), f"metadata.annotations[{ASSIGNED_AT}]",
                          f"not a time (epoch seconds or RFC 3339): {raw!r}")
    return stamp


def pod_qos(pod: Mapping[str, Any]) -> QoS:
    """The pod's gpuplane QoS (label `QOS_LABEL`, online when absent). Raises `ObjectError` for an unknown one."""
    raw = labels_of(pod).get(QOS_LABEL, "online")
    try:
        return QoS.from_trace(raw)
    except RequestError:
        raise ObjectError(object_key(pod), f"metadata.labels[{QOS_LABEL}]",
                          f"unknown QoS {raw!r} (online, offline, best-effort)") from None


# ------------------------------------------------------------------ pods
def _items(value: object, obj: str, field: str) -> list[Mapping[str, Any]]:
    """A list of objects (None: empty); anything else names the field."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise ObjectError(obj, field, f"must be a list of objects, got {type(value).__name__}")
    return value


def _resource_map(container: Mapping[str, Any], obj: str, field: str) -> dict[str, str]:
    """`limits` over `requests` of one container."""
    resources = container.get("resources")
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise ObjectError(obj, f"{field}.resources", "must be an object")
    merged: dict[str, str] = {}
    for part in ("requests", "limits"):
        values = resources.get(part)
        if values is None:
            continue
        if not isinstance(values, Mapping):
            raise ObjectError(obj, f"{field}.resources.{part}", "must be an object")
        merged.update({str(k): str(v) for k, v in values.items()})
    return merged


def pod_resources(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """Per resource, the sum over containers of `limits` (falling back to `requests`).

    Init containers run before the others, so the pod needs the larger of their largest and the sum.
    """
    obj = object_key(pod)
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    total: dict[str, Decimal] = {}
    for i, container in enumerate(_items(spec.get("containers"), obj, "spec.containers")):
        for name, raw in _resource_map(container, obj, f"spec.containers[{i}]").items():
            total[name] = total.get(name, Decimal(0)) + quantity(raw, obj, f"spec.containers[{i}].resources[{name}]")
    for i, container in enumerate(_items(spec.get("initContainers"), obj, "spec.initContainers")):
        for name, raw in _resource_map(container, obj, f"spec.initContainers[{i}]").items():
            value = quantity(raw, obj, f"spec.initContainers[{i}].resources[{name}]")
            total[name] = max(total.get(name, Decimal(0)), value)
    return total


def container_units(pod: Mapping[str, Any], resource: str) -> tuple[tuple[str, int], ...]:
    """(name, whole units of `resource`) of each of the pod's `spec.containers` that asks for it (`limits` over
    `requests`), in spec order; an unnamed container is `container-<i>`. Raises `ObjectError` naming the field
    for a container that is not an object or a count that is not whole."""
    obj = object_key(pod)
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return ()
    found = []
    for i, container in enumerate(_items(spec.get("containers"), obj, "spec.containers")):
        raw = _resource_map(container, obj, f"spec.containers[{i}]").get(resource)
        if raw is not None:
            field = f"spec.containers[{i}].resources[{resource}]"
            units = _whole(quantity(raw, obj, field), obj, field)
            found.append((str(container.get("name") or f"container-{i}"), units))
    return tuple(found)


def wants_gpu(pod: Mapping[str, Any]) -> bool:
    """Whether some container asks for one of gpuplane's resources (kube-scheduler's managedResources test).

    A pod too malformed to read counts as asking: whoever calls this then reads it and reports why."""
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return False
    try:
        obj = object_key(pod)
        containers = [*_items(spec.get("containers"), obj, "spec.containers"),
                      *_items(spec.get("initContainers"), obj, "spec.initContainers")]
        return any(name in MANAGED_RESOURCES for c in containers for name in _resource_map(c, obj, "spec"))
    except ObjectError:
        return True


def _gpu_form(resources: Mapping[str, Decimal], annotations: Mapping[str, str], obj: str) -> GpuForm | None:
    def count(name: str) -> int:
        return _whole(resources.get(name, Decimal(0)), obj, f"resources[{name}]")

    cards, cores, mem, mem_pct = count(RES_GPU), count(RES_CORES), count(RES_MEM), count(RES_MEM_PCT)
    encoders, decoders = count(RES_ENCODERS), count(RES_DECODERS)
    profile = annotations.get(MIG_PROFILE)
    try:
        if profile is not None:
            if cards != 1 or cores or mem or mem_pct:
                raise ObjectError(obj, f"metadata.annotations[{MIG_PROFILE}]",
                                  f"a MIG instance is asked for with {RES_GPU}: 1 alone (no {RES_CORES}/{RES_MEM})")
            if profile.isdigit():
                number = parse_count(profile)
                if number is None:
                    raise ObjectError(obj, f"metadata.annotations[{MIG_PROFILE}]",
                                      f"not a MIG profile name or ID: {profile!r}")
                return MigSlice(number)
            return MigSlice(profile)
        if not (cards or cores or mem or mem_pct or encoders or decoders):
            return None
        if not cards:
            raise ObjectError(obj, f"resources[{RES_GPU}]",
                              f"missing: ask {RES_GPU}: 1 with {RES_CORES}/{RES_MEM}/codecs (without it the kubelet "
                              "never hands a card to the container)")
        if cores > 100:
            raise ObjectError(obj, f"resources[{RES_CORES}]", f"at most 100 (percent of one card), got {cores}")
        fractional = (0 < cores < 100) or mem or mem_pct or encoders or decoders
        if fractional:
            # As in HAMi, the share figures are per card: gpu: 2 with gpumem: 3000 is 3000 MiB on each of two cards.
            return Fraction(compute_milli=cores * 10, memory_mib=mem, memory_pct=mem_pct,
                            encoders=encoders, decoders=decoders, count=cards)
        return WholeCards(max(cards, 1))
    except RequestError as exc:
        raise ObjectError(obj, f"resources ({exc.field})", exc.reason) from None


def pod_request(pod: Mapping[str, Any], catalog: Catalog) -> PodRequest:
    """Read what a pod asks for. Raises `ObjectError` naming the field when it cannot be valid."""
    obj = object_key(pod)
    if not _meta(pod).get("name"):
        raise ObjectError(obj or "pod", "metadata.name", "missing")
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise ObjectError(obj, "spec", "missing or not an object")
    labels, annotations = labels_of(pod), annotations_of(pod)
    resources = pod_resources(pod)
    gpu = _gpu_form(resources, annotations, obj)
    qos = pod_qos(pod)
    models_raw = annotations.get(GPU_MODELS)
    models = {m.strip() for m in models_raw.split(",") if m.strip()} if models_raw else None
    gang = labels.get(GANG_LABEL)
    gang_size = _int_annotation(annotations, GANG_SIZE, obj) or (1 if gang else 0)
    selector = _str_map(spec.get("nodeSelector"))
    pool = selector.get(POOL_LABEL)
    preemption_policy = spec.get("preemptionPolicy")
    priority_class = spec.get("priorityClassName")
    for field, value in (("preemptionPolicy", preemption_policy), ("priorityClassName", priority_class)):
        if value is not None and not isinstance(value, str):
            raise ObjectError(obj, f"spec.{field}", f"must be a string, got {value!r}")
    tolerations = tuple(
        Toleration(str(t.get("key") or ""), None if t.get("operator") == "Exists" else str(t.get("value") or ""))
        for t in _items(spec.get("tolerations"), obj, "spec.tolerations"))
    priority = spec.get("priority") or 0
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ObjectError(obj, "spec.priority", f"must be an integer, got {priority!r}")
    checkpoint = annotations.get(CHECKPOINT_EVERY)
    checkpoint_s = 0.0
    if checkpoint:
        try:
            checkpoint_s = float(checkpoint)
        except ValueError:
            checkpoint_s = -1.0
        if not (math.isfinite(checkpoint_s) and checkpoint_s >= 0):
            raise ObjectError(obj, f"metadata.annotations[{CHECKPOINT_EVERY}]",
                              f"must be a non-negative number of seconds, got {checkpoint!r}")
    workload = labels.get(WORKLOAD_LABEL) or _owner(pod)
    instance_raw = labels.get(INSTANCE_LABEL)
    instance = None if instance_raw is None else parse_count(instance_raw)
    if instance_raw is not None and instance is None:
        raise ObjectError(obj, f"metadata.labels[{INSTANCE_LABEL}]",
                          f"must be the pod's index in its workload (0, 1, …), got {instance_raw!r}")
    try:
        return make_request(
            catalog, obj,
            cpu_milli=int(resources.get("cpu", Decimal(0)) * 1000),
            memory_mib=int(resources.get("memory", Decimal(0)) / (1 << 20)),
            gpu=gpu, models=models,
            priority=priority,
            priority_class=priority_class or None,
            preempt=None if preemption_policy is None else preemption_policy != "Never",
            qos=qos,
            workload=workload,
            instance=instance,
            gang=gang, gang_size=gang_size if gang else 0,
            queue=labels.get(QUEUE_LABEL),
            checkpoint_every_s=checkpoint_s,
            rdma_vfs=_whole(resources.get(RES_RDMA, Decimal(0)), obj, f"resources[{RES_RDMA}]"),
            pools=frozenset({pool}) if pool else None,
            tolerations=tolerations,
            labels=tuple(sorted(labels.items())),
        )
    except RequestError as exc:
        raise ObjectError(obj, exc.field, exc.reason) from None
    except (CatalogError, ValueError) as exc:
        raise ObjectError(obj, "spec", str(exc)) from None


def _owner(pod: Mapping[str, Any]) -> str | None:
    """The controlling owner (`ReplicaSet/web-7f9c`), as the workload a pod belongs to."""
    for ref in _items(_meta(pod).get("ownerReferences"), object_key(pod), "metadata.ownerReferences"):
        if ref.get("controller"):
            namespace = _meta(pod).get("namespace") or "default"
            return f"{namespace}/{ref.get('kind')}/{ref.get('name')}"
    return None


def pod_phase(pod: Mapping[str, Any]) -> PodPhase:
    if _meta(pod).get("deletionTimestamp"):
        return PodPhase.TERMINATING
    status = pod.get("status") if isinstance(pod.get("status"), Mapping) else {}
    assert isinstance(status, Mapping)
    raw = status.get("phase") or "Pending"
    if raw == "Pending" and isinstance(pod.get("spec"), Mapping) and pod["spec"].get("nodeName"):
        return PodPhase.RUNNING  # bound: its capacity is taken even while images pull
    try:
        return PodPhase(raw)
    except ValueError:
        return PodPhase.RUNNING  # "Unknown": the node lost contact; the pod still holds its cards


def pod_info(pod: Mapping[str, Any], catalog: Catalog) -> PodInfo:
    """A pod as the port reports it: request, phase, recorded assignment and annotations."""
    obj = object_key(pod)
    annotations = annotations_of(pod)
    raw = annotations.get(ASSIGNMENT)
    assignment = decode_assignment(raw, obj) if raw else None
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    node_name = spec.get("nodeName")
    if assignment is not None and node_name and assignment.node != node_name:
        raise ObjectError(obj, f"metadata.annotations[{ASSIGNMENT}]",
                          f"names node {assignment.node!r} but the pod is bound to {node_name!r}")
    if assignment is None and node_name:
        assignment = Assignment(str(node_name))  # bound by someone else, no cards recorded
    phase = pod_phase(pod)
    if phase is PodPhase.PENDING:
        assignment = None  # recorded but not bound yet: the capacity is not the pod's until the Binding lands
    stamp = assigned_at(pod)
    return PodInfo(
        request=pod_request(pod, catalog),
        phase=phase,
        assignment=assignment,
        created_at=parse_time(_meta(pod).get("creationTimestamp")) or 0.0,
        bound_at=stamp if phase is not PodPhase.PENDING else None,
        annotations=tuple(sorted(annotations.items())),
    )


# ------------------------------------------------------------------ assignments
def encode_assignment(assignment: Assignment) -> str:
    """The `gpuplane.io/assignment` annotation: compact JSON, stable key order."""
    cards = []
    for share in assignment.cards:
        card: dict[str, Any] = {"card": share.card, "milli": share.compute_milli, "mib": share.memory_mib}
        if share.encoders:
            card["enc"] = share.encoders
        if share.decoders:
            card["dec"] = share.decoders
        if share.mig_profile is not None:
            card["mig"] = share.mig_profile
            card["start"] = share.mig_start
        if share.whole:
            card["whole"] = True
        cards.append(card)
    doc: dict[str, Any] = {"node": assignment.node, "cards": cards}
    if assignment.rdma is not None:
        doc["rdma"] = {"nic": assignment.rdma.nic, "vfs": assignment.rdma.vfs,
                       "locality": assignment.rdma.locality.value}
    if assignment.oversubscribed:
        doc["oversubscribed"] = True
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def decode_assignment(raw: str, obj: str = "pod") -> Assignment:
    """Inverse of `encode_assignment`; `ObjectError` naming the field on anything malformed."""
    field = f"metadata.annotations[{ASSIGNMENT}]"
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str) or not doc["node"]:
            raise ValueError("needs a non-empty 'node'")
        shares = []
        for i, card in enumerate(doc.get("cards") or []):
            if not isinstance(card, dict):
                raise ValueError(f"cards[{i}] is not an object")
            mig = card.get("mig")
            values = [card.get("card"), *(card.get(k, 0) for k in ("milli", "mib", "enc", "dec"))]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ValueError(f"cards[{i}]: card, milli, mib, enc, dec must be non-negative integers")
            shares.append(CardShare(card=int(card["card"]), compute_milli=int(card.get("milli", 0)),
                                    memory_mib=int(card.get("mib", 0)), encoders=int(card.get("enc", 0)),
                                    decoders=int(card.get("dec", 0)),
                                    mig_profile=int(mig) if mig is not None else None,
                                    mig_start=int(card["start"]) if mig is not None else None,
                                    whole=bool(card.get("whole", False))))
        rdma = None
        if doc.get("rdma") is not None:
            r = doc["rdma"]
            rdma = RdmaShare(int(r["nic"]), int(r["vfs"]), RdmaLocality(r["locality"]))
        return Assignment(doc["node"], tuple(shares), rdma, bool(doc.get("oversubscribed", False)))
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        # OverflowError: an infinite number; RecursionError: JSON nested past the parser's depth
        raise ObjectError(obj, field, f"not a gpuplane assignment ({type(exc).__name__}: {exc})") from None


def assignment_annotations(assignment: Assignment, now_s: float) -> dict[str, str]:
    """What the scheduler writes on a pod before its Binding."""
    return {ASSIGNMENT: encode_assignment(assignment), ASSIGNED_AT: f"{now_s:.6f}", BIND_PHASE: PHASE_ALLOCATING}


# ------------------------------------------------------------------ nodes
@dataclass(frozen=True, slots=True)
class CardInventory:
    index: int
    uuid: str
    numa: int = 0
    pcie_switch: int = 0


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """What the node agent reports about a node's cards (annotation `gpuplane.io/gpu-inventory`)."""

    model: str
    cards: tuple[CardInventory, ...]
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    nics: tuple[RdmaNic, ...] = ()
    mig_mode: MigMode = MigMode.DYNAMIC
    split: int = 10
    """Containers that may share one card (the device plugin advertises cards × split `gpuplane.io/gpu`)."""

    def encode(self) -> str:
        doc: dict[str, Any] = {
            "model": self.model,
            "cards": [{"index": c.index, "uuid": c.uuid, "numa": c.numa, "pcieSwitch": c.pcie_switch}
                      for c in self.cards],
            "migMode": self.mig_mode.value, "split": self.split,
        }
        if self.nvlink_groups:
            doc["nvlinkGroups"] = [list(g) for g in self.nvlink_groups]
        if self.nics:
            doc["nics"] = [{"name": n.name, "pcieSwitch": n.pcie_switch, "numa": n.numa, "vfs": n.vfs}
                           for n in self.nics]
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def decode(raw: str, obj: str = "node") -> NodeInventory:
        field = f"metadata.annotations[{INVENTORY}]"
        try:
            doc = json.loads(raw)
            cards = tuple(CardInventory(int(c["index"]), str(c["uuid"]), int(c.get("numa", 0)),
                                        int(c.get("pcieSwitch", 0))) for c in doc["cards"])
            if [c.index for c in cards] != list(range(len(cards))):
                raise ValueError("cards must be listed by index 0, 1, 2, …")
            nics = tuple(RdmaNic(str(n["name"]), int(n["pcieSwitch"]), int(n["numa"]), int(n["vfs"]))
                         for n in doc.get("nics") or [])
            split = int(doc.get("split", 10))
            if split < 1:
                raise ValueError(f"split must be at least 1, got {split}")
            return NodeInventory(str(doc["model"]), cards,
                                 tuple(tuple(int(c) for c in g) for g in doc.get("nvlinkGroups") or []),
                                 nics, MigMode(doc.get("migMode", "dynamic")), split)
        except (ValueError, KeyError, TypeError, NodeSpecError) as exc:
            raise ObjectError(obj, field, f"not a gpuplane GPU inventory ({exc})") from None


def node_spec(node: Mapping[str, Any], catalog: Catalog) -> NodeSpec:
    """Read a node: allocatable CPU and memory, labels, taints, cordon, pool and the GPU inventory."""
    obj = object_key(node)
    if not obj:
        raise ObjectError("node", "metadata.name", "missing")
    spec = node.get("spec") if isinstance(node.get("spec"), Mapping) else {}
    status = node.get("status") if isinstance(node.get("status"), Mapping) else {}
    assert isinstance(spec, Mapping) and isinstance(status, Mapping)
    allocatable = _str_map(status.get("allocatable"))
    cpu = quantity(allocatable.get("cpu", "0"), obj, "status.allocatable[cpu]")
    memory = quantity(allocatable.get("memory", "0"), obj, "status.allocatable[memory]")
    labels = labels_of(node)
    raw = annotations_of(node).get(INVENTORY)
    inventory = NodeInventory.decode(raw, obj) if raw else None
    model: str | None = None
    topology = Topology((), ())
    mig_mode = MigMode.DYNAMIC
    if inventory is not None and inventory.cards:
        try:
            model = catalog.canonical(inventory.model)
        except CatalogError as exc:
            raise ObjectError(obj, f"metadata.annotations[{INVENTORY}].model", str(exc)) from None
        topology = Topology(tuple(c.numa for c in inventory.cards), tuple(c.pcie_switch for c in inventory.cards),
                            inventory.nvlink_groups, inventory.nics)
        mig_mode = inventory.mig_mode
    taints = tuple(Taint(str(t.get("key") or ""), str(t.get("value") or ""), str(t.get("effect") or "NoSchedule"))
                   for t in spec.get("taints") or [] if isinstance(t, Mapping))
    try:
        return NodeSpec(
            name=obj, cpu_milli=int(cpu * 1000), memory_mib=int(memory / (1 << 20)),
            gpu_model=model, gpus=len(inventory.cards) if inventory is not None else 0,
            pool=labels.get(POOL_LABEL, "default"), labels=tuple(sorted(labels.items())), taints=taints,
            schedulable=not spec.get("unschedulable", False), mig_mode=mig_mode, topology=topology)
    except NodeSpecError as exc:
        raise ObjectError(obj, f"metadata.annotations[{INVENTORY}]", str(exc)) from None


def node_info(node: Mapping[str, Any], catalog: Catalog) -> NodeInfo:
    return NodeInfo(node_spec(node, catalog), resource_version(node), tuple(sorted(annotations_of(node).items())))


def taints_json(taints: Sequence[Taint]) -> list[dict[str, str]]:
    return [{"key": t.key, "value": t.value, "effect": t.effect} if t.value else {"key": t.key, "effect": t.effect}
            for t in taints]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Equality label selector: every pair of `selector` must be in `labels`; an empty selector selects all."""
    return all(labels.get(key) == value for key, value in selector.items())
