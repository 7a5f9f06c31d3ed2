"""gpuplane's custom resources: pydantic models, generated structural schemas, field paths in errors, the committed
CRD files, and agreement between the models and the schemas (checked with jsonschema as the API server would)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer import Typer
from typer.testing import CliRunner

from gpuplane.cli.operator_cmd import register
from gpuplane.kube.crds import (
    BY_KIND,
    COLOCATION_POLICY,
    GPU_POOL,
    KINDS,
    QUEUE,
    TIDAL_POLICY,
    ColocationPolicySpec,
    GpuPoolSpec,
    Kind,
    ResourceError,
    TidalPolicySpec,
    crd,
    crd_file,
    parse_resource,
    render_crd,
    resource_schema,
)
from gpuplane.model import default_catalog
from gpuplane.model.tidal import TidalPolicy

REPO = Path(__file__).resolve().parents[1]
CATALOG = default_catalog()


def obj(kind: Kind, spec: Any, name: str = "x", namespace: str | None = "ml") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "generation": 2}
    if kind.scope == "Namespaced" and namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": kind.kind, "metadata": meta, "spec": spec}


def tidal_spec(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "services": [{"name": "chat", "minReplicas": 2, "maxReplicas": 10, "dayFloor": 6, "perReplicaCapacity": 50.0,
                      "gpuMilliPerReplica": 1000},
                     {"name": "search", "minReplicas": 1, "maxReplicas": 4, "perReplicaCapacity": 20,
                      "gpuMilliPerReplica": 500}],
        "windows": [{"name": "night", "shrinkAt": "22:30", "lendFrom": "23:30", "reclaimAt": "07:30",
                     "nightReplicas": {"chat": 3}}],
        "reclaimHeadroom": 0.1, "reclaimGraceSeconds": 120, "checkpointLeadSeconds": 600,
        "drainOrder": "fewest-instances"}
    spec.update(changes)
    return spec


def pool_spec(**changes: Any) -> dict[str, Any]:
    return {"models": ["A100-80GB", "H100-80GB"], "nodeSelector": {"gpuplane.io/pool": "train"},
            "oversubscriptionRatio": 1.5, "split": 4, "migMode": "on", "quota": {"minGpus": 8, "maxGpus": 64},
            **changes}


def edit(spec: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `spec` with `path` (`windows.0.shrinkAt`) set to `value`."""
    out = copy.deepcopy(spec)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    target: Any = out
    for part in parents:
        target = target[part]
    target[last] = value
    return out


