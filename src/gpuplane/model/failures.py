"""The failure-signature library: what a failed training job's logs, Xids and exit codes mean.

A `Signature` recognises one kind of failure evidence with exactly one matcher: a regular expression over a
log line (`pattern`), an NVIDIA Xid code (`xid`, from NVML events or a dmesg `NVRM: Xid` line), a process
exit code (`exit_code`; negative numbers are torchrun's form of "killed by signal n") or a signal name
(`signal`). It carries the verdict for that evidence: the failure class, whether the node it was seen on is
to blame, the action (isolate the node, restart, do not retry, log only) and whether it is critical.
Every signature ships its own test data: realistic `examples` that must match and `near_misses` that must
not; the loader checks both, so an operator's file cannot load with a signature that does not do what its
examples say.

The bundled library is `gpuplane/data/failure-signatures.yaml` (rules and sources in
`docs/training-faults.md`); operators' files extend it or override entries by id. The streaming
classifier that applies a library is `gpuplane.controllers.classifier`.

Model layer: standard library and pydantic only.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gpuplane.model.errors import GpuplaneError
from gpuplane.model.yamlfile import load_yaml_model, validate_model

if TYPE_CHECKING:  # the stubs know the parser under its deprecated public name
    import sre_constants as _sre_c
    import sre_parse as _sre_p
else:
    from re import _constants as _sre_c
    from re import _parser as _sre_p

BUNDLED_SIGNATURES = "failure-signatures.yaml"

#: A pattern must contain a literal of at least this many characters on every path (the prefilter's key).
MIN_LITERAL = 4
#: Longest pattern accepted.
MAX_PATTERN = 2000
#: Repeats with an upper bound above this count as unbounded for the backtracking checks.
_BOUNDED = 64


class SignatureError(GpuplaneError):
    """A signature file or entry that is invalid; the message names the file, the entry and the field."""


class FailureClass(enum.Enum):
    """Where a failure comes from. `MEMORY` is memory hardware (GPU HBM/ECC/row remapping, host DIMMs);
    running out of memory is a `SOFTWARE` (job configuration) failure."""

    GPU_HARDWARE = "gpu-hardware"
    MEMORY = "memory"
    INTERCONNECT = "interconnect"  # NVLink, NVSwitch, PCIe
    NETWORK = "network"  # InfiniBand/RoCE/Ethernet, NCCL transport, rendezvous
    STORAGE = "storage"
    SOFTWARE = "software"  # the job: code, configuration, numerics
    INFRASTRUCTURE = "infrastructure"  # Kubernetes, drivers, node lifecycle, preemption


class FailureAction(enum.Enum):
    """What to do about a failure.

    `severity` orders actions for tie-breaks and escalation: isolate-node (3) > do-not-retry (2) >
    restart-job (1) > log-only (0). Isolation outranks do-not-retry on purpose: when a hardware signature
    and a software one are equally early, the hardware one is usually the cause (an Xid 79 makes the
    rank's next CUDA call fail with what looks like a code error, fault-tolerance.md §4.3 #17), and
    isolating costs one restart on other nodes where giving up wrongly costs the whole job. If the
    software error was real it recurs on healthy nodes and is then classified do-not-retry.
    """

    ISOLATE_NODE = "isolate-node"  # cordon/drain/exclude the blamed node(s), restart elsewhere from a checkpoint
    RESTART_JOB = "restart-job"  # restart on the same nodes
    DO_NOT_RETRY = "do-not-retry"  # fail fast and notify: retrying repeats the failure
    LOG_ONLY = "log-only"  # tolerate: count, never the cause of a failed job on its own

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {FailureAction.ISOLATE_NODE: 3, FailureAction.DO_NOT_RETRY: 2, FailureAction.RESTART_JOB: 1,
             FailureAction.LOG_ONLY: 0}

#: Linux signal numbers (x86-64 and arm64 agree on 1–31), for exit codes 128+n and torchrun's -n.
SIGNALS: dict[int, str] = dict(enumerate((
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGKILL", "SIGUSR1", "SIGSEGV",
    "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM", "SIGSTKFLT", "SIGCHLD", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN",
    "SIGTTOU", "SIGURG", "SIGXCPU", "SIGXFSZ", "SIGVTALRM", "SIGPROF", "SIGWINCH", "SIGIO", "SIGPWR", "SIGSYS",
), start=1))
SIGNAL_NUMBERS: dict[str, int] = {name: number for number, name in SIGNALS.items()}


def signal_of_exit(code: int) -> str | None:
    """The signal an exit code reports: 128+n (shells, containers) or -n (torchrun); None for other codes."""
    if code < 0:
        return SIGNALS.get(-code)
    return SIGNALS.get(code - 128) if code > 128 else None


# The structured evidence the classifier reads out of a line, besides the signatures' own patterns.
#: dmesg: `NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: ...`
XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?[^)\n]{1,64}\): (\d{1,5}),")
#: The Xid another line names as its cause or carries in another form: an Xid 45's `caused by previous Xid
#: 149`, the device plugin's health line `XidCriticalError: Xid=69 on Device=GPU-...`. Read before `XID_LINE`:
#: the named cause, not the echo's own code, is the evidence.
#: NVLink5 Xids (144-150) carry their unit's verdict: a `Nonfatal` status is IGNORE in NVIDIA's NVLink5
#: decode table (`NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 ...`), so the Xid is not read.
NVLINK5_NONFATAL = re.compile(r", \w{2,32} Nonfatal\b")
XID_NAMED = re.compile(r"caused by previous Xid (\d{1,5})\b|XidCriticalError: Xid=(\d{1,5})\b"
                       r"|\bxid=(\d{1,5})\b.{0,120}\bunhealthy\b")
#: torchrun's failure summary (`exitcode  : -6 (pid: 4242)`), `kubectl describe pod` (`Exit Code:    137`),
#: pod status in YAML or JSON (`exitCode: 137`, `"exitCode":137`), a launcher's summary in words with a
#: negative (signal) code (`launcher failed with exit code -9`).
EXIT_LINE = re.compile(r"\bexitcode\s{0,8}:\s{0,8}(-?\d{1,3})\b|\bExit Code:\s{0,16}(-?\d{1,3})\b"
                       r"|\bexitCode\"?\s{0,4}[:=]\s{0,4}(-?\d{1,3})\b"
                       r"|\b(?:failed|exited) with exit code (-\d{1,3})\b")
#: torchrun's elastic agent: `Signal 6 (SIGABRT) received by PID 4242`
#: the GPU (PCI address) and process of a dmesg Xid line, for `DeviceRepeat`
XID_PROCESS = re.compile(r"NVRM: Xid \((?:PCI:)?([^)\n]{1,64})\): \d{1,5}, pid=(\d{1,10})\b")
SIGNAL_LINE = re.compile(r"\b[Ss]ignal \d{1,2} \((SIG[A-Z0-9]{2,8})\) received by PID")

Event = tuple[Literal["xid"], int] | tuple[Literal["exit"], int] | tuple[Literal["signal"], str]


def line_events(text: str) -> list[Event]:
    """The Xid, exit code and signal a log line reports (at most one of each), in that order."""
    events: list[Event] = []
    if (m := XID_NAMED.search(text)) is not None:
        events.append(("xid", int(next(g for g in m.groups() if g is not None))))
    elif (m := XID_LINE.search(text)) is not None:
        xid = int(m.group(1))
        if not (144 <= xid <= 150 and NVLINK5_NONFATAL.match(text, m.end(1))):
            events.append(("xid", xid))
    if (m := EXIT_LINE.search(text)) is not None:
        code = int(next(g for g in m.groups() if g is not None))
        if code:
            events.append(("exit", code))
    if (m := SIGNAL_LINE.search(text)) is not None and m.group(1) in SIGNAL_NUMBERS:
        events.append(("signal", m.group(1)))
    return events


class Escalation(BaseModel):
    """Repetition turns a tolerated or restartable signature into something worse: `count` occurrences on
    one node within `window_s` seconds give that occurrence (and later ones in the window) `action`.

    `per: event` counts every matching line or event (an InfiniBand port flapping twice in five minutes);
    `per: incident` counts at most once per incident, i.e. between classifier resets (an Xid 13 that
    follows a node from job to job). An escalation to isolate-node blames the node it repeated on.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int = Field(ge=2, le=10_000)
    window_s: float = Field(gt=0, allow_inf_nan=False)
    action: FailureAction
    per: Literal["event", "incident"] = "event"


class DeviceRepeat(BaseModel):
    """The same Xid on one GPU (the PCI address of its dmesg line) from `processes` distinct processes within
    `window_s` seconds is the device, not the application: NVIDIA's Xid catalogue for Xid 13 and 31 reads
    repeated faults on the same GPU as a possible hardware issue (run diagnostics) and faults spread over
    different GPUs, or one alone, as the application's. That match takes `action` and `failure_class` and
    blames its node. Counted across incidents and jobs (different jobs faulting on one GPU are the strongest
    sign), until `reset(forget_history=True)`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    processes: int = Field(ge=2, le=1000)
    window_s: float = Field(gt=0, allow_inf_nan=False)
    action: FailureAction
    failure_class: FailureClass


class Amendment(BaseModel):
    """What a tolerated line says about the cause: when one of `signatures` is the cause of an incident in
    which this signature matched (on any node), the verdict takes `action` when it is more severe (NCCL
    bootstrapping on a docker bridge or a link-local address turns a socket connect failure, on that node or
    on its peers, into a configuration fault)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    signatures: tuple[str, ...] = Field(min_length=1)
    action: FailureAction


class Signature(BaseModel):
    """One failure signature; exactly one of `pattern`, `xid`, `exit_code`, `signal` is set.

    `echo` marks consequences of other failures (NCCL aborts and watchdog timeouts, SIGABRT, exit codes,
    the torchrun wrapper): they decide a verdict only when nothing else matched. `echo_after` names
    signatures whose earlier match on the same node makes this one's match an echo (an Xid 109 context-switch
    timeout after the application's Xid 13 on that node). `fallback` marks the weakest evidence (a bare
    Python traceback, whose exception line says what happened): it decides only when neither a cause nor an
    echo matched. Echoes and fallbacks never blame a node, and isolate-node needs `blame_node`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=2, max_length=64, pattern=r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
    description: str = Field(min_length=1)
    pattern: str | None = None
    xid: int | None = Field(default=None, ge=1, le=65535)
    exit_code: int | None = Field(default=None, ge=-64, le=255)
    signal: str | None = None
    failure_class: FailureClass
    blame_node: bool
    action: FailureAction
    critical: bool = False
    echo: bool = False
    echo_after: tuple[str, ...] = ()
    fallback: bool = False
    amends: Amendment | None = None
    explains: tuple[str, ...] = ()
    escalate: Escalation | None = None
    device_repeat: DeviceRepeat | None = None
    examples: list[str] = Field(min_length=1)
    near_misses: list[str] = Field(min_length=1)

    _regex: re.Pattern[str] | None = PrivateAttr(default=None)
    _literals: tuple[tuple[str, bool], ...] = PrivateAttr(default=())

    @field_validator("pattern")
    @classmethod
    def _check_pattern(cls, value: str | None) -> str | None:
        if value is not None:
            check_pattern(value)
        return value

    @field_validator("exit_code")
    @classmethod
    def _nonzero(cls, value: int | None) -> int | None:
        if value == 0:
            raise _error("exit_code", "0 is success, not a failure")
        return value

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str | None) -> str | None:
        if value is not None and value not in SIGNAL_NUMBERS:
            raise _error("signal", f"unknown signal {value!r}: use a Linux name such as SIGSEGV")
        return value

    @field_validator("examples", "near_misses")
    @classmethod
    def _non_empty_lines(cls, value: list[str]) -> list[str]:
        for i, line in enumerate(value):
            if not line.strip():
                raise _error("line", f"item {i} is an empty line")
            if "\n" in line:
                raise _error("line", f"item {i} is more than one line")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Signature:
        given = [name for name in ("pattern", "xid", "exit_code", "signal") if getattr(self, name) is not None]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise _error("matcher", f"matcher: give exactly one of pattern, xid, exit_code, signal (got {what})")
        if self.action is FailureAction.ISOLATE_NODE and not self.blame_node:
            raise _error("blame", "blame_node: isolate-node needs blame_node: true")
        if self.echo and self.blame_node:
            raise _error("blame", "blame_node: an echo signature cannot blame a node")
        if self.fallback and (self.blame_node or self.echo):
            raise _error("fallback", "fallback: a fallback signature is neither an echo nor blames a node")
        if self.device_repeat is not None and (self.xid is None or self.echo or self.fallback
                                               or self.device_repeat.action.severity <= self.action.severity):
            raise _error("device_repeat", "device_repeat: an Xid signature's, neither echo nor fallback, with an "
                                          "action more severe than its own")
        if self.amends is not None and self.action is not FailureAction.LOG_ONLY:
            raise _error("amends", "amends: only a log-only signature amends other signatures' verdicts")
        if self.escalate is not None and self.escalate.action.severity <= self.action.severity:
            raise _error("escalate", f"escalate.action: {self.escalate.action.value} is not more severe than "
                                     f"action {self.action.value}")
        if self.pattern is not None:
            self._regex = re.compile(self.pattern)
            self._literals = required_literals(self.pattern)
        for i, line in enumerate(self.examples):
            if not self.matches(line):
                raise _error("example", f"examples.{i}: does not match this signature: {line[:200]!r}")
        for i, line in enumerate(self.near_misses):
            if self.matches(line):
                raise _error("near_miss", f"near_misses.{i}: matches this signature: {line[:200]!r}")
        return self

    @property
    def matcher(self) -> tuple[str, str | int]:
        """(kind, value): ("pattern", regex), ("xid", 79), ("exit_code", -6) or ("signal", "SIGSEGV")."""
        if self.pattern is not None:
            return "pattern", self.pattern
        if self.xid is not None:
            return "xid", self.xid
        if self.exit_code is not None:
            return "exit_code", self.exit_code
        assert self.signal is not None
        return "signal", self.signal

    @property
    def regex(self) -> re.Pattern[str] | None:
        """The compiled `pattern` (None for the other matchers)."""
        return self._regex

    @property
    def literals(self) -> tuple[tuple[str, bool], ...]:
        """(literal, ignore_case) alternatives one of which every line matching `pattern` contains."""
        return self._literals

    def matches(self, line: str) -> bool:
        """Whether this signature alone recognises `line` (Xid, exit code and signal via `line_events`;
        a signal signature also takes exit codes 128+n and -n of its signal)."""
        if self._regex is not None:
            return self._regex.search(line) is not None
        for kind, value in line_events(line):
            if kind == "xid" and value == self.xid:
                return True
            if kind == "exit" and (value == self.exit_code or (self.signal is not None
                                                               and signal_of_exit(int(value)) == self.signal)):
                return True
            if kind == "signal" and value == self.signal:
                return True
        return False


# ---------------------------------------------------------------------------------------------------------
# Pattern analysis: cheap checks against catastrophic backtracking, and the literals the prefilter keys on.

def _error(kind: str, message: str) -> PydanticCustomError:
    """A validation error whose text is exactly `message` (no "Value error, " prefix)."""
    return PydanticCustomError(kind, "{message}", {"message": message})


def _bad_pattern(message: str) -> PydanticCustomError:
    return _error("pattern", message)


def check_pattern(pattern: str) -> None:
    """Raise a pydantic error (message starting with the problem) for a pattern the classifier cannot use."""
    if len(pattern) > MAX_PATTERN:
        raise _bad_pattern(f"longer than {MAX_PATTERN} characters")
    try:
        compiled = re.compile(pattern)
        parsed = _sre_p.parse(pattern)
    except re.error as exc:
        raise _bad_pattern(f"invalid regex: {exc}") from None
    if compiled.search("") is not None:
        raise _bad_pattern("matches an empty line (it would match every line)")
    problem = _backtracking_hazard(parsed.data, inside_unbounded=False)
    if problem is None and _count_wildcards(parsed.data) > 2:
        problem = "more than two unbounded '.' repeats (backtracking grows as a power of the line length)"
    if problem is not None:
        raise _bad_pattern(problem)
    literals = required_literals(pattern)
    if not literals:
        raise _bad_pattern(f"no literal of {MIN_LITERAL}+ characters that every match contains "
                           "(the classifier's prefilter needs one)")
    for literal, ignore_case in literals:
        if ignore_case and not literal.isascii():
            raise _bad_pattern(f"case-insensitive literal {literal!r} is not ASCII")


def _is_repeat(op: object) -> bool:
    return op in (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT, _sre_c.POSSESSIVE_REPEAT)


def _unbounded(hi: int) -> bool:
    return hi is _sre_c.MAXREPEAT or hi > _BOUNDED


def _children(op: object, av: Any) -> list[list[Any]]:
    """The sub-sequences of one parsed item (groups, branches, repeats, look-arounds)."""
    if op is _sre_c.SUBPATTERN:
        return [av[3].data]
    if op is _sre_c.BRANCH:
        return [b.data for b in av[1]]
    if _is_repeat(op):
        return [av[2].data]
    if op is _sre_c.ATOMIC_GROUP:
        return [av.data]
    if op in (_sre_c.ASSERT, _sre_c.ASSERT_NOT):
        return [av[1].data]
    if op is _sre_c.GROUPREF_EXISTS:
        return [av[1].data] + ([av[2].data] if av[2] is not None else [])
    return []


def _backtracking_hazard(items: list[Any], inside_unbounded: bool) -> str | None:
    previous: Any = None
    for op, av in items:
        if _is_repeat(op):
            _, hi, body = av
            if _unbounded(hi):
                if inside_unbounded and body.getwidth()[1] > 0:
                    return "nested unbounded quantifiers, e.g. (a+)+ (catastrophic backtracking)"
                if previous is not None and previous == body.data:
                    return "adjacent unbounded quantifiers over the same characters, e.g. \\d+\\d+"
                previous = body.data
            else:
                previous = None
            problem = _backtracking_hazard(body.data, inside_unbounded or _unbounded(hi))
        else:
            previous = None
            problem = None
            for child in _children(op, av):
                problem = problem or _backtracking_hazard(child, inside_unbounded)
        if problem is not None:
            return problem
    return None


def _count_wildcards(items: list[Any]) -> int:
    count = 0
    for op, av in items:
        if _is_repeat(op) and _unbounded(av[1]) and [o for o, _ in av[2].data] == [_sre_c.ANY]:
            count += 1
        for child in _children(op, av):
            count += _count_wildcards(child)
    return count


_Alternatives = list[tuple[str, bool]]


def required_literals(pattern: str) -> tuple[tuple[str, bool], ...]:
    """Alternatives (literal, ignore_case), one of which occurs in every string `pattern` matches: of the
    sets found, the cheapest to scan for (`literal_cost`) among those whose literals all have
    `MIN_LITERAL`+ characters; () when there is none. Case-insensitive literals come lower-cased."""
    parsed = _sre_p.parse(pattern)
    found = _required(parsed.data, bool(parsed.state.flags & _sre_c.SRE_FLAG_IGNORECASE))
    if not found or min(len(s) for s, _ in found) < MIN_LITERAL:
        return ()
    return tuple(dict.fromkeys((s.lower() if ci else s, ci) for s, ci in found))


#: Rough frequency (per mille) of characters in training and system logs; unknown characters count 1.
LOG_CHAR_FREQ: dict[str, int] = {
    " ": 150, "e": 80, "t": 60, "a": 55, "o": 50, "i": 50, "n": 50, "s": 45, "r": 45, "l": 30, "d": 25, "c": 25,
    "u": 20, "h": 20, "m": 18, "p": 15, "f": 12, "g": 12, "b": 8, "y": 8, "w": 8, "v": 6, "k": 4, "x": 3,
    **dict.fromkeys("0123456789", 30), ":": 30, "[": 25, "]": 25, ".": 15, "/": 10, ",": 10, '"': 10, "=": 10,
    "-": 8, "(": 8, ")": 8, "_": 6, "|": 5, "'": 3, "E": 5, "I": 6, "N": 6, "C": 5, "A": 4, "S": 4, "T": 4, "R": 4,
    "O": 3, "P": 3, "L": 3, "D": 3, "M": 3, "F": 2, "G": 2, "B": 2, "H": 2, "U": 2,
}
#: The prefilter keeps at least this many characters of a literal when it cuts it to a rarer first character.
PREFILTER_KEEP = 6


def char_cost(ch: str, ignore_case: bool) -> int:
    """How often `ch` (both cases when `ignore_case`) starts a position a literal scan has to try."""
    if ignore_case and ch.lower() != ch.upper():
        return LOG_CHAR_FREQ.get(ch.lower(), 1) + LOG_CHAR_FREQ.get(ch.upper(), 1)
    return LOG_CHAR_FREQ.get(ch, 1)


def literal_cost(text: str, ignore_case: bool) -> tuple[int, int]:
    """(cost, start): the cheapest character to start scanning for `text` at, keeping `PREFILTER_KEEP`
    characters (a suffix of a required literal is required too)."""
    last = max(0, len(text) - PREFILTER_KEEP)
    return min((char_cost(text[i], ignore_case), i) for i in range(last + 1))


def _score(alternatives: _Alternatives | None) -> tuple[bool, int, int]:
    """Better literal sets score higher: all long enough, cheap to scan for, then long."""
    if not alternatives:
        return (False, -(1 << 30), 0)
    shortest = min(len(s) for s, _ in alternatives)
    cost = sum(literal_cost(s, ci)[0] for s, ci in alternatives)
    return (shortest >= MIN_LITERAL, -cost, shortest)


def _leading(items: list[Any]) -> str:
    """The literal characters a sequence starts with."""
    chars = []
    for op, av in items:
        if op is not _sre_c.LITERAL:
            break
        chars.append(chr(av))
    return "".join(chars)


def _required(items: list[Any], ignore_case: bool) -> _Alternatives | None:
    best: _Alternatives | None = None
    run: list[str] = []

    def consider(candidate: _Alternatives | None) -> None:
        nonlocal best
        if _score(candidate) > _score(best):
            best = candidate

    def flush() -> None:
        if run:
            consider([("".join(run), ignore_case)])
            run.clear()

    for op, av in items:
        if op is _sre_c.LITERAL:
            run.append(chr(av))
            continue
        prefix = "".join(run)
        flush()
        if op is _sre_c.SUBPATTERN:
            _, add_flags, del_flags, body = av
            ci = (ignore_case or bool(add_flags & _sre_c.SRE_FLAG_IGNORECASE)) and not (
                del_flags & _sre_c.SRE_FLAG_IGNORECASE)
            consider(_required(body.data, ci))
        elif op is _sre_c.BRANCH:
            branches = [_required(b.data, ignore_case) for b in av[1]]
            if all(branches):
                consider([alt for branch in branches if branch for alt in branch])
            if prefix:  # the parser factors a common prefix out of "abc|abd": put it back
                consider([(prefix + _leading(b.data), ignore_case) for b in av[1]])
        elif _is_repeat(op) and av[0] >= 1:
            consider(_required(av[2].data, ignore_case))
        elif op is _sre_c.ATOMIC_GROUP:
            consider(_required(av.data, ignore_case))
    flush()
    return best


# ---------------------------------------------------------------------------------------------------------
# The library and its files.

class SignatureLibrary:
    """An ordered set of signatures with lookups by id, Xid, exit code and signal.

    Ids are unique, and so is each Xid, exit code and signal: one piece of evidence has one meaning.
    """

    def __init__(self, signatures: Iterable[Signature] = ()) -> None:
        self._by_id: dict[str, Signature] = {}
        self._by_xid: dict[int, Signature] = {}
        self._by_exit: dict[int, Signature] = {}
        self._by_signal: dict[str, Signature] = {}
        for signature in signatures:
            self._add(signature)

    def _add(self, signature: Signature) -> None:
        if signature.id in self._by_id:
            raise SignatureError(f"id: {signature.id!r} is defined twice")
        kind, value = signature.matcher
        indexes: dict[str, dict[Any, Signature]] = {"xid": self._by_xid, "exit_code": self._by_exit,
                                                    "signal": self._by_signal}
        index = indexes.get(kind)
        if index is not None:
            if value in index:
                raise SignatureError(f"{kind}: {value} is already matched by {index[value].id}")
            index[value] = signature
        self._by_id[signature.id] = signature

    def __iter__(self) -> Iterator[Signature]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, signature_id: object) -> bool:
        return signature_id in self._by_id

    def __getitem__(self, signature_id: str) -> Signature:
        try:
            return self._by_id[signature_id]
        except KeyError:
            raise KeyError(f"no signature with id {signature_id!r}") from None

    def get(self, signature_id: str) -> Signature | None:
        return self._by_id.get(signature_id)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(self._by_id)

    def by_xid(self, xid: int) -> Signature | None:
        return self._by_xid.get(xid)

    def by_exit_code(self, code: int) -> Signature | None:
        """The signature for exactly this exit code."""
        return self._by_exit.get(code)

    def by_signal(self, name: str) -> Signature | None:
        """The signature for exactly this signal name."""
        return self._by_signal.get(name)

    def resolve_exit(self, code: int | None, signal: str | None = None) -> Signature | None:
        """The signature for a process exit: the exact code, else its signal (128+n, -n), else the same
        signal's other code form; for a bare signal name, the signal, else 128+n, else -n."""
        if code:
            found = self._by_exit.get(code)
            if found is not None:
                return found
            signal = signal_of_exit(code) or signal
        if signal is None:
            return None
        name = signal.upper() if signal.upper().startswith("SIG") else f"SIG{signal.upper()}"
        found = self._by_signal.get(name)
        number = SIGNAL_NUMBERS.get(name)
        if found is None and number is not None:
            found = self._by_exit.get(128 + number) or self._by_exit.get(-number)
        return found

    def pattern_signatures(self) -> list[Signature]:
        return [s for s in self if s.pattern is not None]


class _LibraryFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    signatures: list[dict[str, Any]] = Field(default_factory=list)
    disable: list[str] = Field(default_factory=list)


def bundled_signatures_path() -> Path:
    """The bundled library, `gpuplane/data/failure-signatures.yaml`."""
    return Path(str(resources.files("gpuplane.data").joinpath(BUNDLED_SIGNATURES)))


def parse_signature_file(path: str | Path) -> tuple[list[Signature], list[str]]:
    """One file's signatures and `disable` ids, each entry validated on its own; errors read
    `FILE: signatures.3 (id xid-79): pattern: invalid regex: ...`."""
    parsed = load_yaml_model(path, _LibraryFile, SignatureError)
    signatures: list[Signature] = []
    first_index: dict[str, int] = {}
    for i, raw in enumerate(parsed.signatures):
        where = f"{path}: signatures.{i} (id {raw.get('id', '?')})"
        signature = validate_model(raw, Signature, SignatureError, where)
        if signature.id in first_index:
            raise SignatureError(f"{where}: id: duplicate of signatures.{first_index[signature.id]}")
        first_index[signature.id] = i
        signatures.append(signature)
    return signatures, parsed.disable


def load_signature_library(path: str | Path | None = None, *, extra: Sequence[str | Path] = ()) -> SignatureLibrary:
    """The library in `path` (None: the bundled one), extended by each file in `extra` in turn: an entry
    whose id exists replaces it in place, a new id is appended, ids under `disable:` are removed."""
    base = bundled_signatures_path() if path is None else Path(path)
    signatures, disabled = parse_signature_file(base)
    if disabled:
        raise SignatureError(f"{base}: disable: only files extending a library may disable signatures")
    by_id = {s.id: s for s in signatures}
    _library_or_error(by_id.values(), base, signatures)
    for extra_path in extra:
        overrides, disable = parse_signature_file(extra_path)
        for i, signature_id in enumerate(disable):
            if signature_id not in by_id:
                raise SignatureError(f"{extra_path}: disable.{i}: no signature with id {signature_id!r}")
            del by_id[signature_id]
        for signature in overrides:
            by_id[signature.id] = signature
        _library_or_error(by_id.values(), extra_path, overrides)
    return SignatureLibrary(by_id.values())


def _library_or_error(signatures: Iterable[Signature], path: str | Path, entries: list[Signature]) -> None:
    """Report an Xid, exit code or signal claimed by two signatures against this file's entry."""
    in_file = {s.id: i for i, s in enumerate(entries)}
    seen: dict[tuple[str, object], str] = {}
    for signature in signatures:
        kind, value = signature.matcher
        if kind == "pattern":
            continue
        other = seen.setdefault((kind, value), signature.id)
        if other != signature.id:
            culprit, holder = (signature.id, other) if signature.id in in_file else (other, signature.id)
            where = f"signatures.{in_file[culprit]} (id {culprit})" if culprit in in_file else f"id {culprit}"
            raise SignatureError(f"{path}: {where}: {kind}: {value} is already matched by {holder}")
