"""Record every decision of fgd-plus fill replays, card for card, as the golden file its tests compare against.

    python3 scripts/record-fgd-plus-placements.py tests/fixtures/fgd-plus-placements.csv.gz

Fill protocol, fgd-plus node and card policy (M from the whole trace), on the bundled cluster: the three
bundled traces at seed 42, whole. One row per decision in order, `trace,seed,node,cards` (cards joined by
`+`; a failed pod has no node). Rerun it only on purpose: a speed change must leave the file byte for byte the same
(`tests/test_fgd_plus_equivalence.py`).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io

from gpuplane.model import default_catalog
from gpuplane.scheduler import PolicyConfig, default_registry
from gpuplane.scheduler.plugins.frag import TypicalPods
from gpuplane.sim import bundled_path, load_nodes, load_pods
from gpuplane.sim.replay import run_fill

RUNS = (("default", 42), ("gpushare40", 42), ("gpushare100", 42))


def placement_rows(trace: str, seed: int) -> list[tuple[str, ...]]:
    catalog = default_catalog()
    nodes = load_nodes(bundled_path("nodes"), catalog)
    pods = [p.request for p in load_pods(bundled_path(trace), catalog)]
    profile = default_registry().build(PolicyConfig(node_policy="fgd-plus", card_policy="fgd-plus",
                                                    typical=TypicalPods.from_workload(pods), seed=seed))
    result = run_fill(catalog, nodes, pods, profile, seed=seed, trace=trace, record_placements=True)
    return [(trace, str(seed), p.node if p.outcome == "placed" else "", "+".join(map(str, p.cards)))
            for p in result.placements]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    args = parser.parse_args()
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(("trace", "seed", "node", "cards"))
    for trace, seed in RUNS:
        writer.writerows(placement_rows(trace, seed))
    with open(args.out, "wb") as out:
        out.write(gzip.compress(text.getvalue().encode(), 9, mtime=0))


if __name__ == "__main__":
    main()
