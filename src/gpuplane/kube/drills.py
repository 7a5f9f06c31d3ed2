"""Fault drills against the local API server: kill a component mid-operation, hurt the API, restart on a stale cache.

Each drill starts an in-process `FaultyApiServer` (the local API server, `gpuplane.kube.localapi`, plus injected
latency and a random share of 500/429 answers), runs gpuplane's components as real child processes against it
(`python -m gpuplane.cli.main scheduler|extender|operator|node-reporter --kubeconfig …`), does harm while they
work (SIGKILL, injected failures, a compacted store and dropped watches), restarts what it killed, and then
checks that nothing was lost (`nothing_lost`), reading the API server's objects only:

- no card double-booked: over the pods' `gpuplane.io/assignment` annotations (live pods only), a card held whole
  has one holder, and the shares on a card add up to at most 1000 milli and its memory (unless oversubscribed);
  every bound pod's assignment names the node it is bound to; no card index beyond the node's inventory;
- no node lent twice: at most one tidal-loan taint per node, and the loan label exactly where the taint is;
- no process left stopped: every component started is running, and each Lease is held by one of the running
  replicas of its group (the others stand by);
- and what the drill itself expects (every pod bound, every Xid reported, a node quarantined, a drain finished with
  every pod evicted once and the lifecycle steps in order).

`DRILLS` maps each drill's name to its function; `run_drills` runs some or all and returns their results, each
of which lists what was done and what was checked. Every drill takes seconds.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuplane.controllers.health import HEALTH_LABEL
from gpuplane.controllers.lifecycle import LIFECYCLE_HISTORY
from gpuplane.controllers.tidal import LOAN_LABEL, LOAN_TAINT
from gpuplane.kube.api import JsonObject
from gpuplane.kube.localapi import FakeApiServer, HttpAnswer, node_json, pod_json
from gpuplane.kube.objects import ASSIGNMENT, SCHEDULER_NAME, ObjectError, decode_assignment
from gpuplane.kube.operator import REPAIR_ANNOTATION
from gpuplane.kube.scheduler_mode import DEFAULT_LEASE_NAME, DEFAULT_LEASE_NAMESPACE

__all__ = [
    "DRAIN_ROUND", "DRILLS", "Check", "Component", "DrillResult", "FaultyApiServer", "Workspace", "double_booking",
    "lifecycle_problems", "nothing_lost", "run_drills",
]

CARD_MILLI = 1000
CARD_MIB = 40960
"""A100-40GB, the model `node_json` gives every drill node."""
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
OPERATOR_LEASE = "gpuplane-system/gpuplane-operator"
SCHEDULER_LEASE = f"{DEFAULT_LEASE_NAMESPACE}/{DEFAULT_LEASE_NAME}"
WAIT_S = 30.0
"""The longest any drill waits for one thing (a deadline, not an expected figure)."""


# -- the API server with faults --------------------------------------------------------------------------------


class FaultyApiServer(FakeApiServer):
    """The local API server with harm on demand: `latency_s` before every request that is not a watch, `slow`
    seconds more before those whose `(method, path regex)` matches, and `error_rate` of them (chosen by a seeded
    draw) answered `error_status` (500 or 429). `fail_next` (inherited) injects failures on chosen paths;
    `compact` and `drop_watches` make every watcher relist."""

    def __init__(self, *, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.latency_s = 0.0
        self.slow: dict[tuple[str, str], float] = {}
        """Extra delay by `(method, path regex)`: e.g. `{("POST", r"/eviction$"): 0.25}` slows evictions only."""
        self.error_rate = 0.0
        self.error_status = 500
        self.harmed = 0
        """Requests answered with an injected random error so far."""
        self._draw = random.Random(seed)
        self._draw_lock = threading.Lock()

    def record(self, method: str, path: str, body: Any, *, watch: bool = False) -> None:
        if not watch and self.latency_s > 0:
            time.sleep(self.latency_s)
        if not watch:
            for (verb, pattern), delay_s in list(self.slow.items()):
                if verb == method and re.search(pattern, path):
                    time.sleep(delay_s)
        if not watch and self.error_rate > 0:
            with self._draw_lock:
                hit = self._draw.random() < self.error_rate
                if hit:
                    self.harmed += 1
            if hit:
                super().record(method, path, body, watch=watch)  # counted like any request
                reason = "TooManyRequests" if self.error_status == 429 else "InternalError"
                raise HttpAnswer(self.error_status, reason, f"drill: injected {self.error_status} for {method} {path}")
        super().record(method, path, body, watch=watch)


# -- components as processes ------------------------------------------------------------------------------------


class Component:
    """One gpuplane command run as a child process (`python -m gpuplane.cli.main ARGS`), its output in a log file.
    `lease` is the `namespace/name` of the Lease its replicas elect on (None: no election)."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, *, lease: str | None = None) -> None:
        self.name = name
        self.args = list(args)
        self.lease = lease
        self.log_path = log_dir / f"{name}.log"
        self.log_path.write_bytes(b"")
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> Component:
        self.starts += 1
        log = self.log_path.open("ab")
        log.write(f"--- start {self.starts}\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpuplane.cli.main", *self.args], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        log.close()
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no Lease release, no flush."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=WAIT_S)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self, start: int | None = None) -> str:
        """The log of start `start` (default: the latest)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        parts = re.split(r"^--- start \d+\n", text, flags=re.M)
        index = self.starts if start is None else start
        return parts[index] if 0 <= index < len(parts) else ""

    def wait_log(self, pattern: str, timeout_s: float = WAIT_S) -> re.Match[str] | None:
        """The first match of `pattern` in the latest start's log, waiting for it."""
        found: list[re.Match[str]] = []

        def seen() -> bool:
            match = re.search(pattern, self.log())
            if match is not None:
                found.append(match)
            return match is not None or not self.running

        wait_until(seen, timeout_s)
        return found[0] if found else None


