"""The training-faults scenario: one large training job under node failures, recovered by people (the
baseline) or by gpuplane's `RecoveryController` (the platform), at the SAME failure rate.

The world is the kit's: `EventLoop` + `SimCluster` + the production `Scheduler` (`build_world`). The job is
a gang of `nodes` pods of 8 GPUs; the cluster holds `spare_nodes` more. Its work is the kit's
`CheckpointingJob` (a save blocks `save_s`; a crash loses everything since the last completed save) and
every GPU-second is booked once in a `WorkLedger`.

Failure model (fault-tolerance reference §8), the same for both arms and drawn from the same seed: every
node fails at its own exponential rate while the job trains on it; a share of the fleet are lemons failing
`lemon_factor` times as often (the fleet's mean is `failure_rate_per_node_day`); a repaired lemon stays one
with probability `lemon_persist`. A failure's category follows the Llama 3 mix. GPU, network, host
hardware and host maintenance failures leave the node broken: an attempt placed on it fails at start-up
until the node is repaired. Software failures and NCCL timeouts of unknown cause are transient.

- **Baseline (people).** The failure ends the process (a hang only at the NCCL timeout); someone notices
  (`baseline_notice_s`), reads the logs (`baseline_diagnosis_s`), reboots or swaps the node
  (`baseline_reschedule_s`, which repairs it; a lemon stays a lemon) and resubmits the gang. It saves at
  Young's interval for its save cost and the fleet's rate: its best fixed setting.
- **Platform (gpuplane).** The controller sees the failed pods (`detect_s`), gathers every node's logs and
  classifies them (`diagnosis_s`), isolates what the verdict blames (quarantine, taint), attributes
  blamed-but-not-isolated failures in the health book, holds a hang's suspect out until its stop-time check
  (`stop_check_s`, finding a broken node with `stop_check_catch`), and resubmits the gang; the production
  scheduler places it on healthy nodes (free spares included). The save interval comes from the
  controller's planner (measured save cost, observed failure rate). Nodes join after a pre-flight check that
  catches a share of the lemons (`preflight_catch`); quarantined nodes go through repair and probation and
  come back only if the book does not find them lemons. Replacement nodes (`replace_s`) are ordered as soon
  as the untainted pool is below the job plus `spare_nodes` (the baseline's people order one only when the
  job cannot start). An attempt that fails twice on the same broken node, and a do-not-retry verdict, go to
  a person (`manual_s`).

The classifier reads realistic streams (`gpuplane.sim.fault_streams`): noise, near misses, tolerated
events, cascades, clock skew, silent nodes. Its accuracy is measured on `accuracy_incidents` incidents
drawn from the same failure mix, besides the ones the run meets.

ETTR = productive training / wall clock over `days`. The first-order closed form
(`first_order_ettr`, reference §2) fed with each arm's measured rate, interval and downtime per failure is
reported next to the simulation as a cross-check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from gpuplane.controllers.classifier import CAUSE_WINDOW_S, FailureClassifier
from gpuplane.controllers.health import HealthPolicy, NodeHealth, NodeHealthBook
from gpuplane.controllers.recovery import (
    DAY_S,
    QUARANTINE_TAINT,
    CheckpointPlanner,
    GangJob,
    RecoveryController,
    classify_incident,
    first_order_ettr,
    hang_suspects,
    nodes_to_isolate,
    young_interval,
)
from gpuplane.model import NodeSpec, PodRequest, QoS, WholeCards, default_catalog
from gpuplane.model.failures import SignatureLibrary, load_signature_library
from gpuplane.port import ClusterEvent, EventKind
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.sim.fault_streams import CATEGORIES, HANGS, PERSISTENT, StreamMaker, StreamModel, decision_correct
from gpuplane.sim.scenario import (
    CheckpointingJob,
    Figures,
    Goal,
    Headline,
    Progress,
    SaveModel,
    Table,
    WorkLedger,
    World,
    WorldSettings,
    build_world,
    figure,
)

GPUS_PER_NODE = 8
_NODE = ("H100-80GB", 128_000, 1_024_000)
_LIBRARY: list[SignatureLibrary] = []


def bundled_library() -> SignatureLibrary:
    if not _LIBRARY:
        _LIBRARY.append(load_signature_library())
    return _LIBRARY[0]


class TrainingFaultsSettings(WorldSettings):
    """Every assumption of the scenario; both arms share all but the recovery fields of their own."""

    days: float = Field(default=60.0, gt=0, le=365)
    nodes: int = Field(default=64, ge=2, le=1024, description="the job's nodes (8 GPUs each)")
    spare_nodes: int = Field(default=4, ge=0, description="nodes in the cluster beyond the job's")
    failure_rate_per_node_day: float = Field(default=0.004, gt=0, lt=1,
                                             description="the fleet's mean, both arms (reference §8.5: Llama 3)")
    lemon_fraction: float = Field(default=0.03, ge=0, lt=1)
    lemon_factor: float = Field(default=15.0, ge=1)
    lemon_persist: float = Field(default=0.7, ge=0, le=1)
    mix_gpu: float = Field(default=0.64, ge=0)
    mix_software: float = Field(default=0.13, ge=0)
    mix_network: float = Field(default=0.08, ge=0)
    mix_host_maintenance: float = Field(default=0.08, ge=0)
    mix_host_hardware: float = Field(default=0.05, ge=0)
    mix_unknown_nccl: float = Field(default=0.02, ge=0)
    save_s: float = Field(default=10.0, gt=0, description="blocking part of one save (the job's; both arms)")
    save_cost_cv: float = Field(default=0.2, ge=0, description="spread of the measured save cost")
    restart_s: float = Field(default=120.0, ge=0, description="container start, NCCL init, model build")
    load_s: float = Field(default=300.0, ge=0, description="checkpoint load (the job's; both arms)")
    hang_timeout_s: float = Field(default=600.0, ge=0, description="NCCL watchdog: when a hang ends the process")
    repair_days: float = Field(default=2.0, ge=0)
    probation_days: float = Field(default=3.0, ge=0)
    # the incident streams the classifier reads
    noise_lines: int = Field(default=400, ge=0)
    near_miss_share: float = Field(default=0.05, ge=0, le=1)
    tolerated_lines: int = Field(default=3, ge=0)
    clock_skew_s: float = Field(default=1.0, ge=0)
    silent_share: float = Field(default=0.1, ge=0, le=1)
    silent_hang_share: float = Field(default=0.5, ge=0, le=1)
    app_error_lead_s: float = Field(default=2.0, ge=0)
    accuracy_incidents: int = Field(default=200, ge=1)
    stream_nodes: int = Field(default=16, ge=2, description="nodes whose logs an accuracy incident holds")
    # baseline: people
    baseline_notice_s: float = Field(default=1200.0, ge=0)
    baseline_diagnosis_s: float = Field(default=3600.0, ge=0)
    baseline_reschedule_s: float = Field(default=7200.0, ge=0, description="reboot or swap the node")
    # platform: gpuplane
    detect_s: float = Field(default=10.0, ge=0, description="failed pods to the controller")
    diagnosis_s: float = Field(default=30.0, ge=0, description="gather every node's logs and classify")
    preflight_catch: float = Field(default=0.3, ge=0, le=1, description="share of lemons a pre-flight check catches")
    replace_s: float = Field(default=7200.0, ge=0, description="a replacement node when the pool runs short")
    manual_s: float = Field(default=14_400.0, ge=0, description="a person's escalation")
    stop_check_s: float = Field(default=600.0, ge=0, description="a hang suspect's stop-time check (tier 3)")
    stop_check_catch: float = Field(default=0.9, ge=0, le=1, description="share of broken nodes it finds")
    interval_formula: str = Field(default="daly", pattern="^(young|daly)$")

    @model_validator(mode="after")
    def _mix(self) -> TrainingFaultsSettings:
        if sum(self.mix().values()) <= 0:
            raise ValueError("mix_*: the failure category mix must not be all zero")
        return self

    def mix(self) -> dict[str, float]:
        return {c: float(getattr(self, f"mix_{c}")) for c in CATEGORIES}

    def streams(self) -> StreamModel:
        return StreamModel(noise_lines=self.noise_lines, near_miss_share=self.near_miss_share,
                           tolerated_lines=self.tolerated_lines, clock_skew_s=self.clock_skew_s,
                           silent_share=self.silent_share, silent_hang_share=self.silent_hang_share,
                           app_error_lead_s=self.app_error_lead_s, hang_timeout_s=self.hang_timeout_s)

    def good_rate(self) -> float:
        """A good node's rate, so that the fleet's mean (lemons included) is `failure_rate_per_node_day`."""
        f, k = self.lemon_fraction, self.lemon_factor
        return self.failure_rate_per_node_day / (1.0 - f + f * k)


class TrainingFaultsFigures(Figures):
    baseline_ettr_pct: float = figure("baseline", "productive training / wall clock", "%")
    platform_ettr_pct: float = figure("platform", "productive training / wall clock", "%")
    baseline_failures: int = figure("baseline", "failures the job met (start-up failures included)")
    platform_failures: int = figure("platform", "failures the job met (start-up failures included)")
    baseline_rate_per_node_day: float = figure(
        "baseline", "failures per node-day the job trained (the fleet's rate as the job meets it)")
    platform_rate_per_node_day: float = figure(
        "platform", "failures per node-day the job trained, after culling and quarantine")
    rate_cut_pct: float = figure("platform", "how much culling and quarantine cut the rate the job meets, "
                                             "against the baseline's", "%")
    baseline_lost_pct: float = figure("baseline", "work lost to rollbacks", "% of wall")
    platform_lost_pct: float = figure("platform", "work lost to rollbacks", "% of wall")
    baseline_down_pct: float = figure("baseline", "failure to training again (detection .. checkpoint load)",
                                      "% of wall")
    platform_down_pct: float = figure("platform", "failure to training again (detection .. checkpoint load)",
                                      "% of wall")
    baseline_save_pct: float = figure("baseline", "blocking saves", "% of wall")
    platform_save_pct: float = figure("platform", "blocking saves", "% of wall")
    baseline_downtime_s: float = figure("baseline", "mean time from a failure to training again", "s")
    platform_downtime_s: float = figure("platform", "mean time from a failure to training again", "s")
    baseline_interval_s: float = figure("baseline", "save interval (Young, fleet rate)", "s")
    platform_interval_s: float = figure("platform", "last save interval the planner gave", "s")
    baseline_closed_form_ettr_pct: float = figure(
        "baseline", "first-order closed form fed with this run's rate, interval and downtime", "%")
    platform_closed_form_ettr_pct: float = figure(
        "platform", "first-order closed form fed with this run's rate, interval and downtime", "%")
    platform_isolated: int = figure("platform", "nodes isolated by verdicts and the exclusion policy")
    platform_culled: int = figure("platform", "nodes a pre-flight check turned away")
    platform_escalations: int = figure("platform", "failures that went to a person")
    platform_run_decisions_correct_pct: float = figure(
        "platform", "the run's verdicts that took out exactly the broken node (or none when none was)", "%")
    classification_accuracy_pct: float = figure(
        "platform", "incidents (same mix, realistic streams) decided right: exactly the failing node out when "
                    "it is at fault, no node otherwise", "%")
    culprit_isolated_pct: float = figure("platform", "node faults whose node the verdict took out", "%")
    healthy_isolated_per_incident: float = figure("platform", "healthy nodes taken out per incident")
    cause_on_failing_node_pct: float = figure("platform", "incidents whose verdict's cause is on the failing node",
                                              "%")


# ------------------------------------------------------------------------------------------------ the fleet


@dataclass(slots=True)
class _Fleet:
    """Each node's truth: its failure rate (lemon or not) and whether it is broken now."""

    s: TrainingFaultsSettings
    rng: np.random.Generator
    lemon: dict[str, bool] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    """node -> the category of the fault it carries until repaired"""

    def new(self, name: str) -> str:
        self.lemon[name] = bool(self.rng.random() < self.s.lemon_fraction)
        return name

    def rate(self, node: str) -> float:
        return self.s.good_rate() * (self.s.lemon_factor if self.lemon[node] else 1.0)

    def repaired(self, node: str) -> None:
        self.broken.pop(node, None)
        if self.lemon[node] and self.rng.random() >= self.s.lemon_persist:
            self.lemon[node] = False


