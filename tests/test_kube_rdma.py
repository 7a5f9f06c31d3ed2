"""RDMA to the pod: the Multus network a bind writes for the chosen NIC (`gpuplane.kube.network`), the resource
request it relies on, the local API server refusing what the real one refuses, and the sample manifests under
`deploy/rdma/` (their own kustomization) agreeing with what the scheduler writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gpuplane.kube.api import ApiError
from gpuplane.kube.cluster import KubeCluster, pod_manifest
from gpuplane.kube.localapi import FakeApiServer, node_json
from gpuplane.kube.network import NETWORKS, RESOURCE_NAME, RdmaNetworks, parse_networks
from gpuplane.kube.objects import ASSIGNMENT, INVENTORY, RES_RDMA, ObjectError, decode_assignment
from gpuplane.model import (
    Assignment,
    CardShare,
    PodRequest,
    RdmaLocality,
    RdmaShare,
    WholeCards,
    default_catalog,
)
from gpuplane.node import rdma
from gpuplane.port import WallClock
from gpuplane.scheduler import PolicyConfig, Scheduler, default_registry

ROOT = Path(__file__).resolve().parent.parent
RDMA_DEPLOY = ROOT / "deploy" / "rdma"
SCHEMAS = json.loads((Path(__file__).parent / "fixtures" / "rdma_crd_schemas.json").read_text(encoding="utf-8"))
NICS = ["ens1f0np0", "ens2f0np0"]
NETS = RdmaNetworks()


# ------------------------------------------------------------------ the annotation, as Multus reads it
@pytest.mark.parametrize(("raw", "elements"), [
    ("", []),
    ("macvlan", [{"name": "macvlan"}]),
    ("team/macvlan@eth5, other", [{"name": "macvlan", "namespace": "team", "interface": "eth5"}, {"name": "other"}]),
    ("a@", [{"name": "a"}]),  # Multus takes an empty interface as none
    ('[{"name":"x","ips":["10.0.0.1/24"],"interface":"net7"}]', [{"name": "x", "ips": ["10.0.0.1/24"],
                                                                  "interface": "net7"}]),
])
def test_the_annotation_is_parsed_as_multus_parses_it(raw: str, elements: list[dict[str, Any]]) -> None:
    # multus-cni pkg/k8sclient parsePodNetworkAnnotation / parsePodNetworkObjectName
    assert parse_networks(raw) == elements


@pytest.mark.parametrize(("raw", "field"), [
    ("a/b/c", "[0]"),                     # more than one '/'
    ("a@x@y", "[0]"),                     # more than one '@'
    ("ok,Bad_Name", "[1]"),               # not a DNS-1123 label
    ("a@averyveryverylongif", "[0]"),     # interface names are at most 15 bytes
    ('{"name": "x"}', ""),                # JSON, but not a list
    ('[{"ips": []}]', "[0]"),             # an element without a name
    ("[not json", ""),
])
def test_an_annotation_multus_would_refuse_is_named(raw: str, field: str) -> None:
    with pytest.raises(ObjectError) as caught:
        parse_networks(raw, "pod default/p")
    assert caught.value.field == f"metadata.annotations[{NETWORKS}]{field}"
    assert str(caught.value).startswith("pod default/p: ")


@pytest.mark.parametrize(("pf", "name"), [
    ("ens1f0np0", "gpuplane-rdma-ens1f0np0"),
    ("ibp12s0", "gpuplane-rdma-ibp12s0"),
    ("Eth_0.100", "gpuplane-rdma-eth-0-100"),  # lower case; what a DNS label cannot hold becomes '-'
])
def test_a_pfs_network_is_named_after_its_interface(pf: str, name: str) -> None:
    assert NETS.name(pf) == name


@pytest.mark.parametrize("pf", ["x" * 60, "eth0-"])
def test_a_pf_name_that_cannot_name_a_network_is_refused(pf: str) -> None:
    with pytest.raises(ValueError, match="DNS-1123"):
        NETS.name(pf)


OURS = {"name": "gpuplane-rdma-ens2f0np0", "namespace": "gpuplane-system"}


@pytest.mark.parametrize(("existing", "expected"), [
    (None, [OURS, OURS]),
    ("macvlan,team/sriov@eth9", [{"name": "macvlan"}, {"name": "sriov", "namespace": "team", "interface": "eth9"},
                                 OURS, OURS]),
    ('[{"name":"x","mac":"02:00:00:00:00:01"}]', [{"name": "x", "mac": "02:00:00:00:00:01"}, OURS, OURS]),
    # an earlier bind's elements are replaced, never listed twice; a user's network of the same name elsewhere stays
    ('[{"name":"gpuplane-rdma-ens1f0np0","namespace":"gpuplane-system"},{"name":"gpuplane-rdma-ens1f0np0"}]',
     [{"name": "gpuplane-rdma-ens1f0np0"}, OURS, OURS]),
])
def test_the_rdma_networks_join_the_users_networks(existing: str | None, expected: list[dict[str, Any]]) -> None:
    merged = NETS.annotate(existing, "ens2f0np0", 2, pod_namespace="default")
    assert json.loads(merged) == expected
    assert NETS.annotate(merged, "ens2f0np0", 2, pod_namespace="default") == merged  # binding again: the same


def test_a_network_namespace_and_prefix_are_checked() -> None:
    with pytest.raises(ValueError, match="namespace"):
        RdmaNetworks(namespace="Bad")
    with pytest.raises(ValueError, match="prefix"):
        RdmaNetworks(prefix="rdma_")
    assert RdmaNetworks(namespace="net").elements("ens1f0np0", 1) == [{"name": "gpuplane-rdma-ens1f0np0",
                                                                     "namespace": "net"}]


# ------------------------------------------------------------------ a bind through KubeCluster
def rdma_node(name: str = "n1") -> dict[str, Any]:
    node = node_json(name, cards=8)
    inventory = json.loads(node["metadata"]["annotations"][INVENTORY])
    inventory["nics"] = [{"name": nic, "pcieSwitch": i, "numa": i, "vfs": 8} for i, nic in enumerate(NICS)]
    node["metadata"]["annotations"][INVENTORY] = json.dumps(inventory)
    return node


def rdma_pod(name: str = "p", vfs: int = 2, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    pod = pod_manifest(PodRequest(f"default/{name}", gpu=WholeCards(2), rdma_vfs=vfs))
    pod["metadata"]["annotations"].update(annotations or {})
    return pod


def rdma_assignment(nic: int = 1, vfs: int = 2) -> Assignment:
    cards = tuple(CardShare(card=c, compute_milli=1000, memory_mib=40960, whole=True) for c in (2, 3))
    return Assignment("n1", cards, RdmaShare(nic, vfs, RdmaLocality.PCIE_SWITCH))


class Clock(WallClock):
    def now(self) -> float:
        return 1000.0


@pytest.fixture
def world() -> Iterator[tuple[FakeApiServer, KubeCluster]]:
    with FakeApiServer() as server:
        server.add_node(rdma_node())
        cluster = KubeCluster(server.api, default_catalog(), clock=Clock(), dispatch="manual", watch_timeout_s=30)
        yield server, cluster
        cluster.close()


def seen(cluster: KubeCluster, key: str, timeout_s: float = 5.0) -> bool:
    """Pump watch events until the pod is in the view (a deadline for the watch thread, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cluster.pump()
        if cluster.get_pod(key) is not None:
            return True
        cluster.wait_for_changes(0.05)
    return False


@pytest.mark.parametrize(("user", "kept"), [
    (None, []),
    ("macvlan-conf,team/storage@st0", [{"name": "macvlan-conf"}, {"name": "storage", "namespace": "team",
                                                                   "interface": "st0"}]),
    ('[{"name":"macvlan-conf","ips":["10.1.1.5/24"]}]', [{"name": "macvlan-conf", "ips": ["10.1.1.5/24"]}]),
])
def test_a_bind_names_the_chosen_nics_network_in_the_assignment_patch(world: tuple[FakeApiServer, KubeCluster],
                                                                      user: str | None,
                                                                      kept: list[dict[str, Any]]) -> None:
    server, cluster = world
    server.add_pod(rdma_pod(annotations={NETWORKS: user} if user is not None else None))
    assert seen(cluster, "default/p")
    since = len(server.requests)
    assert cluster.bind("default/p", rdma_assignment(nic=1, vfs=2)).ok
    writes = [(m, p) for m, p, _ in server.requests[since:] if m != "GET"]
    assert writes == [("PATCH", "/api/v1/namespaces/default/pods/p"),  # no extra write: the same PATCH
                      ("POST", "/api/v1/namespaces/default/pods/p/binding")]
    stored = server.get("pods", "default/p")
    assert stored is not None
    annotations = stored["metadata"]["annotations"]
    network = {"name": "gpuplane-rdma-ens2f0np0", "namespace": "gpuplane-system"}  # NIC 1 of the inventory
    assert json.loads(annotations[NETWORKS]) == [*kept, network, network]  # one element per VF, user's first
    assert decode_assignment(annotations[ASSIGNMENT]).rdma == RdmaShare(1, 2, RdmaLocality.PCIE_SWITCH)
    # The resource request is the one written at creation, the one every RDMA network's resourceName names:
    # kubelet allocates that many VFs and Multus hands one to each listed element.
    assert stored["spec"]["containers"][0]["resources"]["requests"][RES_RDMA] == "2"
    assert stored["spec"]["nodeName"] == "n1"


def test_the_scheduler_names_the_network_of_the_nic_it_chose_near_the_cards(
        world: tuple[FakeApiServer, KubeCluster]) -> None:
    server, cluster = world
    scheduler = Scheduler(cluster, default_catalog(), default_registry().build(PolicyConfig()), seed=0)
    try:
        assert cluster.create_pod(PodRequest("default/train-0", gpu=WholeCards(2), rdma_vfs=2)).ok
        [outcome] = scheduler.run_pending()
        assert outcome.decision.status.ok, outcome.decision.status.message
    finally:
        scheduler.close()
    stored = server.get("pods", "default/train-0")
    assert stored is not None and stored["spec"]["nodeName"] == "n1"
    assignment = decode_assignment(stored["metadata"]["annotations"][ASSIGNMENT])
    assert assignment.rdma is not None and assignment.rdma.locality is RdmaLocality.PCIE_SWITCH
    network = {"name": NETS.name(NICS[assignment.rdma.nic]), "namespace": NETS.namespace}
    assert json.loads(stored["metadata"]["annotations"][NETWORKS]) == [network, network]
    assert stored["spec"]["containers"][0]["resources"]["requests"][RES_RDMA] == "2"
    # The node agent reads the same pod and steers kubelet to that NIC's VFs.
    waiting = rdma.rdma_pod(stored, "n1")
    assert waiting is not None and waiting.assignment.rdma == assignment.rdma


def test_a_bind_without_rdma_leaves_the_networks_alone(world: tuple[FakeApiServer, KubeCluster]) -> None:
    server, cluster = world
    server.add_pod(rdma_pod(vfs=0, annotations={NETWORKS: "macvlan-conf"}))
    assert seen(cluster, "default/p")
    assignment = rdma_assignment()
    assert cluster.bind("default/p", Assignment(assignment.node, assignment.cards)).ok
    stored = server.get("pods", "default/p")
    assert stored is not None and stored["metadata"]["annotations"][NETWORKS] == "macvlan-conf"


@pytest.mark.parametrize(("annotations", "assignment", "message"), [
    ({NETWORKS: "a/b/c"}, rdma_assignment(), f"metadata.annotations[{NETWORKS}][0]"),
    ({}, rdma_assignment(nic=5), "RDMA NIC 5 assigned, the node has 2"),
])
def test_a_bind_that_cannot_name_the_network_writes_nothing(world: tuple[FakeApiServer, KubeCluster],
                                                            annotations: dict[str, str], assignment: Assignment,
                                                            message: str) -> None:
    server, cluster = world
    server.add_pod(rdma_pod(annotations=annotations))
    assert seen(cluster, "default/p")
    since = len(server.requests)
    status = cluster.bind("default/p", assignment)
    assert not status.ok and message in status.message
    assert [m for m, _, _ in server.requests[since:] if m != "GET"] == []


@pytest.mark.parametrize(("change", "refused"), [
    ({"spec": {"containers": [{"name": "main", "resources": {"limits": {RES_RDMA: "2", "example.com/vf": "1"}}}]}},
     True),
    ({"spec": {"containers": [{"name": "main", "resources": {"limits": {RES_RDMA: "2"}, "requests": {}}}]}}, True),
    ({"metadata": {"annotations": {NETWORKS: "macvlan-conf"}}}, False),  # annotations stay writable
])
def test_the_local_api_server_refuses_a_resource_change_on_a_pod(world: tuple[FakeApiServer, KubeCluster],
                                                                 change: dict[str, Any], refused: bool) -> None:
    # kubernetes pkg/apis/core/validation ValidatePodUpdate: only images, activeDeadlineSeconds, added tolerations
    # and terminationGracePeriodSeconds change (resources only through the resize subresource, cpu and memory).
    server, cluster = world
    server.add_pod(rdma_pod())
    if not refused:
        cluster.api.patch("/api/v1/namespaces/default/pods/p", change)
        return
    with pytest.raises(ApiError) as caught:
        cluster.api.patch("/api/v1/namespaces/default/pods/p", change)
    assert caught.value.status == 422 and "pod updates may not change fields other than" in str(caught.value)


# ------------------------------------------------------------------ deploy/rdma
def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(RDMA_DEPLOY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    return docs


DOCS = _docs()


def _kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def _pfs() -> list[str]:
    (configmap,) = _kind("ConfigMap")
    pools = json.loads(configmap["data"]["config.json"])["resourceList"]
    pfs = []
    for pool in pools:  # sriov-network-device-plugin's config: one pool per PF, RDMA, no ranges
        (selector,) = pool["selectors"]
        (pf,) = selector["pfNames"]
        assert selector["isRdma"] is True and "#" not in pf, pool
        assert "-" not in pool["resourceName"], pool  # the device plugin refuses hyphens in resource names
        pfs.append(pf)
    return pfs


@pytest.mark.parametrize("doc", DOCS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCS])
def test_every_rdma_object_validates_against_its_schema(doc: dict[str, Any]) -> None:
    schema = SCHEMAS.get(f"{doc['apiVersion']}/{doc['kind']}")
    if schema is None:  # built in: the Kubernetes 1.34 schemas
        assert kubernetes_validate.validate(doc, "1.34", strict=True) == "1.34"
    else:  # the upstream CRD's schema (tests/fixtures/rdma_crd_schemas.json names the source)
        jsonschema.validate(doc, schema)


def test_the_crd_schema_check_can_fail() -> None:
    (pool, *_) = _kind("SpiderIPPool")
    with pytest.raises(jsonschema.ValidationError):  # subnet is required
        jsonschema.validate({**pool, "spec": {"ips": ["10.0.0.1"]}},
                            SCHEMAS["spiderpool.spidernet.io/v2beta1/SpiderIPPool"])


def test_every_pf_has_the_network_and_the_ip_pool_the_scheduler_names() -> None:
    pfs = _pfs()
    assert pfs and len({NETS.name(pf) for pf in pfs}) == len(pfs)
    networks = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in _kind("NetworkAttachmentDefinition")}
    pools = {d["metadata"]["name"]: d for d in _kind("SpiderIPPool")}
    assert set(networks) == {(NETS.namespace, NETS.name(pf)) for pf in pfs}
    used_pools = set()
    for pf in pfs:
        network = networks[(NETS.namespace, NETS.name(pf))]
        assert network["metadata"]["annotations"][RESOURCE_NAME] == RES_RDMA  # what the pods request
        config = json.loads(network["spec"]["config"])
        assert config["name"] == NETS.name(pf)
        sriov = config["plugins"][0]
        assert sriov["type"] == "sriov" and "deviceID" not in sriov  # Multus adds the VF from PodResources
        assert [p["type"] for p in config["plugins"][1:]] == ["rdma", "coordinator"]
        assert sriov["ipam"]["type"] == "spiderpool"
        for name in sriov["ipam"]["default_ipv4_ippool"]:
            assert pools[name]["spec"]["multusName"] == [f"{NETS.namespace}/{NETS.name(pf)}"]
            used_pools.add(name)
    assert used_pools == set(pools)


def test_the_rdma_kustomization_renders_its_objects_and_is_not_in_the_default_one() -> None:
    kustomization = yaml.safe_load((RDMA_DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    assert sorted(kustomization["resources"]) == sorted(p.name for p in RDMA_DEPLOY.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")
    default = yaml.safe_load((ROOT / "deploy" / "kustomization.yaml").read_text(encoding="utf-8"))
    assert not [r for r in default.get("resources", []) if r.startswith("rdma")]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    rendered = subprocess.run([kubectl, "kustomize", str(RDMA_DEPLOY)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    names = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(rendered.stdout) if d)
    assert names == sorted((d["kind"], d["metadata"]["name"]) for d in DOCS)
