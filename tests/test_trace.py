"""Trace loaders: `load_nodes` / `load_pods` on small CSV files, their errors, and the bundled files."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from gpuplane.model import Fraction, GpuplaneError, QoS, WholeCards, default_catalog
from gpuplane.sim import (
    BUNDLED_TRACES,
    LoadReport,
    TraceError,
    TracePod,
    bundled_path,
    load_nodes,
    load_pods,
    resolve_trace,
)

CATALOG = default_catalog()

POD_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
              "creation_time,deletion_time,scheduled_time")
NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model"
GOOD_POD = "pod-good,4000,8192,1,1000,,LS,Running,10,20,10"
GOOD_NODE = "node-good,64000,262144,2,P100"


def write(tmp_path: Path, name: str, *lines: str) -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def pod_row(name: str = "pod-bad", cpu: str = "4000", mem: str = "8192", num_gpu: str = "1", gpu_milli: str = "1000",
            spec: str = "", qos: str = "LS", created: str = "10", deleted: str = "20") -> str:
    return f"{name},{cpu},{mem},{num_gpu},{gpu_milli},{spec},{qos},Running,{created},{deleted},{created}"


# ---------------------------------------------------------------------------------------------- errors
# (id, bad row, column, words the reason must contain). The bad row is always physical line 3.
POD_ERRORS = [
    ("empty value", pod_row(cpu=""), "cpu_milli", "missing value"),
    ("empty name", pod_row(name=""), "name", "missing value"),
    ("not a number", pod_row(mem="abc"), "memory_mib", "not a number"),
    ("not an integer", pod_row(num_gpu="1.5"), "num_gpu", "not a whole number"),
    ("not finite", pod_row(cpu="inf"), "cpu_milli", "not a finite number"),
    ("negative", pod_row(cpu="-1"), "cpu_milli", "at least 0"),
    ("gpu_milli above a card", pod_row(gpu_milli="1001"), "gpu_milli", "at most 1000"),
    ("fraction over several GPUs", pod_row(num_gpu="2", gpu_milli="500"), "gpu_milli", "cannot span 2"),
    ("milli without GPUs", pod_row(num_gpu="0", gpu_milli="300"), "gpu_milli", "num_gpu 0"),
    ("GPUs without milli", pod_row(num_gpu="2", gpu_milli="0"), "gpu_milli", "0 milli"),
    ("unknown model in gpu_spec", pod_row(spec="X9000"), "gpu_spec", "X9000"),
    ("one unknown model among several", pod_row(spec="V100M16|X9000"), "gpu_spec", "X9000"),
    ("unknown qos", pod_row(qos="Platinum"), "qos", "Platinum"),
    ("duplicate name", pod_row(name="pod-good"), "name", "duplicate"),
    ("deletion before creation", pod_row(created="100", deleted="99"), "deletion_time", "before creation_time"),
    ("negative time", pod_row(created="-5", deleted="1"), "creation_time", "negative"),
    ("bad time", pod_row(deleted="soon"), "deletion_time", "not a number"),
    ("NaN time", pod_row(created="nan"), "creation_time", "not a finite number"),
    ("infinite time", pod_row(deleted="inf"), "deletion_time", "not a finite number"),
]


@pytest.mark.parametrize(("row", "column", "words"), [case[1:] for case in POD_ERRORS],
                         ids=[case[0] for case in POD_ERRORS])
def test_load_pods_rejects_bad_row(tmp_path: Path, row: str, column: str, words: str) -> None:
    path = write(tmp_path, "pods.csv", POD_HEADER, GOOD_POD, row, pod_row(name="pod-after"))
    with pytest.raises(TraceError) as info:
        load_pods(path, CATALOG)
    error = info.value
    assert (error.path, error.line, error.column) == (str(path), 3, column)
    assert words in error.reason
    assert str(error).startswith(f"{path}:3: {column}: ")


NODE_ERRORS = [
    ("unknown node model", "node-x,64000,262144,2,X9000", "model", "X9000"),
    ("GPUs but no model", "node-x,64000,262144,2,", "model", "missing value"),
    ("duplicate name", "node-good,64000,262144,2,P100", "sn", "duplicate"),
    ("empty name", ",64000,262144,2,P100", "sn", "missing value"),
    ("negative gpus", "node-x,64000,262144,-2,P100", "gpu", "at least 0"),
    ("not a number", "node-x,abc,262144,2,P100", "cpu_milli", "not a number"),
    ("not an integer", "node-x,64000,1.5,2,P100", "memory_mib", "not a whole number"),
    ("empty value", "node-x,64000,,2,P100", "memory_mib", "missing value"),
    ("short row", "node-x,64000,262144", "gpu", "missing value"),
]


@pytest.mark.parametrize(("row", "column", "words"), [case[1:] for case in NODE_ERRORS],
                         ids=[case[0] for case in NODE_ERRORS])
def test_load_nodes_rejects_bad_row(tmp_path: Path, row: str, column: str, words: str) -> None:
    path = write(tmp_path, "nodes.csv", NODE_HEADER, GOOD_NODE, row)
    with pytest.raises(TraceError) as info:
        load_nodes(path, CATALOG)
    assert (info.value.path, info.value.line, info.value.column) == (str(path), 3, column)
    assert words in info.value.reason


@pytest.mark.parametrize("missing", ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"])
def test_load_pods_missing_column_is_reported_on_the_header(tmp_path: Path, missing: str) -> None:
    columns = [c for c in POD_HEADER.split(",") if c != missing]
    path = write(tmp_path, "pods.csv", ",".join(columns))
    for skip in (False, True):  # a bad header cannot be skipped
        with pytest.raises(TraceError) as info:
            load_pods(path, CATALOG, skip_bad_rows=skip)
        assert (info.value.path, info.value.line, info.value.column) == (str(path), 1, missing)
        assert "missing column" in info.value.reason


@pytest.mark.parametrize("missing", ["sn", "cpu_milli", "memory_mib", "gpu", "model"])
def test_load_nodes_missing_column_is_reported_on_the_header(tmp_path: Path, missing: str) -> None:
    columns = [c for c in NODE_HEADER.split(",") if c != missing]
    path = write(tmp_path, "nodes.csv", ",".join(columns), GOOD_NODE)
    with pytest.raises(TraceError) as info:
        load_nodes(path, CATALOG)
    assert (info.value.line, info.value.column) == (1, missing)


def test_empty_file_reports_every_column_missing_from_line_1(tmp_path: Path) -> None:
    path = write(tmp_path, "empty.csv")
    with pytest.raises(TraceError) as info:
        load_pods(path, CATALOG)
    assert (info.value.line, info.value.column) == (1, "name")


@pytest.mark.parametrize("loader", [load_nodes, load_pods])
def test_missing_file(tmp_path: Path, loader: object) -> None:
    path = tmp_path / "nope.csv"
    with pytest.raises(TraceError) as info:
        loader(path, CATALOG)  # type: ignore[operator]
    assert info.value.path == str(path)
    assert info.value.line == 0  # no line was read
    assert info.value.column == "file"
    assert isinstance(info.value, GpuplaneError)


def test_line_numbers_are_physical_lines_across_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "pods.csv", POD_HEADER, GOOD_POD, "", "", pod_row(name="p2"), pod_row(name="p3", mem="x"))
    with pytest.raises(TraceError) as info:
        load_pods(path, CATALOG)
    assert info.value.line == 6
    pods = load_pods(write(tmp_path, "ok.csv", POD_HEADER, "", GOOD_POD, "", pod_row(name="p2")), CATALOG)
    assert [p.line for p in pods] == [3, 5]


# ---------------------------------------------------------------------------------------------- skipping
def test_skip_bad_rows_keeps_good_rows_and_reports_each_skipped_row(tmp_path: Path) -> None:
    path = write(
        tmp_path, "pods.csv", POD_HEADER,
        pod_row(name="a"),                                  # 2 good
        pod_row(name="b", num_gpu="2", gpu_milli="500"),    # 3 fraction over 2 GPUs
        pod_row(name="c", cpu="abc"),                       # 4 not a number
        pod_row(name="d", gpu_milli="460"),                 # 5 good
        pod_row(name="a"),                                  # 6 duplicate of line 2
        pod_row(name="e", cpu="xyz"),                       # 7 not a number again
        pod_row(name="f", num_gpu="0", gpu_milli="0"),      # 8 good, CPU-only
    )
    report = LoadReport(str(path))
    pods = load_pods(path, CATALOG, skip_bad_rows=True, report=report)
    assert [p.request.name for p in pods] == ["a", "d", "f"]
    assert [p.line for p in pods] == [2, 5, 8]
    assert report.rows == 7
    assert [(s.line, s.column) for s in report.skipped] == [
        (3, "gpu_milli"), (4, "cpu_milli"), (6, "name"), (7, "cpu_milli")]
    assert "duplicate" in report.skipped[2].reason
    summary = report.summary()
    assert summary.startswith(f"{path}: 7 rows, 4 skipped (")
    assert "1 × gpu_milli: a fraction (500 milli) cannot span 2 GPUs" in summary
    assert "1 × cpu_milli: not a number: 'abc'" in summary
    assert "1 × cpu_milli: not a number: 'xyz'" in summary
    assert "1 × name: duplicate pod name 'a'" in summary


def test_skip_summary_counts_identical_reasons(tmp_path: Path) -> None:
    path = write(tmp_path, "nodes.csv", NODE_HEADER, GOOD_NODE, "n1,1,1,2,X9000", "n2,1,1,2,X9000", "n3,1,1,1,T4")
    report = LoadReport(str(path))
    nodes = load_nodes(path, CATALOG, skip_bad_rows=True, report=report)
    assert [n.name for n in nodes] == ["node-good", "n3"]
    assert [(s.line, s.column) for s in report.skipped] == [(3, "model"), (4, "model")]
    assert f"{path}: 4 rows, 2 skipped (2 × model: unknown GPU model 'X9000'" in report.summary()


def test_summary_without_skips(tmp_path: Path) -> None:
    path = write(tmp_path, "pods.csv", POD_HEADER, GOOD_POD)
    report = LoadReport(str(path))
    load_pods(path, CATALOG, skip_bad_rows=True, report=report)
    assert report.summary() == f"{path}: 1 rows, none skipped"


def test_without_skipping_the_first_bad_row_raises(tmp_path: Path) -> None:
    path = write(tmp_path, "pods.csv", POD_HEADER, pod_row(name="a", cpu="x"), pod_row(name="b", mem="y"))
    with pytest.raises(TraceError) as info:
        load_pods(path, CATALOG)
    assert (info.value.line, info.value.column) == (2, "cpu_milli")


# ---------------------------------------------------------------------------------------------- good rows
def test_good_pod_rows_become_requests(tmp_path: Path) -> None:
    path = write(
        tmp_path, "pods.csv", POD_HEADER,
        "ls,12000,16384,4,1000,,LS,Running,100,160,100",
        "be,6000,12288,1,460,,BE,Running,5,,",
        "burst,1000,2048,0,0,,Burstable,Failed,,,",
        "guar,1000,2048,1,1000,V100M16|V100M32,Guaranteed,Pending,7,7,",
        "noqos,1000,2048,1,1000,V100M32,,Running,1.5,2.5,",
    )
    pods = {p.request.name: p for p in load_pods(path, CATALOG)}
    ls, be, burst, guar, noqos = (pods[n] for n in ("ls", "be", "burst", "guar", "noqos"))
    assert ls.request.qos is QoS.ONLINE
    assert be.request.qos is QoS.BEST_EFFORT
    assert burst.request.qos is QoS.OFFLINE
    assert guar.request.qos is QoS.ONLINE
    assert noqos.request.qos is QoS.ONLINE
    assert ls.request.gpu == WholeCards(4)
    assert ls.request.gpu_milli_total == 4000
    assert (ls.request.cpu_milli, ls.request.memory_mib) == (12000, 16384)
    assert be.request.gpu == Fraction(compute_milli=460)
    assert be.request.gpu_milli_total == 460
    assert burst.request.gpu is None
    assert ls.request.models is None
    assert guar.request.models == frozenset({"V100-16GB", "V100-32GB"})
    assert noqos.request.models == frozenset({"V100-32GB"})
    assert (ls.creation_time, ls.deletion_time, ls.lifetime) == (100.0, 160.0, 60.0)
    assert (be.creation_time, be.deletion_time, be.lifetime) == (5.0, None, None)
    assert burst.creation_time is None
    assert guar.lifetime == 0.0
    assert noqos.lifetime == pytest.approx(1.0)
    assert isinstance(ls, TracePod)
    assert ls.line == 2


def test_pod_list_with_only_the_required_columns(tmp_path: Path) -> None:
    path = write(tmp_path, "multigpu.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli", "p,1000,1024,8,1000")
    (pod,) = load_pods(path, CATALOG)
    assert pod.request.gpu == WholeCards(8)
    assert pod.request.qos is QoS.ONLINE
    assert pod.lifetime is None


def test_good_node_rows(tmp_path: Path) -> None:
    path = write(tmp_path, "nodes.csv", NODE_HEADER, GOOD_NODE, "v,96000,786432,8,V100M32", "cpu,32000,65536,0,",
                 "g,96000,786432,8,g2")
    good, v, cpu, g = load_nodes(path, CATALOG)
    assert (good.name, good.cpu_milli, good.memory_mib, good.gpus, good.gpu_model) == (
        "node-good", 64000, 262144, 2, "P100")
    assert v.gpu_model == "V100-32GB"
    assert (cpu.gpus, cpu.gpu_model) == (0, None)
    assert g.gpu_model == "G2"


# ---------------------------------------------------------------------------------------------- bundled
def test_bundled_node_list_matches_the_readme() -> None:
    nodes = load_nodes(bundled_path("nodes"), CATALOG)
    assert len(nodes) == 1213
    assert sum(n.gpus for n in nodes) == 6212
    assert sum(n.cpu_milli for n in nodes) == 107_018_000
    assert Counter(n.gpus for n in nodes) == {8: 617, 2: 518, 4: 54, 1: 24}
    by_model: Counter[str | None] = Counter()
    for node in nodes:
        by_model[node.gpu_model] += node.gpus
    assert by_model == {"G2": 4392, "T4": 842, "G3": 312, "P100": 265, "V100-32GB": 204, "V100-16GB": 195, "A10": 2}


@pytest.mark.parametrize("trace", BUNDLED_TRACES)
def test_bundled_pod_lists_load_completely(trace: str) -> None:
    report = LoadReport(trace)
    pods = load_pods(bundled_path(trace), CATALOG, skip_bad_rows=True, report=report)
    assert len(pods) == 8152
    assert report.rows == 8152 and not report.skipped
    assert sum(1 for p in pods if p.request.gpu is None) == 1088
    assert all(p.lifetime is not None and p.lifetime >= 0 for p in pods)
    assert len({p.request.name for p in pods}) == 8152


def test_bundled_default_statistics_match_the_readme() -> None:
    pods = [p.request for p in load_pods(bundled_path("default"), CATALOG)]
    shapes = Counter(p.gpu.count if isinstance(p.gpu, WholeCards) else type(p.gpu).__name__ for p in pods)
    assert shapes == {"NoneType": 1088, 1: 3911, "Fraction": 3078, 2: 16, 4: 15, 8: 44}
    assert sum(p.gpu_milli_total for p in pods) == 6_086_800
    assert Counter(p.qos for p in pods) == {QoS.ONLINE: 4647 + 7, QoS.BEST_EFFORT: 3398, QoS.OFFLINE: 100}


def test_bundled_gpushare100_has_only_sharing_gpu_pods() -> None:
    pods = [p.request for p in load_pods(bundled_path("gpushare100"), CATALOG)]
    gpu = [p.gpu for p in pods if p.gpu is not None]
    assert len(gpu) == 8152 - 1088
    assert all(isinstance(g, Fraction) and g.compute_milli < 1000 for g in gpu)


def test_bundled_path_and_resolve_trace(tmp_path: Path) -> None:
    assert bundled_path("nodes").name == "openb_node_list_gpu_node.csv"
    assert bundled_path("default").name == "openb_pod_list_default.csv"
    for trace in BUNDLED_TRACES:
        assert bundled_path(trace).is_file()
        assert resolve_trace(trace) == bundled_path(trace)
    assert resolve_trace(str(tmp_path / "mine.csv")) == tmp_path / "mine.csv"
    with pytest.raises(GpuplaneError, match="unknown bundled trace 'multigpu20'"):
        bundled_path("multigpu20")


def test_optional_pool_and_gpu_memory_columns(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model,pool\na,8000,1024,1,T4,dev\nb,8000,1024,1,T4,\n")
    assert [n.pool for n in load_nodes(nodes, CATALOG)] == ["dev", "default"]
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_memory_mib\n"
                    "f,1000,1,1,300,8000\nw,1000,1,1,1000,\nm,1000,1,1,1000,4000\n")
    loaded = {p.request.name: p.request.gpu for p in load_pods(pods, CATALOG)}
    # a whole-card share with a memory cap is a fraction of the full compute
    assert loaded == {"f": Fraction(compute_milli=300, memory_mib=8000), "w": WholeCards(1),
                      "m": Fraction(compute_milli=1000, memory_mib=4000)}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("x,1000,1,1,300,999999", "exceeds the largest allowed card"),
        ("x,1000,1,2,1000,4000", "cannot span 2 GPUs"),
        ("x,1000,1,1,300,-5", "must be at least 0"),
    ],
)
def test_gpu_memory_column_errors(tmp_path: Path, row: str, message: str) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(f"name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_memory_mib\n{row}\n")
    with pytest.raises(TraceError, match=message) as info:
        load_pods(pods, CATALOG)
    assert (info.value.line, info.value.column) == (2, "gpu_memory_mib")


def test_errors_survive_pickling_across_processes() -> None:
    import pickle

    from gpuplane.model import RequestError

    error = pickle.loads(pickle.dumps(TraceError("pods.csv", 7, "gpu_milli", "too big")))
    assert (error.path, error.line, error.column, error.reason, str(error)) == (
        "pods.csv", 7, "gpu_milli", "too big", "pods.csv:7: gpu_milli: too big")
    request = pickle.loads(pickle.dumps(RequestError("cpu_milli", "must not be negative")))
    assert (request.field, str(request)) == ("cpu_milli", "cpu_milli: must not be negative")
