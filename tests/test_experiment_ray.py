"""`sweep(..., ray_address=...)`: the replays as Ray tasks on a running Ray head equal the local pool's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuplane.sim.experiment import runs_rows, sweep
from gpuplane.sim.trace import bundled_path, resolve_trace


def _head(lines: int, source: Path, target: Path) -> str:
    with source.open(encoding="utf-8") as handle:
        target.write_text("".join(handle.readline() for _ in range(lines + 1)), encoding="utf-8")
    return str(target)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `ray start --head --block` with 2 CPUs, in a session of its own, stopped by its process group."""
    port = _free_port()
    temp = tmp_path_factory.mktemp("ray")
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray head did not come up (exit {head.poll()})")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGINT)  # `ray start --block` stops its processes on ^C
        try:
            head.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_ray_equals_local_pool(ray_head: str, tmp_path: Path) -> None:
    # A small cluster and workload keep each replay well under a second: the first 120 nodes and 400 pods.
    nodes = _head(120, bundled_path("nodes"), tmp_path / "nodes.csv")
    pods = _head(400, resolve_trace("default"), tmp_path / "pods.csv")
    args = ([pods], ["fgd", "bestfit", "random"], [42, 43])
    local = sweep(*args, nodes_path=nodes, workers=2)
    remote = sweep(*args, nodes_path=nodes, ray_address=ray_head)
    assert [r.key for r in remote] == [r.key for r in local]
    # Byte for byte: the runs.csv rows, as text, are the same (wall_s is the only field left out).
    assert repr(runs_rows(remote)).encode() == repr(runs_rows(local)).encode()
    assert len(runs_rows(local)) == 3 * 2 * 131  # policies × seeds × arrived points 0…130
    # A sweep that cannot differ from the pool across seeds would say nothing: the seeds do differ here.
    assert local[0].allocation_pct != local[1].allocation_pct

