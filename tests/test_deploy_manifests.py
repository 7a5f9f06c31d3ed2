"""The deploy manifests (`deploy/`): Kubernetes schemas, least-privilege RBAC, real commands and flags,
pinned images, probes and resources, and the cross-references between the pieces.

No API server is involved: objects are validated against the Kubernetes 1.34 JSON schemas
(kubernetes-validate, strict: unknown fields are errors), the scheduler's component config against the
keys kube-scheduler reads, the webhook's matchConditions with a CEL interpreter, container command lines
by parsing them with gpuplane's own CLI.
"""

from __future__ import annotations

import base64
import http.server
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.controllers.recovery import QUARANTINE_TAINT
from gpuplane.controllers.tidal import LOAN_TAINT
from gpuplane.kube import localapi, webhook
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import MANAGED_RESOURCES, RES_GPU, SCHEDULER_ANNOTATIONS, SCHEDULER_NAME
from gpuplane.model import Taint
from gpuplane.model.priority import default_priority_classes
from gpuplane.node import allocation, device_plugin
from gpuplane.node.guard import load_guard_config
from gpuplane.scaler.service import load_scaler_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.34"
NAMESPACE = "gpuplane-system"
IMAGE = "ghcr.io/gpuplane/gpuplane:0.1.0"
SCHEDULER_CONFIG = DEPLOY / "scheduler" / "kube-scheduler-config.yaml"
NOT_API_OBJECTS = {"kustomization.yaml", "kube-scheduler-config.yaml"}

Doc = dict[str, Any]


RDMA = DEPLOY / "rdma"
"""Sample RDMA networks: their own kustomization, custom resources of other projects (tests/test_kube_rdma.py)."""
SCHEDULER_MODE = DEPLOY / "modes" / "scheduler"
"""Scheduler mode's scheduler pod: the component deploy/kustomization.yaml names instead of modes/extender (which
brings deploy/scheduler/). The objects below are the default install (extender mode); scheduler mode's are
checked at the end of this file."""
EXTENDER_MODE = DEPLOY / "scheduler"
DRA_MODE = DEPLOY / "modes" / "dra"
"""DRA mode: scheduler mode with patches (the DRA driver in the node agent, --dra on the scheduler); its objects are
those `kubectl kustomize` renders (checked after scheduler mode's, at the end of this file)."""
MIXED_MODE = DEPLOY / "modes" / "mixed"
"""Mixed mode: DRA mode's agent on the nodes labelled gpuplane.io/gpu-api=dra, scheduler mode's on the other GPU
nodes; rendered as DRA mode is (checked last)."""
OPERATOR_HA = DEPLOY / "components" / "operator-ha-rwx"
"""The operator's two-replica form on ReadWriteMany storage: a component added beside the mode (checked after the
operator's ledger below)."""
NOT_KUBERNETES = (DEPLOY / "monitoring", DEPLOY / "grafana")
"""Prometheus' and Grafana's own files (tests/test_alert_rules.py, tests/test_grafana.py; the scrape jobs below)."""
SCRAPE_CONFIG = DEPLOY / "monitoring" / "prometheus-scrape.yaml"


def _yaml_files(root: Path = DEPLOY) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
                  and RDMA not in p.parents and (root == SCHEDULER_MODE or SCHEDULER_MODE not in p.parents)
                  and (root == DRA_MODE or DRA_MODE not in p.parents)
                  and (root == MIXED_MODE or MIXED_MODE not in p.parents)
                  and (root == OPERATOR_HA or OPERATOR_HA not in p.parents)
                  and not any(d in p.parents for d in NOT_KUBERNETES))