def wait_until(done: Callable[[], bool], timeout_s: float = WAIT_S, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(step_s)
    return True


# -- the checks ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class DrillResult:
    name: str
    did: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def text(self) -> str:
        lines = [f"drill {self.name}: {'PASS' if self.ok else 'FAIL'} ({self.seconds:.1f} s)"]
        lines += [f"  did: {step}" for step in self.did]
        lines += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)

    def json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "seconds": round(self.seconds, 2), "did": self.did,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks]}


def _live_pods(server: FakeApiServer) -> list[JsonObject]:
    pods = [server.get("pods", key) for key in server.keys("pods")]
    return [p for p in pods if p is not None and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
            and not p.get("metadata", {}).get("deletionTimestamp")]


def _node_cards(server: FakeApiServer) -> dict[str, int]:
    cards = {}
    for key in server.keys("nodes"):
        obj = server.get("nodes", key) or {}
        raw = obj.get("metadata", {}).get("annotations", {}).get("gpuplane.io/gpu-inventory")
        cards[key] = len(json.loads(raw).get("cards", [])) if raw else 0
    return cards


def double_booking(server: FakeApiServer) -> list[str]:
    """Every way the live pods' assignments overbook a card, or disagree with where the pod is bound."""
    problems: list[str] = []
    whole: dict[tuple[str, int], list[str]] = defaultdict(list)
    shares: dict[tuple[str, int], list[tuple[str, int, int, bool]]] = defaultdict(list)
    cards = _node_cards(server)
    for pod in _live_pods(server):
        meta = pod.get("metadata", {})
        key = f"{meta.get('namespace', 'default')}/{meta.get('name')}"
        raw = meta.get("annotations", {}).get(ASSIGNMENT)
        if raw is None:
            continue
        try:
            assignment = decode_assignment(raw, key)
        except ObjectError as exc:
            problems.append(f"{key}: unreadable assignment ({exc})")
            continue
        bound = pod.get("spec", {}).get("nodeName")
        if bound and bound != assignment.node:
            problems.append(f"{key}: bound to {bound} but its assignment names {assignment.node}")
        for share in assignment.cards:
            slot = (assignment.node, share.card)
            if share.card >= cards.get(assignment.node, 0):
                has = cards.get(assignment.node, 0)
                problems.append(f"{key}: card {share.card} of {assignment.node}, which has {has}")
            if share.whole:
                whole[slot].append(key)
            shares[slot].append((key, share.compute_milli, share.memory_mib, assignment.oversubscribed))
    for slot, holders in sorted(whole.items()):
        others = [k for k, *_ in shares[slot] if k not in holders]
        if len(holders) > 1 or others:
            problems.append(f"{slot[0]} card {slot[1]}: held whole by {', '.join(holders)}"
                            + (f" and shared by {', '.join(others)}" if others else ""))
    for slot, held in sorted(shares.items()):
        if slot in whole:
            continue
        milli = sum(m for _, m, _, _ in held)
        mib = sum(b for _, _, b, over in held if not over)
        if milli > CARD_MILLI or mib > CARD_MIB:
            problems.append(f"{slot[0]} card {slot[1]}: {milli} milli / {mib} MiB by {', '.join(k for k, *_ in held)}")
    return problems


def _held_cards(server: FakeApiServer) -> int:
    held = set()
    for pod in _live_pods(server):
        raw = pod.get("metadata", {}).get("annotations", {}).get(ASSIGNMENT)
        if raw is not None:
            doc = json.loads(raw)
            held |= {(doc["node"], c["card"]) for c in doc.get("cards", [])}
    return len(held)


def lent_twice(server: FakeApiServer) -> list[str]:
    problems = []
    for key in server.keys("nodes"):
        obj = server.get("nodes", key) or {}
        taints = [t for t in obj.get("spec", {}).get("taints", []) or []
                  if t.get("key") == LOAN_TAINT.key and t.get("value") == LOAN_TAINT.value]
        labelled = LOAN_LABEL in (obj.get("metadata", {}).get("labels") or {})
        if len(taints) > 1:
            problems.append(f"{key}: {len(taints)} loan taints")
        if labelled != bool(taints):
            problems.append(f"{key}: loan label {'without' if labelled else 'missing beside'} the loan taint")
    return problems


