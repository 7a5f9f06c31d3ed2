"""Pod requests: CPU, memory and one GPU form, validated at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gpuplane.model.catalog import MILLI_PER_CARD, Catalog
from gpuplane.model.errors import CatalogError, RequestError


class QoS(enum.Enum):
    ONLINE = "online"
    OFFLINE = "offline"
    BEST_EFFORT = "best-effort"

    @classmethod
    def from_trace(cls, value: str) -> QoS:
        """Map the trace's Kubernetes-style classes: LS/Guaranteed → online, Burstable → offline, BE."""
        mapping = {"LS": cls.ONLINE, "GUARANTEED": cls.ONLINE, "BURSTABLE": cls.OFFLINE, "BE": cls.BEST_EFFORT}
        try:
            return mapping[value.strip().upper()]
        except KeyError:
            try:
                return cls(value.strip().lower())
            except ValueError:
                raise RequestError("qos", f"unknown QoS class {value!r}") from None


@dataclass(frozen=True, slots=True)
class WholeCards:
    """`count` whole cards, exclusively."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise RequestError("gpu.count", f"must be at least 1, got {self.count}")


@dataclass(frozen=True, slots=True)
class Fraction:
    """A share of `count` cards (vGPU): compute in milli-cards and/or memory in MiB or percent, plus codec units.

    Every figure is per card, as HAMi reads `gpumem`/`gpucores` beside `gpu: N`: a pod with `count` 2 and
    `memory_mib` 3000 holds 3000 MiB on each of two distinct cards of one node.
    `memory_pct` (1..100) is resolved against the chosen card's memory; it excludes `memory_mib`.
    """

    compute_milli: int = 0
    memory_mib: int = 0
    memory_pct: int = 0
    encoders: int = 0
    decoders: int = 0
    package: str | None = None
    count: int = 1
    """Distinct cards, each holding the share above."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise RequestError("gpu.count", f"a fraction is of at least 1 card, got {self.count}")
        for name in ("compute_milli", "memory_mib", "memory_pct", "encoders", "decoders"):
            if getattr(self, name) < 0:
                raise RequestError(f"gpu.{name}", f"must not be negative, got {getattr(self, name)}")
        if self.compute_milli > MILLI_PER_CARD:
            raise RequestError("gpu.compute_milli", f"a fraction holds at most {MILLI_PER_CARD}, "
                                                    f"got {self.compute_milli}; ask for whole cards instead")
        if self.memory_pct > 100:
            raise RequestError("gpu.memory_pct", f"must be at most 100, got {self.memory_pct}")
        if self.memory_pct and self.memory_mib:
            raise RequestError("gpu.memory_pct", "give memory in MiB or in percent, not both")
        if not (self.compute_milli or self.memory_mib or self.memory_pct or self.encoders or self.decoders):
            raise RequestError("gpu", "a fractional request needs compute, memory or codec units")

    def memory_on(self, card_memory_mib: int) -> int:
        """Memory this fraction takes on a card with `card_memory_mib` of memory."""
        if self.memory_pct:
            return card_memory_mib * self.memory_pct // 100
        return self.memory_mib


@dataclass(frozen=True, slots=True)
class MigSlice:
    """One MIG GPU instance, by profile ID (e.g. 9) or driver name (e.g. `3g.40gb`)."""

    profile: int | str

    def __post_init__(self) -> None:
        if isinstance(self.profile, int) and self.profile < 0:
            raise RequestError("gpu.profile", f"must not be negative, got {self.profile}")


GpuForm = WholeCards | Fraction | MigSlice


TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
FILTER_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
"""Taint effects that keep a pod off a node (kube-scheduler's TaintToleration filter); PreferNoSchedule only scores."""
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
"""The taint a cordoned node stands for (kube-scheduler's NodeUnschedulable plugin: effect NoSchedule, no value)."""


