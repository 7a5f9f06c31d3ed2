"""The co-location guard: online inference and offline batch work share a card; online always wins.

Each pass (`tick`) reads every card once and, per card, takes the online-first policy's decisions from
`gpuplane.controllers.colocation.CardPolicy` (`SliceArbiter`, `MemoryGuard`, `pick_eviction`, the
transition table), then acts on the offline containers' processes:

- online demand (an online container's process above the SM threshold): SIGSTOP every offline process;
- online idle for the minimum slice: SIGCONT them;
- free memory under the safety line, or an offline container above its quota: evict it (SIGTERM and
  SIGCONT, then SIGKILL after the grace period if it is still alive, or at once if online demand appears
  during the grace: a continued process must not compete with online work);
- an offline container that starts while the guard runs and whose footprint (its quota) would break the
  safety line: held (SIGSTOP) until it fits, evicted if it has not fitted within the admission timeout;
- an online container above its quota is logged and counted, never signalled.

Fail safe: a failed card reading changes nothing; unknown and vanished processes are skipped. Each
offline container's state is persisted (JSON, replaced atomically on every change) so that a restarted
guard neither leaves processes stopped for ever nor forgets a pending kill. Times are the guard's clock
(`time.monotonic` in real use: comparable across guard restarts until the node reboots).
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from gpuplane.controllers.colocation import (
    GUARD_REACTION,
    CardPolicy,
    GuardSettings,
    OfflineAction,
    OfflineEvent,
    OfflineState,
    OfflineView,
    offline_transition,
)
from gpuplane.model import GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model
from gpuplane.node.gpu import CardReading, GpuBackend, GpuBackendError
from gpuplane.node.processes import ProcessState, SignalResult, container_pids, read_stat, signal_process

log = logging.getLogger(__name__)
_DEFAULTS = GuardSettings()
_STOPPED = (OfflineState.SUSPENDED, OfflineState.HELD)
"""States in which the guard keeps an offline container's processes stopped."""


class GuardConfigError(GpuplaneError):
    """A guard configuration that cannot be valid; the message names the file and the field."""


class GuardOptions(BaseModel):
    """How the guard polls and acts, plus the online-first policy's suspension and eviction thresholds
    (the `GuardSettings` fields of the same names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    poll_s: float = Field(default=GUARD_REACTION.poll_s, gt=0, allow_inf_nan=False)
    kill_grace_s: float = Field(default=GUARD_REACTION.kill_grace_s, ge=0, allow_inf_nan=False)
    """SIGKILL follows SIGTERM after this long if the container is still alive."""
    online_sm_threshold_pct: float = Field(default=GUARD_REACTION.online_sm_threshold_pct, ge=0, le=100)
    """An online process above this SM utilisation is online demand."""
    state_file: Path | None = None
    min_slice_s: float = Field(default=GUARD_REACTION.min_slice_s, ge=0, allow_inf_nan=False)
    """Offline resumes after online has been idle this long beyond the idle reading itself (0: at the
    first pass that reads online idle; docs/colocation.md measures the trade, and why it is not 250 ms)."""
    memory_guard: bool = _DEFAULTS.memory_guard
    safety_margin_bytes: int = Field(default=_DEFAULTS.safety_margin_bytes, ge=0)
    growth_factor: float = Field(default=_DEFAULTS.growth_factor, ge=0, allow_inf_nan=False)
    min_growth_bytes: int = Field(default=_DEFAULTS.min_growth_bytes, ge=0)
    reaction_horizon_s: float = Field(default=_DEFAULTS.reaction_horizon_s, ge=0, allow_inf_nan=False)
    growth_window_s: float = Field(default=_DEFAULTS.growth_window_s, ge=0, allow_inf_nan=False)
    admission: bool = _DEFAULTS.admission
    """Hold an offline container that starts while its footprint would break the safety line."""
    admit_hysteresis_bytes: int = Field(default=_DEFAULTS.admit_hysteresis_bytes, ge=0)
    admit_window_s: float = Field(default=_DEFAULTS.admit_window_s, ge=0, allow_inf_nan=False)
    admit_timeout_s: float = Field(default=_DEFAULTS.admit_timeout_s, ge=0, allow_inf_nan=False)

    def settings(self) -> GuardSettings:
        """The policy's settings: these options' values, `GuardSettings`' defaults for the rest."""
        shared = {f.name for f in fields(GuardSettings)} & set(type(self).model_fields)
        return GuardSettings(**{name: getattr(self, name) for name in shared})


