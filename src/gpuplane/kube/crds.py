"""gpuplane's custom resources (group `gpuplane.io`, version `v1alpha1`): models, CRDs and validation.

- `GpuPool` (cluster-scoped): a set of nodes (node selector) with its card models, sharing (split,
  oversubscription), MIG mode and quota.
- `TidalPolicy` (namespaced): the tidal controller's policy (`gpuplane.model.tidal.TidalPolicy`, which the
  spec model extends, so the same validators run) plus how each service maps onto its workloads.
- `ColocationPolicy` (namespaced): the node co-location guard's thresholds for matching nodes.
- `Queue` (cluster-scoped): a tenant's GPU quota (guaranteed minimum, maximum, per card model, borrowing),
  which pods name with the label `gpuplane.io/queue` (`gpuplane.model.quota.QueueQuota`).

Each spec is a pydantic model; its JSON schema becomes the CRD's structural `openAPIV3Schema` (`crd`), and
`write_crds` writes the CRDs to `deploy/crds/<plural>.gpuplane.io.yaml`. The schema carries what a schema
can say (types, required, bounds, enums, patterns); the cross-field rules (minimum above maximum,
overlapping windows, unknown card models) are checked by `parse_resource`, which the admission webhook
and the operator both call. Unknown fields are pruned by the API server (structural schemas forbid
`additionalProperties: false` next to `properties`) and rejected by the models (`extra="forbid"`).
Errors name the field path as Kubernetes writes it: `spec.windows[0].shrinkAt: ...`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from gpuplane.controllers.colocation import GUARD_REACTION, GuardSettings
from gpuplane.controllers.tidal import DrainOrder, ServiceBinding
from gpuplane.model import Catalog, CatalogError, GpuplaneError, MigMode
from gpuplane.model.quota import ModelQuota, QueueQuota, QuotaError
from gpuplane.model.tidal import TidalPolicy, TidalService, TidalWindow

GROUP = "gpuplane.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

_GUARD = GuardSettings()
_CLOCK = r"^([01]?[0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _alias(name: str) -> str:
    """snake_case → camelCase, with the `_s` unit suffix spelled out (`reclaim_grace_s` → `reclaimGraceSeconds`)."""
    if name.endswith("_s"):
        return to_camel(name[:-2]) + "Seconds"
    return to_camel(name)


_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True, alias_generator=_alias, populate_by_name=True)


class ResourceError(GpuplaneError):
    """A custom resource that cannot be valid; `field` is the path (`spec.windows[0].shrinkAt`)."""

    def __init__(self, obj: str, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.obj = obj
        self.field = field
        self.reason = message


# ------------------------------------------------------------------ GpuPool
class GpuPoolQuota(BaseModel):
    model_config = _CONFIG

    min_gpus: int = Field(default=0, ge=0, description="Cards guaranteed to the pool's queue.")
    max_gpus: int | None = Field(default=None, ge=0,
                                 description="Cards the pool's pods may hold at most (unset: no cap).")

    @model_validator(mode="after")
    def _bounds(self) -> GpuPoolQuota:
        if self.max_gpus is not None and self.min_gpus > self.max_gpus:
            raise ValueError(f"minGpus {self.min_gpus} is above maxGpus {self.max_gpus}")
        return self


class GpuPoolSpec(BaseModel):
    """A pool of GPU nodes and how its cards are shared."""

    model_config = _CONFIG

    models: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        min_length=1, description="Card models of the pool (catalog names or aliases, e.g. A100-80GB).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Labels a node needs to be in the pool.")
    oversubscription_ratio: float = Field(default=1.0, ge=1.0, le=4.0,
                                          description="Card memory handed out per physical byte (1 = none).")
    split: int = Field(default=10, ge=1, le=100, description="Containers that may share one card.")
    mig_mode: Literal["dynamic", "on", "off"] = Field(
        default="dynamic",
        description="dynamic: a card enters MIG mode with its first instance and leaves it with its last; on; off.")
    quota: GpuPoolQuota | None = Field(default=None, description="Guaranteed and maximum cards of the pool.")

    @property
    def mig(self) -> MigMode:
        return MigMode(self.mig_mode)


# ------------------------------------------------------------------ TidalPolicy
class TidalServiceSpec(TidalService):
    """One inference service: the policy's bounds plus how it maps onto the cluster."""

    model_config = _CONFIG

    name: str = Field(min_length=1, max_length=56, pattern=_DNS_LABEL,
                      description="The service; its workloads are <name>-stable and <name>-tidal.")
    max_replicas: int = Field(ge=1, description="Replicas the service never exceeds.")
    per_replica_capacity: float = Field(gt=0, description="Load (requests/s) one replica serves.")
    gpu_milli_per_replica: int = Field(ge=1, le=8000, description="GPU thousandths one replica holds (1000 = a card).")

    def binding(self) -> ServiceBinding:
        return ServiceBinding(self.name, self.per_replica_capacity, self.gpu_milli_per_replica)