def _load(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _objects() -> list[tuple[Path, Doc]]:
    """Every Kubernetes object under deploy/ (CRDs included), with its file."""
    return [(p, d) for p in _yaml_files() if p.name not in NOT_API_OBJECTS for d in _load(p)]


OBJECTS = _objects()


def _id(path: Path, doc: Doc) -> str:
    return f"{path.relative_to(DEPLOY)}:{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def _of_kind(*kinds: str, objects: list[tuple[Path, Doc]] | None = None) -> list[Doc]:
    return [d for _, d in (OBJECTS if objects is None else objects) if d.get("kind") in kinds]


def _one(kind: str, name: str) -> Doc:
    found = [d for d in _of_kind(kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _workloads() -> list[Doc]:
    return _of_kind("Deployment", "DaemonSet", "StatefulSet")


def _containers(workload: Doc) -> list[Doc]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def _gpuplane_containers() -> Iterator[tuple[Doc, Doc]]:
    for w in _workloads():
        for c in _containers(w):
            if c["image"].startswith("ghcr.io/gpuplane/"):
                yield w, c


def _cel_literals(expression: str) -> list[str]:
    return re.findall(r"'([^']*)'", expression)


# ------------------------------------------------------------------ schemas
@pytest.mark.parametrize(("path", "doc"), OBJECTS, ids=[_id(p, d) for p, d in OBJECTS])
def test_every_object_validates_against_the_kubernetes_schema(path: Path, doc: Doc) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_the_schema_check_rejects_an_unknown_field_and_a_wrong_type() -> None:
    # The check above must be able to fail: strict schemas refuse a misspelt field and a string port.
    service = _one("Service", "gpuplane-webhook")
    typo = {**service, "spec": {**service["spec"], "selectr": {"a": "b"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    bad_port = {**service, "spec": {**service["spec"], "ports": [{"port": "443"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad_port, K8S_VERSION, strict=True)


def _crds() -> list[Doc]:
    return _of_kind("CustomResourceDefinition")


# ------------------------------------------------------------------ the scheduler's component config
# KubeSchedulerConfiguration (kubescheduler.config.k8s.io/v1) is not an API object, so no schema above
# covers it; these are the keys kube-scheduler v1.34 decodes (strictly: an unknown key fails its start).
SCHEDULER_CONFIG_KEYS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection",
                         "enableProfiling", "enableContentionProfiling", "percentageOfNodesToScore",
                         "podInitialBackoffSeconds", "podMaxBackoffSeconds", "profiles", "extenders",
                         "delayCacheUntilActive"}
LEADER_ELECTION_KEYS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock",
                        "resourceName", "resourceNamespace"}
# protocols.md §1.1
EXTENDER_KEYS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "weight", "bindVerb",
                 "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable"}
DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


def _scheduler_config() -> Doc:
    # the repository ships it: without it the extender mode cannot be deployed, so its absence fails here
    assert SCHEDULER_CONFIG.exists(), f"{SCHEDULER_CONFIG.relative_to(DEPLOY.parent)} is missing"
    docs = _load(SCHEDULER_CONFIG)
    assert len(docs) == 1
    return docs[0]


def _embedded_scheduler_config() -> str:
    data: str = _one("ConfigMap", "gpuplane-scheduler-config")["data"]["kube-scheduler-config.yaml"]
    return data


def _check_scheduler_config(config: Doc) -> None:
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert set(config) <= SCHEDULER_CONFIG_KEYS, set(config) - SCHEDULER_CONFIG_KEYS
    election = config["leaderElection"]
    assert set(election) <= LEADER_ELECTION_KEYS, set(election) - LEADER_ELECTION_KEYS
    assert election["leaderElect"] is True
    assert election.get("resourceLock", "leases") == "leases"  # v1's default
    assert election["resourceName"]
    assert [p["schedulerName"] for p in config["profiles"]] == [SCHEDULER_NAME]
    extenders = config["extenders"]
    assert len(extenders) == 1
    ext = extenders[0]
    assert set(ext) <= EXTENDER_KEYS, set(ext) - EXTENDER_KEYS
    assert isinstance(ext["urlPrefix"], str) and ext["urlPrefix"]
    if ext.get("prioritizeVerb"):
        assert isinstance(ext.get("weight"), int) and ext["weight"] > 0, "v1 has no default weight: write it"
    assert sum(1 for e in extenders if e.get("bindVerb")) <= 1, "only one extender can implement bind"
    assert isinstance(ext.get("nodeCacheCapable", False), bool)
    assert isinstance(ext.get("ignorable", False), bool)
    if "httpTimeout" in ext:
        assert DURATION.match(str(ext["httpTimeout"])), ext["httpTimeout"]
    # No managedResources: kube-scheduler asks the extender about every pod of the profile, GPU or not.
    assert not ext.get("managedResources")
    # gpuplane.io/gpu is advertised by the device plugin, so NodeResourcesFit may count it; the others
    # exist on no node and must be ignored by the scheduler or no pod asking for them would ever fit.
    (profile,) = config["profiles"]
    fit = [c for c in profile.get("pluginConfig", []) if c["name"] == "NodeResourcesFit"]
    assert len(fit) == 1 and set(fit[0]["args"]) == {"ignoredResources"}
    assert sorted(fit[0]["args"]["ignoredResources"]) == sorted(n for n in MANAGED_RESOURCES if n != RES_GPU)


def test_scheduler_config_is_a_valid_component_config() -> None:
    _check_scheduler_config(_scheduler_config())


def test_the_embedded_scheduler_config_is_a_valid_component_config() -> None:
    _check_scheduler_config(yaml.safe_load(_embedded_scheduler_config()))


def test_the_configmap_embeds_the_scheduler_config_unchanged() -> None:
    sample = _scheduler_config()
    text = SCHEDULER_CONFIG.read_text(encoding="utf-8")
    assert yaml.safe_load(_embedded_scheduler_config()) == sample
    # Byte for byte too (comments included), so the sample and what runs cannot drift apart.
    assert _embedded_scheduler_config() == text, (
        "deploy/scheduler/configmap.yaml is stale: paste kube-scheduler-config.yaml into its data, indented 4")


def test_the_scheduler_calls_its_own_sidecar_with_the_sidecars_port_and_prefix() -> None:
    config = yaml.safe_load(_embedded_scheduler_config())
    deployment = _one("Deployment", "gpuplane-scheduler")
    by_name = {c["name"]: c for c in _containers(deployment)}
    args = by_name["extender"]["args"]
    port, prefix = args[args.index("--port") + 1], args[args.index("--prefix") + 1]
    assert config["extenders"][0]["urlPrefix"] == f"http://127.0.0.1:{port}{prefix}"
    assert by_name["kube-scheduler"]["command"][1] == "--config=/etc/gpuplane/kube-scheduler-config.yaml"
    mounts = {m["name"]: m["mountPath"] for m in by_name["kube-scheduler"]["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert mounts["config"] == "/etc/gpuplane"
    assert volumes["config"]["configMap"]["name"] == "gpuplane-scheduler-config"


# ------------------------------------------------------------------ RBAC
# What each component's code calls, as (verb, apiGroup, resource, scope, resourceName); scope is
# "cluster" or a namespace. Write verbs are exactly the calls the code makes; a resource the component reads
# gets get/list/watch (or get alone) as a set. The tests assert the manifests grant exactly this table.
Grant = tuple[str, str, str, str, str | None]
_POD_CACHE: set[Grant] = {(v, "", r, "cluster", None) for v in ("get", "list", "watch") for r in ("pods", "nodes")}


def _lease(namespace: str, name: str, *, create: bool = True) -> set[Grant]:
    # client-go and gpuplane.kube.lease: read, create once, then update (renew) one Lease.
    return {*({("create", "coordination.k8s.io", "leases", namespace, None)} if create else set()),
            ("get", "coordination.k8s.io", "leases", namespace, name),
            ("update", "coordination.k8s.io", "leases", namespace, name)}


def _scheduler_lease() -> tuple[str, str]:
    election = yaml.safe_load(_embedded_scheduler_config())["leaderElection"]
    return election.get("resourceNamespace", "kube-system"), election["resourceName"]


def _crd_resources() -> tuple[set[str], set[str]]:
    """(plurals, plurals with a status subresource) of the CRDs under deploy/crds."""
    plurals = {c["spec"]["names"]["plural"] for c in _crds() if c["spec"]["group"] == "gpuplane.io"}
    with_status = {c["spec"]["names"]["plural"] for c in _crds() if c["spec"]["group"] == "gpuplane.io"
                   and any("status" in v.get("subresources", {}) for v in c["spec"]["versions"])}
    return plurals, with_status


OPERATOR_CRS = {"gpupools", "tidalpolicies", "colocationpolicies", "queues"}
"""The operator's custom resources: deploy/crds must define exactly these."""

REQUIRED: dict[str, set[Grant]] = {
    # The extender (KubeCluster): informer cache (list+watch), the assignment annotations patched on the pod
    # before the bind, the bind itself (POST pods/<p>/binding), card-level preemption (POST pods/<p>/eviction),
    # and the GpuPools' settings (gpuplane.kube.pools.PoolSync: an informer on gpupools).
    # kube-scheduler's leader election on the Lease its config names: get/update by name here, `create` comes
    # with system:kube-scheduler, as does pods/status (KubeCluster.fail_pod, for a gang that timed out).
    "gpuplane-scheduler": _POD_CACHE | {
        ("patch", "", "pods", "cluster", None),
        ("create", "", "pods/binding", "cluster", None),
        ("create", "", "pods/eviction", "cluster", None),
        *{(v, "gpuplane.io", "gpupools", "cluster", None) for v in ("get", "list", "watch")},
    } | _lease(*_scheduler_lease(), create=False),
    # gpuplane.kube.operator: its policies (informers) and their status (PATCH .../status); the tidal controller
    # through KubeCluster: node patches (loan labels, taints), pod-deletion-cost patches before a scale-down,
    # evictions, PATCH deployments/<d>/scale. Its Lease (gpuplane.kube.lease: GET, POST, PUT).
    # Recovery and node health: the node agents' Events (informer, a patch marking each handled), a failed
    # gang's pods deleted for their owner to re-create. The idle policy (--idle-rule) POSTs its notices as core/v1
    # Events in the pod's namespace (KubeCluster.record_event).
    "gpuplane-operator": _POD_CACHE | {
        ("patch", "", "nodes", "cluster", None),
        ("patch", "", "pods", "cluster", None),
        ("delete", "", "pods", "cluster", None),
        *{(v, "", "events", "cluster", None) for v in ("get", "list", "watch", "patch", "create")},
        ("create", "", "pods/eviction", "cluster", None),
        ("get", "apps", "deployments/scale", "cluster", None),
        ("patch", "apps", "deployments/scale", "cluster", None),
        *{(v, "gpuplane.io", r, "cluster", None) for v in ("get", "list", "watch") for r in OPERATOR_CRS},
        *{("patch", "gpuplane.io", f"{r}/status", "cluster", None) for r in OPERATOR_CRS},
    } | _lease(NAMESPACE, "gpuplane-operator"),
    # The device plugin: its node's pods (fieldSelector at run time), their bind phase, its node's inventory, its
    # node's labels and the GpuPools (gpuplane.node.pool_follow: the split and MIG mode of the node's pool).
    # The guard (--from-pods): the same pods, its node's labels (a watch narrowed to it by fieldSelector), the
    # ColocationPolicies (gpuplane.node.node_policy).
    "gpuplane-node-agent": {
        *{(v, "", "pods", "cluster", None) for v in ("get", "list", "watch", "patch")},
        *{(v, "", "nodes", "cluster", None) for v in ("get", "list", "watch", "patch")},
        *{(v, "gpuplane.io", r, "cluster", None) for v in ("get", "list", "watch")
          for r in ("colocationpolicies", "gpupools")},
        # The reporter (gpuplane.node.reporter): POST core/v1 Events about its node, which live in `default`.
        ("create", "", "events", "default", None),
    },
    "gpuplane-webhook": set(),
    "gpuplane-scaler": set(),
}
# Built-in roles bound on top (documented in deploy/scheduler/rbac.yaml): what any kube-scheduler needs.
BUILTIN_ROLES: dict[str, set[tuple[str, str, str]]] = {
    "gpuplane-scheduler": {("ClusterRole", "system:kube-scheduler", "cluster"),
                           ("ClusterRole", "system:volume-scheduler", "cluster"),
                           ("Role", "extension-apiserver-authentication-reader", "kube-system")},
}
NO_API = {"gpuplane-webhook", "gpuplane-scaler"}


def _rbac(objects: list[tuple[Path, Doc]] | None = None
          ) -> tuple[dict[str, set[Grant]], dict[str, set[tuple[str, str, str]]]]:
    """Per ServiceAccount: the grants of roles defined under deploy/, and the roles bound that are not."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in _of_kind("ClusterRole", "Role", objects=objects)}
    grants: dict[str, set[Grant]] = {}
    builtin: dict[str, set[tuple[str, str, str]]] = {}
    for binding in _of_kind("ClusterRoleBinding", "RoleBinding", objects=objects):
        ref = binding["roleRef"]
        binding_ns = binding["metadata"].get("namespace")
        scope = "cluster" if binding["kind"] == "ClusterRoleBinding" else binding_ns
        role_ns = binding_ns if ref["kind"] == "Role" else None
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount", _id(DEPLOY, binding)
            assert subject["namespace"] == NAMESPACE, _id(DEPLOY, binding)
            sa = subject["name"]
            role = roles.get((ref["kind"], role_ns, ref["name"]))
            if role is None:
                builtin.setdefault(sa, set()).add((ref["kind"], ref["name"], scope))
                continue
            for rule in role.get("rules", []):
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            for name in rule.get("resourceNames") or [None]:
                                grants.setdefault(sa, set()).add((verb, group, resource, scope, name))
    return grants, builtin


def test_rbac_grants_exactly_what_the_code_uses() -> None:
    grants, _ = _rbac()
    for sa, required in REQUIRED.items():
        got = grants.get(sa, set())
        assert required - got == set(), f"{sa} lacks {sorted(required - got, key=str)}"
        assert got - required == set(), f"{sa} has more than it uses: {sorted(got - required, key=str)}"
    assert set(grants) <= set(REQUIRED), f"bindings for unknown accounts: {set(grants) - set(REQUIRED)}"


def test_only_the_documented_built_in_roles_are_bound() -> None:
    _, builtin = _rbac()
    assert builtin == BUILTIN_ROLES


def test_rbac_has_no_wildcards_and_no_secrets() -> None:
    for role in _of_kind("ClusterRole", "Role"):
        assert "aggregationRule" not in role
        for rule in role["rules"]:
            for key in ("verbs", "resources", "apiGroups", "resourceNames", "nonResourceURLs"):
                assert not any("*" in v for v in rule.get(key, [])), f"{role['metadata']['name']}: {key} {rule}"
            assert "secrets" not in rule["resources"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_the_operators_resources_are_the_crds_under_deploy() -> None:
    plurals, with_status = _crd_resources()
    assert plurals == OPERATOR_CRS
    assert with_status == OPERATOR_CRS, "the operator updates every resource's status subresource"
    config = _one("ValidatingWebhookConfiguration", "gpuplane-webhook")
    [cr_hook] = [w for w in config["webhooks"] if any("gpuplane.io" in r["apiGroups"] for r in w["rules"])]
    [rule] = cr_hook["rules"]
    assert set(rule["resources"]) == plurals
    served = {v["name"] for c in _crds() for v in c["spec"]["versions"] if v.get("served", True)}
    assert set(rule["apiVersions"]) == served


def test_lease_names_match_what_the_components_are_told() -> None:
    grants, _ = _rbac()
    namespace, name = _scheduler_lease()
    assert ("update", "coordination.k8s.io", "leases", namespace, name) in grants["gpuplane-scheduler"]
    operator = _one("Deployment", "gpuplane-operator")
    args = _containers(operator)[0]["args"]
    assert args[args.index("--namespace") + 1] == NAMESPACE
    lease = args[args.index("--lease-name") + 1]
    assert ("update", "coordination.k8s.io", "leases", NAMESPACE, lease) in grants["gpuplane-operator"]



def _operator_ledger(deployment: Doc, claims: Mapping[str, Doc]) -> list[str]:
    """What is wrong with how the operator Deployment books its accounting ledger (empty: nothing)."""
    [container] = _containers(deployment)
    _, *flags = container["args"]
    params = _CLI.commands["operator"].make_context("gpuplane operator", list(flags)).params  # type: ignore[attr-defined]
    ledger = params["ledger"]
    if ledger is None:
        return ["no --ledger: the ledger never runs"]
    spec = deployment["spec"]
    volumes = {v["name"]: v for v in spec["template"]["spec"].get("volumes", [])}
    path = Path(os.path.normpath(ledger))
    mounts = [m for m in container.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
    if not mounts:
        return [f"--ledger {ledger} is on no mounted volume"]
    mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the innermost mount holds the file
    problems = []
    if mount.get("readOnly"):
        problems.append(f"{mount['mountPath']} is mounted read-only")
    claim_name = volumes.get(mount["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
    if claim_name is None:
        return [*problems, f"volume {mount['name']} is no PersistentVolumeClaim: a restart loses the ledger"]
    claim = claims.get(claim_name)
    if claim is None:
        return [*problems, f"claim {claim_name} is not defined"]
    if claim["metadata"]["namespace"] != deployment["metadata"]["namespace"]:
        problems.append(f"claim {claim_name} is in another namespace")
    # One file for every replica: a ReadWriteOnce volume attaches to one node, so only one pod, and no
    # overlap while it is replaced (Recreate); ReadWriteMany lets the standby mount the same file.
    if "ReadWriteMany" not in claim["spec"]["accessModes"]:
        if spec.get("replicas", 1) != 1:
            problems.append(f"{spec['replicas']} replicas on a {claim['spec']['accessModes']} claim")
        if spec.get("strategy", {}).get("type") != "Recreate":
            problems.append("a rolling update starts a second pod on a ReadWriteOnce claim")
    pod_security = spec["template"]["spec"].get("securityContext", {})
    if pod_security.get("fsGroup") != pod_security.get("runAsGroup"):
        problems.append("no fsGroup: the volume is not writable by the operator's group")
    return problems


def test_the_operator_books_its_ledger_on_the_claim_every_replica_mounts() -> None:
    claims = {c["metadata"]["name"]: c for c in _of_kind("PersistentVolumeClaim")}
    operator = _one("Deployment", "gpuplane-operator")
    assert _operator_ledger(operator, claims) == []
    [container] = _containers(operator)
    args = container["args"]
    assert args[args.index("--ledger") + 1] == "/var/lib/gpuplane/ledger/ledger.jsonl"


def _with(doc: Doc, path: str, value: Any) -> Doc:
    """A deep copy of `doc` with the dotted `path` set to `value` (None: removed)."""
    import copy

    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = out
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) else last
    if value is None:
        del node[key]
    else:
        node[key] = value
    return out


_POD = "spec.template.spec"
_OPERATOR_LEDGER_BREAKS = [
    # (what is changed, the value, the problem reported)
    (f"{_POD}.containers.0.args", ["operator", "--health-port", "8081"], "no --ledger"),
    (f"{_POD}.containers.0.args", ["operator", "--ledger", "/tmp/../data/ledger.jsonl"], "on no mounted volume"),
    (f"{_POD}.containers.0.args", ["operator", "--ledger", "/tmp/ledger.jsonl"], "is no PersistentVolumeClaim"),
    (f"{_POD}.volumes.1.persistentVolumeClaim.claimName", "other", "claim other is not defined"),
    ("spec.replicas", 2, "2 replicas on a ['ReadWriteOnce'] claim"),
    ("spec.strategy", None, "a rolling update starts a second pod"),
    (f"{_POD}.securityContext.fsGroup", None, "no fsGroup"),
]


@pytest.mark.parametrize(("path", "value", "problem"), _OPERATOR_LEDGER_BREAKS,
                         ids=[p for _, _, p in _OPERATOR_LEDGER_BREAKS])
def test_the_ledger_check_catches_a_broken_deployment(path: str, value: Any, problem: str) -> None:
    claims = {c["metadata"]["name"]: c for c in _of_kind("PersistentVolumeClaim")}
    operator = _one("Deployment", "gpuplane-operator")
    assert [v["name"] for v in operator["spec"]["template"]["spec"]["volumes"]] == ["tmp", "ledger"]
    problems = _operator_ledger(_with(operator, path, value), claims)
    assert any(problem in p for p in problems), problems


def test_a_readwritemany_claim_allows_the_standby_replica() -> None:
    # ReadWriteMany storage, two replicas, a rolling update: what components/operator-ha-rwx makes of the shipped
    # objects (rendered below); here by hand, so that the check itself is seen to allow it.
    claims = {c["metadata"]["name"]: c for c in _of_kind("PersistentVolumeClaim")}
    rwx = {n: _with(c, "spec.accessModes", ["ReadWriteMany"]) for n, c in claims.items()}
    two = _with(_with(_one("Deployment", "gpuplane-operator"), "spec.replicas", 2), "spec.strategy", None)
    assert _operator_ledger(two, rwx) == []
    assert kubernetes_validate.validate(two, K8S_VERSION, strict=True) == K8S_VERSION


# ------------------------------------------------------------------ the operator on ReadWriteMany storage
def _operator_ha(objects: list[Doc]) -> list[str]:
    """What is wrong with the operator's two-replica form (empty: nothing): besides the ledger check, a standby
    always there to take the Lease, during a rollout (no replica stopped before its successor is up) and during a
    drain (a PodDisruptionBudget that selects the operator's pods and keeps one)."""
    claims = {d["metadata"]["name"]: d for d in objects if d["kind"] == "PersistentVolumeClaim"}
    [operator] = [d for d in objects if d["kind"] == "Deployment" and d["metadata"]["name"] == "gpuplane-operator"]
    problems = _operator_ledger(operator, claims)
    spec = operator["spec"]
    if spec.get("replicas", 1) < 2:
        problems.append(f"{spec.get('replicas', 1)} replica(s): no standby")
    strategy = spec.get("strategy", {"type": "RollingUpdate"})
    if strategy["type"] != "RollingUpdate":
        problems.append(f"strategy {strategy['type']}: every replica stops before a new one starts")
    elif strategy.get("rollingUpdate", {}).get("maxUnavailable", "25%") not in (0, "0%"):
        problems.append("maxUnavailable is not 0: a rollout may stop a replica before its successor is up")
    labels = spec["template"]["metadata"]["labels"]
    budgets = [d for d in objects if d["kind"] == "PodDisruptionBudget"
               and d["metadata"]["namespace"] == operator["metadata"]["namespace"]
               and d["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    if not any(b["spec"].get("minAvailable", 0) >= 1 for b in budgets):
        problems.append("no PodDisruptionBudget keeps one operator replica through a drain")
    anti = spec["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
    terms = [t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    terms += anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    if not any(t["topologyKey"] == "kubernetes.io/hostname"
               and t["labelSelector"]["matchLabels"].items() <= labels.items() for t in terms):
        problems.append("no anti-affinity spreads the replicas over nodes")
    return problems


def _key(d: Doc) -> tuple[str, str | None, str]:
    return d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]


@pytest.fixture(scope="module")
def operator_ha(tmp_path_factory: pytest.TempPathFactory) -> list[Doc]:
    return _render(["modes/extender", "components/operator-ha-rwx"], tmp_path_factory.mktemp("operator-ha"))


@pytest.fixture(scope="module")
def default_install(tmp_path_factory: pytest.TempPathFactory) -> list[Doc]:
    return _render(["modes/extender"], tmp_path_factory.mktemp("default"))


def test_the_operator_ha_component_names_every_file_it_has() -> None:
    component = yaml.safe_load((OPERATOR_HA / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["kind"] == "Component"
    assert _named_below(OPERATOR_HA) == {
        p.resolve() for p in _yaml_files(OPERATOR_HA) if p.name not in NOT_API_OBJECTS}


def test_the_operator_ha_component_validates_strictly(operator_ha: list[Doc], default_install: list[Doc]) -> None:
    before = {_key(d) for d in default_install}
    changed = [d for d in operator_ha if _key(d) not in before or d not in default_install]
    # the claim, the Deployment and the new PodDisruptionBudget; nothing else moves
    assert sorted(map(_key, changed)) == [("Deployment", NAMESPACE, "gpuplane-operator"),
                                          ("PersistentVolumeClaim", NAMESPACE, "gpuplane-operator-ledger"),
                                          ("PodDisruptionBudget", NAMESPACE, "gpuplane-operator")]
    assert {_key(d) for d in operator_ha} - before == {("PodDisruptionBudget", NAMESPACE, "gpuplane-operator")}
    for doc in changed:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, _key(doc)


def test_the_operator_ha_component_runs_two_replicas_on_one_readwritemany_ledger(operator_ha: list[Doc]) -> None:
    assert _operator_ha(operator_ha) == []
    [claim] = [d for d in operator_ha if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    [operator] = [d for d in operator_ha if _key(d) == ("Deployment", NAMESPACE, "gpuplane-operator")]
    assert operator["spec"]["replicas"] == 2
    # maxSurge 1, maxUnavailable 0: 2 + 1 pods at most during a rollout, never fewer than 2 ready
    assert operator["spec"]["strategy"] == {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    # the same --ledger, parsed by the CLI's own parser, on the same mount and claim as the shipped form
    [container] = _containers(operator)
    _, *flags = container["args"]
    params = _CLI.commands["operator"].make_context("gpuplane operator", list(flags)).params  # type: ignore[attr-defined]
    assert str(params["ledger"]) == "/var/lib/gpuplane/ledger/ledger.jsonl"
    assert params["lease_name"] == "gpuplane-operator"


def test_the_shipped_operator_is_not_the_ha_form(default_install: list[Doc]) -> None:
    # The same check fails the one-replica form on ReadWriteOnce storage, for its reasons.
    assert _operator_ha(default_install) == ["1 replica(s): no standby",
                                             "strategy Recreate: every replica stops before a new one starts",
                                             "no PodDisruptionBudget keeps one operator replica through a drain"]


_HA_BREAKS = [
    # (kind, what is changed, the value, the problem reported)
    ("PersistentVolumeClaim", "spec.accessModes", ["ReadWriteOnce"], "2 replicas on a ['ReadWriteOnce'] claim"),
    ("Deployment", "spec.replicas", 1, "1 replica(s): no standby"),
    ("Deployment", "spec.strategy.rollingUpdate.maxUnavailable", 1, "maxUnavailable is not 0"),
    ("Deployment", "spec.strategy.rollingUpdate", None, "maxUnavailable is not 0"),  # the default is 25 %
    ("PodDisruptionBudget", "spec.minAvailable", 0, "no PodDisruptionBudget"),
    ("PodDisruptionBudget", "spec.selector.matchLabels", {"app.kubernetes.io/name": "other"}, "no PodDisruption"),
    ("Deployment", f"{_POD}.affinity", None, "no anti-affinity"),
]


@pytest.mark.parametrize(("kind", "path", "value", "problem"), _HA_BREAKS, ids=[p for *_, p in _HA_BREAKS])
def test_the_ha_check_catches_a_broken_component(operator_ha: list[Doc], kind: str, path: str, value: Any,
                                                 problem: str) -> None:
    broken = [_with(d, path, value) if d["kind"] == kind and d["metadata"]["name"].startswith("gpuplane-operator")
              else d for d in operator_ha]
    problems = _operator_ha(broken)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("mode", ["modes/scheduler", "modes/dra", "modes/mixed"])
def test_the_operator_ha_component_goes_with_every_mode(mode: str, tmp_path: Path) -> None:
    assert _operator_ha(_render([mode, "components/operator-ha-rwx"], tmp_path)) == []


# Subresource calls as the code spells them (`pod_path(ns, name, "binding")`, f"{path}/scale") → the grant
# they need. A module under src/gpuplane/kube or src/gpuplane/node that makes such a call runs as a component
# that must hold the grant.
SUBRESOURCE_CALLS = {'"binding")': ("create", "pods/binding"), '"eviction")': ("create", "pods/eviction"),
                     '/scale"': ("patch", "deployments/scale")}


def test_every_subresource_the_code_calls_is_granted_to_some_component() -> None:
    grants, _ = _rbac()
    held = {(verb, resource) for g in grants.values() for verb, _, resource, _, _ in g}
    src = DEPLOY.parent / "src" / "gpuplane"
    sources = [f.read_text(encoding="utf-8") for d in ("kube", "node") for f in (src / d).rglob("*.py")]
    used = {call for call in SUBRESOURCE_CALLS if any(call in text for text in sources)}
    assert used, "no subresource call found: the patterns no longer match the code"
    for call in used:
        assert SUBRESOURCE_CALLS[call] in held, f"the code calls {call} but no component may"


def test_service_accounts_match_between_workloads_and_bindings() -> None:
    accounts = {d["metadata"]["name"]: d for d in _of_kind("ServiceAccount")}
    assert all(d["metadata"]["namespace"] == NAMESPACE for d in accounts.values())
    used = set()
    for w in _workloads():
        spec = w["spec"]["template"]["spec"]
        sa = spec["serviceAccountName"]
        used.add(sa)
        assert sa in accounts, f"{w['metadata']['name']}: ServiceAccount {sa} is not defined"
        assert sa in REQUIRED, f"{sa}: not in the RBAC table"
        if sa in NO_API:
            # No API use: no token in the pod at all.
            assert spec.get("automountServiceAccountToken") is False, sa
            assert accounts[sa].get("automountServiceAccountToken") is False, sa
    assert used == set(accounts) == set(REQUIRED)
    for binding in _of_kind("ClusterRoleBinding", "RoleBinding"):
        for subject in binding["subjects"]:
            assert subject["name"] in accounts, binding["metadata"]["name"]


# ------------------------------------------------------------------ commands, images, containers
_runner = CliRunner()
_CLI = typer.main.get_command(app)
_COMMANDS = [(w["metadata"]["name"], c) for w, c in _gpuplane_containers()]


@pytest.mark.parametrize(("workload", "container"), _COMMANDS, ids=[f"{w}/{c['name']}" for w, c in _COMMANDS])
def test_every_container_runs_a_real_gpuplane_command_with_real_flags(workload: str, container: Doc) -> None:
    _check_command(workload, container)


def _check_command(workload: str, container: Doc) -> None:
    assert container.get("command") == ["gpuplane"], f"{workload}/{container['name']}: command"
    subcommand, *flags = container["args"]
    commands = getattr(_CLI, "commands", {})
    assert subcommand in commands, f"{workload}/{container['name']}: `gpuplane {subcommand}` is no command"
    result = _runner.invoke(app, [subcommand, "--help"])
    assert result.exit_code == 0, result.output
    # Parse the container's arguments exactly as the CLI will: unknown flags, missing required options
    # and values of the wrong type fail here, not in the cluster.
    commands[subcommand].make_context(f"gpuplane {subcommand}", list(flags))
    for flag in (f for f in flags if f.startswith("--")):
        assert flag in result.output, f"{flag} is not in `gpuplane {subcommand} --help`"


def test_the_command_check_catches_a_misspelt_flag() -> None:
    with pytest.raises(Exception, match="No such option"):
        _CLI.commands["scaler"].make_context("gpuplane scaler", ["--config", "x.yaml", "--prot", "1"])  # type: ignore[attr-defined]


def _all_containers() -> list[tuple[str, Doc]]:
    return [(w["metadata"]["name"], c) for w in _workloads() for c in _containers(w)]


def test_images_are_pinned() -> None:
    for workload, c in _all_containers():
        image = c["image"]
        name, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (name and tag and "/" not in tag), f"{workload}/{c['name']}: {image} untagged"
        assert tag != "latest", f"{workload}/{c['name']}: {image}"
        assert c.get("imagePullPolicy") == "IfNotPresent"
        if image.startswith("ghcr.io/gpuplane/"):
            assert image == IMAGE


def _ports(c: Doc) -> set[int | str]:
    return {p for port in c.get("ports", []) for p in (port["containerPort"], port.get("name"))} - {None}


def test_every_container_has_requests_a_memory_limit_and_probes() -> None:
    for workload, c in _all_containers():
        where = f"{workload}/{c['name']}"
        resources = c.get("resources", {})
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
        assert "memory" in resources.get("limits", {}), where
        for probe_kind in ("livenessProbe", "readinessProbe"):
            probe = c.get(probe_kind)
            assert probe, f"{where}: no {probe_kind}"
            for handler in ("httpGet", "tcpSocket", "grpc"):
                if handler in probe:
                    assert probe[handler]["port"] in _ports(c), f"{where}: {probe_kind} port is not a container port"


NODE_AGENTS = ("gpuplane-node-agent", "gpuplane-node-agent-dra")
"""The node agent's DaemonSets: the one of every mode, and mixed mode's second one on its DRA nodes."""
# Containers that run as root, and why (the comments in the manifests say it in full), in either node agent.
ROOT = {(agent, container): why for agent in NODE_AGENTS for container, why in (
    ("device-plugin", "the kubelet's device-plugin socket directory is root's"),
    ("node-guard", "CAP_KILL is effective only for UID 0 in Kubernetes"),
    ("node-reporter", "its state file is in a hostPath directory the kubelet made root's"),
    ("dra-plugin", "kubelet's plugin registry and plugins directory are root's"))}
CAPABILITIES = {(agent, "node-guard"): ["KILL"] for agent in NODE_AGENTS}


def test_security_contexts_give_the_least_each_container_needs() -> None:
    _check_security_contexts(_workloads())


def _check_security_contexts(workloads: list[Doc]) -> None:
    for w in workloads:
        pod_sc = w["spec"]["template"]["spec"].get("securityContext", {})
        for c in _containers(w):
            key = (w["metadata"]["name"], c["name"])
            sc = {**pod_sc, **c.get("securityContext", {})}
            assert sc.get("allowPrivilegeEscalation") is False, key
            assert sc.get("readOnlyRootFilesystem") is True, key
            assert not sc.get("privileged", False), key
            assert sc["capabilities"]["drop"] == ["ALL"], key
            assert sc["capabilities"].get("add", []) == CAPABILITIES.get(key, []), key
            if key in ROOT:
                assert sc.get("runAsUser") == 0 and sc.get("runAsNonRoot") is False, key
            else:
                assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, key
    host_pid = {w["metadata"]["name"] for w in workloads if w["spec"]["template"]["spec"].get("hostPID")}
    # the guard's, and only there
    assert "gpuplane-node-agent" in host_pid
    assert host_pid == {w["metadata"]["name"] for w in workloads if w["metadata"]["name"] in NODE_AGENTS}


def _tolerates(tolerations: list[Doc], taint: Taint) -> bool:
    for t in tolerations:
        key_ok = t.get("key") in (None, taint.key) if t.get("operator") == "Exists" else t.get("key") == taint.key
        value_ok = t.get("operator") == "Exists" or t.get("value") == taint.value
        if key_ok and value_ok and t.get("effect") in (None, taint.effect):
            return True
    return False


def test_the_node_agent_runs_on_every_gpu_node_whatever_gpuplane_taints_it_with() -> None:
    ds = _one("DaemonSet", "gpuplane-node-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpuplane.io/gpu-node": "true"}
    assert spec["priorityClassName"] == "system-node-critical"
    for taint in (QUARANTINE_TAINT, LOAN_TAINT, Taint("nvidia.com/gpu", "present", "NoSchedule")):
        assert _tolerates(spec["tolerations"], taint), taint
    assert not _tolerates([{"key": "gpuplane.io/health", "operator": "Equal", "value": "ok"}], QUARANTINE_TAINT)


def test_the_device_plugin_gets_the_kubelet_directory_and_its_node_name() -> None:
    ds = _one("DaemonSet", "gpuplane-node-agent")
    spec = ds["spec"]["template"]["spec"]
    plugin = next(c for c in spec["containers"] if c["name"] == "device-plugin")
    directory = plugin["args"][plugin["args"].index("--dir") + 1]
    assert directory == "/var/lib/kubelet/device-plugins"  # protocols.md §2.1 DevicePluginPath
    [mount] = [m for m in plugin["volumeMounts"] if m["mountPath"] == directory]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == directory
    assert not mount.get("readOnly", False)  # it creates its socket there
    env = {e["name"]: e for e in plugin["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_device_plugin_sees_the_host_directories_it_hands_to_containers() -> None:
    ds = _one("DaemonSet", "gpuplane-node-agent")
    spec = ds["spec"]["template"]["spec"]
    plugin = next(c for c in spec["containers"] if c["name"] == "device-plugin")
    assert "--vgpu-dir" not in plugin["args"] and "--mps" not in plugin["args"]  # the defaults below apply
    settings = allocation.AllocationSettings()
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in plugin["volumeMounts"] if not m.get("readOnly")}
    # Allocate creates these on the host, then the kubelet mounts them into the container: same path both sides.
    for path in (settings.vgpu_dir, settings.lock_dir):
        assert mounted[path]["hostPath"]["path"] == path, path


def _exec_probe(workload: str, container: str, kind: str) -> list[str]:
    w = next(x for x in _workloads() if x["metadata"]["name"] == workload)
    c = next(x for x in _containers(w) if x["name"] == container)
    command: list[str] = c[kind]["exec"]["command"]
    return command


def _run_probe(command: list[str], old: str, new: str) -> int:
    """Run an exec probe here, with `old` (a path or address valid in the pod) replaced by `new`."""
    args = [sys.executable if a == "python3" else a.replace(old, new) for a in command]
    return subprocess.run(args, capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("kind", ["livenessProbe", "readinessProbe"])
def test_the_device_plugin_probe_passes_exactly_while_its_socket_exists(kind: str, tmp_path: Path) -> None:
    ds = _one("DaemonSet", "gpuplane-node-agent")
    plugin = next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "device-plugin")
    socket_path = f"{plugin['args'][plugin['args'].index('--dir') + 1]}/{device_plugin.ENDPOINT}"
    command = _exec_probe("gpuplane-node-agent", "device-plugin", kind)
    assert any(socket_path in a for a in command)
    here = tmp_path / device_plugin.ENDPOINT
    assert _run_probe(command, socket_path, str(here)) != 0  # no socket yet (or the kubelet deleted it)
    here.write_text("", encoding="utf-8")
    assert _run_probe(command, socket_path, str(here)) != 0  # a plain file is not a served socket
    here.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(here))
        assert _run_probe(command, socket_path, str(here)) == 0


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("kind", ["livenessProbe", "readinessProbe"])
def test_the_extender_probe_asks_the_extenders_healthz_on_loopback(kind: str) -> None:
    deployment = _one("Deployment", "gpuplane-scheduler")
    extender = next(c for c in _containers(deployment) if c["name"] == "extender")
    assert "--host" not in extender["args"]  # the default, 127.0.0.1: only this pod's kube-scheduler calls it
    address = f"127.0.0.1:{extender['args'][extender['args'].index('--port') + 1]}"
    command = _exec_probe("gpuplane-scheduler", "extender", kind)
    assert any(f"http://{address}/healthz" in a for a in command)
    for status, passes in ((200, True), (500, False)):
        handler = type("Handler", (_Health,), {"status": status})
        with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            try:
                rc = _run_probe(command, address, f"127.0.0.1:{server.server_address[1]}")
            finally:
                server.shutdown()
                thread.join()
        assert (rc == 0) is passes, status
    with socket.socket() as sock:  # a port nothing listens on: the extender is down
        sock.bind(("127.0.0.1", 0))
        assert _run_probe(command, address, f"127.0.0.1:{sock.getsockname()[1]}") != 0


def test_the_guard_and_scaler_configmaps_load_with_their_commands_own_loaders(tmp_path: Path) -> None:
    guard = tmp_path / "guard.yaml"
    guard.write_text(_one("ConfigMap", "gpuplane-node-guard")["data"]["guard.yaml"], encoding="utf-8")
    config = load_guard_config(guard)
    # The ConfigMap holds thresholds only: the guard takes its containers from the node's pods.
    assert not config.containers
    (guard_container,) = [c for c in _containers(_one("DaemonSet", "gpuplane-node-agent")) if c["name"] == "node-guard"]
    assert "--from-pods" in guard_container["args"]
    scaler = tmp_path / "scaler.yaml"
    scaler.write_text(_one("ConfigMap", "gpuplane-scaler")["data"]["scaler.yaml"], encoding="utf-8")
    assert load_scaler_config(scaler).scaled_objects
    # And the paths the commands are given are where the ConfigMaps are mounted.
    for workload, container, cm, key in (("gpuplane-node-agent", "node-guard", "gpuplane-node-guard", "guard.yaml"),
                                         ("gpuplane-scaler", "scaler", "gpuplane-scaler", "scaler.yaml")):
        w = next(x for x in _workloads() if x["metadata"]["name"] == workload)
        c = next(x for x in _containers(w) if x["name"] == container)
        path = c["args"][c["args"].index("--config") + 1]
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        assert mounted[str(Path(path).parent)]["configMap"]["name"] == cm
        assert Path(path).name == key


# ------------------------------------------------------------------ the node reporter
Call = tuple[str, str, str, str | None, str | None]
"""(verb, apiGroup, resource[/subresource], namespace or None, name or None) of one request an API server saw."""
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def _calls(server: FakeApiServer) -> set[Call]:
    """What a component asked of `server` (a FakeApiServer keeping its requests), as RBAC sees it: a GET of one
    object is `get`, of a collection `list`, and `watch` where the server counted a watch of that resource."""
    calls: set[Call] = set()
    for method, path, _ in server.requests:
        route = localapi.parse_route(path)
        resource = f"{route.plural}/{route.sub}" if route.sub else route.plural
        verb = ("get" if route.name else "list") if method == "GET" else _VERBS[method]
        calls.add((verb, route.group, resource, route.namespace, route.name or None))
    watched = {label.split()[1] for label in server.request_counts() if label.endswith("(watch)")}
    calls |= {("watch", g, r, ns, None) for v, g, r, ns, _ in calls if v == "list" and r in watched}
    return calls


def _granted(call: Call, grants: set[Grant]) -> bool:
    verb, group, resource, namespace, name = call
    return any(g[:3] == (verb, group, resource) and g[3] in ("cluster", namespace) and g[4] in (None, name)
               for g in grants)


def _ungranted(calls: set[Call], grants: set[Grant]) -> list[Call]:
    return sorted((c for c in calls if not _granted(c, grants)), key=str)


def _node_agent_container(name: str, objects: list[tuple[Path, Doc]] | None = None) -> tuple[Doc, Doc]:
    [ds] = [d for d in _of_kind("DaemonSet", objects=objects) if d["metadata"]["name"] == "gpuplane-node-agent"]
    [container] = [c for c in _containers(ds) if c["name"] == name]
    return ds["spec"]["template"]["spec"], container


def _host_path(spec: Doc, container: Doc, path: str, *, writable: bool) -> str:
    """Where `path` (inside `container`) is on the host: through the hostPath mount it lies under."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        if path == mount["mountPath"] or path.startswith(mount["mountPath"].rstrip("/") + "/"):
            assert mount.get("readOnly", False) is not writable, f"{path}: mounted readOnly={not writable} expected"
            host = volumes[mount["name"]]["hostPath"]["path"]
            return host.rstrip("/") + path[len(mount["mountPath"].rstrip("/")):]
    raise AssertionError(f"{path} is on no mount of {container['name']}")


def test_the_node_reporter_follows_the_hosts_kernel_log_and_keeps_its_state_on_the_host() -> None:
    from gpuplane.cli.node_reporter_cmd import STATE_FILE

    spec, reporter = _node_agent_container("node-reporter")
    args = reporter["args"]
    assert args[0] == "node-reporter" and "--once" not in args and "--from-start" not in args
    assert "--follow" not in args
    candidates = [args[i + 1] for i, a in enumerate(args) if a == "--kernel-log"]
    # rsyslog's files first (a node with both keeps the same kernel lines in each: one is read), then the journal
    assert [_host_path(spec, reporter, c, writable=False) for c in candidates] == [
        "/var/log/kern.log", "/var/log/messages", "/var/log/journal", "/run/log/journal"]
    state = _flag(reporter, "--state-file")
    assert state == str(STATE_FILE)  # the path docs/drills.md names, and the CLI's default
    assert _host_path(spec, reporter, state, writable=True) == str(STATE_FILE)
    # the guard's state_file is in the same host directory, under another name
    guard = yaml.safe_load(_one("ConfigMap", "gpuplane-node-guard")["data"]["guard.yaml"])["guard"]
    guard_state = guard["state_file"]
    assert Path(guard_state).parent == STATE_FILE.parent and Path(guard_state).name != STATE_FILE.name
    assert [args[i + 1] for i, a in enumerate(args) if a == "--check"] == ["nvml"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in reporter["env"] if "valueFrom" in e}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_NAME": "metadata.name"}  # the node; reportingInstance
    assert _flag(reporter, "--node-name") == "$(NODE_NAME)"
    port = int(_flag(reporter, "--health-port") or 0)
    assert port in _ports(reporter)
    assert {reporter[k]["httpGet"]["path"] for k in ("livenessProbe", "readinessProbe")} == {"/healthz"}
    sc = reporter["securityContext"]
    # root without a capability, in group adm (Ubuntu's kern.log is syslog:adm 0640)
    assert sc["runAsGroup"] == 4 and sc["seccompProfile"] == {"type": "RuntimeDefault"}


XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2417, GPU has fallen off the bus."


def test_the_node_reporter_with_its_manifests_args_makes_only_calls_its_rbac_grants(tmp_path: Path) -> None:
    # The container's own command line (its paths moved here, --once to end it) against a local API server
    # that logs each request: every request it made is one the node agent's roles allow.
    _, reporter = _node_agent_container("node-reporter")
    followed = reporter["args"][reporter["args"].index("--kernel-log") + 1]  # the first place looked at
    log = tmp_path / "kern.log"
    log.write_text(f"boot\n{XID_79}\n", encoding="utf-8")
    swap = {followed: str(log), _flag(reporter, "--state-file"): str(tmp_path / "state.json"),
            "$(NODE_NAME)": "gpu-7"}
    args = [swap.get(a, a) for a in reporter["args"]]
    i = args.index("--health-port")
    del args[i:i + 2]  # --once ends before serving it
    with FakeApiServer() as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        result = _runner.invoke(app, [*args, "--once", "--from-start", "--kubeconfig", str(kubeconfig)],
                                env={"POD_NAME": "gpuplane-node-agent-x"})
        assert result.exit_code == 0, result.output
        assert "gpu-7: 1 report(s) posted" in result.output
        calls = _calls(server)
    assert calls == {("create", "", "events", "default", None)}
    grants, _ = _rbac()
    assert _ungranted(calls, grants["gpuplane-node-agent"]) == []


# ------------------------------------------------------------------ services and the webhook
def test_services_select_a_workload_and_target_its_ports() -> None:
    for svc in _of_kind("Service"):
        selector = svc["spec"]["selector"]
        matches = [w for w in _workloads()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, svc["metadata"]["name"]
        ports = set().union(*(_ports(c) for c in _containers(matches[0])))
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{svc['metadata']['name']}: {port}"


def _container_port(workload: str, container: str, name: str) -> int:
    w = next(x for x in _workloads() if x["metadata"]["name"] == workload)
    c = next(x for x in _containers(w) if x["name"] == container)
    port: int = next(p["containerPort"] for p in c["ports"] if p["name"] == name)
    return port


def test_the_webhook_configuration_reaches_the_webhook() -> None:
    config = _one("ValidatingWebhookConfiguration", "gpuplane-webhook")
    service = _one("Service", "gpuplane-webhook")
    deployment = _one("Deployment", "gpuplane-webhook")
    args = _containers(deployment)[0]["args"]
    for hook in config["webhooks"]:
        ref = hook["clientConfig"]["service"]
        assert (ref["name"], ref["namespace"], ref["path"]) == ("gpuplane-webhook", NAMESPACE, "/validate")
        [port] = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]]
        assert _container_port("gpuplane-webhook", "webhook", port["targetPort"]) == int(args[args.index("--port") + 1])
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["failurePolicy"] == "Fail"
    [pods] = [h for h in config["webhooks"] if any(r["resources"] == ["pods"] for r in h["rules"])]
    assert pods["rules"] == [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    [selector] = pods["namespaceSelector"]["matchExpressions"]
    assert selector["key"] == "kubernetes.io/metadata.name" and selector["operator"] == "NotIn"
    assert set(selector["values"]) == {"kube-system", NAMESPACE}
    # The TLS secret the webhook mounts is the one make-certs.sh writes.
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "gpuplane-webhook-tls"}} in volumes


def _pod_conditions() -> dict[str, str]:
    config = _one("ValidatingWebhookConfiguration", "gpuplane-webhook")
    [pods] = [h for h in config["webhooks"] if any(r["resources"] == ["pods"] for r in h["rules"])]
    return {c["name"]: c["expression"] for c in pods["matchConditions"]}


def test_match_conditions_name_the_scheduler_annotations_resources_and_account() -> None:
    conditions = _pod_conditions()
    assert set(conditions) == {"not-the-scheduler", "scheduler-annotations-or-gpuplane-resources"}
    literals = set(_cel_literals(conditions["scheduler-annotations-or-gpuplane-resources"]))
    assert literals == SCHEDULER_ANNOTATIONS | {"CREATE", "gpuplane.io/"}
    assert all(name.startswith("gpuplane.io/") for name in MANAGED_RESOURCES)  # what wants_gpu looks for
    # Only the scheduler is exempt: the node agent's writes reach the webhook, which lets it change bind-phase
    # alone. The webhook trusts the same account (its default; the Deployment does not override it).
    assert _cel_literals(conditions["not-the-scheduler"]) == [SCHEDULER]
    assert webhook.DEFAULT_SCHEDULER_ACCOUNT == SCHEDULER
    assert webhook.DEFAULT_DEVICE_PLUGIN_ACCOUNT == NODE_AGENT
    args = _containers(_one("Deployment", "gpuplane-webhook"))[0]["args"]
    assert "--scheduler-account" not in args and "--device-plugin-account" not in args


def test_match_conditions_guard_every_has_with_its_parent() -> None:
    # CEL's has(a.b.c) still evaluates a.b, an error when b is absent; with failurePolicy Fail an error is a
    # refusal. cel-python answers false there instead, so the evaluation below cannot see a missing guard:
    # each has() must have its parent guarded by a has() too, unless the parent is a variable or the
    # metadata every object has. (So each comprehension names its variable differently.)
    always_there = {"object.metadata", "oldObject.metadata"}
    for name, expression in _pod_conditions().items():
        guarded = set(re.findall(r"has\(([\w.]+)\)", expression))
        for path in guarded:
            parent = path.rpartition(".")[0]
            assert "." not in parent or parent in always_there or parent in guarded, f"{name}: has({path})"


A = "gpuplane.io/assignment"
P = "gpuplane.io/bind-phase"
USER = "system:serviceaccount:team-a:default"
SCHEDULER = f"system:serviceaccount:{NAMESPACE}:gpuplane-scheduler"
NODE_AGENT = f"system:serviceaccount:{NAMESPACE}:gpuplane-node-agent"


def _pod(annotations: Mapping[str, str] | None, spec: Doc | None = None) -> Doc:
    meta: Doc = {"name": "p", "namespace": "team-a"}
    if annotations is not None:
        meta["annotations"] = dict(annotations)
    pod: Doc = {"metadata": meta}
    if spec is not None:
        pod["spec"] = spec
    return pod


def _asking(part: str, resources: Mapping[str, str], *, init: bool = False) -> Doc:
    """A pod spec whose container (or initContainer) has `resources` under `part` (limits or requests)."""
    asking = {"name": "c", "image": "x", "resources": {part: dict(resources)}}
    plain = {"name": "main", "image": "x"}
    return {"initContainers": [asking], "containers": [plain]} if init else {"containers": [plain, asking]}


GPU = {RES_GPU: "1"}
CPU = {"cpu": "2", "memory": "1Gi"}
# (operation, user, old annotations, new annotations, new spec) → does the API server call the webhook?
MATCH_CASES = [
    ("CREATE", USER, None, None, None, False),                         # no annotations, no spec: has() guards
    ("CREATE", USER, None, None, {}, False),                           # no containers (has() guards)
    ("CREATE", USER, None, None, {"containers": [{"name": "c", "image": "x"}]}, False),  # no resources at all
    ("CREATE", USER, None, None, {"containers": [{"name": "c", "image": "x", "resources": {}}]}, False),
    ("CREATE", USER, None, None, _asking("limits", CPU), False),       # only cpu/memory: a plain pod
    ("CREATE", USER, None, None, _asking("requests", CPU), False),     # (limits or requests absent: has())
    ("CREATE", USER, None, None, _asking("limits", CPU, init=True), False),
    ("CREATE", USER, None, None, _asking("requests", CPU, init=True), False),
    ("CREATE", USER, None, {"gpuplane.io/qos": "online"}, None, False),  # a user's own gpuplane annotation
    ("CREATE", USER, None, None, _asking("limits", GPU), True),        # asks for a card: the request is judged
    ("CREATE", USER, None, None, _asking("requests", {"gpuplane.io/gpumem": "4096"}), True),
    ("CREATE", USER, None, None, _asking("limits", GPU, init=True), True),  # in an initContainer
    ("CREATE", USER, None, None, _asking("requests", {**CPU, **GPU}, init=True), True),
    ("CREATE", USER, None, {A: "forged"}, None, True),                 # a forged assignment: judged
    ("CREATE", USER, None, {P: "allocated"}, _asking("limits", CPU), True),
    ("UPDATE", USER, {A: "x"}, {A: "x", "team": "b"}, None, False),    # assignment untouched
    ("UPDATE", USER, {A: "x"}, {A: "x"}, _asking("limits", GPU), False),  # UPDATE: resources do not matter
    ("UPDATE", USER, {}, {A: "forged"}, None, True),                   # added
    ("UPDATE", USER, None, {A: "forged"}, None, True),                 # added to a pod with no annotations
    ("UPDATE", USER, {A: "x"}, {A: "y"}, None, True),                  # changed
    ("UPDATE", USER, {A: "x"}, {}, None, True),                        # removed: the card would look free
    ("UPDATE", USER, {A: "x"}, None, None, True),                      # removed with every annotation
    ("UPDATE", USER, {P: "allocating"}, {P: "allocated"}, None, True),
    # The scheduler writes every annotation unjudged; the node agent is judged (the webhook lets it change
    # bind-phase alone), so the node agent cannot rewrite an assignment past the webhook.
    ("CREATE", SCHEDULER, None, {A: "x"}, _asking("limits", GPU), False),
    ("UPDATE", SCHEDULER, {P: "allocating"}, {A: "x", P: "allocating"}, None, False),
    ("UPDATE", NODE_AGENT, {P: "allocating"}, {P: "allocated"}, None, True),
    ("UPDATE", NODE_AGENT, {A: "x", P: "allocating"}, {A: "y", P: "allocating"}, None, True),
    ("UPDATE", NODE_AGENT, {A: "x"}, {A: "x", "team": "b"}, None, False),
]


@pytest.mark.parametrize(("operation", "user", "old", "new", "spec", "called"), MATCH_CASES)
def test_the_webhook_is_called_exactly_for_the_requests_it_judges(
        operation: str, user: str, old: Mapping[str, str] | None, new: Mapping[str, str] | None,
        spec: Doc | None, called: bool) -> None:
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the matchConditions")
    env = celpy.Environment()
    activation = {"request": celpy.json_to_cel({"operation": operation, "userInfo": {"username": user}}),
                  "object": celpy.json_to_cel(_pod(new, spec)),
                  "oldObject": celpy.json_to_cel(_pod(old) if operation == "UPDATE" else None)}
    results = [env.program(env.compile(expr)).evaluate(activation) for expr in _pod_conditions().values()]
    # An evaluation error is no answer: with failurePolicy Fail the API server would refuse the request.
    assert all(isinstance(r, celpy.celtypes.BoolType) for r in results), results
    assert all(results) is called  # the API server calls the webhook only when every condition holds

    # The webhook's own rules agree: whatever it would refuse is sent to it, except the scheduler's requests,
    # which are trusted (the scheduler creates no pods; it only annotates them).
    review = {"apiVersion": webhook.REVIEW_API_VERSION, "kind": "AdmissionReview",
              "request": {"uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": operation,
                          "userInfo": {"username": user}, "object": _pod(new, spec),
                          **({"oldObject": _pod(old)} if operation == "UPDATE" else {})}}
    if user != SCHEDULER and not webhook.AdmissionPolicy().review(review)["response"]["allowed"]:
        assert called


def test_make_certs_writes_a_secret_and_a_ca_bundle_that_verify(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    # kubectl stands in for the cluster: it records what the script would send.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {tmp_path}/calls
        case "$*" in
          *"create secret"*) while [ $# -gt 0 ]; do [ "$1" = --cert ] && cp "$2" {tmp_path}/tls.crt; shift; done;;
          apply*) cat > {tmp_path}/applied;;
          patch*) echo "$@" > {tmp_path}/patch;;
        esac
        """), encoding="utf-8")
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DAYS": "2"}
    subprocess.run(["bash", str(DEPLOY / "webhook" / "make-certs.sh")], env=env, check=True,
                   capture_output=True, timeout=60)
    calls = (tmp_path / "calls").read_text(encoding="utf-8")
    assert f"-n {NAMESPACE} create secret tls gpuplane-webhook-tls" in calls
    patch = (tmp_path / "patch").read_text(encoding="utf-8")
    assert "validatingwebhookconfiguration gpuplane-webhook" in patch
    bundles = re.findall(r'"path": "/webhooks/(\d)/clientConfig/caBundle", "value": "([^"]+)"', patch)
    webhooks = _one("ValidatingWebhookConfiguration", "gpuplane-webhook")["webhooks"]
    assert [int(i) for i, _ in bundles] == list(range(len(webhooks)))
    ca = tmp_path / "ca.crt"
    ca.write_bytes(base64.b64decode(bundles[0][1]))
    host = f"gpuplane-webhook.{NAMESPACE}.svc"
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(ca), "-verify_hostname", host,
                             "-purpose", "sslserver", str(tmp_path / "tls.crt")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


# ------------------------------------------------------------------ priorities
def test_priority_classes_are_the_models_defaults() -> None:
    objects = {d["metadata"]["name"]: d for d in _of_kind("PriorityClass")}
    model = {c.name: c for c in default_priority_classes()}
    assert set(objects) == set(model)
    for name, cls in model.items():
        obj = objects[name]
        assert obj["value"] == cls.value
        assert obj["preemptionPolicy"] == cls.preemption_policy.value
        assert obj["description"] == cls.description
        assert obj.get("globalDefault", False) is False


# ------------------------------------------------------------------ kustomization
def _listed(kustomization: Path) -> set[Path]:
    """The files a kustomization reaches, following directories that have their own kustomization."""
    files: set[Path] = set()
    doc = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
    for entry in [*doc["resources"], *doc.get("components", [])]:
        target = (kustomization.parent / entry).resolve()
        assert target.exists(), f"{kustomization}: {entry} does not exist"
        if target.is_dir():
            files |= _listed(target / "kustomization.yaml")
        else:
            files.add(target)
    return files


def test_the_kustomization_lists_every_manifest() -> None:
    manifests = {p.resolve() for p in _yaml_files() if p.name not in NOT_API_OBJECTS}
    listed = _listed(DEPLOY / "kustomization.yaml")
    assert manifests - listed == set(), f"not in kustomization.yaml: {sorted(map(str, manifests - listed))}"
    assert listed - manifests == set()


def test_kustomize_renders_every_object() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    rendered = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d is not None]
    assert sorted(_id(DEPLOY, d) for d in docs) == sorted(_id(DEPLOY, d) for _, d in OBJECTS)


# ------------------------------------------------------------------ scheduler mode (deploy/modes/scheduler)
def _scheduler_mode_objects() -> list[tuple[Path, Doc]]:
    """The install with modes/scheduler in place of modes/extender: the default's objects without extender
    mode's scheduler pod (deploy/scheduler/), plus scheduler mode's."""
    kept = [(p, d) for p, d in OBJECTS if EXTENDER_MODE not in p.parents]
    return kept + [(p, d) for p in _yaml_files(SCHEDULER_MODE) if p.name not in NOT_API_OBJECTS for d in _load(p)]


SCHEDULER_MODE_OBJECTS = _scheduler_mode_objects()
SCHEDULER_LEASE = ("gpuplane-system", "gpuplane-scheduler")
# gpuplane.kube.scheduler_mode over KubeCluster: the pod and node caches (a pod read again by name when a refused
# bind's assignment is taken back), the assignment and eviction-reason patches, the Binding, evictions (the API
# server applies the disruption budgets), pods/status (PodScheduled, nominatedNodeName, a timed-out gang),
# events.k8s.io events, the informers of gpuplane.kube.declarations, and its own Lease (GET, POST, PUT). No
# built-in role: it is not a kube-scheduler.
SCHEDULER_MODE_REQUIRED: set[Grant] = _POD_CACHE | {
    ("patch", "", "pods", "cluster", None),
    ("create", "", "pods/binding", "cluster", None),
    ("create", "", "pods/eviction", "cluster", None),
    ("patch", "", "pods/status", "cluster", None),
    ("create", "events.k8s.io", "events", "cluster", None),
    *{(v, "gpuplane.io", r, "cluster", None) for v in ("get", "list", "watch") for r in ("queues", "gpupools")},
    *{(v, "scheduling.x-k8s.io", "podgroups", "cluster", None) for v in ("get", "list", "watch")},
} | _lease(*SCHEDULER_LEASE)


def _scheduler_mode_deployment() -> Doc:
    [deployment] = [d for d in _of_kind("Deployment", objects=SCHEDULER_MODE_OBJECTS)
                    if d["metadata"]["name"] == "gpuplane-scheduler"]
    return deployment


@pytest.mark.parametrize(("path", "doc"), [(p, d) for p, d in SCHEDULER_MODE_OBJECTS if SCHEDULER_MODE in p.parents],
                         ids=[_id(p, d) for p, d in SCHEDULER_MODE_OBJECTS if SCHEDULER_MODE in p.parents])
def test_scheduler_modes_objects_validate_against_the_kubernetes_schema(path: Path, doc: Doc) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_scheduler_mode_grants_exactly_what_gpuplane_scheduler_uses_and_nothing_else_changes() -> None:
    grants, builtin = _rbac(SCHEDULER_MODE_OBJECTS)
    got = grants["gpuplane-scheduler"]
    assert SCHEDULER_MODE_REQUIRED - got == set(), f"lacks {sorted(SCHEDULER_MODE_REQUIRED - got, key=str)}"
    extra = got - SCHEDULER_MODE_REQUIRED
    assert extra == set(), f"more than it uses: {sorted(extra, key=str)}"
    assert "gpuplane-scheduler" not in builtin  # none of kube-scheduler's roles
    default, _ = _rbac()
    assert {sa: g for sa, g in grants.items() if sa != "gpuplane-scheduler"} == \
           {sa: g for sa, g in default.items() if sa != "gpuplane-scheduler"}


def test_scheduler_modes_informers_are_the_ones_it_may_list_and_watch() -> None:
    # Derived from the code: every informer gpuplane.kube.declarations opens is on a granted (group, resource).
    from gpuplane.kube.declarations import Declarations
    from gpuplane.model import default_catalog

    declarations = Declarations(None, default_catalog())  # type: ignore[arg-type]  # no call before start()
    for informer in declarations.informers.values():
        parts = informer.path.strip("/").split("/")
        group, resource = ("", parts[2]) if parts[0] == "api" else (parts[1], parts[3])
        for verb in ("list", "watch"):
            assert (verb, group, resource, "cluster", None) in SCHEDULER_MODE_REQUIRED, informer.path
    src = DEPLOY.parent / "src" / "gpuplane" / "kube"
    mode = (src / "scheduler_mode.py").read_text(encoding="utf-8")
    assert 'pod_path(namespace, name, "status")' in mode  # PodScheduled / nominatedNodeName → pods/status patch
    assert "/events" in mode and "api.create(" in mode      # events.k8s.io events → create


def test_scheduler_mode_runs_gpuplane_scheduler_on_its_lease_with_two_replicas() -> None:
    deployment = _scheduler_mode_deployment()
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "gpuplane-scheduler"
    [container] = spec["containers"]
    assert container["image"] == IMAGE and container["command"] == ["gpuplane"]
    subcommand, *flags = container["args"]
    assert subcommand == "scheduler"
    # Parsed exactly as the CLI will: an unknown flag or a value of the wrong type fails here.
    _CLI.commands["scheduler"].make_context("gpuplane scheduler", list(flags))  # type: ignore[attr-defined]
    assert "--leader-elect" in flags
    lease = (flags[flags.index("--lease-namespace") + 1], flags[flags.index("--lease-name") + 1])
    assert lease == SCHEDULER_LEASE
    from gpuplane.kube.scheduler_mode import DEFAULT_SCHEDULER_NAME

    assert flags[flags.index("--scheduler-name") + 1] == DEFAULT_SCHEDULER_NAME
    assert container["livenessProbe"]["httpGet"]["port"] in _ports(container)
    assert container["readinessProbe"]["httpGet"]["port"] in _ports(container)
    assert int(flags[flags.index("--health-port") + 1]) in _ports(container)
    assert {e["name"] for e in container["env"]} == {"POD_NAME"}  # the Lease holder identity
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and "memory" in container["resources"]["limits"]
    sc = {**spec["securityContext"], **container["securityContext"]}
    assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}


def test_scheduler_mode_leaves_out_every_piece_of_extender_mode() -> None:
    names = {(d["kind"], d["metadata"]["name"]) for _, d in SCHEDULER_MODE_OBJECTS}
    assert ("ConfigMap", "gpuplane-scheduler-config") not in names
    images = {c["image"] for d in _of_kind("Deployment", objects=SCHEDULER_MODE_OBJECTS) for c in _containers(d)}
    assert not any("kube-scheduler" in i for i in images)
    accounts = {d["metadata"]["name"] for d in _of_kind("ServiceAccount", objects=SCHEDULER_MODE_OBJECTS)}
    assert accounts == {d["metadata"]["name"] for d in _of_kind("ServiceAccount")}  # one gpuplane-scheduler


def test_the_default_install_names_exactly_one_mode() -> None:
    root = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))
    assert root["components"] == ["modes/extender"]
    for mode in ("extender", "scheduler", "dra", "mixed"):
        component = yaml.safe_load((DEPLOY / "modes" / mode / "kustomization.yaml").read_text(encoding="utf-8"))
        assert component["kind"] == "Component"
    assert _listed(SCHEDULER_MODE / "kustomization.yaml") == {
        p.resolve() for p in _yaml_files(SCHEDULER_MODE) if p.name not in NOT_API_OBJECTS}


def test_kustomize_renders_scheduler_mode(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    root = copy / "kustomization.yaml"
    root.write_text(root.read_text(encoding="utf-8").replace("  - modes/extender\n", "  - modes/scheduler\n"),
                    encoding="utf-8")
    rendered = subprocess.run([kubectl, "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d is not None]
    key = lambda d: (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, docs)) == sorted(key(d) for _, d in SCHEDULER_MODE_OBJECTS)


# ------------------------------------------------------------------ metrics and their scraping
def _flag(container: Doc, flag: str) -> str | None:
    args = container.get("args", [])
    return str(args[args.index(flag) + 1]) if flag in args else None


def _metrics_containers(objects: list[tuple[Path, Doc]]) -> list[tuple[Doc, Doc, int]]:
    """(workload, container, port) of every gpuplane container serving metrics: `--metrics-port`, or the node
    exporter's `--port`."""
    out = []
    for w in _of_kind("Deployment", "DaemonSet", objects=objects):
        for c in _containers(w):
            port = _flag(c, "--metrics-port") or (_flag(c, "--port") if c.get("args", [])[:1] == ["node-exporter"]
                                               else None)
            if port is not None:
                out.append((w, c, int(port)))
    return out


@pytest.mark.parametrize("objects", [OBJECTS, SCHEDULER_MODE_OBJECTS], ids=["extender mode", "scheduler mode"])
def test_every_metrics_port_is_a_container_port_behind_a_headless_service(objects: list[tuple[Path, Doc]]) -> None:
    served = _metrics_containers(objects)
    # The scheduler pod (either mode), the scaler, the node agent's exporter and guard.
    assert {(w["metadata"]["name"], c["name"]) for w, c, _ in served} >= {
        ("gpuplane-scheduler", "extender" if objects is OBJECTS else "scheduler"), ("gpuplane-scaler", "scaler"),
        ("gpuplane-node-agent", "node-exporter"), ("gpuplane-node-agent", "node-guard")}
    services = _of_kind("Service", objects=objects)
    for w, c, port in served:
        where = f"{w['metadata']['name']}/{c['name']}"
        names = [p["name"] for p in c.get("ports", []) if p["containerPort"] == port]
        assert len(names) == 1, f"{where}: metrics port {port} is not a named container port"
        labels = w["spec"]["template"]["metadata"]["labels"]
        targets = [(svc, p) for svc in services if svc["spec"]["selector"].items() <= labels.items()
                   for p in svc["spec"]["ports"] if p["targetPort"] == names[0]]
        assert targets, f"{where}: no Service targets {names[0]}"
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in annotations:
            assert annotations["prometheus.io/port"] == str(port), where  # one metrics container there
            assert annotations["prometheus.io/scrape"] == "true"


def test_the_scheduler_pod_serves_metrics_on_the_same_port_and_service_in_both_modes() -> None:
    def metrics_of(objects: list[tuple[Path, Doc]]) -> tuple[int, Doc]:
        [(_, _, port)] = [x for x in _metrics_containers(objects) if x[0]["metadata"]["name"] == "gpuplane-scheduler"]
        [service] = [s for s in _of_kind("Service", objects=objects)
                     if s["metadata"]["name"] == "gpuplane-scheduler-metrics"]
        return port, service

    (port, extender), (same, scheduler) = metrics_of(OBJECTS), metrics_of(SCHEDULER_MODE_OBJECTS)
    assert port == same
    assert extender["spec"]["clusterIP"] == scheduler["spec"]["clusterIP"] == "None"  # one target per replica
    # Extender mode adds kube-scheduler's own HTTPS metrics port (job kube-scheduler).
    assert {p["name"] for p in extender["spec"]["ports"]} == {"metrics", "kube-scheduler"}
    assert {p["name"] for p in scheduler["spec"]["ports"]} == {"metrics"}


def test_the_extender_observes_while_the_lease_kube_scheduler_is_configured_with_is_its() -> None:
    # Two replicas each run an extender: only the one beside the leading kube-scheduler may count the cluster,
    # so the Lease it follows must be the one kube-scheduler's configuration names.
    deployment = _one("Deployment", "gpuplane-scheduler")
    assert deployment["spec"]["replicas"] == 2
    extender = next(c for c in _containers(deployment) if c["name"] == "extender")
    assert _flag(extender, "--observe") in (None, "leading")
    params = {p.name: p for p in _CLI.commands["extender"].params}  # type: ignore[attr-defined]
    followed = _flag(extender, "--kube-scheduler-lease") or params["kube_scheduler_lease"].default
    config = yaml.safe_load(SCHEDULER_CONFIG.read_text(encoding="utf-8"))["leaderElection"]
    assert followed == f"{config['resourceNamespace']}/{config['resourceName']}"
    assert config["leaderElect"] is True and config["resourceLock"] == "leases"
    # and it may read that Lease (the role kube-scheduler renews it with).
    grants, _ = _rbac()
    assert ("get", "coordination.k8s.io", "leases", config["resourceNamespace"], config["resourceName"]) in \
        grants["gpuplane-scheduler"]


def _scrape_jobs() -> dict[str, tuple[str, str]]:
    """job name -> (Service name, port name) its keep rule selects."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    jobs = {}
    for job in config["scrape_configs"]:
        [sd] = job["kubernetes_sd_configs"]
        assert sd == {"role": "endpoints", "namespaces": {"names": [NAMESPACE]}}, job["job_name"]
        [keep] = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        assert keep["source_labels"] == ["__meta_kubernetes_service_name", "__meta_kubernetes_endpoint_port_name"]
        service, port = keep["regex"].split(";")
        jobs[job["job_name"]] = (service, port)
    return jobs


def test_the_scrape_jobs_are_the_ones_the_rules_name_and_reach_real_services() -> None:
    jobs = _scrape_jobs()
    doc = (DEPLOY.parent / "docs" / "monitoring.md").read_text(encoding="utf-8")
    table = doc.split("## Scraping", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z-]+)` \|", table, re.M))
    others = {"dcgm-exporter", "kube-state-metrics"}  # their own charts scrape them
    assert set(jobs) == documented - others
    alerts = (DEPLOY / "monitoring" / "rules" / "gpuplane-alerts.yaml").read_text(encoding="utf-8")
    watched = re.search(r'up\{job=~"([^"]+)"\}', alerts)
    assert watched is not None
    assert all(re.fullmatch(watched.group(1), job) for job in jobs if job != "kube-scheduler")
    reached = set()
    for objects in (OBJECTS, SCHEDULER_MODE_OBJECTS):
        for svc in _of_kind("Service", objects=objects):
            reached |= {(svc["metadata"]["name"], p["name"]) for p in svc["spec"]["ports"]}
    missing = {job for job, target in jobs.items() if target not in reached}
    # The operator does not serve metrics yet (gpuplane operator has no --metrics-port): its job finds no target.
    assert missing == {"gpuplane-operator"}


# ------------------------------------------------------------------ DRA mode (deploy/modes/dra)
def _render(components: list[str], tmp: Path) -> list[Doc]:
    """`kubectl kustomize` of deploy/ with `components` in place of modes/extender."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is needed to render DRA mode's patches (scripts/test installs it)"
    copy = tmp / "deploy"
    shutil.copytree(DEPLOY, copy)
    root = copy / "kustomization.yaml"
    listed = "".join(f"  - {c}\n" for c in components)
    root.write_text(root.read_text(encoding="utf-8").replace("  - modes/extender\n", listed), encoding="utf-8")
    rendered = subprocess.run([kubectl, "kustomize", str(copy)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    return [d for d in yaml.safe_load_all(rendered.stdout) if d is not None]


@pytest.fixture(scope="module")
def dra_objects(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Doc]]:
    return [(DRA_MODE / "rendered", d) for d in _render(["modes/dra"], tmp_path_factory.mktemp("dra"))]


def _key(doc: Doc) -> tuple[str, str | None, str]:
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]


DRA_NEW = {("ClusterRole", None, "gpuplane-node-agent-dra"), ("ClusterRoleBinding", None, "gpuplane-node-agent-dra"),
           ("ClusterRole", None, "gpuplane-scheduler-dra"), ("ClusterRoleBinding", None, "gpuplane-scheduler-dra"),
           ("ValidatingAdmissionPolicy", None, "gpuplane-node-agent-resourceslices"),
           ("ValidatingAdmissionPolicyBinding", None, "gpuplane-node-agent-resourceslices")}
_READ = ("get", "list", "watch")
# The node agent without its device plugin: the guard's reads (pods and its node; `get` of the Node also gives the
# slices their owner), the reporter's Events, and the DRA driver's calls (the GpuPools and its node's labels for the
# split and MIG mode; gpuplane.node.dra_plugin reads the claim kubelet names; gpuplane.node.dra_slices.
# publish_slices lists, creates, patches and deletes its node's slices).
DRA_NODE_AGENT: set[Grant] = {
    *{(v, "", r, "cluster", None) for v in _READ for r in ("pods", "nodes")},
    *{(v, "gpuplane.io", r, "cluster", None) for v in _READ for r in ("colocationpolicies", "gpupools")},
    ("create", "", "events", "default", None),
    ("get", "resource.k8s.io", "resourceclaims", "cluster", None),
    *{(v, "resource.k8s.io", "resourceslices", "cluster", None) for v in ("list", "create", "patch", "delete")},
}
# gpuplane-scheduler --dra: scheduler mode's calls, and gpuplane.kube.dra's informers on slices, classes and claims,
# a claim read again after a conflict, its status patched (allocation, reservedFor).
DRA_SCHEDULER: set[Grant] = SCHEDULER_MODE_REQUIRED | {
    *{(v, "resource.k8s.io", r, "cluster", None) for v in _READ
      for r in ("resourceslices", "deviceclasses", "resourceclaims")},
    ("patch", "resource.k8s.io", "resourceclaims/status", "cluster", None),
}


def test_dra_mode_is_scheduler_mode_with_the_dra_driver_in_place_of_the_device_plugin(
        dra_objects: list[tuple[Path, Doc]]) -> None:
    for _, doc in dra_objects:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, _key(doc)
    assert {_key(d) for _, d in dra_objects} == {_key(d) for _, d in SCHEDULER_MODE_OBJECTS} | DRA_NEW
    spec, _ = _node_agent_container("dra-plugin", dra_objects)
    [base] = [d for d in _of_kind("DaemonSet") if d["metadata"]["name"] == "gpuplane-node-agent"]
    base_spec = base["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["dra-plugin", *(c["name"] for c in base_spec["containers"]
                                                                       if c["name"] != "device-plugin")]
    # the exporter, the guard and the reporter exactly as in the default install, with their volumes
    for container in base_spec["containers"]:
        if container["name"] != "device-plugin":
            assert container in spec["containers"], container["name"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    kept = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
    assert set(volumes) == kept  # the device plugin's host directories are gone with it
    assert {k: v for k, v in base_spec.items() if k not in ("containers", "volumes")} == \
           {k: v for k, v in spec.items() if k not in ("containers", "volumes")}
    [scheduler] = [c for d in _of_kind("Deployment", objects=dra_objects) if d["metadata"]["name"] ==
                   "gpuplane-scheduler" for c in _containers(d)]
    assert scheduler["args"] == [*_containers(_scheduler_mode_deployment())[0]["args"], "--dra"]


def _check_rendered_workloads(objects: list[tuple[Path, Doc]]) -> None:
    """A rendered mode's workloads: every gpuplane container's command line, every security context."""
    workloads = _of_kind("Deployment", "DaemonSet", "StatefulSet", objects=objects)
    for w in workloads:
        for c in _containers(w):
            if c["image"].startswith("ghcr.io/gpuplane/"):
                _check_command(w["metadata"]["name"], c)
    _check_security_contexts(workloads)


def test_dra_modes_containers_run_real_commands_with_the_least_privilege(dra_objects: list[tuple[Path, Doc]]) -> None:
    _check_rendered_workloads(dra_objects)
    _, plugin = _node_agent_container("dra-plugin", dra_objects)
    assert {"cpu", "memory"} <= set(plugin["resources"]["requests"]) and "memory" in plugin["resources"]["limits"]


def test_dra_mode_grants_exactly_what_the_driver_and_the_scheduler_call(dra_objects: list[tuple[Path, Doc]]) -> None:
    grants, builtin = _rbac(dra_objects)
    for account, required in (("gpuplane-node-agent", DRA_NODE_AGENT), ("gpuplane-scheduler", DRA_SCHEDULER)):
        got = grants[account]
        assert required - got == set(), f"{account} lacks {sorted(required - got, key=str)}"
        assert got - required == set(), f"{account} has more than it uses: {sorted(got - required, key=str)}"
    assert "gpuplane-scheduler" not in builtin
    others, _ = _rbac(SCHEDULER_MODE_OBJECTS)
    assert {a: g for a, g in grants.items() if a not in ("gpuplane-node-agent", "gpuplane-scheduler")} == \
           {a: g for a, g in others.items() if a not in ("gpuplane-node-agent", "gpuplane-scheduler")}


def test_the_dra_plugin_serves_in_kubelets_directories_from_the_host(dra_objects: list[tuple[Path, Doc]]) -> None:
    from gpuplane.node.dra_plugin import DraSettings

    spec, plugin = _node_agent_container("dra-plugin", dra_objects)
    defaults = DraSettings("n")
    for flag, where in (("--registry-dir", defaults.registry_dir), ("--plugins-dir", defaults.plugins_dir),
                        ("--cdi-dir", defaults.cdi_dir)):
        assert _flag(plugin, flag) == str(where), flag  # where kubelet and the runtime look (docs/dra.md)
    # every directory it writes is the host's, at the same path (kubelet dials the sockets the plugin names)
    settings = DraSettings("n", registry_dir=Path(str(_flag(plugin, "--registry-dir"))),
                           plugins_dir=Path(str(_flag(plugin, "--plugins-dir"))),
                           cdi_dir=Path(str(_flag(plugin, "--cdi-dir"))))
    for path in (settings.registration_socket.parent, settings.plugin_dir, settings.cdi_dir,
                 Path(allocation.AllocationSettings().vgpu_dir), Path(allocation.AllocationSettings().lock_dir)):
        assert _host_path(spec, plugin, str(path), writable=True) == str(path)
    env = {e["name"]: e for e in plugin["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


@pytest.mark.parametrize("kind", ["livenessProbe", "readinessProbe"])
def test_the_dra_plugin_probe_passes_exactly_while_both_sockets_exist(kind: str, dra_objects: list[tuple[Path, Doc]],
                                                                       tmp_path: Path) -> None:
    from gpuplane.node.dra_plugin import DraSettings

    _, plugin = _node_agent_container("dra-plugin", dra_objects)
    settings = DraSettings("n")
    command = plugin[kind]["exec"]["command"]
    here = {settings.registration_socket: tmp_path / "reg.sock", settings.endpoint: tmp_path / "dra.sock"}

    def probe() -> int:
        args = [sys.executable if a == "python3" else a for a in command]
        for there, local in here.items():
            args = [a.replace(str(there), str(local)) for a in args]
        return subprocess.run(args, capture_output=True, timeout=30).returncode

    assert all(str(there) in command[-1] for there in here)
    assert probe() != 0  # neither socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as registration:
        registration.bind(str(here[settings.registration_socket]))
        assert probe() != 0  # the endpoint is missing
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as endpoint:
            endpoint.bind(str(here[settings.endpoint]))
            assert probe() == 0


def test_the_dra_plugin_with_its_manifests_args_makes_only_calls_its_rbac_grants(
        dra_objects: list[tuple[Path, Doc]]) -> None:
    # The container's command line (kubelet's directories moved here, fake cards for NVML) against the local API
    # server, through a prepare kubelet asks for: every request it made is one DRA mode's roles allow.
    import tempfile

    from daemons import gpuplane_daemon, sigterm
    from gpuplane.node.dra_plugin import claim_path, dra_protocol, registration_protocol
    from gpuplane.node.dra_slices import DRIVER, RESOURCE_SLICES

    _, plugin = _node_agent_container("dra-plugin", dra_objects)
    root = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # a Unix socket path has 108 bytes at most
    try:
        swap = {_flag(plugin, "--registry-dir"): str(root / "reg"), _flag(plugin, "--plugins-dir"): str(root / "p"),
                _flag(plugin, "--cdi-dir"): str(root / "cdi"), "$(NODE_NAME)": "dra-0"}
        args = [swap.get(a, a) for a in plugin["args"]]
        args[args.index("--interval") + 1] = "0.2"
        with FakeApiServer() as server:
            server.add_node(localapi.node_json("dra-0"))
            stored = server.add_object(claim_path("team", ""), {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"namespace": "team", "name": "train"}, "spec": {"devices": {"requests": [{"name": "g"}]}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "g", "driver": DRIVER, "pool": "dra-0", "device": "gpu-1"}]}}}})
            kubeconfig = server.write_kubeconfig(root / "kubeconfig")
            with gpuplane_daemon([*args, "--fake-cards", "2", "--fake-model", "A100-80GB",
                                  "--kubeconfig", str(kubeconfig)]) as child:
                registration = root / "reg" / f"{DRIVER}-reg.sock"
                deadline = time.monotonic() + 60
                while not (registration.exists() and server.keys("resourceslices")):
                    assert child.poll() is None and time.monotonic() < deadline, "the plugin did not start"
                    time.sleep(0.05)
                with grpc.insecure_channel(f"unix://{registration}") as channel:
                    info = registration_protocol().services.RegistrationStub(channel).GetInfo(
                        registration_protocol().messages.InfoRequest(), timeout=5)
                with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
                    messages = dra_protocol().messages
                    claim = messages.Claim(namespace="team", name="train", uid=stored["metadata"]["uid"])
                    answer = dra_protocol().services.DRAPluginStub(channel).NodePrepareResources(
                        messages.NodePrepareResourcesRequest(claims=[claim]), timeout=10)
                assert answer.claims[stored["metadata"]["uid"]].error == ""
                server.mutate("resourceslices", server.keys("resourceslices")[0],
                              lambda s: s["spec"].update(devices=[]))  # changed behind its back: written again
                time.sleep(1.0)
                returncode, output = sigterm(child)
                assert returncode == 0, output
            calls = _calls(server)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert {(v, r) for v, _, r, _, _ in calls} >= {("get", "resourceclaims"), ("list", "resourceslices"),
                                                   ("create", "resourceslices"), ("patch", "resourceslices"),
                                                   ("get", "nodes")}
    assert RESOURCE_SLICES.startswith("/apis/resource.k8s.io/v1/")
    grants, _ = _rbac(dra_objects)
    assert _ungranted(calls, grants["gpuplane-node-agent"]) == []


def test_the_dra_scheduler_with_its_manifests_args_makes_only_calls_its_rbac_grants(
        dra_objects: list[tuple[Path, Doc]], tmp_path: Path) -> None:
    # gpuplane scheduler with the Deployment's arguments (--dra, leader election on its Lease; its ports moved to
    # free ones) against the local API server: a claim's pod is allocated and bound, then preempted by a higher
    # priority one (eviction, the claim released, allocated again). Every request is one DRA mode's roles allow.
    from daemons import gpuplane_daemon, sigterm
    from gpuplane.kube.cluster import pod_manifest
    from gpuplane.kube.dra import CLASSES, SLICES, claim_manifest, with_claim
    from gpuplane.kube.dra import claim_path as claims_of
    from gpuplane.kube.scheduler_mode import DEFAULT_SCHEDULER_NAME
    from gpuplane.model import NodeSpec, PodRequest, WholeCards, default_catalog
    from gpuplane.node.dra_slices import spec_slices
    from gpuplane.sim.dra_bench import device_classes, dra_node_manifest

    [scheduler] = [c for d in _of_kind("Deployment", objects=dra_objects) if d["metadata"]["name"] ==
                   "gpuplane-scheduler" for c in _containers(d)]

    def free_port() -> str:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return str(sock.getsockname()[1])

    args = list(scheduler["args"])
    for flag in ("--health-port", "--metrics-port"):
        args[args.index(flag) + 1] = free_port()
    catalog = default_catalog()
    spec = NodeSpec("dra-0", 64_000, 512_000, catalog.canonical("A100-80GB"), 2)
    with FakeApiServer() as server:
        server.add_node(dra_node_manifest(spec))
        for cls in device_classes():
            server.add_object(CLASSES, cls)
        for piece in spec_slices(spec, catalog):
            server.add_object(SLICES, piece)

        def submit(name: str, priority: int) -> None:
            request = PodRequest(f"team/{name}", cpu_milli=100, gpu=WholeCards(2))
            server.add_object(claims_of("team"), claim_manifest(request, f"{name}-gpu"))
            pod = with_claim(pod_manifest(request, scheduler_name=DEFAULT_SCHEDULER_NAME), f"{name}-gpu")
            pod["spec"]["priority"] = priority
            server.add_pod(pod)

        def bound(name: str) -> bool:
            pod = server.get("pods", f"team/{name}")
            return pod is not None and pod["spec"].get("nodeName") == "dra-0"

        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        with gpuplane_daemon([*args, "--kubeconfig", str(kubeconfig)]) as child:
            submit("low", 100)
            deadline = time.monotonic() + 60
            while not bound("low"):
                assert child.poll() is None and time.monotonic() < deadline, "low was not bound"
                time.sleep(0.05)
            submit("high", 1000)
            while not bound("high"):
                assert child.poll() is None and time.monotonic() < deadline, "high was not bound"
                time.sleep(0.05)
            returncode, output = sigterm(child)
            assert returncode == 0, output
        calls = _calls(server)
    assert {(v, r) for v, _, r, _, _ in calls} >= {
        ("patch", "resourceclaims/status"), ("create", "pods/binding"), ("create", "pods/eviction"),
        ("list", "resourceslices"), ("watch", "resourceclaims"), ("list", "deviceclasses")}
    grants, _ = _rbac(dra_objects)
    assert _ungranted(calls, grants["gpuplane-scheduler"]) == []


# (operation, user's node, slice's node (old one for a DELETE), user) → allowed?
NODE_AGENT_USER = f"system:serviceaccount:{NAMESPACE}:gpuplane-node-agent"
SLICE_POLICY_CASES = [
    ("CREATE", "dra-0", "dra-0", NODE_AGENT_USER, True),    # its own node's slice
    ("UPDATE", "dra-0", "dra-0", NODE_AGENT_USER, True),    # a patch is an UPDATE
    ("DELETE", "dra-0", "dra-0", NODE_AGENT_USER, True),
    ("CREATE", "dra-0", "dra-1", NODE_AGENT_USER, False),   # another node's
    ("DELETE", "dra-0", "dra-1", NODE_AGENT_USER, False),
    ("CREATE", "dra-0", None, NODE_AGENT_USER, False),      # a slice of no node (allNodes, nodeSelector)
    ("CREATE", None, "dra-0", NODE_AGENT_USER, False),      # a token that names no node: refused
    ("CREATE", None, "dra-1", "system:serviceaccount:kube-system:other-driver", True),  # not the policy's
]


@pytest.mark.parametrize(("operation", "user_node", "slice_node", "user", "allowed"), SLICE_POLICY_CASES)
def test_the_node_agent_writes_its_own_nodes_slices_only(operation: str, user_node: str | None,
                                                        slice_node: str | None, user: str, allowed: bool) -> None:
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the policy")
    [policy] = [d for p in _yaml_files(DRA_MODE) for d in _load(p) if d.get("kind") == "ValidatingAdmissionPolicy"]
    [binding] = [d for p in _yaml_files(DRA_MODE) for d in _load(p)
                 if d.get("kind") == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"], set(rule["operations"])) == (
        ["resource.k8s.io"], ["resourceslices"], {"CREATE", "UPDATE", "DELETE"})
    slice_obj = {"metadata": {"name": "s"}, "spec": {"driver": "gpu.gpuplane.io",
                                                     **({"nodeName": slice_node} if slice_node else {})}}
    info: Doc = {"username": user}
    if user_node is not None:
        info["extra"] = {"authentication.kubernetes.io/node-name": [user_node]}
    env = celpy.Environment()
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel({"operation": operation, "userInfo": info}),
        "object": celpy.json_to_cel(None if operation == "DELETE" else slice_obj),
        "oldObject": celpy.json_to_cel(slice_obj if operation != "CREATE" else None)}

    def evaluate(expression: str) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    if not all(evaluate(c["expression"]) for c in policy["spec"]["matchConditions"]):
        assert allowed  # the policy does not apply: RBAC alone decides
        return
    variables = {v["name"]: evaluate(v["expression"]) for v in policy["spec"]["variables"]}
    activation["variables"] = celpy.json_to_cel({k: str(v) for k, v in variables.items()})
    results = [evaluate(v["expression"]) for v in policy["spec"]["validations"]]
    assert all(isinstance(r, celpy.celtypes.BoolType) for r in results), results
    assert all(results) is allowed


def _named_below(directory: Path) -> set[Path]:
    """The files a kustomization or component in `directory` names (resources, patches), following the
    directories it names that lie below `directory`."""
    doc = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    files: set[Path] = set()
    for entry in [*doc.get("resources", []), *doc.get("components", []),
                  *(p["path"] for p in doc.get("patches", []) if "path" in p)]:
        target = (directory / entry).resolve()
        if target.is_dir():
            files |= _named_below(target) if directory.resolve() in target.parents else set()
        else:
            files.add(target)
    return files


def test_dra_modes_component_names_every_file_it_has() -> None:
    component = yaml.safe_load((DRA_MODE / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["kind"] == "Component" and component["components"] == ["../scheduler", "cluster", "agent"]
    for part in ("cluster", "agent"):
        assert yaml.safe_load((DRA_MODE / part / "kustomization.yaml").read_text(encoding="utf-8"))["kind"] == \
            "Component"
    assert _named_below(DRA_MODE) == {p.resolve() for p in _yaml_files(DRA_MODE) if p.name not in NOT_API_OBJECTS}


# ------------------------------------------------------------------ mixed mode (deploy/modes/mixed)
GPU_API = "gpuplane.io/gpu-api"
"""The node label that makes a GPU node a DRA node in mixed mode (value `dra`)."""
AGENT_MODE = "gpuplane.io/agent-mode"
DRA_AGENT = "gpuplane-node-agent-dra"
MIXED_NEW = {("ServiceAccount", NAMESPACE, DRA_AGENT), ("DaemonSet", NAMESPACE, DRA_AGENT),
             ("ClusterRole", None, "gpuplane-node-agent-dra-reads"),
             ("ClusterRoleBinding", None, "gpuplane-node-agent-dra-reads"),
             ("RoleBinding", "default", "gpuplane-node-agent-dra-events")}


@pytest.fixture(scope="module")
def mixed_objects(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Doc]]:
    return [(MIXED_MODE / "rendered", d) for d in _render(["modes/mixed"], tmp_path_factory.mktemp("mixed"))]


def _daemonset(objects: list[tuple[Path, Doc]], name: str) -> Doc:
    [ds] = [d for d in _of_kind("DaemonSet", objects=objects) if d["metadata"]["name"] == name]
    return ds


def _term_holds(term: Doc, labels: Mapping[str, str]) -> bool:
    """Whether a nodeSelectorTerm holds for a node with `labels`, as Kubernetes evaluates it: its expressions all
    hold; NotIn and DoesNotExist hold where the label is absent; a term with no expression selects no node."""
    assert set(term) <= {"matchExpressions"}, term  # matchFields: not evaluated here
    expressions = term.get("matchExpressions", [])
    for e in expressions:
        key, values = e["key"], e.get("values", [])
        holds = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                 "Exists": key in labels, "DoesNotExist": key not in labels}[e["operator"]]
        if not holds:
            return False
    return bool(expressions)


def _runs_on(daemonset: Doc, labels: Mapping[str, str]) -> bool:
    """Whether the DaemonSet controller puts a pod of `daemonset` on a node with `labels` (its nodeSelector and
    required node affinity; the node agents tolerate every taint that matters, checked above)."""
    spec = daemonset["spec"]["template"]["spec"]
    if not spec.get("nodeSelector", {}).items() <= labels.items():
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    return required is None or any(_term_holds(t, labels) for t in required["nodeSelectorTerms"])


def _agents_on(objects: list[tuple[Path, Doc]], labels: Mapping[str, str]) -> set[str]:
    return {d["metadata"]["name"] for d in _of_kind("DaemonSet", objects=objects) if _runs_on(d, labels)}


GPU_NODE = {"gpuplane.io/gpu-node": "true"}
# A node's labels → the node agents mixed mode runs on it: one on every GPU node, none elsewhere.
AGENT_CASES = [
    ({**GPU_NODE, GPU_API: "dra"}, {DRA_AGENT}),
    (GPU_NODE, {"gpuplane-node-agent"}),
    ({**GPU_NODE, GPU_API: "device-plugin"}, {"gpuplane-node-agent"}),  # any other value: the device plugin
    ({**GPU_NODE, GPU_API: "DRA"}, {"gpuplane-node-agent"}),  # label values are case-sensitive
    ({**GPU_NODE, "kubernetes.io/hostname": "gpu-7"}, {"gpuplane-node-agent"}),
    ({GPU_API: "dra"}, set()),  # not a GPU node
    ({"gpuplane.io/gpu-node": "false", GPU_API: "dra"}, set()),
    ({}, set()),
]


@pytest.mark.parametrize(("labels", "agents"), AGENT_CASES, ids=[str(sorted(c[0].items())) for c in AGENT_CASES])
def test_mixed_mode_runs_exactly_one_node_agent_on_each_gpu_node_by_its_label(
        labels: dict[str, str], agents: set[str], mixed_objects: list[tuple[Path, Doc]]) -> None:
    assert _agents_on(mixed_objects, labels) == agents


def _broken(objects: list[tuple[Path, Doc]], name: str, path: str, value: Any) -> list[tuple[Path, Doc]]:
    return [(p, _with(d, path, value) if d["kind"] == "DaemonSet" and d["metadata"]["name"] == name else d)
            for p, d in objects]


_TERM = f"{_POD}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0"
_AFFINITY_BREAKS = [
    # (the DaemonSet, what is changed, the value)
    ("gpuplane-node-agent", f"{_POD}.affinity", None),  # a DRA node gets the device plugin too
    (DRA_AGENT, f"{_POD}.affinity", None),  # every GPU node gets the DRA driver
    (DRA_AGENT, f"{_POD}.nodeSelector", None),  # a labelled node that is no GPU node gets it
    (DRA_AGENT, f"{_TERM}.matchExpressions.0.operator", "NotIn"),
    ("gpuplane-node-agent", f"{_TERM}.matchExpressions.0.operator", "In"),
    ("gpuplane-node-agent", f"{_TERM}.matchExpressions.0.operator", "DoesNotExist"),  # any value keeps it off
    (DRA_AGENT, f"{_TERM}.matchExpressions.0.values", ["true"]),
    ("gpuplane-node-agent", f"{_TERM}.matchExpressions.0.key", "gpuplane.io/gpu-mode"),
]


@pytest.mark.parametrize(("name", "path", "value"), _AFFINITY_BREAKS,
                         ids=[f"{n}:{p.rsplit('.', 1)[-1]}={v}" for n, p, v in _AFFINITY_BREAKS])
def test_the_node_agent_table_catches_a_broken_affinity(name: str, path: str, value: Any,
                                                       mixed_objects: list[tuple[Path, Doc]]) -> None:
    broken = _broken(mixed_objects, name, path, value)
    assert any(_agents_on(broken, labels) != agents for labels, agents in AGENT_CASES)


def test_mixed_modes_node_agents_select_their_own_pods_only(mixed_objects: list[tuple[Path, Doc]]) -> None:
    agents = {d["metadata"]["name"]: d for d in _of_kind("DaemonSet", objects=mixed_objects)}
    assert set(agents) == set(NODE_AGENTS)
    for name, ds in agents.items():
        assert set(ds["spec"]["selector"]) == {"matchLabels"}, name
        for other, pods in agents.items():
            labels = pods["spec"]["template"]["metadata"]["labels"]
            assert (ds["spec"]["selector"]["matchLabels"].items() <= labels.items()) is (other == name), (name, other)
    assert {ds["spec"]["template"]["metadata"]["labels"][AGENT_MODE] for ds in agents.values()} == {"device-plugin",
                                                                                                  "dra"}


def _plain(ds: Doc, *, renamed: bool) -> Doc:
    """`ds` without what sets mixed mode's two node agents apart: the node affinity and the agent-mode label, and
    where `renamed` the DaemonSet's name, its name label (selector and pods), and its ServiceAccount."""
    import copy

    out = copy.deepcopy(ds)
    template = out["spec"]["template"]
    template["spec"].pop("affinity", None)
    template["metadata"]["labels"].pop(AGENT_MODE, None)
    if renamed:
        del out["metadata"]["name"], template["spec"]["serviceAccountName"]
        for labels in (out["metadata"]["labels"], out["spec"]["selector"]["matchLabels"],
                       template["metadata"]["labels"]):
            del labels["app.kubernetes.io/name"]
    return out


def test_mixed_mode_is_dra_mode_on_labelled_nodes_and_scheduler_mode_on_the_others(
        mixed_objects: list[tuple[Path, Doc]], dra_objects: list[tuple[Path, Doc]]) -> None:
    for _, doc in mixed_objects:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, _key(doc)
    assert {_key(d) for _, d in mixed_objects} == {_key(d) for _, d in dra_objects} | MIXED_NEW
    # the device-plugin agent: scheduler mode's, its selector included (a DaemonSet's cannot change)
    plugin, scheduler_mode_agent = (_daemonset(o, "gpuplane-node-agent") for o in (mixed_objects,
                                                                                  SCHEDULER_MODE_OBJECTS))
    assert _plain(plugin, renamed=False) == scheduler_mode_agent
    # the DRA agent: DRA mode's, renamed, with its own account
    dra, dra_mode_agent = _daemonset(mixed_objects, DRA_AGENT), _daemonset(dra_objects, "gpuplane-node-agent")
    assert _plain(dra, renamed=True) == _plain(dra_mode_agent, renamed=True)
    assert dra["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": DRA_AGENT}}
    assert dra["spec"]["template"]["spec"]["serviceAccountName"] == DRA_AGENT
    # the scheduler: DRA mode's (scheduler mode's with --dra)
    [scheduler] = [d for d in _of_kind("Deployment", objects=mixed_objects) if d["metadata"]["name"] ==
                   "gpuplane-scheduler"]
    assert _containers(scheduler)[0]["args"] == [*_containers(_scheduler_mode_deployment())[0]["args"], "--dra"]
    assert scheduler == next(d for d in _of_kind("Deployment", objects=dra_objects)
                             if d["metadata"]["name"] == "gpuplane-scheduler")


def test_mixed_modes_containers_run_real_commands_with_the_least_privilege(
        mixed_objects: list[tuple[Path, Doc]]) -> None:
    _check_rendered_workloads(mixed_objects)


def test_mixed_mode_grants_each_node_agent_exactly_what_it_calls(mixed_objects: list[tuple[Path, Doc]]) -> None:
    grants, builtin = _rbac(mixed_objects)
    accounts = {d["metadata"]["name"] for d in _of_kind("ServiceAccount", objects=mixed_objects)}
    # Each node agent by what it runs: the device plugin's keeps its own grants, the DRA driver's has DRA mode's
    # node agent's, no more; each its own account.
    running = {next(c["name"] for c in _containers(ds) if c["name"] in ("device-plugin", "dra-plugin")):
               ds["spec"]["template"]["spec"]["serviceAccountName"]
               for ds in _of_kind("DaemonSet", objects=mixed_objects)}
    assert running == {"device-plugin": "gpuplane-node-agent", "dra-plugin": DRA_AGENT}
    assert set(running.values()) <= accounts
    for account, required in ((running["device-plugin"], REQUIRED["gpuplane-node-agent"]),
                              (running["dra-plugin"], DRA_NODE_AGENT), ("gpuplane-scheduler", DRA_SCHEDULER)):
        got = grants[account]
        assert required - got == set(), f"{account} lacks {sorted(required - got, key=str)}"
        assert got - required == set(), f"{account} has more than it uses: {sorted(got - required, key=str)}"
    assert "gpuplane-scheduler" not in builtin
    others, _ = _rbac(SCHEDULER_MODE_OBJECTS)
    mine = ("gpuplane-node-agent", DRA_AGENT, "gpuplane-scheduler")
    assert {a: g for a, g in grants.items() if a not in mine} == {a: g for a, g in others.items() if a not in mine}
    # the slice admission policy holds the account that writes slices
    [policy] = _of_kind("ValidatingAdmissionPolicy", objects=mixed_objects)
    [condition] = policy["spec"]["matchConditions"]
    assert _cel_literals(condition["expression"]) == [f"system:serviceaccount:{NAMESPACE}:{DRA_AGENT}"]


def test_mixed_modes_metrics_service_reaches_both_node_agents(mixed_objects: list[tuple[Path, Doc]]) -> None:
    [service] = [s for s in _of_kind("Service", objects=mixed_objects) if s["metadata"]["name"] ==
                 "gpuplane-node-agent"]
    selector = service["spec"]["selector"]
    selected = [w for w in _of_kind("Deployment", "DaemonSet", "StatefulSet", objects=mixed_objects)
                if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert sorted(w["metadata"]["name"] for w in selected) == sorted(NODE_AGENTS)
    scraped = {port for svc, port in _scrape_jobs().values() if svc == "gpuplane-node-agent"}
    assert scraped and scraped <= {p["name"] for p in service["spec"]["ports"]}
    for w in selected:
        ports = set().union(*(_ports(c) for c in _containers(w)))
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, w["metadata"]["name"]


def test_mixed_modes_component_names_every_file_it_has() -> None:
    component = yaml.safe_load((MIXED_MODE / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["kind"] == "Component" and component["components"] == ["../scheduler", "../dra/cluster"]
    assert _named_below(MIXED_MODE) == {p.resolve() for p in _yaml_files(MIXED_MODE) if p.name not in NOT_API_OBJECTS}
