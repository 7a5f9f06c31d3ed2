"""`gpuplane.kube.snapshot`: a hand-made `kubectl get nodes,pods -A -o json` dump read exactly, bad dumps refused
with every problem named by file, object and field, the API path equal to the file path, and `gpuplane snapshot`."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from gpuplane.cli import snapshot_cmd
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import encode_assignment
from gpuplane.kube.snapshot import (
    CLUSTER_FILE,
    Skipped,
    Snapshot,
    SnapshotError,
    Stack,
    load_api,
    load_files,
    load_snapshot,
    read_objects,
)
from gpuplane.model import Assignment, CardShare, Fraction, WholeCards, default_catalog
from gpuplane.sim.trace import load_nodes, load_pods
from gpuplane.sim.whatif import write_snapshot

CATALOG = default_catalog()
FIXTURE = Path(__file__).parent / "fixtures" / "snapshot" / "cluster.json"
Doc = dict[str, Any]


def fixture_doc() -> Doc:
    doc: Doc = json.loads(FIXTURE.read_text())
    return doc


@pytest.fixture(scope="module")
def snap() -> Snapshot:
    return load_files(FIXTURE, CATALOG)


# ------------------------------------------------------------------ the fixture, read exactly
@pytest.mark.parametrize(("node", "model", "gpus", "cpu_milli", "memory_mib", "foreign"), [
    ("cpu-01", None, 0, 15_500, 60_000, ()),
    ("gpu-a100-01", "A100-80GB", 8, 95_500, 1_031_500, ()),  # allocatable cpu 95500m, memory 1031500Mi
    ("gpu-t4-01", "T4", 4, 47_500, 186_000, ()),
    ("gpu-v100-01", "V100-32GB", 8, 63_500, 487_000, (6, 7)),  # its foreign-cards report: ml/legacy-train-0 on 6, 7
])
def test_nodes_are_read_with_their_cards(snap: Snapshot, node: str, model: str | None, gpus: int, cpu_milli: int,
                                         memory_mib: int, foreign: tuple[int, ...]) -> None:
    spec = {n.name: n for n in snap.nodes}[node]
    assert (spec.gpu_model, spec.gpus, spec.cpu_milli, spec.memory_mib) == (model, gpus, cpu_milli, memory_mib)
    assert tuple(sorted(spec.foreign_cards)) == foreign


@pytest.mark.parametrize(("pod", "node", "stack", "cards", "milli_per_card"), [
    ("ml/legacy-train-0", "gpu-v100-01", Stack.FOREIGN, (6, 7), None),  # nvidia.com/gpu: 2, cards from the report
    ("ml/train-llm-0", "gpu-a100-01", Stack.GPUPLANE, (0, 1, 2, 3), 1000),
    ("monitoring/prometheus-k8s-0", "cpu-01", Stack.NONE, (), None),
    ("research/eval-2", "gpu-v100-01", Stack.GPUPLANE, (0,), 1000),
    ("research/notebook-3", "gpu-t4-01", Stack.GPUPLANE, (0,), 300),  # gpucores 30 → 300 milli
    ("serve/embed-7f9c5d8b6-q8w7n", "gpu-a100-01", Stack.GPUPLANE, (4,), 500),
    ("serve/embed-7f9c5d8b6-x2k4p", "gpu-a100-01", Stack.GPUPLANE, (4,), 500),  # two halves of card 4
])
def test_running_pods_keep_their_cards(snap: Snapshot, pod: str, node: str, stack: Stack, cards: tuple[int, ...],
                                       milli_per_card: int | None) -> None:
    running = {p.name: p for p in snap.running}[pod]
    assert (running.assignment.node, running.stack) == (node, stack)
    if stack is Stack.FOREIGN:
        assert (running.assignment.cards, running.foreign_cards) == ((), cards)
    else:
        assert running.assignment.card_indexes == cards
        assert all(s.compute_milli == milli_per_card for s in running.assignment.cards)


def test_running_pods_are_exactly_those_bound(snap: Snapshot) -> None:
    # 8 pods are bound in the dump; the Succeeded one holds nothing, so 7 run.
    assert [p.name for p in snap.running] == [
        "ml/legacy-train-0", "ml/train-llm-0", "monitoring/prometheus-k8s-0", "research/eval-2",
        "research/notebook-3", "serve/embed-7f9c5d8b6-q8w7n", "serve/embed-7f9c5d8b6-x2k4p"]


def test_pending_pods_oldest_first(snap: Snapshot) -> None:
    assert [(p.name, p.request.gpu) for p in snap.pending] == [
        ("ml/train-llm-big-0", WholeCards(8)),  # created 09:41:00
        ("research/finetune-1", WholeCards(2)),  # 09:50:00
        ("serve/embed-7f9c5d8b6-m3v9z", Fraction(compute_milli=500, memory_mib=20000)),  # 09:55:10
        ("research/notebook-4", Fraction(compute_milli=300, memory_mib=6000)),  # 09:58:30
    ]


def test_what_is_left_out_is_said(snap: Snapshot) -> None:
    reasons = {s.obj: s.reason for s in snap.skipped}
    assert set(reasons) == {"pod ml/preprocess-28391-4xk2d", "pod ml/legacy-train-1",
                            "pod default/report-cron-28391720-zt5kq"}
    assert "finished (Succeeded)" in reasons["pod ml/preprocess-28391-4xk2d"]
    assert "nvidia.com/gpu" in reasons["pod ml/legacy-train-1"]
    assert "kube-scheduler" in reasons["pod default/report-cron-28391720-zt5kq"]


def test_the_moment_and_ages(snap: Snapshot) -> None:
    # The latest time recorded: the GPU nodes' Ready heartbeat, 2026-11-30T10:00:00Z = 1796032800.
    assert snap.taken_at == 1_796_032_800.0
    running = {p.name: p for p in snap.running}
    # train-llm-0 was assigned at 06:40:07: 3 h 19 min 53 s = 11993 s before.
    assert snap.age_s(running["ml/train-llm-0"]) == 11_993.0


ITEMS = len(fixture_doc()["items"])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.permutations(range(ITEMS)))
def test_the_order_of_the_dump_does_not_matter(snap: Snapshot, order: list[int]) -> None:
    items = fixture_doc()["items"]
    shuffled = [items[i] for i in order]
    assert read_objects([("shuffled", [(i["kind"], i) for i in shuffled])], CATALOG) == snap


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into `obj` (keys and indexes), the kind excepted (it chooses the codec)."""
    found = [prefix] if prefix and prefix != ("kind",) else []
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found += _paths(value, (*prefix, i))
    return found


