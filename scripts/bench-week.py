#!/usr/bin/env python3
"""One arm of the platform week: CPU seconds, wall seconds and peak RSS, as one JSON line.

    python3 scripts/bench-week.py [--settings docs/settings/platform-10k.yaml] [--days 0.02] [--arm platform|vanilla]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import yaml

from gpuplane.sim.platform import PlatformSettings, run_arm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", type=Path, help="a YAML file of PlatformSettings fields")
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--arm", choices=("platform", "vanilla"), default="platform")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    fields = yaml.safe_load(args.settings.read_text(encoding="utf-8")) if args.settings else {}
    settings = PlatformSettings(**{**fields, "seed": args.seed, "days": args.days,
                                   "warmup_hours": min(6.0, args.days * 24.0 / 4.0)})
    if args.arm == "vanilla":
        settings = settings.vanilla()
    nodes = (settings.a100_nodes + settings.h100_nodes + settings.a10_nodes + settings.t4_nodes + settings.l40s_nodes
             + settings.a30_nodes)
    cpu, wall = time.process_time(), time.perf_counter()
    run_arm(settings)
    print(json.dumps({"arm": args.arm, "nodes": nodes, "days": args.days, "cpu_s": round(time.process_time() - cpu, 1),
                      "wall_s": round(time.perf_counter() - wall, 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))


if __name__ == "__main__":
    main()
