"""The codec between Kubernetes objects and the model: what a pod asks, what a node offers, what was assigned."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.kube.extender import ExtenderBindingArgs
from gpuplane.kube.objects import (
    ASSIGNED_AT,
    ASSIGNMENT,
    BIND_PHASE,
    INVENTORY,
    PHASE_ALLOCATING,
    CardInventory,
    NodeInventory,
    ObjectError,
    assignment_annotations,
    decode_assignment,
    encode_assignment,
    node_info,
    node_spec,
    object_key,
    pod_info,
    pod_qos,
    pod_request,
    resource_version,
    resource_version_number,
    split_key,
    wants_gpu,
)
from gpuplane.model import (
    Assignment,
    CardShare,
    Fraction,
    MigMode,
    MigSlice,
    QoS,
    RdmaLocality,
    RdmaNic,
    RdmaShare,
    Taint,
    WholeCards,
    default_catalog,
)
from gpuplane.port import PodPhase

CATALOG = default_catalog()


def pod(limits: dict[str, str] | None = None, *, labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, phase: str = "Pending", node: str | None = None,
        **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ml", "labels": labels or {}, "annotations": annotations or {},
                     "creationTimestamp": "2026-11-29T10:00:00Z", "uid": "u-1"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits or {}}}], **spec},
        "status": {"phase": phase},
    }
    if node is not None:
        body["spec"]["nodeName"] = node
    return body


@pytest.mark.parametrize(("limits", "annotations", "gpu"), [
    ({}, {}, None),
    ({"gpuplane.io/gpu": "1"}, {}, WholeCards(1)),
    ({"gpuplane.io/gpu": "4"}, {}, WholeCards(4)),
    # 100 % of the cores is the whole card, as in HAMi
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "100"}, {}, WholeCards(1)),
    # 30 % of the cores = 300 milli-cards
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "30", "gpuplane.io/gpumem": "10240"}, {},
     Fraction(compute_milli=300, memory_mib=10240)),
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpumem-percentage": "25"}, {}, Fraction(memory_pct=25)),
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpu-encoders": "1"}, {}, Fraction(encoders=1)),
    ({"gpuplane.io/gpu": "1"}, {"gpuplane.io/mig-profile": "3g.40gb"}, MigSlice("3g.40gb")),
    ({"gpuplane.io/gpu": "1"}, {"gpuplane.io/mig-profile": "9"}, MigSlice(9)),
])
def test_gpu_forms(limits: dict[str, str], annotations: dict[str, str], gpu: object) -> None:
    assert pod_request(pod(limits, annotations=annotations), CATALOG).gpu == gpu


def test_a_pod_reads_every_scheduling_field() -> None:
    body = pod({"cpu": "1500m", "memory": "8Gi", "gpuplane.io/gpu": "2", "gpuplane.io/rdma-vf": "1"},
               labels={"gpuplane.io/qos": "offline", "gpuplane.io/queue": "team-a",
                       "scheduling.x-k8s.io/pod-group": "job-1"},
               annotations={"gpuplane.io/gang-size": "4", "gpuplane.io/gpu-models": "H100, A100-80GB",
                            "gpuplane.io/checkpoint-every-s": "600"},
               priority=1000, priorityClassName="training", preemptionPolicy="Never",
               nodeSelector={"gpuplane.io/pool": "train"},
               tolerations=[{"key": "gpu", "operator": "Exists"}, {"key": "zone", "value": "a"}])
    request = pod_request(body, CATALOG)
    assert request.name == "ml/p"
    assert (request.cpu_milli, request.memory_mib) == (1500, 8192)  # 8 Gi = 8 × 1024 MiB
    assert request.gpu == WholeCards(2)
    assert request.rdma_vfs == 1
    assert request.qos is QoS.OFFLINE
    assert (request.queue, request.gang, request.gang_size) == ("team-a", "job-1", 4)
    assert request.models == frozenset({"H100-80GB", "A100-80GB"})
    assert (request.priority, request.priority_class, request.preempt) == (1000, "training", False)
    assert request.pools == frozenset({"train"})
    assert request.checkpoint_every_s == 600.0
    assert [(t.key, t.value) for t in request.tolerations] == [("gpu", None), ("zone", "a")]


def test_containers_add_up_and_init_containers_take_the_larger() -> None:
    body = pod({"cpu": "1", "gpuplane.io/gpumem": "1000", "gpuplane.io/gpu": "1"})
    body["spec"]["containers"].append({"name": "side", "resources": {"requests": {"cpu": "500m"},
                                                                     "limits": {"gpuplane.io/gpumem": "24"}}})
    body["spec"]["initContainers"] = [{"name": "init", "resources": {"limits": {"cpu": "4"}}}]
    request = pod_request(body, CATALOG)
    assert request.cpu_milli == 4000  # max(init 4, 1 + 0.5)
    assert request.gpu == Fraction(memory_mib=1024)  # 1000 + 24


@pytest.mark.parametrize(("limits", "annotations", "labels", "field"), [
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "150"}, {}, {}, "resources[gpuplane.io/gpucores]"),
    ({"gpuplane.io/gpu": "1.5"}, {}, {}, "resources[gpuplane.io/gpu]"),
    ({"gpuplane.io/gpumem": "1024"}, {}, {}, "resources[gpuplane.io/gpu]"),  # the kubelet would never call Allocate
    ({"gpuplane.io/gpu": "lots"}, {}, {}, "spec.containers[0].resources[gpuplane.io/gpu]"),
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpumem": "1"}, {"gpuplane.io/mig-profile": "3g.40gb"}, {},
     "metadata.annotations[gpuplane.io/mig-profile]"),
    ({}, {"gpuplane.io/mig-profile": "3g.40gb"}, {}, "metadata.annotations[gpuplane.io/mig-profile]"),
    ({}, {}, {"gpuplane.io/qos": "urgent"}, "metadata.labels[gpuplane.io/qos]"),
    ({}, {"gpuplane.io/gang-size": "four"}, {"scheduling.x-k8s.io/pod-group": "g"},
     "metadata.annotations[gpuplane.io/gang-size]"),
    ({"gpuplane.io/gpu": "1"}, {"gpuplane.io/gpu-models": "Z9000"}, {}, "models"),
])
def test_bad_pods_name_the_field(limits: dict[str, str], annotations: dict[str, str], labels: dict[str, str],
                                 field: str) -> None:
    with pytest.raises(ObjectError) as caught:
        pod_request(pod(limits, annotations=annotations, labels=labels), CATALOG)
    assert caught.value.obj == "ml/p"
    assert caught.value.field == field
    assert field in str(caught.value)


def test_wants_gpu_only_for_gpuplane_resources() -> None:
    assert wants_gpu(pod({"gpuplane.io/gpumem": "100"}))
    assert not wants_gpu(pod({"cpu": "1", "nvidia.com/gpu": "1"}))
    assert not wants_gpu({"metadata": {"name": "x"}})


@pytest.mark.parametrize(("status_phase", "deleting", "node", "phase"), [
    ("Pending", False, None, PodPhase.PENDING),
    ("Pending", False, "n1", PodPhase.RUNNING),  # bound: its cards are taken while images pull
    ("Running", False, "n1", PodPhase.RUNNING),
    ("Running", True, "n1", PodPhase.TERMINATING),
    ("Succeeded", False, "n1", PodPhase.SUCCEEDED),
    ("Failed", False, "n1", PodPhase.FAILED),
    ("Unknown", False, "n1", PodPhase.RUNNING),
])
def test_phases(status_phase: str, deleting: bool, node: str | None, phase: PodPhase) -> None:
    body = pod({"gpuplane.io/gpu": "1"}, phase=status_phase, node=node)
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-11-29T11:00:00Z"
    assert pod_info(body, CATALOG).phase is phase


def test_a_recorded_assignment_counts_once_the_pod_is_bound() -> None:
    assignment = Assignment("n1", (CardShare(3, 300, 10240),))
    notes = assignment_annotations(assignment, 1_700_000_000.5)
    assert notes[BIND_PHASE] == PHASE_ALLOCATING
    assert float(notes[ASSIGNED_AT]) == 1_700_000_000.5
    recorded = pod({"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "30", "gpuplane.io/gpumem": "10240"},
                   annotations=notes)
    assert pod_info(recorded, CATALOG).assignment is None  # recorded, Binding not landed yet
    bound = pod_info({**recorded, "spec": {**recorded["spec"], "nodeName": "n1"}}, CATALOG)
    assert bound.assignment == assignment
    assert bound.bound_at == 1_700_000_000.5
    assert bound.created_at == 1_795_946_400.0  # 2026-11-29T10:00:00Z
    assert dict(bound.annotations)[ASSIGNMENT] == notes[ASSIGNMENT]


def test_an_assignment_for_another_node_is_an_error() -> None:
    notes = assignment_annotations(Assignment("n2", (CardShare(0, 1000, 0, whole=True),)), 0.0)
    with pytest.raises(ObjectError, match="names node 'n2' but the pod is bound to 'n1'"):
        pod_info(pod({"gpuplane.io/gpu": "1"}, annotations=notes, node="n1", phase="Running"), CATALOG)


def test_a_pod_bound_by_someone_else_holds_its_node_without_cards() -> None:
    assert pod_info(pod({"cpu": "1"}, node="n1", phase="Running"), CATALOG).assignment == Assignment("n1")


@pytest.mark.parametrize("raw", [
    "", "not json", "[]", '{"cards":[]}', '{"node":""}', '{"node":"n","cards":[{"card":-1}]}',
    '{"node":"n","cards":[{"card":"0"}]}', '{"node":"n","cards":[{"card":0,"mig":9}]}',
    '{"node":"n","cards":[7]}', '{"node":"n","rdma":{"nic":0}}',
])
def test_malformed_assignments_name_the_annotation(raw: str) -> None:
    with pytest.raises(ObjectError, match=r"metadata\.annotations\[gpuplane\.io/assignment\]"):
        decode_assignment(raw, "ml/p")


shares = st.builds(
    CardShare, card=st.integers(0, 15), compute_milli=st.integers(0, 1000), memory_mib=st.integers(0, 200_000),
    encoders=st.integers(0, 3), decoders=st.integers(0, 7), whole=st.booleans())
mig_shares = st.builds(lambda card, profile, start: CardShare(card, 428, 40_000, mig_profile=profile, mig_start=start),
                       st.integers(0, 7), st.sampled_from([0, 5, 9, 14, 15, 19, 20]), st.integers(0, 6))
assignments = st.builds(
    Assignment, node=st.text(min_size=1, max_size=20), cards=st.lists(shares | mig_shares, max_size=8).map(tuple),
    rdma=st.none() | st.builds(RdmaShare, st.integers(0, 3), st.integers(1, 8), st.sampled_from(list(RdmaLocality))),
    oversubscribed=st.booleans())


@given(assignments)
def test_assignments_round_trip(assignment: Assignment) -> None:
    assert decode_assignment(encode_assignment(assignment)) == assignment


def inventory_node(inventory: NodeInventory, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": "n1", "resourceVersion": "42", "labels": {"gpuplane.io/pool": "train"},
                         "annotations": {INVENTORY: inventory.encode()}},
            "spec": extra, "status": {"allocatable": {"cpu": "96", "memory": "1Ti"}}}


def test_a_node_reads_its_inventory_labels_taints_and_cordon() -> None:
    inventory = NodeInventory("H100", tuple(CardInventory(i, f"GPU-{i}", numa=i // 4, pcie_switch=i // 2)
                                            for i in range(8)),
                              nvlink_groups=((0, 1, 2, 3), (4, 5, 6, 7)),
                              nics=(RdmaNic("mlx5_0", 0, 0, 8),), mig_mode=MigMode.OFF, split=4)
    info = node_info(inventory_node(inventory, unschedulable=True,
                                    taints=[{"key": "gpuplane.io/quarantine", "effect": "NoSchedule"}]), CATALOG)
    spec = info.spec
    assert info.resource_version == 42
    assert (spec.cpu_milli, spec.memory_mib) == (96_000, 1_048_576)  # 1 Ti = 1024 × 1024 MiB
    assert (spec.gpu_model, spec.gpus, spec.pool, spec.mig_mode) == ("H100-80GB", 8, "train", MigMode.OFF)
    assert spec.topology.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert spec.topology.pcie_switch == (0, 0, 1, 1, 2, 2, 3, 3)
    assert spec.topology.nvlink_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert spec.topology.nics == (RdmaNic("mlx5_0", 0, 0, 8),)
    assert spec.taints == (Taint("gpuplane.io/quarantine", "", "NoSchedule"),)
    assert not spec.schedulable
    assert NodeInventory.decode(inventory.encode()) == inventory


def test_a_node_without_inventory_has_no_gpus() -> None:
    spec = node_spec({"metadata": {"name": "cpu-1"}, "status": {"allocatable": {"cpu": "8", "memory": "32Gi"}}},
                     CATALOG)
    assert (spec.gpus, spec.gpu_model, spec.schedulable) == (0, None, True)


@pytest.mark.parametrize(("raw", "message"), [
    ("{", "not a gpuplane GPU inventory"),
    ('{"model":"H100","cards":[{"index":1,"uuid":"a"}]}', "listed by index"),
    ('{"model":"H100","cards":[{"index":0,"uuid":"a"}],"split":0}', "split must be at least 1"),
    ('{"model":"Z9000","cards":[{"index":0,"uuid":"a"}]}', "unknown GPU model"),
    ('{"model":"H100","cards":[{"index":0,"uuid":"a"}],"nvlinkGroups":[[0,5]]}', "NVLink group"),
])
def test_bad_inventories_name_the_annotation(raw: str, message: str) -> None:
    body = {"metadata": {"name": "n1", "annotations": {INVENTORY: raw}}, "status": {"allocatable": {"cpu": "1"}}}
    with pytest.raises(ObjectError, match=message) as caught:
        node_spec(body, CATALOG)
    assert caught.value.field.startswith("metadata.annotations[gpuplane.io/gpu-inventory]")


def test_bad_allocatable_names_the_field() -> None:
    with pytest.raises(ObjectError, match=r"status\.allocatable\[cpu\]"):
        node_spec({"metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "many"}}}, CATALOG)


# ------------------------------------------------------------------ malformed pods: ObjectError, never anything else
@pytest.mark.parametrize(("annotations", "labels", "field"), [
    ({"gpuplane.io/checkpoint-every-s": "often"}, {}, "metadata.annotations[gpuplane.io/checkpoint-every-s]"),
    ({"gpuplane.io/checkpoint-every-s": "-60"}, {}, "metadata.annotations[gpuplane.io/checkpoint-every-s]"),
    ({"gpuplane.io/checkpoint-every-s": "nan"}, {}, "metadata.annotations[gpuplane.io/checkpoint-every-s]"),
    ({"gpuplane.io/checkpoint-every-s": "inf"}, {}, "metadata.annotations[gpuplane.io/checkpoint-every-s]"),
    ({}, {"gpuplane.io/instance": "three"}, "metadata.labels[gpuplane.io/instance]"),
    ({}, {"gpuplane.io/instance": "-1"}, "metadata.labels[gpuplane.io/instance]"),
    ({}, {"gpuplane.io/instance": "²"}, "metadata.labels[gpuplane.io/instance]"),  # str.isdigit says yes
    ({"gpuplane.io/mig-profile": "²"}, {}, "metadata.annotations[gpuplane.io/mig-profile]"),
    ({"gpuplane.io/mig-profile": "9" * 5000}, {}, "metadata.annotations[gpuplane.io/mig-profile]"),
])
def test_bad_annotations_and_labels_name_themselves(annotations: dict[str, str], labels: dict[str, str],
                                                     field: str) -> None:
    with pytest.raises(ObjectError) as caught:
        pod_request(pod({"gpuplane.io/gpu": "1"}, annotations=annotations, labels=labels), CATALOG)
    assert (caught.value.obj, caught.value.field) == ("ml/p", field)


@pytest.mark.parametrize(("instance", "expected"), [(None, None), ("0", 0), ("12", 12)])
def test_the_instance_label(instance: str | None, expected: int | None) -> None:
    labels = {} if instance is None else {"gpuplane.io/instance": instance}
    assert pod_request(pod({"gpuplane.io/gpu": "1"}, labels=labels), CATALOG).instance == expected


@pytest.mark.parametrize(("spec", "field"), [
    ({"priorityClassName": {"a": 1}}, "spec.priorityClassName"),
    ({"preemptionPolicy": ["Never"]}, "spec.preemptionPolicy"),
])
def test_ill_typed_spec_fields_name_themselves(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ObjectError) as caught:
        pod_request(pod({"gpuplane.io/gpu": "1"}, **spec), CATALOG)
    assert caught.value.field == field


@pytest.mark.parametrize("quantity_", ["Infinity", "-Infinity", "NaN", "sNaN", "1e999999", "1e999999Ki", "-1e30"])
def test_quantities_past_kubernetes_range_name_the_field(quantity_: str) -> None:
    with pytest.raises(ObjectError) as caught:
        pod_request(pod({"gpuplane.io/gpu": "1", "cpu": quantity_}), CATALOG)
    assert caught.value.field == "spec.containers[0].resources[cpu]"


def test_owner_references_must_be_a_list_of_objects() -> None:
    body = pod({"gpuplane.io/gpu": "1"})
    body["metadata"]["ownerReferences"] = 5
    with pytest.raises(ObjectError) as caught:
        pod_request(body, CATALOG)
    assert caught.value.field == "metadata.ownerReferences"


@pytest.mark.parametrize(("stamp", "bound_at"), [
    ("1700000000.5", 1_700_000_000.5),  # what the scheduler writes: epoch seconds
    ("2026-11-29T10:00:00Z", 1_795_946_400.0),  # RFC 3339, as the device plugin also reads it
    ("yesterday", None),
    ("nan", None),
    ("inf", None),
    ("", None),
])
def test_the_assignment_stamp(stamp: str, bound_at: float | None) -> None:
    notes = assignment_annotations(Assignment("n1", (CardShare(0, 1000, 0, whole=True),)), 0.0)
    notes[ASSIGNED_AT] = stamp
    body = pod({"gpuplane.io/gpu": "1"}, annotations=notes, node="n1", phase="Running")
    if bound_at is None:
        with pytest.raises(ObjectError) as caught:
            pod_info(body, CATALOG)
        assert caught.value.field == "metadata.annotations[gpuplane.io/assigned-at]"
    else:
        assert pod_info(body, CATALOG).bound_at == bound_at


@pytest.mark.parametrize(("label", "qos"), [
    (None, QoS.ONLINE),  # the default
    ("offline", QoS.OFFLINE),
    ("best-effort", QoS.BEST_EFFORT),
    ("Burstable", QoS.OFFLINE),  # Kubernetes' class names, as the trace uses them
    ("urgent", None),
    ("", None),
])
def test_pod_qos(label: str | None, qos: QoS | None) -> None:
    body = pod(labels={} if label is None else {"gpuplane.io/qos": label})
    if qos is None:
        with pytest.raises(ObjectError) as caught:
            pod_qos(body)
        assert (caught.value.obj, caught.value.field) == ("ml/p", "metadata.labels[gpuplane.io/qos]")
    else:
        assert pod_qos(body) is qos


@pytest.mark.parametrize(("raw", "version"), [
    ("42", 42), (None, -1), ("", -1), ("abc", -1), ("-3", -1), ("²", -1), ("1" * 5000, -1), (7, -1), ({}, -1),
])
def test_resource_version_is_a_non_negative_integer_or_minus_one(raw: object, version: int) -> None:
    assert resource_version_number(raw) == version
    assert resource_version({"metadata": {"resourceVersion": raw}}) == version


def test_a_node_without_a_readable_resource_version() -> None:
    inventory = NodeInventory("H100", (CardInventory(0, "GPU-0"),))
    body = inventory_node(inventory)
    body["metadata"]["resourceVersion"] = "opaque"
    assert node_info(body, CATALOG).resource_version == -1  # as the informer reads it


def rich_pod() -> dict[str, Any]:
    """A valid pod that uses every field the codec reads."""
    assignment = Assignment("n1", (CardShare(0, 300, 10240),), RdmaShare(0, 1, RdmaLocality.PCIE_SWITCH))
    notes = assignment_annotations(assignment, 1_700_000_000.0)
    notes.update({"gpuplane.io/gang-size": "2", "gpuplane.io/gpu-models": "A100-80GB",
                  "gpuplane.io/checkpoint-every-s": "600"})
    body = pod({"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "30", "gpuplane.io/gpumem": "10240", "cpu": "1",
                "memory": "1Gi", "gpuplane.io/rdma-vf": "1"},
               labels={"gpuplane.io/qos": "offline", "gpuplane.io/queue": "q", "gpuplane.io/instance": "2",
                       "scheduling.x-k8s.io/pod-group": "g"},
               annotations=notes, node="n1", phase="Running", priority=10, priorityClassName="high",
               preemptionPolicy="Never", nodeSelector={"gpuplane.io/pool": "train"},
               tolerations=[{"key": "gpu", "operator": "Exists"}])
    body["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"cpu": "2"}}}]
    body["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "controller": True}]
    return body


tricky_strings = st.sampled_from([
    "", "²", "1" * 5000, "nan", "inf", "-1", "1.5", "1e400", "Infinity", "sNaN", "1e999999Ki", "[" * 3000,
    "{", "null", "3g.40gb", "Never", "Running", "Pending", "2026-13-45T99:00:00Z", "0001-01-01T00:00:00",
])
json_scalars = st.one_of(st.none(), st.booleans(), st.text(max_size=12), tricky_strings,
                         st.integers(min_value=-(10**30), max_value=10**30),
                         st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8) | tricky_strings, inner, max_size=3)),
    max_leaves=10)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found.extend(_paths(value, (*prefix, i)))
    return found


@st.composite
def mutated_pods(draw: st.DrawFn) -> dict[str, Any]:
    """`rich_pod` with one to three parts broken: a value replaced (JSON-ish garbage, or a string for an annotation
    or label), a key dropped."""
    body = rich_pod()
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent: Any = body
        for step in path[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return body


@settings(max_examples=400, deadline=None)
@given(mutated_pods())
def test_malformed_pods_raise_only_object_errors(body: dict[str, Any]) -> None:
    for read in (pod_request, pod_info):
        with contextlib.suppress(ObjectError):  # anything else fails the test
            read(body, CATALOG)


# ------------------------------------------------------------------ label selectors
@pytest.mark.parametrize(("selector", "labels", "selected"), [
    ({}, {}, True),                                            # empty selects everything
    ({}, {"a": "1"}, True),
    ({"a": "1"}, {"a": "1", "b": "2"}, True),                  # extra labels do not matter
    ({"a": "1", "b": "2"}, {"a": "1", "b": "2"}, True),
    ({"a": "1"}, {}, False),                                   # a missing key fails
    ({"a": "1"}, {"a": "2"}, False),                           # a different value fails
    ({"a": "1", "b": "2"}, {"a": "1", "b": "3"}, False),       # every pair must match
    ({"a": ""}, {}, False),                                    # an empty value needs the key present
    ({"a": ""}, {"a": ""}, True),
])
def test_selects_is_every_pair_equal(selector: dict[str, str], labels: dict[str, str], selected: bool) -> None:
    from gpuplane.kube.objects import selects

    assert selects(selector, labels) is selected


@given(st.dictionaries(st.sampled_from("abcd"), st.sampled_from("xy")),
       st.dictionaries(st.sampled_from("abcd"), st.sampled_from("xy")))
def test_selects_is_subset_of_items(selector: dict[str, str], labels: dict[str, str]) -> None:
    from gpuplane.kube.objects import selects

    assert selects(selector, labels) is (selector.items() <= labels.items())


@pytest.mark.parametrize(("namespace", "name", "key"), [
    ("ml", "p", "ml/p"),
    ("", "p", "default/p"),  # a bare name would never match the port's `namespace/name`
])
def test_binding_args_name_the_pod_as_the_model_does(namespace: str, name: str, key: str) -> None:
    args = ExtenderBindingArgs.decode({"PodName": name, "PodNamespace": namespace, "PodUID": "u", "Node": "n1"})
    assert args.pod_key == key
    assert split_key(args.pod_key) == (namespace or "default", name)
    # the API server stores a pod sent without a namespace in `default`: the port names it so
    assert args.pod_key == object_key({"metadata": {"name": name, "namespace": namespace or "default"}})
