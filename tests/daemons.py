"""Long-running gpuplane commands as child processes, as a container runs them: started with `python -m
gpuplane.cli.main`, ended with SIGTERM as the kubelet ends them, and killed if a test leaves one running."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def gpuplane_daemon(args: Sequence[str]) -> Iterator[subprocess.Popen[bytes]]:
    """`gpuplane <args>` running for the block; killed after it when still running."""
    child = subprocess.Popen([sys.executable, "-m", "gpuplane.cli.main", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def sigterm(child: subprocess.Popen[bytes], timeout_s: float = 30.0) -> tuple[int, str]:
    """Send SIGTERM and wait: (exit status, everything it printed)."""
    child.send_signal(signal.SIGTERM)
    returncode = child.wait(timeout_s)
    return returncode, child.stdout.read().decode(errors="replace") if child.stdout else ""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a daemon's --health-port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthy(port: int) -> bool:
    """Whether `/healthz` on 127.0.0.1:`port` answers 200 now."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False
