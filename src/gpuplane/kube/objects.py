"""Kubernetes objects ↔ gpuplane's model: the wire contract of the Kubernetes world.

Everything that reads or writes a pod or node in the Kubernetes API goes through this module, so the
extender, the cluster port, the device plugin and the admission webhook agree on one encoding.

How a pod asks for GPUs (container resources, HAMi's conventions; summed as Kubernetes sums a pod, `pod_resources`):

- `gpuplane.io/gpu`: cards wanted. Alone, whole cards.
- `gpuplane.io/gpucores` (percent of one card's compute, 100 = exclusive) and/or `gpuplane.io/gpumem`
  (MiB) or `gpuplane.io/gpumem-percentage`: with `gpuplane.io/gpu: N`, that share on each of N distinct cards
  (HAMi's reading; N = 1 is a fraction of one card).
- `gpuplane.io/gpu-encoders`, `gpuplane.io/gpu-decoders`: video codec units on the card.
- annotation `gpuplane.io/mig-profile` (`3g.40gb` or a profile ID): one MIG instance.
- `gpuplane.io/rdma-vf`: RDMA virtual functions.

Everything else comes from the pod: `spec.priority`/`priorityClassName`/`preemptionPolicy`, label
`gpuplane.io/qos`, label `gpuplane.io/queue`, the gang label `scheduling.x-k8s.io/pod-group` with annotation
`gpuplane.io/gang-size`, annotation `gpuplane.io/gpu-models`, node selector `gpuplane.io/pool` (the pool) and its
other labels, required and preferred node affinity, tolerations. Placement constraints gpuplane does not implement
are recorded by field (`PodRequest.unsupported`, `UNSUPPORTED_FIELDS`) and the pod is never placed.

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

from gpuplane.kube.foreign import FOREIGN_CARDS, ForeignReport, holds_unreported
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
    NodeSelectorTerm,
    NodeSpec,
    NodeSpecError,
    PodRequest,
    PreferredTerm,
    QoS,
    RdmaLocality,
    RdmaNic,
    RdmaShare,
    RequestError,
    Requirement,
    SelectorOp,
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


BASE_RESOURCES = frozenset({"cpu", "memory"})
POD_LEVEL_RESOURCES = BASE_RESOURCES
"""Pod-level `spec.resources` gpuplane reads (Kubernetes' `supportedPodLevelResources`; hugepages, which it also
takes, are not modelled and so refused as unsupported)."""
RESTART_ALWAYS = "Always"


def _resource_list(value: object, obj: str, field: str, item_field: str | None = None) -> dict[str, Decimal]:
    """A ResourceList at `field`; a bad quantity names `item_field[<resource>]` (default `field`)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ObjectError(obj, field, "must be an object")
    return {str(k): quantity(v, obj, f"{item_field or field}[{k}]") for k, v in value.items()}


def _requirements(holder: Mapping[str, Any], obj: str, field: str) -> tuple[dict[str, Decimal], dict[str, Decimal]]:
    """(requests, limits) of the `resources` of a container or pod spec at `field`."""
    resources = holder.get("resources")
    if resources is None:
        return {}, {}
    if not isinstance(resources, Mapping):
        raise ObjectError(obj, f"{field}.resources", "must be an object")
    return (_resource_list(resources.get("requests"), obj, f"{field}.resources.requests", f"{field}.resources"),
            _resource_list(resources.get("limits"), obj, f"{field}.resources.limits", f"{field}.resources"))


def container_requests(container: Mapping[str, Any], obj: str, field: str) -> dict[str, Decimal]:
    """One container's requests as the API server stores them: its requests, with the limit standing in for each
    resource that has no request (`SetDefaults_Pod`, pkg/apis/core/v1/defaults.go). gpuplane's resources are
    extended resources, whose request must equal the limit (`ValidateResourceRequirements`)."""
    requests, limits = _requirements(container, obj, field)
    for name in MANAGED_RESOURCES:
        if name in requests and name in limits and requests[name] != limits[name]:
            raise ObjectError(obj, f"{field}.resources.requests[{name}]",
                              f"must equal the limit ({limits[name]}) for an extended resource, got {requests[name]}")
    return {**limits, **requests}


