"""The co-location guard's thresholds from the ColocationPolicy that selects its node.

A `ColocationPolicy` (`gpuplane.kube.crds`, namespaced) selects nodes by `spec.nodeSelector` (every pair must be
among the node's labels; an empty selector selects every node) and carries the guard's thresholds. For the node
the guard runs on:

- exactly one valid policy selects it: its thresholds replace the config file's (all of them: the API server has
  filled in the CRD's defaults for fields the policy leaves out); the state file stays the file's;
- none: the file's thresholds;
- two or more: a conflict. The thresholds in force are kept (the policy applied before, if it is one of them;
  otherwise the file's); the conflict is logged and counted once per conflicting set, and flagged while it lasts;
- an invalid policy (`parse_resource` raises `ResourceError`) is ignored, as if it did not exist, with a
  warning naming the field (once while it stays invalid for the same reason, and only if its selector could
  select the node).

The policies and the node's labels come from a `gpuplane.kube.node_watch.NodeWatch` (an `Informer` on all
namespaces' `colocationpolicies`, one on `/api/v1/nodes` narrowed to the node): a change of either reaches the guard
through `ColocationGuard.update_settings` at its next pass, with no request per refresh. While the node's watch is
broken (or the node is gone), its last labels are used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from gpuplane.kube.api import KubeApi
from gpuplane.kube.crds import COLOCATION_POLICY, ColocationPolicySpec, ResourceError, parse_resource
from gpuplane.kube.informer import Informer
from gpuplane.kube.node_watch import NodeWatch
from gpuplane.kube.objects import object_key, selects
from gpuplane.node.guard import ColocationGuard, GuardOptions

log = logging.getLogger(__name__)

POLICIES_ALL = COLOCATION_POLICY.path()
"""Every namespace's ColocationPolicies."""
FILE = ""
"""`PolicyChoice.policy` when the config file's thresholds are in force."""


def policy_options(fallback: GuardOptions, spec: ColocationPolicySpec) -> GuardOptions:
    """`fallback` (the config file's options) with the policy's thresholds in place of its own."""
    return GuardOptions.model_validate({
        **fallback.model_dump(),
        "poll_s": spec.poll_s,
        "kill_grace_s": spec.kill_grace_s,
        "online_sm_threshold_pct": spec.online_sm_threshold_percent,
        "min_slice_s": spec.min_slice_s,
        "memory_guard": spec.memory_guard,
        "safety_margin_bytes": spec.safety_margin_bytes,
        "growth_factor": spec.growth_factor,
        "min_growth_bytes": spec.min_growth_bytes,
        "reaction_horizon_s": spec.reaction_horizon_s,
        "growth_window_s": spec.growth_window_s,
    })