class NightWindowSpec(TidalWindow):
    """A nightly loan window; times are HH:MM, UTC."""

    model_config = _CONFIG

    name: str = Field(min_length=1, description="The window's name.")
    shrink_at: str = Field(pattern=_CLOCK, description="When inference shrinks to its night floor.")
    lend_from: str = Field(pattern=_CLOCK, description="When emptied tidal nodes start being lent to training.")
    reclaim_at: str = Field(pattern=_CLOCK, description="When lent nodes must be back (the return-before time).")
    night_replicas: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="Per service, the replicas kept during the window (at least its minimum).")


class TidalPolicySpec(TidalPolicy):
    """The tidal controller's policy: shrink inference at night, lend emptied nodes, return them in time."""

    model_config = _CONFIG

    services: tuple[TidalServiceSpec, ...] = Field(min_length=1, description="The inference services managed.")
    windows: tuple[NightWindowSpec, ...] = Field(min_length=1, description="Loan windows (they must not overlap).")
    reclaim_headroom: float = Field(default=0.1, ge=0, lt=1, description=(
        "Reclaim at once when the forecast needs more than (1 - headroom) of the unlent tidal nodes."))
    drain_order: Literal["fewest-instances", "newest", "random"] = Field(
        default="fewest-instances", description="Which replicas a scale-down removes first.")
    lend: bool = Field(default=True, description="Lend emptied nodes to training (false: only shrink and grow).")
    training_pool: str = Field(default="training", min_length=1, description="Pool lent nodes join.")
    tidal_pool: str = Field(default="inference-tidal", min_length=1, description="Pool returned nodes rejoin.")
    forecast_horizon_s: float = Field(default=1800.0, ge=0, description="How far ahead the load forecast looks.")

    @property
    def order(self) -> DrainOrder:
        return DrainOrder(self.drain_order)

    def bindings(self) -> list[ServiceBinding]:
        return [s.binding() for s in self.services]


# ------------------------------------------------------------------ ColocationPolicy
class ColocationPolicySpec(BaseModel):
    """The node co-location guard's online-first thresholds for the nodes it selects."""

    # The node guard's options only: admission (admission, admit_*) is set in the guard's file, not by a policy.
    model_config = _CONFIG

    node_selector: dict[str, str] = Field(default_factory=dict, description="Labels of the nodes the policy covers.")
    poll_s: float = Field(default=GUARD_REACTION.poll_s, gt=0, le=60,
                          description="How often the guard reads the cards.")
    kill_grace_s: float = Field(default=10.0, ge=0, description="SIGKILL follows SIGTERM after this long.")
    online_sm_threshold_percent: float = Field(default=5.0, ge=0, le=100,
                                               description="An online process above this SM use is online demand.")
    min_slice_s: float = Field(default=GUARD_REACTION.min_slice_s, ge=0, le=3600,
                               description="Offline resumes only after online has been idle this long beyond the "
                                           "idle reading itself (the node guard's default: 0, at once).")
    memory_guard: bool = Field(default=_GUARD.memory_guard, description="Evict offline work when card memory runs low.")
    safety_margin_bytes: int = Field(default=_GUARD.safety_margin_bytes, ge=0,
                                     description="Free memory always kept for online, on top of its expected growth.")
    growth_factor: float = Field(default=_GUARD.growth_factor, ge=0, le=100,
                                 description="Multiplies the largest online growth seen over the reaction horizon.")
    min_growth_bytes: int = Field(default=_GUARD.min_growth_bytes, ge=0, description="Online growth assumed at least.")
    reaction_horizon_s: float = Field(default=_GUARD.reaction_horizon_s, ge=0, le=3600,
                                      description="Sampling period plus the time an eviction takes to free memory.")
    growth_window_s: float = Field(default=_GUARD.growth_window_s, ge=0, le=7 * 86400,
                                   description="How long a growth observation counts.")


