"""Malformed bodies at every verb of the extender, over real HTTP: always an answer, never a 5xx or a crash.

What an answer must be: filter and bind answer HTTP 200 with their result type (with `Error` set when the
body was unreadable); prioritize and preempt answer 200 with their result, or 4xx with `{"Error": …}`.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import CATALOG, node
from gpuplane.cli.extender_cmd import build_profile, sample_pod
from gpuplane.kube.extender import VERBS, Extender, ExtenderServer
from gpuplane.kube.objects import ObjectError, pod_request
from gpuplane.sim.cluster import SimCluster

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NODES = ["n1", "n2", "t4"]


class Conn:
    """A keep-alive connection that reconnects when the server closed it (after a 4xx that must close)."""

    def __init__(self, server: ExtenderServer) -> None:
        self.server = server
        self.conn = http.client.HTTPConnection(*server.address, timeout=30)

    def post(self, verb: str, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", f"{self.server.prefix}/{verb}", body,
                                  {"Content-Type": "application/json"})
                response = self.conn.getresponse()
                data = response.read()
                if response.will_close:
                    self.conn.close()
                return response.status, data
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def conn() -> Iterator[Conn]:
    world = SimCluster(CATALOG, [node("n1").gpus(2, model="A100-40GB").obj(),
                                 node("n2").gpus(4, model="A100-40GB").obj(), node("t4").gpus(2, model="T4").obj()])
    extender = Extender(world, CATALOG, build_profile("binpack", None))
    server = ExtenderServer(extender, port=0).start()
    client = Conn(server)
    yield client
    client.conn.close()
    server.close()
    extender.close()


# ------------------------------------------------------------------ strategies
json_scalars = st.one_of(
    st.none(), st.booleans(), st.text(max_size=20),
    st.integers(min_value=-(10**30), max_value=10**30),  # past int64 both ways
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 2**63, -(2**63) - 1]),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=20)


def valid(verb: str) -> dict[str, Any]:
    pod = sample_pod("fuzz", cards=1)
    if verb in ("filter", "prioritize"):
        return {"Pod": pod, "Nodes": None, "NodeNames": list(NODES)}
    if verb == "bind":
        return {"PodName": "fuzz", "PodNamespace": "default", "PodUID": "uid-fuzz", "Node": "n1"}
    return {"Pod": pod, "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "u1"}], "NumPDBViolations": 0}}}


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `doc` (dict keys and list indexes)."""
    found = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found.extend(_paths(value, (*prefix, i)))
    return found


@st.composite
def mutated(draw: st.DrawFn, verb: str) -> bytes:
    """A valid body with one part broken: a value replaced by garbage, a key dropped or its case changed."""
    doc = valid(verb)
    paths = _paths(doc)
    path = draw(st.sampled_from(paths))
    parent: Any = doc
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    action = draw(st.sampled_from(["replace", "drop", "case"] if isinstance(parent, dict) else ["replace"]))
    if action == "replace":
        parent[last] = draw(json_values)
    elif action == "drop":
        del parent[last]
    else:
        value = parent.pop(last)
        parent[draw(st.sampled_from([str(last).lower(), str(last).upper(), str(last).swapcase()]))] = value
    return json.dumps(doc).encode()


def junk() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.sampled_from([b"", b"{", b"[]", b"null", b'{"Pod":', b"\xff\xfe{}", b"1" * 5000,  # 5,000 digits: past
                         b"[" * 5000 + b"]" * 5000,  # Python's digit limit; nesting past the recursion limit
                         b'{"Pod":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}"]),
    )


def garbage_pod() -> st.SearchStrategy[bytes]:
    """A well-formed request whose Pod is nested garbage in the places objects.py reads."""
    pod_parts = st.fixed_dictionaries({}, optional={
        "metadata": json_values, "spec": st.one_of(json_values, st.fixed_dictionaries({}, optional={
            "containers": st.one_of(json_values, st.lists(st.fixed_dictionaries({}, optional={
                "resources": st.one_of(json_values, st.fixed_dictionaries({}, optional={
                    "limits": st.dictionaries(st.sampled_from(["gpuplane.io/gpu", "gpuplane.io/gpucores",
                                                               "gpuplane.io/gpumem", "cpu", "memory"]),
                                              json_values, max_size=3),
                    "requests": json_values}))}), max_size=2)),
            "initContainers": json_values, "priority": json_values, "tolerations": json_values,
            "nodeSelector": json_values, "preemptionPolicy": json_values}))})
    return pod_parts.map(lambda pod: json.dumps({"Pod": {**pod, "metadata": pod.get("metadata", {"name": "g"})},
                                                 "NodeNames": NODES}).encode())


# ------------------------------------------------------------------ the property
def check(verb: str, status: int, data: bytes) -> None:
    assert status < 500, (verb, status, data[:300])
    body = json.loads(data)
    if verb == "filter":
        assert status == 200
        assert list(body) == ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
    elif verb == "bind":
        assert status == 200 and list(body) == ["Error"]
    elif status == 200:
        assert isinstance(body, list) if verb == "prioritize" else list(body) == ["NodeNameToMetaVictims"]
    else:
        assert 400 <= status < 500 and isinstance(body.get("Error"), str) and body["Error"]


def still_serving(conn: Conn) -> None:
    status, data = conn.post("filter", json.dumps(valid("filter")).encode())
    answer = json.loads(data)
    # Filter answers gpuplane's one pick (filter answers "chosen"); the other nodes are failed as placed elsewhere.
    assert status == 200 and not answer["Error"] and len(answer["NodeNames"]) == 1
    assert sorted(answer["NodeNames"] + list(answer["FailedAndUnresolvableNodes"])) == sorted(NODES)


@pytest.mark.parametrize("verb", VERBS)
@FUZZ
@given(data=st.data())
def test_malformed_bodies_get_an_error_answer(conn: Conn, verb: str, data: st.DataObject) -> None:
    body = data.draw(st.one_of(junk(), mutated(verb), garbage_pod()))
    status, answer = conn.post(verb, body)
    check(verb, status, answer)
    try:
        json.loads(body)
        readable = True
    except (ValueError, RecursionError):
        readable = False
    if not readable:  # not JSON at all: an error answer for certain
        assert status >= 400 or json.loads(answer)["Error"]
    still_serving(conn)


@pytest.mark.parametrize("verb", VERBS)
def test_unreadable_bodies_are_errors_per_verb(conn: Conn, verb: str) -> None:
    for body in (b"{oops", b"[]", b'{"Pod": []}', b"[" * 5000 + b"]" * 5000):
        status, answer = conn.post(verb, body)
        check(verb, status, answer)
        error = json.loads(answer)["Error"]
        assert error
        assert status == (200 if verb in ("filter", "bind") else 400)
    still_serving(conn)


# ------------------------------------------------------------------ found by the fuzz test (fixed in objects.py)
@pytest.mark.parametrize("spec", [
    {"containers": True},  # _containers iterates it
    {"containers": [{"resources": [1]}]},  # resources.get on a list
    {"containers": [], "initContainers": True},  # iterated
    {"containers": [], "tolerations": 63},  # iterated
    {"containers": [], "priority": {"a": 1}},  # int() of a dict
])
def test_pod_request_names_the_field_of_ill_typed_pods(spec: dict[str, Any]) -> None:
    with pytest.raises(ObjectError):
        pod_request({"metadata": {"name": "p", "namespace": "default"}, "spec": spec}, CATALOG)