def lease_holder(server: FakeApiServer, lease: str) -> str | None:
    obj = server.get("leases", lease)
    return None if obj is None else obj.get("spec", {}).get("holderIdentity")


def nothing_lost(server: FakeApiServer, components: Sequence[Component]) -> list[Check]:
    """The three checks every drill ends with (see the module's docstring)."""
    booked = double_booking(server)
    pods = _live_pods(server)
    with_cards = sum(1 for p in pods if ASSIGNMENT in p.get("metadata", {}).get("annotations", {}))
    checks = [Check("no card double-booked", not booked, "; ".join(booked) or
                    f"{with_cards} pods hold {_held_cards(server)} cards; none beyond a card's capacity, "
                    "every assignment on its pod's node")]
    lent = lent_twice(server)
    checks.append(Check("no node lent twice", not lent, "; ".join(lent) or
                        f"{len(server.keys('nodes'))} nodes, each with at most one loan taint, label beside it"))
    stopped = [c.name for c in components if not c.running]
    groups: dict[str, list[Component]] = defaultdict(list)
    for c in components:
        if c.lease is not None:
            groups[c.lease].append(c)
    roles = []
    for lease, members in sorted(groups.items()):
        holder = lease_holder(server, lease)
        if holder not in {c.name for c in members if c.running}:
            stopped.append(f"{lease} held by {holder!r}, not a running replica")
        roles += [f"{c.name} {'leading' if c.name == holder else 'standing by'}" for c in members]
    roles += [f"{c.name} running" for c in components if c.lease is None and c.running]
    checks.append(Check("no process left stopped", not stopped,
                        "; ".join(stopped) if stopped else ", ".join(roles)))
    return checks


# -- the workspace a drill runs in ----------------------------------------------------------------------------


class Workspace:
    """One drill's API server, kubeconfig, log folder and components (all stopped at the end)."""

    def __init__(self, server: FaultyApiServer, folder: Path) -> None:
        self.server = server
        self.folder = folder
        self.kubeconfig = server.write_kubeconfig(folder / "kubeconfig")
        self.components: list[Component] = []

    def component(self, name: str, args: Sequence[str], *, lease: str | None = None) -> Component:
        c = Component(name, [*args, "--kubeconfig", str(self.kubeconfig)], self.folder, lease=lease)
        self.components.append(c)
        return c

    def scheduler(self, name: str, *, elect: bool = True) -> Component:
        args = ["scheduler", "--scheduler-name", SCHEDULER_NAME, "--identity", name]
        args += ["--lease-duration", "2", "--renew-deadline", "1.5", "--retry-period", "0.2"] if elect else \
            ["--no-leader-elect"]
        return self.component(name, args, lease=SCHEDULER_LEASE if elect else None)

    def operator(self, name: str) -> Component:
        return self.component(name, ["operator", "--identity", name, "--lease-duration", "2", "--renew-deadline",
                                     "1.5", "--retry-period", "0.2"], lease=OPERATOR_LEASE)

    def nodes(self, count: int, cards: int) -> list[str]:
        names = [f"n{i}" for i in range(count)]
        for name in names:
            self.server.add_node(node_json(name, cards=cards))
        return names

    def pods(self, names: Sequence[str], cards: int = 1) -> None:
        for name in names:
            self.server.add_pod(pod_json(name, limits={"gpuplane.io/gpu": str(cards)}))

    def bound(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if ((self.server.get("pods", f"default/{n}") or {}).get("spec", {}).get("nodeName"))]

    def leader(self, lease: str, among: Sequence[Component]) -> Component | None:
        holder = lease_holder(self.server, lease)
        return next((c for c in among if c.name == holder and c.running), None)

    def close(self) -> None:
        for c in self.components:
            c.stop()


@contextmanager
def workspace(folder: Path | None = None, *, seed: int = 0) -> Iterator[Workspace]:
    with tempfile.TemporaryDirectory(prefix="gpuplane-drill-") as scratch:
        where = folder if folder is not None else Path(scratch)
        where.mkdir(parents=True, exist_ok=True)
        server = FaultyApiServer(seed=seed)
        server.start()
        space = Workspace(server, where)
        try:
            yield space
        finally:
            space.close()
            server.stop()


def _expect(result: DrillResult, name: str, ok: bool, detail: str) -> bool:
    result.checks.append(Check(name, ok, detail))
    return ok


def _all_bound(space: Workspace, result: DrillResult, names: Sequence[str]) -> None:
    wait_until(lambda: len(space.bound(names)) == len(names))
    got = space.bound(names)
    _expect(result, "no pod lost", len(got) == len(names), f"{len(got)} of {len(names)} pods bound")


# -- the drills -------------------------------------------------------------------------------------------------