def _add(total: dict[str, Decimal], more: Mapping[str, Decimal]) -> None:
    for name, value in more.items():
        total[name] = total.get(name, Decimal(0)) + value


def _raise_to(total: dict[str, Decimal], more: Mapping[str, Decimal]) -> None:
    for name, value in more.items():
        total[name] = max(total.get(name, Decimal(0)), value)


def _spec(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = pod.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _restartable(container: Mapping[str, Any]) -> bool:
    """A native sidecar: an init container with `restartPolicy: Always` (`isRestartableInitContainer`)."""
    return container.get("restartPolicy") == RESTART_ALWAYS


def _gpu_containers(pod: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(field path, container) of every init container then every container: the order kubelet admits them in."""
    obj, spec = object_key(pod), _spec(pod)
    return [(f"spec.{kind}[{i}]", c) for kind in ("initContainers", "containers")
            for i, c in enumerate(_items(spec.get(kind), obj, f"spec.{kind}"))]


def _pod_accounting(pod: Mapping[str, Any]) -> tuple[dict[str, Decimal], tuple[str, ...]]:
    """(effective requests, fields asking for resources gpuplane does not model): see `pod_resources`."""
    obj, spec = object_key(pod), _spec(pod)
    total: dict[str, Decimal] = {}
    unknown: list[str] = []

    def note(field: str, resources: Mapping[str, Decimal]) -> None:
        unknown.extend(f"{field}[{name}]" for name, value in resources.items()
                       if value and name not in BASE_RESOURCES and name not in MANAGED_RESOURCES)

    for i, container in enumerate(_items(spec.get("containers"), obj, "spec.containers")):
        own = container_requests(container, obj, f"spec.containers[{i}]")
        note(f"spec.containers[{i}].resources", own)
        _add(total, own)
    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for i, container in enumerate(_items(spec.get("initContainers"), obj, "spec.initContainers")):
        own = container_requests(container, obj, f"spec.initContainers[{i}]")
        note(f"spec.initContainers[{i}].resources", own)
        if _restartable(container):
            # A sidecar runs beside everything after it: it adds to the pod and to every later init step.
            _add(total, own)
            _add(sidecars, own)
            _raise_to(init_peak, sidecars)
        else:
            step = dict(sidecars)
            _add(step, own)
            _raise_to(init_peak, step)
    _raise_to(total, init_peak)
    pod_requests, pod_limits = _requirements(spec, obj, "spec")
    pod_level = {**pod_limits, **pod_requests}
    note("spec.resources", {k: v for k, v in pod_level.items() if k not in POD_LEVEL_RESOURCES})
    total.update({k: v for k, v in pod_level.items() if k in POD_LEVEL_RESOURCES})
    overhead = _resource_list(spec.get("overhead"), obj, "spec.overhead")
    note("spec.overhead", overhead)
    _add(total, overhead)
    return total, tuple(unknown)


def pod_resources(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """The pod's effective requests per resource, as `PodRequests` (k8s.io/component-helpers resource/helpers.go)
    computes them for kube-scheduler's NodeResourcesFit:

    - each container's requests, limits standing in where a request is absent (`container_requests`);
    - the sum over `spec.containers`, plus native sidecars (init containers with `restartPolicy: Always`);
    - raised to the largest init step, an init container's step being its requests plus those of the sidecars
      started before it;
    - pod-level `spec.resources` (requests, limits standing in) replacing that for cpu and memory;
    - plus `spec.overhead`.
    """
    return _pod_accounting(pod)[0]


def container_units(pod: Mapping[str, Any], resource: str) -> tuple[tuple[str, int], ...]:
    """(name, whole units of `resource`) of each of the pod's containers that asks for it (requests, limits standing
    in), init containers first, in spec order: the order kubelet allocates devices in. An unnamed container is
    `container-<i>` (`init-<i>` for an init container). Raises `ObjectError` naming the field for a container that
    is not an object or a count that is not whole."""
    obj = object_key(pod)
    found = []
    for field, container in _gpu_containers(pod):
        raw = container_requests(container, obj, field).get(resource)
        if raw is not None:
            units = _whole(raw, obj, f"{field}.resources[{resource}]")
            kind = "init" if field.startswith("spec.initContainers") else "container"
            found.append((str(container.get("name") or f"{kind}-{field[field.index('[') + 1:-1]}"), units))
    return tuple(found)


def wants_gpu(pod: Mapping[str, Any]) -> bool:
    """Whether some container asks for one of gpuplane's resources (kube-scheduler's managedResources test).

    A pod too malformed to read counts as asking: whoever calls this then reads it and reports why."""
    if not isinstance(pod.get("spec"), Mapping):
        return False
    try:
        obj = object_key(pod)
        return any(name in MANAGED_RESOURCES for field, c in _gpu_containers(pod)
                   for name in container_requests(c, obj, field))
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


def _object(value: object, obj: str, field: str) -> Mapping[str, Any]:
    """An object (None: empty); anything else names the field."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ObjectError(obj, field, f"must be an object, got {type(value).__name__}")
    return value


