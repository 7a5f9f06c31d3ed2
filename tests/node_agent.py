"""A node agent's reporting loop in threads, as `gpuplane node-reporter` runs it: one follower putting findings
on a queue, `run_reporter` posting them and saving positions; `kill` stops it with no last word (what is on disk
is what a SIGKILLed agent leaves), and a new `Agent` on the same state file is its restart."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.model.failures import load_signature_library
from gpuplane.node.reporter import Finding, NodeReporter, PositionStore, run_reporter

Follower = Callable[["queue.Queue[Finding]", threading.Event, PositionStore], object]
"""What follows the node's log: (findings, stop, the agent's positions) → anything (kept in `Agent.followed`)."""


class Agent:
    def __init__(self, server: FakeApiServer, follow: Follower, state: Path,
                 store: PositionStore | None = None) -> None:
        self.findings: queue.Queue[Finding] = queue.Queue()
        self.stop = threading.Event()
        self.store = store if store is not None else PositionStore(state)
        self.reporter = NodeReporter(server.api, "gpu-7", FailureClassifier(load_signature_library()), time.time)
        self.followed: list[object] = []
        self.threads = [
            threading.Thread(target=lambda: self.followed.append(follow(self.findings, self.stop, self.store))),
            threading.Thread(target=run_reporter, args=(self.reporter, self.findings, self.stop),
                             kwargs={"positions": self.store})]
        for thread in self.threads:
            thread.start()

    def kill(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in self.threads)
