"""The failure classifier: a signature library applied to streams of log lines, Xid events and exit codes.

Feed it everything a failed job left behind, on every node (`feed_line`, `feed_xid`, `feed_exit`), then ask
for the `verdict()`: the first error wins (fault-tolerance.md §4.1), later errors are echoes. "First" is
a window, not an instant (`cause_window_s`, 2 minutes): clocks and log pipelines differ by seconds, and a
failing GPU's rank often logs its CUDA error before the kernel's Xid line; among the matches within the
window of the earliest, the most severe is the cause.

Speed. Almost every line matches nothing, so an unmatched line costs one `re.search` of a prefilter: a trie
of literals, one that every match of each signature must contain (`Signature.literals`, extracted from the
parsed pattern), each trimmed to start at a character that is rare in logs so the regex engine's first-
character scan skips most positions. Only lines that pass the prefilter are decoded and tried against the
signatures whose literals they contain. Unmatched lines are counted by template (numbers -> `N`, hex ids
-> `X`); the template of a line is cached under the line with its digits and hex letters folded, and a new
key first tries its shape (`key_shape`: whole numbers of any width made one word), so the normalising regexes
run once per new shape of line, not once per line. `feed_lines` does the same for a batch: one scan of the
joined batch (Hyperscan over the same literals when installed), the keys folded and split in two C calls, the
lines counted at once.

Bad input never raises: bytes are decoded with errors="replace" and only when a line passed the prefilter,
lines are cut to `max_line_bytes` (counted in `stats().truncated_lines`), NUL bytes are just bytes.

Controllers layer: imports the model only.
"""

from __future__ import annotations

import calendar
import re
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from operator import add
from typing import Any

import numpy as np

try:  # a multi-literal scanner in C; without it the batch scan runs the prefilter regex over the batch
    import hyperscan as _hyperscan
except ImportError:  # pragma: no cover - a platform without its wheel
    _hyperscan = None  # type: ignore[assignment]

from gpuplane.model.failures import (
    EXIT_LINE,
    PREFILTER_KEEP,
    SIGNAL_LINE,
    XID_LINE,
    XID_NAMED,
    XID_PROCESS,
    Amendment,
    FailureAction,
    FailureClass,
    Signature,
    SignatureLibrary,
    char_cost,
    line_events,
    literal_cost,
    required_literals,
)

INF = float("inf")
#: Matches within this many seconds of an incident's earliest one compete for its cause by severity
#: (fault-tolerance reference §4.1 "in a window around the first failure ... rank by severity and earliest
#: timestamp"; §4.3 #17: a hardware Xid within ±2 min of a CUDA error makes it a hardware failure).
CAUSE_WINDOW_S = 120.0
#: A blaming signature seen on every node of an incident of at least this many nodes blames none of them
#: (the same error everywhere at once is the fabric, the configuration or the job, not a node).
EVERYWHERE_NODES = 3
#: Lines per `feed_lines` call that readers of whole logs use (the CLI, the benchmark): enough to amortise the
#: call, few enough that the joined batch stays in cache.
BATCH_LINES = 2048
#: Stands for a matched line among a batch's templates.
_MATCHED = object()
#: Characters of an unmatched line that make its template.
TEMPLATE_CHARS = 160
#: Characters of a matched line kept as evidence.
EVIDENCE_CHARS = 512
#: The template cache's key: the line with digits and hex letters folded, so lines that differ only in
#: numbers and hex ids share one entry (and, rarely, lines that differ only in letters a-f at the same places).
_FOLD = bytes.maketrans(b"123456789abcdefABCDEF", b"000000000aaaaaaAAAAAA")
_KEY_CACHE = 1 << 16
#: A shape of the folded key: the whole words whose template is one token whatever their length (digits -> N;
#: hex with a digit, 0x... -> X) made one canonical word, so that keys differing only in the widths and digit
#: patterns of such numbers share one template. Words next to `.`, `+` or `-` are left alone (a decimal or an
#: exponent could take them in).
_SHAPE_HEX = re.compile(rb"(?<![0-9A-Za-z.+\-])(?:0[xX][0aA]+|(?=[0aA]*0)[0aA]*[aA][0aA]*)(?![0-9A-Za-z.])")
_SHAPE_DIGITS = re.compile(rb"0(?<![0-9A-Za-z.+\-]0)0*(?![0-9A-Za-z.])")  # lookbehind after the 0: scans faster
_DECIMAL = re.compile(rb"[0-9]+\.[0-9]+(?:[eE][-+]?[0-9]+)?")
_WORD = re.compile(rb"[0-9A-Za-z]+")
_HEX_RUN = re.compile(rb"(?=[0-9a-fA-F]{0,63}[0-9])[0-9a-fA-F]{6,}")
_DIGIT_RUN = re.compile(rb"[0-9]+")
#: whole words (runs of letters and digits) of digits only, and of hex digits with a digit or after 0x
_WHOLE_DIGITS = re.compile(rb"(?<![0-9A-Za-z])[0-9]+(?![0-9A-Za-z])")
_WHOLE_HEX = re.compile(rb"(?<![0-9A-Za-z])(?:0[xX][0-9a-fA-F]+|(?=[a-fA-F]*[0-9])[0-9a-fA-F]+)(?![0-9A-Za-z])")
_BLANKS = re.compile(rb"[ \t]+")
_HEX_CHARS = frozenset(b"0123456789abcdefABCDEF")


