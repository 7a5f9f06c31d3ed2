#!/usr/bin/env python3
"""CPU seconds (time.process_time) of the platform week's arms, for the scheduler's gang retries.

    python3 scripts/bench-gang-retry.py --seeds 1-3                 # the quick settings, one arm per seed
    python3 scripts/bench-gang-retry.py --default --days 0.1 --warmup 1 --profile 10   # the default fleet, profiled

Prints figures; it is not a test and asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from gpuplane.sim.platform.fleet import PlatformSettings
from gpuplane.sim.platform.scenario import SCENARIO
from gpuplane.sim.platform.week import run_arm


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1-3")
    parser.add_argument("--default", action="store_true", help="the default fleet instead of the quick settings")
    parser.add_argument("--days", type=float, default=None, help="simulated days (default: the settings')")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up hours (default: the settings')")
    parser.add_argument("--without", default=None, help="a capability to leave out (e.g. autoscale)")
    parser.add_argument("--profile", type=int, default=0, help="print this many cProfile entries by own time")
    args = parser.parse_args()
    for seed in _seeds(args.seeds):
        fields: dict[str, object] = {} if args.default else dict(SCENARIO.quick)
        if args.days is not None:
            fields["days"] = args.days
        if args.warmup is not None:
            fields["warmup_hours"] = args.warmup
        settings = PlatformSettings(**fields, seed=seed)  # type: ignore[arg-type]
        if args.without:
            settings = settings.without(args.without)
        profiler = cProfile.Profile() if args.profile else None
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        run_arm(settings)
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
        print(f"seed {seed}: {cpu:.1f} s CPU, {wall:.1f} s wall", flush=True)
        if profiler is not None:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(args.profile)
            stats.sort_stats("cumulative").print_stats(args.profile * 2)


if __name__ == "__main__":
    main()
