"""What a failed training job leaves behind, as a recovery controller reads it: realistic incident streams.

One incident is a failure of one category (the Llama 3 mix, fault-tolerance reference §8.2) on one node of
a job. Its stream is every node's log lines and exit events around the failure, each with the time its
node's clock gave it:

- **noise**: training progress, NCCL INFO, kernel and kubelet chatter, on every node;
- **near misses**: the library's own `near_misses` lines that match no signature at all (lines that look like
  a signature but are not), mixed into the noise;
- **tolerated events**: log-only lines (a row remapped, corrected ECC and PCIe errors, one link flap, a
  clock step) on random nodes, as a healthy fleet logs them;
- **the root cause** on the failing node (a line of one of the category's signatures, `ROOT_CAUSES`, its
  variable fields drawn afresh by `vary`), unless
  the node fell silent (it died before its logs were shipped: `silent_share`); a hang's node often logs
  nothing at all;
- **the cascade**: the rank's next CUDA call fails on the failing node (within ±`app_error_lead_s` of the
  kernel's Xid line, either order: reference §4.3 #17), peers see `ncclRemoteError` (and InfiniBand
  completion errors, status 12 once the retries run out, when the whole node went down), then the
  watchdog, aborted communicators, `terminate called` and torchrun's −6 exits everywhere; a hang shows
  only the watchdog and each rank's last completed NCCL work, where the stuck rank is one behind.

Every node's clock is off by a normal draw of `clock_skew_s`, so the first error by timestamp is not always
on the failing node. The truth (`Incident`) says which node failed and whether the node itself is at
fault (`persistent`: it fails again until repaired), so a verdict can be graded (`decision_correct`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.controllers.recovery import Evidence
from gpuplane.model.failures import SignatureLibrary

CATEGORIES = ("gpu", "software", "network", "host_maintenance", "host_hardware", "unknown_nccl")
HANGS = frozenset({"network", "unknown_nccl"})
"""Categories that hang the job (it stops making progress and exits only at the NCCL timeout)."""
PERSISTENT = frozenset({"gpu", "network", "host_maintenance", "host_hardware"})
"""Categories whose node is at fault: it fails again until it is taken out and repaired. Software failures
and NCCL timeouts of unknown cause are transient: a restart on the same nodes is the right decision."""

NODE_DOWN = frozenset({"host_maintenance", "host_hardware"})
"""Crashes that take the whole node (and its HCA) down, so its peers' InfiniBand retries run out."""

ROOT_CAUSES: dict[str, tuple[str, ...]] = {
    # Llama 3 Table 5's GPU rows (faulty GPU, HBM3, SRAM, GSP, thermal): Xid and CUDA-level evidence
    "gpu": ("xid-79", "gpu-fallen-off-bus", "xid-48", "ecc-double-bit", "xid-95", "xid-64",
            "row-remap-failure", "cuda-uncorrectable-ecc", "hbm-uncorrectable", "xid-119", "gsp-rpc-timeout",
            "xid-46", "xid-62", "xid-109", "xid-154-recovery-action", "gpu-missing", "xid-74", "nvlink-error"),
    # software and dependency failures that a restart gets past (a deterministic user error does not
    # appear halfway through a long run), and Xid 94, a contained ECC error: RESTART_APP in NVIDIA's
    # catalogue, only the application that touched the bad memory dies and the node stays
    "software": ("xid-94", "nan-loss", "nan-local-grad", "segfault", "heap-corruption", "xid-13", "xid-31",
                 "stale-file-handle", "object-store-transient", "storage-io-error"),
    # switch, cable and NIC faults on the node's links
    "network": ("ib-link-down", "ib-port-state", "net-ib-completion-error", "nvswitch-sxid-fatal"),
    "host_maintenance": ("k8s-node-not-ready", "node-shutdown"),
    # SSD, power, CPU, memory, PCIe
    "host_hardware": ("cpu-mce-uncorrected", "pcie-aer-uncorrected", "nvme-io-error", "pcie-downtrained"),
    "unknown_nccl": (),
}
TOLERATED = ("xid-63", "xid-92", "pcie-aer-corrected", "cpu-mce-corrected", "clock-unstable", "ib-link-down",
             "nvswitch-sxid-nonfatal", "xid-43")
