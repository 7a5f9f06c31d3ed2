"""The node agent's reports: the classifier's verdicts on this node's logs, Xids and exits, and its health
checks' results, published as core/v1 Events (`gpuplane.kube.node_reports`) for the operator.

`NodeReporter` keeps one streaming `FailureClassifier` for its node (so escalations over repeats count) and
posts an Event for every piece of evidence a signature recognises with an action other than log-only
(tolerated lines and unmatched ones stay on the node). A tier of health checks (`health_checks.tier`) is
posted when it fails, or when it passes after a failure was posted (the operator then clears a suspect);
passing checks on a healthy node post nothing. A post the API refuses or cannot take is kept and retried
before the next one (`flush`), oldest first, up to `backlog` Events.

`run_reporter` is the loop the node agent runs in a thread: it drains a queue of findings and runs the check tier
every `check_period_s`. Findings come from `follow_file` (a log file, e.g. the kernel log whose `NVRM: Xid` lines
the classifier reads, followed as `tail -F` does), `follow_journal` (the kernel's entries of a systemd
journal, through `journalctl --follow --output=json`, on nodes that log only to journald), `follow_kernel_log`
(the first of several candidate places for the kernel log: kern.log, messages, the journal) and
`follow_command` (a child process's output, e.g. `dmesg --follow`), each on its own thread.

A followed file's read position survives the agent: each line's Finding carries the position just past it
(`LogPosition`), and `run_reporter` saves the positions of the lines it has fed and posted to a `PositionStore`
(a small JSON file, replaced atomically) after each batch. A restarted agent resumes each file where that store
says when the file is the same one (device and inode match, and it is at least that long), and reads it from
its start when it was rotated or truncated meanwhile; so a line written while the agent was down is reported
once. The one window left is a crash after a post and before the save that follows it: that batch is posted
again (at least once, never lost). A followed journal's position is its last entry's cursor, kept in the same
store: a restarted agent resumes after it (`--after-cursor`), across reboots too (the kernel's entries of every
boot are read, not `--dmesg`'s current boot only).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuplane.controllers.classifier import FailureClassifier, SignatureMatch
from gpuplane.controllers.health import HealthEvent
from gpuplane.controllers.recovery import Evidence
from gpuplane.kube.api import ApiError, KubeApi
from gpuplane.kube.events import events_path
from gpuplane.kube.node_reports import NodeReport, report_event
from gpuplane.model.failures import FailureAction
from gpuplane.node.health_checks import CheckResult, HealthCheck, run_checks, tier

log = logging.getLogger(__name__)

_REASONS = {FailureAction.ISOLATE_NODE: "FaultIsolateNode", FailureAction.RESTART_JOB: "FaultRestartJob",
            FailureAction.DO_NOT_RETRY: "FaultDoNotRetry"}
_HEALTH_REASONS = {HealthEvent.CHECK_FAILED: "HealthCheckFailed", HealthEvent.CRITICAL_FAILURE: "HealthCheckCritical",
                   HealthEvent.CHECK_PASSED: "HealthCheckPassed"}


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the node saw: a log line, an Xid or an exit (exactly the fields `Evidence` has), maybe a pod's."""

    line: str | None = None
    xid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    pod: str | None = None
    position: LogPosition | JournalPosition | None = None
    """for a followed file's line or journal entry: where it is read to once this one is done with"""


@dataclass(frozen=True, slots=True)
class LogPosition:
    """How far one followed file has been read: `offset` bytes into the file that was (`device`, `inode`)."""

    path: str
    device: int
    inode: int
    offset: int


@dataclass(frozen=True, slots=True)
class JournalPosition:
    """How far one followed systemd journal (`path`: its directory) has been read: the last entry's cursor."""

    path: str
    cursor: str


