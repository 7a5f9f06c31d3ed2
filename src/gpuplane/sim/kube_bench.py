"""`gpuplane bench kube`: pods bound per second through the local API server, with `gpuplane scheduler` deciding.

Three processes, as on a cluster: the API server (`FakeApiServer`, spawned, holding `nodes` GPU nodes), the
scheduler (`gpuplane scheduler`, its own process, asynchronous binds), and this one, which creates the pods and
watches them. A pod's latency is from the moment its create was sent to the moment the watch shows it bound;
throughput is bound pods over the time from the first create to the last bind. The API server counts the
requests by verb and resource (`FakeApiServer.request_counts`), so the writes per bound pod and the reads
outside the watch streams come from the server itself.

The API server's own ceiling (`ceiling=True`): the same pipeline with the scheduler replaced by a client that
decides nothing: it watches the pods and, for each, sends what the scheduler sends for a bind (PATCH of the
assignment, POST of the Binding, POST of the `Scheduled` event) with the scheduler's own client (`RestKubeApi`)
from several threads. What that reaches is the most any scheduler could get through this API server.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from gpuplane.kube.api import ApiError, JsonObject, RestKubeApi, pod_path
from gpuplane.kube.cluster import pod_manifest
from gpuplane.kube.dra import claim_path, with_claim
from gpuplane.kube.localapi import FakeApiServer, write_kubeconfig
from gpuplane.kube.objects import SCHEDULER_NAME
from gpuplane.kube.standin import node_manifest
from gpuplane.model import Fraction, GpuForm, NodeSpec, PodRequest, WholeCards, default_catalog
from gpuplane.sim.dra_bench import SlicesOf, claim_of, dra_node_manifest, publish_dra

NAMESPACE = "bench"
TARGET_PODS_PER_S = 500.0
TARGET_NODES = 5000
MAX_WRITES_PER_POD = 3.0
Progress = Callable[[str], None]


def bench_nodes(count: int) -> list[NodeSpec]:
    """`count` empty 8-card A100-80GB nodes (96 CPUs, 768 GiB)."""
    model = default_catalog().canonical("A100-80GB")
    return [NodeSpec(f"gpu-node-{i:05d}", 96_000, 786_432, model, 8) for i in range(count)]


def bench_pods(count: int) -> list[PodRequest]:
    """Whole cards (1 and 2) and half cards, in turn: every one fits on an empty 1,000-node cluster."""
    shapes: tuple[GpuForm, ...] = (WholeCards(1), Fraction(compute_milli=500, memory_mib=16_384), WholeCards(2))
    return [PodRequest(f"{NAMESPACE}/pod-{i:06d}", cpu_milli=2000, memory_mib=8192, gpu=shapes[i % len(shapes)])
            for i in range(count)]


# ------------------------------------------------------------------ the API server's process
def _serve(nodes: int, conn: Connection, dra: SlicesOf | None = None) -> None:
    server = FakeApiServer(pod_deletion_delay_s=0.0, keep_requests=False)
    for spec in bench_nodes(nodes):
        server.add_node(dra_node_manifest(spec) if dra is not None else node_manifest(spec))
    server.start()
    if dra is not None:  # the node agents' ResourceSlices and the DeviceClasses (`gpuplane.sim.dra_bench`)
        publish_dra(server.api, bench_nodes(nodes), dra)
    # What was set up lives as long as the server: out of the cycle collector's reach, or every full collection
    # walks it (a thousand DRA nodes' slices, with their history, are millions of objects: pauses of seconds in
    # the middle of a run, a cost of this Python stand-in, not of an API server).
    gc.collect()
    gc.freeze()
    conn.send(server.url)
    while True:
        command = conn.recv()
        if command == "counts":
            conn.send((server.request_counts(), time.process_time()))
        else:
            break
    server.stop()


class ServerProcess:
    """The API server in a spawned process (its own GIL); `counts()` asks it for its request counts."""

    def __init__(self, nodes: int, dra: SlicesOf | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(nodes, child, dra), daemon=True)
        self._process.start()
        deadline = time.monotonic() + 300
        while not self._conn.poll(0.5):
            if not self._process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server process did not start (exit code {self._process.exitcode})")
        self.url: str = self._conn.recv()

    def counts(self) -> tuple[dict[str, int], float]:
        """The server's request counts so far, and the CPU seconds its process has used."""
        self._conn.send("counts")
        counts: tuple[dict[str, int], float] = self._conn.recv()
        return counts

    def close(self) -> None:
        self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)  # reaped, not left a zombie