"""Log-only signatures a healthy fleet logs now and then (one link flap is tolerated; two on a node within
five minutes escalate, as they should)."""
APP_ERRORS = ("cuda-illegal-address", "cuda-launch-failure")
"""What the failing GPU's rank logs when its next CUDA call fails."""
PEER_ERRORS = ("nccl-remote-error", "net-connection-reset")
IB_PEER = "net-ib-completion-error"
ECHOES = ("nccl-comm-aborted", "cpp-terminate", "torchrun-child-failed")
WATCHDOG = ("[rank{r}]:[E501 12:13:11.204117503 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, "
            "Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
PROGRESS = ("[rank{r}]:[E501 12:13:11.204 ProcessGroupNCCL.cpp:1834] [PG 0 (default_pg) Rank {r}] Exception "
            "(either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL work: {seq}, "
            "last completed NCCL work: {done}.")


class StreamModel(BaseModel):
    """How much of what an incident's stream holds (all assumptions; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    noise_lines: int = Field(default=400, ge=0, description="noise lines per incident, over all nodes")
    near_miss_share: float = Field(default=0.05, ge=0.0, le=1.0,
                                   description="share of noise lines that are near misses")
    tolerated_lines: int = Field(default=3, ge=0, description="log-only events per incident")
    clock_skew_s: float = Field(default=1.0, ge=0.0, description="standard deviation of each node's clock offset")
    silent_share: float = Field(default=0.1, ge=0.0, le=1.0,
                                description="crashes whose failing node ships no log line of its own")
    silent_hang_share: float = Field(default=0.5, ge=0.0, le=1.0,
                                     description="network hangs whose failing node logs nothing")
    app_error_lead_s: float = Field(default=2.0, ge=0.0,
                                    description="the failing rank's CUDA error is within ± this of the Xid line")
    peers: int = Field(default=8, ge=0, description="peers that log the failure (remote errors, IB completions)")
    hang_timeout_s: float = Field(default=600.0, ge=0.0, description="NCCL watchdog timeout")


@dataclass(frozen=True, slots=True)
class Incident:
    """The truth of one failure: which node, what kind, whether the node is at fault, which root signature."""

    category: str
    node: str
    root: str | None
    """the signature id the failing node logged (None: it logged nothing)"""

    @property
    def persistent(self) -> bool:
        return self.category in PERSISTENT

    @property
    def hang(self) -> bool:
        return self.category in HANGS


def decision_correct(incident: Incident, isolated: Sequence[str]) -> bool:
    """The right decision: take out exactly the failing node when it is at fault, no node otherwise."""
    return tuple(isolated) == ((incident.node,) if incident.persistent else ())


class StreamMaker:
    """Draws incidents' streams from a signature library (the lines are the library's own examples)."""

    def __init__(self, library: SignatureLibrary, model: StreamModel) -> None:
        self.library = library
        self.model = model
        missing = [i for ids in ROOT_CAUSES.values() for i in ids if i not in library]
        missing += [i for i in (*TOLERATED, *APP_ERRORS, *PEER_ERRORS, IB_PEER, *ECHOES) if i not in library]
        if missing:
            raise ValueError(f"the signature library lacks {', '.join(sorted(set(missing)))}")
        checker = FailureClassifier(library)
        self.near_misses = [line for s in library for line in s.near_misses if checker.feed_line("x", line) is None]
        pool = np.random.default_rng(0)
        self.noise = [noise_line(pool) for _ in range(NOISE_POOL)]

    def _example(self, rng: np.random.Generator, signature: str) -> str:
        examples = self.library[signature].examples
        return vary(examples[int(rng.integers(len(examples)))], rng)

    def incident(self, rng: np.random.Generator, category: str, node: str) -> Incident:
        roots = ROOT_CAUSES[category]
        silent = self.model.silent_hang_share if category in HANGS else self.model.silent_share
        if not roots or rng.random() < silent:
            return Incident(category, node, None)
        return Incident(category, node, roots[int(rng.integers(len(roots)))])

    def stream(self, rng: np.random.Generator, incident: Incident, nodes: Sequence[str], t0: float) -> list[Evidence]:
        """Every node's evidence of `incident` (failure at true time `t0`), in timestamp order."""
        m = self.model
        offset = {n: float(rng.normal(0.0, m.clock_skew_s)) if m.clock_skew_s > 0 else 0.0 for n in nodes}
        out: list[tuple[float, int, Evidence]] = []

        def add(node: str, at: float, line: str | None = None, exit_code: int | None = None) -> None:
            t = at + offset[node]
            out.append((t, len(out), Evidence(node, line=line, exit_code=exit_code, t=t)))

        x = incident.node
        peers = [n for n in nodes if n != x]
        end = t0 + (m.hang_timeout_s if incident.hang else 0.0) + 5.0
        n = m.noise_lines
        where = rng.integers(len(nodes), size=n).tolist()
        when = rng.uniform(t0 - 600.0, end, size=n).tolist()
        near = (rng.random(n) < m.near_miss_share).tolist() if self.near_misses else [False] * n
        which = rng.integers(NOISE_POOL, size=n).tolist()
        for node_i, at, is_near, line_i in zip(where, when, near, which, strict=True):
            line = self.near_misses[line_i % len(self.near_misses)] if is_near else self.noise[line_i]
            add(nodes[node_i], at, line)
        for _ in range(m.tolerated_lines):
            add(nodes[int(rng.integers(len(nodes)))], float(rng.uniform(t0 - 3600.0, end)),
                self._example(rng, TOLERATED[int(rng.integers(len(TOLERATED)))]))
        chosen = [peers[int(i)] for i in rng.permutation(len(peers))[:m.peers]]
        if incident.root is not None:
            add(x, t0, self._example(rng, incident.root))
            if incident.root == "ib-link-down":  # a flapping port: it went down twice within minutes
                add(x, t0 + float(rng.uniform(5.0, 240.0)), self._example(rng, "ib-link-down"))
        if incident.hang:
            # the stuck collective: every rank times out; the stuck rank completed one op fewer
            seq = int(rng.integers(10_000, 90_000))
            for rank, node in enumerate(nodes):
                at = t0 + m.hang_timeout_s + float(rng.uniform(0.0, 2.0))
                add(node, at, WATCHDOG.format(r=rank * 8, seq=seq))
                add(node, at + 0.01, PROGRESS.format(r=rank * 8, seq=seq, done=seq - 2 if node == x else seq - 1))
            echoes_at = t0 + m.hang_timeout_s + 1.0
        else:
            if incident.category == "gpu" or incident.category == "host_hardware":
                lead = m.app_error_lead_s
                add(x, t0 + float(rng.uniform(-lead, lead)), self._example(rng, APP_ERRORS[int(rng.integers(2))]))
            for peer in chosen:
                add(peer, t0 + float(rng.uniform(0.2, 5.0)), self._example(rng, PEER_ERRORS[int(rng.integers(2))]))
            for peer in chosen[:2] if incident.category in NODE_DOWN else ():
                # the node's HCA stopped answering: the IB retries run out, status 12 on peers that talked to it
                add(peer, t0 + float(rng.uniform(5.0, 30.0)), self._example(rng, IB_PEER))
            echoes_at = t0 + 6.0
        for node in nodes:
            at = echoes_at + float(rng.uniform(0.0, 3.0))
            add(node, at, self._example(rng, ECHOES[int(rng.integers(len(ECHOES)))]))
            add(node, at + 0.5, exit_code=-6)
        out.sort(key=lambda item: (item[0], item[1]))
        return [e for _, _, e in out]


