"""The admission webhook over real HTTP and HTTPS: forged annotations, who may change them, GPU requests that can
never be valid, gpuplane's custom resources, and malformed reviews (HTTP 400, never a crash)."""

from __future__ import annotations

import copy
import http.client
import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.kube.objects import ASSIGNED_AT, ASSIGNMENT, BIND_PHASE, PHASE_ALLOCATED, PHASE_ALLOCATING
from gpuplane.kube.webhook import AdmissionPolicy, ReviewError, WebhookServer

SCHEDULER = "system:serviceaccount:gpuplane-system:gpuplane-scheduler"
EXTENDER = "system:serviceaccount:gpuplane-system:gpuplane-extender"
PLUGIN = "system:serviceaccount:gpuplane-system:gpuplane-node-agent"
USER = "alice@example.com"
POLICY = AdmissionPolicy(scheduler_accounts=frozenset({SCHEDULER, EXTENDER}),
                         device_plugin_accounts=frozenset({PLUGIN}))
ASSIGNMENT_JSON = '{"cards":[{"card":0,"mib":0,"milli":1000,"whole":true}],"node":"gpu-1"}'


def pod(name: str = "web", *, limits: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
        generate: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "ml", "annotations": dict(annotations or {})}
    meta["generateName" if generate else "name"] = name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c", "image": "img",
                                     "resources": {"limits": {"cpu": "1", "memory": "1Gi", **(limits or {})}}}]}}


def review(operation: str, obj: dict[str, Any] | None, *, old: dict[str, Any] | None = None, user: str = USER,
           kind: tuple[str, str, str] = ("", "v1", "Pod"), uid: str = "705ab4f5-6393-11e8-b7cc-42010a800002"
           ) -> dict[str, Any]:
    group, version, name = kind
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": group, "version": version, "kind": name},
        "resource": {"group": group, "version": version, "resource": name.lower() + "s"},
        "namespace": "ml", "operation": operation, "object": obj, "oldObject": old,
        "userInfo": {"username": user, "groups": ["system:authenticated"]}, "dryRun": False}}


def tidal(shrink_at: str = "22:30") -> dict[str, Any]:
    return {"apiVersion": "gpuplane.io/v1alpha1", "kind": "TidalPolicy", "metadata": {"name": "night"},
            "spec": {"services": [{"name": "chat", "minReplicas": 2, "maxReplicas": 10, "perReplicaCapacity": 5,
                                   "gpuMilliPerReplica": 1000}],
                     "windows": [{"name": "night", "shrinkAt": shrink_at, "lendFrom": "23:30", "reclaimAt": "07:30"}]}}


