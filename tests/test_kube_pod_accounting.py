"""Kubernetes' own pod accounting and node constraints, everywhere a pod is read: one row per rule, each naming the
Kubernetes function it comes from, with the arithmetic in a comment.

Resources follow `PodRequests` (k8s.io/component-helpers resource/helpers.go) after the API server's defaulting
(`SetDefaults_Pod`, pkg/apis/core/v1/defaults.go); tolerations `ToleratesTaint` (k8s.io/api core/v1
toleration.go); node selection kube-scheduler's NodeUnschedulable, TaintToleration and NodeAffinity plugins
(k8s.io/component-helpers scheduling/corev1/nodeaffinity/nodeaffinity.go).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import CATALOG, cluster, framework, node, pod
from gpuplane.kube.cluster import pod_manifest
from gpuplane.kube.objects import ObjectError, container_units, pod_request, pod_resources
from gpuplane.kube.webhook import AdmissionPolicy
from gpuplane.model import (
    Assignment,
    CardShare,
    ClusterState,
    NodeSelectorTerm,
    NodeSpec,
    PodRequest,
    PreferredTerm,
    Requirement,
    SelectorOp,
    Toleration,
    WholeCards,
    make_request,
)
from gpuplane.node.allocation import PendingPod, match_pod
from gpuplane.port import Code
from gpuplane.scheduler import Framework, Profile
from gpuplane.scheduler.plugins.constraints import default_normalize
from gpuplane.scheduler.plugins.fit import AFFINITY_MISMATCH, UNSCHEDULABLE_NODE, UNTOLERATED_TAINT

GPU = "gpuplane.io/gpu"


def container(name: str = "main", *, requests: dict[str, str] | None = None, limits: dict[str, str] | None = None,
              sidecar: bool = False, **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = requests
    if limits is not None:
        resources["limits"] = limits
    body: dict[str, Any] = {"name": name, "image": "img", "resources": resources, **extra}
    if sidecar:
        body["restartPolicy"] = "Always"
    return body


def k8s_pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), name: str = "p",
            **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": name, "namespace": "ml"},
                            "spec": {"containers": list(containers) or [container()], **spec}}
    if init:
        body["spec"]["initContainers"] = list(init)
    return body


def read(body: dict[str, Any]) -> PodRequest:
    return pod_request(body, CATALOG)


# ============================================================================ resources

RESOURCE_CASES: list[tuple[str, dict[str, Any], int, int]] = [
    # (id, pod, cpu milli, memory MiB)
    # SetDefaults_Pod: the request stands; the limit only bounds. Burstable: requests 2, limits 128 → 2 CPUs.
    ("burstable", k8s_pod(container(requests={"cpu": "2"}, limits={"cpu": "128"})), 2000, 0),
    # SetDefaults_Pod: no request → the limit is copied in as the request.
    ("limit-stands-in", k8s_pod(container(limits={"cpu": "3", "memory": "1Gi"})), 3000, 1024),
    # SetDefaults_Pod copies per resource: cpu from requests (1), memory from limits (4 Gi = 4096 MiB).
    ("per-resource", k8s_pod(container(requests={"cpu": "1"}, limits={"cpu": "8", "memory": "4Gi"})), 1000, 4096),
    # PodRequests: containers add up (1 + 0.5 = 1.5 CPUs, 1 + 2 = 3 GiB).
    ("containers-sum", k8s_pod(container("a", requests={"cpu": "1", "memory": "1Gi"}),
                               container("b", requests={"cpu": "500m", "memory": "2Gi"})), 1500, 3072),
    # PodRequests: an init container larger than the sum wins: max(init 3, 1 + 1) = 3.
    ("init-max", k8s_pod(container("a", requests={"cpu": "1"}), container("b", requests={"cpu": "1"}),
                         init=(container("init", requests={"cpu": "3"}),)), 3000, 0),
    # PodRequests: a smaller init container adds nothing: max(init 1, 1 + 1) = 2 (a max, not a sum: not 3).
    ("init-below-sum", k8s_pod(container("a", requests={"cpu": "1"}), container("b", requests={"cpu": "1"}),
                               init=(container("init", requests={"cpu": "1"}),)), 2000, 0),
    # PodRequests: a native sidecar (restartPolicy Always) adds to the sum (1 + 1 = 2), and the init container
    # after it runs beside it: step 1 + 2 = 3 > 2 → 3.
    ("sidecar-then-init", k8s_pod(container(requests={"cpu": "1"}),
                                  init=(container("side", requests={"cpu": "1"}, sidecar=True),
                                        container("init", requests={"cpu": "2"}))), 3000, 0),
    # PodRequests: an init container before the sidecar runs alone: steps max(2, 1) = 2; sum 1 + 1 = 2 → 2.
    ("init-then-sidecar", k8s_pod(container(requests={"cpu": "1"}),
                                  init=(container("init", requests={"cpu": "2"}),
                                        container("side", requests={"cpu": "1"}, sidecar=True))), 2000, 0),
    # PodRequests: spec.overhead is added last: 1 + 0.25 = 1.25 CPUs, 1 Gi + 128 Mi = 1152 MiB.
    ("overhead", k8s_pod(container(requests={"cpu": "1", "memory": "1Gi"}),
                         overhead={"cpu": "250m", "memory": "128Mi"}), 1250, 1152),
    # PodRequests (applyPodLevelResources): pod-level requests replace the containers' sum for cpu (3, not
    # 1 + 1); memory, named only in the pod-level limits, takes the limit (8 Gi), not the containers' 2 Gi.
    ("pod-level", k8s_pod(container("a", requests={"cpu": "1", "memory": "1Gi"}),
                          container("b", requests={"cpu": "1", "memory": "1Gi"}),
                          resources={"requests": {"cpu": "3"}, "limits": {"memory": "8Gi"}}), 3000, 8192),
    # PodRequests: pod-level resources, then overhead on top: 2 + 0.5 = 2.5.
    ("pod-level-and-overhead", k8s_pod(container(requests={"cpu": "1"}), resources={"requests": {"cpu": "2"}},
                                       overhead={"cpu": "500m"}), 2500, 0),
    # Quantity.MilliValue rounds up: 0.0001 CPU is 1 milli-CPU, never 0.
    ("rounded-up", k8s_pod(container(requests={"cpu": "100u"})), 1, 0),
]


@pytest.mark.parametrize(("body", "cpu", "memory"), [c[1:] for c in RESOURCE_CASES],
                         ids=[c[0] for c in RESOURCE_CASES])
def test_pod_requests(body: dict[str, Any], cpu: int, memory: int) -> None:
    request = read(body)
    assert (request.cpu_milli, request.memory_mib) == (cpu, memory)


def test_burstable_pod_fits_a_96_cpu_node() -> None:
    # Requests 2 CPUs (limits 128): 2 ≤ 96 fits; reading the limit (128 > 96) refused it before.
    request = read(k8s_pod(container(requests={"cpu": "2"}, limits={"cpu": "128"})))
    state = cluster(node("n").cpu(96000).obj())
    decision = framework().schedule(request, state)
    assert decision.assignment is not None and decision.assignment.node == "n"


def test_gpu_sidecars_add_cards_so_two_such_pods_do_not_share_an_8_card_node() -> None:
    # PodRequests with extended resources: main 4 cards + native sidecar 4 cards = 8 cards per pod;
    # an 8-card node holds one such pod (8 + 8 = 16 > 8), where reading the main container alone promised 12.
    def gpu_pod(name: str) -> dict[str, Any]:
        return k8s_pod(container(limits={GPU: "4"}), name=name,
                       init=(container("side", limits={GPU: "4"}, sidecar=True),))

    first, second = read(gpu_pod("a")), read(gpu_pod("b"))
    assert first.gpu == WholeCards(8)
    state = cluster(node("n").gpus(8).obj())
    fw = framework()
    decision = fw.schedule(first, state)
    assert decision.assignment is not None
    state.place(first, decision.assignment)
    refused = fw.schedule(second, state)
    assert refused.assignment is None and "insufficient idle GPUs" in refused.status.message


def test_a_gpu_init_container_is_a_max_not_a_sum() -> None:
    # PodRequests: a plain init container asking 2 cards beside a main container asking 2: max(2, 2) = 2 cards.
    request = read(k8s_pod(container(limits={GPU: "2"}), init=(container("init", limits={GPU: "2"}),)))
    assert request.gpu == WholeCards(2)


def test_extended_resource_request_must_equal_its_limit() -> None:
    # ValidateResourceRequirements: an extended resource cannot be overcommitted (request == limit).
    with pytest.raises(ObjectError) as caught:
        read(k8s_pod(container(requests={GPU: "1"}, limits={GPU: "2"})))
    assert caught.value.field == f"spec.containers[0].resources.requests[{GPU}]"


def test_pod_resources_is_what_the_request_reads() -> None:
    body = k8s_pod(container(requests={"cpu": "1"}), init=(container("s", requests={"cpu": "1"}, sidecar=True),),
                   overhead={"cpu": "100m"})
    # sidecar 1 + container 1 + overhead 0.1 = 2.1 CPUs
    assert pod_resources(body)["cpu"] * 1000 == read(body).cpu_milli == 2100


# ============================================================================ tolerations

TAINTED = node("t").taint("dedicated", "gpu", "NoSchedule").taint("maintenance", "", "NoExecute")


def tol(key: str = "", operator: str | None = None, value: str | None = None,
        effect: str | None = None) -> dict[str, str]:
    body = {"key": key}
    for name, item in (("operator", operator), ("value", value), ("effect", effect)):
        if item is not None:
            body[name] = item
    return body


TOLERATION_CASES: list[tuple[str, list[dict[str, str]], bool]] = [
    # (id, tolerations, whether the node tainted dedicated=gpu:NoSchedule and maintenance:NoExecute takes the pod)
    # ToleratesTaint: empty key + Exists matches every key, value and effect.
    ("blanket", [{"operator": "Exists"}], True),
    # ToleratesTaint: effect-only Exists matches every NoSchedule taint, not the NoExecute one.
    ("effect-only", [{"operator": "Exists", "effect": "NoSchedule"}], False),
    ("effect-only-both", [{"operator": "Exists", "effect": "NoSchedule"}, {"operator": "Exists",
                                                                           "effect": "NoExecute"}], True),
    # ToleratesTaint: an absent operator is Equal; the value must match (gpu == gpu), an empty effect matches all.
    ("equal", [tol("dedicated", value="gpu"), tol("maintenance", "Exists")], True),
    ("equal-wrong-value", [tol("dedicated", value="cpu"), tol("maintenance", "Exists")], False),
    # ToleratesTaint: Equal with an empty value matches the taint's empty value.
    ("equal-empty-value", [tol("dedicated", "Exists"), tol("maintenance", "Equal", "")], True),
    # ToleratesTaint: a named effect must equal the taint's (NoExecute ≠ NoSchedule).
    ("effect-mismatch", [tol("dedicated", "Exists", effect="NoExecute"), tol("maintenance", "Exists")], False),
    # FindMatchingUntoleratedTaint: every NoSchedule/NoExecute taint must be tolerated, one is not enough.
    ("one-of-two", [tol("dedicated", "Exists")], False),
    ("none", [], False),
]


@pytest.mark.parametrize(("tolerations", "fits"), [c[1:] for c in TOLERATION_CASES],
                         ids=[c[0] for c in TOLERATION_CASES])
def test_tolerates_taint(tolerations: list[dict[str, str]], fits: bool) -> None:
    request = read(k8s_pod(tolerations=tolerations))
    decision = framework().schedule(request, cluster(TAINTED.obj()))
    assert (decision.assignment is not None) == fits
    if not fits:
        assert UNTOLERATED_TAINT in decision.status.message
        assert decision.status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE


UNSCHEDULABLE_CASES: list[tuple[str, list[dict[str, str]], bool]] = [
    # NodeUnschedulable: a cordoned node takes a pod tolerating node.kubernetes.io/unschedulable:NoSchedule ...
    ("unschedulable-exists", [tol("node.kubernetes.io/unschedulable", "Exists", effect="NoSchedule")], True),
    # ... with the taint's empty value under Equal too, and under a blanket toleration;
    ("unschedulable-equal", [tol("node.kubernetes.io/unschedulable", "Equal", "")], True),
    ("unschedulable-blanket", [{"operator": "Exists"}], True),
    # ... not with another effect, nor without a toleration.
    ("unschedulable-noexecute", [tol("node.kubernetes.io/unschedulable", "Exists", effect="NoExecute")], False),
    ("unschedulable-none", [], False),
]


@pytest.mark.parametrize(("tolerations", "fits"), [c[1:] for c in UNSCHEDULABLE_CASES],
                         ids=[c[0] for c in UNSCHEDULABLE_CASES])
def test_node_unschedulable(tolerations: list[dict[str, str]], fits: bool) -> None:
    request = read(k8s_pod(tolerations=tolerations))
    decision = framework().schedule(request, cluster(node("cordoned").unschedulable().obj()))
    assert (decision.assignment is not None) == fits
    if not fits:
        assert UNSCHEDULABLE_NODE in decision.status.message


def test_prefer_no_schedule_scores_and_does_not_filter() -> None:
    # TaintToleration: PreferNoSchedule is no filter (the only node left takes the pod) ...
    soft = node("soft").taint("spot", "", "PreferNoSchedule")
    decision = framework().schedule(read(k8s_pod()), cluster(soft.obj()))
    assert decision.assignment is not None
    # ... and scores: raw untolerated counts (soft 1, plain 0), normalised reversed: 100 − 100·1/1 = 0 and 100.
    state = cluster(soft.obj(), node("plain").obj())
    counts = state.prefer_no_schedule_counts(read(k8s_pod()))
    assert counts is not None and default_normalize(counts, reverse=True).tolist() == [0.0, 100.0]
    for seed in range(8):  # binpack ties the two empty nodes; the taint's score settles it whatever the seed
        decision = framework(seed=seed).schedule(read(k8s_pod()), state)
        assert decision.assignment is not None and decision.assignment.node == "plain"
    # A pod tolerating the taint sees no preference.
    tolerant = read(k8s_pod(tolerations=[tol("spot", "Exists")]))
    assert state.prefer_no_schedule_counts(tolerant) is None


@pytest.mark.parametrize(("toleration", "field"), [
    # validateTolerations: Exists takes no value; an empty key needs Exists; Gt/Lt are feature-gated (1.35).
    (tol("k", "Exists", "v"), "spec.tolerations[0].value"),
    (tol("", "Equal", "v"), "spec.tolerations[0].operator"),
    (tol("k", "Lt", "3"), "spec.tolerations[0].operator"),
    (tol("k", "Exists", effect="Sometimes"), "spec.tolerations[0].effect"),
])
def test_invalid_tolerations_name_the_field(toleration: dict[str, str], field: str) -> None:
    with pytest.raises(ObjectError) as caught:
        read(k8s_pod(tolerations=[toleration]))
    assert caught.value.field == field


def test_toleration_model_keeps_the_old_meaning() -> None:
    # Toleration(key) is Exists on that key, Toleration(key, value) Equal: as the simulator built them.
    assert Toleration("spot").operator == "Exists" and Toleration("zone", "a").operator == "Equal"
    request = pod("p").tolerate("spot").obj()
    assert request.tolerates("spot", "anything") and not request.tolerates("other", "x")


# ============================================================================ node selection

LABELLED = (node("n1").label("zone", "a").label("gen", "3").obj(),
            node("n2").label("zone", "b").label("gen", "5").obj(),
            node("n3").label("gen", "x").obj(),
            node("n4").obj())


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)} if values else {"key": key,
                                                                                     "operator": operator}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


SELECTION_CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    # (id, pod spec fields, the nodes n1 {zone a, gen 3}, n2 {zone b, gen 5}, n3 {gen x}, n4 {} that match)
    # RequiredNodeAffinity.Match: nodeSelector, every pair.
    ("node-selector", {"nodeSelector": {"zone": "a"}}, ["n1"]),
    ("node-selector-two", {"nodeSelector": {"zone": "b", "gen": "5"}}, ["n2"]),
    ("node-selector-absent-value", {"nodeSelector": {"zone": "c"}}, []),
    # labels.Requirement.Matches, one operator each:
    ("in", {"affinity": required({"matchExpressions": [expr("zone", "In", "a", "b")]})}, ["n1", "n2"]),
    # NotIn also matches a node without the label.
    ("not-in", {"affinity": required({"matchExpressions": [expr("zone", "NotIn", "a")]})}, ["n2", "n3", "n4"]),
    ("exists", {"affinity": required({"matchExpressions": [expr("zone", "Exists")]})}, ["n1", "n2"]),
    ("does-not-exist", {"affinity": required({"matchExpressions": [expr("zone", "DoesNotExist")]})},
     ["n3", "n4"]),
    # Gt/Lt parse the label as an int64: 5 > 4; "x" is no integer and matches neither; n4 has no label.
    ("gt", {"affinity": required({"matchExpressions": [expr("gen", "Gt", "4")]})}, ["n2"]),
    ("lt", {"affinity": required({"matchExpressions": [expr("gen", "Lt", "4")]})}, ["n1"]),
    # nodeSelectorTerm: expressions are ANDed (zone in {a, b} and gen > 4).
    ("and", {"affinity": required({"matchExpressions": [expr("zone", "In", "a", "b"), expr("gen", "Gt", "4")]})},
     ["n2"]),
    # LazyErrorNodeSelector.Match: terms are ORed (zone b, or gen < 4).
    ("or", {"affinity": required({"matchExpressions": [expr("zone", "In", "b")]},
                                 {"matchExpressions": [expr("gen", "Lt", "4")]})}, ["n1", "n2"]),
    # isEmptyNodeSelectorTerm: an empty term matches nothing, alone or beside another.
    ("empty-term", {"affinity": required({})}, []),
    ("empty-term-or", {"affinity": required({}, {"matchExpressions": [expr("zone", "Exists")]})}, ["n1", "n2"]),
    # matchFields on metadata.name (In and NotIn, one value).
    ("fields-in", {"affinity": required({"matchFields": [expr("metadata.name", "In", "n3")]})}, ["n3"]),
    ("fields-not-in", {"affinity": required({"matchFields": [expr("metadata.name", "NotIn", "n3")]})},
     ["n1", "n2", "n4"]),
    # A term's expressions and fields both hold.
    ("fields-and-labels", {"affinity": required({"matchExpressions": [expr("gen", "Exists")],
                                                 "matchFields": [expr("metadata.name", "NotIn", "n1")]})},
     ["n2", "n3"]),
    # RequiredNodeAffinity.Match: nodeSelector and affinity both hold.
    ("selector-and-affinity", {"nodeSelector": {"gen": "3"},
                               "affinity": required({"matchExpressions": [expr("zone", "In", "a", "b")]})},
     ["n1"]),
]


def matching(state: ClusterState, request: PodRequest) -> list[str]:
    mask = state.affinity_mask(request)
    assert mask is not None
    return [state.nodes[i].name for i in np.flatnonzero(mask)]


@pytest.mark.parametrize(("spec", "names"), [c[1:] for c in SELECTION_CASES], ids=[c[0] for c in SELECTION_CASES])
def test_node_affinity_filter(spec: dict[str, Any], names: list[str]) -> None:
    request = read(k8s_pod(**spec))
    state = cluster(*LABELLED)
    assert matching(state, request) == names
    decision = framework().schedule(request, state)
    if names:
        assert decision.assignment is not None and decision.assignment.node in names
    else:
        assert decision.assignment is None and AFFINITY_MISMATCH in decision.status.message
        assert decision.status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE


def test_a_pod_without_selectors_sees_every_node() -> None:
    request = read(k8s_pod())
    assert request.node_selector == () and request.required_terms is None
    assert cluster(*LABELLED).affinity_mask(request) is None


def test_the_pool_selector_stays_the_pool() -> None:
    # gpuplane.io/pool in nodeSelector is the pod's pool (`pools`), the other pairs its node selector.
    request = read(k8s_pod(nodeSelector={"gpuplane.io/pool": "train", "zone": "a"}))
    assert request.pools == frozenset({"train"}) and request.node_selector == (("zone", "a"),)


def test_labels_changing_on_a_node_are_seen() -> None:
    state = cluster(*LABELLED)
    request = read(k8s_pod(nodeSelector={"zone": "c"}))
    assert matching(state, request) == []
    state.update_node(replace(LABELLED[3], labels=(("zone", "c"),)))
    assert matching(state, request) == ["n4"]


@pytest.mark.parametrize(("requirement", "field"), [
    # labels.NewRequirement / ValidateNodeSelectorRequirement
    (expr("zone", "In"), "matchExpressions[0].values"),
    (expr("zone", "Exists", "a"), "matchExpressions[0].values"),
    (expr("gen", "Gt", "4", "5"), "matchExpressions[0].values"),
    (expr("gen", "Lt", "four"), "matchExpressions[0].values"),
    (expr("zone", "Near", "a"), "matchExpressions[0].operator"),
])
def test_invalid_requirements_name_the_field(requirement: dict[str, Any], field: str) -> None:
    with pytest.raises(ObjectError) as caught:
        read(k8s_pod(affinity=required({"matchExpressions": [requirement]})))
    prefix = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]."
    assert caught.value.field == prefix + field


def test_match_fields_name_only_the_node_name() -> None:
    # validNodeFieldSelectorKeys: metadata.name, with In/NotIn and one value.
    for bad in (expr("metadata.uid", "In", "u"), expr("metadata.name", "In", "a", "b")):
        with pytest.raises(ObjectError, match="matchFields"):
            read(k8s_pod(affinity=required({"matchFields": [bad]})))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["zone", "gen", "rack"]), st.sampled_from(["In", "NotIn", "Exists",
                                                                                      "DoesNotExist", "Gt", "Lt"]),
                          st.sampled_from(["a", "b", "3", "5", "-2"])), min_size=1, max_size=3),
       st.lists(st.dictionaries(st.sampled_from(["zone", "gen", "rack"]), st.sampled_from(["a", "b", "3", "5", "x"])),
                min_size=1, max_size=6))
def test_vectorised_affinity_equals_the_per_node_rule(exprs: list[tuple[str, str, str]],
                                                      labels: list[dict[str, str]]) -> None:
    """The array check over all nodes equals `NodeSelectorTerm.matches` node by node."""
    requirements = []
    for key, operator, value in exprs:
        op = SelectorOp(operator)
        if op in (SelectorOp.EXISTS, SelectorOp.DOES_NOT_EXIST):
            requirements.append(Requirement(key, op))
        elif op in (SelectorOp.GT, SelectorOp.LT):
            requirements.append(Requirement(key, op, (value if value.lstrip("-").isdigit() else "1",)))
        else:
            requirements.append(Requirement(key, op, (value,)))
    term = NodeSelectorTerm(tuple(requirements))
    specs = [NodeSpec(f"n{i}", 1000, 1024, None, 0, labels=tuple(sorted(d.items()))) for i, d in enumerate(labels)]
    state = cluster(*specs)
    expected = [term.matches(s.name, dict(s.labels)) for s in specs]
    assert state.term_mask(term).tolist() == expected


def test_preferred_node_affinity_scores_normalised() -> None:
    # PreferredSchedulingTerms.Score sums the weights of the matching terms: zone a (80) and gen exists (20):
    # n1 80 + 20 = 100, n2 20, n3 20, n4 0; DefaultNormalizeScore: 100·s/100 → 100, 20, 20, 0.
    preferred = [{"weight": 80, "preference": {"matchExpressions": [expr("zone", "In", "a")]}},
                 {"weight": 20, "preference": {"matchExpressions": [expr("gen", "Exists")]}}]
    request = read(k8s_pod(affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}))
    state = cluster(*LABELLED)
    raw = state.preferred_weights(request.preferred_terms)
    assert raw.tolist() == [100, 20, 20, 0]
    assert default_normalize(raw).tolist() == [100.0, 20.0, 20.0, 0.0]
    for seed in range(8):  # binpack ties the four empty nodes; the preference picks n1 whatever the seed
        decision = framework(seed=seed).schedule(request, state)
        assert decision.assignment is not None and decision.assignment.node == "n1"


def test_a_pod_without_constraints_decides_exactly_as_without_the_constraint_scores() -> None:
    """No preference → every constraint score is 0: the same nodes, cards and random draws as a profile without
    them, decision after decision (random ties included)."""
    specs = [node(f"n{i}").gpus(4).label("zone", "ab"[i % 2]).obj() for i in range(6)]
    requests = [pod(f"p{i}").cpu(500).fraction(250 * (1 + i % 3)).obj() for i in range(30)]
    for policy in ("binpack", "spread"):
        with_scores = framework(policy, seed=3)
        base = with_scores.profile
        without = Framework(Profile(base.name, base.filters, base.scores[:1], base.picker, base.tie_break),
                            np.random.default_rng(3))
        assert [s.plugin.name for s in base.scores[1:]] == ["NodeAffinity", "TaintToleration"]
        a, b = cluster(*specs), cluster(*specs)
        for request in requests:
            da, db = with_scores.schedule(request, a), without.schedule(request, b)
            assert da.assignment == db.assignment
            if da.assignment is not None:
                a.place(request, da.assignment)
                b.place(request, db.assignment)  # type: ignore[arg-type]


# ============================================================================ constraints gpuplane does not implement

UNSUPPORTED_CASES: list[tuple[str, dict[str, Any], str]] = [
    # (id, pod, the field named). kube-scheduler's InterPodAffinity, PodTopologySpread, DynamicResources,
    # SchedulingGates, VolumeBinding/VolumeZone, NodePorts and NodeResourcesFit (other resources) plugins.
    ("pod-affinity", k8s_pod(affinity={"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "zone"}]}}), "spec.affinity.podAffinity"),
    ("pod-anti-affinity", k8s_pod(affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "podAffinityTerm": {"topologyKey": "zone"}}]}}), "spec.affinity.podAntiAffinity"),
    ("topology-spread", k8s_pod(topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone",
                                                            "whenUnsatisfiable": "DoNotSchedule"}]),
     "spec.topologySpreadConstraints"),
    ("resource-claims", k8s_pod(resourceClaims=[{"name": "gpu", "resourceClaimName": "c"}]), "spec.resourceClaims"),
    ("scheduling-gates", k8s_pod(schedulingGates=[{"name": "wait"}]), "spec.schedulingGates"),
    ("pvc", k8s_pod(volumes=[{"name": "cfg", "configMap": {"name": "c"}},
                             {"name": "data", "persistentVolumeClaim": {"claimName": "d"}}]),
     "spec.volumes[1].persistentVolumeClaim"),
    ("ephemeral-volume", k8s_pod(volumes=[{"name": "scratch", "ephemeral": {"volumeClaimTemplate": {}}}]),
     "spec.volumes[0].ephemeral"),
    ("host-port", k8s_pod(container(ports=[{"containerPort": 80}, {"containerPort": 81, "hostPort": 8081}])),
     "spec.containers[0].ports[1].hostPort"),
    ("other-resource", k8s_pod(container(requests={"cpu": "1", "ephemeral-storage": "10Gi"})),
     "spec.containers[0].resources[ephemeral-storage]"),
    ("other-stack-gpu", k8s_pod(init=(container("i", limits={"nvidia.com/gpu": "1"}),)),
     "spec.initContainers[0].resources[nvidia.com/gpu]"),
]


@pytest.mark.parametrize(("body", "field"), [c[1:] for c in UNSUPPORTED_CASES], ids=[c[0] for c in UNSUPPORTED_CASES])
def test_unsupported_constraints_are_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    request = read(body)
    assert request.unsupported == (field,)
    state = cluster(*LABELLED)
    decision = framework().schedule(request, state)
    # Refused on every node (4/4), unresolvably (no preemption), the message naming the field.
    assert decision.assignment is None and decision.status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    assert field in decision.status.message
    assert decision.diagnosis is not None and sum(decision.diagnosis.counts().values()) == 4


def test_empty_constraint_fields_are_no_constraint() -> None:
    main = container(ports=[{"containerPort": 80}], requests={"cpu": "1", "ephemeral-storage": "0"})
    body = k8s_pod(main, affinity={"podAntiAffinity": {}}, topologySpreadConstraints=[], schedulingGates=[],
                   volumes=[{"name": "cfg", "configMap": {"name": "c"}}])
    assert read(body).unsupported == ()


# ============================================================================ the other readers

def test_device_plugin_matches_sidecars_in_kubelets_order() -> None:
    # kubelet's device manager allocates init containers first: sidecar 4 units, then main 4; the pod's 8 cards
    # are split in runs: sidecar cards 0-3, main cards 4-7.
    body = k8s_pod(container(limits={GPU: "4"}), init=(container("side", limits={GPU: "4"}, sidecar=True),))
    units = container_units(body, GPU)
    assert units == (("side", 4), ("main", 4))
    shares = tuple(CardShare(c, 1000, 0, whole=True) for c in range(8))
    pending = PendingPod("ml/p", "u", Assignment("n", shares), 1.0, containers=units)
    for number, cards in ((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))):
        match = match_pod([pending], 4, {"u": number})
        assert match is not None and (match[1], tuple(s.card for s in match[2])) == (number, cards)


def test_device_plugin_reads_requests_with_limits_standing_in() -> None:
    body = k8s_pod(container("a", requests={GPU: "2"}), container("b", limits={GPU: "1"}), container("c"))
    assert container_units(body, GPU) == (("a", 2), ("b", 1))


def test_webhook_reads_through_the_codec() -> None:
    policy = AdmissionPolicy()

    def verdict(body: dict[str, Any]) -> tuple[bool, str]:
        result = policy.decide({"kind": {"group": "", "kind": "Pod"}, "operation": "CREATE", "object": body,
                                "userInfo": {"username": "alice"}})
        return result.allowed, result.message

    # A GPU asked in requests only is a GPU request: the webhook judges it; request ≠ limit can never be valid.
    allowed, message = verdict(k8s_pod(container(requests={GPU: "1"}, limits={GPU: "2"})))
    assert not allowed and f"spec.containers[0].resources.requests[{GPU}]" in message
    # A constraint gpuplane's scheduler does not implement is no invalid pod (kube-scheduler may place it).
    assert verdict(k8s_pod(container(requests={GPU: "1"}), topologySpreadConstraints=[{"maxSkew": 1}]))[0]


def test_the_manifest_reads_back_with_selectors_affinity_and_tolerations() -> None:
    term = NodeSelectorTerm((Requirement("zone", SelectorOp.IN, ("a", "b")), Requirement("gen", SelectorOp.GT, ("4",))),
                            (Requirement("metadata.name", SelectorOp.NOT_IN, ("n9",)),))
    request = make_request(
        CATALOG, "ml/p", cpu_milli=1000, gpu=WholeCards(1), pools=frozenset({"train"}),
        node_selector=(("rack", "r1"),), required_terms=(term, NodeSelectorTerm()),
        preferred_terms=(PreferredTerm(30, NodeSelectorTerm((Requirement("ssd", SelectorOp.EXISTS),))),),
        tolerations=(Toleration(), Toleration("spot", None, "PreferNoSchedule"), Toleration("zone", "", "NoSchedule")))
    read_back = read(pod_manifest(request))
    assert replace(read_back, labels=()) == replace(request, labels=())
    with pytest.raises(ValueError, match=r"spec\.schedulingGates"):
        pod_manifest(replace(request, unsupported=("spec.schedulingGates",)))
