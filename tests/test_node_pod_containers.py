"""The guard's containers from the pods on the node: a real (fake) API server over HTTP, a cgroup tree in a temp
directory whose `cgroup.procs` files hold the PIDs of real child processes, and a `FakeGpuBackend` for the card.
Every assertion about a process reads its state from /proc.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from tests.test_node_guard import FakeClock, Procs, sigterm_self_when, wait_state
from typer.testing import CliRunner

from gpuplane.cli.main import app
from gpuplane.kube.localapi import FakeApiServer, pod_json
from gpuplane.kube.objects import ASSIGNMENT, QOS_LABEL, ObjectError, encode_assignment
from gpuplane.model import Assignment, CardShare
from gpuplane.node import gpu
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.node.guard import ColocationGuard, ContainerSpec, GuardActionKind, GuardConfig, GuardOptions
from gpuplane.node.pod_containers import (
    BEST_EFFORT,
    BURSTABLE,
    GUARANTEED,
    CgroupLayout,
    PodContainerSource,
    kube_qos_class,
    pod_containers,
)
from gpuplane.node.processes import ProcessState, process_state

NODE = "gpu-node-1"
UID = "3f2a9c1e-7b4d-4e8f-9a0b-1c2d3e4f5a6b"
UID_ = "3f2a9c1e_7b4d_4e8f_9a0b_1c2d3e4f5a6b"
MIB = 1 << 20


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    spawned = Procs(tmp_path)
    yield spawned
    for child in spawned.children:
        child.kill()
        child.wait()


def share(card: int, mib: int = 0, *, whole: bool = False, mig: int | None = None) -> CardShare:
    return CardShare(card=card, compute_milli=1000 if whole else 300, memory_mib=mib, whole=whole,
                     mig_profile=mig, mig_start=None if mig is None else 0)


def gpu_pod(name: str, *shares: CardShare, qos: str | None = None, uid: str | None = None, node: str = NODE,
            assigned_node: str | None = None, phase: str = "Running", limits: dict[str, str] | None = None,
            **status: str) -> dict[str, Any]:
    """A pod bound to `node` holding `shares` (its assignment annotation), with QoS label `qos`."""
    annotations = {ASSIGNMENT: encode_assignment(Assignment(assigned_node or node, shares))} if shares else {}
    pod = pod_json(name, limits={"gpuplane.io/gpu": str(len(shares) or 1), **(limits or {})},
                   annotations=annotations, labels={QOS_LABEL: qos} if qos else {}, node=node, phase=phase)
    if uid is not None:
        pod["metadata"]["uid"] = uid
    pod["status"].update(status)
    return pod


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- the kubelet's cgroup layout and the pod's QoS class ------------------------------------------------


@pytest.mark.parametrize(
    ("driver", "qos_class", "expected"),
    [
        # systemd: a dash separates slice levels, so the uid's dashes become underscores
        ("systemd", GUARANTEED, f"kubepods.slice/kubepods-pod{UID_}.slice"),
        ("systemd", BURSTABLE, f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"),
        ("systemd", BEST_EFFORT, f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"),
        # cgroupfs: the uid as it is
        ("cgroupfs", GUARANTEED, f"kubepods/pod{UID}"),
        ("cgroupfs", BURSTABLE, f"kubepods/burstable/pod{UID}"),
        ("cgroupfs", BEST_EFFORT, f"kubepods/besteffort/pod{UID}"),
    ],
)
def test_pod_cgroup_follows_the_kubelets_layout(driver: str, qos_class: str, expected: str) -> None:
    layout = CgroupLayout("systemd" if driver == "systemd" else "cgroupfs", Path("/host/cgroup"))
    assert layout.pod_dir(UID, qos_class) == Path("/host/cgroup") / expected


def _containers(*resources: dict[str, dict[str, str]], init: dict[str, dict[str, str]] | None = None,
                qos_class: str | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns"},
                           "spec": {"containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(resources)]},
                           "status": {}}
    if init is not None:
        pod["spec"]["initContainers"] = [{"name": "init", "resources": init}]
    if qos_class is not None:
        pod["status"]["qosClass"] = qos_class
    return pod


FULL = {"cpu": "2", "memory": "4Gi"}


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        (_containers({}, qos_class=BURSTABLE), BURSTABLE),  # the API server's answer wins
        (_containers({}), BEST_EFFORT),  # nothing asked
        (_containers({"limits": {"gpuplane.io/gpu": "1"}}), BEST_EFFORT),  # only CPU and memory count
        (_containers({"limits": {"cpu": "0", "memory": "0"}}), BEST_EFFORT),  # zero is not asking
        (_containers({"limits": FULL}), GUARANTEED),  # requests left out are the limits
        (_containers({"limits": FULL, "requests": {"cpu": "2000m", "memory": "4096Mi"}}), GUARANTEED),  # equal
        (_containers({"limits": FULL, "requests": {"cpu": "1"}}), BURSTABLE),  # 1 CPU asked < 2 CPU limit
        (_containers({"limits": {"cpu": "2"}}), BURSTABLE),  # no memory limit
        (_containers({"limits": FULL}, {}), BURSTABLE),  # one container without limits
        (_containers({"limits": FULL}, init={}), BURSTABLE),  # init containers count too
        (_containers({"requests": {"memory": "1Gi"}}), BURSTABLE),
    ],
)
def test_the_pods_qos_class_is_the_kubelets(pod: dict[str, Any], expected: str) -> None:
    assert kube_qos_class(pod) == expected


# -- pods -> containers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["systemd", "cgroupfs"])
def test_the_nodes_gpu_pods_become_guard_containers(tmp_path: Path, driver: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    layout = CgroupLayout("systemd" if driver == "systemd" else "cgroupfs", tmp_path)
    uids = {name: f"0000000{i}-aaaa-4bbb-8ccc-00000000000{i}" for i, name in enumerate(
        ("chat", "train", "scavenge", "tiny"))}
    escaped = {name: uid.replace("-", "_") for name, uid in uids.items()}
    with FakeApiServer() as server:
        # online by default (no label); BestEffort (only gpuplane resources); 10 GiB on card 2
        server.add_pod(gpu_pod("chat", share(2, 10240), uid=uids["chat"]))
        # offline on two whole cards; Guaranteed (CPU and memory limits): no quota on a whole card
        server.add_pod(gpu_pod("train", share(0, 40960, whole=True), share(1, 40960, whole=True), qos="offline",
                               uid=uids["train"], limits=FULL))
        # best-effort is offline for the guard; Burstable as the API server says
        server.add_pod(gpu_pod("scavenge", share(2, 2048), qos="best-effort", uid=uids["scavenge"],
                               qosClass=BURSTABLE))
        # a MIG slice and a fraction: the slice is isolated by the hardware, only card 3 is guarded
        server.add_pod(gpu_pod("tiny", share(3, 1024), share(4, mig=9), qos="offline", uid=uids["tiny"]))
        # not guarded: no assignment (not a gpuplane GPU pod), not running, another node's
        server.add_pod(pod_json("web", node=NODE, phase="Running"))
        server.add_pod(gpu_pod("waiting", share(5, 1024), phase="Pending"))
        server.add_pod(gpu_pod("done", share(5, 1024), phase="Succeeded"))
        server.add_pod(gpu_pod("elsewhere", share(5, 1024), node="gpu-node-2"))
        registry = CollectorRegistry()
        source = PodContainerSource(server.api, NODE, layout, registry=registry)
        source.start()
        try:
            assert source.wait_synced(5)
            got = {c.name: c for c in source.containers()}
        finally:
            source.stop()

    def where(name: str, tier: str) -> Path:
        if driver == "cgroupfs":
            top = tmp_path / "kubepods"
            return top / tier / f"pod{uids[name]}" if tier else top / f"pod{uids[name]}"
        if not tier:
            return tmp_path / "kubepods.slice" / f"kubepods-pod{escaped[name]}.slice"
        return tmp_path / "kubepods.slice" / f"kubepods-{tier}.slice" / f"kubepods-{tier}-pod{escaped[name]}.slice"

    assert got == {
        "default/chat": ContainerSpec(name="default/chat", card=2, qos="online", cgroup=where("chat", "besteffort"),
                                      memory_quota_bytes=10240 * MIB),
        "default/train#0": ContainerSpec(name="default/train#0", card=0, qos="offline", cgroup=where("train", "")),
        "default/train#1": ContainerSpec(name="default/train#1", card=1, qos="offline", cgroup=where("train", "")),
        "default/scavenge": ContainerSpec(name="default/scavenge", card=2, qos="offline",
                                          cgroup=where("scavenge", "burstable"), memory_quota_bytes=2048 * MIB),
        "default/tiny": ContainerSpec(name="default/tiny", card=3, qos="offline", cgroup=where("tiny", "besteffort"),
                                      memory_quota_bytes=1024 * MIB),
    }
    assert registry.get_sample_value("gpuplane_guard_pod_containers") == 5
    assert registry.get_sample_value("gpuplane_guard_pods_unreadable_total") == 0
    assert "skipped" not in caplog.text


def test_unreadable_pods_are_logged_counted_once_and_skipped(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    layout = CgroupLayout("systemd", tmp_path)
    with FakeApiServer() as server:
        server.add_pod(gpu_pod("good", share(0, 1024), qos="offline"))
        bad_json = gpu_pod("bad-json", share(0, 1024))
        bad_json["metadata"]["annotations"][ASSIGNMENT] = "{not json"
        server.add_pod(bad_json)
        server.add_pod(gpu_pod("bad-qos", share(0, 1024), qos="urgent"))
        server.add_pod(gpu_pod("misplaced", share(0, 1024), assigned_node="gpu-node-2"))
        registry = CollectorRegistry()
        source = PodContainerSource(server.api, NODE, layout, registry=registry)
        source.start()
        try:
            assert source.wait_synced(5)
            first = source.containers()
            second = source.containers()  # the same three unreadable pods: not counted again
            assert [c.name for c in first] == [c.name for c in second] == ["default/good"]
            assert registry.get_sample_value("gpuplane_guard_pods_unreadable_total") == 3
            server.mutate("pods", "default/bad-qos", lambda pod: pod["metadata"]["labels"].update({QOS_LABEL: "LS"}))
            wait_for(lambda: len(source.containers()) == 2, "the fixed pod")
            assert registry.get_sample_value("gpuplane_guard_pods_unreadable_total") == 3
        finally:
            source.stop()
    assert "default/bad-json: metadata.annotations[gpuplane.io/assignment]: not a gpuplane assignment" in caplog.text
    assert "default/bad-qos: metadata.labels[gpuplane.io/qos]: unknown QoS 'urgent'" in caplog.text
    assert "names node 'gpu-node-2', but the pod runs on 'gpu-node-1'" in caplog.text
    assert caplog.text.count("skipped, the guard cannot read it") == 3


def test_a_deleted_or_terminating_pod_drops_out_and_static_containers_stay(tmp_path: Path) -> None:
    static = ContainerSpec(name="host-agent", card=0, qos="online", pids=(os.getpid(),))
    with FakeApiServer(pod_deletion_delay_s=None) as server:
        server.add_pod(gpu_pod("a", share(0, 1024), qos="offline"))
        server.add_pod(gpu_pod("b", share(0, 1024), qos="offline"))
        source = PodContainerSource(server.api, NODE, CgroupLayout("systemd", tmp_path), static=(static,))
        source.start()
        try:
            assert source.wait_synced(5)
            assert [c.name for c in source.containers()] == ["host-agent", "default/a", "default/b"]
            server.api.delete("/api/v1/namespaces/default/pods/a")  # terminating: its grace period runs
            wait_for(lambda: [c.name for c in source.containers()] == ["host-agent", "default/b"], "a terminating")
            server.api.delete("/api/v1/namespaces/default/pods/b", {"gracePeriodSeconds": 0})  # gone at once
            wait_for(lambda: [c.name for c in source.containers()] == ["host-agent"], "b deleted")
        finally:
            source.stop()


@pytest.mark.parametrize(("phase", "deleting", "guarded"), [
    ("Running", False, True),
    ("Running", True, False),  # terminating: its processes must be free to handle SIGTERM
    ("Pending", False, False),  # bound, images pulling: the scheduler counts its cards, but nothing runs yet
    ("Unknown", False, False),  # the node lost contact with it
    ("Succeeded", False, False),
    ("Failed", False, False),
])
def test_only_running_pods_are_guarded(phase: str, deleting: bool, guarded: bool) -> None:
    pod = gpu_pod("p", share(0, 1024), uid=UID, phase=phase)
    if deleting:
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert len(pod_containers(pod, NODE, CgroupLayout())) == (1 if guarded else 0)


def test_pod_containers_of_a_pod_without_cards_or_uid() -> None:
    layout = CgroupLayout()
    assert pod_containers(gpu_pod("nothing"), NODE, layout) == ()  # no assignment at all
    # an assignment that holds no card (an RDMA-only pod, say): nothing to guard
    pod = gpu_pod("none")
    pod["metadata"]["annotations"][ASSIGNMENT] = encode_assignment(Assignment(NODE))
    assert pod_containers(pod, NODE, layout) == ()
    nameless = gpu_pod("no-uid", share(0, 1024))
    with pytest.raises(ObjectError, match=r"default/no-uid: metadata.uid: missing"):
        pod_containers(nameless, NODE, layout)


# -- the guard, fed from pods, on real processes --------------------------------------------------------


class Node:
    """A node's pods in the fake API server, their cgroups in a temp tree, a guard fed from them."""

    def __init__(self, server: FakeApiServer, root: Path, cards: int = 1, **options: Any) -> None:
        self.server = server
        self.layout = CgroupLayout("systemd", root)
        self.backend = FakeGpuBackend(cards=cards)
        self.clock = FakeClock()
        self.guard = ColocationGuard(GuardConfig(guard=GuardOptions(**options)), self.backend, clock=self.clock)
        self.source = PodContainerSource(server.api, NODE, self.layout, registry=self.guard.registry)
        self.uids = 0

    def pod(self, name: str, qos: str, *shares: CardShare, pids: tuple[int, ...] = ()) -> Path:
        """Add a running pod and write `pids` into its cgroup (BestEffort: only gpuplane resources)."""
        self.uids += 1
        uid = f"00000000-0000-4000-8000-{self.uids:012d}"
        self.server.add_pod(gpu_pod(name, *shares, qos=qos, uid=uid))
        group = self.layout.pod_dir(uid, BEST_EFFORT)
        (group / "cri-containerd-main.scope").mkdir(parents=True)
        (group / "cgroup.procs").write_text("")  # the pod slice itself holds no process
        (group / "cri-containerd-main.scope" / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
        return group

    def sync(self) -> None:
        """Push what the informer holds now to the guard."""
        self.guard.update_containers(self.source.containers())

    def at(self, now: float) -> None:
        self.clock.now = now
        self.guard.tick(now)

    def kinds(self) -> list[tuple[GuardActionKind, str]]:
        return [(a.kind, a.container) for a in self.guard.actions]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []
    with FakeApiServer() as server:
        def make(**kwargs: Any) -> Node:
            n = Node(server, tmp_path / "cgroup", **kwargs)
            n.source.start()
            assert n.source.wait_synced(5)
            made.append(n)
            return n

        yield make
        for n in made:
            n.source.stop()


def test_the_guard_fed_from_pods_stops_offline_work_and_lets_a_deleted_pod_go(procs: Procs,
                                                                               node: Callable[..., Node]) -> None:
    chat, batch = procs.online(), procs.busy()
    n = node(min_slice_s=0.5)
    n.pod("chat", "online", share(0, 8192), pids=(chat,))
    n.pod("batch", "offline", share(0, 4096), pids=(batch,))
    wait_for(lambda: len(n.source.containers()) == 2, "both pods in the cache")
    n.sync()
    n.backend.set_process(0, chat, GIB, 80.0)
    n.backend.set_process(0, batch, GIB, 99.0)
    n.at(1.0)  # online demand on card 0: the offline pod's process is stopped
    wait_state(batch, ProcessState.STOPPED)
    assert n.kinds() == [(GuardActionKind.SUSPEND, "default/batch")]
    assert n.guard.actions[0].pids == (batch,)
    # The pod is deleted while stopped: it drops out, and its process is continued so it can handle SIGTERM.
    n.server.api.delete("/api/v1/namespaces/default/pods/batch")
    wait_for(lambda: len(n.source.containers()) == 1, "the deletion")
    n.sync()
    n.at(1.25)  # online is still busy, but the container is no longer the guard's
    wait_state(batch, ProcessState.RUNNING)
    assert n.kinds()[1:] == [(GuardActionKind.RESUME, "default/batch")]
    assert n.guard.actions[1].reason == "no longer guarded (its pod is ending)"
    n.at(1.5)
    assert process_state(batch) is ProcessState.RUNNING and len(n.guard.actions) == 2
    procs.assert_online_untouched(chat)


def test_the_source_pushes_changes_to_a_running_guard(procs: Procs, node: Callable[..., Node]) -> None:
    chat, batch = procs.online(), procs.busy()
    n = node(min_slice_s=0.0)
    stop = threading.Event()
    feeder = threading.Thread(target=n.source.run, args=(n.guard, stop))
    feeder.start()
    try:
        n.backend.set_process(0, chat, GIB, 80.0)
        n.backend.set_process(0, batch, GIB, 99.0)
        n.pod("chat", "online", share(0, 8192), pids=(chat,))
        n.pod("batch", "offline", share(0, 4096), pids=(batch,))
        now = iter(range(1, 10_000))

        def stopped() -> bool:  # a pass per check: the guard takes the pushed containers at its next pass
            n.at(float(next(now)))
            return process_state(batch) is ProcessState.STOPPED

        wait_for(stopped, "the pods reaching the guard")
        n.server.api.delete("/api/v1/namespaces/default/pods/batch")

        def running() -> bool:
            n.at(float(next(now)))
            return process_state(batch) is ProcessState.RUNNING

        wait_for(running, "the deletion reaching the guard")
    finally:
        stop.set()
        n.source.stop()
        feeder.join(timeout=5)
    assert not feeder.is_alive()
    assert [k for k, _ in n.kinds()] == [GuardActionKind.SUSPEND, GuardActionKind.RESUME]


def test_a_pod_on_two_cards_runs_only_when_both_are_idle(procs: Procs, node: Callable[..., Node]) -> None:
    chat0, chat1, train = procs.online(), procs.online(), procs.busy()
    n = node(cards=2, min_slice_s=0.5)
    n.pod("chat0", "online", share(0, 8192), pids=(chat0,))
    n.pod("chat1", "online", share(1, 8192), pids=(chat1,))
    n.pod("train", "offline", share(0, 4096), share(1, 4096), pids=(train,))
    wait_for(lambda: len(n.source.containers()) == 4, "the pods")
    n.sync()
    n.backend.set_process(0, train, GIB, 50.0)
    n.backend.set_process(1, train, GIB, 50.0)
    # (now, card 0 SM %, card 1 SM %, train expected); the minimum idle slice is 0.5 s
    steps = [
        (1.0, 80.0, 80.0, ProcessState.STOPPED),  # both cards busy: both containers of train suspended
        (1.5, 80.0, 0.0, ProcessState.STOPPED),  # card 1 idle since 1.5
        (2.0, 80.0, 0.0, ProcessState.STOPPED),  # card 1 idle 0.5 s: train#1 resumes, but card 0 holds it
        (2.5, 0.0, 0.0, ProcessState.STOPPED),  # card 0 idle since 2.5
        (3.0, 0.0, 0.0, ProcessState.RUNNING),  # card 0 idle 0.5 s: both let it run
    ]
    for now, sm0, sm1, expected in steps:
        n.backend.set_process(0, chat0, GIB, sm0)
        n.backend.set_process(1, chat1, GIB, sm1)
        n.at(now)
        wait_state(train, expected)
    assert n.kinds() == [(GuardActionKind.SUSPEND, "default/train#0"), (GuardActionKind.SUSPEND, "default/train#1"),
                         (GuardActionKind.RESUME, "default/train#1"), (GuardActionKind.RESUME, "default/train#0")]
    assert "stay stopped: suspended for card 0 too" in n.guard.actions[2].reason


def test_a_restarted_container_of_a_pod_is_guarded_again(procs: Procs, node: Callable[..., Node]) -> None:
    chat, first = procs.online(), procs.busy()
    n = node(min_slice_s=0.0)
    n.pod("chat", "online", share(0, 8192), pids=(chat,))
    group = n.pod("batch", "offline", share(0, 4096), pids=(first,))
    wait_for(lambda: len(n.source.containers()) == 2, "the pods")
    n.sync()
    n.backend.set_process(0, chat, GIB, 0.0)
    n.at(1.0)
    procs.end(first)  # the container's process exits ...
    n.at(2.0)  # ... and is forgotten
    second = procs.busy()
    (group / "cri-containerd-main.scope" / "cgroup.procs").write_text(f"{second}\n")  # the kubelet restarts it
    n.backend.set_process(0, chat, GIB, 80.0)
    n.at(3.0)  # the cgroup has a process again: tracked, and stopped at once for the online demand
    wait_state(second, ProcessState.STOPPED)
    assert n.kinds() == [(GuardActionKind.FORGET, "default/batch"), (GuardActionKind.SUSPEND, "default/batch")]
    assert n.guard.actions[1].pids == (second,)


def stopped_by_a_first_guard(procs: Procs, node: Callable[..., Node], state: Path) -> tuple[int, int, Node]:
    """A guard recording to `state` that has stopped the offline pod `batch` for the online pod `chat`."""
    chat, batch = procs.online(), procs.busy()
    first = node(state_file=state)
    first.pod("chat", "online", share(0, 8192), pids=(chat,))
    first.pod("batch", "offline", share(0, 4096), pids=(batch,))
    wait_for(lambda: len(first.source.containers()) == 2, "the pods")
    first.sync()
    first.backend.set_process(0, chat, GIB, 80.0)
    first.at(1.0)
    wait_state(batch, ProcessState.STOPPED)
    return chat, batch, first


@pytest.mark.parametrize("deleted", [False, True])
def test_a_restarted_guard_takes_over_or_continues_what_it_stopped(procs: Procs, node: Callable[..., Node],
                                                                  tmp_path: Path, deleted: bool) -> None:
    state = tmp_path / "guard-state.json"
    chat, batch, first = stopped_by_a_first_guard(procs, node, state)
    if deleted:  # deleted while no guard ran: the next guard must not leave its process stopped
        first.server.api.delete("/api/v1/namespaces/default/pods/batch")
    second = node(state_file=state)  # a new guard, no containers configured: all from the pods
    wait_for(lambda: len(second.source.containers()) == (1 if deleted else 2), "the pods")
    second.sync()
    second.backend.set_process(0, chat, GIB, 80.0)
    second.at(2.0)
    if deleted:
        wait_state(batch, ProcessState.RUNNING)
        assert [(a.kind, a.container, a.pids) for a in second.guard.actions] == [
            (GuardActionKind.RESUME, "default/batch", (batch,))]
    else:  # online is still busy: it stays stopped, with no second SIGSTOP
        assert process_state(batch) is ProcessState.STOPPED and second.guard.actions == []
    procs.assert_online_untouched(chat)


def test_a_guard_with_no_containers_left_continues_what_its_predecessor_stopped(procs: Procs,
                                                                              node: Callable[..., Node],
                                                                              tmp_path: Path) -> None:
    state = tmp_path / "guard-state.json"
    _chat, batch, first = stopped_by_a_first_guard(procs, node, state)
    for name in ("chat", "batch"):  # every pod gone while no guard ran
        first.server.api.delete(f"/api/v1/namespaces/default/pods/{name}")
    second = node(state_file=state)
    wait_for(lambda: second.source.containers() == (), "the deletions")
    second.sync()  # the same (empty) list the guard started with: the recorded container is still let go
    second.at(2.0)
    wait_state(batch, ProcessState.RUNNING)
    assert [(a.kind, a.container) for a in second.guard.actions] == [(GuardActionKind.RESUME, "default/batch")]


# -- command line ---------------------------------------------------------------------------------------

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--config: give the guard's configuration"),
        (["--from-pods"], "--node-name: needed with --from-pods"),
        (["--from-pods", "--node-name", NODE, "--cgroup-driver", "docker"], "--cgroup-driver: systemd or cgroupfs"),
        (["--from-pods", "--node-name", NODE, "--refresh-s", "0"], "--refresh-s: must be above 0"),
        (["--from-pods", "--node-name", NODE, "--kubeconfig", "/nonexistent/kubeconfig"],
         "--kubeconfig /nonexistent/kubeconfig: no such file"),
    ],
)
def test_node_guard_flags_are_checked(monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    result = runner.invoke(app, ["node-guard", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_node_guard_without_containers_needs_from_pods(tmp_path: Path) -> None:
    config = tmp_path / "guard.yaml"
    config.write_text("guard: {poll_s: 0.01}\n")
    result = runner.invoke(app, ["node-guard", "--config", str(config)])
    assert result.exit_code == 2
    assert "containers: none listed" in result.output


def test_node_guard_from_pods_guards_the_nodes_pods(procs: Procs, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The command end to end: its own informer, guard loop and SIGTERM; only the GPU is a fake."""
    chat, batch = procs.online(), procs.busy()
    backend = FakeGpuBackend()
    backend.set_process(0, chat, GIB, 80.0)
    backend.set_process(0, batch, GIB, 99.0)
    monkeypatch.setattr(gpu, "NvmlBackend", lambda: backend)
    monkeypatch.setenv("NODE_NAME", NODE)
    layout = CgroupLayout("cgroupfs", tmp_path / "cgroup")
    config = tmp_path / "guard.yaml"
    config.write_text("guard: {poll_s: 0.01}\n")
    with FakeApiServer() as server:
        for name, qos, pid, uid in (("chat", "online", chat, UID), ("batch", "offline", batch, UID[::-1])):
            server.add_pod(gpu_pod(name, share(0, 4096), qos=qos, uid=uid))
            group = layout.pod_dir(uid, BEST_EFFORT)
            group.mkdir(parents=True)
            (group / "cgroup.procs").write_text(f"{pid}\n")
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        with sigterm_self_when(batch, ProcessState.STOPPED) as seen:  # once it has stopped the offline process
            result = runner.invoke(app, ["node-guard", "--config", str(config), "--from-pods", "--kubeconfig",
                                         str(kubeconfig), "--cgroup-driver", "cgroupfs", "--cgroup-root",
                                         str(tmp_path / "cgroup"), "--refresh-s", "0.5"])
    assert result.exit_code == 0, result.output
    assert seen == [ProcessState.STOPPED]
    # It had stopped the offline pod's process (the watcher saw it) and, with no state file for a successor,
    # continued it on the way out.
    wait_state(batch, ProcessState.RUNNING)
    procs.assert_online_untouched(chat)
