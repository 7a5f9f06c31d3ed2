"""What the `gpuplane` commands share: the error console and exit, a daemon's logging and SIGTERM, the policy flags."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from gpuplane.model import GpuplaneError
from gpuplane.scheduler import CardOnlyOneScope, PolicyConfig, load_topo_config
from gpuplane.scheduler.plugins.frag import TypicalPods

if TYPE_CHECKING:
    from gpuplane.kube.operator import HealthServer
    from gpuplane.port.metrics import PlaneMetrics

err = Console(stderr=True)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def fail(message: str) -> NoReturn:
    """Print `error: message` on stderr and exit 2 (bad flags or configuration)."""
    # Messages name fields such as `spec.windows[0]`: printed as they are, not as markup, and not wrapped.
    err.print(f"[red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def log_to_stderr() -> None:
    """A long-running command's log: INFO and above, with times, on stderr."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)


def serve_metrics(port: int | None) -> PlaneMetrics | None:
    """`--metrics-port`: gpuplane's metrics served on `port` (0: a free one, logged); None: no metrics."""
    if port is None:
        return None
    from gpuplane.port.metrics import PlaneMetrics

    metrics = PlaneMetrics()
    try:
        served = metrics.serve(port)
    except OSError as exc:
        fail(f"--metrics-port {port}: {exc}")
    logging.getLogger(__name__).info("metrics on :%d/metrics", served)
    return metrics


def serve_health(port: int | None) -> HealthServer | None:
    """`--health-port`: `/healthz` for the kubelet's probes served on `port`; None: none. Stop it when done."""
    if port is None:
        return None
    from gpuplane.kube.operator import HealthServer

    try:
        return HealthServer(port).start()
    except OSError as exc:
        fail(f"--health-port {port}: {exc}")


def interrupt() -> NoReturn:
    """A SIGTERM handler for a server whose loop runs on this thread: end it as Ctrl-C does."""
    raise KeyboardInterrupt


@contextmanager
def on_sigterm(handler: Callable[[], None]) -> Iterator[None]:
    """Within the block SIGTERM calls `handler`; the previous handler is back after it."""
    previous = signal.signal(signal.SIGTERM, lambda *_: handler())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def policy_config(node_policy: str, card_policy: str | None, scope: str = "workload", topo: Path | None = None,
                  seed: int = 0, *, typical: TypicalPods | None = None) -> PolicyConfig:
    """The scheduler policy the `--node-policy`, `--card-policy`, `--card-only-one-scope` and `--topo` flags
    choose; `GpuplaneError` naming the flag on a bad scope or topology file (the registry checks the names)."""
    try:
        scope_value = CardOnlyOneScope(scope)
    except ValueError:
        raise GpuplaneError(f"--card-only-one-scope: choose workload or all, got {scope!r}") from None
    return PolicyConfig(node_policy=node_policy, card_policy=card_policy, card_only_one_scope=scope_value,
                        custom_topo=load_topo_config(topo) if topo is not None else None, typical=typical,
                        seed=seed)


# The scheduling-policy flags `gpuplane extender` and `gpuplane scheduler` share.
NodePolicyOption = Annotated[str, typer.Option("--node-policy", "--policy", help=(
    "node policy: binpack, spread, random, dotprod, gpu-clustering, gpu-packing, bestfit, fgd-online, "
    "fgd-used, colocation"))]
CardPolicyOption = Annotated[str | None, typer.Option(
    help="card policy: binpack, spread, card-only-one, custom-topo or colocation "
         "(default: the node policy's own, else binpack)")]
CardOnlyOneScopeOption = Annotated[str, typer.Option(help="card-only-one scope: workload or all")]
TopoOption = Annotated[Path | None, typer.Option(help="custom-topo rules (YAML)")]
SeedOption = Annotated[int, typer.Option(help="seed for tie-breaks")]