class ContainerSpec(BaseModel):
    """A container on one card; its processes are an explicit PID list or a cgroup v2 directory."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    card: int = Field(ge=0)
    qos: Literal["online", "offline"]
    memory_quota_bytes: PositiveInt | None = None
    pids: tuple[PositiveInt, ...] = ()
    cgroup: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ContainerSpec:
        if bool(self.pids) == (self.cgroup is not None):
            raise ValueError(f"container {self.name!r}: give either pids or cgroup")
        return self


class GuardConfig(BaseModel):
    """The guard's options and its containers; none at all is a guard that takes them from the node's pods
    (`gpuplane.node.pod_containers`, through `ColocationGuard.update_containers`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    guard: GuardOptions = GuardOptions()
    containers: tuple[ContainerSpec, ...] = ()

    @model_validator(mode="after")
    def _distinct(self) -> GuardConfig:
        names = [c.name for c in self.containers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"container names must be unique: {', '.join(twice)}")
        pids = [p for c in self.containers for p in c.pids]
        shared = sorted({p for p in pids if pids.count(p) > 1})
        if shared:
            raise ValueError(f"a PID belongs to one container only: {', '.join(map(str, shared))}")
        return self


class _GuardFile(GuardConfig):
    """A configuration file: `containers` may be left out (they come from the node's pods then), but an empty
    list is refused as a mistake (the default is not validated, an explicit list is)."""

    containers: tuple[ContainerSpec, ...] = Field(default=(), min_length=1)


def load_guard_config(path: str | Path) -> GuardConfig:
    """Read a guard configuration (YAML); raises `GuardConfigError("FILE: field: message")`. `containers` may be
    left out (they come from the node's pods then), but an empty list is refused."""
    config = load_yaml_model(path, _GuardFile, GuardConfigError)
    return GuardConfig(guard=config.guard, containers=config.containers)


class GuardActionKind(enum.Enum):
    SUSPEND = "suspend"
    RESUME = "resume"
    EVICT = "evict"
    KILL = "kill"
    FORGET = "forget"
    HOLD = "hold"
    """A starting offline container stopped: it does not fit under the safety line yet."""
    ADMIT = "admit"
    """A held container fits now; it stays stopped until online has been idle for the minimum slice."""
    QUOTA_WARNING = "quota-warning"
    """An online container above its quota: logged and counted only."""


@dataclass(frozen=True, slots=True)
class GuardAction:
    at: float
    kind: GuardActionKind
    container: str
    card: int
    pids: tuple[int, ...]
    reason: str


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"gpuplane_guard_{name}", doc, labels, registry=registry)

        self.suspensions = counter("suspensions", "Offline containers suspended (SIGSTOP).", ("card", "container"))
        self.resumptions = counter("resumptions", "Offline containers resumed (SIGCONT).", ("card", "container"))
        self.evictions = counter("evictions", "Offline containers evicted (SIGTERM).",
                                 ("card", "container", "reason"))
        self.holds = counter("holds", "Starting offline containers held (SIGSTOP) until they fit under the "
                             "safety line.", ("card", "container"))
        self.kills = counter("kills", "Evicted containers killed (SIGKILL) after the grace period.")
        self.backend_errors = counter("backend_errors", "Card readings that failed; no action was taken.")
        self.unknown_pids = counter("unknown_pids", "Processes seen on a card that belong to no container.")
        self.quota_violations = counter("quota_violations", "Containers seen above their memory quota.",
                                        ("container", "qos"))
        self.suspended = Gauge("gpuplane_guard_offline_suspended", "1 while the offline container is suspended.",
                               ("card", "container"), registry=registry)
        self.threshold = Gauge("gpuplane_guard_memory_threshold_bytes",
                               "Free memory under which offline work is evicted.", ("card",), registry=registry)
        self.reaction = Histogram("gpuplane_guard_reaction_seconds",
                                  "From the reading that showed online demand to the SIGSTOP done.",
                                  registry=registry,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))