# ------------------------------------------------------------------ this process: create and watch
class _Watcher:
    """When each pod was first seen bound, from a watch on the namespace's pods."""

    def __init__(self, api: RestKubeApi, resource_version: str) -> None:
        self.bound: dict[str, float] = {}
        self._changed = threading.Condition()
        self._stream = api.watch(pod_path(NAMESPACE), resource_version, timeout_s=3600)
        self._thread = threading.Thread(target=self._run, name="bench watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for _, obj in self._stream:
                if (obj.get("spec") or {}).get("nodeName"):
                    name = obj["metadata"]["name"]
                    with self._changed:
                        if name not in self.bound:
                            self.bound[name] = time.perf_counter()
                            self._changed.notify_all()
        except ApiError:
            return

    def wait(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self.bound) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def close(self) -> None:
        self._stream.close()


def _create(api: RestKubeApi, pods: Sequence[PodRequest], threads: int, rate: float | None = None,
            dra: bool = False) -> dict[str, float]:
    """Create `pods` from `threads` threads, as fast as the API server takes them or `rate` a second (open loop:
    pod i is sent at start + i / rate); when each create was sent (`dra`: each pod's ResourceClaim first, then the
    pod using it)."""
    sent: dict[str, float] = {}
    lock = threading.Lock()
    manifests = [pod_manifest(p) for p in pods]
    claims = {m["metadata"]["name"]: claim_of(p) for m, p in zip(manifests, pods, strict=True)} if dra else {}
    if dra:
        manifests = [with_claim(m, claims[m["metadata"]["name"]]["metadata"]["name"]) for m in manifests]
    origin = time.perf_counter()

    def work(share: Sequence[JsonObject], first: int) -> None:
        for i, manifest in enumerate(share):
            if rate is not None:
                delay = origin + (first + i * threads) / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            started = time.perf_counter()
            claim = claims.get(manifest["metadata"]["name"])
            if claim is not None:
                api.create(claim_path(NAMESPACE), claim)
            api.create(pod_path(NAMESPACE), manifest)
            with lock:
                sent[manifest["metadata"]["name"]] = started

    workers = [threading.Thread(target=work, args=(manifests[k::threads], k)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sent


# ------------------------------------------------------------------ the ceiling's replaying client
def _replay(url: str, threads: int, resource_version: str, conn: Connection) -> None:
    """Watch the pods; for each new one PATCH its assignment, POST its Binding and an event (no decisions), with
    the scheduler's own client (`RestKubeApi`'s write path), so the ceiling is the API server's, not a slower
    client's."""
    api = RestKubeApi.from_url(url)
    work: list[JsonObject] = []
    ready = threading.Condition()

    def lane() -> None:
        node = 0
        while True:
            with ready:
                while not work:
                    ready.wait()
                pod = work.pop()
            if not pod:
                return
            name = pod["metadata"]["name"]
            node = (node + 1) % 1000
            assignment = json.dumps({"node": f"gpu-node-{node:05d}", "cards": [[0, 1000]]})
            api.patch(pod_path(NAMESPACE, name), {"metadata": {
                "resourceVersion": pod["metadata"]["resourceVersion"],
                "annotations": {"gpuplane.io/assignment": assignment}}})
            api.create(pod_path(NAMESPACE, name, "binding"), {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": NAMESPACE},
                "target": {"apiVersion": "v1", "kind": "Node", "name": f"gpu-node-{node:05d}"}})
            api.create(f"/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events", {
                "apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": f"{name}.{time.time_ns():x}", "namespace": NAMESPACE},
                "reason": "Scheduled", "action": "Binding", "type": "Normal",
                "note": f"Successfully assigned {NAMESPACE}/{name}", "reportingController": "replay",
                "reportingInstance": "replay", "eventTime": "2026-12-01T00:00:00.000000Z",
                "regarding": {"kind": "Pod", "namespace": NAMESPACE, "name": name}})

    lanes = [threading.Thread(target=lane, daemon=True) for _ in range(threads)]
    for thread in lanes:
        thread.start()
    conn.send("ready")
    seen: set[str] = set()
    try:
        for kind, obj in api.watch(pod_path(NAMESPACE), resource_version, timeout_s=3600):
            name = obj.get("metadata", {}).get("name", "")
            if kind == "ADDED" and name not in seen:
                seen.add(name)
                with ready:
                    work.insert(0, obj)
                    ready.notify()
            if conn.poll():
                break
    except ApiError:
        pass


# ------------------------------------------------------------------ one run
@dataclass(frozen=True, slots=True)
class KubeBenchRun:
    nodes: int
    pods: int
    bound: int
    pods_bound_per_s: float
    p50_ms: float
    p99_ms: float
    requests_per_bound_pod: dict[str, float]
    """Requests the API server received during the run, by `VERB resource`, per bound pod (the pods' own
    creates and the watches included, so every request is in it)."""
    scheduler_writes_per_pod: float
    """Writes beyond the pod's own create (what the scheduler, or the ceiling's client, wrote), per bound pod."""
    reads_beyond_watches: int
    """GETs and lists during the run that were not watches."""
    api_server_cpu_pct: float
    """CPU the API server's process used during the run, in % of one core (near 100: it is the limit)."""
    api_server_cpu_ms_per_pod: float
    """The API server's CPU per bound pod: what the machine's load does not change (1000 / it: pods/s per core)."""
    scheduler_cpu_pct: float
    """The same for the scheduler's process (or the ceiling's client), -1 where /proc cannot tell."""
    scheduler_cpu_ms_per_pod: float
    """The scheduler's process CPU (all its threads: deciding, informers, bind lanes) per bound pod: the figure
    that does not move with the machine's load (wall-clock pods/s does, on a shared machine)."""
    client_cpu_ms_per_pod: float
    """This process's CPU (the creating threads and the watch) per bound pod: the third process on the
    machine's cores, beside the API server and the scheduler."""
    wall_s: float


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q * 100)) if len(values) else 0.0


