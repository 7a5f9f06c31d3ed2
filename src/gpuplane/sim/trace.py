"""Loading the Alibaba `openb` trace (node list and pod lists) into model objects.

Every bad row raises `TraceError` naming the file, line and field; with `skip_bad_rows=True` the loader
goes on and reports each skipped row and why, so nothing is dropped silently.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from gpuplane.model import (
    MILLI_PER_CARD,
    Catalog,
    CatalogError,
    Fraction,
    GpuForm,
    GpuplaneError,
    NodeSpec,
    PodRequest,
    QoS,
    RequestError,
    WholeCards,
)

BUNDLED_TRACES = ("default", "gpushare40", "gpushare100")
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
OPTIONAL_POD_COLUMNS = ("gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time", "scheduled_time",
                        "gpu_memory_mib")
"""`gpu_memory_mib` (not in the Alibaba files) gives a GPU-sharing pod's card memory in MiB."""


class TraceError(GpuplaneError):
    def __init__(self, path: Path | str, line: int, column: str, message: str) -> None:
        super().__init__(f"{path}:{line}: {column}: {message}")
        self.path = str(path)
        self.line = line
        self.column = column
        self.reason = message

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int, str, str]]:
        # Picklable with its four fields, so it crosses process boundaries (experiment workers).
        return TraceError, (self.path, self.line, self.column, self.reason)


@dataclass(frozen=True, slots=True)
class TracePod:
    request: PodRequest
    line: int
    creation_time: float | None = None
    deletion_time: float | None = None

    @property
    def lifetime(self) -> float | None:
        if self.creation_time is None or self.deletion_time is None:
            return None
        return self.deletion_time - self.creation_time


@dataclass(slots=True)
class SkippedRow:
    line: int
    column: str
    reason: str


@dataclass(slots=True)
class LoadReport:
    path: str
    rows: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)

    def summary(self) -> str:
        if not self.skipped:
            return f"{self.path}: {self.rows} rows, none skipped"
        why = Counter(f"{s.column}: {s.reason}" for s in self.skipped)
        parts = "; ".join(f"{count} × {reason}" for reason, count in why.most_common())
        return f"{self.path}: {self.rows} rows, {len(self.skipped)} skipped ({parts})"


def bundled_path(name: str) -> Path:
    """Path of a bundled file: `nodes` or one of `BUNDLED_TRACES`."""
    base = resources.files("gpuplane.data").joinpath("alibaba-gpu-2023")
    filename = "openb_node_list_gpu_node.csv" if name == "nodes" else f"openb_pod_list_{name}.csv"
    if name != "nodes" and name not in BUNDLED_TRACES:
        raise GpuplaneError(f"unknown bundled trace {name!r} (choose from {', '.join(BUNDLED_TRACES)} or a path)")
    return Path(str(base.joinpath(filename)))


def resolve_trace(name_or_path: str) -> Path:
    return bundled_path(name_or_path) if name_or_path in BUNDLED_TRACES else Path(name_or_path)


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(path, 0, "file", exc.strerror or str(exc)) from None
    with handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        for column in required:
            if column not in header:
                raise TraceError(path, 1, column, f"missing column (header has: {', '.join(header) or 'nothing'})")
        for row in reader:
            yield reader.line_num, row