@dataclass(frozen=True, slots=True)
class Toleration:
    """A pod's toleration, as core/v1 `Toleration`: `key` "" with operator Exists tolerates every taint, `effect` ""
    matches every effect. The operator is carried by `value`: None is Exists, a string (possibly "") is Equal."""

    key: str = ""
    value: str | None = None
    effect: str = ""

    def __post_init__(self) -> None:
        if not self.key and self.value is not None:
            raise RequestError("tolerations.operator", "must be Exists when the key is empty (all keys)")
        if self.effect and self.effect not in TAINT_EFFECTS:
            raise RequestError("tolerations.effect", f"unknown effect {self.effect!r} ({', '.join(TAINT_EFFECTS)})")

    @property
    def operator(self) -> str:
        return "Exists" if self.value is None else "Equal"

    def tolerates(self, key: str, value: str, effect: str) -> bool:
        """`ToleratesTaint` of k8s.io/api core/v1 toleration.go."""
        if self.effect and self.effect != effect:
            return False
        if self.key and self.key != key:
            return False
        return self.value is None or self.value == value


class SelectorOp(enum.Enum):
    """Operators of a `NodeSelectorRequirement`."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
NODE_NAME_FIELD = "metadata.name"
"""The one node field `matchFields` may name."""


def parse_int64(raw: str) -> int | None:
    """Go's `strconv.ParseInt(raw, 10, 64)`: optional sign, ASCII digits, within int64; None otherwise."""
    digits = raw[1:] if raw[:1] in ("+", "-") else raw
    if not (digits.isascii() and digits.isdigit()):
        return None
    value = int(raw)
    return value if INT64_MIN <= value <= INT64_MAX else None


@dataclass(frozen=True, slots=True)
class Requirement:
    """One `NodeSelectorRequirement`, checked as `labels.NewRequirement` checks it: In/NotIn need values,
    Exists/DoesNotExist none, Gt/Lt exactly one integer."""

    key: str
    operator: SelectorOp
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        op = self.operator
        if not self.key:
            raise RequestError("key", "must not be empty")
        if op in (SelectorOp.IN, SelectorOp.NOT_IN) and not self.values:
            raise RequestError("values", f"must be non-empty for operator {op.value}")
        if op in (SelectorOp.EXISTS, SelectorOp.DOES_NOT_EXIST) and self.values:
            raise RequestError("values", f"must be empty for operator {op.value}")
        if op in (SelectorOp.GT, SelectorOp.LT):
            if len(self.values) != 1:
                raise RequestError("values", f"must have exactly one value for operator {op.value}")
            if parse_int64(self.values[0]) is None:
                raise RequestError("values", f"must be an integer for operator {op.value}, got {self.values[0]!r}")

    def matches(self, labels: dict[str, str]) -> bool:
        """`Requirement.Matches` of k8s.io/apimachinery labels/selector.go."""
        op, present = self.operator, self.key in labels
        if op is SelectorOp.IN:
            return present and labels[self.key] in self.values
        if op is SelectorOp.NOT_IN:
            return not present or labels[self.key] not in self.values
        if op is SelectorOp.EXISTS:
            return present
        if op is SelectorOp.DOES_NOT_EXIST:
            return not present
        number = parse_int64(labels[self.key]) if present else None
        if number is None:
            return False
        bound = int(self.values[0])
        return number > bound if op is SelectorOp.GT else number < bound


@dataclass(frozen=True, slots=True)
class NodeSelectorTerm:
    """A `NodeSelectorTerm`: every label requirement and every field requirement (`metadata.name` In/NotIn one
    name) must hold. A term with neither matches no node."""

    expressions: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    def __post_init__(self) -> None:
        for requirement in self.fields:
            if requirement.key != NODE_NAME_FIELD:
                raise RequestError("matchFields.key", f"only {NODE_NAME_FIELD} is a node field, got "
                                                      f"{requirement.key!r}")
            if requirement.operator not in (SelectorOp.IN, SelectorOp.NOT_IN) or len(requirement.values) != 1:
                raise RequestError("matchFields", "a field requirement is In or NotIn with exactly one value")

    @property
    def empty(self) -> bool:
        return not self.expressions and not self.fields

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        """The term's match in k8s.io/component-helpers scheduling/corev1/nodeaffinity/nodeaffinity.go."""
        if self.empty:
            return False
        fields = {NODE_NAME_FIELD: name}
        return all(r.matches(labels) for r in self.expressions) and all(r.matches(fields) for r in self.fields)