JUNK = st.sampled_from([None, 0, -1, 1.5, "", "x", "-3", [], {}, [1], {"a": 1}, True, "1e400", "9" * 30, "DELETE"])


@settings(max_examples=150, deadline=None)
@given(st.data(), JUNK)
def test_a_damaged_dump_is_read_whole_or_refused_by_name(data: st.DataObject, junk: Any) -> None:
    doc = fixture_doc()
    items = doc["items"]
    item = data.draw(st.integers(0, len(items) - 1))
    path = data.draw(st.sampled_from(_paths(items[item])))
    target = items[item]
    for key in path[:-1]:
        target = target[key]
    if junk == "DELETE" and isinstance(target, dict):
        del target[path[-1]]
    else:
        target[path[-1]] = junk
    try:
        read = read_objects([("dump.json", [(i["kind"], i) for i in items])], CATALOG)
    except SnapshotError as exc:
        assert exc.problems and all(p.source == "dump.json" and p.obj and p.field for p in exc.problems)
        return
    # Read whole: and what `gpuplane snapshot` keeps of it reads the same.
    assert read_objects([("kept", [(o["kind"], o) for o in read.objects])], CATALOG) == read


# ------------------------------------------------------------------ bad dumps
Mutation = Callable[[Doc], None]


def _item(doc: Doc, kind: str, key: str) -> Doc:
    for item in doc["items"]:
        meta = item["metadata"]
        name = f"{meta.get('namespace')}/{meta['name']}" if kind == "Pod" else meta["name"]
        if item["kind"] == kind and name == key:
            found: Doc = item
            return found
    raise KeyError(key)


def _drop_allocatable(doc: Doc) -> None:
    del _item(doc, "Node", "gpu-t4-01")["status"]["allocatable"]


def _drop_containers(doc: Doc) -> None:
    del _item(doc, "Pod", "research/finetune-1")["spec"]["containers"]


def _drop_phase(doc: Doc) -> None:
    del _item(doc, "Pod", "serve/embed-7f9c5d8b6-m3v9z")["status"]["phase"]