_VARIABLE = re.compile(r"(?<=pid=)\d+|(?<=PCI:0000:)[0-9a-f]{2}(?=:)|(?<=gpu-node-)\d{3}|(?<=\[rank)\d+(?=\])"
                       r"|(?<=\d\d:)\d\d(?=[:.,])|(?<=SeqNum=)\d+")


def vary(line: str, rng: np.random.Generator) -> str:
    """A library example with its variable fields drawn afresh (process ids, PCI buses, node names, ranks,
    clock minutes and seconds, sequence numbers), so a stream does not repeat the library's lines verbatim;
    what a signature keys on (Xid codes, messages, status codes) stays."""

    def draw(m: re.Match[str]) -> str:
        text = m.group()
        if text.isdigit():
            top = 60 if len(text) == 2 else 10 ** len(text)
            return f"{int(rng.integers(top)):0{len(text)}d}"
        return f"{int(rng.integers(256)):02x}"

    return _VARIABLE.sub(draw, line)


_NOISE_KINDS = 6
NOISE_POOL = 4096
"""Noise lines drawn once per `StreamMaker` and sampled from (their numbers vary; their kinds are six)."""


def noise_line(rng: np.random.Generator) -> str:
    """A line a healthy training job logs, which no signature matches."""
    k = int(rng.integers(_NOISE_KINDS))
    r = rng.integers
    if k == 0:
        return (f" [2024-05-01 12:{r(60):02d}:{r(60):02d}] iteration {r(500_000):>8d}/  500000 | elapsed time per "
                f"iteration (ms): {rng.uniform(3000, 5000):.1f} | lm loss: {rng.uniform(1.5, 3.5):.6E} | "
                f"grad norm: {rng.uniform(0.2, 2.0):.3f} | number of nan iterations:   0 |")
    if k == 1:
        rank = int(r(512))
        return (f"gpu-node-{rank // 8:03d}:{r(99_999)}:{r(99_999)} [{rank % 8}] NCCL INFO Channel {r(32):02d}/0 : "
                f"{rank}[{rank % 8}] -> {r(512)}[{rank % 8}] via NET/IB/{r(8)}/GDRDMA")
    if k == 2:
        return (f"[2024-05-01 12:{r(60):02d}:{r(60):02d},{r(1000):03d}] [INFO] [checkpointing.py:{r(900)}] "
                f"saved checkpoint at iteration {r(500_000)} in {rng.uniform(1, 60):.2f} s")
    if k == 3:
        return (f"I0501 12:{r(60):02d}:{r(60):02d}.{r(10**6):06d}    {r(9999)} kubelet.go:{r(3000)}] "
                f"\"SyncLoop (PLEG): event for pod\" pod=\"ml-train/llama-worker-{r(64)}\" event=ContainerStarted")
    if k == 4:
        return f"[{rng.uniform(0, 2e6):14.6f}] IPv6: ADDRCONF(NETDEV_CHANGE): cali{r(2**40):010x}: link becomes ready"
    return (f"[2024-05-01 12:{r(60):02d}:{r(60):02d}] [INFO] [dataloader] worker {r(16)} prefetched {r(4096)} "
            f"samples from shard {r(100_000):05d}")
