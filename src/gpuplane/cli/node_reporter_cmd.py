"""`gpuplane node-reporter`: the node agent's failure and health reports, as core/v1 Events for the operator."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpuplane.cli.common import fail, log_to_stderr, on_sigterm, serve_health
from gpuplane.cli.operator_cmd import connect

if TYPE_CHECKING:
    from gpuplane.node.health_checks import HealthCheck

CHECKS = ("nvml", "dcgm")
STATE_FILE = Path("/var/lib/gpuplane/node-reporter.json")
"""the default --state-file: under the node agent's state directory (a hostPath, so it outlives the pod)"""


def _checks(names: list[str]) -> list[HealthCheck]:
    from gpuplane.node.health_checks import DcgmDiagCheck, NvmlHealthReader, NvmlSanityCheck

    made: list[HealthCheck] = []
    for name in names:
        if name == "nvml":
            made.append(NvmlSanityCheck(NvmlHealthReader()))
        elif name == "dcgm":
            made.append(DcgmDiagCheck())
        else:
            fail(f"--check {name}: unknown (use {', '.join(CHECKS)})")
    return made


def register(app: typer.Typer) -> None:
    """Add `node-reporter` to `app`."""

    @app.command("node-reporter")
    def node_reporter(
        node_name: Annotated[str | None, typer.Option(help="this node [default: $NODE_NAME]")] = None,
        follow: Annotated[list[Path] | None, typer.Option(
            "--follow", help="a log file to classify line by line (repeatable), e.g. /var/log/kern.log for the "
                             "driver's NVRM: Xid lines")] = None,
        kernel_log: Annotated[list[Path] | None, typer.Option(
            "--kernel-log", help="where this node's kernel log may be, in order (repeatable): the first one there "
                                 "is followed, a file as --follow does, a directory of systemd journal files "
                                 "(/var/log/journal, /run/log/journal) through journalctl, its kernel entries; "
                                 "e.g. kern.log, then messages, then the journal, for rsyslog and journald-only "
                                 "nodes alike")] = None,
        journalctl: Annotated[str, typer.Option(help="the journalctl to run for a journal")] = "journalctl",
        command: Annotated[str | None, typer.Option(
            help="a command whose output to classify, run as a child process and restarted when it ends, "
                 "e.g. 'dmesg --follow'")] = None,
        check: Annotated[list[str] | None, typer.Option(
            "--check", help=f"a health check tier to run every --check-period ({', '.join(CHECKS)}; repeatable)")
        ] = None,
        check_period: Annotated[float, typer.Option(min=1.0, help="seconds between check tiers")] = 300.0,
        signatures: Annotated[list[Path] | None, typer.Option(
            "--signatures", help="a signature file on top of the bundled library (repeatable)")] = None,
        from_start: Annotated[bool, typer.Option(
            help="read a followed file from its start when --state-file has no position for it (the first "
                 "start); without, from its end")] = False,
        state_file: Annotated[Path, typer.Option(
            help="where the followed files' read positions are kept across restarts: a restarted agent resumes "
                 "each file there (from its start when it was rotated meanwhile)")] = STATE_FILE,
        once: Annotated[bool, typer.Option(
            "--once", help="read the followed files to their end, run the checks once, post, and exit")] = False,
        health_port: Annotated[int | None, typer.Option(
            min=0, max=65535, help="serve /healthz on this port (the kubelet's probes) while it runs [default: none]")
        ] = None,
        kubeconfig: Annotated[Path | None, typer.Option(help="kubeconfig [default: in-cluster, else ~/.kube/config]")
                              ] = None,
    ) -> None:
        """Classify this node's logs and run its health checks; post what the operator must act on as Events."""
        from gpuplane.controllers.classifier import FailureClassifier
        from gpuplane.model import GpuplaneError
        from gpuplane.model.failures import load_signature_library
        from gpuplane.node.health_checks import run_checks
        from gpuplane.node.reporter import (
            Finding,
            NodeReporter,
            PositionStore,
            drain,
            end_of,
            find_kernel_log,
            follow_command,
            follow_file,
            follow_kernel_log,
            read_journal,
            run_reporter,
        )
        from gpuplane.port import WallClock

        node = node_name or os.environ.get("NODE_NAME")
        if not node:
            fail("no node name: pass --node-name or set $NODE_NAME")
        if once and command is not None:
            fail("--once reads the logs only; --command runs until stopped")
        try:
            library = load_signature_library(extra=signatures or ())
        except GpuplaneError as exc:
            fail(str(exc))
        checks = _checks(check or [])
        api = connect(kubeconfig)
        log_to_stderr()
        reporter = NodeReporter(api, node, FailureClassifier(library), WallClock().now,
                                instance=os.environ.get("POD_NAME"))
        findings: queue.Queue[Finding] = queue.Queue()
        stop = threading.Event()
        if once:
            for path in follow or []:
                if not path.is_file():
                    fail(f"--follow {path}: no such file")
                for line in path.read_text(errors="replace").splitlines():
                    findings.put(Finding(line=line))
            if kernel_log:  # the first one there, whole (a journal: every kernel entry it keeps)
                found = find_kernel_log(kernel_log, PositionStore(Path(os.devnull)), from_start=True,
                                        journalctl=journalctl)
                if found is None:
                    fail(f"--kernel-log: none of {', '.join(map(str, kernel_log))} is there")
                try:
                    lines = (read_journal(found.path, journalctl=journalctl) if found.journal
                             else found.path.read_text(errors="replace").splitlines())
                except (OSError, ValueError) as exc:
                    fail(f"--kernel-log {found.path}: {exc}")
                for line in lines:
                    findings.put(Finding(line=line))
            drain(reporter, findings)
            if checks:
                reporter.checks(run_checks(checks))
            if not reporter.flush():
                fail(f"{len(reporter.pending)} report(s) could not be posted")
            print(f"{node}: {len(reporter.posted)} report(s) posted")
            return
        positions = PositionStore(state_file)
        try:
            state_file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"--state-file {state_file}: {exc}")
        # A file with no saved position is read from its end as it is now (or its start), before /healthz says ready.
        threads = [threading.Thread(target=follow_file, args=(path, findings, stop), daemon=True, kwargs={
                       "from_start": from_start,
                       "resume": positions.get(path) or (None if from_start else end_of(path))})
                   for path in follow or []]
        if kernel_log:  # where it is and where to start, now (as for --follow); else looked for by the thread
            found = find_kernel_log(kernel_log, positions, from_start=from_start, journalctl=journalctl)
            threads.append(threading.Thread(target=follow_kernel_log, args=(kernel_log, findings, stop), daemon=True,
                                            kwargs={"positions": positions, "from_start": from_start,
                                                    "journalctl": journalctl, "found": found}))
        if command is not None:
            threads.append(threading.Thread(target=follow_command, args=(command.split(), findings, stop),
                                            daemon=True))
        for thread in threads:
            thread.start()
        health = serve_health(health_port)
        try:
            with on_sigterm(stop.set):
                run_reporter(reporter, findings, stop, checks=checks, check_period_s=check_period,
                             positions=positions)
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            reporter.flush()
            if health is not None:
                health.stop()