def _int(path: Path, line: int, row: dict[str, str], column: str, *, minimum: int = 0) -> int:
    raw = row.get(column)
    if raw is None or raw.strip() == "":
        raise TraceError(path, line, column, "missing value")
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(path, line, column, f"not a number: {raw!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise TraceError(path, line, column, f"not a finite number: {raw!r}")
    if value != int(value):
        raise TraceError(path, line, column, f"not a whole number: {raw!r}")
    if value < minimum:
        raise TraceError(path, line, column, f"must be at least {minimum}, got {raw}")
    return int(value)


def _time(path: Path, line: int, row: dict[str, str], column: str) -> float | None:
    raw = (row.get(column) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(path, line, column, f"not a number: {raw!r}") from None
    if not math.isfinite(value):
        raise TraceError(path, line, column, f"not a finite number: {raw!r}")
    if value < 0:
        raise TraceError(path, line, column, f"must not be negative, got {raw}")
    return value


def load_nodes(path: Path | str, catalog: Catalog, *, skip_bad_rows: bool = False,
               report: LoadReport | None = None) -> list[NodeSpec]:
    """Read an openb node list (`sn,cpu_milli,memory_mib,gpu,model`, optionally `pool`)."""
    path = Path(path)
    report = report if report is not None else LoadReport(str(path))
    nodes: list[NodeSpec] = []
    names: set[str] = set()
    for line, row in _rows(path, NODE_COLUMNS):
        report.rows += 1
        try:
            name = (row.get("sn") or "").strip()
            if not name:
                raise TraceError(path, line, "sn", "missing value")
            if name in names:
                raise TraceError(path, line, "sn", f"duplicate node name {name!r}")
            cpu = _int(path, line, row, "cpu_milli")
            memory = _int(path, line, row, "memory_mib")
            gpus = _int(path, line, row, "gpu")
            model_name = (row.get("model") or "").strip()
            model: str | None = None
            if gpus:
                if not model_name:
                    raise TraceError(path, line, "model", "missing value for a node with GPUs")
                try:
                    model = catalog.canonical(model_name)
                except CatalogError as exc:
                    raise TraceError(path, line, "model", str(exc)) from None
            pool = (row.get("pool") or "").strip() or "default"
            nodes.append(NodeSpec(name, cpu, memory, model, gpus, pool=pool))
            names.add(name)
        except TraceError as exc:
            if not skip_bad_rows:
                raise
            report.skipped.append(SkippedRow(exc.line, exc.column, exc.reason))
    return nodes


def _gpu_form(path: Path, line: int, num_gpu: int, gpu_milli: int, gpu_memory: int) -> GpuForm | None:
    if gpu_milli > MILLI_PER_CARD:
        raise TraceError(path, line, "gpu_milli", f"a card holds at most {MILLI_PER_CARD} milli, got {gpu_milli}")
    if num_gpu == 0:
        if gpu_milli:
            raise TraceError(path, line, "gpu_milli", f"{gpu_milli} milli asked with num_gpu 0")
        return None
    if gpu_milli == 0:
        raise TraceError(path, line, "gpu_milli", f"0 milli asked with num_gpu {num_gpu}")
    if gpu_milli == MILLI_PER_CARD and not gpu_memory:
        return WholeCards(num_gpu)
    if num_gpu > 1:
        column = "gpu_milli" if gpu_milli != MILLI_PER_CARD else "gpu_memory_mib"
        share = f"{gpu_milli} milli" + (f", {gpu_memory} MiB" if gpu_memory else "")
        raise TraceError(path, line, column, f"a fraction ({share}) cannot span {num_gpu} GPUs")
    return Fraction(compute_milli=gpu_milli, memory_mib=gpu_memory)


def load_pods(path: Path | str, catalog: Catalog, *, skip_bad_rows: bool = False,
              report: LoadReport | None = None) -> list[TracePod]:
    """Read an openb pod list. Timestamps are kept for timed replays; fill replays ignore them."""
    path = Path(path)
    report = report if report is not None else LoadReport(str(path))
    pods: list[TracePod] = []
    names: set[str] = set()
    for line, row in _rows(path, POD_COLUMNS):
        report.rows += 1
        try:
            name = (row.get("name") or "").strip()
            if not name:
                raise TraceError(path, line, "name", "missing value")
            if name in names:
                raise TraceError(path, line, "name", f"duplicate pod name {name!r}")
            cpu = _int(path, line, row, "cpu_milli")
            memory = _int(path, line, row, "memory_mib")
            num_gpu = _int(path, line, row, "num_gpu")
            gpu_milli = _int(path, line, row, "gpu_milli")
            has_memory = (row.get("gpu_memory_mib") or "").strip() != ""
            gpu_memory = _int(path, line, row, "gpu_memory_mib") if has_memory else 0
            gpu = _gpu_form(path, line, num_gpu, gpu_milli, gpu_memory)
            spec = (row.get("gpu_spec") or "").strip()
            models: frozenset[str] | None = None
            if spec:
                try:
                    models = frozenset(catalog.canonical(m.strip()) for m in spec.split("|") if m.strip())
                except CatalogError as exc:
                    raise TraceError(path, line, "gpu_spec", str(exc)) from None
            if gpu_memory:
                largest = max(catalog.get(m).memory_mib for m in (models or catalog.names))
                if gpu_memory > largest:
                    raise TraceError(path, line, "gpu_memory_mib",
                                     f"{gpu_memory} MiB exceeds the largest allowed card ({largest} MiB)")
            qos_raw = (row.get("qos") or "").strip()
            try:
                qos = QoS.from_trace(qos_raw) if qos_raw else QoS.ONLINE
            except RequestError as exc:
                raise TraceError(path, line, "qos", str(exc)) from None
            created = _time(path, line, row, "creation_time")
            deleted = _time(path, line, row, "deletion_time")
            if created is not None and deleted is not None and deleted < created:
                raise TraceError(path, line, "deletion_time", f"before creation_time ({deleted} < {created})")
            request = PodRequest(name, cpu_milli=cpu, memory_mib=memory, gpu=gpu, models=models, qos=qos)
            pods.append(TracePod(request, line, created, deleted))
            names.add(name)
        except TraceError as exc:
            if not skip_bad_rows:
                raise
            report.skipped.append(SkippedRow(exc.line, exc.column, exc.reason))
    return pods
