"""The parity proof: the same workload through the simulated cluster and through Kubernetes, the same decisions.

Both worlds run the same `Scheduler`. The simulated one drives it over `SimCluster`; the Kubernetes one runs it
over `KubeCluster` against the local API server (`gpuplane.kube.localapi.FakeApiServer`), either as
`gpuplane scheduler` in a separate process (`SchedulerProcess`, the proof) or in this process over a manually
pumped `KubeCluster` (`InProcessScheduler`, for the tests of the harness itself).

- Fill (`fill_parity`): the FGD protocol of `run_fill` (the same tuned workload, one pod at a time, a pod the
  scheduler cannot place is deleted, no retries). The Kubernetes world waits for each pod until the scheduler
  has acted on it (bound, or `PodScheduled=False`), then compares the node and the cards with the simulator's.
- Timed (`timed_parity`): a scripted workload with priorities, a gang, preemption and backfill
  (`timed_script`), replayed event by event. Bound pods' deletions are held by the API server until the
  harness finishes them at the simulated grace's end (`pod_deletion_delay_s=None` + `finish_deletion`), so both
  worlds see the same order of events; the ordered sequences of binds, evictions and failures are compared.

Both worlds read the same requests: each trace pod is written with `pod_manifest` and read back with the codec,
and that reading is what the simulator gets too. A pod whose decision-relevant fields do not survive that
round trip cannot be expressed as a pod: it is reported (`inexpressible`) and left out of both worlds.

Determinism the proof depends on (and checks where it can): the nodes are listed in the same order in both worlds.
The API server lists by key, as etcd does, so the Kubernetes world's order is by name; the bundled node list is
in name order already, and a list that is not is run in name order in both worlds (`nodes_reordered` says so:
the simulated side then differs from `run_fill` on the list as given). The scheduler draws its tie-breaks from
one seeded stream, so it must make the same decisions in the same order: a failed pod is deleted before the next
is created (a parked pod retried meanwhile would draw again; the scheduler's 300 s flush of parked pods could
only do so in the milliseconds between a failure and its deletion), and the timed script spans less than the
scheduler's shortest retry timer (60 s), so no timer fires in either world.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

from gpuplane.kube.api import ApiError, JsonObject, pod_path
from gpuplane.kube.cluster import KubeCluster, pod_manifest
from gpuplane.kube.declarations import POD_GROUP_API
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import ASSIGNMENT, SCHEDULER_NAME, decode_assignment, object_key, pod_request
from gpuplane.kube.standin import fill_through_extender, node_manifest
from gpuplane.model import Catalog, GpuplaneError, NodeSpec, PodRequest, WholeCards
from gpuplane.model.priority import BATCH_LOW, DEV, ONLINE, TRAINING, default_priority_classes
from gpuplane.port import ClusterEvent, EventKind
from gpuplane.scheduler import Profile, Scheduler
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop
from gpuplane.sim.replay import Progress, tune_workload

NAMESPACE = "parity"
SHOWN_DIFFERENCES = 10


# ------------------------------------------------------------------ the pods both worlds run
def _relevant(request: PodRequest) -> PodRequest:
    """The request without what the scheduler does not decide on (its labels)."""
    return replace(request, labels=())


def as_pod(request: PodRequest, catalog: Catalog) -> PodRequest:
    """`request` as the Kubernetes world reads it back from its pod (`pod_manifest`, then the codec).

    Raises ValueError naming what a pod cannot say (e.g. compute that is not whole percent) or the fields the
    round trip changes."""
    manifest = pod_manifest(request)
    manifest["metadata"]["namespace"] = manifest["metadata"].get("namespace") or NAMESPACE
    back = pod_request(manifest, catalog)
    changed = [f.name for f in fields(PodRequest) if f.name != "labels"
               and getattr(_relevant(back), f.name) != getattr(_relevant(request), f.name)]
    if changed:
        raise ValueError(f"reads back with other {', '.join(changed)}")
    return back


def expressible(pods: Sequence[PodRequest], catalog: Catalog) -> tuple[list[PodRequest], list[str]]:
    """The pods as both worlds will run them (named `parity/<name>`), and `name: why` for those that cannot be
    written as a Kubernetes pod."""
    kept: list[PodRequest] = []
    refused: list[str] = []
    for request in pods:
        named = replace(request, name=f"{NAMESPACE}/{request.name.lower()}")
        try:
            kept.append(as_pod(named, catalog))
        except (ValueError, GpuplaneError) as exc:
            refused.append(f"{request.name}: {exc}")
    return kept, refused


def _placement(pod: JsonObject | None) -> tuple[str, tuple[int, ...]]:
    """(node, cards) of a bound pod; ("", ()) for one that is not bound."""
    if pod is None or not (pod.get("spec") or {}).get("nodeName"):
        return "", ()
    raw = (pod.get("metadata", {}).get("annotations") or {}).get(ASSIGNMENT)
    if not raw:
        return str(pod["spec"]["nodeName"]), ()
    assignment = decode_assignment(raw, object_key(pod))
    return assignment.node, assignment.card_indexes


def scheduler_acted(pod: JsonObject | None) -> bool:
    """Bound, or marked unschedulable (`PodScheduled=False`, as kube-scheduler marks it), or gone."""
    if pod is None or (pod.get("spec") or {}).get("nodeName"):
        return True
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False"
               for c in (pod.get("status") or {}).get("conditions") or [])


# ------------------------------------------------------------------ the scheduler in the Kubernetes world
class KubeScheduler(Protocol):
    """The Kubernetes world's scheduler, as the harness drives it."""

    def act(self, server: FakeApiServer, key: str, timeout_s: float) -> JsonObject | None:
        """Wait until the scheduler has acted on pod `key` (`scheduler_acted`); the pod as stored then."""
        ...

    def settle(self, done: Callable[[], bool], timeout_s: float) -> None:
        """Let the scheduler react to what happened until `done()` (or `timeout_s`), then a little longer."""
        ...

    def close(self) -> None: ...


