"""`gpuplane snapshot` (a cluster read into gpuplane's node list and workload) and `gpuplane replay --snapshot`
(the what-if replay of such a snapshot under candidate policies): `gpuplane.kube.snapshot`, `gpuplane.sim.whatif`."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpuplane.cli.common import fail
from gpuplane.cli.scenario_cmd import scenario_settings
from gpuplane.kube.api import ApiError, KubeConfigError, connect_api
from gpuplane.kube.objects import format_time
from gpuplane.kube.snapshot import CLUSTER_FILE, Snapshot, Stack, load_api, load_files, load_snapshot
from gpuplane.model import MILLI_PER_CARD, GpuplaneError, default_catalog
from gpuplane.sim.scenario.sweep import Spread, parse_seeds
from gpuplane.sim.whatif import WhatIfResult, WhatIfSettings, Written, compare, write_snapshot

out = Console()

DEFAULT_SEED = 42
"""`simulate`'s own default seed."""


def register(app: typer.Typer) -> None:
    @app.command("snapshot")
    def snapshot(
        out_dir: Annotated[Path, typer.Option("--out", help="directory for nodes.csv, pods.csv, running.csv and "
                                                            f"{CLUSTER_FILE}")],
        from_: Annotated[Path | None, typer.Option("--from", help=(
            "read `kubectl get nodes,pods -A -o json` output (a file, or a directory of .json files) instead of "
            "the API server"))] = None,
        kubeconfig: Annotated[Path | None, typer.Option(
            help="kubeconfig file (default: in-cluster config, else $KUBECONFIG or ~/.kube/config)")] = None,
        context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
    ) -> None:
        """Read a cluster (nodes with their cards, running pods where they are, pending pods) into gpuplane's node
        list and workload, the files `gpuplane replay` reads; a dump that cannot be read whole is refused with
        every problem named by file, object and field."""
        snapshot_command(out_dir, from_, kubeconfig, context, as_json)


def snapshot_command(out_dir: Path, from_: Path | None, kubeconfig: Path | None, context: str | None,
                     as_json: bool) -> None:
    catalog = default_catalog()
    if from_ is not None and (kubeconfig is not None or context is not None):
        fail("--from reads files: drop --kubeconfig/--context, or drop --from to read the API server")
    try:
        if from_ is not None:
            snap = load_files(from_, catalog)
        else:
            if kubeconfig is not None and not kubeconfig.is_file():
                fail(f"--kubeconfig {kubeconfig}: no such file")
            try:
                api = connect_api(str(kubeconfig) if kubeconfig is not None else None, context)
            except KubeConfigError as exc:
                fail(f"--kubeconfig: cannot load a configuration: {exc}")
            try:
                snap = load_api(api, catalog)
            except ApiError as exc:
                fail(f"cannot list nodes and pods from the API server: {exc}")
        written = write_snapshot(snap, out_dir)
    except GpuplaneError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(snapshot_json(snap, written)))
        return
    print_snapshot(snap, written)


def _gpus(milli: int) -> str:
    return f"{milli / MILLI_PER_CARD:g}"


def snapshot_json(snap: Snapshot, written: Written) -> dict[str, Any]:
    stacks = Counter(p.stack.value for p in snap.running)
    return {
        "taken_at": format_time(snap.taken_at) if snap.taken_at is not None else None,
        "nodes": len(snap.nodes), "gpus": sum(n.gpus for n in snap.nodes),
        "foreign_cards": sum(len(n.foreign_cards) for n in snap.nodes),
        "running": dict(sorted(stacks.items())), "pending": [p.name for p in snap.pending],
        "skipped": [{"object": s.obj, "reason": s.reason} for s in snap.skipped],
        "files": list(written.files), "pods_written": written.pods_written,
        "left_out_of_pods_csv": [{"pod": p, "reason": r} for p, r in written.left_out],
        "not_in_nodes_csv": list(written.not_in_nodes_csv),
    }