def _spec(name: str) -> NodeSpec:
    model, cpu, memory = _NODE
    return NodeSpec(name, cpu, memory, model, GPUS_PER_NODE)


@dataclass(slots=True)
class ArmResult:
    ettr_pct: float
    failures: int
    rate_per_node_day: float
    lost_pct: float
    down_pct: float
    save_pct: float
    interval_s: float
    closed_form_pct: float
    downtime_s: float = 0.0
    isolated: int = 0
    culled: int = 0
    escalations: int = 0
    decisions: int = 0
    correct: int = 0
    train_failures: int = 0


class _Arm:
    """One arm's world: the cluster, the scheduler, the job, and (platform) the recovery controller."""

    def __init__(self, s: TrainingFaultsSettings, *, platform: bool, library: SignatureLibrary,
                 streams: StreamMaker) -> None:
        self.s = s
        self.platform = platform
        self.horizon = s.days * DAY_S
        self.fleet = _Fleet(s, np.random.default_rng([s.seed, 1]))
        self.rng = np.random.default_rng([s.seed, 2])
        self.streams = streams
        names = [self.fleet.new(f"node-{i:04d}") for i in range(s.nodes + s.spare_nodes)]
        catalog = default_catalog()
        profile = default_registry().build(PolicyConfig(node_policy="binpack", seed=s.seed))
        self.world: World = build_world(catalog, [_spec(n) for n in names], profile, seed=s.seed,
                                        stop_s=s.kubelet_stop_s)
        self.loop = self.world.loop
        self.cluster = self.world.cluster
        mix = s.mix()
        self.categories = list(mix)
        self.weights = np.array([mix[c] for c in self.categories]) / sum(mix.values())
        self.template = PodRequest("train", cpu_milli=64_000, memory_mib=512_000, gpu=WholeCards(GPUS_PER_NODE),
                                   qos=QoS.OFFLINE)
        gpus = s.nodes * GPUS_PER_NODE
        self.work = CheckpointingJob("train", self.horizon * 2.0, float(gpus), SaveModel(every_s=1.0))
        self.ledger = WorkLedger()
        self.planner = CheckpointPlanner(s.nodes, s.failure_rate_per_node_day, formula=s.interval_formula)
        self.interval = (young_interval(s.save_s, DAY_S / (s.nodes * s.failure_rate_per_node_day)) if not platform
                         else self.planner.interval_s(s.save_s))
        self.job = GangJob("train", self.template, s.nodes, self.planner)
        self.book = NodeHealthBook(HealthPolicy(probation_s=s.probation_days * DAY_S), names, 0.0)
        self.controller: RecoveryController | None = None
        if platform:
            self.controller = RecoveryController(self.cluster, FailureClassifier(library), self.book, self.loop.now)
        self.result = ArmResult(0.0, 0, 0.0, 0.0, 0.0, 0.0, self.interval, 0.0)
        self.attempt_live = False
        self.trained_node_s = 0.0
        self.train_started: float | None = None
        self.down_since: float | None = None
        self.down_s = 0.0
        self.startup_s = 0.0
        """the first start's share of `down_s` (no failure caused it)"""
        self.repeats: dict[str, int] = {}
        self.pending_run = False
        self.timers: list[Any] = []
        self.cluster.watch(self._on_event)
        self._node_seq = len(names)
        self._ordered = 0
        self.placed: list[str] = []
        self.bound: dict[str, str] = {}
        """the current attempt's members bound so far, and their nodes"""

    # ---------------------------------------------------------------------------------------- plumbing

    def _on_event(self, event: ClusterEvent) -> None:
        if event.kind in (EventKind.POD_ADDED, EventKind.POD_DELETED, EventKind.NODE_UPDATED, EventKind.NODE_ADDED):
            if not self.pending_run:
                self.pending_run = True
                self.loop.call_later(0.0, self._schedule)
        elif event.kind is EventKind.POD_BOUND and not self.attempt_live and event.pod is not None:
            if event.pod.assignment is None or not event.pod.name.startswith(f"train.{self.job.attempt}."):
                return
            self.bound[event.pod.name] = event.pod.assignment.node
            if len(self.bound) == self.job.nodes:
                self.attempt_live = True
                placed = [self.bound[m] for m in self.job.members()]
                self.loop.call_later(0.0, lambda: self._bound(placed))

    def _schedule(self) -> None:
        self.pending_run = False
        self.world.scheduler.run_pending()

    def _later(self, delay: float, callback: Any) -> None:
        self.timers.append(self.loop.call_later(delay, callback))

    def _cancel(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()

    # ---------------------------------------------------------------------------------------- the job

    def submit(self) -> None:
        if self.platform:
            for node in list(self.fleet.lemon):
                self._preflight(node)
        self.down_since = 0.0
        self._create_attempt()

    def _create_attempt(self) -> None:
        self.attempt_live = False
        self.bound = {}
        if self.controller is not None:
            if self.job.name in self.controller.jobs:
                self.controller.resubmit(self.job)
            else:
                self.controller.submit(self.job)
        else:
            for member in self.job.members():
                self.cluster.create_pod(replace(self.template, name=member, gang=f"train.{self.job.attempt}",
                                                gang_size=self.job.nodes))
        self._top_up()

    def _stop_attempt(self) -> None:
        if self.controller is not None:
            self.controller.stop(self.job)
        else:
            for member in self.job.members():
                self.cluster.evict(member, grace_s=0.0, reason="failed")
            self.job.attempt += 1

    def _bound(self, placed: Sequence[str]) -> None:
        broken = [n for n in placed if n in self.fleet.broken]
        if broken:  # the attempt dies at start-up on a node that is still broken
            node = broken[0]
            self._later(self.s.restart_s, lambda: self._failed(node, self.fleet.broken[node], repeat=True))
            return
        self.placed = list(placed)
        self._later(self.s.restart_s + self.s.load_s, self._train)

    def _train(self) -> None:
        now = self.loop.now()
        if self.down_since is not None:
            self.down_s += now - self.down_since
            if self.work.starts == 0:
                self.startup_s = now - self.down_since
            self.down_since = None
        self.work.save = SaveModel(every_s=self.interval, save_s=self.s.save_s, on_signal=False)
        self.work.start(now)
        self.train_started = now
        if self.controller is not None:
            self.job.last_checkpoint_at = now
            self._later(self.interval + self.s.save_s, self._saved)
        rates = np.array([self.fleet.rate(n) for n in self.placed])
        dt = float(self.rng.exponential(DAY_S / rates.sum()))
        node = self.placed[int(self.rng.choice(len(self.placed), p=rates / rates.sum()))]
        category = self.categories[int(self.rng.choice(len(self.categories), p=self.weights))]
        if now + dt < self.horizon:
            self._later(dt, lambda: self._failed(node, category, repeat=False))

    def _saved(self) -> None:
        assert self.controller is not None
        cost = self.s.save_s * float(self.rng.lognormal(0.0, self.s.save_cost_cv)) if self.s.save_cost_cv else \
            self.s.save_s
        self.interval = self.controller.checkpointed(self.job.name, cost)
        self._later(self.work.save.every_s + self.s.save_s, self._saved)

    def _failed(self, node: str, category: str, *, repeat: bool) -> None:
        now = self.loop.now()
        self._cancel()
        self.result.failures += 1
        if self.train_started is not None:
            self.result.train_failures += 1
            self.trained_node_s += (now - self.train_started) * self.s.nodes
            self.train_started = None
            self.ledger.stopped(self.work, self.work.crash(now), "failure")
            self.down_since = now
        if category in PERSISTENT:
            self.fleet.broken[node] = category
        exit_at = self.s.hang_timeout_s if category in HANGS else 0.0
        if not self.platform:
            self._later(exit_at + self.s.baseline_notice_s + self.s.baseline_diagnosis_s, self._stop_attempt)
            self._later(exit_at + self.s.baseline_notice_s + self.s.baseline_diagnosis_s
                        + self.s.baseline_reschedule_s, lambda: self._by_hand(node))
            return
        self.repeats[node] = self.repeats.get(node, 0) + 1 if repeat else 1
        self._later(exit_at + self.s.detect_s + self.s.diagnosis_s, lambda: self._decide(node, category, now))

    def _by_hand(self, node: str) -> None:
        self.fleet.repaired(node)
        self._create_attempt()

    def _decide(self, node: str, category: str, failed_at: float) -> None:
        controller = self.controller
        assert controller is not None
        if self.repeats.get(node, 0) > 2:  # the same node broke two restarts: a person takes over
            self.result.escalations += 1
            controller.stop(self.job)
            self._later(self.s.manual_s, lambda: self._person(node))
            return
        incident = self.streams.incident(self.rng, category, node)
        members = self.job.members()
        on = {p.name: p.assignment.node for p in self.cluster.list_pods() if p.assignment is not None}
        nodes = [on[m] for m in members if m in on] or [node]
        evidence = self.streams.stream(self.rng, incident, nodes, failed_at)
        outcome = controller.on_failure(self.job.name, evidence)
        self.result.decisions += 1
        # a suspect counts as taken out when it is the broken node (its stop-time check then finds it)
        held = tuple(n for n in outcome.suspects if n in self.fleet.broken)
        self.result.correct += decision_correct(incident, (*outcome.isolated, *held))
        for isolated in outcome.isolated:
            self._repair(isolated)
        for suspect in outcome.suspects:
            self._later_free(self.s.stop_check_s, lambda n=suspect: self._checked(n))
        if not outcome.resubmitted:
            self.result.escalations += 1
            self._later(self.s.manual_s, lambda: self._create_attempt())
        else:
            self.attempt_live = False
            self.bound = {}
            self._top_up()

    def _later_free(self, delay: float, callback: Any) -> None:
        """A timer that a new failure of the job does not cancel."""
        self.loop.call_later(delay, callback)

    def _checked(self, node: str) -> None:
        assert self.controller is not None
        failed = node in self.fleet.broken and self.rng.random() < self.s.stop_check_catch
        result = self.controller.check_done(node, passed=not failed)
        if result.state is NodeHealth.QUARANTINED:
            self._repair(node)

    def _person(self, node: str) -> None:
        assert self.controller is not None
        self.controller.isolate(node, "a person: the node broke two restarts")
        self.result.isolated += 1
        self._repair_cycle(node)
        self._create_attempt()

    def _repair(self, node: str) -> None:
        self.result.isolated += 1
        self._repair_cycle(node)

    def _repair_cycle(self, node: str) -> None:
        controller = self.controller
        assert controller is not None
        controller.repair_started(node)

        def done() -> None:
            self.fleet.repaired(node)
            controller.repair_done(node)
            self.loop.call_later(self.s.probation_days * DAY_S, lambda: self._probation_over(node))

        self.loop.call_later(self.s.repair_days * DAY_S, done)

    def _probation_over(self, node: str) -> None:
        assert self.controller is not None
        self.controller.probation_passed(node)

    def _preflight(self, node: str) -> bool:
        """A node joins only if its pre-flight check passes; a caught lemon goes to repair."""
        if self.fleet.lemon.get(node) and self.rng.random() < self.s.preflight_catch:
            assert self.controller is not None
            self.controller.isolate(node, "pre-flight check failed")
            self.result.culled += 1
            self._repair_cycle(node)
            return False
        return True

    def _top_up(self) -> None:
        """Ask for replacement nodes: the baseline's people when the pool is smaller than the job, the
        platform as soon as its warm spares run below `spare_nodes`."""
        usable = sum(1 for n in self.cluster.list_nodes() if QUARANTINE_TAINT not in n.spec.taints)
        want = self.s.nodes + (self.s.spare_nodes if self.platform else 0)
        for _ in range(max(0, want - usable - self._ordered)):
            self._ordered += 1
            self.loop.call_later(self.s.replace_s, self._arrive)

    def _arrive(self) -> None:
        self._ordered -= 1
        name = self.fleet.new(f"node-{self._node_seq:04d}")
        self._node_seq += 1
        self.book.register(name, self.loop.now())
        self.cluster.add_node(_spec(name))
        if self.platform:
            self._preflight(name)
            self._top_up()

    # ---------------------------------------------------------------------------------------- the run

    def run(self) -> ArmResult:
        self.submit()
        self.loop.run(until=self.horizon)
        now = self.horizon
        if self.train_started is not None:
            self.trained_node_s += (now - self.train_started) * self.s.nodes
            tail = max(0.0, self.work.done_s(now) - self.work.booked_s)
        else:
            tail = 0.0
            if self.down_since is not None:
                self.down_s += now - self.down_since
        gpus = self.work.gpus
        productive = self.ledger.useful_gpu_s / gpus + tail
        lost = self.ledger.lost_gpu_s.get("failure", 0.0) / gpus
        r = self.result
        r.ettr_pct = 100.0 * productive / self.horizon
        r.lost_pct = 100.0 * lost / self.horizon
        r.down_pct = 100.0 * self.down_s / self.horizon
        r.save_pct = max(0.0, 100.0 - r.ettr_pct - r.lost_pct - r.down_pct)
        node_days = self.trained_node_s / DAY_S
        r.rate_per_node_day = r.train_failures / node_days if node_days > 0 else 0.0
        r.interval_s = self.interval
        r.downtime_s = (self.down_s - self.startup_s) / max(r.failures, 1)
        # the closed form charges each failure (start-up ones too) the run's mean downtime
        all_rate = r.failures / node_days if node_days > 0 else 0.0
        r.closed_form_pct = 100.0 * first_order_ettr(self.s.save_s, self.interval, r.downtime_s,
                                                     all_rate * self.s.nodes)
        return r


# --------------------------------------------------------------------------------------- classification


@dataclass(frozen=True, slots=True)
class Accuracy:
    correct_pct: float
    culprit_pct: float
    healthy_per_incident: float
    cause_on_node_pct: float


def measure_accuracy(s: TrainingFaultsSettings, library: SignatureLibrary, streams: StreamMaker,
                     cause_window_s: float = CAUSE_WINDOW_S) -> Accuracy:
    """The controller's decisions (`classify_incident`, `nodes_to_isolate`, `hang_suspects` and the suspect's
    stop-time check) on `accuracy_incidents` incidents of the failure mix, each on `stream_nodes` nodes; the
    health book's exclusion policy, which needs a history, is left out."""
    rng = np.random.default_rng([s.seed, 3])
    mix = s.mix()
    categories = list(mix)
    weights = np.array([mix[c] for c in categories]) / sum(mix.values())
    nodes = [f"node-{i:04d}" for i in range(s.stream_nodes)]
    classifier = FailureClassifier(library, cause_window_s=cause_window_s)
    correct = culprit = faults = healthy = on_node = 0
    for k in range(s.accuracy_incidents):
        category = categories[int(rng.choice(len(categories), p=weights))]
        incident = streams.incident(rng, category, nodes[int(rng.integers(len(nodes)))])
        t0 = 1_000_000.0 + k * 86_400.0
        verdict = classify_incident(classifier, streams.stream(rng, incident, nodes, t0), t0)
        isolated = nodes_to_isolate(verdict)
        # a hang's suspect stays out only if its stop-time check finds the fault
        isolated += tuple(n for n in hang_suspects(verdict) if incident.persistent and n == incident.node
                          and rng.random() < s.stop_check_catch)
        correct += decision_correct(incident, isolated)
        healthy += sum(1 for n in isolated if n != incident.node or not incident.persistent)
        on_node += verdict.cause is not None and verdict.cause.node == incident.node
        if incident.persistent:
            faults += 1
            culprit += incident.node in isolated
    n = s.accuracy_incidents
    return Accuracy(100.0 * correct / n, 100.0 * culprit / max(faults, 1), healthy / n, 100.0 * on_node / n)


# ------------------------------------------------------------------------------------------- the scenario


class TrainingFaultsScenario:
    name = "training-faults"
    title = "Training faults: ETTR at equal failure rates, people against gpuplane's recovery controller"
    settings = TrainingFaultsSettings
    figures = TrainingFaultsFigures
    ours = "platform"
    arms: tuple[str, ...] = ("baseline", "platform")
    goals: tuple[Goal, ...] = (Goal("platform ETTR at equal rates", "platform_ettr_pct", ">=", 99.5),)
    headlines: tuple[Headline, ...] = (
        Headline("platform_ettr_pct", "the fleet fails 0.4 % of nodes a day (Llama 3), the same for both arms",
                 "failure_rate_per_node_day", 0.02, "down"),
        Headline("platform_ettr_pct", "a save blocks the job 10 s (the job's checkpointing, both arms)",
                 "save_s", 300.0, "down"),
        Headline("baseline_ettr_pct", "people take 2 h to reboot or swap a node", "baseline_reschedule_s",
                 28_800.0, "down"),
        Headline("classification_accuracy_pct", "9 in 10 crashed nodes ship their own logs", "silent_share", 0.5,
                 "down"),
        Headline("classification_accuracy_pct", "node clocks agree within about 1 s (the cause window is 2 min)",
                 "clock_skew_s", 300.0, "down"),
        Headline("platform_rate_per_node_day", "the fleet fails 0.4 % of nodes a day: culling and quarantine "
                 "cut what the job meets, they do not set it", "failure_rate_per_node_day", 0.02, "up"),
    )
    quick: Mapping[str, object] = {"days": 30.0, "nodes": 16, "spare_nodes": 2, "accuracy_incidents": 60,
                                   "failure_rate_per_node_day": 0.01}

    def run(self, settings: TrainingFaultsSettings, progress: Progress) -> TrainingFaultsFigures:
        progress("arms", 0, 3)
        library = bundled_library()
        streams = StreamMaker(library, settings.streams())
        base = _Arm(settings, platform=False, library=library, streams=streams).run()
        progress("arms", 1, 3)
        plat = _Arm(settings, platform=True, library=library, streams=streams).run()
        progress("arms", 2, 3)
        acc = measure_accuracy(settings, library, streams)
        progress("arms", 3, 3)
        cut = 100.0 * (1.0 - plat.rate_per_node_day / base.rate_per_node_day) if base.rate_per_node_day > 0 else 0.0
        return TrainingFaultsFigures(
            baseline_ettr_pct=base.ettr_pct, platform_ettr_pct=plat.ettr_pct,
            baseline_failures=base.failures, platform_failures=plat.failures,
            baseline_rate_per_node_day=base.rate_per_node_day, platform_rate_per_node_day=plat.rate_per_node_day,
            rate_cut_pct=cut, baseline_lost_pct=base.lost_pct, platform_lost_pct=plat.lost_pct,
            baseline_down_pct=base.down_pct, platform_down_pct=plat.down_pct,
            baseline_save_pct=base.save_pct, platform_save_pct=plat.save_pct,
            baseline_downtime_s=base.downtime_s, platform_downtime_s=plat.downtime_s,
            baseline_interval_s=base.interval_s, platform_interval_s=plat.interval_s,
            baseline_closed_form_ettr_pct=base.closed_form_pct, platform_closed_form_ettr_pct=plat.closed_form_pct,
            platform_isolated=plat.isolated, platform_culled=plat.culled, platform_escalations=plat.escalations,
            platform_run_decisions_correct_pct=100.0 * plat.correct / plat.decisions if plat.decisions else 100.0,
            classification_accuracy_pct=acc.correct_pct, culprit_isolated_pct=acc.culprit_pct,
            healthy_isolated_per_incident=acc.healthy_per_incident, cause_on_failing_node_pct=acc.cause_on_node_pct)

    def tables(self, figures: TrainingFaultsFigures) -> Sequence[Table]:
        f = figures
        rows = (("ETTR (%)", f"{f.baseline_ettr_pct:.2f}", f"{f.platform_ettr_pct:.2f}"),
                ("closed form (%)", f"{f.baseline_closed_form_ettr_pct:.2f}", f"{f.platform_closed_form_ettr_pct:.2f}"),
                ("failures", str(f.baseline_failures), str(f.platform_failures)),
                ("failures per trained node-day", f"{f.baseline_rate_per_node_day:.4f}",
                 f"{f.platform_rate_per_node_day:.4f}"),
                ("lost work (% of wall)", f"{f.baseline_lost_pct:.2f}", f"{f.platform_lost_pct:.2f}"),
                ("down: failure to training (% of wall)", f"{f.baseline_down_pct:.2f}", f"{f.platform_down_pct:.2f}"),
                ("blocking saves (% of wall)", f"{f.baseline_save_pct:.2f}", f"{f.platform_save_pct:.2f}"),
                ("save interval (s)", f"{f.baseline_interval_s:.0f}", f"{f.platform_interval_s:.0f}"))
        decisions = (("decided right (accuracy incidents)", f"{f.classification_accuracy_pct:.1f} %"),
                     ("decided right (this run's failures)", f"{f.platform_run_decisions_correct_pct:.1f} %"),
                     ("node faults whose node was taken out", f"{f.culprit_isolated_pct:.1f} %"),
                     ("healthy nodes taken out per incident", f"{f.healthy_isolated_per_incident:.3f}"),
                     ("cause found on the failing node", f"{f.cause_on_failing_node_pct:.1f} %"),
                     ("nodes isolated / culled / escalations",
                      f"{f.platform_isolated} / {f.platform_culled} / {f.platform_escalations}"))
        return (Table("ETTR at equal failure rates", ("baseline", "platform"), rows),
                Table("The classifier on realistic streams", ("platform",), decisions))

    def summary(self, figures: TrainingFaultsFigures) -> str:
        f = figures
        return (f"ETTR at equal rates: baseline {f.baseline_ettr_pct:.2f} %, platform {f.platform_ettr_pct:.2f} % "
                f"(closed form {f.platform_closed_form_ettr_pct:.2f} %); rate met cut {f.rate_cut_pct:.0f} % by "
                f"culling and quarantine; classifier decides right {f.classification_accuracy_pct:.1f} %")


SCENARIO = TrainingFaultsScenario()
