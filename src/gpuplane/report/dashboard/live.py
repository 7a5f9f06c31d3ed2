"""Worlds for the dashboard to watch: the platform week run in accelerated time, or a sampler for a live cluster.

`PacedWeek` runs `run_arm` in a thread. Through `on_world` it builds the `Board` over the world, feeds the board the
scheduler's outcomes (the reasons pods wait), and adds a pacer event to the world's loop: every `tick_s` of wall
time the pacer lets the virtual clock run `speed` × `tick_s` seconds, takes a history sample every `sample_s`
virtual seconds, and releases the board's lock while it sleeps, so that the page reads a world that stands still.

`ClusterWatch` is the board over a Kubernetes cluster: `KubeCluster` for the fleet and the pods (and why each
pending pod waits, from the `PodScheduled=False` conditions its scheduler wrote), `Declarations` (the reader
gpuplane-scheduler uses) for the quotas of the cluster's Queue and GpuPool resources, and a `Sampler`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuplane.model import Catalog, default_catalog
from gpuplane.report.dashboard.state import Board
from gpuplane.scheduler.scheduler import Outcome
from gpuplane.sim.accounting import PlatformBusy
from gpuplane.sim.platform import PlatformSettings, run_arm
from gpuplane.sim.scenario.world import World

if TYPE_CHECKING:
    from gpuplane.controllers.accounting import UtilisationReader
    from gpuplane.kube.api import KubeApi

SAMPLE_S = 300.0
"""Virtual seconds between two history samples of a simulated world."""


class Stopped(Exception):
    """Raised by the pacer inside the world's loop to end a run that `PacedWeek.stop` asked to stop."""


class PacedWeek:
    """The platform week's platform arm, `speed` virtual seconds per wall second (see the module docstring)."""

    def __init__(self, settings: PlatformSettings, *, speed: float = 120.0, tick_s: float = 0.2,
                 sample_s: float = SAMPLE_S, catalog: Catalog | None = None) -> None:
        if speed <= 0 or tick_s <= 0 or sample_s <= 0:
            raise ValueError("speed, tick_s and sample_s must be positive")
        self.settings = settings
        self.speed = speed
        self.tick_s = tick_s
        self.sample_s = sample_s
        self.catalog = catalog if catalog is not None else default_catalog()
        self.board: Board | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="platform-week", daemon=True)

    def start(self, timeout_s: float = 120.0) -> Board:
        """Start the week; returns its board once the world is built."""
        self._thread.start()
        if not self._ready.wait(timeout_s) or self.board is None:
            raise RuntimeError(f"the platform week did not build its world: {self.error!r}")
        return self.board

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the run at the pacer's next tick (the board keeps its last state)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            run_arm(self.settings, on_world=self._attach)
        except Stopped:
            if self.board is not None:
                self.board.status = "stopped"
        except BaseException as exc:  # the page says the run stopped; the server goes on
            self.error = exc
            if self.board is not None:
                self.board.status = f"stopped: {exc}"
            self._ready.set()
            raise
        finally:
            if self.board is not None:
                if self.board.status == "live":
                    self.board.status = "finished"
                with contextlib.suppress(RuntimeError):  # a world that failed before the lock was taken
                    self.board.lock.release()

    def _attach(self, world: World) -> None:
        board = Board(world.cluster, self.catalog, now=world.loop.now, scheduler=world.scheduler,
                      reader=PlatformBusy(self.settings, world.cluster), title="gpuplane · platform week (simulated)")
        board.lock.acquire()  # held by this thread while the world moves; the pacer lets readers in
        self.board = board
        original = world.scheduler.run_pending

        def run_pending(on_outcome: Callable[[Outcome], bool] | None = None) -> list[Outcome]:
            outcomes = original(on_outcome)
            board.record_outcomes(outcomes)
            return outcomes

        setattr(world.scheduler, "run_pending", run_pending)  # noqa: B010 - the week calls it on the instance
        loop = world.loop
        wall0, virtual0 = time.monotonic(), loop.now()
        next_sample = [virtual0]

        def pace() -> None:
            if self._stop.is_set():
                raise Stopped
            now = loop.now()
            if now >= next_sample[0]:
                board.sample()
                next_sample[0] = now + self.sample_s
            board.lock.release()
            try:
                time.sleep(max(0.002, wall0 + (now - virtual0) / self.speed - time.monotonic()))
            finally:
                board.lock.acquire()
            loop.call_later(self.speed * self.tick_s, pace)

        loop.call_at(loop.now(), pace)
        self._ready.set()


class Sampler:
    """Samples a board every `every_s` wall seconds in a daemon thread (a live cluster's history)."""

    def __init__(self, board: Board, every_s: float = 30.0) -> None:
        self.board = board
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.board.sample()
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()


class ClusterWatch:
    """The board over the cluster `api` reaches (see the module docstring), sampled every `sample_s` wall seconds.

    Starting waits for the first lists of pods and nodes (TimeoutError after `sync_timeout_s`) and of the
    declarations (a resource that cannot be listed in time is logged, and applied when it answers). `close()`
    stops the sampler, the board's watch and the informers."""

    def __init__(self, api: KubeApi, catalog: Catalog, *, reader: UtilisationReader | None = None,
                 sample_s: float = 30.0, sync_timeout_s: float = 30.0, title: str = "gpuplane · cluster") -> None:
        from gpuplane.kube.cluster import KubeCluster  # the simulation's board does not load the cluster code
        from gpuplane.kube.declarations import Declarations

        self.cluster = KubeCluster(api, catalog, sync_timeout_s=sync_timeout_s)
        self.declarations = Declarations(api, catalog)
        try:
            self.declarations.start(sync_timeout_s)
        except BaseException:
            self.cluster.close()
            raise
        self.board = Board(self.cluster, catalog, now=time.time, reader=reader, title=title,
                           pending_reasons=self.cluster.pending_reasons, quota_source=self.declarations.quotas)
        self.sampler = Sampler(self.board, sample_s)
        self.sampler.start()

    def close(self) -> None:
        self.sampler.stop()
        self.board.close()
        self.declarations.stop()
        self.cluster.close()

    def __enter__(self) -> ClusterWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SAMPLE_S", "ClusterWatch", "PacedWeek", "Sampler", "Stopped"]