def _bad_cpu(doc: Doc) -> None:
    _item(doc, "Pod", "research/notebook-4")["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "two"


def _bad_memory(doc: Doc) -> None:
    _item(doc, "Node", "gpu-a100-01")["status"]["allocatable"]["memory"] = "lots"


def _assign(pod: Doc, assignment: Assignment) -> None:
    pod["metadata"]["annotations"]["gpuplane.io/assignment"] = encode_assignment(assignment)
    pod["spec"]["nodeName"] = assignment.node


def _card_the_node_lacks(doc: Doc) -> None:
    # gpu-t4-01 has cards 0-3.
    _assign(_item(doc, "Pod", "research/notebook-3"), Assignment("gpu-t4-01", (CardShare(9, 300, 6000),)))


def _unknown_node(doc: Doc) -> None:
    _assign(_item(doc, "Pod", "research/eval-2"),
            Assignment("gpu-h100-07", (CardShare(0, 1000, 81920, whole=True),)))


def _same_whole_card(doc: Doc) -> None:
    twin = copy.deepcopy(_item(doc, "Pod", "research/eval-2"))  # whole card 0 of gpu-v100-01
    twin["metadata"]["name"] = "eval-3"
    doc["items"].append(twin)


def _foreign_card(doc: Doc) -> None:
    # Card 6 of gpu-v100-01 is held by ml/legacy-train-0 (nvidia.com/gpu).
    _assign(_item(doc, "Pod", "research/eval-2"),
            Assignment("gpu-v100-01", (CardShare(6, 1000, 32510, whole=True),)))


def _no_assignment(doc: Doc) -> None:
    del _item(doc, "Pod", "ml/train-llm-0")["metadata"]["annotations"]["gpuplane.io/assignment"]


def _unreported_foreign_pod(doc: Doc) -> None:
    legacy = copy.deepcopy(_item(doc, "Pod", "ml/legacy-train-0"))
    legacy["metadata"]["name"] = "legacy-train-9"  # runs, but the node's report names only legacy-train-0
    doc["items"].append(legacy)


A = "metadata.annotations[gpuplane.io/assignment]"
BAD = [
    ("missing allocatable", [_drop_allocatable], [("node gpu-t4-01", "status.allocatable", "missing")]),
    ("missing containers", [_drop_containers], [("pod research/finetune-1", "spec.containers", "missing")]),
    ("missing phase", [_drop_phase], [("pod serve/embed-7f9c5d8b6-m3v9z", "status.phase", "missing")]),
    ("bad pod quantity", [_bad_cpu],
     [("pod research/notebook-4", "spec.containers[0].resources[cpu]", "not a Kubernetes quantity: 'two'")]),
    ("bad node quantity", [_bad_memory],
     [("node gpu-a100-01", "status.allocatable[memory]", "not a Kubernetes quantity: 'lots'")]),
    ("a card the node lacks", [_card_the_node_lacks], [("pod research/notebook-3", A, "card 9 does not exist")]),
    ("unknown node", [_unknown_node], [("pod research/eval-2", "spec.nodeName", "'gpu-h100-07' is not in")]),
    ("two pods on one whole card", [_same_whole_card],
     [("pod research/eval-3", A, "already placed there: research/eval-2")]),
    ("a card another stack holds", [_foreign_card], [("pod research/eval-2", A, "held by another GPU stack")]),
    ("bound without an assignment", [_no_assignment], [("pod ml/train-llm-0", A, "missing on a bound pod")]),
    ("a foreign pod the report misses", [_unreported_foreign_pod],
     [("pod ml/legacy-train-9", "spec.nodeName", "names no card for it")]),
    # Every problem at once, none hiding another; in the order they are found: nodes, then the pods' fields, then the
    # codec and placements (the A100 node is unreadable, so the pods bound to it go unchecked: its problem says why).
    ("all at once", [_drop_containers, _drop_phase, _bad_cpu, _bad_memory, _unknown_node, _same_whole_card],
     [("node gpu-a100-01", "status.allocatable[memory]", "'lots'"),
      ("pod research/finetune-1", "spec.containers", "missing"),
      ("pod serve/embed-7f9c5d8b6-m3v9z", "status.phase", "missing"),
      ("pod research/eval-2", "spec.nodeName", "'gpu-h100-07'"),
      ("pod research/notebook-4", "spec.containers[0].resources[cpu]", "'two'"),
      ("pod research/eval-3", "spec.nodeName", "'gpu-h100-07'")]),  # the copy of eval-2, made after it moved
]


@pytest.mark.parametrize(("case", "mutations", "expected"), BAD, ids=[c[0] for c in BAD])
def test_bad_dumps_are_refused_naming_file_object_and_field(tmp_path: Path, case: str, mutations: list[Mutation],
                                                             expected: list[tuple[str, str, str]]) -> None:
    doc = fixture_doc()
    for mutate in mutations:
        mutate(doc)
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SnapshotError) as caught:
        load_files(path, CATALOG)
    problems = caught.value.problems
    assert len(problems) == len(expected), [str(p) for p in problems]
    for (obj, field, words), problem in zip(expected, problems, strict=True):
        assert (problem.source, problem.obj, problem.field) == (str(path), obj, field)
        assert words in problem.message
        assert str(problem) in str(caught.value)