def _text(value: object, obj: str, field: str) -> str:
    """A string (None: empty); anything else names the field."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ObjectError(obj, field, f"must be a string, got {value!r}")
    return value


def _tolerations(spec: Mapping[str, Any], obj: str) -> tuple[Toleration, ...]:
    """`spec.tolerations` (core/v1 `Toleration`; an absent operator is Equal). `tolerationSeconds` only bounds how
    long a NoExecute taint lets a running pod stay, which is no placement question."""
    found = []
    for i, raw in enumerate(_items(spec.get("tolerations"), obj, "spec.tolerations")):
        field = f"spec.tolerations[{i}]"
        key, value = _text(raw.get("key"), obj, f"{field}.key"), _text(raw.get("value"), obj, f"{field}.value")
        operator = _text(raw.get("operator"), obj, f"{field}.operator") or "Equal"
        effect = _text(raw.get("effect"), obj, f"{field}.effect")
        if operator == "Exists" and value:
            raise ObjectError(obj, f"{field}.value", "must be empty when operator is Exists")
        if operator not in ("Exists", "Equal"):
            raise ObjectError(obj, f"{field}.operator", f"unsupported operator {operator!r} (Exists, Equal)")
        try:
            found.append(Toleration(key, None if operator == "Exists" else value, effect))
        except RequestError as exc:
            raise ObjectError(obj, f"{field}.{exc.field.removeprefix('tolerations.')}", exc.reason) from None
    return tuple(found)


def _requirement(raw: Mapping[str, Any], obj: str, field: str) -> Requirement:
    operator = _text(raw.get("operator"), obj, f"{field}.operator")
    try:
        op = SelectorOp(operator)
    except ValueError:
        raise ObjectError(obj, f"{field}.operator", f"unsupported operator {operator!r} "
                                                    f"({', '.join(o.value for o in SelectorOp)})") from None
    values = raw.get("values") or []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ObjectError(obj, f"{field}.values", "must be a list of strings")
    try:
        return Requirement(_text(raw.get("key"), obj, f"{field}.key"), op, tuple(values))
    except RequestError as exc:
        raise ObjectError(obj, f"{field}.{exc.field}", exc.reason) from None


def _term(raw: Mapping[str, Any], obj: str, field: str) -> NodeSelectorTerm:
    """A `NodeSelectorTerm` (`matchExpressions` on labels, `matchFields` on `metadata.name`)."""
    expressions = tuple(_requirement(r, obj, f"{field}.matchExpressions[{j}]")
                        for j, r in enumerate(_items(raw.get("matchExpressions"), obj, f"{field}.matchExpressions")))
    fields = tuple(_requirement(r, obj, f"{field}.matchFields[{j}]")
                   for j, r in enumerate(_items(raw.get("matchFields"), obj, f"{field}.matchFields")))
    try:
        return NodeSelectorTerm(expressions, fields)
    except RequestError as exc:
        raise ObjectError(obj, f"{field}.{exc.field}", exc.reason) from None


NODE_AFFINITY = "spec.affinity.nodeAffinity"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _node_affinity(spec: Mapping[str, Any],
                   obj: str) -> tuple[tuple[NodeSelectorTerm, ...] | None, tuple[PreferredTerm, ...]]:
    """(required terms or None, preferred terms) of `spec.affinity.nodeAffinity`."""
    affinity = _object(_object(spec.get("affinity"), obj, "spec.affinity").get("nodeAffinity"), obj, NODE_AFFINITY)
    required: tuple[NodeSelectorTerm, ...] | None = None
    if affinity.get(REQUIRED) is not None:
        field = f"{NODE_AFFINITY}.{REQUIRED}"
        selector = _object(affinity[REQUIRED], obj, field)
        required = tuple(_term(t, obj, f"{field}.nodeSelectorTerms[{i}]")
                         for i, t in enumerate(_items(selector.get("nodeSelectorTerms"), obj,
                                                      f"{field}.nodeSelectorTerms")))
    preferred = []
    for i, raw in enumerate(_items(affinity.get(PREFERRED), obj, f"{NODE_AFFINITY}.{PREFERRED}")):
        field = f"{NODE_AFFINITY}.{PREFERRED}[{i}]"
        weight = raw.get("weight")
        if not isinstance(weight, int) or isinstance(weight, bool):
            raise ObjectError(obj, f"{field}.weight", f"must be an integer, got {weight!r}")
        term = _term(_object(raw.get("preference"), obj, f"{field}.preference"), obj, f"{field}.preference")
        try:
            preferred.append(PreferredTerm(weight, term))
        except RequestError as exc:
            raise ObjectError(obj, f"{field}.{exc.field}", exc.reason) from None
    return required, tuple(preferred)


def tolerations_json(tolerations: Sequence[Toleration]) -> list[dict[str, str]]:
    """`spec.tolerations` that `pod_request` reads back as `tolerations`."""
    out = []
    for t in tolerations:
        doc = {"operator": t.operator}
        if t.key:
            doc["key"] = t.key
        if t.value:
            doc["value"] = t.value
        if t.effect:
            doc["effect"] = t.effect
        out.append(doc)
    return out


def _term_json(term: NodeSelectorTerm) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name, requirements in (("matchExpressions", term.expressions), ("matchFields", term.fields)):
        if requirements:
            doc[name] = [{"key": r.key, "operator": r.operator.value, "values": list(r.values)} if r.values
                         else {"key": r.key, "operator": r.operator.value} for r in requirements]
    return doc


def node_affinity_json(required: Sequence[NodeSelectorTerm] | None,
                       preferred: Sequence[PreferredTerm]) -> dict[str, Any]:
    """`spec.affinity.nodeAffinity` that `pod_request` reads back as these terms (empty: no node affinity)."""
    doc: dict[str, Any] = {}
    if required is not None:
        doc[REQUIRED] = {"nodeSelectorTerms": [_term_json(t) for t in required]}
    if preferred:
        doc[PREFERRED] = [{"weight": p.weight, "preference": _term_json(p.term)} for p in preferred]
    return doc


UNSUPPORTED_FIELDS = (
    "spec.affinity.podAffinity", "spec.affinity.podAntiAffinity", "spec.topologySpreadConstraints",
    "spec.resourceClaims", "spec.schedulingGates", "spec.volumes[i].persistentVolumeClaim",
    "spec.volumes[i].ephemeral", "spec.containers[i].ports[j].hostPort", "spec.initContainers[i].ports[j].hostPort",
    "spec.containers[i].resources[<resource>]",
)
"""Placement constraints gpuplane's scheduler does not implement (inter-pod affinity, topology spread, dynamic
resource claims, scheduling gates, volume topology and binding, host ports, resources other than cpu, memory and
gpuplane's): a pod using one is recorded with the field (`PodRequest.unsupported`) and never placed. The resource
pattern stands for any container, init container, `spec.resources` or `spec.overhead` entry."""


def pod_unsupported(pod: Mapping[str, Any]) -> tuple[str, ...]:
    """The fields of `pod` that constrain its placement in ways gpuplane does not implement (`UNSUPPORTED_FIELDS`),
    in spec order."""
    obj, spec = object_key(pod), _spec(pod)
    found = []
    affinity = _object(spec.get("affinity"), obj, "spec.affinity")
    for kind in ("podAffinity", "podAntiAffinity"):
        if any(_object(affinity.get(kind), obj, f"spec.affinity.{kind}").values()):
            found.append(f"spec.affinity.{kind}")
    for name in ("topologySpreadConstraints", "resourceClaims", "schedulingGates"):
        if _items(spec.get(name), obj, f"spec.{name}"):
            found.append(f"spec.{name}")
    for i, volume in enumerate(_items(spec.get("volumes"), obj, "spec.volumes")):
        found.extend(f"spec.volumes[{i}].{kind}" for kind in ("persistentVolumeClaim", "ephemeral")
                     if volume.get(kind) is not None)
    for field, container in _gpu_containers(pod):
        for j, port in enumerate(_items(container.get("ports"), obj, f"{field}.ports")):
            if port.get("hostPort"):
                found.append(f"{field}.ports[{j}].hostPort")
    return tuple(found)


def pod_request(pod: Mapping[str, Any], catalog: Catalog) -> PodRequest:
    """Read what a pod asks for. Raises `ObjectError` naming the field when it cannot be valid."""
    obj = object_key(pod)
    if not _meta(pod).get("name"):
        raise ObjectError(obj or "pod", "metadata.name", "missing")
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise ObjectError(obj, "spec", "missing or not an object")
    labels, annotations = labels_of(pod), annotations_of(pod)
    resources, unknown_resources = _pod_accounting(pod)
    gpu = _gpu_form(resources, annotations, obj)
    qos = pod_qos(pod)
    models_raw = annotations.get(GPU_MODELS)
    models = {m.strip() for m in models_raw.split(",") if m.strip()} if models_raw else None
    gang = labels.get(GANG_LABEL)
    gang_size = _int_annotation(annotations, GANG_SIZE, obj) or (1 if gang else 0)
    selector = _str_map(_object(spec.get("nodeSelector"), obj, "spec.nodeSelector"))
    pool = selector.pop(POOL_LABEL, None)
    required_terms, preferred_terms = _node_affinity(spec, obj)
    preemption_policy = spec.get("preemptionPolicy")
    priority_class = spec.get("priorityClassName")
    for field, value in (("preemptionPolicy", preemption_policy), ("priorityClassName", priority_class)):
        if value is not None and not isinstance(value, str):
            raise ObjectError(obj, f"spec.{field}", f"must be a string, got {value!r}")
    tolerations = _tolerations(spec, obj)
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
            # Rounded up, as Quantity.MilliValue and Value are: a request never counts less than it asks.
            cpu_milli=math.ceil(resources.get("cpu", Decimal(0)) * 1000),
            memory_mib=math.ceil(resources.get("memory", Decimal(0)) / (1 << 20)),
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
            node_selector=tuple(sorted(selector.items())),
            required_terms=required_terms,
            preferred_terms=preferred_terms,
            unsupported=(*pod_unsupported(pod), *unknown_resources),
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


def pod_info(pod: Mapping[str, Any], catalog: Catalog, *, request: PodRequest | None = None) -> PodInfo:
    """A pod as the port reports it: request, phase, recorded assignment and annotations. `request`: what the pod
    asks for, when the caller knows it has not changed since it was last read (else it is read again)."""
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
        request=request if request is not None else pod_request(pod, catalog),
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
    """Read a node: allocatable CPU and memory, labels, taints, cordon, pool, the GPU inventory and the cards other
    GPU stacks hold."""
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
    gpus = len(inventory.cards) if inventory is not None else 0
    # Cards other GPU stacks hold (gpuplane.kube.foreign): from the node agent's report, else, on a node offering
    # a foreign GPU resource beside gpuplane's, all of them until the report comes.
    report = annotations_of(node).get(FOREIGN_CARDS)
    foreign: frozenset[int] = frozenset(range(gpus)) if holds_unreported(allocatable) else frozenset()
    if report is not None:
        try:
            foreign = ForeignReport.decode(report).cards(gpus)
        except ValueError as exc:
            raise ObjectError(obj, f"metadata.annotations[{FOREIGN_CARDS}]", str(exc)) from None
    try:
        return NodeSpec(
            name=obj, cpu_milli=int(cpu * 1000), memory_mib=int(memory / (1 << 20)),
            gpu_model=model, gpus=gpus,
            pool=labels.get(POOL_LABEL, "default"), labels=tuple(sorted(labels.items())), taints=taints,
            schedulable=not spec.get("unschedulable", False), mig_mode=mig_mode, topology=topology,
            foreign_cards=foreign)
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