# ------------------------------------------------------------------ Queue
class QueueModelSpec(BaseModel):
    model_config = _CONFIG

    min_gpus: float = Field(default=0.0, ge=0, description="Cards of this model guaranteed to the queue.")
    max_gpus: float | None = Field(default=None, ge=0,
                                   description="Cards of this model the queue's pods may hold at most (unset: no cap).")


class QueueSpec(BaseModel):
    """A tenant's GPU quota; pods name the queue with the label gpuplane.io/queue."""

    model_config = _CONFIG

    min_gpus: float | None = Field(default=None, ge=0, description=(
        "Cards guaranteed to the queue, reclaimed from borrowers when it needs them (unset: the sum of the "
        "models' minGpus)."))
    max_gpus: float | None = Field(default=None, ge=0, description="Cards the queue's pods may hold at most (unset: "
                                                                     "no cap).")
    models: dict[str, QueueModelSpec] = Field(
        default_factory=dict, description="Per card model (catalog name or alias, e.g. H100): its own minimum and "
                                          "maximum.")
    borrow: bool = Field(default=True, description=(
        "Whether the queue may run beyond its minimum, up to its maximum, on cards others leave idle."))
    lend: bool = Field(default=True, description=(
        "Whether other pods may use the queue's idle guaranteed share (reclaimed by preemption when the queue "
        "needs it); false keeps it free."))

    def quota(self, name: str, catalog: Catalog | None = None, *, label: str = "") -> QueueQuota:
        """The scheduler's quota; `ResourceError` names the field (unknown models with a `catalog`)."""
        label = label or f"Queue/{name}"
        shares: list[ModelQuota] = []
        for model, share in self.models.items():
            field = f"spec.models.{model}"
            if not model:
                raise ResourceError(label, "spec.models", "a card model name must not be empty")
            canonical = model
            if catalog is not None:
                try:
                    canonical = catalog.canonical(model)
                except CatalogError as exc:
                    raise ResourceError(label, field, str(exc)) from None
            if share.max_gpus is not None and share.min_gpus > share.max_gpus:
                raise ResourceError(label, f"{field}.minGpus",
                                    f"{share.min_gpus:g} is above maxGpus {share.max_gpus:g}")
            if self.max_gpus is not None and share.min_gpus > self.max_gpus:
                raise ResourceError(label, f"{field}.minGpus",
                                    f"{share.min_gpus:g} is above the queue's maxGpus {self.max_gpus:g}")
            if any(s.model == canonical for s in shares):
                raise ResourceError(label, field, f"names the model {canonical} a second time")
            shares.append(ModelQuota(canonical, share.min_gpus, share.max_gpus))
        floor = sum(s.min_gpus for s in shares)
        minimum = floor if self.min_gpus is None else self.min_gpus
        if minimum < floor:
            raise ResourceError(label, "spec.minGpus",
                                f"{minimum:g} is below the sum of the models' minGpus ({floor:g})")
        if self.max_gpus is not None and minimum > self.max_gpus:
            raise ResourceError(label, "spec.minGpus", f"{minimum:g} is above maxGpus {self.max_gpus:g}")
        try:
            return QueueQuota(name, minimum, self.max_gpus, tuple(shares), self.borrow, self.lend)
        except QuotaError as exc:  # every rule above is checked first; this names what is left
            raise ResourceError(label, "spec", str(exc)) from None


# ------------------------------------------------------------------ status
class Condition(BaseModel):
    model_config = _CONFIG

    type: str = Field(description="Valid, Applied or (GpuPool) Conflict.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase cause (InvalidSpec, Reconciled, NotLeader, ...).")
    message: str = ""
    last_transition_time: str = Field(default="", description="RFC 3339.")
    observed_generation: int = Field(default=0, ge=0)