@dataclass(frozen=True, slots=True)
class SignatureMatch:
    """One piece of evidence a signature recognised.

    `t` is the time given (or read from the line, or the node's last known time; None when unknown),
    `seq` the feed order, `action` the signature's action or, when it repeated enough, its escalation's.
    """

    signature: Signature
    node: str
    t: float | None
    seq: int
    action: FailureAction
    evidence: str
    escalated: bool = False
    echo: bool = False
    """an echo: its signature's `echo`, or a signature of its `echo_after` matched earlier on its node"""
    reclassified: FailureClass | None = None
    """the class a `device_repeat` gave it (None: its signature's)"""

    @property
    def failure_class(self) -> FailureClass:
        return self.signature.failure_class if self.reclassified is None else self.reclassified

    @property
    def blames_node(self) -> bool:
        """Whether this match blames its node: a blaming signature (or an escalation to isolate-node) that
        is neither tolerated (log-only) nor an echo nor a fallback."""
        if self.action is FailureAction.LOG_ONLY or self.echo or self.signature.fallback:
            return False
        return self.signature.blame_node or (self.escalated and self.action is FailureAction.ISOLATE_NODE)

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature.id, "node": self.node, "t": self.t, "seq": self.seq,
                "action": self.action.value, "class": self.failure_class.value,
                "escalated": self.escalated, "echo": self.echo, "evidence": self.evidence}


@dataclass(frozen=True, slots=True)
class Classification:
    """The verdict on one incident.

    `signature`/`cause` is the first error (None: nothing but tolerated or no evidence matched; then the
    action is restart-job and the failure counts as unknown). `blamed_nodes` lists every node a blaming
    match was seen on, the earliest first (the cause's node first when the cause blames one).
    `matches` is the evidence in feed order (the first `max_matches` of the incident).
    """

    signature: Signature | None
    action: FailureAction
    failure_class: FailureClass | None
    blamed_nodes: tuple[str, ...]
    matches: tuple[SignatureMatch, ...]
    cause: SignatureMatch | None = None

    @property
    def unknown(self) -> bool:
        return self.signature is None

    def to_dict(self) -> dict[str, Any]:
        return {"signature": None if self.signature is None else self.signature.id,
                "description": None if self.signature is None else self.signature.description,
                "action": self.action.value,
                "class": None if self.failure_class is None else self.failure_class.value,
                "blamed_nodes": list(self.blamed_nodes), "unknown": self.unknown,
                "critical": bool(self.signature is not None and self.signature.critical),
                "cause": None if self.cause is None else self.cause.to_dict(),
                "matches": [m.to_dict() for m in self.matches]}


@dataclass(frozen=True, slots=True)
class UnmatchedTemplate:
    template: str
    count: int


@dataclass(frozen=True, slots=True)
class ClassifierStats:
    """Counters since the classifier was made (`reset()` keeps them).

    `dropped_templates`/`dropped_template_lines`: templates (and their lines) pushed out of the bounded
    unmatched report by more frequent ones; a template that comes back starts counting again from zero.
    """

    lines: int
    matched_lines: int
    unmatched_lines: int
    truncated_lines: int
    candidate_lines: int
    events: int
    matched_events: int
    incidents: int
    unknown_failures: int
    unmatched_templates: int
    dropped_templates: int
    dropped_template_lines: int
    dropped_matches: int