@dataclass(frozen=True, slots=True)
class PreferredTerm:
    """A `PreferredSchedulingTerm`: nodes matching `term` score `weight` (1..100)."""

    weight: int
    term: NodeSelectorTerm

    def __post_init__(self) -> None:
        if not 1 <= self.weight <= 100:
            raise RequestError("weight", f"must be within 1..100, got {self.weight}")


@dataclass(frozen=True, slots=True)
class PodRequest:
    """What a pod asks for. Construct through `make_request` to get catalog checks too."""

    name: str
    cpu_milli: int = 0
    memory_mib: int = 0
    gpu: GpuForm | None = None
    models: frozenset[str] | None = None
    """Allowed GPU models (canonical names); None allows every model."""
    priority: int = 0
    priority_class: str | None = None
    """Name of a priority class; admission resolves it into `priority` and `preempt`."""
    preempt: bool | None = None
    """Preemption policy: True PreemptLowerPriority, False Never, None the class's (default: True)."""
    qos: QoS = QoS.ONLINE
    workload: str | None = None
    instance: int | None = None
    """Index of this pod within its workload (custom-topo rules may name it)."""
    gang: str | None = None
    gang_size: int = 0
    """Members the gang needs before any of them starts (all or nothing); 0 for a pod outside a gang."""
    queue: str | None = None
    """The queue (tenant) whose quota this pod counts against; None: no quota."""
    checkpoint_every_s: float = 0.0
    """How often the pod checkpoints (0: never): preemption loses the work since the last checkpoint."""
    rdma_vfs: int = 0
    pools: frozenset[str] | None = None
    """Node pools the pod may run in; None allows every pool."""
    tolerations: tuple[Toleration, ...] = ()
    labels: tuple[tuple[str, str], ...] = field(default=())
    node_selector: tuple[tuple[str, str], ...] = ()
    """`spec.nodeSelector` pairs (sorted) the node's labels must all hold, beyond the pool in `pools`."""
    required_terms: tuple[NodeSelectorTerm, ...] | None = None
    """Required node affinity: ORed terms (None: no requirement; empty: no node matches)."""
    preferred_terms: tuple[PreferredTerm, ...] = ()
    """Preferred node affinity, scored as kube-scheduler's NodeAffinity plugin scores it."""
    unsupported: tuple[str, ...] = ()
    """Field paths of placement constraints gpuplane does not implement: such a pod is never placed."""

    def __post_init__(self) -> None:
        if not self.name:
            raise RequestError("name", "must not be empty")
        for name in ("cpu_milli", "memory_mib", "rdma_vfs"):
            if getattr(self, name) < 0:
                raise RequestError(name, f"must not be negative, got {getattr(self, name)}")
        if self.instance is not None and self.instance < 0:
            raise RequestError("instance", f"must not be negative, got {self.instance}")
        if self.gang is not None and self.gang_size < 1:
            raise RequestError("gang_size", f"a gang member needs gang_size of at least 1, got {self.gang_size}")
        if self.gang is None and self.gang_size:
            raise RequestError("gang_size", "gang_size is set but the pod names no gang")
        if self.checkpoint_every_s < 0:
            raise RequestError("checkpoint_every_s", f"must not be negative, got {self.checkpoint_every_s}")
        if self.models is not None and not self.models:
            raise RequestError("models", "an empty set of allowed models can never be satisfied")

    @property
    def preempts(self) -> bool:
        """Whether this pod may evict lower-priority pods (PreemptLowerPriority)."""
        return self.preempt is not False

    @property
    def gpu_cards(self) -> int:
        """How many distinct cards the GPU form takes (0 without one; a MIG slice takes one)."""
        gpu = self.gpu
        if gpu is None:
            return 0
        return gpu.count if isinstance(gpu, WholeCards | Fraction) else 1

    @property
    def gpu_milli_total(self) -> int:
        """GPU demand in milli-cards, as the trace counts it (MIG counts its compute share at placement)."""
        gpu = self.gpu
        if isinstance(gpu, WholeCards):
            return gpu.count * MILLI_PER_CARD
        if isinstance(gpu, Fraction):
            return gpu.count * gpu.compute_milli
        return 0

    def tolerates(self, key: str, value: str = "", effect: str = "NoSchedule") -> bool:
        """`TolerationsTolerateTaint` of k8s.io/api core/v1 toleration.go: some toleration tolerates the taint."""
        return any(t.tolerates(key, value, effect) for t in self.tolerations)

    @property
    def tolerates_unschedulable(self) -> bool:
        """Whether a cordoned node takes this pod (NodeUnschedulable: the taint `UNSCHEDULABLE_TAINT:NoSchedule`)."""
        return self.tolerates(UNSCHEDULABLE_TAINT, "", "NoSchedule")

    @property
    def has_node_constraints(self) -> bool:
        """Whether node labels or names decide anything for this pod (selector or required affinity)."""
        return bool(self.node_selector) or self.required_terms is not None