class PositionStore:
    """The followed files' read positions, kept in a JSON file across restarts of the agent.

    `advance` records a position in memory; `save` writes them all (a temporary file renamed over the old one,
    so a crash leaves the old positions or the new, never a torn file). An unreadable file reads as empty."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.positions: dict[str, LogPosition] = {}
        self.journals: dict[str, JournalPosition] = {}
        self.dirty = False
        try:
            doc = json.loads(path.read_text())
            for name, entry in (doc.get("files") or {}).items():
                self.positions[name] = LogPosition(name, int(entry["device"]), int(entry["inode"]),
                                                   int(entry["offset"]))
            for name, entry in (doc.get("journals") or {}).items():
                self.journals[name] = JournalPosition(name, str(entry["cursor"]))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("%s: unreadable (%s); every followed file starts afresh", path, exc)

    @staticmethod
    def key(path: Path) -> str:
        return os.path.abspath(path)

    def get(self, path: Path) -> LogPosition | None:
        return self.positions.get(self.key(path))

    def journal(self, directory: Path) -> JournalPosition | None:
        return self.journals.get(self.key(directory))

    def advance(self, position: LogPosition | JournalPosition) -> None:
        if isinstance(position, LogPosition):
            changed = self.positions.get(position.path) != position
            self.positions[position.path] = position
        else:
            changed = self.journals.get(position.path) != position
            self.journals[position.path] = position
        self.dirty = self.dirty or changed

    def save(self) -> None:
        """Write the positions when they changed since the last save."""
        if not self.dirty:
            return
        doc = {"version": 1, "files": {name: {"device": p.device, "inode": p.inode, "offset": p.offset}
                                       for name, p in sorted(self.positions.items())},
               "journals": {name: {"cursor": j.cursor} for name, j in sorted(self.journals.items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with temporary.open("w") as handle:
            json.dump(doc, handle, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
        self.dirty = False


class NodeReporter:
    """Publishes one node's failure verdicts and health results as Events through `api`."""

    def __init__(self, api: KubeApi, node: str, classifier: FailureClassifier, now: Callable[[], float], *,
                 instance: str | None = None, backlog: int = 1000) -> None:
        self.api = api
        self.node = node
        self.classifier = classifier
        self.now = now
        self.instance = instance or f"{node}-agent"
        self.pending: deque[tuple[NodeReport, int]] = deque(maxlen=backlog)
        self.posted: list[NodeReport] = []
        self._seq = 0
        self._failing = False
        """whether the last health tier posted was a failure"""

    # -- evidence ----------------------------------------------------------------------------------------
    def feed(self, finding: Finding) -> NodeReport | None:
        """Classify one finding; post (and return) a report when a signature acts on it."""
        t = self.now()
        match: SignatureMatch | None = None
        if finding.line is not None:
            match = self.classifier.feed_line(self.node, finding.line, t)
        elif finding.xid is not None:
            match = self.classifier.feed_xid(self.node, finding.xid, t)
        elif finding.exit_code is not None or finding.signal is not None:
            match = self.classifier.feed_exit(self.node, finding.exit_code, finding.signal, t)
        if match is None or match.action is FailureAction.LOG_ONLY:
            return None
        evidence = Evidence(self.node, line=finding.line, xid=finding.xid, exit_code=finding.exit_code,
                            signal=finding.signal, t=t)
        signature = match.signature
        verdict = {"signature": signature.id, "action": match.action.value,
                   "class": signature.failure_class.value, "blamesNode": match.blames_node,
                   "escalated": match.escalated}
        message = (f"{signature.id} ({signature.failure_class.value}): {match.action.value}"
                   f"{', blames the node' if match.blames_node else ''}: {match.evidence}")
        report = NodeReport("failure", self.node, t, _REASONS[match.action], message, (evidence,), None, verdict,
                            finding.pod)
        self.publish(report)
        return report

    def line(self, text: str, pod: str | None = None) -> NodeReport | None:
        return self.feed(Finding(line=text, pod=pod))

    def xid(self, xid: int) -> NodeReport | None:
        return self.feed(Finding(xid=xid))

    # -- health ------------------------------------------------------------------------------------------
    def checks(self, results: Sequence[CheckResult]) -> NodeReport | None:
        """Grade a tier of check results; post it when it fails, or passes after a failure."""
        verdict = tier(self.node, results)
        if verdict.event is None or (verdict.event is HealthEvent.CHECK_PASSED and not self._failing):
            return None
        self._failing = verdict.event is not HealthEvent.CHECK_PASSED
        report = NodeReport("health", self.node, self.now(), _HEALTH_REASONS.get(verdict.event, "HealthCheck"),
                            verdict.reason, (), verdict.event,
                            {"failed": list(verdict.failed)} if verdict.failed else None)
        self.publish(report)
        return report

    # -- the API -----------------------------------------------------------------------------------------
    def publish(self, report: NodeReport) -> bool:
        """Queue `report` and post everything queued, oldest first; False when something is left queued."""
        self._seq += 1
        self.pending.append((report, self._seq))
        return self.flush()

    def flush(self) -> bool:
        while self.pending:
            report, seq = self.pending[0]
            body = report_event(report, self.instance, seq=seq)
            try:
                self.api.create(events_path(body["metadata"]["namespace"]), body)
            except ApiError as exc:
                if exc.status == 409:  # posted before, its answer lost: it is there
                    self.pending.popleft()
                    continue
                log.warning("%s: posting %s failed (kept, %d queued): %s", self.node, report.reason,
                            len(self.pending), exc)
                return False
            self.pending.popleft()
            self.posted.append(report)
        return True