class FailureClassifier:
    """Streaming classification of one incident at a time; see the module docstring.

    `line_time(text)`, when given, reads a timestamp out of a matched line fed without `t` (e.g.
    `line_timestamp`); otherwise such a match takes its node's last known time. Matches with no time at
    all rank after every dated one.
    """

    def __init__(self, library: SignatureLibrary, *, max_line_bytes: int = 4096, max_templates: int = 1000,
                 max_matches: int = 10_000, line_time: Callable[[str], float | None] | None = None,
                 cause_window_s: float = CAUSE_WINDOW_S) -> None:
        if max_line_bytes < 64 or max_templates < 1 or max_matches < 1:
            raise ValueError("max_line_bytes must be at least 64, max_templates and max_matches at least 1")
        if not cause_window_s >= 0:
            raise ValueError(f"cause_window_s must be a number >= 0, got {cause_window_s!r}")
        self._window = cause_window_s
        self.library = library
        self._cap = max_line_bytes
        self._max_templates = max_templates
        self._max_matches = max_matches
        self._line_time = line_time
        self._patterns: list[Signature] = [s for s in library if s.regex is not None]
        owned: list[tuple[str, bool, int]] = [
            (text, ci, i) for i, s in enumerate(self._patterns) for text, ci in s.literals]
        owned += [(text, ci, STRUCTURED) for rx in (XID_LINE, XID_NAMED, EXIT_LINE, SIGNAL_LINE)
                  for text, ci in required_literals(rx.pattern)]
        self._order = {s.id: i for i, s in enumerate(library)}
        self.prefilter = Prefilter(owned)
        self._search = self.prefilter.regex.search
        # counters (kept across incidents)
        self._lines = 0
        self._matched_lines = 0
        self._truncated = 0
        self._candidates = 0
        self._events = 0
        self._matched_events = 0
        self._incidents = 0
        self._unknown_failures = 0
        self._dropped_templates = 0
        self._dropped_template_lines = 0
        self._dropped_matches = 0
        self._seq = 0
        self._counts: dict[bytes, int] = {}
        self._cache: dict[bytes, bytes] = {}
        self._shapes: dict[bytes, bytes] = {}
        """`key_shape` of a template key -> the template"""
        # escalation history: (scope, signature id, node) -> times; survives reset(). A signature that does
        # not blame its node counts for the job wherever it runs (node ""): a code fault follows the job.
        self._history: dict[tuple[str, str, str], list[float]] = {}
        self._scope = ""
        self._devices: dict[tuple[str, str, str], dict[str, float]] = {}
        """`device_repeat` history: (signature id, node, GPU) -> the latest time of each process that faulted"""
        self._nodes: set[str] = set()
        """the nodes the incident's lines and events came from"""
        self._spread: dict[str, set[str]] = {}
        """per blaming signature, the nodes it was seen on"""
        # the incident (see _reset_incident)
        self._matches: list[SignatureMatch] = []
        self._earliest: tuple[dict[int, tuple[float, int, SignatureMatch]], ...] = ({}, {}, {})
        """per group (causes, echoes, fallbacks): severity -> the earliest (time, seq, match) of that severity"""
        self._seen: set[tuple[str, str]] = set()
        """(node, signature id) of the incident's matches, for `echo_after`"""
        self._amends: list[Amendment] = []
        """the amendments of the incident's matches (`Signature.amends`)"""
        self._explained: set[str] = set()
        """the signatures the incident's matches explain (`Signature.explains`)"""
        self._blame: dict[str, tuple[float, int, int]] = {}
        self._counted: set[tuple[str, str, str]] = set()
        self._last_t: dict[str, float] = {}
        self._unknown_counted = False

    # ----------------------------------------------------------------------------------------------- feeding

    def feed_line(self, node: str, line: bytes | str, t: float | None = None) -> SignatureMatch | None:
        """Classify one log line of `node`; the match, or None (the line is then counted as unmatched)."""
        if line.__class__ is not bytes:
            line = _as_bytes(line, self._cap)
        self._lines += 1
        self._nodes.add(node)
        if len(line) > self._cap:
            line = line[:self._cap]
            self._truncated += 1
        if t is not None:
            self._last_t[node] = t
        hit = self._search(line)
        if hit is not None:
            found = self._classify(node, line, t, self.prefilter.owners_of(line, hit))
            if found is not None:
                return found
        key = line.translate(_FOLD)
        template = self._cache.get(key)
        if template is None:
            template = self._new_template(key, line)
        self._counts[template] += 1
        return None

    def feed_lines(self, node: str | Sequence[str], lines: Sequence[bytes | str]) -> list[SignatureMatch]:
        """`feed_line(node, line)` for each line in order, without times (`line_time` still reads them), and
        the matches: the same evidence, counters and unmatched report, faster. `node` names one node for all
        the lines or one node per line. The batch is joined and the prefilter scans it once (with Hyperscan
        when it is installed: the same literals, every occurrence reported, so each line is scanned once);
        only the lines it hits are decoded and classified, the rest are counted by template at once."""
        count = len(lines)
        nodes: Sequence[str] | None = None
        only = ""
        if isinstance(node, str):
            only = node
            self._nodes.add(node)
        else:
            if len(node) != count:
                raise ValueError(f"{len(node)} nodes for {count} lines")
            nodes = node
            self._nodes.update(node)
        if not count:
            return []
        cap = self._cap
        self._lines += count
        batch: Sequence[Any] = lines
        joined: bytes | None
        try:
            joined = b"\n".join(batch)  # bytes-like lines only; a str (or worse) is converted first
        except TypeError:
            batch = [line if line.__class__ is bytes else _as_bytes(line, cap) for line in batch]
            joined = None
        if max(map(len, batch)) > cap:
            self._truncated += sum(1 for line in batch if len(line) > cap)
            batch = [line[:cap] for line in batch]
            joined = None
        if joined is None:
            joined = b"\n".join(batch)
        hits = self.prefilter.scan_lines(batch, joined)
        # the template keys of the whole batch in two C calls, unless a line holds a newline of its own
        folded = joined.translate(_FOLD)
        keys = folded.split(b"\n")
        if len(keys) != count:  # a line holds a newline of its own
            keys = [bytes(line).translate(_FOLD) for line in batch]
        matches: list[SignatureMatch] = []
        matched: list[int] = []
        for index, owners in hits:
            found = self._classify(only if nodes is None else nodes[index], bytes(batch[index]), None, owners)
            if found is not None:
                matches.append(found)
                matched.append(index)
        self._count_templates(batch, keys, matched)
        return matches

    def _count_templates(self, lines: Sequence[Any], keys: list[bytes], matched: list[int]) -> None:
        """Count the unmatched lines (all but `matched`) by template as `feed_line` does one by one: the
        templates of new keys are made in line order, then the lines are counted at once (a prune or a cache
        clear in between would see other counts, so a batch that could cause one is counted line by line)."""
        cache = self._cache
        templates: list[Any] = list(map(cache.get, keys))
        for index in matched:
            templates[index] = _MATCHED
        misses = templates.count(None)
        if misses:
            if (len(self._counts) + misses >= 2 * self._max_templates or len(cache) + misses >= _KEY_CACHE
                    or len(self._shapes) + misses >= _KEY_CACHE):
                for line, key, known in zip(lines, keys, templates, strict=True):
                    if known is not _MATCHED:
                        template = cache.get(key)
                        if template is None:
                            template = self._new_template(key, bytes(line))
                        self._counts[template] += 1
                return
            at = -1
            for _ in range(misses):
                at = templates.index(None, at + 1)
                known = cache.get(keys[at])
                templates[at] = self._new_template(keys[at], bytes(lines[at])) if known is None else known
        tally = Counter(templates)
        tally.pop(_MATCHED, None)
        counts = self._counts
        for template, times in tally.items():
            counts[template] += times

    def feed_xid(self, node: str, xid: int, t: float | None = None) -> SignatureMatch | None:
        """An Xid event (e.g. from NVML) on `node`."""
        self._events += 1
        self._nodes.add(node)
        signature = self.library.by_xid(xid)
        if signature is None:
            self._count_event(f"Xid {xid}: no signature")
            return None
        self._matched_events += 1
        return self._record(signature, node, t, f"Xid {xid}", None)

    def feed_exit(self, node: str, exit_code: int | None, signal: str | None = None,
                  t: float | None = None) -> SignatureMatch | None:
        """A process exit on `node`: an exit code (negative: torchrun's killed-by-signal form) and/or a
        signal name. Exit code 0 without a signal is success and ignored."""
        if not exit_code and signal is None:
            return None
        self._events += 1
        self._nodes.add(node)
        signature = self.library.resolve_exit(exit_code, signal)
        what = f"exit code {exit_code}" if exit_code else f"signal {signal}"
        if signature is None:
            self._count_event(f"{what}: no signature")
            return None
        self._matched_events += 1
        return self._record(signature, node, t, what, None)

    # ------------------------------------------------------------------------------------------------ verdict

    def verdict(self) -> Classification:
        """The incident's classification so far (an unknown verdict is counted once per incident).

        Across nodes: a blaming signature seen on every node of the incident (three or more) is not a node
        fault (an InfiniBand completion error on every node at start-up is the fabric or the configuration):
        it blames no node, and as the cause it restarts the job. When the cause's signature escalated later in
        the incident on the cause's node, the escalated match is the cause (`_escalated`). A tolerated line that
        amends the cause's signature (`Signature.amends`), seen on any node of the incident, gives the cause its
        more severe action (a node bootstrapping NCCL on a docker bridge makes its peers' connects to it fail
        too)."""
        everywhere = self._everywhere()
        unblamed = everywhere | self._explained
        blame = self._blame if not unblamed else self._blame_without(unblamed)
        blamed = tuple(sorted(blame, key=blame.__getitem__))
        cause = self._pick_cause()
        if cause is not None:
            cause = self._escalated(cause)
        if cause is None:
            if not self._unknown_counted:
                self._unknown_counted = True
                self._unknown_failures += 1
            return Classification(None, FailureAction.RESTART_JOB, None, blamed, tuple(self._matches))
        action = cause.action
        if cause.signature.id in everywhere and action is FailureAction.ISOLATE_NODE:
            action = FailureAction.RESTART_JOB
        for amendment in self._amends:
            if cause.signature.id in amendment.signatures and amendment.action.severity > action.severity:
                action = amendment.action
        return Classification(cause.signature, action, cause.failure_class, blamed,
                              tuple(self._matches), cause)

    def reset(self, *, forget_history: bool = False, scope: str = "") -> None:
        """Start the next incident. Counters and the unmatched report stay; so does the escalation history
        (repeats across incidents are what `per: incident` escalations count) unless `forget_history`.
        `scope` names whose incidents these are (a job): repeats count within a scope only."""
        self._incidents += 1
        self._reset_incident()
        self._scope = scope
        if forget_history:
            self._history.clear()
            self._devices.clear()

    @property
    def unknown_failures(self) -> int:
        """Incidents whose verdict found no cause."""
        return self._unknown_failures

    def stats(self) -> ClassifierStats:
        return ClassifierStats(
            lines=self._lines, matched_lines=self._matched_lines, unmatched_lines=self._lines - self._matched_lines,
            truncated_lines=self._truncated, candidate_lines=self._candidates, events=self._events,
            matched_events=self._matched_events, incidents=self._incidents + 1,
            unknown_failures=self._unknown_failures, unmatched_templates=len(self._counts),
            dropped_templates=self._dropped_templates, dropped_template_lines=self._dropped_template_lines,
            dropped_matches=self._dropped_matches)

    def unmatched_report(self, top: int | None = None) -> list[UnmatchedTemplate]:
        """Unmatched line templates (`normalise_line` of the first 160 bytes) with their counts, the
        most frequent first, at most `max_templates` (or `top`): new problems to write signatures for."""
        limit = self._max_templates if top is None else min(top, self._max_templates)
        ranked = sorted(self._counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        return [UnmatchedTemplate(t.decode("utf-8", "replace"), n) for t, n in ranked if n > 0]

    # -------------------------------------------------------------------------------------------- internals

    def _everywhere(self) -> set[str]:
        """Blaming signatures seen on every node of the incident, when it has `EVERYWHERE_NODES` or more (two
        nodes blaming each other are the two sides of one link: both go, reference §4.3 #25)."""
        nodes = self._nodes
        if len(nodes) < EVERYWHERE_NODES:
            return set()
        return {sid for sid, seen in self._spread.items() if seen >= nodes}

    def _blame_without(self, signatures: set[str]) -> dict[str, tuple[float, int, int]]:
        """The blame of each node from its blaming matches other than `signatures`."""
        blame: dict[str, tuple[float, int, int]] = {}
        for m in self._matches:
            if m.blames_node and m.signature.id not in signatures:
                entry = (INF if m.t is None else m.t, -m.action.severity, m.seq)
                if m.node not in blame or entry < blame[m.node]:
                    blame[m.node] = entry
        return blame

    def _reset_incident(self) -> None:
        self._nodes = set()
        self._spread = {}
        self._matches = []
        self._earliest = ({}, {}, {})
        self._seen = set()
        self._amends = []
        self._explained = set()
        self._blame = {}
        self._counted = set()
        self._last_t = {}
        self._unknown_counted = False

    def _classify(self, node: str, line: bytes, t: float | None, owners: set[int]) -> SignatureMatch | None:
        """Try the signatures of `owners` (a superset of those whose literals occur in `line`)."""
        self._candidates += 1
        text = line.decode("utf-8", "replace")
        best: Signature | None = None
        best_rank: tuple[int, int, bool, int] | None = None
        for owner in owners:
            if owner == STRUCTURED:
                continue
            signature = self._patterns[owner]
            regex = signature.regex
            if regex is not None and regex.search(text) is not None:
                rank = self._rank(signature, structured=False)
                if _better(signature, rank, best, best_rank):
                    best, best_rank = signature, rank
        events = line_events(text) if STRUCTURED in owners else []
        for kind, value in events:
            if kind == "xid":
                found = self.library.by_xid(int(value))
            elif kind == "exit":
                found = self.library.resolve_exit(int(value))
            else:
                found = self.library.resolve_exit(None, str(value))
            if found is not None:
                rank = self._rank(found, structured=True)
                if _better(found, rank, best, best_rank):
                    best, best_rank = found, rank
        if best is None:
            return None
        self._matched_lines += 1
        return self._record(best, node, t, text.rstrip("\r\n")[:EVIDENCE_CHARS], text)

    def _rank(self, signature: Signature, *, structured: bool) -> tuple[int, int, bool, int]:
        """Which of several signatures matching one line speaks for it: a cause before an echo before a
        fallback, the more severe, an Xid/exit/signal reading before a pattern, the earlier in the library."""
        return (-_group(signature), signature.action.severity, structured, -self._order[signature.id])

    def _record(self, signature: Signature, node: str, t: float | None, evidence: str,
                text: str | None) -> SignatureMatch:
        if t is None and text is not None and self._line_time is not None:
            t = self._line_time(text)
            if t is not None:
                self._last_t[node] = t
        if t is None:
            t = self._last_t.get(node)
        if t is not None and t != t:  # NaN: no usable time
            t = None
        when = INF if t is None else t
        action, escalated = signature.action, False
        escalation = signature.escalate
        if escalation is not None:
            key = (self._scope, signature.id, node if signature.blame_node else "")
            times = self._history.setdefault(key, [])
            if escalation.per == "event" or key not in self._counted:
                self._counted.add(key)
                times.append(when)
            if when != INF:
                horizon = when - escalation.window_s
                times[:] = [x for x in times if not x < horizon]
            times.sort()
            del times[:-escalation.count]  # the latest `count` are all that can matter
            if len(times) >= escalation.count:
                action, escalated = escalation.action, True
        reclassified = None
        repeat = signature.device_repeat
        if repeat is not None and text is not None and (found := XID_PROCESS.search(text)) is not None:
            pids = self._devices.setdefault((signature.id, node, found.group(1)), {})
            pids[found.group(2)] = when
            if when != INF:
                for pid in [pid for pid, at in pids.items() if at < when - repeat.window_s]:
                    del pids[pid]
            if len(pids) > repeat.processes:  # the latest `processes` are all that can matter
                del pids[min(pids, key=pids.__getitem__)]
            if len(pids) >= repeat.processes:
                action, escalated, reclassified = repeat.action, True, repeat.failure_class
        echo = signature.echo or any((node, sid) in self._seen for sid in signature.echo_after)
        self._seen.add((node, signature.id))
        if signature.amends is not None:
            self._amends.append(signature.amends)
        self._explained.update(signature.explains)
        seq = self._seq
        self._seq += 1
        match = SignatureMatch(signature, node, t, seq, action, evidence, escalated, echo, reclassified)
        if len(self._matches) < self._max_matches:
            self._matches.append(match)
        else:
            self._dropped_matches += 1
        if action is not FailureAction.LOG_ONLY:
            group = self._earliest[1 if echo else _group(signature)]
            _keep_earliest(group, when, match)
            if match.blames_node:
                self._spread.setdefault(signature.id, set()).add(node)
                blame = (when, -action.severity, seq)
                if node not in self._blame or blame < self._blame[node]:
                    self._blame[node] = blame
        return match

    def _escalated(self, cause: SignatureMatch) -> SignatureMatch:
        """The cause, or the first later match of its signature on its node that repetition escalated to a more
        severe action: the repeat speaks for the cause (three processes faulting on one GPU over an hour make
        the first fault's verdict the device's, not the application's)."""
        best = cause
        for m in self._matches:
            if (m.escalated and m.signature is cause.signature and m.node == cause.node
                    and m.action.severity > best.action.severity):
                best = m
        return best

    def _pick_cause(self) -> SignatureMatch | None:
        """The first error: among the matches within `cause_window_s` of the earliest, the most severe
        (the earliest of that severity); echoes only when nothing else matched, fallbacks only when nothing
        but fallbacks did. Matches of signatures that another match explains do not compete (the groups are
        then made again from the matches kept)."""
        groups = self._earliest
        if self._explained:
            groups = ({}, {}, {})
            for m in self._matches:
                if m.action is FailureAction.LOG_ONLY or m.signature.id in self._explained:
                    continue
                group = groups[1 if m.echo else _group(m.signature)]
                _keep_earliest(group, INF if m.t is None else m.t, m)
        for group in groups:
            if group:
                first = min(when for when, _, _ in group.values())
                limit = first + self._window
                return group[max(sev for sev, (when, _, _) in group.items() if when <= limit)][2]
        return None

    def _new_template(self, key: bytes, line: bytes) -> bytes:
        """The template of `line` (cached under `key`, its folded prefix)."""
        shape = key_shape(key[:TEMPLATE_CHARS])
        template = self._shapes.get(shape)
        if template is None:
            template = normalise_line(line[:TEMPLATE_CHARS])
            if len(self._shapes) >= _KEY_CACHE:
                self._shapes.clear()
            self._shapes[shape] = template
        if template not in self._counts:
            if len(self._counts) >= 2 * self._max_templates:
                self._prune()
            self._counts[template] = 0
        if len(self._cache) >= _KEY_CACHE:
            self._cache.clear()
        self._cache[key] = template
        return template

    def _prune(self) -> None:
        """Keep the `max_templates` most frequent templates; forget the cache so dropped ones re-enter."""
        ranked = sorted(self._counts.items(), key=lambda kv: -kv[1])
        kept = dict(ranked[:self._max_templates])
        self._dropped_templates += len(ranked) - len(kept)
        self._dropped_template_lines += sum(n for _, n in ranked[self._max_templates:])
        self._counts = kept
        self._cache.clear()

    def _count_event(self, template: str) -> None:
        key = template.encode()
        if key not in self._counts:
            if len(self._counts) >= 2 * self._max_templates:
                self._prune()
            self._counts[key] = 0
        self._counts[key] += 1


def _keep_earliest(group: dict[int, tuple[float, int, SignatureMatch]], when: float, match: SignatureMatch) -> None:
    """Keep `match` as its severity's entry of `group` when it is the earliest (time, then sequence) seen."""
    known = group.get(match.action.severity)
    if known is None or (when, match.seq) < known[:2]:
        group[match.action.severity] = (when, match.seq, match)


def _better(signature: Signature, rank: tuple[int, int, bool, int], best: Signature | None,
            best_rank: tuple[int, int, bool, int] | None) -> bool:
    """Whether `signature` speaks for a line rather than `best`: one that explains the other wins, else the
    higher rank (`_rank`)."""
    if best is None or best_rank is None or best.id in signature.explains:
        return True
    return signature.id not in best.explains and rank > best_rank


def _group(signature: Signature) -> int:
    """The group a signature's matches compete in for the cause: 0 causes, 1 echoes, 2 fallbacks."""
    return 2 if signature.fallback else 1 if signature.echo else 0


def _word(m: re.Match[bytes]) -> bytes:
    word = m.group()
    if word.isdigit():
        return b"N"
    if not any(48 <= c <= 57 for c in word):
        return word
    if word[:2] in (b"0x", b"0X") and len(word) > 2 and all(c in _HEX_CHARS for c in word[2:]):
        return b"X"
    if all(c in _HEX_CHARS for c in word):
        return b"X"
    return _DIGIT_RUN.sub(b"N", _HEX_RUN.sub(b"X", word))


def key_shape(key: bytes) -> bytes:
    """The shape of a folded template key (`_SHAPE_HEX`, `_SHAPE_DIGITS`): keys of one shape have one template.
    Worked out per blank-separated token, each token's shape memoised (a blank bounds a word as the ends of the
    string do, so this is the same as the two substitutions over the whole key)."""
    return b" ".join(map(_token_shape, key.split(b" ")))


@lru_cache(maxsize=_KEY_CACHE)
def _token_shape(token: bytes) -> bytes:
    return _SHAPE_DIGITS.sub(b"0", _SHAPE_HEX.sub(b"0x0", token))


def normalise_line(line: bytes) -> bytes:
    """A line's template: numbers (decimals and exponents too) -> N, hex ids (0x..., words of hex digits with
    a digit, runs of six or more inside a word) -> X, other digit runs -> N, blanks collapsed, ends trimmed.
    (A word is a run of letters and digits.) Five substitutions without callbacks; `_normalise_by_word`
    is the same rule word by word, kept as the reference the tests compare with."""
    text = _DECIMAL.sub(b"N", line.strip())
    text = _WHOLE_DIGITS.sub(b"N", text)
    text = _WHOLE_HEX.sub(b"X", text)
    text = _DIGIT_RUN.sub(b"N", _HEX_RUN.sub(b"X", text))
    return _BLANKS.sub(b" ", text)


def _normalise_by_word(line: bytes) -> bytes:
    text = _DECIMAL.sub(b"N", line.strip())
    return _BLANKS.sub(b" ", _WORD.sub(_word, text))


def _as_bytes(line: object, cap: int) -> bytes:
    """`line` as bytes; a long str is cut before encoding (the caller cuts to `cap` bytes and counts it)."""
    if isinstance(line, str):
        return line[:cap + 1].encode("utf-8", "replace")
    if isinstance(line, bytes | bytearray | memoryview):
        return bytes(line)
    raise TypeError(f"a log line is bytes or str, not {type(line).__name__}")


# ------------------------------------------------------------------------------------------------- prefilter

def _atom(ch: str, ignore_case: bool) -> str:
    if ignore_case and ch.lower() != ch.upper():
        return f"[{re.escape(ch.upper())}{re.escape(ch.lower())}]"
    return re.escape(ch)


#: Owner of the literals of the structured readings (Xid, exit code, signal lines).
STRUCTURED = -1


class Prefilter:
    """One bytes regex that finds any of a set of literals, and which literals' owners a hit concerns.

    Each literal is cut to a suffix (a suffix of a required literal is required too) that starts with a
    character rare in logs, or with one already chosen, hardest literals first, and the suffixes are merged
    into a trie. The regex engine then tests each position against one small set of first characters and
    tries the trie only where one occurs (which needs every alternative to start with a plain character: a
    case-insensitive first letter becomes two words). The trie stops at the shortest word, so a hit on a
    word stands for every longer word it begins.
    """

    def __init__(self, literals: Sequence[tuple[str, bool, int]]) -> None:
        chosen: set[str] = set()
        owners: dict[bytes, set[int]] = {}
        words: list[tuple[str, ...]] = []
        exact: dict[bytes, set[int]] = {}  # each word as a Hyperscan expression (bytes) -> its literals' owners
        todo = []
        for text, ignore_case, owner in literals:
            chars = text.encode("utf-8").decode("latin-1")  # one "character" per byte
            todo.append((literal_cost(chars, ignore_case)[0], chars, ignore_case, owner))
        for _, chars, ignore_case, owner in sorted(todo, key=lambda item: (-item[0], item[1:])):
            atoms = [_atom(ch, ignore_case) for ch in chars]
            last = max(0, len(chars) - PREFILTER_KEEP)
            start = min(range(last + 1),
                        key=lambda i: (0 if atoms[i] in chosen else char_cost(chars[i], ignore_case), i))
            chosen.add(atoms[start])
            owners.setdefault(chars[start:].encode("latin-1").lower(), set()).add(owner)
            exact.setdefault(_hs_word(chars[start:], ignore_case), set()).add(owner)
            if atoms[start].startswith("["):
                words.append((re.escape(chars[start].upper()), *atoms[start + 1:]))
                words.append((re.escape(chars[start].lower()), *atoms[start + 1:]))
            else:
                words.append(tuple(atoms[start:]))
        self._owners = {word: frozenset(o for longer, who in owners.items() if longer.startswith(word) for o in who)
                        for word in owners}
        trie: dict[str, Any] = {}
        for word in words:
            node = trie
            for atom in word:
                node = node.setdefault(atom, {})
            node[""] = {}
        self.regex: re.Pattern[bytes] = re.compile(_emit(trie).encode("latin-1") if words else rb"(?!x)x")
        self._exact = [(word, frozenset(who)) for word, who in sorted(exact.items())]
        # the batch scan joins lines with a newline, which no literal may contain
        self._joinable = all(b"\n" not in chars.encode("latin-1") for chars, _, _ in
                             ((t.encode("utf-8").decode("latin-1"), c, o) for t, c, o in literals))
        self._database: Any = None
        self.engine = "hyperscan" if _hyperscan is not None and self._exact and self._joinable else "re"
        """what `scan_lines` scans with: "hyperscan", or "re" (this regex over the joined batch)"""

    def scan_lines(self, lines: Sequence[bytes], joined: bytes | None = None) -> list[tuple[int, set[int]]]:
        """The lines in which a literal occurs, in order, each with a superset of the owners of the literals
        occurring in it (exactly those, with Hyperscan). One scan of the batch joined by newlines (`joined`, when
        the caller has it)."""
        if not lines:
            return []
        if not self._joinable:
            return [(i, self.owners_of(line, hit)) for i, line in enumerate(lines)
                    if (hit := self.regex.search(line)) is not None]
        if joined is None:
            joined = b"\n".join(lines)
        ends: list[int] | None = None  # ends[i]: the offset just past line i's newline
        found: dict[int, set[int]] = {}
        if self.engine == "hyperscan":
            seen: list[tuple[int, int]] = []
            self._hyperscan().scan(joined, match_event_handler=lambda word, _start, end, _flags, _context:
                                   seen.append((end, word)))
            if not seen:
                return []
            newlines = np.flatnonzero(np.frombuffer(joined, dtype=np.uint8) == 10)
            if len(newlines) == len(lines) - 1:  # no line holds a newline: a match's line is the newlines before it
                where = np.searchsorted(newlines, np.fromiter((end - 1 for end, _ in seen), dtype=np.int64,
                                                              count=len(seen))).tolist()
            else:
                ends = _line_ends(lines)
                where = [bisect_right(ends, end - 1) for end, _ in seen]
            exact = self._exact
            for index, (_, word) in zip(where, seen, strict=True):
                found.setdefault(index, set()).update(exact[word][1])
            return sorted(found.items())
        for match in self.regex.finditer(joined):
            if ends is None:
                ends = _line_ends(lines)
            index = bisect_right(ends, match.start())
            if index not in found:
                line = lines[index]
                hit = self.regex.search(line)
                assert hit is not None  # the literal found in the batch lies inside this line
                found[index] = self.owners_of(line, hit)
        return sorted(found.items())

    def _hyperscan(self) -> Any:
        """The Hyperscan block database of the words (compiled on first use)."""
        if self._database is None:
            assert _hyperscan is not None
            database = _hyperscan.Database(mode=_hyperscan.HS_MODE_BLOCK)
            database.compile(expressions=[word for word, _ in self._exact], ids=list(range(len(self._exact))),
                             flags=0)
            self._database = database
        return self._database

    def owners_of(self, line: bytes, hit: re.Match[bytes]) -> set[int]:
        """The owners of every literal occurring in `line`, given the first hit (overlaps included)."""
        found: set[int] = set()
        search = self.regex.search
        match: re.Match[bytes] | None = hit
        while match is not None:
            found.update(self._owners.get(match.group().lower(), ()))
            match = search(line, match.start() + 1)
        return found


def _line_ends(lines: Sequence[bytes]) -> list[int]:
    """The offset just past each line's newline in the lines joined by newlines."""
    return list(map(add, accumulate(map(len, lines)), range(1, len(lines) + 1)))


def _hs_word(chars: str, ignore_case: bool) -> bytes:
    """A word (one character per byte) as a Hyperscan expression of the same bytes the trie's atoms match."""
    parts = []
    for ch in chars:
        if ignore_case and ch.lower() != ch.upper():
            parts.append(b"[\\x%02x\\x%02x]" % (ord(ch.upper()), ord(ch.lower())))
        else:
            parts.append(b"\\x%02x" % ord(ch))
    return b"".join(parts)


def _emit(node: dict[str, Any]) -> str:
    # a word that ends here makes the rest optional: any literal found is enough, so stop at the shortest
    if "" in node:
        return ""
    branches = [atom + _emit(child) for atom, child in sorted(node.items())]
    return branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"


# ------------------------------------------------------------------------------------------------ timestamps

#: What stands before a line's own text: a node or container name (`node2: `, `vllm-1  | `), torch's rank
#: (`[rank3]:`), Ray's process (`(raylet, ip=10.0.0.1) `, `(EngineCore_DP0 pid=7) `), a kernel tag.
_PREFIX = r"^(?:[\w.-]{1,64}:\s|[\w.-]{1,64}\s{1,4}\|\s|\[rank\d{1,6}\]:|\([^()\n]{1,80}\)\s)*\W{0,3}"
_ISO = re.compile(_PREFIX + r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?\s?(Z|[+-]\d\d:?\d\d)?")
_DMESG_T = re.compile(_PREFIX + r"(\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4})\]")
#: glog and torch's C++ logs (`I1201 12:00:00.123456 ...`, `[rank0]:[W1201 12:00:00.123456 ...]`; torch drops the
#: month's leading zero: `E108` is 8 January), vLLM (`INFO 12-01 12:00:00 ...`): month, day, time, no year.
_GLOG = re.compile(_PREFIX + r"(?:[IWEF]|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) )(\d{1,2}?)-?(\d\d) "
                   r"(\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?\b")
#: syslog (`Dec  1 12:00:00 host kernel: ...`), no year.
_SYSLOG = re.compile(_PREFIX + r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) ([ \d]\d) (\d\d):(\d\d):(\d\d)\b")
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                         "Nov", "Dec"), start=1)}