def test_every_pod_that_does_not_fit_is_named(tmp_path: Path) -> None:
    # Binding goes on past a pod that does not fit: both are listed, in name order (eval-3 before notebook-3).
    doc = fixture_doc()
    _same_whole_card(doc)
    _card_the_node_lacks(doc)
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SnapshotError) as caught:
        load_files(path, CATALOG)
    assert [(p.obj, p.field) for p in caught.value.problems] == [
        ("pod research/eval-3", A), ("pod research/notebook-3", A)]


@pytest.mark.parametrize(("content", "field", "words"), [
    ("{not json", "-", "not JSON (line 1"),
    ('{"kind": "ServiceList", "items": 3}', "items", "missing or not a list"),
    ('{"kind": "Deployment"}', "kind", "not a List, Node or Pod"),
    ("[1, 2]", "-", "not a Kubernetes object"),
])
def test_a_bad_file_in_a_directory_is_named_beside_the_good_ones(tmp_path: Path, content: str, field: str,
                                                                  words: str) -> None:
    (tmp_path / "a-good.json").write_text(FIXTURE.read_text())
    (tmp_path / "b-bad.json").write_text(content)
    with pytest.raises(SnapshotError) as caught:
        load_files(tmp_path, CATALOG)
    [problem] = caught.value.problems
    assert (problem.source, problem.field) == (str(tmp_path / "b-bad.json"), field)
    assert words in problem.message


def test_a_directory_of_dumps_reads_as_one(tmp_path: Path, snap: Snapshot) -> None:
    items = fixture_doc()["items"]
    (tmp_path / "nodes.json").write_text(json.dumps({"kind": "List", "items": [i for i in items
                                                                                if i["kind"] == "Node"]}))
    pods = [{k: v for k, v in i.items() if k != "kind"} for i in items if i["kind"] == "Pod"]
    (tmp_path / "pods.json").write_text(json.dumps({"kind": "PodList", "items": pods}))  # items without kind
    (tmp_path / "NOTES.txt").write_text("dumped at 10:00")
    read = load_files(tmp_path, CATALOG)
    assert (read.nodes, read.running, read.pending) == (snap.nodes, snap.running, snap.pending)
    assert read.skipped == tuple(sorted((Skipped(str(tmp_path / "NOTES.txt"), "not a .json file"), *snap.skipped),
                                        key=lambda k: k.obj))
    assert read.sources == (str(tmp_path / "nodes.json"), str(tmp_path / "pods.json"))


def test_a_pod_listed_twice_differently_is_a_problem(tmp_path: Path) -> None:
    items = fixture_doc()["items"]
    (tmp_path / "one.json").write_text(json.dumps({"kind": "List", "items": items}))
    changed = copy.deepcopy(items)
    _item({"items": changed}, "Pod", "research/eval-2")["metadata"]["labels"]["extra"] = "x"
    (tmp_path / "two.json").write_text(json.dumps({"kind": "List", "items": changed}))
    with pytest.raises(SnapshotError) as caught:
        load_files(tmp_path, CATALOG)
    [problem] = caught.value.problems
    assert (problem.source, problem.obj) == (str(tmp_path / "two.json"), "pod research/eval-2")
    assert str(tmp_path / "one.json") in problem.message


# ------------------------------------------------------------------ the API path
def test_the_api_path_gives_the_same_snapshot(snap: Snapshot) -> None:
    with FakeApiServer() as server:
        for item in fixture_doc()["items"]:
            if item["kind"] == "Node":
                server.add_node(item)
            else:
                server.add_pod(item)
        read = load_api(server.api, CATALOG)
    assert read == snap
    assert read.skipped == snap.skipped
    assert read.sources == ("/api/v1/nodes", "/api/v1/pods")


