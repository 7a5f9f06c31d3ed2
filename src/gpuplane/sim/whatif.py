"""What-if on a real cluster: replay a `Snapshot` under candidate policies and compare what each leaves idle.

One replay, per policy, on the kit's world (`build_world`: `SimCluster` + the production `Scheduler`):

1. the running pods are bound where they are, with their recorded assignments, before the scheduler decides
   anything (another stack's cards stay held, through the nodes' `foreign_cards`; pods asking no GPU keep their
   CPU and memory; pods already terminating are evicted with Kubernetes' default 30 s grace);
2. the pending pods arrive at once (t = 0), oldest first;
3. a synthetic continuation for `hours`: Poisson arrivals drawn with replacement from the snapshot's own pod mix
   (gpuplane's running and pending pods, gangs left out: one member alone would wait for the rest forever).

Departures. The snapshot says how long each pod has run, not how long it will: lifetimes are assumed exponential,
which makes the mean age of the running pods an estimate of the mean lifetime (a memoryless pod's age at a random
moment has its lifetime's distribution) and each running pod's remaining time a fresh draw of it. The arrival rate
is the one that keeps today's running set steady (Little's law: running pods / mean lifetime), times `load_scale`.
Heavy-tailed lifetimes (services running for weeks) make the mean age overstate the mean lifetime: set
`mean_lifetime_s` when you know it.

Every policy sees the same draws (arrival times, pods, lifetimes) for a seed: the figures differ by the policy alone.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from pydantic import Field

from gpuplane.kube.snapshot import CLUSTER_FILE, Snapshot, Stack
from gpuplane.model import MILLI_PER_CARD, Assignment, Catalog, Fraction, GpuplaneError, PodRequest, WholeCards
from gpuplane.port import ClusterEvent, EventKind, PodPhase
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.scheduler.scheduler import Outcome
from gpuplane.sim.scenario.world import WorldSettings, build_world
from gpuplane.sim.trace import NODE_COLUMNS, POD_COLUMNS

TERMINATION_GRACE_S = 30.0
"""Kubernetes' default `terminationGracePeriodSeconds`: what a pod the snapshot caught terminating has left."""


class WhatIfSettings(WorldSettings):
    """The replay's assumptions (`seed` draws the continuation; `kubelet_stop_s` from the kit's world)."""

    hours: float = Field(default=8.0, gt=0, le=24 * 7, description=(
        "virtual hours of continuation after the pending pods: one working shift, the timed replay's horizon"))
    load_scale: float = Field(default=1.0, gt=0, le=10, description=(
        "arrival rate as a multiple of the rate that keeps today's running pods steady (1.2: 20 % more load)"))
    mean_lifetime_s: float | None = Field(default=None, gt=0, description=(
        "mean pod lifetime; None: the mean age of gpuplane's running pods (exact for exponential lifetimes)"))
    default_lifetime_s: float = Field(default=3600.0, gt=0, description=(
        "mean lifetime when the snapshot records no start times (one hour)"))
    min_lifetime_s: float = Field(default=60.0, gt=0, description=(
        "shortest lifetime drawn: a pod takes about a minute to start and stop (the timed replay's floor)"))
    sample_every_s: float = Field(default=60.0, gt=0, description="seconds between samples of the idle share")


@dataclass(frozen=True, slots=True)
class Bind:
    """A bind the replay saw, in order (`at`: virtual seconds)."""

    at: float
    pod: str
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class WhatIfResult:
    policy: str
    seed: int
    running: int
    """Pods bound where they are at the start (every stack)."""
    pending_at_start: int
    pending_placed_at_once: int
    """Of the pending pods, those the policy placed at t = 0."""
    unallocated_after_pending_pct: float
    """GPU capacity left unallocated once the pending pods were tried (another stack's cards count as allocated)."""
    arrivals: int
    """Continuation pods that arrived."""
    placed: int
    """Pending and continuation pods placed during the replay."""
    pending_at_end: int
    failed: int
    """Pods the scheduler gave up on (a gang whose members never all came)."""
    unallocated_pct: float
    """Mean over the replay's samples."""
    unallocated_while_waiting_pct: float | None
    """Mean over the samples at which a pod was pending (capacity idle while demand waits); None: none waited."""
    wait_p50_s: float
    wait_p95_s: float
    """Waits from arrival to bind (pending pods arrive at t = 0); pods still pending at the end count with the time
    they have waited so far (a lower bound)."""
    mean_lifetime_s: float
    arrivals_per_hour: float
    binds: tuple[Bind, ...] = ()