def run_reporter(reporter: NodeReporter, findings: queue.Queue[Finding], stop: threading.Event, *,
                 checks: Sequence[HealthCheck] = (), check_period_s: float = 300.0,
                 positions: PositionStore | None = None) -> None:
    """The node agent's reporting loop: each finding as it arrives, the check tier every `check_period_s`
    (first at once), until `stop` is set. With `positions`, the followed files' positions of the findings fed
    are saved once everything fed is posted and the queue is drained (a batch)."""
    held: dict[str, LogPosition | JournalPosition] = {}
    """positions of findings fed whose reports are not all posted yet"""

    def commit() -> None:
        if positions is None or reporter.pending:
            return
        for position in held.values():
            positions.advance(position)
        held.clear()
        if findings.empty():
            try:
                positions.save()
            except OSError as exc:  # kept in memory, saved with the next batch
                log.warning("%s: cannot save the read positions: %s", positions.path, exc)

    next_check = reporter.now()
    while not stop.is_set():
        if checks and reporter.now() >= next_check:
            reporter.checks(run_checks(checks))
            next_check = reporter.now() + check_period_s
        try:
            finding = findings.get(timeout=0.2)
        except queue.Empty:
            reporter.flush()
            commit()
            continue
        reporter.feed(finding)
        if finding.position is not None:
            held[finding.position.path] = finding.position
        commit()


def end_of(path: Path) -> LogPosition | None:
    """Where `path` ends now, as a position to resume from (None: no such file yet). Taken before a follower's
    thread starts, it fixes "from its end" at the agent's start, so a line written while the thread starts is
    not skipped."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return LogPosition(PositionStore.key(path), stat.st_dev, stat.st_ino, stat.st_size)


def follow_file(path: Path, findings: queue.Queue[Finding], stop: threading.Event, *, from_start: bool = False,
                poll_s: float = 0.5, resume: LogPosition | None = None) -> None:
    """Put each new line of `path` on `findings` until `stop`, each with the position just past it; a file
    that is truncated or replaced (log rotation) is reopened from its start. A missing file is waited for.

    It starts at `resume` when that is this file (same device and inode, and at least that long), at its
    start when `resume` is another file or a longer one (rotated or truncated since), and with no `resume` at
    its end (or its start, `from_start`)."""
    key = PositionStore.key(path)
    position: int | None = 0 if from_start else None
    inode: tuple[int, int] | None = None
    while not stop.is_set():
        try:
            stat = path.stat()
        except OSError:
            stop.wait(poll_s)
            continue
        if resume is not None:
            same = (stat.st_dev, stat.st_ino) == (resume.device, resume.inode) and stat.st_size >= resume.offset
            position = resume.offset if same else 0
            resume = None
        elif inode is not None and ((stat.st_dev, stat.st_ino) != inode or stat.st_size < (position or 0)):
            position = 0  # rotated or truncated
        inode = (stat.st_dev, stat.st_ino)
        if position is None:
            position = stat.st_size
        if stat.st_size > position:
            with path.open("rb") as handle:
                handle.seek(position)
                chunk = handle.read()
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                raw = chunk[start:end].rstrip(b"\r")
                findings.put(Finding(line=raw.decode("utf-8", "replace"),
                                     position=LogPosition(key, inode[0], inode[1], position + end + 1)))
                start = end + 1
            position += start
        stop.wait(poll_s)


def follow_command(argv: Sequence[str], findings: queue.Queue[Finding], stop: threading.Event, *,
                   restart_s: float = 5.0) -> None:
    """Run `argv` as a child process and put each line it prints on `findings`; restart it when it ends, until
    `stop` (which terminates it)."""
    while not stop.is_set():
        try:
            child = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as exc:
            log.warning("%s: cannot start: %s", argv[0], exc)
            stop.wait(restart_s)
            continue
        watcher = threading.Thread(target=_terminate_on_stop, args=(child, stop), daemon=True)
        watcher.start()
        assert child.stdout is not None
        for raw in child.stdout:
            findings.put(Finding(line=raw.decode("utf-8", "replace").rstrip("\n")))
        child.wait()
        if not stop.is_set():
            log.warning("%s ended (exit %s); restarting in %g s", argv[0], child.returncode, restart_s)
            stop.wait(restart_s)


KERNEL_MATCH = "_TRANSPORT=kernel"
"""the journal's kernel messages, of every boot (`--dmesg` would keep to the current boot)"""