# ------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    server = WebhookServer(POLICY).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ssl.SSLContext, Path, Path]]:
    """A self-signed certificate for 127.0.0.1 made with the openssl CLI; a client that trusts only it."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "tls.crt", folder / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=gpuplane-webhook",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = WebhookServer(POLICY, cert=cert, key=key).start()
    yield server.url, ssl.create_default_context(cafile=str(cert)), cert, key
    server.stop()


def post(url: str, body: bytes | dict[str, Any], context: ssl.SSLContext | None = None,
         path: str = "/validate") -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def response(url: str, body: dict[str, Any], context: ssl.SSLContext | None = None) -> dict[str, Any]:
    status, answer = post(url, body, context)
    assert status == 200, answer
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == body["request"]["uid"]
    result: dict[str, Any] = answer["response"]
    if not result["allowed"]:
        assert result["status"]["code"] == 403
    return result


# ------------------------------------------------------------------ pods: CREATE
@pytest.mark.parametrize("annotation", [ASSIGNMENT, ASSIGNED_AT, BIND_PHASE])
@pytest.mark.parametrize("user", [USER, SCHEDULER])
def test_create_with_a_scheduler_annotation_is_rejected_naming_it(http_url: str, annotation: str, user: str) -> None:
    forged = pod(limits={"gpuplane.io/gpu": "1"}, annotations={annotation: "x", "team": "a"})
    answer = response(http_url, review("CREATE", forged, user=user))
    assert not answer["allowed"]
    assert f"metadata.annotations[{annotation}]" in answer["status"]["message"]
    assert "ml/web" in answer["status"]["message"]


@pytest.mark.parametrize("obj", [
    pod(),                                                               # no GPU at all
    pod(limits={"gpuplane.io/gpu": "2"}),                                # two whole cards
    pod(limits={"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "30", "gpuplane.io/gpumem": "8000"}),  # a share
    pod(limits={"gpuplane.io/gpu": "2", "gpuplane.io/gpumem": "4000"}),  # HAMi: 4000 MiB on each of two cards
    pod("web-", limits={"gpuplane.io/gpu": "1"}, generate=True),         # generateName: no name yet
    pod(annotations={"prometheus.io/scrape": "true"}),
], ids=["plain", "whole-cards", "share", "shares-on-two-cards", "generate-name", "other-annotations"])
def test_ordinary_pods_are_allowed(http_url: str, obj: dict[str, Any]) -> None:
    assert response(http_url, review("CREATE", obj))["allowed"]


@pytest.mark.parametrize(("limits", "field"), [
    ({"gpuplane.io/gpu": "1", "gpuplane.io/gpucores": "150"}, "resources[gpuplane.io/gpucores]"),  # > 100 %
    ({"gpuplane.io/gpu": "1.5"}, "resources[gpuplane.io/gpu]"),                              # not whole
    ({"gpuplane.io/gpu": "lots"}, "spec.containers[0].resources[gpuplane.io/gpu]"),         # not a quantity
])
def test_a_gpu_request_that_can_never_be_valid_is_rejected_naming_the_field(
        http_url: str, limits: dict[str, str], field: str) -> None:
    answer = response(http_url, review("CREATE", pod(limits=limits)))
    assert not answer["allowed"]
    assert f"pod ml/web: {field}: " in answer["status"]["message"]


def test_an_unknown_qos_is_checked_only_for_gpu_pods(http_url: str) -> None:
    # pod_request would refuse the QoS label, but the pod asks for no gpuplane resource: not ours to judge.
    plain = pod()
    plain["metadata"]["labels"] = {"gpuplane.io/qos": "gold"}
    assert response(http_url, review("CREATE", plain))["allowed"]
    gpu = copy.deepcopy(plain)
    gpu["spec"]["containers"][0]["resources"]["limits"]["gpuplane.io/gpu"] = "1"
    answer = response(http_url, review("CREATE", gpu))
    assert not answer["allowed"] and "metadata.labels[gpuplane.io/qos]" in answer["status"]["message"]


# ------------------------------------------------------------------ pods: UPDATE
BOUND = pod(limits={"gpuplane.io/gpu": "1"})
RECORDED = pod(limits={"gpuplane.io/gpu": "1"}, annotations={
    ASSIGNMENT: ASSIGNMENT_JSON, ASSIGNED_AT: "1764430000.000000", BIND_PHASE: PHASE_ALLOCATING})


def with_notes(base: dict[str, Any], **changes: str | None) -> dict[str, Any]:
    out = copy.deepcopy(base)
    notes = out["metadata"]["annotations"]
    for key, value in changes.items():
        name = {"assignment": ASSIGNMENT, "assigned_at": ASSIGNED_AT, "phase": BIND_PHASE}.get(key, key)
        if value is None:
            notes.pop(name, None)
        else:
            notes[name] = value
    return out


@pytest.mark.parametrize(("old", "new", "user", "allowed", "named"), [
    # the scheduler (or extender) records an assignment before binding
    (BOUND, RECORDED, SCHEDULER, True, None),
    (BOUND, RECORDED, EXTENDER, True, None),
    # a user may not record one, change one or remove one
    (BOUND, RECORDED, USER, False, ASSIGNED_AT),
    (RECORDED, with_notes(RECORDED, assignment=ASSIGNMENT_JSON.replace("gpu-1", "gpu-2")), USER, False, ASSIGNMENT),
    (RECORDED, with_notes(RECORDED, assignment=None), USER, False, ASSIGNMENT),
    # a user may change other annotations of a pod that carries an assignment
    (RECORDED, with_notes(RECORDED, team="b"), USER, True, None),
    # the device plugin moves bind-phase only
    (RECORDED, with_notes(RECORDED, phase=PHASE_ALLOCATED), PLUGIN, True, None),
    (RECORDED, with_notes(RECORDED, phase=PHASE_ALLOCATED, assignment=ASSIGNMENT_JSON.replace("1000", "500")),
     PLUGIN, False, ASSIGNMENT),
    (BOUND, RECORDED, PLUGIN, False, ASSIGNED_AT),
    # a user may not move bind-phase either
    (RECORDED, with_notes(RECORDED, phase=PHASE_ALLOCATED), USER, False, BIND_PHASE),
], ids=["scheduler-records", "extender-records", "user-records", "user-changes", "user-removes", "user-other",
        "plugin-phase", "plugin-assignment", "plugin-records", "user-phase"])
def test_who_may_change_the_scheduler_annotations(http_url: str, old: dict[str, Any], new: dict[str, Any],
                                                  user: str, allowed: bool, named: str | None) -> None:
    answer = response(http_url, review("UPDATE", new, old=old, user=user))
    assert answer["allowed"] is allowed
    if named is not None:
        assert f"metadata.annotations[{named}]" in answer["status"]["message"]


def test_delete_and_connect_are_allowed(http_url: str) -> None:
    assert response(http_url, review("DELETE", None, old=RECORDED))["allowed"]
    assert response(http_url, review("CONNECT", None))["allowed"]


# ------------------------------------------------------------------ custom resources
@pytest.mark.parametrize(("obj", "message"), [
    (tidal(), None),
    (tidal("25:00"), "spec.windows[0].shrinkAt: "),
    ({**tidal(), "spec": {**tidal()["spec"], "services": []}}, "spec.services: "),
    ({"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": "a100"},
      "spec": {"models": ["A100-80GB"], "split": 4}}, None),
    ({"apiVersion": "gpuplane.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": "a100"},
      "spec": {"models": ["Z9000"]}}, "spec.models[0]: unknown GPU model 'Z9000'"),
    ({"apiVersion": "gpuplane.io/v1alpha1", "kind": "ColocationPolicy", "metadata": {"name": "c"},
      "spec": {"growthFactor": -1}}, "spec.growthFactor: "),
])
def test_custom_resources_are_validated_naming_the_field(http_url: str, obj: dict[str, Any],
                                                         message: str | None) -> None:
    answer = response(http_url, review("CREATE", obj, kind=("gpuplane.io", "v1alpha1", obj["kind"])))
    assert answer["allowed"] is (message is None)
    if message is not None:
        assert message in answer["status"]["message"]
    assert response(http_url, review("UPDATE", obj, old=tidal(), kind=("gpuplane.io", "v1alpha1", obj["kind"])
                                     ))["allowed"] is (message is None)


# ------------------------------------------------------------------ malformed
@pytest.mark.parametrize(("body", "says"), [
    (b"{not json", "malformed"),
    (b"[]", "not a JSON object"),
    (json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1beta1", "request": {}}).encode(),
     "not an AdmissionReview admission.k8s.io/v1"),
    (json.dumps({"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}).encode(), "request: missing"),
    (json.dumps({**review("CREATE", pod()), "request": {**review("CREATE", pod())["request"], "uid": ""}}).encode(),
     "request.uid"),
    (json.dumps({**review("CREATE", pod()), "request": {**review("CREATE", pod())["request"], "kind": "Pod"}}).encode(),
     "request.kind"),
    (json.dumps(review("UPDATE", RECORDED, old=None)).encode(), "request.oldObject"),
    (json.dumps(review("CREATE", None)).encode(), "request.object"),
    (json.dumps(review("CREATE", {**pod(), "metadata": "x"})).encode(), "request.object.metadata"),
])
def test_a_malformed_review_is_a_400_with_a_message(http_url: str, body: bytes, says: str) -> None:
    status, answer = post(http_url, body)
    assert status == 400
    assert says in answer["message"]


def test_empty_body_wrong_path_and_health(http_url: str) -> None:
    host, port = http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("POST", "/validate", body=b"", headers={"Content-Length": "0"})
    assert connection.getresponse().status == 400
    connection.close()
    assert post(http_url, review("CREATE", pod()), path="/mutate")[0] == 404
    with urllib.request.urlopen(http_url + "/healthz", timeout=10) as answer:
        assert answer.status == 200


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
REQUEST_KEYS = st.sampled_from(["uid", "kind", "operation", "object", "oldObject", "userInfo", "namespace", "name"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(REQUEST_KEYS, JSON | st.just({"kind": "Pod", "group": ""}) | st.just(pod()), max_size=8),
       st.sampled_from(["CREATE", "UPDATE", "DELETE"]))
def test_any_request_is_answered_or_refused_as_malformed_never_a_crash(request: dict[str, Any], op: str) -> None:
    body = review(op, pod())
    body["request"].update(request)
    try:
        answer = POLICY.review(body)
    except ReviewError as exc:
        assert str(exc)
    else:
        assert isinstance(answer["response"]["allowed"], bool)


# ------------------------------------------------------------------ HTTPS
def test_the_same_rules_over_https(tls: tuple[str, ssl.SSLContext, Path, Path]) -> None:
    url, context, _, _ = tls
    assert url.startswith("https://127.0.0.1:")
    assert response(url, review("CREATE", pod(limits={"gpuplane.io/gpu": "1"})), context)["allowed"]
    forged = response(url, review("CREATE", RECORDED), context)
    assert not forged["allowed"] and ASSIGNED_AT in forged["status"]["message"]
    assert response(url, review("UPDATE", RECORDED, old=BOUND, user=SCHEDULER), context)["allowed"]
    assert post(url, b"{", context)[0] == 400


def test_https_refuses_a_client_that_does_not_trust_the_certificate(tls: tuple[str, ssl.SSLContext, Path, Path]
                                                                   ) -> None:
    url, _, _, _ = tls
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        post(url, review("CREATE", pod()), ssl.create_default_context())


def test_a_missing_certificate_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        WebhookServer(POLICY, cert=tmp_path / "none.crt", key=tmp_path / "none.key")


def test_the_webhook_command_serves_https_until_sigterm(tls: tuple[str, ssl.SSLContext, Path, Path]) -> None:
    import os
    import signal
    import socket
    import sys
    import time

    _, context, cert, key = tls
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = ("import typer; from gpuplane.cli.operator_cmd import register; app = typer.Typer(); register(app); "
              "app()")
    child = subprocess.Popen([sys.executable, "-c", script, "webhook", "--addr", "127.0.0.1", "--port", str(port),
                              "--cert", str(cert), "--key", str(key),
                              "--scheduler-account", "system:serviceaccount:x:sched"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                answer = response(url, review("UPDATE", RECORDED, old=BOUND, user="system:serviceaccount:x:sched"),
                                  context)
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline and child.poll() is None, child.stdout and child.stdout.read()
                time.sleep(0.05)
        assert answer["allowed"]          # the account given by --scheduler-account
        assert not response(url, review("UPDATE", RECORDED, old=BOUND, user=SCHEDULER), context)["allowed"]
    finally:
        child.send_signal(signal.SIGTERM)
        assert child.wait(20) == 0
