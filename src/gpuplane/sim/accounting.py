"""The accounting ledger on the platform simulation: its utilisation reader and the `--simulate` source.

`run_arm`'s `on_world` hook attaches an `AccountingLedger` to the week's `SimCluster`, reading the loop's virtual
clock. `PlatformBusy` is the simulator's utilisation reader: it re-derives the week's SM-busy model
(`week.busy_milli`) from what the port shows, since the week keeps its jobs' state to itself:

- a serving replica: from `startup_s` after its bind, its service's load share over the ready replicas, of the
  compute one replica needs (at most what it holds);
- a training pod: `training_busy` once every member of its gang holds cards and its node is schedulable (a node
  cordoned by a fault hangs the gang: 0 until it is restarted);
- a batch or near-line pod (`batch-low`): `batch_busy`; a dev box (`dev`): `dev_busy` of a card, at most what it
  holds; a Terminating pod: 0 (its job has stopped).

Who pays: serving replicas are in namespace `serving`, training pods in `training` (team: their queue, `team-N`),
batch and near-line pods in `batch`, dev boxes in `dev` (the simulated pods carry no namespace).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpuplane.controllers.accounting import AccountingLedger, Booking
from gpuplane.model import MILLI_PER_CARD
from gpuplane.model.priority import BATCH_LOW, DEV, TRAINING
from gpuplane.port import PodInfo, PodPhase
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.platform import ArmRun, PlatformSettings, run_arm
from gpuplane.sim.platform.work import Service, build_services, service_pools
from gpuplane.sim.scenario import DAY_S
from gpuplane.sim.scenario.world import World

NAMESPACES = {TRAINING: "training", BATCH_LOW: "batch", DEV: "dev"}


def platform_namespace(pod: PodInfo) -> str:
    """The namespace a simulated platform pod stands for (see the module docstring)."""
    if pod.request.workload is not None:
        return "serving"
    return NAMESPACES.get(pod.request.priority_class or "", "default")


class PlatformBusy:
    """The platform week's busy share of a pod's cards, read through the port (see the module docstring)."""

    def __init__(self, s: PlatformSettings, cluster: SimCluster) -> None:
        self.s, self.cluster = s, cluster
        services = build_services(s, np.random.default_rng(s.seed))  # run_arm's first draws from the same seed
        self.service_of: dict[str, Service] = {w: svc for svc in services for w in service_pools(svc)}
        self._at: float | None = None
        self._ready: dict[str, int] = {}
        self._gang_running: dict[str, int] = {}
        self._cordoned: set[str] = set()

    def _refresh(self, now: float) -> None:
        if self._at == now:
            return
        ready: dict[str, int] = defaultdict(int)
        running: dict[str, int] = defaultdict(int)
        for pod in self.cluster.list_pods():
            if pod.phase is not PodPhase.RUNNING:
                continue
            svc = self.service_of.get(pod.request.workload or "")
            if svc is not None and pod.bound_at is not None and pod.bound_at + self.s.startup_s <= now:
                ready[svc.name] += 1
            if pod.request.gang is not None:
                running[pod.request.gang] += 1
        self._at, self._ready, self._gang_running = now, ready, running
        self._cordoned = {n.name for n in self.cluster.list_nodes() if not n.spec.schedulable}

    def busy_shares(self, pods: Sequence[PodInfo], now: float) -> Mapping[str, float | None]:
        return {pod.name: self.busy_share(pod, now) for pod in pods}

    def busy_share(self, pod: PodInfo, now: float) -> float | None:
        assignment = pod.assignment
        if assignment is None or assignment.gpu_milli <= 0:
            return None
        if pod.phase is not PodPhase.RUNNING:
            return 0.0
        self._refresh(now)
        s, milli = self.s, assignment.gpu_milli
        svc = self.service_of.get(pod.request.workload or "")
        if svc is not None:
            if pod.bound_at is None or pod.bound_at + s.startup_s > now:
                return 0.0
            share = min(1.0, svc.load(now) / (max(1, self._ready.get(svc.name, 0)) * s.per_replica_capacity))
            return share * min(svc.need_milli, milli) / milli
        kind = pod.request.priority_class
        if kind == DEV:
            return min(1.0, s.dev_busy * MILLI_PER_CARD / milli)
        if kind == BATCH_LOW:
            return s.batch_busy
        if kind == TRAINING:
            gang = pod.request.gang
            if gang is not None and self._gang_running.get(gang, 0) < pod.request.gang_size:
                return 0.0
            return 0.0 if assignment.node in self._cordoned else s.training_busy
        return None


@dataclass(frozen=True, slots=True)
class SimulatedLedger:
    """A platform simulation's bookings, over [0, `horizon_s`) of virtual time, and the week's own figures."""

    settings: PlatformSettings
    bookings: tuple[Booking, ...]
    horizon_s: float
    run: ArmRun


def simulate(settings: PlatformSettings, *, sample_s: float = 60.0,
             sink: Callable[[Booking], None] | None = None) -> SimulatedLedger:
    """Run the platform arm of `settings` with a ledger attached; its bookings up to the horizon."""
    ledgers: list[AccountingLedger] = []

    def attach(world: World) -> None:
        ledgers.append(AccountingLedger(world.cluster, world.loop, PlatformBusy(settings, world.cluster),
                                        sample_s=sample_s, sink=sink, namespace=platform_namespace))

    run = run_arm(settings, on_world=attach)
    horizon = settings.days * DAY_S
    ledger = ledgers[0]
    ledger.close(horizon)
    return SimulatedLedger(settings, tuple(ledger.bookings), horizon, run)