def _kill_scheduler(space: Workspace, result: DrillResult) -> None:
    """SIGKILL the leading scheduler replica while pods arrive; the standby takes the Lease and binds the rest."""
    space.nodes(2, 8)
    replicas = [space.scheduler("sched-a").start(), space.scheduler("sched-b").start()]
    wait_until(lambda: space.leader(SCHEDULER_LEASE, replicas) is not None)
    leader = space.leader(SCHEDULER_LEASE, replicas)
    holder = lease_holder(space.server, SCHEDULER_LEASE)
    if not _expect(result, "a leader elected", leader is not None, f"lease holder {holder!r}"):
        return
    assert leader is not None
    names = [f"p{i}" for i in range(12)]
    feeder = threading.Thread(target=_trickle, args=(space, names, 0.1), daemon=True)
    feeder.start()
    wait_until(lambda: len(space.bound(names)) >= 3, step_s=0.01)
    done = len(space.bound(names))
    leader.kill()
    result.did.append(f"started 2 scheduler replicas on 2 nodes × 8 cards; {leader.name} led")
    result.did.append(f"created 12 one-card pods, one every 0.1 s; SIGKILLed {leader.name} with {done} of them bound")
    feeder.join()
    _all_bound(space, result, names)
    standby = next(c for c in replicas if c is not leader)
    _expect(result, "the standby took the lease", lease_holder(space.server, SCHEDULER_LEASE) == standby.name,
            f"holder {lease_holder(space.server, SCHEDULER_LEASE)!r}")
    leader.start()
    result.did.append(f"restarted {leader.name}")
    wait_until(lambda: "gpuplane scheduler" in leader.log(), 15)


def _trickle(space: Workspace, names: Sequence[str], gap_s: float) -> None:
    for name in names:
        space.pods([name])
        time.sleep(gap_s)


def _kill_extender(space: Workspace, result: DrillResult) -> None:
    """SIGKILL the extender between a pod's filter and its bind; kube-scheduler's retry lands it once."""
    nodes = space.nodes(2, 4)
    names = [f"p{i}" for i in range(6)]
    space.pods(names)
    extender = space.component("extender", ["extender", "--port", "0", "--observe", "always"]).start()

    def url() -> str | None:
        found = extender.wait_log(r"extender on (http://\S+)")
        return None if found is None else found.group(1)

    base = url()
    if not _expect(result, "the extender serves", base is not None, f"at {base}"):
        return
    assert base is not None
    result.did.append("played kube-scheduler: filter then bind for 6 one-card pods on 2 nodes × 4 cards")
    retries = 0
    killed = False
    for i, name in enumerate(names):
        for _attempt in range(100):
            try:
                pod = space.server.get("pods", f"default/{name}") or {}
                code, answer = _post(base, "filter", {"Pod": pod, "NodeNames": nodes})
                chosen = (answer.get("NodeNames") or []) if code == 200 else []
                if not chosen:
                    time.sleep(0.1)
                    continue
                if i == 3 and not killed:
                    extender.kill()
                    killed = True
                    result.did.append(f"SIGKILLed the extender between filter and bind of {name}, "
                                      f"{len(space.bound(names))} of 6 pods bound (kube-scheduler retries the pod)")
                code, bound = _post(base, "bind", {"PodName": name, "PodNamespace": "default",
                                                   "PodUID": pod["metadata"]["uid"], "Node": chosen[0]})
                if code == 200 and not bound.get("Error"):
                    break
            except (OSError, ValueError):
                retries += 1
                if not extender.running:
                    extender.start()
                    result.did.append("restarted the extender (a new port)")
                    base = url() or base
                time.sleep(0.1)
    result.did.append(f"{retries} call(s) failed while the extender was down")
    _all_bound(space, result, names)


