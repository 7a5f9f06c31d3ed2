"""The platform week's fleet: its pools, their cards and the settings every part of the week reads.

Pools (node pools, `NodeSpec.pool`):

- `training`: A100-80GB and H100-80GB nodes of 8 NVLink cards, each half of the pool one network block;
- `inference`: A10 and T4 nodes of 8 cards, whose services the GPU scaler scales;
- `inference-stable` / `inference-tidal`: L40S nodes of 8 cards, whose services the tidal controller scales
  and of which the tidal subset is lent whole to training at night;
- `dev`: A30-24GB nodes of 4 cards with card memory oversold 1:2 (`PoolConfig.memory_oversell`).

Card names are the catalog's (`gpuplane.model.default_catalog()`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gpuplane.controllers import SUBSET_LABEL
from gpuplane.model import NodeSpec, PoolConfig, default_catalog
from gpuplane.scheduler.scheduler import NETWORK_BLOCK_LABEL
from gpuplane.sim.scenario import DAY_S, LoadModel, SaveModel, WorldSettings

TRAINING_POOL = "training"
INFERENCE_POOL = "inference"
STABLE_POOL = "inference-stable"
TIDAL_POOL = "inference-tidal"
DEV_POOL = "dev"
POOLS = (TRAINING_POOL, INFERENCE_POOL, STABLE_POOL, TIDAL_POOL, DEV_POOL)

CAPABILITIES = ("autoscale", "tidal", "backfill", "colocation", "vgpu", "recovery")
"""What the platform adds to vanilla Kubernetes, each a settings flag; an ablation arm switches one off."""


class PlatformSettings(WorldSettings):
    """Every parameter of the platform week. The defaults are the assumptions the figures rest on."""

    days: float = Field(default=7.0, gt=0, le=30, description="simulated days, warm-up included")
    warmup_hours: float = Field(default=6.0, ge=0, description="left out of the figures while the fleet fills")
    step_s: float = Field(default=60.0, gt=0, le=300, description="the controllers' pass and the SLO check")
    sample_s: float = Field(default=600.0, gt=0, description="utilisation and allocation samples")
    # -- the fleet
    a100_nodes: int = Field(default=200, ge=0, description="training nodes of 8 A100-80GB")
    h100_nodes: int = Field(default=200, ge=0, description="training nodes of 8 H100-80GB")
    a10_nodes: int = Field(default=150, ge=0, description="inference nodes of 8 A10")
    t4_nodes: int = Field(default=150, ge=0, description="inference nodes of 8 T4")
    l40s_nodes: int = Field(default=200, ge=2, description="inference nodes of 8 L40S (the tidal services)")
    stable_share: float = Field(default=0.25, gt=0, lt=1, description="share of L40S nodes never lent")
    tidal_overflow: bool = Field(default=True, description=(
        "a tidal service's replicas above its floor may use the stable subset's nodes too (a peak beyond the "
        "tidal nodes preempts the fillers there); off: the tidal subset's only, and such a peak waits. Without "
        "tidal lending both subsets are one pool to both workloads"))
    a30_nodes: int = Field(default=200, ge=0, description="dev nodes of 4 A30-24GB")
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    dev_gpus_per_node: int = Field(default=4, ge=1, le=16)
    dev_memory_oversell: float = Field(default=2.0, ge=1.0, le=16.0, description="the dev pool's vGPU memory")
    dev_mig_share: float = Field(default=0.25, ge=0, le=1, description=(
        "share of dev boxes that ask for a MIG instance (`dev_mig_profile`: hardware-isolated compute and memory, "
        "never oversold) instead of a vGPU fraction; the A30s enter MIG mode with their first instance and leave "
        "it with their last. Without vgpu every dev box takes a whole card, as the device plugin gives"))
    dev_mig_profile: str = Field(default="2g.12gb", description="the A30 MIG profile a MIG dev box asks for")
    # -- inference
    services_per_pool: int = Field(default=8, ge=1, description="services on A10, on T4 and on L40S each")
    peak_fill: float = Field(default=0.6, gt=0, le=1.2, description="share of a pool's GPUs its mean peak needs")
    per_replica_capacity: float = Field(default=10.0, gt=0, description="requests/s one replica serves")
    replica_milli: int = Field(default=500, ge=100, le=1000, description="GPU share one A10/T4 replica asks for "
                               "(vanilla: rounded up to a whole card)")
    startup_s: float = Field(default=120.0, ge=0, description="a new replica serves after this long")
    peak_trough_ratio: float = Field(default=3.0, ge=1)
    peak_hour: float = Field(default=20.0, ge=0, lt=24)
    noise_cv: float = Field(default=0.05, ge=0, le=1)
    bursts_per_day: float = Field(default=0.5, ge=0, description="flash crowds per service per day")
    burst_factor: float = Field(default=1.6, ge=1)
    burst_minutes: float = Field(default=20.0, gt=0)
    target_util_pct: float = Field(default=70.0, gt=0, le=100, description="the GPU scaler's per-replica target")
    rise_reserve: bool = Field(default=False, description=(
        "the GPU scaler also holds replicas for the largest rise of demand any service showed within a "
        "replica's start (startup_s plus one step) over the last day (`RiseReserve`, shared by the services); "
        "off by default: on the tenth fleet's week it cut the median SLO minutes by a fifth for 1.3 points of "
        "utilisation and 6 points of the inference GPU-hour cut (docs/platform.md)"))
    gateway_demand: bool = Field(default=True, description=(
        "the scaled objects also read the gateway's request rate (`demand_query`), which does not saturate as a "
        "busy GPU does (off: the GPU metric alone)"))
    static_headroom: float = Field(default=0.1, ge=0, description="vanilla's static replicas: the peak plus this")
    # -- training
    teams: int = Field(default=4, ge=1, description="training teams, each a queue with a quota")
    job_nodes: tuple[int, ...] = Field(default=(1, 1, 2, 4), min_length=1, description="gang sizes, whole nodes")
    job_work_hours: tuple[float, float] = Field(default=(2.0, 16.0))
    training_backlog: int = Field(default=24, ge=1, description="training jobs kept pending, fleet-wide")
    checkpoint_every_s: float = Field(default=1800.0, ge=0)
    checkpoint_cost_s: float = Field(default=60.0, ge=0)
    training_busy: float = Field(default=0.9, ge=0, le=1, description="SM busy share of a training card")
    failure_rate_per_node_day: float = Field(default=0.004, ge=0, description="training-node faults (the "
                                             "training-faults scenario's fleet rate)")
    broken_refault_s: float = Field(default=1800.0, gt=0, description="a node left broken (not isolated) fails "
                                    "the next gang placed on it after this long on average")
    manual_recovery_s: float = Field(default=4800.0, ge=0, description="the same by hand: notice (1,200 s) and "
                                     "diagnosis (3,600 s), the training-faults baseline's")
    repair_s: float = Field(default=7200.0, ge=0, description="a faulty node is out this long")
    retry_preemptors_s: float = Field(default=300.0, gt=0, description="the scheduler's retry of parked pods "
                                      "that may preempt (kube-scheduler flushes its unschedulable pods every 5 min)")
    reclaim_grace_s: float = Field(default=120.0, ge=0)
    # -- dev, batch, near-line
    dev_boxes: int = Field(default=600, ge=0, description="dev boxes open at the daily peak")
    dev_memory_mib: int = Field(default=10_000, gt=0, description="card memory a dev box asks for")
    dev_busy: float = Field(default=0.15, ge=0, le=1, description="SM busy share of a dev box's card")
    batch_backlog: int = Field(default=40, ge=1, description="low-priority batch pods kept pending (backfill)")
    batch_hours: float = Field(default=1.0, gt=0, description="a batch pod's mean work")
    batch_busy: float = Field(default=0.8, ge=0, le=1)
    nearline_backlog: int = Field(default=40, ge=1, description="near-line pods kept pending (co-location)")
    nearline_milli: int = Field(default=300, ge=50, le=900, description="GPU share a near-line pod asks for")
    nearline_hours: float = Field(default=0.5, gt=0, description="a near-line task's mean work")
    nearline_l40s: Literal["none", "stable", "all"] = Field(default="stable", description=(
        "near-line work also co-locates on the L40S cards of the tidal services: none (A10/T4 only), the "
        "stable subset's (never lent, its replicas steady), or all (the tidal subset's too, from whose nodes "
        "the tidal controller evicts it when it lends them)"))
    nearline_worker: bool = Field(default=True, description=(
        "a near-line pod is a queue worker that takes the next task in place when one completes, as a message "
        "queue's consumer does (off: one pod a task, each completion frees its share and a new pod is scheduled)"))
    backlog_rounds: int = Field(default=50, ge=1, description="each step, the backlogs are refilled and scheduled "
                                "again while the scheduler places what was refilled, at most this many rounds "
                                "(1: one refill a step, so a backlog of N submits at most N a step)")
    online_request_ms: float = Field(default=20.0, gt=0, description="mean GPU time of one online request (the "
                                     "co-location scenario's), for the node guard's passes")
    # -- capabilities
    autoscale: bool = Field(default=True, description="the GPU scaler scales A10/T4 services (off: static peak)")
    tidal: bool = Field(default=True, description="the tidal controller lends L40S nodes at night")
    backfill: bool = Field(default=True, description="low-priority batch fills fragments")
    colocation: bool = Field(default=True, description="near-line pods share inference cards")
    vgpu: bool = Field(default=True, description="fractional cards and oversold dev memory (off: whole cards)")
    recovery: bool = Field(default=True, description="the RecoveryController with the classifier and the health "
                           "book (off: by hand)")
    binpack: bool = Field(default=True, description="gpuplane's binpack scoring (off: LeastAllocated spread)")
    ablation: bool = Field(default=True, description="also run the platform with each capability off in turn")
    price_per_gpu_h: dict[str, float] = Field(
        default_factory=lambda: {"H100-80GB": 4.0, "A100-80GB": 2.5, "L40S": 1.5, "A10": 0.8, "T4": 0.4,
                                 "A30-24GB": 1.0},
        description="list price per card-hour (an assumption), for costs")

    @model_validator(mode="after")
    def _consistent(self) -> PlatformSettings:
        if self.warmup_hours * 3600.0 >= self.days * DAY_S:
            raise ValueError(f"warmup_hours {self.warmup_hours} leaves nothing of {self.days} day(s) to measure")
        low, high = self.job_work_hours
        if not 0 < low <= high:
            raise ValueError(f"job_work_hours must be 0 < low <= high, got {self.job_work_hours}")
        if self.a100_nodes + self.h100_nodes < max(self.job_nodes):
            raise ValueError(f"job_nodes: a gang of {max(self.job_nodes)} nodes cannot fit the training pool")
        catalog = default_catalog()
        for model in self.price_per_gpu_h:
            catalog.get(model)
        a30 = catalog.get("A30-24GB")
        if a30.mig_profile(self.dev_mig_profile) is None:
            names = ", ".join(p.name for p in a30.mig_profiles.values())
            raise ValueError(f"dev_mig_profile: the A30 has no MIG profile {self.dev_mig_profile!r} (one of {names})")
        return self

    @property
    def stable_nodes(self) -> int:
        return max(1, round(self.l40s_nodes * self.stable_share))

    def load_model(self) -> LoadModel:
        return LoadModel(peak_trough_ratio=self.peak_trough_ratio, peak_hour=self.peak_hour, noise_cv=self.noise_cv,
                         bursts_per_day=self.bursts_per_day, burst_factor=self.burst_factor,
                         burst_minutes=self.burst_minutes)

    def save_model(self) -> SaveModel:
        return SaveModel(every_s=self.checkpoint_every_s, save_s=self.checkpoint_cost_s)

    def vanilla(self) -> PlatformSettings:
        """Vanilla Kubernetes on the same workload: every capability off, kube-scheduler's spread."""
        return self.model_copy(update={c: False for c in CAPABILITIES} | {"binpack": False})

    def without(self, capability: str) -> PlatformSettings:
        if capability not in CAPABILITIES:
            raise ValueError(f"no capability {capability!r} (one of {', '.join(CAPABILITIES)})")
        return self.model_copy(update={capability: False})