class ResourceStatus(BaseModel):
    """What the operator writes back: the generation it saw, its conditions and a few figures."""

    model_config = _CONFIG

    observed_generation: int = Field(default=0, ge=0, description="The metadata.generation last processed.")
    conditions: tuple[Condition, ...] = Field(default=(), description="Valid, Applied and (GpuPool) Conflict.")
    nodes: int = Field(default=0, ge=0, description="Nodes the resource currently covers.")
    models: tuple[str, ...] = Field(default=(), description="GpuPool: card models of its labelled nodes.")
    phase: str = Field(default="", description="TidalPolicy: day, shrink or lend.")
    lent_nodes: int = Field(default=0, ge=0, description="TidalPolicy: nodes lent to training now.")


# ------------------------------------------------------------------ kinds
@dataclass(frozen=True, slots=True)
class Column:
    name: str
    json_path: str
    type: str = "string"
    priority: int = 0


_VALID_COLUMN = Column("Valid", '.status.conditions[?(@.type=="Valid")].status')
_AGE_COLUMN = Column("Age", ".metadata.creationTimestamp", "date")


@dataclass(frozen=True, slots=True)
class Kind:
    kind: str
    plural: str
    scope: Literal["Namespaced", "Cluster"]
    spec: type[BaseModel]
    short_names: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{GROUP}"

    def path(self, namespace: str | None = None, name: str = "", sub: str = "") -> str:
        """The API path: all namespaces when `namespace` is None for a namespaced kind."""
        path = f"/apis/{GROUP}/{VERSION}"
        if self.scope == "Namespaced" and namespace is not None:
            path += f"/namespaces/{namespace}"
        path += f"/{self.plural}"
        if name:
            path += f"/{name}" + (f"/{sub}" if sub else "")
        return path


GPU_POOL = Kind("GpuPool", "gpupools", "Cluster", GpuPoolSpec, ("gpool",), (
    Column("Models", ".spec.models"), Column("Split", ".spec.split", "integer"),
    Column("Oversub", ".spec.oversubscriptionRatio", "number"), Column("Nodes", ".status.nodes", "integer"),
    _VALID_COLUMN, _AGE_COLUMN))
TIDAL_POLICY = Kind("TidalPolicy", "tidalpolicies", "Namespaced", TidalPolicySpec, ("tidal",), (
    Column("Phase", ".status.phase"), Column("Lent", ".status.lentNodes", "integer"), _VALID_COLUMN,
    Column("Applied", '.status.conditions[?(@.type=="Applied")].status'), _AGE_COLUMN))
COLOCATION_POLICY = Kind("ColocationPolicy", "colocationpolicies", "Namespaced", ColocationPolicySpec, ("coloc",), (
    Column("MemoryGuard", ".spec.memoryGuard", "boolean"), Column("Nodes", ".status.nodes", "integer"),
    _VALID_COLUMN, _AGE_COLUMN))
QUEUE = Kind("Queue", "queues", "Cluster", QueueSpec, ("gq",), (
    Column("Min", ".spec.minGpus", "number"), Column("Max", ".spec.maxGpus", "number"),
    Column("Borrow", ".spec.borrow", "boolean"), Column("Lend", ".spec.lend", "boolean"), _VALID_COLUMN, _AGE_COLUMN))
KINDS: tuple[Kind, ...] = (GPU_POOL, TIDAL_POLICY, COLOCATION_POLICY, QUEUE)
BY_KIND: Mapping[str, Kind] = {k.kind: k for k in KINDS}


# ------------------------------------------------------------------ schemas
def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema as a Kubernetes structural schema (OpenAPI v3.0 dialect): `$ref`s inlined,
    optional values `nullable`, exclusive bounds as booleans, no titles, no `additionalProperties: false`."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Any] = raw.pop("$defs", {})
    return _structural(raw, defs)


def _structural(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        merged = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise TypeError(f"no structural form for a union of {len(branches)} types")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        merged = {**_structural(branches[0], defs), **_structural(rest, defs), "nullable": True}
        if merged.get("default", 0) is None:
            del merged["default"]
        return merged
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items",) or (key == "additionalProperties" and isinstance(value, Mapping)):
            out[key] = _structural(value, defs)
        elif key == "additionalProperties":
            continue  # `false`: structural schemas prune unknown fields instead
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def resource_schema(kind: Kind) -> dict[str, Any]:
    """The whole object's schema: apiVersion, kind, metadata, spec (required) and status."""
    return {
        "type": "object",
        "description": (kind.spec.__doc__ or kind.kind).strip().splitlines()[0],
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(kind.spec),
            "status": openapi_schema(ResourceStatus),
        },
    }