def journal_end(directory: Path, *, journalctl: str = "journalctl") -> JournalPosition | None:
    """The cursor of the journal's last kernel entry now, to resume after (None: no kernel entry yet). Taken
    before a follower's thread starts, as `end_of` for a file. Raises `OSError` when journalctl cannot run,
    `ValueError` when it fails (its message)."""
    for raw in _journal_lines(journalctl, directory, ["--lines=1"], timeout_s=60):
        cursor = (_journal_entry(raw) or {}).get("__CURSOR")
        if isinstance(cursor, str):
            return JournalPosition(PositionStore.key(directory), cursor)
    return None


def _journal_lines(journalctl: str, directory: Path, options: list[str], *, timeout_s: float) -> list[bytes]:
    """journalctl's JSON lines for the journal's kernel entries (not following); `ValueError` when it fails."""
    done = subprocess.run([journalctl, "--directory", str(directory), "--output=json", "--no-pager", *options,
                           KERNEL_MATCH], capture_output=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise ValueError(f"journalctl --directory {directory}: {_stderr(done.stderr)}")
    return done.stdout.splitlines()


def read_journal(directory: Path, *, journalctl: str = "journalctl") -> list[str]:
    """Every kernel entry's message in the journal in `directory`, oldest first (`--once`). Raises `OSError`
    when journalctl cannot run, `ValueError` when it fails (its message)."""
    messages = (_journal_message((_journal_entry(raw) or {}).get("MESSAGE"))
                for raw in _journal_lines(journalctl, directory, ["--all"], timeout_s=600))
    return [m for m in messages if m is not None]


def follow_journal(directory: Path, findings: queue.Queue[Finding], stop: threading.Event, *,
                   resume: JournalPosition | None = None, from_start: bool = False, journalctl: str = "journalctl",
                   restart_s: float = 5.0) -> None:
    """Put each new kernel entry of the systemd journal in `directory` (the host's /var/log/journal or
    /run/log/journal) on `findings`, each with its cursor, until `stop`: `journalctl --follow --output=json` as
    a child process, restarted after the last entry it gave when it ends.

    It starts after `resume` (a cursor saved by an earlier agent), else at the journal's end (its start,
    `from_start`). A cursor journalctl refuses (a corrupt state file) is replaced by the time in it, when it has
    one (`--since`), and by the journal's end when not, with a warning either way."""
    key = PositionStore.key(directory)
    cursor = resume.cursor if resume is not None else None
    since: str | None = None
    while not stop.is_set():
        argv = [journalctl, "--directory", str(directory), "--follow", "--output=json", "--all", "--no-pager"]
        if cursor is not None:
            argv += ["--after-cursor", cursor]
        elif since is not None:
            argv += ["--since", since]
        else:
            argv.append("--lines=all" if from_start else "--lines=0")
        argv.append(KERNEL_MATCH)
        try:
            returncode, given, last, error = _journalctl_run(argv, key, findings, stop)
        except OSError as exc:
            log.warning("%s: cannot start: %s", journalctl, exc)
            stop.wait(restart_s)
            continue
        if last is not None:
            cursor, since = last, None
        if stop.is_set():
            return
        if returncode != 0 and given == 0 and cursor is not None and "cursor" in error.lower():
            since = _cursor_time(cursor)
            log.warning("%s: journalctl refused the saved cursor (%s); reading from %s", directory, error,
                        f"its time ({since})" if since else "the journal's end")
            cursor = None
        log.warning("journalctl --directory %s ended (exit %s%s); restarting in %g s", directory,
                    returncode, f": {error}" if error else "", restart_s)
        stop.wait(restart_s)


def is_journal(directory: Path) -> bool:
    """Whether `directory` holds systemd journal files (`*.journal`, or in its machine-id subdirectory)."""
    try:
        return directory.is_dir() and (any(directory.glob("*.journal")) or any(directory.glob("*/*.journal")))
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class KernelLog:
    """Where the node's kernel log is (a file, or a directory of journal files) and where to start reading it."""

    path: Path
    journal: bool
    """a directory of systemd journal files (else a log file)"""
    resume: LogPosition | JournalPosition | None
    from_start: bool


def find_kernel_log(candidates: Sequence[Path], positions: PositionStore, *, from_start: bool = False,
                    journalctl: str = "journalctl") -> KernelLog | None:
    """The first of `candidates` that is there now, with its saved position in `positions`, else its end as it is
    now (its start, `from_start`; a journal with no kernel entry yet, its start). None: none is there. Taken before
    the follower's thread starts, as `end_of`, so what is logged while it starts is not skipped."""
    for path in candidates:
        if path.is_file():
            return KernelLog(path, False, positions.get(path) or (None if from_start else end_of(path)), from_start)
        if is_journal(path):
            saved = positions.journal(path)
            try:
                end = None if saved is not None or from_start else journal_end(path, journalctl=journalctl)
            except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
                log.warning("%s: cannot read the journal: %s", path, exc)
                continue
            return KernelLog(path, True, saved or end, from_start or (saved is None and end is None))
    return None


def follow_kernel_log(candidates: Sequence[Path], findings: queue.Queue[Finding], stop: threading.Event, *,
                      positions: PositionStore, from_start: bool = False, journalctl: str = "journalctl",
                      found: KernelLog | None = None, poll_s: float = 30.0, file_poll_s: float = 0.5) -> Path | None:
    """Follow the node's kernel log until `stop`: `found`, else the first of `candidates` there is
    (`find_kernel_log`; while none is there, look again every `poll_s`, with one warning); a file as
    `follow_file` does, a journal as `follow_journal` does. Returns the one followed (None: stopped first)."""
    warned = False
    while found is None and not stop.is_set():
        found = find_kernel_log(candidates, positions, from_start=from_start, journalctl=journalctl)
        if found is None:
            if not warned:
                log.warning("no kernel log yet (looked for %s); looking again every %g s",
                            ", ".join(map(str, candidates)), poll_s)
                warned = True
            stop.wait(poll_s)
    if found is None:
        return None
    if found.journal:
        resume = found.resume if isinstance(found.resume, JournalPosition) else None
        follow_journal(found.path, findings, stop, resume=resume, from_start=found.from_start, journalctl=journalctl)
    else:
        at = found.resume if isinstance(found.resume, LogPosition) else None
        follow_file(found.path, findings, stop, from_start=found.from_start, poll_s=file_poll_s, resume=at)
    return found.path


def _journalctl_run(argv: list[str], key: str, findings: queue.Queue[Finding],
                    stop: threading.Event) -> tuple[int, int, str | None, str]:
    """One journalctl child until it ends or `stop`: its exit status, the entries it gave, the last one's cursor,
    and what it said on stderr (kept in a file, read once it ends: a pipe nobody reads could fill and block it)."""
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors)
        watcher = threading.Thread(target=_terminate_on_stop, args=(child, stop), daemon=True)
        watcher.start()
        assert child.stdout is not None
        given, last = 0, None
        for raw in child.stdout:
            entry = _journal_entry(raw)
            at = None if entry is None else entry.get("__CURSOR")
            if entry is None or not isinstance(at, str):
                log.warning("%s: an entry without a cursor, skipped: %.200r", key, raw)
                continue
            given, last = given + 1, at
            text = _journal_message(entry.get("MESSAGE"))
            if text is not None:
                findings.put(Finding(line=text, position=JournalPosition(key, at)))
        child.wait()
        errors.seek(0)
        return child.returncode, given, last, _stderr(errors.read())