def build_fleet(s: PlatformSettings) -> list[NodeSpec]:
    """The nodes of every pool, as configured."""
    cpu, memory = 128_000, 1_048_576
    nodes: list[NodeSpec] = []

    def add(prefix: str, count: int, model: str, gpus: int, pool: str,
            labels: tuple[tuple[str, str], ...] = ()) -> None:
        nodes.extend(NodeSpec(f"{prefix}-{i:05d}", cpu, memory, model, gpus, pool=pool, labels=labels)
                     for i in range(count))

    add("a100", s.a100_nodes, "A100-80GB", s.gpus_per_node, TRAINING_POOL, ((NETWORK_BLOCK_LABEL, "a100"),))
    add("h100", s.h100_nodes, "H100-80GB", s.gpus_per_node, TRAINING_POOL, ((NETWORK_BLOCK_LABEL, "h100"),))
    add("a10", s.a10_nodes, "A10", s.gpus_per_node, INFERENCE_POOL)
    add("t4", s.t4_nodes, "T4", s.gpus_per_node, INFERENCE_POOL)
    add("l40s-stable", s.stable_nodes, "L40S", s.gpus_per_node, STABLE_POOL, ((SUBSET_LABEL, "stable"),))
    add("l40s-tidal", s.l40s_nodes - s.stable_nodes, "L40S", s.gpus_per_node, TIDAL_POOL,
        ((SUBSET_LABEL, "tidal"), (NETWORK_BLOCK_LABEL, "l40s")))
    add("a30", s.a30_nodes, "A30-24GB", s.dev_gpus_per_node, DEV_POOL)
    return nodes


def pool_configs(s: PlatformSettings) -> dict[str, PoolConfig]:
    """Oversold dev memory with vGPU on; every pool 1:1 without."""
    oversell = s.dev_memory_oversell if s.vgpu else 1.0
    return {pool: PoolConfig(memory_oversell=oversell if pool == DEV_POOL else 1.0) for pool in POOLS}
