"""One world for every scenario that places pods: `EventLoop` + `SimCluster` + the production `Scheduler`.

The admission chain and the scheduler are the ones a cluster runs; termination takes the kubelet's time
(grace, then `kubelet_stop_s` to stop the container and free its devices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pydantic import Field

from gpuplane.model import Catalog, NodeSpec, PoolConfig, PriorityClasses, Quotas, default_priority_classes
from gpuplane.scheduler import Profile, Scheduler, SchedulingRules
from gpuplane.scheduler.admission import Admission
from gpuplane.sim.cluster import SimCluster
from gpuplane.sim.engine import EventLoop
from gpuplane.sim.scenario.kit import ScenarioSettings

KUBELET_STOP_S = 2.0
"""Assumed seconds from SIGKILL or exit to a freed device: the runtime's StopContainer and the CUDA
context's teardown. An assumption, not a measurement; scenarios expose it as `kubelet_stop_s`."""


class WorldSettings(ScenarioSettings):
    """Settings of a scenario that places pods in the simulated world."""

    kubelet_stop_s: float = Field(default=KUBELET_STOP_S, ge=0.0,
                                  description="seconds from a container's exit or kill to its pod's deletion")


@dataclass(slots=True)
class World:
    loop: EventLoop
    cluster: SimCluster
    scheduler: Scheduler
    admission: Admission | None


def build_world(catalog: Catalog, nodes: Sequence[NodeSpec], profile: Profile, *, seed: int,
                stop_s: float = KUBELET_STOP_S, rules: SchedulingRules | None = None,
                classes: PriorityClasses | None = None, pools: Mapping[str, PoolConfig] | None = None,
                loop: EventLoop | None = None, quotas: Quotas | None = None) -> World:
    """The world a scenario runs in. With `classes`, pods pass the production admission (priority classes,
    quotas) before they exist, as in a cluster.

    `quotas` are the queues' quotas, one source for both the admission (unknown queues and pods above their
    queue's maximum refused) and the scheduler's rules (a `rules` without quotas gets them). Without
    `quotas`, both use `rules.quotas` (none when `rules` is not given). A `rules` whose quotas differ from
    `quotas` is refused: the two would judge the same queue by two quotas."""
    if quotas is not None and rules is not None:
        if not rules.quotas:
            rules = replace(rules, quotas=quotas)
        elif rules.quotas != quotas:
            raise ValueError("build_world: `rules.quotas` and `quotas` differ; give the quotas once")
    loop = loop if loop is not None else EventLoop()
    cluster = SimCluster(catalog, nodes, loop=loop, pools=pools, stop_s=stop_s)
    admitted = quotas if quotas is not None else rules.quotas if rules is not None else None
    admission = None
    if classes is not None:
        admission = Admission(classes, admitted, cluster_gpu_milli=cluster.state.total_gpu_milli)
        cluster.admission.append(admission)
        admission.attach(cluster)
    if rules is None and (classes is not None or quotas is not None):
        rules = SchedulingRules(classes=classes if classes is not None else default_priority_classes(),
                                quotas=quotas if quotas is not None else Quotas())
    scheduler = Scheduler(cluster, catalog, profile, seed=seed, now=loop.now, pools=pools, rules=rules)
    return World(loop, cluster, scheduler, admission)