# ------------------------------------------------------------------ schema as the API server applies it
def json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAPI v3.0 → JSON Schema draft 4 (what it is based on): `nullable` becomes a null type."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties",):
            out[key] = {k: json_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            out[key] = json_schema(value)
        elif key == "nullable":
            continue
        else:
            out[key] = value
    if schema.get("nullable"):
        out["type"] = [schema["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def strict(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused (what `fieldValidation=Strict` does where pruning would drop them)."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if out["properties"] and "metadata" not in out["properties"]:
            out["additionalProperties"] = False
    for key in ("items",):
        if key in out:
            out[key] = strict(out[key])
    if isinstance(out.get("additionalProperties"), Mapping):
        out["additionalProperties"] = strict(out["additionalProperties"])
    return out


VALIDATORS = {k.kind: jsonschema.Draft4Validator(strict(json_schema(resource_schema(k)))) for k in KINDS}


def schema_errors(resource: Mapping[str, Any]) -> list[str]:
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
            for e in VALIDATORS[resource["kind"]].iter_errors(resource)]


def pydantic_accepts(resource: Mapping[str, Any]) -> bool:
    try:
        parse_resource(resource, CATALOG)
    except ResourceError:
        return False
    return True


def walk(schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), Mapping):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


# ------------------------------------------------------------------ CRDs
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_the_crd_is_structural(kind: Kind) -> None:
    """Structural: every node typed, no $ref / anyOf / allOf, no `additionalProperties` next to `properties`."""
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert "type" in node, path
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs"} & node.keys(), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
    spec = schema["properties"]["spec"]
    assert spec["description"]
    undocumented = [p for p, node in walk(spec)
                    if p.count(".") == 1 and not {"[", "{"} & set(p) and not node.get("description")]
    assert not undocumented


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_the_crd_validates_against_the_kubernetes_schemas(kind: Kind) -> None:
    kubernetes_validate.validate(crd(kind), "1.37.0", strict=True)
    version = crd(kind)["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][-2:] in (["Valid", "Age"], ["Applied", "Age"])
    assert crd(kind)["spec"]["scope"] == ("Cluster" if kind in (GPU_POOL, QUEUE) else "Namespaced")


def test_the_schema_carries_bounds_enums_and_patterns() -> None:
    spec = resource_schema(TIDAL_POLICY)["properties"]["spec"]
    service = spec["properties"]["services"]["items"]
    assert set(service["required"]) == {"name", "minReplicas", "maxReplicas", "perReplicaCapacity",
                                        "gpuMilliPerReplica"}
    assert service["properties"]["perReplicaCapacity"] == {
        "description": "Load (requests/s) one replica serves.", "minimum": 0, "exclusiveMinimum": True,
        "type": "number"}
    assert spec["properties"]["drainOrder"]["enum"] == ["fewest-instances", "newest", "random"]
    assert spec["properties"]["reclaimHeadroom"]["maximum"] == 1 and spec["properties"]["reclaimHeadroom"][
        "exclusiveMaximum"] is True
    window = spec["properties"]["windows"]["items"]["properties"]
    assert window["shrinkAt"]["pattern"].startswith("^")
    assert window["nightReplicas"] == {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0},
                                       "description": window["nightReplicas"]["description"]}
    quota = resource_schema(GPU_POOL)["properties"]["spec"]["properties"]["quota"]
    assert quota["nullable"] is True and quota["type"] == "object"


def test_the_committed_crd_files_are_up_to_date() -> None:
    folder = REPO / "deploy" / "crds"
    committed = sorted(p.name for p in folder.glob("*.yaml"))
    assert committed == sorted(crd_file(k) for k in KINDS)
    for kind in KINDS:
        assert (folder / crd_file(kind)).read_text(encoding="utf-8") == render_crd(kind), (
            f"deploy/crds/{crd_file(kind)} is stale: run `gpuplane crds --out deploy/crds`")
        assert yaml.safe_load(render_crd(kind)) == crd(kind)


def test_the_crds_command_writes_the_files(tmp_path: Path) -> None:
    app = Typer()
    register(app)
    result = CliRunner().invoke(app, ["crds", "--out", str(tmp_path / "crds")])
    assert result.exit_code == 0, result.output
    for kind in KINDS:
        assert (tmp_path / "crds" / crd_file(kind)).read_text(encoding="utf-8") == render_crd(kind)
        assert crd_file(kind) in result.output


# ------------------------------------------------------------------ good and bad objects
GOOD = [
    obj(TIDAL_POLICY, tidal_spec()),
    obj(TIDAL_POLICY, tidal_spec(windows=[{"name": "n", "shrinkAt": "0:00", "lendFrom": "00:00:00",
                                           "reclaimAt": "6:00"}])),
    obj(GPU_POOL, pool_spec(), namespace=None),
    obj(GPU_POOL, {"models": ["V100M16"]}, namespace=None),          # an alias of V100-16GB
    obj(GPU_POOL, pool_spec(quota=None), namespace=None),
    obj(COLOCATION_POLICY, {}),
    obj(COLOCATION_POLICY, {"nodeSelector": {"a": "b"}, "memoryGuard": False, "minSliceSeconds": 0.5,
                            "safetyMarginBytes": 4 << 30, "growthFactor": 2}),
]

# (object, field path named, whether the schema alone rejects it too)
BAD: list[tuple[dict[str, Any], str, bool]] = [
    (obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.shrinkAt", "24:00")), "spec.windows[0].shrinkAt", True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.reclaimAt", "7.30")), "spec.windows[0].reclaimAt", True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "services.0.minReplicas", -1)), "spec.services[0].minReplicas", True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "services.1.maxReplicas", "4")), "spec.services[1].maxReplicas", True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "services.0.perReplicaCapacity", 0)), "spec.services[0].perReplicaCapacity",
     True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "services.0.name", "Chat_1")), "spec.services[0].name", True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "services.0.replicas", 3)), "spec.services[0].replicas", True),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.nightReplicas", {"chat": -1})),
     "spec.windows[0].nightReplicas.chat", True),
    (obj(TIDAL_POLICY, tidal_spec(drainOrder="oldest")), "spec.drainOrder", True),
    (obj(TIDAL_POLICY, tidal_spec(reclaimHeadroom=1)), "spec.reclaimHeadroom", True),
    (obj(TIDAL_POLICY, tidal_spec(reclaimGraceSeconds=-5)), "spec.reclaimGraceSeconds", True),
    (obj(TIDAL_POLICY, tidal_spec(services=[])), "spec.services", True),
    (obj(TIDAL_POLICY, {**tidal_spec(), "nightWindow": {}}), "spec.nightWindow", True),
    (obj(GPU_POOL, pool_spec(split=0), namespace=None), "spec.split", True),
    (obj(GPU_POOL, pool_spec(oversubscriptionRatio=0.5), namespace=None), "spec.oversubscriptionRatio", True),
    (obj(GPU_POOL, pool_spec(migMode="auto"), namespace=None), "spec.migMode", True),
    (obj(GPU_POOL, pool_spec(models=[]), namespace=None), "spec.models", True),
    (obj(GPU_POOL, pool_spec(quota={"minGpus": -1}), namespace=None), "spec.quota.minGpus", True),
    (obj(COLOCATION_POLICY, {"pollSeconds": 0}), "spec.pollSeconds", True),
    (obj(COLOCATION_POLICY, {"memoryGuard": "yes"}), "spec.memoryGuard", True),
    (obj(COLOCATION_POLICY, {"onlineSmThresholdPercent": 101}), "spec.onlineSmThresholdPercent", True),
    # admission is the scheduler's (GuardSettings' admit_* fields), not the node guard's: not a policy field
    (obj(COLOCATION_POLICY, {"admitHysteresisBytes": 1}), "spec.admitHysteresisBytes", True),
    (obj(COLOCATION_POLICY, {"admitWindowSeconds": 1.0}), "spec.admitWindowSeconds", True),
    # cross-field rules: the schema cannot say them, the webhook (parse_resource) does
    (obj(TIDAL_POLICY, edit(tidal_spec(), "services.0.minReplicas", 11)), "spec.services[0]", False),
    (obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.nightReplicas", {"chat": 1})),
     "spec.windows[0].nightReplicas.chat", False),                    # 1 < chat's minimum of 2
    (obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.nightReplicas", {"mail": 1})),
     "spec.windows[0].nightReplicas", False),                         # no such service
    (obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.lendFrom", "08:00")), "spec.windows[0]", False),
    (obj(TIDAL_POLICY, tidal_spec(windows=[*tidal_spec()["windows"], {"name": "late", "shrinkAt": "02:00",
                                                                       "lendFrom": "02:00", "reclaimAt": "05:00"}])),
     "spec", False),                                                   # 02:00-05:00 inside 22:30-07:30
    (obj(GPU_POOL, pool_spec(quota={"minGpus": 9, "maxGpus": 8}), namespace=None), "spec.quota", False),
    (obj(GPU_POOL, pool_spec(models=["A100-80GB", "X9000"]), namespace=None), "spec.models[1]", False),
]