def make_request(catalog: Catalog, name: str, *, cpu_milli: int = 0, memory_mib: int = 0,
                 gpu: GpuForm | None = None, models: frozenset[str] | set[str] | None = None,
                 package: tuple[str, str] | None = None, **kwargs: object) -> PodRequest:
    """Build a request and check it against the catalog.

    `package=(model, name)` asks for a named vGPU package, e.g. `("A30", "half")`, and pins the model.
    Rejects: a fraction of more memory than any allowed card has, a MIG profile an allowed model lacks,
    unknown models.
    """
    if package is not None:
        if gpu is not None:
            raise RequestError("package", "give a package or a GPU form, not both")
        try:
            card = catalog.get(package[0])
            pkg = catalog.package(package[0], package[1])
        except CatalogError as exc:
            raise RequestError("package", str(exc)) from None
        gpu = Fraction(compute_milli=pkg.compute_milli, memory_mib=pkg.memory_mib,
                       package=f"{card.name}/{pkg.name}")
        models = {card.name}
    canonical: frozenset[str] | None = None
    if models is not None:
        try:
            canonical = frozenset(catalog.canonical(m) for m in models)
        except CatalogError as exc:
            raise RequestError("models", str(exc)) from None
    candidates = [catalog.get(m) for m in canonical] if canonical is not None else list(catalog)
    if isinstance(gpu, Fraction) and gpu.memory_mib:
        largest = max(c.memory_mib for c in candidates)
        if gpu.memory_mib > largest:
            raise RequestError("gpu.memory_mib", f"{gpu.memory_mib} MiB exceeds the largest allowed card "
                                                 f"({largest} MiB)")
    if isinstance(gpu, MigSlice):
        having = [c for c in candidates if c.mig_profile(gpu.profile) is not None]
        if canonical is not None:
            lacking = sorted(c.name for c in candidates if c.mig_profile(gpu.profile) is None)
            if lacking:
                raise RequestError("gpu.profile", f"MIG profile {gpu.profile!r} does not exist on "
                                                  f"{', '.join(lacking)}")
        elif not having:
            raise RequestError("gpu.profile", f"no card model has MIG profile {gpu.profile!r}")
        else:
            canonical = frozenset(c.name for c in having)
    return PodRequest(name, cpu_milli=cpu_milli, memory_mib=memory_mib, gpu=gpu, models=canonical,
                      **kwargs)  # type: ignore[arg-type]