# ------------------------------------------------------------------ what `gpuplane snapshot` writes
def test_the_written_files_read_back(tmp_path: Path, snap: Snapshot) -> None:
    written = write_snapshot(snap, tmp_path)
    again = load_snapshot(tmp_path, CATALOG)  # reads CLUSTER_FILE, the trimmed objects
    assert again == snap
    kept = (tmp_path / CLUSTER_FILE).read_text()
    assert "HF_TOKEN" not in kept and "nvcr.io" not in kept  # no environment, no images
    nodes = {n.name: n for n in load_nodes(tmp_path / "nodes.csv", CATALOG)}
    assert {(n.name, n.cpu_milli, n.memory_mib, n.gpus, n.gpu_model) for n in nodes.values()} == \
        {(n.name, n.cpu_milli, n.memory_mib, n.gpus, n.gpu_model) for n in snap.nodes}
    pods = {p.request.name: p.request for p in load_pods(tmp_path / "pods.csv", CATALOG)}
    ours = [p.request for p in snap.running_of(Stack.GPUPLANE)] + [p.request for p in snap.pending]
    assert {r.name: (r.cpu_milli, r.memory_mib, r.gpu) for r in ours} == \
        {r.name: (r.cpu_milli, r.memory_mib, r.gpu) for r in pods.values()}
    assert written.pods_written == 9 and written.left_out == ()  # 5 running + 4 pending, all expressible
    rows = (tmp_path / "running.csv").read_text().splitlines()
    assert "ml/legacy-train-0,gpu-v100-01,foreign,16000,131072,6;7,1000;1000,;,1796023802" in rows
    assert "ml/train-llm-0,gpu-a100-01,gpuplane,32000,262144,0;1;2;3,1000;1000;1000;1000," \
           "81920;81920;81920;81920,1796020807" in rows
    assert any("another stack holds (2 on gpu-v100-01)" in line for line in written.not_in_nodes_csv)


def _app() -> typer.Typer:
    app = typer.Typer()
    snapshot_cmd.register(app)

    @app.command("other")
    def other() -> None:  # a second command keeps `snapshot` a named subcommand
        """Nothing."""

    return app


def test_the_snapshot_command_writes_and_summarises(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["snapshot", "--from", str(FIXTURE), "--out", str(tmp_path)],
                                env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "running: 7 pods (5 gpuplane, 1 of another GPU stack, 1 without GPU)" in result.output
    # Pending GPUs: 8 + 2 + 0.5 + 0.3 = 10.8.
    assert "pending: 4 pods asking 10.8 GPUs" in result.output
    assert "left out: pod ml/preprocess-28391-4xk2d: finished (Succeeded)" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json", "nodes.csv", "pods.csv", "running.csv"]


def test_the_snapshot_command_lists_every_problem_and_writes_nothing(tmp_path: Path) -> None:
    doc = fixture_doc()
    _bad_cpu(doc)
    _unknown_node(doc)
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps(doc))
    result = CliRunner().invoke(_app(), ["snapshot", "--from", str(dump), "--out", str(tmp_path / "out")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "2 problems" in result.output
    assert f"{dump}: pod research/notebook-4: spec.containers[0].resources[cpu]" in result.output
    assert f"{dump}: pod research/eval-2: spec.nodeName" in result.output
    assert not (tmp_path / "out").exists()


def test_from_and_kubeconfig_exclude_each_other(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["snapshot", "--from", str(FIXTURE), "--kubeconfig", str(FIXTURE),
                                         "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--from reads files" in result.output


def test_the_snapshot_command_reads_the_api_server(tmp_path: Path) -> None:
    with FakeApiServer() as server:
        for item in fixture_doc()["items"]:
            (server.add_node if item["kind"] == "Node" else server.add_pod)(item)
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        result = CliRunner().invoke(_app(), ["snapshot", "--kubeconfig", str(kubeconfig), "--out",
                                             str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["running"] == {"foreign": 1, "gpuplane": 5, "none": 1}
    assert data["foreign_cards"] == 2 and data["gpus"] == 20  # 0 + 8 + 4 + 8 cards
    assert load_snapshot(tmp_path / "out", CATALOG) == load_files(FIXTURE, CATALOG)