def _seconds(year: int, month: int, day: int, hour: int, minute: int, second: int,
             fraction: str | None) -> float | None:
    try:
        value = float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))
    except (OverflowError, ValueError):
        return None
    if fraction:
        value += int(fraction) / 10 ** len(fraction)
    return value


def line_timestamp(text: str, year: int | None = None) -> float | None:
    """Seconds since the epoch from a line's leading time, behind the prefixes logs put before it (`_PREFIX`):
    ISO 8601 (`2024-05-01T12:00:00.5Z`, `[2024-05-01 12:00:00,123]`; no zone = UTC), `dmesg -T` (`[Wed May  1
    12:00:00 2024]`), glog/torch (`I0501 12:00:00.123456`, `[rank0]:[E108 20:04:34.4676 ...]`: 8 January),
    vLLM (`INFO 05-01 12:00:00`) and syslog (`May  1 12:00:00`). The last three carry no year: `year`
    (default: this year, UTC) is assumed, so lines of one incident order across nodes. None if none."""
    if (m := _ISO.match(text)) is not None:
        year_, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
        seconds = _seconds(year_, month, day, hour, minute, second, m.group(7))
        if seconds is None:
            return None
        zone = m.group(8)
        if zone and zone != "Z":
            sign = -1 if zone[0] == "+" else 1
            digits = zone[1:].replace(":", "")
            seconds += sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
        return seconds
    if (m := _DMESG_T.match(text)) is not None:
        try:
            return float(calendar.timegm(time.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")))
        except ValueError:
            return None
    assumed = time.gmtime().tm_year if year is None else year
    if (m := _GLOG.match(text)) is not None:
        month, day, hour, minute, second = (int(g) for g in m.groups()[:5])
        return _seconds(assumed, month, day, hour, minute, second, m.group(6))
    if (m := _SYSLOG.match(text)) is not None:
        hour, minute, second = (int(g) for g in m.groups()[2:])
        return _seconds(assumed, _MONTHS[m.group(1)], int(m.group(2)), hour, minute, second, None)
    return None