@pytest.mark.parametrize("resource", GOOD, ids=lambda r: r["kind"])
def test_good_objects_pass_both(resource: dict[str, Any]) -> None:
    parsed = parse_resource(resource, CATALOG)
    assert parsed.kind is BY_KIND[resource["kind"]] and parsed.generation == 2
    assert schema_errors(resource) == []


@pytest.mark.parametrize(("resource", "field", "schema_rejects"), BAD, ids=[b[1] for b in BAD])
def test_bad_objects_are_rejected_naming_the_field_and_the_schema_agrees(
        resource: dict[str, Any], field: str, schema_rejects: bool) -> None:
    with pytest.raises(ResourceError) as caught:
        parse_resource(resource, CATALOG)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    assert bool(schema_errors(resource)) is schema_rejects, schema_errors(resource)


def test_messages_name_fields_as_kubernetes_writes_them() -> None:
    with pytest.raises(ResourceError, match=r"^spec\.services\[0\]: minReplicas 11 is above maxReplicas 10$"):
        parse_resource(obj(TIDAL_POLICY, edit(tidal_spec(), "services.0.minReplicas", 11)))
    with pytest.raises(ResourceError, match=r"^spec\.windows\[0\]\.nightReplicas\.chat: 1 would drop chat under its "
                                            r"minimum of 2$"):
        parse_resource(obj(TIDAL_POLICY, edit(tidal_spec(), "windows.0.nightReplicas", {"chat": 1})))