def _run(nodes: int, pods: int, *, ceiling: bool, creators: int, replay_threads: int, policy: str,
         timeout_s: float, progress: Progress | None, rate: float | None = None,
         dra: SlicesOf | None = None) -> KubeBenchRun:
    server = ServerProcess(nodes, dra)
    helper: subprocess.Popen[bytes] | multiprocessing.process.BaseProcess
    replay_conn: Connection | None = None
    with tempfile.TemporaryDirectory(prefix="gpuplane-bench-kube-") as workdir:
        api = RestKubeApi.from_url(server.url)
        try:
            _, rv = api.list(pod_path(NAMESPACE))
            watcher = _Watcher(api, rv)
            if ceiling:
                context = multiprocessing.get_context("spawn")
                replay_conn, child = context.Pipe()
                helper = context.Process(target=_replay, args=(server.url, replay_threads, rv, child), daemon=True)
                helper.start()
                replay_conn.recv()
            else:
                log = open(Path(workdir) / "scheduler.log", "wb")  # noqa: SIM115 (closed with the process)
                kubeconfig = write_kubeconfig(server.url, Path(workdir) / "kubeconfig")
                command = [sys.executable, "-m", "gpuplane.cli.main", "scheduler", "--kubeconfig", str(kubeconfig),
                           "--scheduler-name", SCHEDULER_NAME, "--no-leader-elect", "--node-policy", policy]
                if dra is not None:
                    command.append("--dra")
                helper = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            # One pod first: the scheduler is up and has listed the cluster once it is bound.
            warm = bench_pods(pods + 1)
            _create(api, warm[:1], 1, dra=dra is not None)
            if not watcher.wait(1, 300):
                raise TimeoutError("the first pod was not bound within 300 s: " + _tail(workdir))
            if progress is not None:
                progress(f"{nodes:,} nodes: creating {pods:,} pods …")
            before, server_cpu = _settled(server)
            helper_cpu = _cpu_s(helper.pid)
            client_cpu = time.process_time()
            started = time.perf_counter()
            sent = _create(api, warm[1:], creators, rate, dra=dra is not None)
            done = watcher.wait(pods + 1, timeout_s)
            finished = max(watcher.bound.values())
            after, server_cpu_after = _settled(server)
            helper_cpu_after = _cpu_s(helper.pid)
            client_s = time.process_time() - client_cpu
            watcher.close()
        finally:
            if isinstance(helper, subprocess.Popen):
                helper.terminate()
                helper.wait(10)
            elif helper is not None and replay_conn is not None:
                replay_conn.send("stop")
                helper.join(2)
                if helper.is_alive():
                    helper.terminate()
                    helper.join(10)
            server.close()
    latencies = [(watcher.bound[name] - at) * 1000 for name, at in sent.items() if name in watcher.bound]
    bound = len(latencies)
    if not done and progress is not None:
        progress(f"only {bound:,} of {pods:,} pods bound within {timeout_s:g} s")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) - before.get(k, 0)}
    writes = sum(v for k, v in delta.items() if k.split()[0] in ("POST", "PUT", "PATCH", "DELETE")
                 and k not in ("POST pods", "POST resourceclaims"))
    reads = sum(v for k, v in delta.items() if k.startswith("GET") and not k.endswith("(watch)"))
    per = max(1, bound)
    wall = max(1e-9, finished - started)
    helper_s = helper_cpu_after - helper_cpu if helper_cpu >= 0 else -1.0
    server_s = server_cpu_after - server_cpu
    return KubeBenchRun(nodes, pods, bound, round(bound / wall, 1),
                        round(_percentile(latencies, 0.5), 1), round(_percentile(latencies, 0.99), 1),
                        {k: round(v / per, 3) for k, v in sorted(delta.items())}, round(writes / per, 3), reads,
                        round(server_s * 100 / wall, 1), round(server_s * 1000 / per, 3),
                        round(helper_s * 100 / wall, 1) if helper_s >= 0 else -1.0,
                        round(helper_s * 1000 / per, 3) if helper_s >= 0 else -1.0, round(client_s * 1000 / per, 3),
                        round(wall, 2))


