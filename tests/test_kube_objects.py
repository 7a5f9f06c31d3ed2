"""The codec between Kubernetes objects and the model: what a pod asks, what a node offers, what was assigned."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    pod_info,
    pod_request,
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
    ({"gpuplane.io/gpu": "2", "gpuplane.io/gpumem": "100"}, {}, {}, "resources[gpuplane.io/gpu]"),
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
