"""The platform week's work: the inference services and their load, and the requests every kind of pod makes.

Inference: `services_per_pool` services on each of A10, T4 and L40S. Each service's load is the kit's
(`sample_load`: the diurnal shape, lognormal noise, Poisson flash crowds), in requests/s; a replica serves
`per_replica_capacity` once it has been up `startup_s`. An A10/T4 replica needs `replica_milli` of a card
(a small model: with vGPU it asks for that share, vanilla's device plugin rounds it up to a whole card); an
L40S replica needs a whole card. Peak replicas are sized so that the mean daily peak needs `peak_fill` of
the pool's cards at whole cards (what vanilla holds).

Every GPU request of the week goes through `gpu_form`: with vGPU off (vanilla, `no-vgpu`) a fraction is
rounded up to whole cards, as the NVIDIA device plugin would.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gpuplane.model import MILLI_PER_CARD, Fraction, GpuForm, WholeCards, default_catalog
from gpuplane.sim.platform.fleet import INFERENCE_POOL, STABLE_POOL, TIDAL_POOL, PlatformSettings
from gpuplane.sim.scenario import DAY_S, LoadCurve, sample_load

SCALED = "scaled"
"""Services the GPU scaler scales (A10, T4)."""
TIDAL = "tidal"
"""Services the tidal controller scales (L40S, stable and tidal subsets)."""


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    kind: str
    model: str
    need_milli: int
    """the compute one replica needs"""
    peak_replicas: int
    curve: LoadCurve

    def load(self, t: float) -> float:
        return self.curve.at(t)

    def static_replicas(self, capacity: float, headroom: float) -> int:
        """Static provisioning for the run's peak (the best a static operator can do, knowing the peak)."""
        return max(1, math.ceil(float(self.curve.value.max()) * (1.0 + headroom) / capacity - 1e-9))


@functools.cache
def _card_memory_mib(model: str) -> int:
    return default_catalog().get(model).memory_mib


def gpu_form(s: PlatformSettings, model: str, milli: int, memory_share: float | None = None) -> GpuForm:
    """The request a pod makes for `milli` of one `model` card: a fraction with vGPU, else whole cards."""
    if milli >= MILLI_PER_CARD or not s.vgpu:
        return WholeCards(max(1, math.ceil(milli / MILLI_PER_CARD)))
    memory = _card_memory_mib(model)
    share = milli / MILLI_PER_CARD if memory_share is None else memory_share
    return Fraction(compute_milli=milli, memory_mib=int(memory * share))


def build_services(s: PlatformSettings, rng: np.random.Generator) -> list[Service]:
    model = s.load_model()
    day = np.arange(0.0, DAY_S, 60.0)
    peak_over_mean = float(model.shape(day).max() / model.shape(day).mean())
    groups = (("a10", SCALED, "A10", s.a10_nodes, s.replica_milli), ("t4", SCALED, "T4", s.t4_nodes, s.replica_milli),
              ("l40s", TIDAL, "L40S", s.l40s_nodes, MILLI_PER_CARD))
    services: list[Service] = []
    for prefix, kind, card, nodes, need in groups:
        cards = nodes * s.gpus_per_node
        weights = rng.dirichlet(np.ones(s.services_per_pool) * 2.0)
        for i, weight in enumerate(weights):
            peak = max(1, int(weight * s.peak_fill * cards))
            mean_rate = peak * s.per_replica_capacity / peak_over_mean
            curve = sample_load(model, days=s.days, mean=mean_rate, rng=rng)
            services.append(Service(f"{prefix}-svc-{i:02d}", kind, card, need, peak, curve))
    return services


def service_pools(service: Service, *, lending: bool = True, overflow: bool = True) -> Mapping[str, frozenset[str]]:
    """Workload name → the pools its replicas may use.

    With `lending`, a tidal service's floor stays on the stable subset (never lent); the replicas above it may
    use either subset with `overflow`, so a peak beyond the tidal nodes takes the stable nodes' spare cards
    (preempting the fillers there) instead of waiting, or the tidal subset's only without. Lending takes only
    tidal nodes without online pods either way. Without lending nothing tells the subsets apart: both
    workloads may use every node of either, as one Deployment over the L40S nodes would."""
    if service.kind == TIDAL:
        both = frozenset({TIDAL_POOL, STABLE_POOL})
        if not lending:
            return {f"{service.name}-stable": both, f"{service.name}-tidal": both}
        return {f"{service.name}-stable": frozenset({STABLE_POOL}),
                f"{service.name}-tidal": both if overflow else frozenset({TIDAL_POOL})}
    return {service.name: frozenset({INFERENCE_POOL})}