def _journal_entry(raw: bytes) -> dict[str, object] | None:
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _journal_message(value: object) -> str | None:
    """journalctl's JSON gives a field as a string, or as an array of byte values when it is not UTF-8 text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value).decode("utf-8", "replace").rstrip("\n")
    return None


def _cursor_time(cursor: str) -> str | None:
    """`@seconds` (journalctl's timestamp syntax) from a cursor's realtime field `t=` (hex microseconds)."""
    for part in cursor.split(";"):
        name, _, value = part.partition("=")
        if name == "t":
            try:
                return f"@{int(value, 16) // 1_000_000}"
            except ValueError:
                return None
    return None


def _stderr(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").strip().replace("\n", "; ")


def _terminate_on_stop(child: subprocess.Popen[bytes], stop: threading.Event) -> None:
    while child.poll() is None:
        if stop.wait(0.2):
            child.terminate()
            return


def drain(reporter: NodeReporter, findings: queue.Queue[Finding], *, settle_s: float = 0.0) -> int:
    """Feed every finding queued now (waiting `settle_s` for stragglers first); returns how many."""
    if settle_s:
        time.sleep(settle_s)
    count = 0
    while True:
        try:
            finding = findings.get_nowait()
        except queue.Empty:
            return count
        reporter.feed(finding)
        count += 1