def _post(base: str, verb: str, doc: Mapping[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(f"{base}/{verb}", data=json.dumps(doc).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


OUT_OF_SERVICE = ("quarantined", "repairing")
"""A quarantined node's health labels while the operator holds it: the lifecycle drains it, then asks for its
repair"""


def _health(space: Workspace, node: str) -> str | None:
    obj = space.server.get("nodes", node) or {}
    labels: dict[str, str] = obj.get("metadata", {}).get("labels") or {}
    return labels.get(HEALTH_LABEL)


def _reports(space: Workspace, node: str) -> int:
    count = 0
    for key in space.server.keys("events"):
        obj = space.server.get("events", key) or {}
        if (obj.get("involvedObject") or obj.get("regarding") or {}).get("name") == node:
            count += 1
    return count


def _kill_operator(space: Workspace, result: DrillResult) -> None:
    """SIGKILL the leading operator, then an Xid 79 on a node; the standby leads and quarantines the node."""
    space.nodes(2, 8)
    started = _operators_and_agent(space, result)
    if started is None:
        return
    _, kern, leader = started
    leader.kill()
    with kern.open("a") as log:
        log.write(XID_79 + "\n")
    result.did.append(f"started 2 operator replicas and n1's node agent; SIGKILLed the leader {leader.name}, "
                      "then n1's kernel log got an Xid 79")
    written = time.monotonic()
    wait_until(lambda: _reports(space, "n1") >= 1)
    reported = time.monotonic() - written
    # quarantined, then (no pods on it: drained at once) repairing, waiting for a person to answer the repair
    wait_until(lambda: _health(space, "n1") in OUT_OF_SERVICE)
    acted = time.monotonic() - written
    _expect(result, "the Xid acted on by the new leader", _health(space, "n1") in OUT_OF_SERVICE,
            f"n1 {HEALTH_LABEL}={_health(space, 'n1')!r}, {_reports(space, 'n1')} report(s) posted "
            f"{reported:.1f} s after the line, acted on {acted:.1f} s after it; "
            f"lease holder {lease_holder(space.server, OPERATOR_LEASE)!r}")
    _expect(result, "n0 left alone", _health(space, "n0") is None, f"n0 {HEALTH_LABEL}={_health(space, 'n0')!r}")
    leader.start()
    result.did.append(f"restarted {leader.name}")
    time.sleep(2.0)  # up, and trying the Lease as a standby (a standby logs nothing)


def _operators_and_agent(space: Workspace, result: DrillResult) -> tuple[list[Component], Path, Component] | None:
    """2 operator replicas and n1's node agent following `kern-n1.log`, started; once a leader is elected (checked)
    and the agent sits at the log's end: the replicas, the log and the leader (None: no leader)."""
    replicas = [space.operator("op-a").start(), space.operator("op-b").start()]
    kern = space.folder / "kern-n1.log"
    kern.write_text("")
    space.component("agent-n1", ["node-reporter", "--node-name", "n1", "--follow", str(kern),
                                 "--state-file", str(space.folder / "agent-n1.json")]).start()
    wait_until(lambda: space.leader(OPERATOR_LEASE, replicas) is not None)
    leader = space.leader(OPERATOR_LEASE, replicas)
    holder = lease_holder(space.server, OPERATOR_LEASE)
    if not _expect(result, "a leader elected", leader is not None, f"lease holder {holder!r}"):
        return None
    assert leader is not None
    time.sleep(1.0)  # the agent has opened the log and sits at its end
    return replicas, kern, leader


DRAIN_ROUND: dict[str, frozenset[str]] = {
    "": frozenset({"cordoned"}),
    "cordoned": frozenset({"draining", "drain-blocked", "drained"}),
    "draining": frozenset({"draining", "drain-blocked", "drained"}),
    "drain-blocked": frozenset({"draining", "drain-blocked", "drained"}),
    "drained": frozenset({"repairing"}),
    "repairing": frozenset(),
}
"""A quarantined node's lifecycle steps, each with the steps that may follow it ("": none written yet), up to the
repair nobody answers in a drill. A drain step may follow itself with another detail (another pass that evicted
or found pods still terminating); no step may follow itself with the same detail."""


def lifecycle_problems(history: Sequence[Mapping[str, Any]], last: str = "repairing") -> list[str]:
    """Every way a node's `gpuplane.io/lifecycle-history` departs from `DRAIN_ROUND`: a step repeated with the same
    detail, one that may not follow the one before it (a step skipped or out of order), or a round not ending at
    `last`."""
    problems: list[str] = []
    before: Mapping[str, Any] = {"step": "", "detail": ""}
    for i, record in enumerate(history):
        step, detail = str(record.get("step", "")), str(record.get("detail", ""))
        if step == before["step"] and detail == before["detail"]:
            problems.append(f"step {i} {step!r} ({detail}) repeated")
        elif step not in DRAIN_ROUND.get(str(before["step"]), frozenset()):
            problems.append(f"step {i} {step!r} after {before['step'] or 'nothing'!r}")
        before = record
    if before["step"] != last:
        problems.append(f"ends at {before['step'] or 'nothing'!r}, not {last!r}")
    return problems


def _steps(space: Workspace, node: str) -> list[dict[str, Any]]:
    obj = space.server.get("nodes", node) or {}
    raw = (obj.get("metadata", {}).get("annotations") or {}).get(LIFECYCLE_HISTORY, "[]")
    history = json.loads(raw)
    return history if isinstance(history, list) else []


def _round(history: Sequence[Mapping[str, Any]]) -> str:
    """`cordoned → drain-blocked → draining ×3 → drained`: the steps, runs of one step counted."""
    runs: list[list[Any]] = []
    for record in history:
        if runs and runs[-1][0] == record.get("step"):
            runs[-1][1] += 1
        else:
            runs.append([record.get("step"), 1])
    return " → ".join(f"{step} ×{n}" if n > 1 else str(step) for step, n in runs) or "nothing"


def _repair_asked(space: Workspace, node: str) -> str | None:
    obj = space.server.get("nodes", node) or {}
    answer: str | None = (obj.get("metadata", {}).get("annotations") or {}).get(REPAIR_ANNOTATION)
    return answer


def _placed(space: Workspace, name: str, node: str, card: int) -> None:
    """A running one-card pod bound on `node`, holding `card` whole."""
    doc = {"node": node, "cards": [{"card": card, "milli": CARD_MILLI, "mib": CARD_MIB, "whole": True}]}
    space.server.add_pod(pod_json(name, limits={"gpuplane.io/gpu": "1"}, node=node, phase="Running",
                                  annotations={ASSIGNMENT: json.dumps(doc)}))


def _evictions(space: Workspace, names: Sequence[str]) -> dict[str, int]:
    """Eviction POSTs the API server received per pod (refused ones included)."""
    return {n: len(space.server.requests_to(rf"/pods/{n}/eviction$", "POST")) for n in names}


DRAIN_GUARDED = "p2"
DRAIN_REFUSALS = 4
"""How many evictions of the guarded pod its disruption budget refuses before it lets one through."""


def _kill_operator_drain(space: Workspace, result: DrillResult) -> None:
    """SIGKILL the leading operator in the middle of a node's drain (some pods evicted, one guarded by a budget);
    the standby finishes the drain from the node's lifecycle record and its pods."""
    space.nodes(2, 8)
    on_n1 = [f"p{i}" for i in range(5)]
    on_n0 = ["q0", "q1"]
    for card, name in enumerate(on_n1):
        _placed(space, name, "n1", card)
    for card, name in enumerate(on_n0):
        _placed(space, name, "n0", card)
    space.server.pod_deletion_delay_s = 3.0  # the kubelet takes 3 s to stop an evicted pod
    space.server.block_eviction(f"default/{DRAIN_GUARDED}", times=DRAIN_REFUSALS)
    space.server.slow[("POST", r"/eviction$")] = 0.25  # so the leader can be caught between two evictions
    started = _operators_and_agent(space, result)
    if started is None:
        return
    replicas, kern, leader = started
    standby = next(c for c in replicas if c is not leader)
    with kern.open("a") as log:
        log.write(XID_79 + "\n")
    result.did.append(f"5 running one-card pods on n1 ({DRAIN_GUARDED}'s budget refuses {DRAIN_REFUSALS} evictions, "
                      "then lets one through; an evicted pod takes 3 s to stop; each eviction answered after 0.25 s), "
                      "2 on n0; 2 operator replicas and n1's node agent; n1's kernel log got an Xid 79")
    wait_until(lambda: sum(_evictions(space, on_n1).values()) >= 2, step_s=0.01)
    leader.kill()
    time.sleep(0.3)  # an eviction already on the wire lands
    sent = _evictions(space, on_n1)
    evicted = [n for n in on_n1 if ((space.server.get("pods", f"default/{n}") or {"metadata": {
        "deletionTimestamp": "gone"}}).get("metadata") or {}).get("deletionTimestamp")]
    refused = [n for n in on_n1 if sent[n] and n not in evicted]
    left = [n for n in on_n1 if not sent[n]]
    at_kill = _steps(space, "n1")
    result.did.append(f"SIGKILLed the leader {leader.name} in the middle of n1's drain: eviction POSTs so far "
                      f"{', '.join(f'{n} {c}' for n, c in sent.items())}; n1's lifecycle record then "
                      f"{_round(at_kill)}")
    _expect(result, "killed in the middle of the drain", bool(evicted) and bool(left),
            f"{', '.join(evicted) or 'none'} evicted, {', '.join(refused) or 'none'} refused by the budget, "
            f"{', '.join(left) or 'none'} not asked yet")
    # the repairing label comes first in the pass, then the repair request, then the step
    wait_until(lambda: _health(space, "n1") == "repairing" and _repair_asked(space, "n1") == "requested"
               and [r.get("step") for r in _steps(space, "n1")][-1:] == ["repairing"])
    took = lease_holder(space.server, OPERATOR_LEASE)
    _expect(result, "the standby took the lease", took == standby.name, f"holder {took!r}")
    sent = _evictions(space, on_n1)
    expected = {n: 1 + (DRAIN_REFUSALS if n == DRAIN_GUARDED else 0) for n in on_n1}
    gone = [n for n in on_n1 if space.server.get("pods", f"default/{n}") is None]
    kept = [n for n in on_n0 if ((space.server.get("pods", f"default/{n}") or {}).get("status") or {}).get(
        "phase") == "Running"]
    touched = {n: c for n, c in _evictions(space, on_n0).items() if c}
    _expect(result, "every pod of n1 evicted once, none lost",
            sent == expected and len(gone) == len(on_n1) and kept == on_n0 and not touched,
            f"eviction POSTs {', '.join(f'{n} {c}' for n, c in sent.items())} ({DRAIN_GUARDED}: {DRAIN_REFUSALS} "
            f"refused by its budget, then 1); {len(gone)} of {len(on_n1)} of n1's pods gone; "
            f"{len(kept)} of {len(on_n0)} of n0's running, eviction POSTs for them {touched or 'none'}")
    n1 = space.server.get("nodes", "n1") or {}
    asked = _repair_asked(space, "n1")
    _expect(result, "n1 drained to repairing", _health(space, "n1") == "repairing" and asked == "requested"
            and bool(n1.get("spec", {}).get("unschedulable")),
            f"n1 {HEALTH_LABEL}={_health(space, 'n1')!r}, {REPAIR_ANNOTATION}={asked!r}, "
            f"unschedulable={n1.get('spec', {}).get('unschedulable')!r}")
    history = _steps(space, "n1")
    problems = lifecycle_problems(history)
    _expect(result, "n1's lifecycle in order, no step repeated or skipped", not problems,
            "; ".join(problems) + f" (record: {_round(history)})" if problems else
            f"{_round(history)}: {len(history) - len(at_kill)} step(s) written after the leader change")
    leader.start()
    result.did.append(f"restarted {leader.name}")
    time.sleep(2.0)  # up, and trying the Lease as a standby


def _kill_node_agent(space: Workspace, result: DrillResult) -> None:
    """SIGKILL a node agent; an Xid logged while it is down is reported after its restart, and each Xid once."""
    space.nodes(1, 8)
    kern = space.folder / "kern-n0.log"
    kern.write_text("")
    state = space.folder / "agent-n0.json"
    # --from-start: the first start reads the log from its start (it may come up after the first Xid); a restart
    # resumes where --state-file says
    args = ["node-reporter", "--node-name", "n0", "--follow", str(kern), "--state-file", str(state), "--from-start"]
    agent = space.component("agent-n0", args).start()
    time.sleep(1.0)
    with kern.open("a") as log:
        log.write(XID_79 + "\n")
    wait_until(lambda: _reports(space, "n0") >= 1)
    wait_until(lambda: _saved_offset(state) == kern.stat().st_size)  # posted, and its position saved
    before = _reports(space, "n0")
    agent.kill()
    with kern.open("a") as log:
        log.write(XID_79.replace("3b:00", "5e:00") + "\n")
    result.did.append(f"n0's node agent followed its kernel log; an Xid 79 → {before} report(s); SIGKILLed the "
                      "agent; a second Xid 79 (another card) written while it was down")
    agent.start()
    result.did.append("restarted the agent (it resumes the log where its --state-file says)")
    wait_until(lambda: _reports(space, "n0") >= before + 1)
    wait_until(lambda: _saved_offset(state) == kern.stat().st_size)
    time.sleep(1.0)  # a re-read of the first Xid would be posted by now
    posted: dict[str, int] = {}
    for key in space.server.keys("events"):
        text = json.dumps(space.server.get("events", key) or {})
        for bus in ("3b:00", "5e:00"):
            posted[bus] = posted.get(bus, 0) + (bus in text)
    _expect(result, "each Xid reported exactly once", posted == {"3b:00": 1, "5e:00": 1},
            f"{_reports(space, 'n0')} report(s) on n0 for 2 Xids; reports per card: {posted}")


def _saved_offset(state: Path) -> int | None:
    """How far the node agent's --state-file says its one followed log is read (None: nothing saved yet)."""
    try:
        files = json.loads(state.read_text()).get("files") or {}
    except (OSError, ValueError):
        return None
    return next((int(entry["offset"]) for entry in files.values()), None)


def _api_errors(space: Workspace, result: DrillResult, status: int) -> None:
    space.nodes(2, 8)
    replicas = [space.scheduler("sched-a").start(), space.scheduler("sched-b").start()]
    wait_until(lambda: space.leader(SCHEDULER_LEASE, replicas) is not None)
    names = [f"p{i}" for i in range(10)]
    space.server.fail_next("POST", r"/binding$", status, "drill", times=3)
    space.server.fail_next("PATCH", r"/pods/p\d+$", status, "drill", times=3)
    space.server.error_status = status
    space.server.error_rate = 0.15
    space.pods(names)
    result.did.append(f"2 scheduler replicas; 10 one-card pods; the first 3 bindings and 3 pod patches answered "
                      f"{status}, and 15 % of every other request at random")
    wait_until(lambda: len(space.bound(names)) == len(names))
    time.sleep(2.0)  # a lease duration more of random harm: renewals fail too
    space.server.error_rate = 0.0
    result.did.append(f"{space.server.harmed} requests answered {status} at random over the run; then the API healed")
    _all_bound(space, result, names)
    binds = len(space.server.requests_to(r"/binding$", "POST"))
    _expect(result, "the injected failures were met", binds >= len(names) + 3,
            f"{binds} binding POSTs for {len(names)} pods (3 refused by injection, the rest by chance)")
    wait_until(lambda: space.leader(SCHEDULER_LEASE, replicas) is not None, 10)


def _api_500(space: Workspace, result: DrillResult) -> None:
    """Bindings, pod patches and 15 % of all requests answered 500; every pod still bound once."""
    _api_errors(space, result, 500)


def _api_429(space: Workspace, result: DrillResult) -> None:
    """Bindings, pod patches and 15 % of all requests answered 429; every pod still bound once."""
    _api_errors(space, result, 429)


def _api_latency(space: Workspace, result: DrillResult) -> None:
    """Every API request delayed 0.2 s; pods bound, one leader kept throughout."""
    space.nodes(2, 8)
    space.server.latency_s = 0.2
    replicas = [space.scheduler("sched-a").start(), space.scheduler("sched-b").start()]
    names = [f"p{i}" for i in range(8)]
    space.pods(names)
    result.did.append("every request delayed 0.2 s (leases of 2 s, renewed within 1.5 s); 2 replicas; 8 pods")
    _all_bound(space, result, names)
    holders = set()
    for _ in range(10):
        holders.add(lease_holder(space.server, SCHEDULER_LEASE))
        time.sleep(0.1)
    _expect(result, "one leader throughout the sample", len(holders) == 1, f"holders seen {sorted(map(str, holders))}")
    space.server.latency_s = 0.0
    del replicas


def _foreign(space: Workspace, name: str, card: int) -> None:
    """A pod another writer placed on n0's `card` (bound, its assignment written), behind the scheduler's back."""
    doc = {"node": "n0", "cards": [{"card": card, "milli": CARD_MILLI, "mib": CARD_MIB, "whole": True}]}
    pod = pod_json(name, limits={"gpuplane.io/gpu": "1"}, node="n0", phase="Running",
                   annotations={ASSIGNMENT: json.dumps(doc)})
    pod["spec"]["schedulerName"] = "someone-else"
    space.server.add_pod(pod)


def _stale_cache(space: Workspace, result: DrillResult) -> None:
    """Restart the scheduler after others took cards behind its back, drop its watches, compact: no card promised
    twice."""
    space.nodes(1, 8)
    scheduler = space.scheduler("sched-a").start()
    first = [f"p{i}" for i in range(3)]
    space.pods(first)
    wait_until(lambda: len(space.bound(first)) == len(first))
    _expect(result, "the first pods bound", len(space.bound(first)) == 3, f"{len(space.bound(first))} of 3")
    scheduler.kill()
    taken = {int(json.loads((space.server.get("pods", f"default/{n}") or {})["metadata"]["annotations"][ASSIGNMENT])
                            ["cards"][0]["card"]) for n in first if space.bound([n])}
    free = [c for c in range(8) if c not in taken]
    for i, card in enumerate(free[:2]):
        _foreign(space, f"foreign{i}", card)
    space.server.compact()
    result.did.append(f"scheduler bound 3 pods on 1 node × 8 cards, SIGKILLed; while it was down another writer "
                      f"took cards {free[:2]} and the store's history was compacted")
    scheduler.start()
    scheduler.wait_log(r"gpuplane scheduler", 15)
    time.sleep(1.0)
    space.server.drop_watches()
    _foreign(space, "foreign2", free[2])
    space.server.compact()
    later = [f"q{i}" for i in range(2)]
    space.pods(later)
    result.did.append(f"restarted it; dropped every watch, another writer took card {free[2]}, the history was "
                      "compacted (its watches must relist), and 2 more pods came: 8 of 8 cards then asked for")
    _all_bound(space, result, later)
    space.pods(["r0"])
    time.sleep(2.0)
    _expect(result, "no ninth card promised", not space.bound(["r0"]),
            f"1 more pod with 8 of 8 cards held: {'bound' if space.bound(['r0']) else 'left pending'}")


DRILLS: dict[str, Callable[[Workspace, DrillResult], None]] = {
    "kill-scheduler": _kill_scheduler,
    "kill-extender": _kill_extender,
    "kill-operator": _kill_operator,
    "kill-operator-drain": _kill_operator_drain,
    "kill-node-agent": _kill_node_agent,
    "api-errors": _api_500,
    "api-429": _api_429,
    "api-latency": _api_latency,
    "stale-cache": _stale_cache,
}
"""Every drill, by name, in the order `run_drills` runs them."""


def run_drill(name: str, folder: Path | None = None, *, seed: int = 0) -> DrillResult:
    result = DrillResult(name)
    started = time.monotonic()
    with workspace(folder, seed=seed) as space:
        try:
            DRILLS[name](space, result)
        except Exception as exc:  # a drill that breaks is a failed drill, with the reason
            result.checks.append(Check("the drill ran", False, f"{type(exc).__name__}: {exc}"))
        result.checks += nothing_lost(space.server, space.components)
    result.seconds = time.monotonic() - started
    return result


def run_drills(names: Sequence[str] = (), folder: Path | None = None, *, seed: int = 0,
               echo: Callable[[str], None] | None = None) -> list[DrillResult]:
    """Run `names` (default: all of `DRILLS`), each in its own workspace (under `folder/<name>` when given)."""
    results = []
    for name in names or list(DRILLS):
        if name not in DRILLS:
            raise KeyError(f"unknown drill {name!r} (choose from {', '.join(DRILLS)})")
        result = run_drill(name, folder / name if folder is not None else None, seed=seed)
        results.append(result)
        if echo is not None:
            echo(result.text())
    return results