class InProcessScheduler:
    """The scheduler in this process over a `KubeCluster` it pumps itself: what `gpuplane scheduler` runs,
    without the process (no conditions or events are written: `act` returns once `run_pending` has tried the pod).
    """

    def __init__(self, server: FakeApiServer, catalog: Catalog, profile: Profile, *, seed: int,
                 now: Callable[[], float] | None = None) -> None:
        self.cluster = KubeCluster(server.api, catalog, dispatch="manual")
        self.scheduler = Scheduler(self.cluster, catalog, profile, seed=seed, now=now)

    def _round(self) -> None:
        self.cluster.pump()
        self.scheduler.run_pending()

    def act(self, server: FakeApiServer, key: str, timeout_s: float) -> JsonObject | None:
        deadline = time.monotonic() + timeout_s
        while self.cluster.get_pod(key) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scheduler's cache never saw pod {key}")
            self.cluster.wait_for_changes(0.05)
            self.cluster.pump()
        self._round()
        return server.get("pods", key)

    def settle(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._round()
        while time.monotonic() < deadline:
            if not self.cluster.wait_for_changes(0.2):
                if done():
                    return
                continue
            self._round()

    def close(self) -> None:
        self.scheduler.close()
        self.cluster.close()


class SchedulerProcess:
    """`gpuplane scheduler` as a separate process against `server` (kubeconfig from `write_kubeconfig`).

    `args`: its flags beyond `--kubeconfig` (policy, seed). Its log goes to `log_path`; `close()` stops it."""

    def __init__(self, server: FakeApiServer, args: Sequence[str], workdir: Path, *, settle_s: float = 0.3) -> None:
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        self.log_path = workdir / "scheduler.log"
        self.settle_s = settle_s
        self._log = self.log_path.open("wb")
        command = [sys.executable, "-m", "gpuplane.cli.main", "scheduler", "--kubeconfig", str(kubeconfig), *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def _check(self) -> None:
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise GpuplaneError(f"gpuplane scheduler exited with {self.process.returncode}: {tail}")

    def act(self, server: FakeApiServer, key: str, timeout_s: float) -> JsonObject | None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                return server.wait_for("pods", key, scheduler_acted, min(1.0, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"gpuplane scheduler did not act on pod {key} within {timeout_s:g} s") \
                        from None

    def settle(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            self._check()
            time.sleep(0.02)
        time.sleep(self.settle_s)  # anything it does beyond what was expected shows up as a difference

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


SchedulerFactory = Callable[[FakeApiServer, Callable[[], float]], KubeScheduler]
"""Builds the Kubernetes world's scheduler over a started server whose nodes are in place; the callable is the
harness's virtual clock (only an in-process scheduler can use it)."""


def in_process(catalog: Catalog, profile: Profile, seed: int) -> SchedulerFactory:
    return lambda server, now: InProcessScheduler(server, catalog, profile, seed=seed, now=now)


def separate_process(args: Sequence[str], workdir: Path) -> SchedulerFactory:
    return lambda server, now: SchedulerProcess(server, args, workdir)


@contextmanager
def _kube_world(nodes: Sequence[NodeSpec], factory: SchedulerFactory, now: Callable[[], float],
                pod_deletion_delay_s: float | None) -> Iterator[tuple[FakeApiServer, KubeScheduler]]:
    with FakeApiServer(pod_deletion_delay_s=pod_deletion_delay_s) as server:
        for spec in nodes:
            server.add_node(node_manifest(spec))
        scheduler = factory(server, now)
        try:
            yield server, scheduler
        finally:
            scheduler.close()


def declare_gangs(server: FakeApiServer, requests: Sequence[PodRequest]) -> None:
    """A PodGroup (scheduler-plugins', `minMember` the gang's size) for every gang the pods name, as users
    declare gangs for `gpuplane scheduler`."""
    gangs = {(r.name.split("/", 1)[0], r.gang): r.gang_size for r in requests if r.gang is not None}
    for (namespace, gang), size in sorted(gangs.items()):
        server.api.create(f"/apis/{POD_GROUP_API}/namespaces/{namespace}/podgroups",
                          {"apiVersion": POD_GROUP_API, "kind": "PodGroup", "metadata": {"name": gang},
                           "spec": {"minMember": size}})


def in_api_order(nodes: Sequence[NodeSpec]) -> list[NodeSpec]:
    """The nodes in the order the API server lists them (by name, as etcd lists its keys)."""
    return sorted(nodes, key=lambda spec: spec.name)


# ------------------------------------------------------------------ fill
@dataclass(frozen=True, slots=True)
class Difference:
    seq: int
    pod: str
    sim: str
    kube: str


@dataclass(frozen=True, slots=True)
class FillParity:
    pods: int
    differences: int
    first_differences: tuple[Difference, ...]
    sim_unallocated_pct: float
    kube_unallocated_pct: float
    """Unallocated GPU % once the arrived workload reached 100 % of capacity (at the end if it never did)."""
    placed: int
    failed: int
    inexpressible: tuple[str, ...]
    nodes_reordered: bool
    """The node list was not in name order: both worlds ran it in the API server's order."""
    nodes: int
    wall_s: float


def _describe(node: str, cards: tuple[int, ...]) -> str:
    return f"{node} {list(cards)}" if node else "unschedulable"


class _Allocation:
    """Allocation against arrived workload, as `SimulationResult.unallocated_at(100)` reads it."""

    def __init__(self, capacity_milli: int) -> None:
        self.capacity = capacity_milli
        self.arrived = 0
        self.used = 0
        self.at_100 = 0.0

    def add(self, request: PodRequest, placed: bool) -> None:
        self.arrived += request.gpu_milli_total
        self.used += request.gpu_milli_total if placed else 0
        if self.arrived <= self.capacity:
            self.at_100 = self.used * 100.0 / self.capacity

    @property
    def unallocated_pct(self) -> float:
        return round(100.0 - self.at_100, 4)


def fill_workload(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest], seed: int,
                  tune: float = 1.3) -> tuple[list[PodRequest], list[str]]:
    """The tuned workload `run_fill` replays (seeded shuffle and resampling to `tune` × capacity), as pods both
    worlds can run, and the pods that cannot be written as Kubernetes pods."""
    capacity = SimCluster(catalog, nodes).state.total_gpu_milli()
    workload = tune_workload(pods, capacity, seed, tune)
    return expressible(workload, catalog)


def sim_fill(catalog: Catalog, nodes: Sequence[NodeSpec], workload: Sequence[PodRequest], profile: Profile,
             seed: int) -> list[tuple[str, tuple[int, ...]]]:
    """`run_fill`'s loop on the simulated cluster: (node, cards) per pod, ("", ()) when it was not placed."""
    cluster = SimCluster(catalog, nodes)
    scheduler = Scheduler(cluster, catalog, profile, seed=seed)
    out: list[tuple[str, tuple[int, ...]]] = []
    for request in workload:
        cluster.create_pod(request)
        decision = scheduler.run_pending(on_outcome=lambda _: False)[-1].decision
        if decision.status.ok and decision.assignment is not None:
            out.append((decision.assignment.node, decision.assignment.card_indexes))
        else:
            out.append(("", ()))
            cluster.delete_pod(request.name)
    return out


def kube_fill(nodes: Sequence[NodeSpec], workload: Sequence[PodRequest], factory: SchedulerFactory, *,
              timeout_s: float = 60.0, progress: Progress | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The same loop through the API server: create a pod, wait until the scheduler acted, delete it if not
    bound (before the next is created)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    with _kube_world(nodes, factory, lambda: 0.0, 0.0) as (server, scheduler):
        api = server.api
        for seq, request in enumerate(workload):
            namespace, name = request.name.split("/", 1)
            api.create(pod_path(namespace), pod_manifest(request))
            # The first pod also waits for the scheduler to start and list the cluster.
            pod = scheduler.act(server, request.name, timeout_s * 4 if seq == 0 else timeout_s)
            node, cards = _placement(pod)
            out.append((node, cards))
            if not node and pod is not None:
                try:
                    api.delete(pod_path(namespace, name))
                except ApiError as exc:
                    if exc.status != 404:
                        raise
            if progress is not None and (seq % 64 == 0 or seq == len(workload) - 1):
                progress(seq + 1, len(workload))
    return out


def compare_fill(catalog: Catalog, nodes: Sequence[NodeSpec], workload: Sequence[PodRequest],
                 sim: Sequence[tuple[str, tuple[int, ...]]], kube: Sequence[tuple[str, tuple[int, ...]]],
                 inexpressible: Sequence[str], wall_s: float) -> FillParity:
    capacity = SimCluster(catalog, nodes).state.total_gpu_milli()
    sim_alloc, kube_alloc = _Allocation(capacity), _Allocation(capacity)
    differences: list[Difference] = []
    for seq, (request, a, b) in enumerate(zip(workload, sim, kube, strict=True)):
        sim_alloc.add(request, bool(a[0]))
        kube_alloc.add(request, bool(b[0]))
        if a != b:
            differences.append(Difference(seq, request.name, _describe(*a), _describe(*b)))
    placed = sum(1 for node, _ in kube if node)
    return FillParity(len(workload), len(differences), tuple(differences[:SHOWN_DIFFERENCES]),
                      sim_alloc.unallocated_pct, kube_alloc.unallocated_pct, placed, len(kube) - placed,
                      tuple(inexpressible), False, len(nodes), round(wall_s, 2))


def fill_parity(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest], profile: Profile,
                factory: SchedulerFactory, *, seed: int = 42, limit: int | None = None, tune: float = 1.3,
                sim_profile: Profile | None = None, sim_seed: int | None = None,
                progress: Progress | None = None) -> FillParity:
    """Fill replay in both worlds; `limit`: only the first pods of the tuned workload. `sim_profile`/`sim_seed`
    give the simulator another policy or seed (the check that a difference is seen)."""
    started = time.perf_counter()
    ordered = in_api_order(nodes)
    workload, refused = fill_workload(catalog, ordered, pods, seed, tune)
    if limit is not None:
        workload = workload[:limit]
    sim = sim_fill(catalog, ordered, workload, sim_profile or profile, seed if sim_seed is None else sim_seed)
    kube = kube_fill(ordered, workload, factory, progress=progress)
    result = compare_fill(catalog, ordered, workload, sim, kube, refused, time.perf_counter() - started)
    return replace(result, nodes_reordered=ordered != list(nodes))


# ------------------------------------------------------------------ timed
@dataclass(frozen=True, slots=True)
class Arrive:
    at: float
    request: PodRequest


@dataclass(frozen=True, slots=True)
class Leave:
    at: float
    pod: str


Step = Arrive | Leave


@dataclass(frozen=True, slots=True)
class Happened:
    """One thing the scheduler did to the world: bind (with node and cards), evict, or fail a pod."""

    kind: str
    pod: str
    node: str = ""
    cards: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind} {self.pod}" + (f" -> {self.node} {list(self.cards)}" if self.kind == "bind" else "")


@dataclass(frozen=True, slots=True)
class TimedParity:
    steps: int
    events: int
    differences: int
    first_differences: tuple[Difference, ...]
    sim_events: tuple[str, ...]
    kube_events: tuple[str, ...]
    binds: int
    evictions: int
    wall_s: float


def timed_nodes(catalog: Catalog) -> list[NodeSpec]:
    """Four 4-card A100 nodes: small enough that every placement in the script matters."""
    return [NodeSpec(f"node-{i}", 64_000, 262_144, catalog.canonical("A100-80GB"), 4) for i in range(4)]


def timed_script(catalog: Catalog) -> list[Step]:
    """Arrivals and departures, one at a time, within 60 s (the scheduler's shortest retry timer):

    - t 0–4: dev pods (300) take 10 of the 16 cards;
    - t 6–9: low-priority batch (100, backfill, grace 0) fills the rest, one pod more than fits (it waits);
    - t 12–14: a 3 × 2-card training gang (500): placed past the backfill, which is evicted at once;
    - t 16: an online pod (1000) for 4 cards: preempts dev pods (grace 30 s), nominated until they are gone;
    - t 18: a Never-preempting online pod that waits; t 20: a 1-card dev pod that waits behind it;
    - t 25, 30: dev pods leave: the parked pods are tried again, highest priority first;
    - t 46: the victims' grace ends (30 s after t 16): the online pod binds;
    - t 50, 55: more departures and a last batch pod.
    """
    classes = default_priority_classes()

    def pod(name: str, cls: str, cards: int, **extra: Any) -> PodRequest:
        return classes.resolve(PodRequest(f"{NAMESPACE}/{name}", cpu_milli=4000, memory_mib=16384,
                                          gpu=WholeCards(cards), priority_class=cls, **extra))

    gang = {"gang": "train-a", "gang_size": 3}
    return [
        Arrive(0, pod("dev-0", DEV, 4)), Arrive(1, pod("dev-1", DEV, 2)), Arrive(2, pod("dev-2", DEV, 2)),
        Arrive(3, pod("dev-3", DEV, 1)), Arrive(4, pod("dev-4", DEV, 1)),
        Arrive(6, pod("batch-0", BATCH_LOW, 2)), Arrive(7, pod("batch-1", BATCH_LOW, 2)),
        Arrive(8, pod("batch-2", BATCH_LOW, 2)), Arrive(9, pod("batch-3", BATCH_LOW, 1)),
        Arrive(12, pod("train-0", TRAINING, 2, **gang)), Arrive(13, pod("train-1", TRAINING, 2, **gang)),
        Arrive(14, pod("train-2", TRAINING, 2, **gang)),
        Arrive(16, pod("online-0", ONLINE, 4)),
        Arrive(18, pod("online-1", ONLINE, 2, preempt=False)),
        Arrive(20, pod("dev-5", DEV, 1)),
        Leave(25, f"{NAMESPACE}/dev-3"), Leave(30, f"{NAMESPACE}/dev-4"),
        Leave(50, f"{NAMESPACE}/train-0"), Arrive(52, pod("batch-4", BATCH_LOW, 1)),
        Leave(55, f"{NAMESPACE}/online-1"),
    ]


def sim_timed(catalog: Catalog, nodes: Sequence[NodeSpec], script: Sequence[Step], profile: Profile,
              seed: int) -> list[tuple[int, Happened]]:
    """The script on the simulated cluster in virtual time, as (moment, what happened). A moment is an event of
    the world: a scripted arrival or departure, or a victim's grace ending; the scheduler runs after each, as
    `gpuplane scheduler` does after every change it sees."""
    loop = EventLoop()
    cluster = SimCluster(catalog, nodes, loop=loop)
    scheduler = Scheduler(cluster, catalog, profile, seed=seed, now=loop.now)
    left: set[str] = set()
    terminating: set[str] = set()
    happened: list[tuple[int, Happened]] = []
    moment = 0

    def observe(event: ClusterEvent) -> None:
        pod = event.pod
        if pod is None:
            return
        if event.kind is EventKind.POD_BOUND and pod.assignment is not None:
            happened.append((moment, Happened("bind", pod.name, pod.assignment.node, pod.assignment.card_indexes)))
        elif event.kind is EventKind.POD_TERMINATING:
            terminating.add(pod.name)
            happened.append((moment, Happened("evict", pod.name)))
        elif event.kind is EventKind.POD_DELETED and pod.name not in left and pod.name not in terminating:
            happened.append((moment, Happened("evict", pod.name)))  # evicted with no grace: deleted at once
        elif event.kind is EventKind.POD_FAILED:
            happened.append((moment, Happened("fail", pod.name)))

    cluster.watch(observe)

    def run(step: Step) -> None:
        if isinstance(step, Arrive):
            cluster.create_pod(step.request)
        else:
            left.add(step.pod)
            cluster.delete_pod(step.pod)

    for step in script:
        loop.call_at(step.at, functools.partial(run, step))
    while loop.step():
        scheduler.run_pending()
        moment += 1
    scheduler.close()
    return happened


class _PodLog:
    """What the scheduler did to the pods, read from a watch (the harness's own deletions left out)."""

    def __init__(self, server: FakeApiServer) -> None:
        self.happened: list[Happened] = []
        self.left: set[str] = set()
        """Pods the harness deleted (departures): their deletion is not the scheduler's."""
        self._graces: dict[str, float] = {}
        self._last: dict[str, JsonObject] = {}
        self._bound: set[str] = set()
        self._lock = threading.Lock()
        self._stream = server.api.watch(pod_path(NAMESPACE), str(server.resource_version), timeout_s=3600)
        self._thread = threading.Thread(target=self._run, name="parity pod log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for kind, obj in self._stream:
                self._see(kind, obj)
        except ApiError:
            return

    def _see(self, kind: str, obj: JsonObject) -> None:
        key = object_key(obj)
        with self._lock:
            old = self._last.pop(key, {})
            terminating = bool((old.get("metadata") or {}).get("deletionTimestamp"))
            if kind == "DELETED":
                if key not in self.left and not terminating and key in self._bound:
                    self.happened.append(Happened("evict", key))  # evicted with no grace: deleted at once
                return
            self._last[key] = obj
            meta = obj.get("metadata") or {}
            node, cards = _placement(obj)
            if node and key not in self._bound:
                self._bound.add(key)
                self.happened.append(Happened("bind", key, node, cards))
            if meta.get("deletionTimestamp") and not terminating and key not in self.left:
                self._graces[key] = float(meta.get("deletionGracePeriodSeconds") or 0)
                self.happened.append(Happened("evict", key))
            failed = (obj.get("status") or {}).get("phase") == "Failed"
            if failed and (old.get("status") or {}).get("phase") != "Failed":
                self.happened.append(Happened("fail", key))

    def __len__(self) -> int:
        with self._lock:
            return len(self.happened)

    def take_graces(self) -> dict[str, float]:
        """Pods evicted since the last call, with their grace period (for the harness to end it)."""
        with self._lock:
            graces, self._graces = self._graces, {}
            return graces

    def close(self) -> None:
        self._stream.close()
        self._thread.join(5.0)


def kube_timed(nodes: Sequence[NodeSpec], script: Sequence[Step], factory: SchedulerFactory,
               expected: Callable[[int], int], *, timeout_s: float = 10.0) -> list[Happened]:
    """The script through the API server, moment by moment in script time. The API server holds the deletions of
    bound pods (`pod_deletion_delay_s=None`); the harness ends an eviction when its grace ends in script time
    (`finish_deletion`). After each moment the scheduler settles until `expected(moments run)` events were
    seen (the simulator's count, so a missing event costs a timeout rather than a wrong comparison)."""
    clock = [0.0]
    with _kube_world(nodes, factory, lambda: clock[0], None) as (server, scheduler):
        declare_gangs(server, [step.request for step in script if isinstance(step, Arrive)])
        log = _PodLog(server)
        try:
            api = server.api
            queue: list[tuple[float, int, Step | str]] = [(step.at, i, step) for i, step in enumerate(script)]
            heapq.heapify(queue)
            order = len(queue)
            moments = 0
            while queue:
                at, _, item = heapq.heappop(queue)
                clock[0] = at
                if isinstance(item, Arrive):
                    api.create(pod_path(NAMESPACE), pod_manifest(item.request))
                elif isinstance(item, Leave):
                    log.left.add(item.pod)
                    try:
                        api.delete(pod_path(*item.pod.split("/", 1)), {"gracePeriodSeconds": 0})
                    except ApiError as exc:
                        if exc.status != 404:
                            raise
                else:
                    server.finish_deletion(item)
                moments += 1
                target = expected(moments)
                scheduler.settle(lambda t=target: len(log) >= t, timeout_s)  # type: ignore[misc]
                for pod, grace in log.take_graces().items():
                    heapq.heappush(queue, (at + grace, order, pod))
                    order += 1
            return list(log.happened)
        finally:
            log.close()


def timed_parity(catalog: Catalog, profile: Profile, factory: SchedulerFactory, *, seed: int = 42,
                 script: Sequence[Step] | None = None, nodes: Sequence[NodeSpec] | None = None,
                 sim_profile: Profile | None = None, sim_seed: int | None = None) -> TimedParity:
    """The timed script in both worlds; `sim_profile`/`sim_seed` as for `fill_parity`."""
    started = time.perf_counter()
    script = list(script if script is not None else timed_script(catalog))
    nodes = list(nodes if nodes is not None else timed_nodes(catalog))
    timed = sim_timed(catalog, nodes, script, sim_profile or profile, seed if sim_seed is None else sim_seed)
    sim = [h for _, h in timed]
    kube = kube_timed(nodes, script, factory, lambda moments: sum(1 for m, _ in timed if m < moments))
    differences = [Difference(i, (a or b).pod if (a or b) else "", str(a) if a else "-", str(b) if b else "-")
                   for i, (a, b) in enumerate(itertools.zip_longest(sim, kube)) if a != b]
    return TimedParity(len(script), len(sim), len(differences), tuple(differences[:SHOWN_DIFFERENCES]),
                       tuple(str(h) for h in sim), tuple(str(h) for h in kube),
                       sum(1 for h in kube if h.kind == "bind"), sum(1 for h in kube if h.kind == "evict"),
                       round(time.perf_counter() - started, 2))


# ------------------------------------------------------------------ the report
@dataclass(frozen=True, slots=True)
class ExtenderFigures:
    """Extender mode through the kube-scheduler stand-in beside the simulator: unallocated GPU % at 100 %
    arrived, the same tuned workload."""

    policy: str
    pods: int
    sim_unallocated_pct: float
    extender_unallocated_pct: float
    wall_s: float

    @property
    def gap(self) -> float:
        return round(self.extender_unallocated_pct - self.sim_unallocated_pct, 4)


def extender_parity(catalog: Catalog, nodes: Sequence[NodeSpec], pods: Sequence[PodRequest],
                    profiles: Sequence[Profile], *, seed: int = 42, limit: int | None = None,
                    progress: Progress | None = None) -> list[ExtenderFigures]:
    """The fill replay through the extender and the stand-in (`standin.fill_through_extender`, gpuplane's
    decision as the filter's only answer) against the simulator, one policy at a time (nodes in the API server's
    order, as `fill_parity` runs them)."""
    nodes = in_api_order(nodes)
    workload, _ = fill_workload(catalog, nodes, pods, seed)
    workload = workload[:limit] if limit is not None else workload
    capacity = SimCluster(catalog, nodes).state.total_gpu_milli()
    figures = []
    for profile in profiles:
        started = time.perf_counter()
        sim = _Allocation(capacity)
        for request, (node, _) in zip(workload, sim_fill(catalog, nodes, workload, profile, seed), strict=True):
            sim.add(request, bool(node))
        through = fill_through_extender(catalog, nodes, workload, profile, seed=seed, progress=progress)
        figures.append(ExtenderFigures(profile.name, len(workload), sim.unallocated_pct,
                                       round(through.unallocated_at(100.0), 4),
                                       round(time.perf_counter() - started, 2)))
    return figures


@dataclass(frozen=True, slots=True)
class ParityReport:
    trace: str
    policy: str
    seed: int
    scheduler: str
    fill: FillParity | None = None
    timed: TimedParity | None = None
    extender: tuple[ExtenderFigures, ...] = ()

    @property
    def differences(self) -> int:
        return (self.fill.differences if self.fill else 0) + (self.timed.differences if self.timed else 0)

    def to_json(self) -> dict[str, Any]:
        data = {"pods": self.fill.pods if self.fill else 0, "differences": self.differences, **asdict(self)}
        data["extender"] = [{**asdict(f), "gap": f.gap} for f in self.extender]
        return data


def report_json(report: ParityReport) -> str:
    return json.dumps(report.to_json())


def summary_rows(report: ParityReport) -> dict[str, Any]:
    """The figures a person reads first, for a two-column table."""
    rows: dict[str, Any] = {"differences": report.differences}
    if report.fill is not None:
        fill = report.fill
        rows |= {"fill pods": fill.pods, "fill differences": fill.differences, "fill placed": fill.placed,
                 "fill unallocated % (simulator)": fill.sim_unallocated_pct,
                 "fill unallocated % (Kubernetes)": fill.kube_unallocated_pct,
                 "fill pods not expressible as pods": len(fill.inexpressible)}
        rows |= {f"fill difference {d.seq} {d.pod}": f"sim {d.sim} / kube {d.kube}" for d in fill.first_differences}
    if report.timed is not None:
        timed = report.timed
        rows |= {"timed steps": timed.steps, "timed events": timed.events, "timed differences": timed.differences,
                 "timed binds": timed.binds, "timed evictions": timed.evictions}
        rows |= {f"timed difference {d.seq}": f"sim {d.sim} / kube {d.kube}" for d in timed.first_differences}
    for figures in report.extender:
        rows[f"extender {figures.policy} unallocated % (simulator / stand-in)"] = \
            f"{figures.sim_unallocated_pct} / {figures.extender_unallocated_pct} ({figures.gap:+g} points)"
    return rows


def scheduler_args(node_policy: str, card_policy: str | None, seed: int, *, trace: str) -> list[str]:
    """The flags that give `gpuplane scheduler` the simulator's policy, seed and target workload (FGD's typical
    pods, from `trace`); binds on the deciding thread, no leader election, the pods' scheduler name."""
    args = ["--scheduler-name", SCHEDULER_NAME, "--no-leader-elect", "--sync-binds", "--node-policy", node_policy,
            "--seed", str(seed), "--typical-pods", trace]
    if card_policy is not None:
        args += ["--card-policy", card_policy]
    return args


def temporary_workdir() -> tempfile.TemporaryDirectory[str]:
    """Where the scheduler process's kubeconfig and log live while the experiment runs."""
    return tempfile.TemporaryDirectory(prefix="gpuplane-parity-")