def print_snapshot(snap: Snapshot, written: Written) -> None:
    taken = format_time(snap.taken_at) if snap.taken_at is not None else "an unknown moment"
    held: Counter[str] = Counter()
    for pod in snap.running_of(Stack.GPUPLANE):
        held[pod.assignment.node] += pod.assignment.gpu_milli
    table = Table(title=f"snapshot taken at {taken}")
    for column in ("node", "model", "cards", "gpuplane pods hold", "other stack holds"):
        table.add_column(column, justify="left" if column in ("node", "model") else "right")
    for node in snap.nodes:
        table.add_row(node.name, node.gpu_model or "-", str(node.gpus), _gpus(held[node.name]),
                      str(len(node.foreign_cards)))
    out.print(table)
    stacks = Counter(p.stack for p in snap.running)
    out.print(f"running: {len(snap.running)} pods ({stacks[Stack.GPUPLANE]} gpuplane, {stacks[Stack.FOREIGN]} of "
              f"another GPU stack, {stacks[Stack.NONE]} without GPU)")
    asked = sum(p.request.gpu_milli_total for p in snap.pending)
    out.print(f"pending: {len(snap.pending)} pods asking {_gpus(asked)} GPUs: "
              f"{', '.join(p.name for p in snap.pending) or '-'}", soft_wrap=True)
    for skipped in snap.skipped:
        out.print(f"left out: {skipped.obj}: {skipped.reason}", soft_wrap=True, markup=False)
    for name, reason in written.left_out:
        out.print(f"not in pods.csv: {name}: {reason}", soft_wrap=True, markup=False)
    out.print(f"the nodes CSV cannot say: {'; '.join(written.not_in_nodes_csv)} "
              f"(simulate --snapshot reads {CLUSTER_FILE}, which keeps them)", soft_wrap=True, markup=False)
    out.print(f"wrote {', '.join(written.files)}", soft_wrap=True, markup=False)


# ------------------------------------------------------------------ simulate --snapshot
def simulate_snapshot(path: Path, policy: str, compare_with: Sequence[str], seed: int | None, hours: float,
                      assignments: Sequence[str], as_json: bool, seeds: str | None = None) -> None:
    """`gpuplane replay --snapshot DIR --policy A --compare B …`: the what-if replay of DIR (what `gpuplane
    snapshot --out` wrote, or a dump as `--from` reads it) under each policy, with the same draws; `seeds` (`1-10`)
    replays each seed and reports medians with their range."""
    catalog = default_catalog()
    try:
        runs = parse_seeds(seeds) if seeds is not None else (DEFAULT_SEED if seed is None else seed,)
        base = scenario_settings(WhatIfSettings, None, [f"hours={hours}", *assignments, f"seed={runs[0]}"])
        assert isinstance(base, WhatIfSettings)
        snap = load_snapshot(path, catalog)
        results = [compare(snap, catalog, [policy, *compare_with], base.model_copy(update={"seed": s}))
                   for s in runs]
    except GpuplaneError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps({"snapshot": str(path), "settings": base.model_dump(exclude={"seed"}), "seeds": list(runs),
                          "results": [[{k: v for k, v in asdict(r).items() if k != "binds"} for r in per_seed]
                                      for per_seed in results]}))
        return
    print_whatif(base, runs, results)


ROWS: tuple[tuple[str, Callable[[WhatIfResult], float | None]], ...] = (
    ("pending placed at once", lambda r: r.pending_placed_at_once),
    ("unallocated GPU after them, %", lambda r: r.unallocated_after_pending_pct),
    ("unallocated GPU, mean %", lambda r: r.unallocated_pct),
    ("unallocated while pods wait, %", lambda r: r.unallocated_while_waiting_pct),
    ("placed", lambda r: r.placed),
    ("pending at the end", lambda r: r.pending_at_end),
    ("wait p50, min", lambda r: r.wait_p50_s / 60),
    ("wait p95, min", lambda r: r.wait_p95_s / 60),
)
"""What `simulate --snapshot` shows per policy (with several seeds: median [min–max])."""


def print_whatif(settings: WhatIfSettings, seeds: Sequence[int], results: Sequence[Sequence[WhatIfResult]]) -> None:
    first = results[0][0]
    where = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}–{seeds[-1]} ({len(seeds)}): " \
        "median [min–max]"
    arrivals = Spread.of([r[0].arrivals for r in results])
    out.print(f"what-if: {first.running} running pods in place, {first.pending_at_start} pending, then "
              f"{settings.hours:g} h of arrivals drawn from the snapshot's pods ({arrivals.show(0)} pods, "
              f"{first.arrivals_per_hour:.2f}/h, mean lifetime {first.mean_lifetime_s / 60:.0f} min, "
              f"load x{settings.load_scale:g}); {where}", soft_wrap=True, markup=False)
    table = Table(title="gpuplane replay --snapshot")
    table.add_column("")
    for result in results[0]:
        table.add_column(result.policy, justify="right")
    for label, value in ROWS:
        cells = []
        for i in range(len(results[0])):
            values = [v for per_seed in results if (v := value(per_seed[i])) is not None]
            whole = label in ("pending placed at once", "placed", "pending at the end")
            cells.append(Spread.of(values).show(0 if whole else 1) if values else "-")
        table.add_row(label, *cells)
    out.print(table)