@pytest.mark.parametrize(("resource", "field"), [
    ({**obj(TIDAL_POLICY, tidal_spec()), "apiVersion": "gpuplane.io/v1"}, "apiVersion"),
    ({**obj(TIDAL_POLICY, tidal_spec()), "kind": "Pod"}, "kind"),
    ({**obj(TIDAL_POLICY, tidal_spec()), "metadata": {}}, "metadata.name"),
    ({k: v for k, v in obj(TIDAL_POLICY, tidal_spec()).items() if k != "spec"}, "spec"),
    (obj(GPU_POOL, pool_spec(), namespace="ml") | {"metadata": {"name": "p", "namespace": "ml"}}, "metadata.namespace"),
])
def test_the_envelope_is_checked(resource: dict[str, Any], field: str) -> None:
    with pytest.raises(ResourceError) as caught:
        parse_resource(resource)
    assert caught.value.field == field


def test_the_tidal_spec_is_the_controllers_policy() -> None:
    spec = parse_resource(obj(TIDAL_POLICY, tidal_spec())).spec
    assert isinstance(spec, TidalPolicySpec) and isinstance(spec, TidalPolicy)
    assert spec.window_at(0.0)[1] == "lend"               # 00:00 is inside 22:30-07:30, after lending from 23:30
    assert spec.reclaim_grace_s == 120.0
    assert [(b.stable_workload, b.per_replica_capacity, b.gpu_milli_per_replica) for b in spec.bindings()] == [
        ("chat-stable", 50.0, 1000), ("search-stable", 20.0, 500)]
    pool = parse_resource(obj(GPU_POOL, pool_spec(), namespace=None)).spec
    assert isinstance(pool, GpuPoolSpec) and pool.mig.value == "on"
    coloc = parse_resource(obj(COLOCATION_POLICY, {"minSliceSeconds": 0.5})).spec
    assert isinstance(coloc, ColocationPolicySpec) and coloc.min_slice_s == 0.5


# ------------------------------------------------------------------ property: pydantic accepts → schema accepts
# Mostly values a field takes, sometimes one it must refuse (the branches of one_of are drawn about evenly).
CLOCKS = st.one_of(st.builds(lambda h, m: f"{h}:{m:02d}", st.integers(0, 23), st.integers(0, 59)),
                   st.builds(lambda h, m: f"{h:02d}:{m:02d}:00", st.integers(0, 23), st.integers(0, 59)),
                   st.sampled_from(["24:00", "7.30", "", "12:60", "007:30"]))
GOOD_NUMBERS = st.integers(1, 12) | st.floats(0.5, 12, allow_nan=False)
NUMBERS = st.one_of(GOOD_NUMBERS, GOOD_NUMBERS, GOOD_NUMBERS, st.integers(-2, 0), st.floats(-1, 1, allow_nan=False),
                    st.sampled_from(["3", None, True]))
