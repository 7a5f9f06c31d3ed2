"""`python -m gpuplane.cli.dra_cmd`: gpuplane's scheduler allocating DRA ResourceClaims (`gpuplane.kube.dra`), as
`gpuplane bench kube --dra` runs it. Until `gpuplane scheduler --dra` is wired into the CLI, this is its entry:

    python -m gpuplane.cli.dra_cmd --kubeconfig FILE [--node-policy binpack] [--scheduler-name NAME]

No leader election; four bind lanes; until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Sequence

from gpuplane.kube.api import JsonObject
from gpuplane.kube.objects import SCHEDULER_NAME
from gpuplane.model import NodeSpec


def bench_slices(spec: NodeSpec) -> list[JsonObject]:
    """A bench node's ResourceSlices (`gpuplane bench kube --dra`: `run_kube_bench(..., dra=bench_slices)`)."""
    from gpuplane.model import default_catalog
    from gpuplane.node.dra_slices import spec_slices

    return spec_slices(spec, default_catalog())


def main(argv: Sequence[str] | None = None) -> None:
    from gpuplane.kube.api import connect_api
    from gpuplane.kube.dra import dra_scheduler
    from gpuplane.model import default_catalog
    from gpuplane.port import WallClock
    from gpuplane.scheduler import PolicyConfig, default_registry

    parser = argparse.ArgumentParser(prog="python -m gpuplane.cli.dra_cmd")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node-policy", default="binpack")
    parser.add_argument("--scheduler-name", default=SCHEDULER_NAME)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    catalog = default_catalog()
    profile = default_registry().build(PolicyConfig(node_policy=args.node_policy))
    mode = dra_scheduler(connect_api(args.kubeconfig, None), profile, catalog=catalog, clock=WallClock(),
                         scheduler_name=args.scheduler_name, seed=0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    mode.run(stop)


if __name__ == "__main__":
    main()