@dataclass(slots=True)
class _Offline:
    """What the guard knows of one offline container; all but `pids` and `killed` is persisted."""

    spec: ContainerSpec
    state: OfflineState
    since: float
    """When it entered `state` (an eviction's grace counts from here)."""
    first_seen: float
    starts: dict[int, int] = field(default_factory=dict)
    """PID -> start time (clock ticks since boot): a PID whose start time differs is another process."""
    pids: tuple[int, ...] = ()
    """Its live processes at the last pass."""
    killed: bool = False
    starting: bool = False
    """Appeared while the guard runs and not read on its card yet: admission applies at that reading."""


@dataclass(slots=True)
class _Usage:
    """One container's processes on its card in one reading."""

    used_bytes: int = 0
    unknown_bytes: bool = False


class _RecordedPid(BaseModel):
    pid: PositiveInt
    start_ticks: int


class _Record(BaseModel):
    card: int
    state: OfflineState
    since: float
    first_seen: float
    pids: list[_RecordedPid]


class _StateFile(BaseModel):
    version: Literal[1]
    containers: dict[str, _Record]


class ColocationGuard:
    """Guards the cards of one node. `tick(now)` is one pass; `run` ticks every poll period;
    `update_containers` replaces the containers while it runs (from the node's pods, say), `update_settings`
    its thresholds (from the node's ColocationPolicy).

    `clock` times reactions (and, in `run`, the passes); `actions` lists every action taken."""

    def __init__(self, config: GuardConfig, backend: GpuBackend, *, clock: Callable[[], float] = time.monotonic,
                 registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.backend = backend
        self.clock = clock
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = _Metrics(self.registry)
        self.actions: list[GuardAction] = []
        options = config.guard
        settings = options.settings()
        cards = sorted({c.card for c in config.containers})
        self._policies = {card: CardPolicy(settings) for card in cards}
        self._online = [c for c in config.containers if c.qos == "online"]
        self._offline: dict[str, _Offline] = {}
        self._unknown: dict[int, set[int]] = {card: set() for card in cards}
        self._over_quota: set[str] = set()
        self._dirty = False
        self._started = False
        self._state_corrupt = False
        self._records = self._load_state()
        """Recorded containers not yet taken over: restored when `update_containers` brings them."""
        self._pending: GuardConfig | None = None
        self._pending_options: GuardOptions | None = None
        self._pending_lock = threading.Lock()
        for spec in config.containers:
            if spec.qos == "offline":
                self._offline[spec.name] = self._restore(spec, self._records.pop(spec.name, None))

    # -- the pass ---------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """One pass at time `now`: read every card, decide, act. Never raises for a failed reading or a
        vanished process."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
            options, self._pending_options = self._pending_options, None
        if options is not None:
            self._retune(options)
        if pending is not None:
            self._reconfigure(now, pending.model_copy(update={"guard": self.config.guard}))
        if not self._started:
            self._started = True
            if self._state_corrupt:
                self._continue_stopped(now, list(self._offline.values()))
        try:
            readings = {r.index: r for r in self.backend.cards()}
        except GpuBackendError as exc:
            self._backend_error(str(exc))
            self._save()
            return
        # PID -> card -> container: the containers of a pod on several cards share its processes.
        owners: dict[int, dict[int, ContainerSpec]] = {}
        for spec in self._online:
            for pid in container_pids(spec.pids, spec.cgroup):
                owners.setdefault(pid, {})[spec.card] = spec
        for tracked in self._offline.values():
            if tracked.state is OfflineState.GONE:
                if tracked.spec.cgroup is None:
                    continue
                self._refresh(tracked)
                if not tracked.pids:
                    continue
                self._revive(tracked, now)
            else:
                self._refresh(tracked)
            for pid in tracked.pids:
                owners.setdefault(pid, {})[tracked.spec.card] = tracked.spec
        for card in self._policies:
            reading = readings.get(card)
            if reading is None:
                self._backend_error(f"the reading has no card {card}")
                continue
            self._card(now, reading, owners)
        self._save()

    def update_containers(self, containers: Sequence[ContainerSpec]) -> None:
        """Guard these containers from the next pass on (callable from any thread). A new offline container
        starts running (or as the state file recorded it); one no longer listed is let go, and if it was
        suspended its processes are continued first, so that a pod being deleted can handle its SIGTERM.
        Raises `ValueError` for containers a configuration could not hold (a name twice, a PID twice)."""
        config = GuardConfig(guard=self.config.guard, containers=tuple(containers))
        with self._pending_lock:
            self._pending = config

    def update_settings(self, options: GuardOptions) -> None:
        """Use these options from the next pass on (callable from any thread); the state file stays the guard's
        own. Only thresholds change, never the containers' states: a suspended container stays stopped until
        online has been idle for the new minimum slice (counted from when it went idle), an eviction under
        way keeps its SIGTERM time, and the online memory growth seen so far still counts."""
        with self._pending_lock:
            self._pending_options = options

    def run(self, stop: threading.Event, *, sleep: Callable[[float], object] | None = None) -> None:
        """Tick every poll period until `stop` is set; `sleep` defaults to waiting on `stop`."""
        pause = stop.wait if sleep is None else sleep
        while not stop.is_set():
            started = self.clock()
            self.tick(started)
            pause(max(0.0, self.config.guard.poll_s - (self.clock() - started)))

    def stop(self, now: float) -> None:
        """Stop guarding. Without a state file no successor could resume the suspended containers, so they
        are resumed now; with one, the next guard takes them over."""
        if self.config.guard.state_file is not None:
            return
        for tracked in self._offline.values():
            self._release(tracked, now, "the guard is stopping")

    def _release(self, tracked: _Offline, now: float, reason: str) -> None:
        """Continue a suspended or held container (through the transition table)."""
        if tracked.state is OfflineState.HELD:
            self._apply(tracked, OfflineEvent.ADMITTED, now, reason)
        if tracked.state is OfflineState.SUSPENDED:
            self._apply(tracked, OfflineEvent.ONLINE_IDLE, now, reason)

    def start_metrics_server(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve this guard's metrics over HTTP (port 0: any free port, see `server.server_port`)."""
        return start_http_server(port, addr, registry=self.registry)

    # -- one card ---------------------------------------------------------------------------------------

    def _card(self, now: float, reading: CardReading, owners: dict[int, dict[int, ContainerSpec]]) -> None:
        card = reading.index
        options = self.config.guard
        offline = [t for t in self._offline.values() if t.spec.card == card and t.state is not OfflineState.GONE]
        usage: dict[str, _Usage] = {}
        online_active = False
        online_bytes = 0
        unknown: set[int] = set()
        for process in reading.processes:
            by_card = owners.get(process.pid)
            if by_card is None:
                unknown.add(process.pid)
                continue
            spec = by_card.get(card)
            if spec is None:
                continue
            use = usage.setdefault(spec.name, _Usage())
            use.used_bytes += process.used_bytes or 0
            use.unknown_bytes |= process.used_bytes is None
            if spec.qos == "online":
                online_bytes += process.used_bytes or 0
                online_active |= (process.sm_util_pct or 0.0) > options.online_sm_threshold_pct
        self._count_unknown(card, unknown)
        for spec in self._online:
            if spec.card == card:
                self._check_online_quota(now, spec, usage.get(spec.name, _Usage()).used_bytes)

        policy = self._policies[card]
        views = [OfflineView(t.spec.name, t.state, t.since, t.first_seen, bool(t.pids),
                             usage.get(t.spec.name, _Usage()).used_bytes,
                             not usage.get(t.spec.name, _Usage()).unknown_bytes, t.spec.memory_quota_bytes,
                             t.starting) for t in offline]
        for tracked in offline:
            tracked.starting = False
            if tracked.pids and tracked.state is OfflineState.EVICTING:
                self._kill_when_due(tracked, now)
        decision = policy.decide(now, online_active, online_bytes, reading.free_bytes, views)
        self.metrics.threshold.labels(card=str(card)).set(decision.threshold)
        for step in decision.steps:
            self._apply(self._offline[step.name], step.event, now, step.reason)

        event = decision.gate
        if event is OfflineEvent.ONLINE_DEMAND:
            for tracked in offline:
                if tracked.state is OfflineState.EVICTING:
                    self._kill(tracked, now, "online demand during the eviction grace: online wins")
        if event is not None:
            reason = ("online demand" if event is OfflineEvent.ONLINE_DEMAND
                      else f"online idle for at least {options.min_slice_s:g} s")
            for tracked in offline:
                self._apply(tracked, event, now, reason)

    def _apply(self, tracked: _Offline, event: OfflineEvent, now: float, reason: str) -> None:
        state, action = offline_transition(tracked.state, event)
        if action is None:
            return
        tracked.state, tracked.since = state, now
        self._dirty = True
        spec = tracked.spec
        labels = {"card": str(spec.card), "container": spec.name}
        self.metrics.suspended.labels(**labels).set(1 if state in _STOPPED else 0)
        if action is OfflineAction.ADMIT:
            self._record(now, GuardActionKind.ADMIT, spec, tracked.pids, reason)
        elif state is OfflineState.SUSPENDED:
            self._signal(tracked, signal.SIGSTOP)
            self.metrics.reaction.observe(max(0.0, self.clock() - now))
            self.metrics.suspensions.labels(**labels).inc()
            self._record(now, GuardActionKind.SUSPEND, spec, tracked.pids, reason)
        elif state is OfflineState.RUNNING:
            holder = self._suspended_sibling(tracked)
            if holder is None:
                self._signal(tracked, signal.SIGCONT)
            else:
                reason += f" (its processes stay stopped: suspended for card {holder.spec.card} too)"
            self.metrics.resumptions.labels(**labels).inc()
            self._record(now, GuardActionKind.RESUME, spec, tracked.pids, reason)
        elif state is OfflineState.HELD:
            self._signal(tracked, signal.SIGSTOP)
            self.metrics.holds.labels(**labels).inc()
            self._record(now, GuardActionKind.HOLD, spec, tracked.pids, reason)
        elif state is OfflineState.EVICTING:
            self._terminate(tracked)
            cause = {OfflineEvent.QUOTA_EXCEEDED: "quota", OfflineEvent.ADMISSION_TIMEOUT: "admission"}.get(
                event, "memory")
            self.metrics.evictions.labels(**labels, reason=cause).inc()
            if cause == "quota":
                self.metrics.quota_violations.labels(container=spec.name, qos="offline").inc()
            self._record(now, GuardActionKind.EVICT, spec, tracked.pids, reason)
        else:
            self._record(now, GuardActionKind.FORGET, spec, (), reason)

    def _kill_when_due(self, tracked: _Offline, now: float) -> None:
        grace = self.config.guard.kill_grace_s
        if now >= tracked.since + grace:
            self._kill(tracked, now, f"still alive {grace:g} s after SIGTERM")

    def _kill(self, tracked: _Offline, now: float, reason: str) -> None:
        if tracked.killed:
            return
        tracked.killed = True
        self._signal(tracked, signal.SIGKILL)
        self.metrics.kills.inc()
        self._record(now, GuardActionKind.KILL, tracked.spec, tracked.pids, reason)

    # -- the containers ---------------------------------------------------------------------------------

    def _reconfigure(self, now: float, config: GuardConfig) -> None:
        """Take over `update_containers`' list: let go of what is gone, start tracking what is new."""
        if config.containers == self.config.containers and not self._records:
            return
        listed = {c.name: c for c in config.containers if c.qos == "offline"}
        for name, tracked in list(self._offline.items()):
            spec = listed.get(name)
            if spec is not None and spec.card == tracked.spec.card:
                tracked.spec = spec
                continue
            self._let_go(tracked, now)
        added = []
        for name, spec in listed.items():
            if name not in self._offline:
                record = self._records.pop(name, None)
                tracked = self._restore(spec, record)
                tracked.starting = self._started and record is None
                self._offline[name] = tracked
                added.append(tracked)
                self._dirty = True
        if self._state_corrupt and self._started:
            self._continue_stopped(now, added)
        for name, record in self._records.items():
            self._continue_recorded(now, name, record)
        self._records = {}
        self._online = [c for c in config.containers if c.qos == "online"]
        self._over_quota &= {c.name for c in self._online}
        settings = config.guard.settings()
        cards = {c.card for c in config.containers}
        for card in set(self._policies) - cards:
            del self._policies[card], self._unknown[card]
            with contextlib.suppress(KeyError):
                self.metrics.threshold.remove(str(card))
        for card in sorted(cards - set(self._policies)):
            self._policies[card] = CardPolicy(settings)
            self._unknown[card] = set()
        self.config = config

    def _retune(self, options: GuardOptions) -> None:
        """Take over `update_settings`' options: the cards' arbiters and memory guards keep what they have seen."""
        options = options.model_copy(update={"state_file": self.config.guard.state_file})
        if options == self.config.guard:
            return
        settings = options.settings()
        for policy in self._policies.values():
            policy.retune(settings)
        old = self.config.guard
        changed = {name: getattr(options, name) for name in type(options).model_fields
                   if getattr(options, name) != getattr(old, name)}
        log.info("settings changed: %s", ", ".join(f"{name}={value}" for name, value in changed.items()))
        self.config = self.config.model_copy(update={"guard": options})

    def _let_go(self, tracked: _Offline, now: float) -> None:
        """Stop guarding an offline container; a suspended one is continued first (its pod is ending, and a
        stopped process would handle the kubelet's SIGTERM only when SIGKILL ends it)."""
        spec = tracked.spec
        if tracked.state in _STOPPED:
            self._refresh(tracked)
            self._release(tracked, now, "no longer guarded (its pod is ending)")
        del self._offline[spec.name]
        with contextlib.suppress(KeyError):
            self.metrics.suspended.remove(str(spec.card), spec.name)
        self._dirty = True
        log.info("forget container=%s card=%d reason=no longer listed", spec.name, spec.card)

    def _continue_recorded(self, now: float, name: str, record: _Record) -> None:
        """A container the state file recorded that is no longer listed: continue its recorded processes that
        are still stopped (same PID, same start time), never leaving them stopped."""
        self._continue_if_stopped(now, name, record.card, [(p.pid, p.start_ticks) for p in record.pids],
                                  "recorded as stopped, no longer listed: continued")

    def _revive(self, tracked: _Offline, now: float) -> None:
        """A forgotten cgroup container whose cgroup has processes again (a restarted container of a pod)."""
        tracked.state, tracked.since, tracked.killed = OfflineState.RUNNING, now, False
        self._dirty = True
        log.info("track container=%s card=%d pids=%s reason=its cgroup has processes again", tracked.spec.name,
                 tracked.spec.card, list(tracked.pids))

    def _suspended_sibling(self, tracked: _Offline) -> _Offline | None:
        """Another suspended container with the same cgroup (a pod on several cards): its processes stay stopped
        until every card it uses lets them run."""
        cgroup = tracked.spec.cgroup
        if cgroup is None:
            return None
        return next((t for t in self._offline.values() if t is not tracked and t.spec.cgroup == cgroup
                     and t.state in _STOPPED), None)

    # -- processes --------------------------------------------------------------------------------------

    def _refresh(self, tracked: _Offline) -> None:
        """Update the container's live PIDs; processes that joined a suspended or evicting container are
        stopped or told to exit like the others."""
        by_cgroup = tracked.spec.cgroup is not None
        live: list[int] = []
        joined: list[int] = []
        for pid in container_pids(tracked.spec.pids, tracked.spec.cgroup):
            stat = read_stat(pid)
            if stat is None or stat.state is ProcessState.ZOMBIE:
                continue
            known = tracked.starts.get(pid)
            if known is not None and known != stat.start_ticks and not by_cgroup:
                continue  # a listed PID now names another process: never ours to signal
            if known != stat.start_ticks:
                tracked.starts[pid] = stat.start_ticks
                joined.append(pid)
                self._dirty = True
            live.append(pid)
        if by_cgroup and len(tracked.starts) != len(live):
            tracked.starts = {pid: tracked.starts[pid] for pid in live}
            self._dirty = True
        tracked.pids = tuple(live)
        if joined and tracked.state in _STOPPED:
            self._signal_pids(tracked.spec, joined, signal.SIGSTOP)
        elif joined and tracked.state is OfflineState.EVICTING:
            self._signal_pids(tracked.spec, joined, signal.SIGTERM)
            self._signal_pids(tracked.spec, joined, signal.SIGCONT)

    def _terminate(self, tracked: _Offline) -> None:
        """SIGTERM, then SIGCONT: a stopped process handles SIGTERM only once it runs again."""
        tracked.killed = False
        self._signal(tracked, signal.SIGTERM)
        self._signal(tracked, signal.SIGCONT)

    def _signal(self, tracked: _Offline, sig: signal.Signals) -> None:
        self._signal_pids(tracked.spec, tracked.pids, sig)

    def _signal_pids(self, spec: ContainerSpec, pids: Sequence[int], sig: signal.Signals) -> None:
        for pid in pids:
            if signal_process(pid, sig) is SignalResult.DENIED:
                log.warning("%s to pid %d of container %s was denied", sig.name, pid, spec.name)

    def _continue_stopped(self, now: float, containers: Sequence[_Offline]) -> None:
        """After losing the state file: continue every stopped process of these offline containers."""
        for tracked in containers:
            spec = tracked.spec
            if self._continue_if_stopped(now, spec.name, spec.card,
                                         [(pid, None) for pid in container_pids(spec.pids, spec.cgroup)],
                                         "state file unreadable: stopped processes are continued"):
                self._dirty = True

    def _continue_if_stopped(self, now: float, name: str, card: int, candidates: Sequence[tuple[int, int | None]],
                             reason: str) -> bool:
        """SIGCONT the candidate processes (PID, start time or None for any) that are stopped, and record it as a
        RESUME of container `name` on `card`. Whether any was."""
        stopped = []
        for pid, start_ticks in candidates:
            stat = read_stat(pid)
            if stat is not None and stat.state is ProcessState.STOPPED and start_ticks in (None, stat.start_ticks):
                stopped.append(pid)
        if not stopped:
            return False
        spec = ContainerSpec(name=name, card=card, qos="offline", pids=tuple(stopped))
        self._signal_pids(spec, stopped, signal.SIGCONT)
        self._record(now, GuardActionKind.RESUME, spec, tuple(stopped), reason)
        return True

    # -- bookkeeping ------------------------------------------------------------------------------------

    def _check_online_quota(self, now: float, spec: ContainerSpec, used: int) -> None:
        quota = spec.memory_quota_bytes
        if quota is None or used <= quota:
            self._over_quota.discard(spec.name)
            return
        if spec.name not in self._over_quota:
            self._over_quota.add(spec.name)
            self.metrics.quota_violations.labels(container=spec.name, qos="online").inc()
            self._record(now, GuardActionKind.QUOTA_WARNING, spec, (),
                         f"quota: uses {used} B > quota {quota} B (online work is never signalled)")

    def _count_unknown(self, card: int, pids: set[int]) -> None:
        new = pids - self._unknown[card]
        if new:
            self.metrics.unknown_pids.inc(len(new))
            log.info("card %d: ignoring processes of no configured container: %s", card, sorted(new))
        self._unknown[card] = pids

    def _backend_error(self, message: str) -> None:
        self.metrics.backend_errors.inc()
        log.warning("card reading failed, no action taken: %s", message)

    def _record(self, now: float, kind: GuardActionKind, spec: ContainerSpec, pids: tuple[int, ...],
                reason: str) -> None:
        self.actions.append(GuardAction(now, kind, spec.name, spec.card, pids, reason))
        log.info("%s container=%s card=%d pids=%s reason=%s", kind.value, spec.name, spec.card, list(pids), reason)

    # -- persisted state --------------------------------------------------------------------------------

    def _load_state(self) -> dict[str, _Record]:
        path = self.config.guard.state_file
        if path is None:
            return {}
        try:
            return _StateFile.model_validate_json(path.read_bytes()).containers
        except FileNotFoundError:
            return {}
        except (OSError, ValidationError) as exc:
            self._state_corrupt = True
            log.error("%s: unreadable guard state, ignored (stopped offline processes will be continued): %s",
                      path, str(exc).splitlines()[0])
            return {}

    def _restore(self, spec: ContainerSpec, record: _Record | None) -> _Offline:
        """A recorded suspended container stays suspended until the first reading: then online idle resumes
        it, low memory evicts it, online demand keeps it stopped. An evicting one is killed once its grace,
        counted from the recorded time, has passed."""
        if record is None or record.card != spec.card:
            return _Offline(spec, OfflineState.RUNNING, since=self.clock(), first_seen=self.clock())
        self.metrics.suspended.labels(card=str(spec.card), container=spec.name).set(
            1 if record.state in _STOPPED else 0)
        return _Offline(spec, record.state, since=record.since, first_seen=record.first_seen,
                        starts={p.pid: p.start_ticks for p in record.pids})

    def _save(self) -> None:
        path = self.config.guard.state_file
        if path is None or not self._dirty:
            return
        data = {"version": 1, "containers": {
            name: {"card": t.spec.card, "state": t.state.value, "since": t.since, "first_seen": t.first_seen,
                   "pids": [{"pid": pid, "start_ticks": start} for pid, start in sorted(t.starts.items())]}
            for name, t in self._offline.items()}}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False,
                                             encoding="utf-8") as handle:
                json.dump(data, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(handle.name, path)
        except OSError as exc:
            log.error("%s: could not write the guard state (retried on the next change): %s", path, exc)
            return
        self._dirty = False