def _settled(server: ServerProcess, quiet_s: float = 0.3, timeout_s: float = 10.0) -> tuple[dict[str, int], float]:
    """The server's counts once no request has come for `quiet_s` (the writes after a bind, such as its event,
    may still be on their way when the watch shows the pod bound)."""
    counts, cpu = server.counts()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again, cpu = server.counts()
        if again == counts:
            break
        counts = again
    return counts, cpu


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process `pid` has used, from /proc; -1 where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return -1.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tail(workdir: str) -> str:
    path = Path(workdir) / "scheduler.log"
    return path.read_text(errors="replace")[-1500:] if path.exists() else ""


# ------------------------------------------------------------------ the benchmark
@dataclass(frozen=True, slots=True)
class KubeBenchFigures:
    nodes: int
    runs: tuple[KubeBenchRun, ...]
    median_pods_bound_per_s: float
    median_p50_ms: float
    median_p99_ms: float
    median_scheduler_cpu_ms_per_pod: float
    ceiling: KubeBenchRun | None


@dataclass(frozen=True, slots=True)
class KubeBenchResult:
    figures: tuple[KubeBenchFigures, ...]
    target_pods_per_s: float
    target_nodes: int
    max_writes_per_pod: float
    misses: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.misses

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_kube_bench(node_counts: Sequence[int], *, pods: int = 3000, repeats: int = 3, ceiling: bool = True,
                   creators: int = 4, replay_threads: int = 8, policy: str = "binpack", timeout_s: float = 300.0,
                   rate: float | None = None, progress: Progress | None = None,
                   dra: SlicesOf | None = None) -> KubeBenchResult:
    """`rate`: pods created a second (open loop) instead of as fast as the API server takes them: latency
    then shows the scheduler's own delay rather than the queue a burst builds up. `dra`: DRA nodes, their
    cards as the ResourceSlices this function makes (`gpuplane.cli.dra_cmd.bench_slices`), and pods asking
    through ResourceClaims the scheduler allocates (`gpuplane.kube.dra`); a claim's create counts as the pod's
    own, its status write as one of the scheduler's."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    figures: list[KubeBenchFigures] = []
    misses: list[str] = []
    for nodes in node_counts:
        runs = [_run(nodes, pods, ceiling=False, creators=creators, replay_threads=replay_threads, policy=policy,
                     timeout_s=timeout_s, progress=progress, rate=rate, dra=dra) for _ in range(repeats)]
        top = _run(nodes, pods, ceiling=True, creators=creators, replay_threads=replay_threads, policy=policy,
                   timeout_s=timeout_s, progress=progress, rate=rate, dra=dra) if ceiling and dra is None else None
        achieved = statistics.median(r.pods_bound_per_s for r in runs)
        figures.append(KubeBenchFigures(nodes, tuple(runs), achieved, statistics.median(r.p50_ms for r in runs),
                                        statistics.median(r.p99_ms for r in runs),
                                        statistics.median(r.scheduler_cpu_ms_per_pod for r in runs), top))
        for run in runs:
            if run.bound < run.pods:
                misses.append(f"{nodes} nodes: {run.pods - run.bound} pods not bound")
            if run.scheduler_writes_per_pod > MAX_WRITES_PER_POD:
                misses.append(f"{nodes} nodes: {run.scheduler_writes_per_pod} writes per bound pod "
                              f"(target ≤ {MAX_WRITES_PER_POD:g})")
            if run.reads_beyond_watches:
                misses.append(f"{nodes} nodes: {run.reads_beyond_watches} reads beyond the watch streams")
        if nodes >= TARGET_NODES and achieved < TARGET_PODS_PER_S:
            misses.append(f"{nodes} nodes: {achieved:g} pods bound/s (target ≥ {TARGET_PODS_PER_S:g})")
    return KubeBenchResult(tuple(figures), TARGET_PODS_PER_S, TARGET_NODES, MAX_WRITES_PER_POD, tuple(misses))
