"""The co-location guard takes its thresholds from the ColocationPolicy that selects its node.

The policies and the node live in the fake API server (real HTTP, a real informer); the card is a
`FakeGpuBackend`, the offline work a real child process whose state is read from /proc. The guard is driven with
explicit times (`tick(now)`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tests.test_node_guard import FakeClock, Procs, sigterm_self_when, wait_state
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.kube.api import node_path
from gpuplane.kube.crds import API_VERSION, COLOCATION_POLICY, ColocationPolicySpec
from gpuplane.kube.localapi import FakeApiServer, node_json
from gpuplane.kube.objects import object_key
from gpuplane.node import gpu
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.node.guard import ColocationGuard, ContainerSpec, GuardActionKind, GuardConfig, GuardOptions
from gpuplane.node.node_policy import FILE, NodePolicySource, PolicyChoice, choose_policy, policy_options
from gpuplane.node.processes import ProcessState

NODE = "gpu-node-1"
POOL = {"gpuplane.io/pool": "shared"}
FILE_OPTIONS = GuardOptions(min_slice_s=0.5, poll_s=0.01)


def policy(name: str, selector: Mapping[str, str] | None = None, namespace: str = "team-a",
           **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"nodeSelector": dict(POOL if selector is None else selector), **spec}
    return {"apiVersion": API_VERSION, "kind": "ColocationPolicy",
            "metadata": {"name": name, "namespace": namespace, "generation": 1}, "spec": body}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    spawned = Procs(tmp_path)
    yield spawned
    for child in spawned.children:
        child.kill()
        child.wait()


# -- choosing the policy (no server) ----------------------------------------------------------------------

LABELS = {"kubernetes.io/hostname": NODE, **POOL}


@pytest.mark.parametrize(
    ("policies", "current", "expected_policy", "expected_slice", "matching", "invalid"),
    [
        # none at all: the file's 0.5 s
        ([], None, FILE, 0.5, (), {}),
        # one selects the node: its 2 s
        ([policy("a", minSliceSeconds=2.0)], None, "team-a/a", 2.0, ("team-a/a",), {}),
        # an empty selector selects every node
        ([policy("a", {}, minSliceSeconds=2.0)], None, "team-a/a", 2.0, ("team-a/a",), {}),
        # another pool's policy, and one asking for a label value the node does not have: the file's
        ([policy("a", {"gpuplane.io/pool": "other"}, minSliceSeconds=2.0),
          policy("b", {**POOL, "zone": "b"}, minSliceSeconds=3.0)], None, FILE, 0.5, (), {}),
        # two select it: a conflict, the file's stays in force
        ([policy("a", minSliceSeconds=2.0), policy("b", {}, namespace="team-b", minSliceSeconds=3.0)], None,
         FILE, 0.5, ("team-a/a", "team-b/b"), {}),
        # ... or the policy in force before, when it is one of them (its thresholds as they were applied)
        ([policy("a", minSliceSeconds=2.0), policy("b", {}, namespace="team-b", minSliceSeconds=3.0)],
         PolicyChoice(FILE_OPTIONS.model_copy(update={"min_slice_s": 1.5}), "team-a/a", 1, ("team-a/a",)),
         "team-a/a", 1.5, ("team-a/a", "team-b/b"), {}),
        # ... but not one that no longer selects the node: the file's
        ([policy("a", minSliceSeconds=2.0), policy("b", {}, namespace="team-b", minSliceSeconds=3.0)],
         PolicyChoice(FILE_OPTIONS, "team-c/c", 1, ("team-c/c",)), FILE, 0.5, ("team-a/a", "team-b/b"), {}),
        # an invalid policy is ignored (the other one applies), with its field named
        ([policy("bad", minSliceSeconds=-1), policy("a", {}, minSliceSeconds=2.0)], None, "team-a/a", 2.0,
         ("team-a/a",), {"team-a/bad": "spec.minSliceSeconds: Input should be greater than or equal to 0"}),
        # an invalid policy whose selector cannot select the node is not this node's concern
        ([policy("bad", {"gpuplane.io/pool": "other"}, minSliceSeconds=-1)], None, FILE, 0.5, (), {}),
        # an unreadable selector could select it: reported
        ([policy("bad", None, nodeSelector="shared")], None, FILE, 0.5, (), {"team-a/bad": "spec.nodeSelector"}),
    ],
)
def test_the_policy_that_selects_the_node_is_chosen(policies: list[dict[str, Any]], current: PolicyChoice | None,
                                                    expected_policy: str, expected_slice: float,
                                                    matching: tuple[str, ...], invalid: dict[str, str]) -> None:
    choice = choose_policy(policies, LABELS, FILE_OPTIONS, current)
    assert choice.policy == expected_policy
    assert choice.options.min_slice_s == expected_slice
    assert choice.matching == matching
    assert choice.conflict == (len(matching) > 1)
    got = dict(choice.invalid or {})
    assert got.keys() == invalid.keys()
    for key, field in invalid.items():
        assert got[key].startswith(field), got[key]


def test_a_policy_replaces_every_threshold_but_not_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    fallback = GuardOptions(state_file=state, poll_s=0.02, kill_grace_s=3, min_slice_s=0.5, memory_guard=True)
    spec: dict[str, Any] = {
        "pollSeconds": 0.1, "killGraceSeconds": 7.0, "onlineSmThresholdPercent": 12.0, "minSliceSeconds": 2.0,
        "memoryGuard": False, "safetyMarginBytes": 1024, "growthFactor": 2.5, "minGrowthBytes": 2048,
        "reactionHorizonSeconds": 1.5, "growthWindowSeconds": 60.0}
    choice = choose_policy([policy("a", **spec)], LABELS, fallback)
    assert choice.options == GuardOptions(
        state_file=state, poll_s=0.1, kill_grace_s=7.0, online_sm_threshold_pct=12.0, min_slice_s=2.0,
        memory_guard=False, safety_margin_bytes=1024, growth_factor=2.5, min_growth_bytes=2048,
        reaction_horizon_s=1.5, growth_window_s=60.0)
    assert policy_options(fallback, ColocationPolicySpec.model_validate(spec)) == choice.options


# -- the guard's update_settings ----------------------------------------------------------------------------


def test_update_settings_keeps_the_state_file_and_is_taken_at_the_next_pass(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    guard = ColocationGuard(GuardConfig(guard=GuardOptions(state_file=state, poll_s=0.05),
                                        containers=(ContainerSpec(name="x", card=0, qos="online", pids=(1,)),)),
                            FakeGpuBackend())
    guard.update_settings(GuardOptions(poll_s=0.2, min_slice_s=3.0))  # no state file: the guard's stays
    assert guard.config.guard.poll_s == 0.05  # not before the next pass
    pauses: list[float] = []
    stop = threading.Event()

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        stop.set()

    guard.run(stop, sleep=sleep)
    assert guard.config.guard == GuardOptions(state_file=state, poll_s=0.2, min_slice_s=3.0)
    assert 0.1 < pauses[0] <= 0.2  # the new poll period, taken by the running loop (0.2 minus the pass)


# -- the guard fed from the policies, on a real process ----------------------------------------------------


class Rig:
    """A node and its policies in the fake API server, a guard with one online and one offline container."""

    def __init__(self, server: FakeApiServer, procs: Procs, labels: Mapping[str, str] = POOL) -> None:
        self.server = server
        self.chat, self.batch = procs.online(), procs.busy()
        server.add_node(node_json(NODE, labels=labels))
        self.backend = FakeGpuBackend()
        self.backend.set_process(0, self.chat, GIB, 0.0)
        self.backend.set_process(0, self.batch, GIB, 99.0)
        self.clock = FakeClock()
        config = GuardConfig(guard=FILE_OPTIONS, containers=(
            ContainerSpec(name="chat", card=0, qos="online", pids=(self.chat,)),
            ContainerSpec(name="batch", card=0, qos="offline", pids=(self.batch,))))
        self.guard = ColocationGuard(config, self.backend, clock=self.clock)
        self.source = NodePolicySource(server.api, NODE, FILE_OPTIONS, registry=self.guard.registry)
        self.source.start()
        assert self.source.wait_synced(5)

    def create(self, obj: dict[str, Any]) -> None:
        self.server.api.create(COLOCATION_POLICY.path(obj["metadata"]["namespace"]), obj)

    def edit(self, key: str, **spec: Any) -> None:
        namespace, name = key.split("/")
        self.server.api.patch(COLOCATION_POLICY.path(namespace, name), {"spec": spec})

    def sync(self, expect: Mapping[str, int]) -> PolicyChoice:
        """Once the informer holds exactly the policies `expect` names, at those generations, and the node's
        informer the node as the server has it: resolve, push the options to the guard (taken at its next pass)."""
        def cached() -> dict[str, int]:
            return {object_key(o): int(o["metadata"]["generation"]) for o in self.source.informer.objects()}

        def node_seen() -> bool:
            node, stored = self.source.node_informer.get(NODE), self.server.get("nodes", NODE)
            return node is not None and stored is not None and node["metadata"] == stored["metadata"]

        wait_for(lambda: cached() == dict(expect), f"the informer to hold {dict(expect)}")
        wait_for(node_seen, "the node's informer to hold the node")
        choice = self.source.resolve()
        self.guard.update_settings(choice.options)
        return choice

    def at(self, now: float, online_pct: float) -> None:
        self.backend.set_process(0, self.chat, GIB, online_pct)
        self.clock.now = now
        self.guard.tick(now)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.guard.registry.get_sample_value(name, labels)

    def in_force(self) -> str:
        """The `policy` label of the info metric."""
        for family in self.guard.registry.collect():
            if family.name == "gpuplane_guard_policy":
                (sample,) = family.samples
                return sample.labels["policy"]
        raise AssertionError("no gpuplane_guard_policy_info")

    def kinds(self) -> list[GuardActionKind]:
        return [a.kind for a in self.guard.actions]


@pytest.fixture
def rig(procs: Procs) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []
    with FakeApiServer() as server:
        def make(**kwargs: Any) -> Rig:
            made.append(Rig(server, procs, **kwargs))
            return made[-1]

        yield make
        for r in made:
            r.source.stop()


def test_the_one_policy_that_selects_the_node_sets_the_minimum_slice(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.create(policy("slow", minSliceSeconds=2.0))
    r.create(policy("elsewhere", {"gpuplane.io/pool": "other"}, minSliceSeconds=0.0))
    choice = r.sync({"team-a/slow": 1, "team-a/elsewhere": 1})
    assert choice.options.min_slice_s == 2.0 and r.in_force() == "team-a/slow"
    # (now, online SM %, batch expected): the file's slice (0.5 s) would resume it at 2.5; the policy's 2 s, at 4.0
    steps = [(1.0, 80.0, ProcessState.STOPPED),  # online demand
             (2.0, 0.0, ProcessState.STOPPED),  # online idle since 2.0
             (2.5, 0.0, ProcessState.STOPPED),  # idle 0.5 s: enough for the file, not for the policy
             (3.9, 0.0, ProcessState.STOPPED),
             (4.0, 0.0, ProcessState.RUNNING)]  # idle 2 s
    for now, pct, expected in steps:
        r.at(now, pct)
        wait_state(r.batch, expected)
    assert r.kinds() == [GuardActionKind.SUSPEND, GuardActionKind.RESUME]
    assert r.guard.actions[1].reason == "online idle for at least 2 s"


def test_without_a_policy_the_files_thresholds_apply(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.create(policy("elsewhere", {"gpuplane.io/pool": "other"}, minSliceSeconds=2.0))
    choice = r.sync({"team-a/elsewhere": 1})
    assert choice.policy == FILE and choice.options == FILE_OPTIONS and r.in_force() == FILE
    for now, pct, expected in [(1.0, 80.0, ProcessState.STOPPED), (2.0, 0.0, ProcessState.STOPPED),
                               (2.5, 0.0, ProcessState.RUNNING)]:  # the file's 0.5 s
        r.at(now, pct)
        wait_state(r.batch, expected)


def test_a_policy_with_more_memory_margin_evicts_offline_work(rig: Callable[..., Rig]) -> None:
    r = rig()
    # 80 GiB card, 2 GiB used: 78 GiB free. The file's line is 2 GiB + 1.5 x 2 GiB = 5 GiB: nothing to do.
    r.at(1.0, 0.0)
    assert r.kinds() == [] and r.metric("gpuplane_guard_memory_threshold_bytes", card="0") == 5 * GIB
    # The policy keeps 77 GiB free on top of 1 x 2 GiB of growth: a 79 GiB line, 1 GiB short: the 1 GiB batch goes.
    r.create(policy("roomy", safetyMarginBytes=77 * GIB, growthFactor=1.0))
    r.sync({"team-a/roomy": 1})
    r.at(2.0, 0.0)
    assert r.metric("gpuplane_guard_memory_threshold_bytes", card="0") == 79 * GIB
    assert r.kinds() == [GuardActionKind.EVICT]
    wait_state(r.batch, ProcessState.ZOMBIE)  # it handled SIGTERM and exited


def test_two_policies_for_one_node_are_a_conflict(rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    r = rig()
    r.create(policy("a", minSliceSeconds=2.0))
    r.create(policy("b", {}, namespace="team-b", minSliceSeconds=3.0))
    choice = r.sync({"team-a/a": 1, "team-b/b": 1})
    assert choice.conflict and choice.policy == FILE and choice.options == FILE_OPTIONS and r.in_force() == FILE
    assert r.metric("gpuplane_guard_policy_conflicts_total") == 1
    assert r.metric("gpuplane_guard_policy_conflict") == 1
    assert "ColocationPolicies team-a/a, team-b/b all select it; none is applied, the thresholds of the config " \
           "file stay in force" in caplog.text
    r.source.resolve()  # the same conflict: not counted again
    assert r.metric("gpuplane_guard_policy_conflicts_total") == 1
    for now, pct, expected in [(1.0, 80.0, ProcessState.STOPPED), (2.0, 0.0, ProcessState.STOPPED),
                               (2.5, 0.0, ProcessState.RUNNING)]:  # the file's 0.5 s
        r.at(now, pct)
        wait_state(r.batch, expected)
    # One goes: the other applies, the conflict is over.
    r.server.api.delete(COLOCATION_POLICY.path("team-a", "a"))
    choice = r.sync({"team-b/b": 1})
    assert choice.options.min_slice_s == 3.0 and r.metric("gpuplane_guard_policy_conflict") == 0
    # A third one for the node: the one in force (b) stays in force through the conflict.
    r.create(policy("c", minSliceSeconds=0.0))
    choice = r.sync({"team-b/b": 1, "team-a/c": 1})
    assert choice.policy == "team-b/b" and choice.options.min_slice_s == 3.0
    assert r.metric("gpuplane_guard_policy_conflicts_total") == 2


def test_an_invalid_policy_is_ignored_with_its_field_named(rig: Callable[..., Rig],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    r = rig()
    r.create(policy("broken", minSliceSeconds=-1.0))
    r.create(policy("fine", {}, namespace="team-b", minSliceSeconds=2.0))
    choice = r.sync({"team-a/broken": 1, "team-b/fine": 1})
    assert not choice.conflict  # the invalid one does not count
    assert ("ColocationPolicy team-a/broken ignored, it is invalid: spec.minSliceSeconds: Input should be greater "
            "than or equal to 0") in caplog.text
    assert r.metric("gpuplane_guard_policies_invalid_total") == 1
    r.source.resolve()
    assert r.metric("gpuplane_guard_policies_invalid_total") == 1  # logged and counted once
    assert caplog.text.count("team-a/broken ignored") == 1


def test_an_edited_policy_applies_without_resuming_stopped_work_early(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.create(policy("p", minSliceSeconds=1.0))
    r.sync({"team-a/p": 1})
    r.at(1.0, 80.0)  # online demand: stopped
    wait_state(r.batch, ProcessState.STOPPED)
    # While online is busy the slice is cut to 0: nothing resumes, online is still busy.
    r.edit("team-a/p", minSliceSeconds=0.0)
    assert r.sync({"team-a/p": 2}).options.min_slice_s == 0.0
    r.at(1.5, 80.0)
    wait_state(r.batch, ProcessState.STOPPED)
    # Online idle since 2.0 under a 0 s slice would resume at once; the slice goes to 3 s first.
    r.edit("team-a/p", minSliceSeconds=3.0)
    r.sync({"team-a/p": 3})
    # (now, batch expected): idle since 2.0, so the 3 s slice ends at 5.0 (not 3.0 as with the old 1 s)
    for now, expected in [(2.0, ProcessState.STOPPED), (3.0, ProcessState.STOPPED), (4.9, ProcessState.STOPPED),
                          (5.0, ProcessState.RUNNING)]:
        r.at(now, 0.0)
        wait_state(r.batch, expected)
    assert r.kinds() == [GuardActionKind.SUSPEND, GuardActionKind.RESUME]
    assert r.guard.actions[1].at == 5.0


def test_a_node_relabelled_out_of_the_selector_goes_back_to_the_file(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.create(policy("p", minSliceSeconds=2.0))
    r.sync({"team-a/p": 1})
    r.at(1.0, 80.0)
    wait_state(r.batch, ProcessState.STOPPED)
    r.server.api.patch(node_path(NODE), {"metadata": {"labels": {"gpuplane.io/pool": None}}})
    choice = r.sync({"team-a/p": 1})
    assert choice.options == FILE_OPTIONS and r.in_force() == FILE
    for now, expected in [(2.0, ProcessState.STOPPED), (2.5, ProcessState.RUNNING)]:  # the file's 0.5 s
        r.at(now, 0.0)
        wait_state(r.batch, expected)


def test_an_unreadable_node_keeps_its_last_labels(rig: Callable[..., Rig]) -> None:
    r = rig()
    r.create(policy("p", minSliceSeconds=2.0))
    r.sync({"team-a/p": 1})
    # The node's watch breaks and cannot be reopened (nor the node listed) while it is relabelled.
    r.server.fail_next("GET", "^/api/v1/nodes$", 503, "ServiceUnavailable", times=1000)
    r.server.drop_watches()
    r.server.api.patch(node_path(NODE), {"metadata": {"labels": {"gpuplane.io/pool": "other"}}})
    wait_for(lambda: "503" in r.source.node_informer.last_error, "the node's watch to fail")
    assert r.source.resolve().policy == "team-a/p"
    assert r.source.labels is not None and r.source.labels["gpuplane.io/pool"] == "shared"


def test_the_node_is_watched_not_fetched(rig: Callable[..., Rig]) -> None:
    """Its labels come from a watch narrowed to it, with no GET of the node per refresh (a 1,000-node cluster
    would take 200 whole-Node GETs a second at the 5 s default)."""
    r = rig()
    r.server.add_node(node_json("gpu-node-2", labels=POOL))
    source = NodePolicySource(r.server.api, NODE, FILE_OPTIONS, refresh_s=0.01, registry=CollectorRegistry())
    source.start()
    stop = threading.Event()
    feeder = threading.Thread(target=source.run, args=(r.guard, stop))
    feeder.start()
    try:
        assert source.wait_synced(5)
        r.create(policy("p", minSliceSeconds=2.0))
        wait_for(lambda: source.choice.policy == "team-a/p", "the policy")
        time.sleep(0.1)  # ten refreshes
    finally:
        stop.set()
        source.stop()
        feeder.join(timeout=5)
    assert r.server.requests_to(f"^{node_path(NODE)}$", "GET") == []
    assert source.node_informer.keys() == [NODE]  # the list and the watch are narrowed to the node


def test_a_running_source_pushes_policy_and_label_changes_to_the_guard(rig: Callable[..., Rig]) -> None:
    r = rig()
    source = NodePolicySource(r.server.api, NODE, FILE_OPTIONS, refresh_s=0.05, registry=CollectorRegistry())
    source.start()
    stop = threading.Event()
    feeder = threading.Thread(target=source.run, args=(r.guard, stop))
    feeder.start()
    now = iter(range(1, 10_000))

    def slice_is(seconds: float) -> Callable[[], bool]:
        def check() -> bool:  # a pass per check: the guard takes the pushed options at its next pass
            r.at(float(next(now)), 0.0)
            return r.guard.config.guard.min_slice_s == seconds
        return check

    try:
        r.create(policy("p", minSliceSeconds=2.0))
        wait_for(slice_is(2.0), "the new policy (the watch)")
        r.edit("team-a/p", minSliceSeconds=4.0)
        wait_for(slice_is(4.0), "the edit (the watch)")
        r.server.api.patch(node_path(NODE), {"metadata": {"labels": {"gpuplane.io/pool": "other"}}})
        wait_for(slice_is(0.5), "the relabelled node (the refresh)")
    finally:
        stop.set()
        source.stop()
        feeder.join(timeout=5)
    assert not feeder.is_alive()


# -- the command -------------------------------------------------------------------------------------------


def test_node_guard_from_pods_applies_the_nodes_policy(procs: Procs, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The command end to end: the policy's safety margin evicts an offline host process that the config file's
    thresholds leave alone; only the GPU is a fake."""
    chat, batch = procs.online(), procs.busy()
    backend = FakeGpuBackend()  # 80 GiB, 2 GiB used: the file's line is 5 GiB, the policy's 79 GiB
    backend.set_process(0, chat, GIB, 0.0)
    backend.set_process(0, batch, GIB, 99.0)
    monkeypatch.setattr(gpu, "NvmlBackend", lambda: backend)
    monkeypatch.setenv("NODE_NAME", NODE)
    config = tmp_path / "guard.yaml"
    config.write_text(f"""guard: {{poll_s: 0.01}}
containers:
  - {{name: chat, card: 0, qos: online, pids: [{chat}]}}
  - {{name: batch, card: 0, qos: offline, pids: [{batch}]}}
""")
    with FakeApiServer() as server:
        server.add_node(node_json(NODE, labels=POOL))
        server.add_object(COLOCATION_POLICY.path("team-a"),
                          policy("roomy", safetyMarginBytes=77 * GIB, growthFactor=1.0))
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        with sigterm_self_when(batch, ProcessState.ZOMBIE) as seen:  # once the offline process is evicted
            result = CliRunner().invoke(app, ["node-guard", "--config", str(config), "--from-pods", "--kubeconfig",
                                              str(kubeconfig), "--refresh-s", "0.5"])
    assert result.exit_code == 0, result.output
    assert seen == [ProcessState.ZOMBIE]
    procs.assert_online_untouched(chat)