def crd(kind: Kind) -> dict[str, Any]:
    """The `apiextensions.k8s.io/v1` CustomResourceDefinition of `kind`."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.crd_name, "labels": {"app.kubernetes.io/part-of": "gpuplane"}},
        "spec": {
            "group": GROUP,
            "scope": kind.scope,
            "names": {"kind": kind.kind, "listKind": f"{kind.kind}List", "plural": kind.plural,
                      "singular": kind.singular, "shortNames": list(kind.short_names), "categories": ["gpuplane"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": resource_schema(kind)},
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": c.name, "type": c.type, "jsonPath": c.json_path, **({"priority": c.priority}
                                                                              if c.priority else {})}
                    for c in kind.columns],
            }],
        },
    }


def render_crd(kind: Kind) -> str:
    header = "# Generated by `gpuplane crds --out deploy/crds` from gpuplane.kube.crds; do not edit.\n"
    return header + yaml.safe_dump(crd(kind), sort_keys=False, width=120, allow_unicode=True)


def crd_file(kind: Kind) -> str:
    return f"{kind.crd_name}.yaml"


def write_crds(out_dir: str | Path) -> list[Path]:
    """Write every CRD to `out_dir/<plural>.gpuplane.io.yaml`; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in KINDS:
        path = out / crd_file(kind)
        path.write_text(render_crd(kind), encoding="utf-8")
        paths.append(path)
    return paths


# ------------------------------------------------------------------ validation
@dataclass(frozen=True, slots=True)
class Resource:
    """A validated custom resource."""

    kind: Kind
    namespace: str | None
    name: str
    generation: int
    spec: BaseModel

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


def _path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_MSG_PATH = re.compile(r"^([A-Za-z_][\w]*(?:\.[\w-]+)*): ")


def _error(exc: ValidationError, prefix: Sequence[str | int]) -> tuple[str, str]:
    """The first error as (field path, message); a `a.b.c: ...` path a model validator puts in front of its
    message is moved into the field path (`windows.0.night_replicas` → `windows[0].nightReplicas`)."""
    first = exc.errors()[0]
    loc: list[str | int] = [*prefix, *first["loc"]]
    message = str(first["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    match = _MSG_PATH.match(message)
    if match:
        loc += [int(p) if p.isdigit() else _alias(p) for p in match.group(1).split(".")]
        message = message[match.end():]
    message = re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: _alias(m.group(0)), message)
    return _path(loc), message


def parse_resource(obj: Mapping[str, Any], catalog: Catalog | None = None) -> Resource:
    """Validate a custom resource object; raises `ResourceError` naming the field path on the first problem.

    With a `catalog`, a GpuPool's and a Queue's card models must be known to it; a Queue's cross-field rules
    (a model's minimum above its maximum, a minimum below the models' sum) are checked here too."""
    kind = BY_KIND.get(str(obj.get("kind")))
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    name = str(meta.get("name") or meta.get("generateName") or "")
    label = f"{obj.get('kind')}/{name}"
    if kind is None:
        raise ResourceError(label, "kind", f"not a gpuplane resource kind ({', '.join(BY_KIND)})")
    if obj.get("apiVersion") != API_VERSION:
        raise ResourceError(label, "apiVersion", f"must be {API_VERSION}, got {obj.get('apiVersion')!r}")
    if not name:
        raise ResourceError(label, "metadata.name", "missing")
    namespace = meta.get("namespace")
    if kind.scope == "Cluster" and namespace:
        raise ResourceError(label, "metadata.namespace", f"{kind.kind} is cluster-scoped")
    if "spec" not in obj:
        raise ResourceError(label, "spec", "missing")
    try:
        spec = kind.spec.model_validate_json(json.dumps(obj["spec"]))
    except ValidationError as exc:
        raise ResourceError(label, *_error(exc, ["spec"])) from None
    if catalog is not None and isinstance(spec, GpuPoolSpec):
        for i, model in enumerate(spec.models):
            try:
                catalog.canonical(model)
            except CatalogError as exc:
                raise ResourceError(label, f"spec.models[{i}]", str(exc)) from None
    if isinstance(spec, QueueSpec):
        spec.quota(name, catalog, label=label)
    generation = meta.get("generation")
    return Resource(kind, str(namespace) if namespace else None, name,
                    generation if isinstance(generation, int) else 0, spec)