@dataclass(frozen=True, slots=True)
class _Arrival:
    at: float
    request: PodRequest
    lifetime_s: float


@dataclass(frozen=True, slots=True)
class Draws:
    """What a seed draws, shared by every policy."""

    mean_lifetime_s: float
    rate_per_s: float
    remaining_s: dict[str, float]
    """Running gpuplane pods: seconds until each leaves."""
    pending_lifetime_s: dict[str, float]
    arrivals: tuple[_Arrival, ...]


def mix(snapshot: Snapshot) -> tuple[PodRequest, ...]:
    """The pods the continuation draws from: gpuplane's running and pending pods, but gang members and pods asking
    what gpuplane cannot place (`PodRequest.unsupported`)."""
    pods = [p.request for p in snapshot.running_of(Stack.GPUPLANE)] + [p.request for p in snapshot.pending]
    return tuple(r for r in pods if r.gpu is not None and r.gang is None and not r.unsupported)


def mean_lifetime(snapshot: Snapshot, settings: WhatIfSettings) -> float:
    if settings.mean_lifetime_s is not None:
        return settings.mean_lifetime_s
    ages = [a for p in snapshot.running_of(Stack.GPUPLANE) if (a := snapshot.age_s(p)) is not None]
    return max(settings.min_lifetime_s, float(np.mean(ages))) if ages else settings.default_lifetime_s


def draw(snapshot: Snapshot, settings: WhatIfSettings) -> Draws:
    rng = np.random.default_rng(settings.seed)
    life = mean_lifetime(snapshot, settings)

    def lifetime() -> float:
        return max(settings.min_lifetime_s, float(rng.exponential(life)))

    ours = snapshot.running_of(Stack.GPUPLANE)
    remaining = {p.name: lifetime() for p in ours if not p.terminating}
    pending = {p.name: lifetime() for p in snapshot.pending}
    pool = mix(snapshot)
    steady = len(ours) or len(snapshot.pending)
    rate = settings.load_scale * steady / life if pool else 0.0
    horizon = settings.hours * 3600.0
    arrivals: list[_Arrival] = []
    at = 0.0
    while rate > 0:
        at += float(rng.exponential(1.0 / rate))
        if at > horizon:
            break
        source = pool[int(rng.integers(len(pool)))]
        namespace, _, name = source.name.rpartition("/")
        copy = replace(source, name=f"{namespace}/{name}-w{len(arrivals)}" if namespace else f"{name}-w{len(arrivals)}",
                       instance=None)
        arrivals.append(_Arrival(at, copy, lifetime()))
    return Draws(life, rate, remaining, pending, tuple(arrivals))


def policy_config(policy: str, snapshot: Snapshot, seed: int) -> PolicyConfig:
    """`policy` as node policy, and as card policy where one has the name (as `simulate --compare`); FGD's policies
    aim at the snapshot's own pod mix."""
    cards = default_registry().card_policies
    return PolicyConfig(node_policy=policy, card_policy=policy if policy in cards else None,
                        typical=TypicalPods.from_workload(mix(snapshot) or [p.request for p in snapshot.pending]),
                        seed=seed)


