"""The training-faults scenario: a large training job under a node failure model, with manual recovery
(the baseline) and with the platform's automatic recovery, and its ETTR.

Failure model (fault-tolerance reference §8): every node fails at its own rate (exponential inter-arrival);
a fraction of the fleet are "lemons" failing `lemon_factor` times as often, and a repaired lemon stays one
with probability `lemon_persist`. A failure has a category (the Llama 3 mix); it shows in the logs as a
line of a signature of that category, which the platform's classifier reads to find the node to blame and
the action. Hang-type failures (network, unknown NCCL) are detected later than crashes.

- **Baseline**: people notice, diagnose and hand the same node back after a reboot (lemons stay); a fixed
  checkpoint interval; synchronous checkpoints.
- **Platform**: pre-flight checks cull a share of the lemons before the job starts; the classifier blames
  a node in seconds; the node is quarantined (`NodeHealthBook`) and replaced from warm spares first; the
  job restarts from its last checkpoint; the interval comes from `CheckpointPlanner` (measured cost and
  the job's observed failure rate, Daly's formula); a repaired node rejoins the spares only if it is
  eligible for large jobs (not a lemon).

ETTR = productive training / wall clock, averaged over `replications` runs of `days` each.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.health import HealthEvent, HealthPolicy, NodeHealthBook
from gpuplane.controllers.recovery import (
    DAY_S,
    CheckpointPlanner,
    EttrAccount,
    Evidence,
    RecoveryTimes,
    SparePool,
    classify_incident,
    nodes_to_isolate,
    segment_outcome,
)
from gpuplane.model.failures import FailureAction, FailureClass, Signature, SignatureLibrary, load_signature_library
from gpuplane.sim.scenario_file import ScenarioError

Progress = Callable[[int, int], None]

CATEGORY_CLASSES: dict[str, tuple[FailureClass, ...]] = {
    "gpu": (FailureClass.GPU_HARDWARE, FailureClass.MEMORY),
    "software": (FailureClass.SOFTWARE,),
    "network": (FailureClass.NETWORK, FailureClass.INTERCONNECT),
    "host_maintenance": (FailureClass.INFRASTRUCTURE,),
    "host_hardware": (FailureClass.INFRASTRUCTURE, FailureClass.STORAGE),
    "unknown_nccl": (FailureClass.NETWORK,),
}
HANGS = frozenset({"network", "unknown_nccl"})


class TrainingFaultsScenarioError(ScenarioError):
    pass


class TrainingFaultsScenario(BaseModel):
    """Every parameter of the training-faults scenario; loadable from YAML."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    days: float = Field(default=30.0, gt=0, le=365)
    seed: int = Field(default=1, ge=0)
    replications: int = Field(default=20, ge=1, le=1000)
    nodes: int = Field(default=128, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    spare_fraction: float = Field(default=0.05, ge=0, le=1, description="warm spares per job node (OPT: 12 for 124)")
    baseline_rate_per_node_day: float = Field(default=0.02, gt=0, lt=1)
    platform_rate_per_node_day: float = Field(default=0.001, gt=0, lt=1)
    llama_rate_per_node_day: float = Field(default=0.0038, gt=0, lt=1, description="419 / (2,048 × 54)")
    llama_gpus: int = Field(default=16_384, ge=1)
    sweep_rates_per_node_day: tuple[float, ...] = (0.001, 0.002, 0.004, 0.01, 0.02)
    lemon_fraction: float = Field(default=0.03, ge=0, lt=1)
    lemon_factor: float = Field(default=15.0, ge=1)
    lemon_persist: float = Field(default=0.7, ge=0, le=1)
    preflight_catch: float = Field(default=0.7, ge=0, le=1, description="share of lemons pre-flight checks cull")
    repair_days: float = Field(default=2.0, ge=0)
    probation_days: float = Field(default=3.0, ge=0)
    mix_gpu: float = Field(default=0.64, ge=0)
    mix_software: float = Field(default=0.13, ge=0)
    mix_network: float = Field(default=0.08, ge=0)
    mix_host_maintenance: float = Field(default=0.08, ge=0)
    mix_host_hardware: float = Field(default=0.05, ge=0)
    mix_unknown_nccl: float = Field(default=0.02, ge=0)
    # baseline: manual recovery
    baseline_detection_crash_s: float = Field(default=1200.0, ge=0)
    baseline_detection_hang_s: float = Field(default=3600.0, ge=0)
    baseline_diagnosis_s: float = Field(default=3600.0, ge=0)
    baseline_reschedule_s: float = Field(default=7200.0, ge=0, description="a replacement or the same node back")
    baseline_restart_s: float = Field(default=120.0, ge=0)
    baseline_checkpoint_load_s: float = Field(default=300.0, ge=0)
    baseline_checkpoint_cost_s: float = Field(default=300.0, ge=0)
    baseline_checkpoint_interval_s: float = Field(default=10_800.0, gt=0)
    # platform: automatic recovery
    detection_crash_s: float = Field(default=10.0, ge=0)
    detection_hang_s: float = Field(default=60.0, ge=0, description="heartbeat / zero-traffic watchdog")
    diagnosis_s: float = Field(default=5.0, ge=0)
    reschedule_spare_s: float = Field(default=30.0, ge=0)
    reschedule_cold_s: float = Field(default=600.0, ge=0)
    restart_s: float = Field(default=30.0, ge=0)
    checkpoint_load_s: float = Field(default=15.0, ge=0, description="in-memory / peer checkpoint")
    checkpoint_cost_s: float = Field(default=2.0, gt=0, description="blocking part of an async checkpoint")
    checkpoint_cost_cv: float = Field(default=0.2, ge=0)
    interval_formula: str = Field(default="daly", pattern="^(young|daly)$")
    manual_probability: float = Field(default=0.005, ge=0, le=1)
    manual_s: float = Field(default=3600.0, ge=0)
    goal_baseline_ettr_pct: float = Field(default=60.0, ge=0, le=100, description="the report's starting point (near)")
    goal_platform_ettr_pct: float = Field(default=99.5, ge=0, le=100)
    goal_llama_ettr_pct: float = Field(default=97.0, ge=0, le=100)

    @model_validator(mode="after")
    def _mix(self) -> TrainingFaultsScenario:
        if sum(self.mix().values()) <= 0:
            raise ValueError("mix_gpu, mix_software, mix_network, mix_host_maintenance, mix_host_hardware, "
                             "mix_unknown_nccl: the failure category mix must not be all zero")
        if not self.sweep_rates_per_node_day or not all(0 < r < 1 for r in self.sweep_rates_per_node_day):
            raise ValueError("sweep_rates_per_node_day: give rates above 0 and below 1")
        return self

    def mix(self) -> dict[str, float]:
        return {"gpu": self.mix_gpu, "software": self.mix_software, "network": self.mix_network,
                "host_maintenance": self.mix_host_maintenance, "host_hardware": self.mix_host_hardware,
                "unknown_nccl": self.mix_unknown_nccl}

    def baseline_times(self) -> RecoveryTimes:
        return RecoveryTimes(self.baseline_detection_crash_s, self.baseline_detection_hang_s,
                             self.baseline_diagnosis_s, self.baseline_reschedule_s, self.baseline_reschedule_s,
                             self.baseline_restart_s, self.baseline_checkpoint_load_s, 0.0, 0.0)

    def platform_times(self) -> RecoveryTimes:
        return RecoveryTimes(self.detection_crash_s, self.detection_hang_s, self.diagnosis_s,
                             self.reschedule_spare_s, self.reschedule_cold_s, self.restart_s,
                             self.checkpoint_load_s, self.manual_probability, self.manual_s)


@dataclass(slots=True)
class _Fleet:
    """Nodes and their failure rates (per node-day); new nodes are lemons with the lemon fraction."""

    s: TrainingFaultsScenario
    base_rate: float
    rng: np.random.Generator
    rate: dict[str, float] = field(default_factory=dict)
    lemon: dict[str, bool] = field(default_factory=dict)

    def new_node(self) -> str:
        name = f"node-{len(self.rate):05d}"
        lemon = bool(self.rng.random() < self.s.lemon_fraction)
        self.lemon[name] = lemon
        self.rate[name] = self.base_rate * (self.s.lemon_factor if lemon else 1.0)
        return name

    def repaired(self, name: str) -> None:
        if self.lemon[name] and self.rng.random() >= self.s.lemon_persist:
            self.lemon[name] = False
            self.rate[name] = self.base_rate


def lemon_adjusted_rate(s: TrainingFaultsScenario, mean_rate: float) -> float:
    """The good nodes' rate such that the fleet's mean rate (lemons included) is `mean_rate`."""
    return mean_rate / (1.0 - s.lemon_fraction + s.lemon_fraction * s.lemon_factor)


@dataclass(slots=True)
class _Signatures:
    by_category: dict[str, list[Signature]]

    @classmethod
    def from_library(cls, library: SignatureLibrary) -> _Signatures:
        by_category: dict[str, list[Signature]] = {}
        for category, classes in CATEGORY_CLASSES.items():
            # a failure in the middle of a long run is not a deterministic user error
            chosen = [sig for sig in library if sig.failure_class in classes
                      and sig.action is not FailureAction.DO_NOT_RETRY and sig.action is not FailureAction.LOG_ONLY
                      and sig.pattern is not None and sig.examples]
            if not chosen:
                raise TrainingFaultsScenarioError(f"the signature library has no usable signature of class "
                                                  f"{', '.join(c.value for c in classes)}")
            by_category[category] = chosen
        return cls(by_category)


def run_job(s: TrainingFaultsScenario, *, platform: bool, mean_rate: float, nodes: int, seed: int,
            library: SignatureLibrary) -> EttrAccount:
    """One job of `nodes` nodes for `s.days`; the account of where its time went."""
    rng = np.random.default_rng(seed)
    fleet = _Fleet(s, lemon_adjusted_rate(s, mean_rate), rng)
    horizon = s.days * DAY_S
    mix = s.mix()
    categories = list(mix)
    weights = np.array([mix[c] for c in categories]) / sum(mix.values())
    signatures = _Signatures.from_library(library)
    classifier = FailureClassifier(library)
    times = s.platform_times() if platform else s.baseline_times()
    book = NodeHealthBook(HealthPolicy(probation_s=s.probation_days * DAY_S))
    job_gpus = nodes * s.gpus_per_node
    t = 0.0

    def fresh(count: int) -> list[str]:
        out: list[str] = []
        while len(out) < count:
            name = fleet.new_node()
            if platform and fleet.lemon[name] and rng.random() < s.preflight_catch:
                continue  # culled by the pre-flight checks
            book.register(name, t)
            out.append(name)
        return out

    job = fresh(nodes)
    spares = SparePool(fresh(math.ceil(s.spare_fraction * nodes)) if platform else [])
    returning: list[tuple[float, str]] = []  # (time back from repair, node)
    planner = CheckpointPlanner(nodes, mean_rate, formula=s.interval_formula)
    account = EttrAccount()
    while t < horizon:
        for back, node in [r for r in returning if r[0] <= t]:
            # repaired, then a probation on small jobs; it rejoins this job's spares only if eligible
            returning.remove((back, node))
            fleet.repaired(node)
            book.apply(node, HealthEvent.REPAIR_DONE, back - s.probation_days * DAY_S, "repaired")
            book.apply(node, HealthEvent.PROBATION_PASSED, back, "probation on small jobs passed")
            if book.eligible(node, job_gpus, back):
                spares.give(node)
        rates = np.array([fleet.rate[n] for n in job])
        dt = rng.exponential(DAY_S / rates.sum())
        if platform:
            interval = planner.interval_s(s.checkpoint_cost_s)
            cost = s.checkpoint_cost_s * float(rng.lognormal(0.0, s.checkpoint_cost_cv)) if s.checkpoint_cost_cv \
                else s.checkpoint_cost_s
            planner.measured_cost(cost)
        else:
            interval, cost = s.baseline_checkpoint_interval_s, s.baseline_checkpoint_cost_s
        failed = t + dt < horizon
        segment = segment_outcome(min(dt, horizon - t), interval, cost, failed=failed)
        account.productive_s += segment.productive_s
        account.checkpoint_s += segment.checkpoint_s
        account.lost_s += segment.lost_s
        planner.observed(nodes * min(dt, horizon - t) / DAY_S, 1 if failed else 0)
        t += dt
        if not failed:
            break
        account.failures += 1
        node = job[int(rng.choice(len(job), p=rates / rates.sum()))]
        category = categories[int(rng.choice(len(categories), p=weights))]
        pool = signatures.by_category[category]
        signature = pool[int(rng.integers(len(pool)))]
        verdict = classify_incident(classifier, [Evidence(node, line=signature.examples[0])], t)
        downtime = (times.detection_hang_s if category in HANGS else times.detection_crash_s) + times.diagnosis_s
        account.detection_s += times.detection_hang_s if category in HANGS else times.detection_crash_s
        account.diagnosis_s += times.diagnosis_s
        reschedule = 0.0
        isolate = nodes_to_isolate(verdict) if platform else ()
        if isolate:
            blamed = isolate[0]
            book.apply(blamed, HealthEvent.CRITICAL_FAILURE, t, signature.id)
            book.apply(blamed, HealthEvent.REPAIR_STARTED, t, "sent to repair")
            replacement = spares.take()
            reschedule = times.reschedule_spare_s if replacement is not None else times.reschedule_cold_s
            job[job.index(blamed)] = replacement if replacement is not None else fresh(1)[0]
            returning.append((t + (s.repair_days + s.probation_days) * DAY_S, blamed))
            account.isolated_nodes += 1
        elif not platform:
            reschedule = times.reschedule_cold_s
        account.reschedule_s += reschedule
        account.restart_s += times.restart_s
        account.checkpoint_load_s += times.checkpoint_load_s
        manual = times.manual_s if rng.random() < times.manual_probability else 0.0
        account.manual_s += manual
        t += downtime + reschedule + times.restart_s + times.checkpoint_load_s + manual
    return account


@dataclass(slots=True)
class CaseResult:
    label: str
    platform: bool
    rate_per_node_day: float
    nodes: int
    account: EttrAccount
    ettr_runs: list[float]

    @property
    def ettr_pct(self) -> float:
        return float(np.mean(self.ettr_runs)) * 100.0


@dataclass(slots=True)
class TrainingFaultsComparison:
    scenario: TrainingFaultsScenario
    cases: dict[str, CaseResult]
    sweep: dict[str, list[tuple[float, float]]]
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        s = self.scenario
        out: dict[str, Any] = {"scenario": "training-faults", "days": s.days, "replications": s.replications,
                               "seed": s.seed, "job_gpus": s.nodes * s.gpus_per_node}
        for key, case in self.cases.items():
            out[f"{key}_rate_per_node_day"] = case.rate_per_node_day
            out[f"{key}_gpus"] = case.nodes * s.gpus_per_node
            out[f"{key}_ettr_pct"] = round(case.ettr_pct, 3)
            out[f"{key}_ettr_min_pct"] = round(min(case.ettr_runs) * 100.0, 3)
            out[f"{key}_failures_per_run"] = round(case.account.failures / s.replications, 2)
            out[f"{key}_isolated_nodes_per_run"] = round(case.account.isolated_nodes / s.replications, 2)
            for part, pct in case.account.shares_pct().items():
                out[f"{key}_{part}_pct"] = round(pct, 3)
        for kind, points in self.sweep.items():
            for rate, ettr in points:
                out[f"sweep_{kind}_{rate:g}_ettr_pct".replace(".", "_")] = round(ettr, 3)
        out |= {
            "goal_baseline_near_60_met": abs(out["baseline_ettr_pct"] - s.goal_baseline_ettr_pct) <= 5.0,
            "goal_platform_met": out["platform_ettr_pct"] >= s.goal_platform_ettr_pct,
            "goal_llama_met": out["llama_ettr_pct"] >= s.goal_llama_ettr_pct,
        }
        out["goals_met"] = bool(out["goal_baseline_near_60_met"] and out["goal_platform_met"]
                                and out["goal_llama_met"])
        out["wall_s"] = round(self.wall_s, 2)
        return out


def _case(s: TrainingFaultsScenario, label: str, *, platform: bool, rate: float, nodes: int,
          library: SignatureLibrary, tick: Callable[[], None]) -> CaseResult:
    total = EttrAccount()
    runs = []
    for r in range(s.replications):
        account = run_job(s, platform=platform, mean_rate=rate, nodes=nodes, seed=s.seed * 100_003 + r,
                          library=library)
        total.add(account)
        runs.append(account.ettr)
        tick()
    return CaseResult(label, platform, rate, nodes, total, runs)


def run_training_faults(s: TrainingFaultsScenario, progress: Progress | None = None,
                        library: SignatureLibrary | None = None) -> TrainingFaultsComparison:
    started = time.perf_counter()
    library = library or load_signature_library()
    total = s.replications * (3 + 2 * len(s.sweep_rates_per_node_day))
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    llama_nodes = math.ceil(s.llama_gpus / s.gpus_per_node)
    cases = {
        "baseline": _case(s, "baseline (manual, no culling)", platform=False, rate=s.baseline_rate_per_node_day,
                          nodes=s.nodes, library=library, tick=tick),
        "platform": _case(s, "platform", platform=True, rate=s.platform_rate_per_node_day, nodes=s.nodes,
                          library=library, tick=tick),
        "llama": _case(s, "platform, Llama 3 rate", platform=True, rate=s.llama_rate_per_node_day,
                       nodes=llama_nodes, library=library, tick=tick),
    }
    sweep: dict[str, list[tuple[float, float]]] = {"baseline": [], "platform": []}
    for rate in s.sweep_rates_per_node_day:
        for kind in ("baseline", "platform"):
            case = _case(s, kind, platform=kind == "platform", rate=rate, nodes=s.nodes, library=library, tick=tick)
            sweep[kind].append((rate, case.ettr_pct))
    return TrainingFaultsComparison(s, cases, sweep, time.perf_counter() - started)