NAMES = st.sampled_from(["chat", "search", "a-b", "Chat", "", "x" * 60])


TIDAL_EDITS = st.sampled_from([
    ("services.0.name", NAMES), ("services.1.name", NAMES), ("services.0.minReplicas", NUMBERS),
    ("services.0.maxReplicas", NUMBERS), ("services.1.dayFloor", NUMBERS), ("services.1.perReplicaCapacity", NUMBERS),
    ("services.0.gpuMilliPerReplica", st.integers(-1, 9000)), ("services.0.surplus", NUMBERS),
    ("windows.0.shrinkAt", CLOCKS), ("windows.0.lendFrom", CLOCKS), ("windows.0.reclaimAt", CLOCKS),
    ("windows.0.nightReplicas", st.dictionaries(NAMES, NUMBERS, max_size=2)), ("reclaimHeadroom", NUMBERS),
    ("drainOrder", st.sampled_from(["newest", "random", "oldest"])), ("lend", st.booleans() | st.just(1)),
    ("forecastHorizonSeconds", NUMBERS), ("trainingPool", NAMES), ("checkpointLeadSeconds", NUMBERS),
])


@st.composite
def tidal_objects(draw: st.DrawFn) -> dict[str, Any]:
    """The good spec with one to three fields redrawn."""
    spec = tidal_spec()
    for path, values in draw(st.lists(TIDAL_EDITS, min_size=1, max_size=3)):
        spec = edit(spec, path, draw(values))
    return obj(TIDAL_POLICY, spec)


@st.composite
def pool_objects(draw: st.DrawFn) -> dict[str, Any]:
    spec = draw(st.fixed_dictionaries({"models": st.lists(st.sampled_from(["A100-80GB", "T4", "L4", "nope", ""]),
                                                          max_size=3)}, optional={
        "split": NUMBERS, "oversubscriptionRatio": NUMBERS, "migMode": st.sampled_from(["on", "off", "x"]),
        "quota": st.none() | st.fixed_dictionaries({}, optional={"minGpus": NUMBERS, "maxGpus": NUMBERS}),
        "nodeSelector": st.dictionaries(NAMES, NAMES | st.integers(), max_size=2)}))
    return obj(GPU_POOL, spec, namespace=None)


@st.composite
def colocation_objects(draw: st.DrawFn) -> dict[str, Any]:
    keys = list(ColocationPolicySpec.model_json_schema(by_alias=True)["properties"])
    return obj(COLOCATION_POLICY, draw(st.dictionaries(st.sampled_from(keys), NUMBERS | st.booleans(), max_size=5)))


@st.composite
def queue_objects(draw: st.DrawFn) -> dict[str, Any]:
    share = st.fixed_dictionaries({}, optional={"minGpus": NUMBERS, "maxGpus": NUMBERS})
    spec = draw(st.fixed_dictionaries({}, optional={
        "minGpus": NUMBERS, "maxGpus": NUMBERS, "borrow": st.booleans() | st.just(1), "lend": st.booleans(),
        "models": st.dictionaries(st.sampled_from(["H100", "A100-80GB", "nope", ""]), share, max_size=2)}))
    return obj(QUEUE, spec, namespace=None)


ACCEPTED: dict[str, int] = {}


@settings(max_examples=400, deadline=None)
@given(st.one_of(tidal_objects(), pool_objects(), colocation_objects(), queue_objects()))
def test_whatever_pydantic_accepts_the_schema_accepts(resource: dict[str, Any]) -> None:
    if pydantic_accepts(resource):
        ACCEPTED[resource["kind"]] = ACCEPTED.get(resource["kind"], 0) + 1
        assert schema_errors(resource) == []


def test_the_property_saw_accepted_objects_of_every_kind() -> None:
    # Guards the property above against vacuity: its generators must produce valid objects of each kind.
    test_whatever_pydantic_accepts_the_schema_accepts()
    assert set(ACCEPTED) == {k.kind for k in KINDS}, ACCEPTED