def replay(snapshot: Snapshot, catalog: Catalog, policy: str, settings: WhatIfSettings | None = None, *,
           draws: Draws | None = None, record_binds: bool = False) -> WhatIfResult:
    """Replay `snapshot` under `policy` (a registered node policy). Raises `GpuplaneError` for an unknown policy or
    a running pod the world refuses (a snapshot `read_objects` accepted never has one)."""
    settings = settings if settings is not None else WhatIfSettings()
    draws = draws if draws is not None else draw(snapshot, settings)
    profile = default_registry().build(policy_config(policy, snapshot, settings.seed))
    world = build_world(catalog, snapshot.nodes, profile, seed=settings.seed, stop_s=settings.kubelet_stop_s)
    loop, cluster, scheduler = world.loop, world.cluster, world.scheduler
    binds: list[Bind] = []

    def seen(event: ClusterEvent) -> None:
        if event.kind is EventKind.POD_BOUND and event.pod is not None and event.pod.assignment is not None:
            binds.append(Bind(event.time, event.pod.name, event.pod.assignment))

    if record_binds:
        cluster.watch(seen)
    for pod in snapshot.running:
        status = cluster.create_pod(pod.request)
        if status.ok:
            status = cluster.bind(pod.name, pod.assignment)
        if not status.ok:
            raise GpuplaneError(f"running pod {pod.name} cannot be bound where it is: {status}")
    capacity = max(1, cluster.state.total_gpu_milli())

    def unallocated() -> float:
        return (capacity - cluster.state.used_gpu_milli()) * 100.0 / capacity

    arrived: dict[str, float] = {}
    waits: list[float] = []
    lifetimes = dict(draws.pending_lifetime_s)
    lifetimes.update({a.request.name: a.lifetime_s for a in draws.arrivals})

    def depart(name: str) -> None:
        cluster.delete_pod(name)
        scheduler.run_pending(record)

    def record(outcome: Outcome) -> bool:
        name = outcome.request.name
        if outcome.decision.status.ok and outcome.decision.assignment is not None and name in arrived:
            waits.append(loop.now() - arrived.pop(name))
            loop.call_later(lifetimes[name], functools.partial(depart, name))
        return True

    for pod in snapshot.running:
        if pod.terminating:
            cluster.evict(pod.name, grace_s=TERMINATION_GRACE_S, reason="terminating in the snapshot")
        elif pod.name in draws.remaining_s:
            loop.call_at(draws.remaining_s[pod.name], functools.partial(depart, pod.name))
    for pending in snapshot.pending:
        arrived[pending.name] = 0.0
        cluster.create_pod(pending.request)
    scheduler.run_pending(record)
    placed_at_once = sum(1 for p in snapshot.pending if p.name not in arrived and p.name not in cluster.failed)
    after_pending = unallocated()

    def arrive(arrival: _Arrival) -> None:
        arrived[arrival.request.name] = loop.now()
        cluster.create_pod(arrival.request)
        scheduler.run_pending(record)

    samples: list[tuple[float, bool]] = []

    def sample() -> None:
        scheduler.run_pending(record)  # parked pods are retried as often as the scheduler's flush would
        samples.append((unallocated(), any(name not in cluster.failed for name in arrived)))

    horizon = settings.hours * 3600.0
    for arrival in draws.arrivals:
        loop.call_at(arrival.at, functools.partial(arrive, arrival))
    for t in np.arange(0.0, horizon + 1e-9, settings.sample_every_s):
        loop.call_at(float(t), sample)
    loop.run(until=horizon)
    waiting = [pct for pct, any_pending in samples if any_pending]
    censored = [horizon - at for name, at in arrived.items() if name not in cluster.failed]
    all_waits = np.asarray(waits + censored) if waits or censored else np.zeros(1)
    return WhatIfResult(
        policy=profile.name, seed=settings.seed, running=len(snapshot.running),
        pending_at_start=len(snapshot.pending), pending_placed_at_once=placed_at_once,
        unallocated_after_pending_pct=after_pending, arrivals=len(draws.arrivals), placed=len(waits),
        pending_at_end=sum(1 for p in cluster.list_pods() if p.phase is PodPhase.PENDING), failed=len(cluster.failed),
        unallocated_pct=float(np.mean([pct for pct, _ in samples])),
        unallocated_while_waiting_pct=float(np.mean(waiting)) if waiting else None,
        wait_p50_s=float(np.percentile(all_waits, 50)), wait_p95_s=float(np.percentile(all_waits, 95)),
        mean_lifetime_s=draws.mean_lifetime_s, arrivals_per_hour=draws.rate_per_s * 3600.0, binds=tuple(binds))


def compare(snapshot: Snapshot, catalog: Catalog, policies: Sequence[str],
            settings: WhatIfSettings | None = None) -> list[WhatIfResult]:
    """`replay` under each policy, with the same draws."""
    settings = settings if settings is not None else WhatIfSettings()
    draws = draw(snapshot, settings)
    return [replay(snapshot, catalog, p, settings, draws=draws) for p in policies]


# ------------------------------------------------------------------ the snapshot as files `simulate` reads
NODES_FILE = "nodes.csv"
PODS_FILE = "pods.csv"
RUNNING_FILE = "running.csv"
RUNNING_COLUMNS = ("pod", "node", "stack", "cpu_milli", "memory_mib", "cards", "card_milli", "card_mib",
                   "started_at")
"""`running.csv`: one row per running pod; `cards`, `card_milli`, `card_mib` list the pod's gpuplane cards and
what it holds on each (`;`-separated), or, for another stack's pod, the whole cards its node's report names."""


@dataclass(frozen=True, slots=True)
class Written:
    """What `write_snapshot` wrote, and what the CSV formats could not say (the cluster file keeps all of it)."""

    files: tuple[str, ...]
    pods_written: int
    left_out: tuple[tuple[str, str], ...]
    """(pod, why) for gpuplane pods the pod CSV cannot express."""
    not_in_nodes_csv: tuple[str, ...]
    """What the nodes CSV cannot say about these nodes (foreign cards, taints, labels, topology, cordons)."""


