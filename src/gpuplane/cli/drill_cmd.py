"""`gpuplane drill`: the fault drills (`gpuplane.kube.drills`) against the local API server.

Each drill starts its own local API server, runs the components as child processes against it, does its harm,
and checks that nothing was lost; it prints what it did and what it checked. Exit 0 when every drill passed,
1 when one failed, 2 on bad flags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gpuplane.cli.common import fail


def register(app: typer.Typer) -> None:
    @app.command("drill")
    def drill(
        names: Annotated[list[str] | None, typer.Argument(
            help="drills to run (default: all): kill-scheduler, kill-extender, kill-operator, kill-operator-drain, "
                 "kill-node-agent, api-errors, api-429, api-latency, stale-cache")] = None,
        out: Annotated[Path | None, typer.Option(
            "--out", help="keep each drill's component logs and kubeconfig under OUT/<drill>, and OUT/drills.json")
                       ] = None,
        seed: Annotated[int, typer.Option(help="seed of the random API failures")] = 0,
        list_only: Annotated[bool, typer.Option("--list", help="list the drills and exit")] = False,
    ) -> None:
        """Kill components mid-operation, hurt the API, restart on a stale cache; check that nothing is lost."""
        from gpuplane.kube.drills import DRILLS, run_drills

        if list_only:
            for name, function in DRILLS.items():
                typer.echo(f"{name}: {' '.join((function.__doc__ or '').split())}")
            return
        unknown = [n for n in names or [] if n not in DRILLS]
        if unknown:
            fail(f"unknown drill {', '.join(unknown)} (choose from {', '.join(DRILLS)})")
        if out is not None:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                fail(f"--out {out}: {exc}")
        results = run_drills(names or (), out, seed=seed, echo=typer.echo)
        passed = sum(r.ok for r in results)
        typer.echo(f"{passed} of {len(results)} drills passed")
        if out is not None:
            (out / "drills.json").write_text(json.dumps([r.json() for r in results], indent=2) + "\n")
        if passed != len(results):
            raise typer.Exit(1)