def _may_select(policy: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether an invalid policy's raw selector could select the node (an unreadable one could)."""
    spec = policy.get("spec")
    selector = spec.get("nodeSelector") if isinstance(spec, Mapping) else None
    if not isinstance(selector, Mapping):
        return True
    return selects({str(key): value for key, value in selector.items()}, labels)


@dataclass(frozen=True, slots=True)
class PolicyChoice:
    """The options in force for the node and where they come from."""

    options: GuardOptions
    policy: str = FILE
    """`namespace/name` of the ColocationPolicy in force; `FILE` for the config file."""
    generation: int = 0
    matching: tuple[str, ...] = ()
    """The valid policies that select the node (two or more: a conflict)."""
    invalid: Mapping[str, str] | None = None
    """Policy key -> why it is ignored (the field and the reason), for those that could select the node."""

    @property
    def conflict(self) -> bool:
        return len(self.matching) > 1


def choose_policy(policies: Sequence[Mapping[str, Any]], labels: Mapping[str, str], fallback: GuardOptions,
                  current: PolicyChoice | None = None) -> PolicyChoice:
    """The options for a node with `labels`, given every ColocationPolicy; `current` is what is in force now
    (kept through a conflict when it is one of the conflicting policies)."""
    valid: dict[str, tuple[int, ColocationPolicySpec]] = {}
    invalid: dict[str, str] = {}
    for obj in policies:
        key = object_key(obj)
        try:
            resource = parse_resource(obj)
        except ResourceError as exc:
            if _may_select(obj, labels):
                invalid[key] = str(exc)
            continue
        assert isinstance(resource.spec, ColocationPolicySpec)
        if selects(resource.spec.node_selector, labels):
            valid[key] = (resource.generation, resource.spec)
    matching = tuple(sorted(valid))
    if len(matching) == 1:
        (key,) = matching
        generation, spec = valid[key]
        return PolicyChoice(policy_options(fallback, spec), key, generation, matching, invalid)
    if matching and current is not None and current.policy in matching:
        return PolicyChoice(current.options, current.policy, current.generation, matching, invalid)
    return PolicyChoice(fallback, FILE, 0, matching, invalid)


class NodePolicySource:
    """Feeds a guard the options of the ColocationPolicy that selects `node` (`fallback`: the config file's).

    `start()` starts the informers (the policies, the node); `run(guard, stop)` pushes the options to the guard
    (`update_settings`) when they change: at once on a change either watch brings, and in any case every
    `refresh_s`. Metrics go to `registry` (the guard's, so they are served with its own)."""

    def __init__(self, api: KubeApi, node: str, fallback: GuardOptions, *, refresh_s: float = 5.0,
                 registry: CollectorRegistry | None = None, informer: Informer | None = None,
                 node_informer: Informer | None = None) -> None:
        self.api = api
        self.node = node
        self.fallback = fallback
        self.refresh_s = refresh_s
        self.watch = NodeWatch(api, node, POLICIES_ALL, name="colocationpolicies", informer=informer,
                               node_informer=node_informer)
        self.informer = self.watch.informer
        self.node_informer = self.watch.node_informer
        self.choice = PolicyChoice(fallback)
        registry = registry if registry is not None else CollectorRegistry()
        self.info = Info("gpuplane_guard_policy", "The thresholds in force: policy (namespace/name of the "
                         "ColocationPolicy, empty for the config file) and its generation.", registry=registry)
        self.conflicts = Counter("gpuplane_guard_policy_conflicts",
                                 "Conflicts: two or more ColocationPolicies select the node (each once while it "
                                 "lasts).", registry=registry)
        self.in_conflict = Gauge("gpuplane_guard_policy_conflict",
                                 "1 while two or more ColocationPolicies select the node.", registry=registry)
        self.invalid = Counter("gpuplane_guard_policies_invalid",
                               "Invalid ColocationPolicies that could select the node, ignored (each once per reason).",
                               registry=registry)
        self._logged_invalid: dict[str, str] = {}
        self._show(self.choice)

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()

    @property
    def has_synced(self) -> bool:
        """Whether both the policies and the node have been listed."""
        return self.watch.has_synced

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        """Wait (at most `timeout_s` in all) for the first list of the policies and of the node."""
        return self.watch.wait_synced(timeout_s)

    @property
    def last_error(self) -> str:
        """The informers' last errors, for a log line."""
        return self.watch.last_error

    @property
    def labels(self) -> dict[str, str] | None:
        """The node's labels as last seen (None: never seen)."""
        return self.watch.labels

    def resolve(self) -> PolicyChoice:
        """The options in force now (from the cached policies and the node's last labels), logged and shown in
        the metrics when they change. Before both are listed, and before the node has been seen, the config
        file's."""
        labels = self.watch.node_labels()
        if labels is None or not self.has_synced:
            return self.choice
        old = self.choice
        choice = choose_policy(self.watch.objects(), labels, self.fallback, old)
        self._report(old, choice)
        self.choice = choice
        return choice

    def run(self, guard: ColocationGuard, stop: threading.Event) -> None:
        """Until `stop` is set (and `stop()` called, to wake it): push the node's options to `guard`."""
        pushed = self.choice.options

        def step() -> None:
            nonlocal pushed
            options = self.resolve().options
            if options != pushed:
                guard.update_settings(options)
                pushed = options

        self.watch.follow(step, stop, self.refresh_s)

    def _report(self, old: PolicyChoice, new: PolicyChoice) -> None:
        invalid = dict(new.invalid or {})
        for key, reason in invalid.items():
            if self._logged_invalid.get(key) != reason:
                self.invalid.inc()
                log.warning("ColocationPolicy %s ignored, it is invalid: %s", key, reason)
        self._logged_invalid = invalid
        if new.conflict and set(new.matching) != set(old.matching if old.conflict else ()):
            self.conflicts.inc()
            kept = f"ColocationPolicy {new.policy}" if new.policy else "the config file"
            log.error("node %s: ColocationPolicies %s all select it; none is applied, the thresholds of %s stay "
                      "in force", self.node, ", ".join(new.matching), kept)
        self.in_conflict.set(1 if new.conflict else 0)
        if (new.policy, new.generation, new.options) != (old.policy, old.generation, old.options):
            source = f"ColocationPolicy {new.policy} (generation {new.generation})" if new.policy else "the config file"
            log.info("node %s: the guard's thresholds are now those of %s", self.node, source)
        self._show(new)

    def _show(self, choice: PolicyChoice) -> None:
        self.info.info({"policy": choice.policy, "generation": str(choice.generation)})