def _trace_row(request: PodRequest) -> tuple[int, int, int | None] | str:
    """(num_gpu, gpu_milli, gpu_memory_mib or None) in `sim.trace`'s pod columns, or why it cannot be said."""
    gpu = request.gpu
    if isinstance(gpu, WholeCards):
        return gpu.count, MILLI_PER_CARD, None
    if isinstance(gpu, Fraction):
        if gpu.count != 1:
            return f"a share on {gpu.count} cards (the CSV's fractions take one card)"
        if gpu.memory_pct or gpu.encoders or gpu.decoders or gpu.package is not None:
            return "GPU memory as a percentage, codec units or a vGPU package (the CSV has compute and MiB)"
        if not gpu.compute_milli:
            return "GPU memory without compute (the CSV's fractions ask compute)"
        return 1, gpu.compute_milli, gpu.memory_mib or None
    return f"a GPU form the CSV cannot say ({type(gpu).__name__})"


def write_snapshot(snapshot: Snapshot, out_dir: Path) -> Written:
    """Write `NODES_FILE` and `PODS_FILE` (`sim.trace`'s node and pod CSVs: `simulate --nodes/--trace` read them),
    `RUNNING_FILE` and `CLUSTER_FILE` (the objects read, trimmed: `simulate --snapshot` reads it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / NODES_FILE).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow((*NODE_COLUMNS, "pool"))
        for node in snapshot.nodes:
            writer.writerow((node.name, node.cpu_milli, node.memory_mib, node.gpus, node.gpu_model or "", node.pool))
    left_out: list[tuple[str, str]] = []
    written = 0
    pods = [(p.request, "Running", p.started_at) for p in snapshot.running_of(Stack.GPUPLANE)]
    pods += [(p.request, "Pending", None) for p in snapshot.pending]
    created = {p.name: p.created_at for p in snapshot.pending}
    with (out_dir / PODS_FILE).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow((*POD_COLUMNS, "gpu_spec", "qos", "pod_phase", "creation_time", "scheduled_time",
                         "gpu_memory_mib"))
        for request, phase, started in pods:
            row = _trace_row(request)
            if isinstance(row, str):
                left_out.append((request.name, row))
                continue
            num_gpu, milli, memory = row
            spec = "|".join(sorted(request.models)) if request.models else ""
            born = created.get(request.name, started)
            writer.writerow((request.name, request.cpu_milli, request.memory_mib, num_gpu, milli, spec,
                             request.qos.value, phase, "" if born is None else f"{born:.0f}",
                             "" if started is None else f"{started:.0f}", "" if memory is None else memory))
            written += 1
    with (out_dir / RUNNING_FILE).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(RUNNING_COLUMNS)
        for pod in snapshot.running:
            shares = pod.assignment.cards
            cards = [s.card for s in shares] if shares else list(pod.foreign_cards)
            held = [s.compute_milli for s in shares] if shares else [MILLI_PER_CARD] * len(pod.foreign_cards)
            mib = [str(s.memory_mib) for s in shares] if shares else [""] * len(pod.foreign_cards)
            writer.writerow((pod.name, pod.assignment.node, pod.stack.value, pod.request.cpu_milli,
                             pod.request.memory_mib, ";".join(map(str, cards)), ";".join(map(str, held)),
                             ";".join(mib), "" if pod.started_at is None else f"{pod.started_at:.0f}"))
    (out_dir / CLUSTER_FILE).write_text(json.dumps({"apiVersion": "v1", "kind": "List", "metadata": {},
                                                    "items": list(snapshot.objects)}, indent=1) + "\n",
                                        encoding="utf-8")
    lost = []
    foreign = [n for n in snapshot.nodes if n.foreign_cards]
    if foreign:
        lost.append(f"cards another stack holds ({sum(len(n.foreign_cards) for n in foreign)} on "
                    f"{', '.join(n.name for n in foreign)})")
    for what, nodes in (("taints", [n for n in snapshot.nodes if n.taints]),
                        ("cordons", [n for n in snapshot.nodes if not n.schedulable])):
        if nodes:
            lost.append(f"{what} ({', '.join(n.name for n in nodes)})")
    lost.append("labels and card topology")
    return Written(tuple(str(out_dir / f) for f in (NODES_FILE, PODS_FILE, RUNNING_FILE, CLUSTER_FILE)), written,
                   tuple(left_out), tuple(lost))
