"""The failure-diagnosis corpus and its scorer: how well the classifier reads real failure logs.

The corpus (`tests/fixtures/failure-corpus/*.yaml`) holds excerpts quoted from public issue threads and
vendor documentation, each labelled from its own thread: what kind of failure it is, where it comes from
(`cause`), whether the node it ran on should be isolated and whether a restart helps. `score` feeds every
case to a `FailureClassifier` and compares its verdict with the label:

- *matched*: the verdict has a cause (a signature matched a line);
- *strict*: matched, and the signature's class and action are the label's (`Cause.of`, `expected_action`);
- *flagged*: a harmless case (`cause: harmless`) for which the classifier found a cause.

A case is one entry, or all entries sharing an `incident` id (several nodes' logs of one failure, each
entry fed on its own `node`). A case with a line identical to an example of a library signature is
reported as "in library examples" and left out of the score: a line copied into the library does not count
twice. The split is fixed by the id (`split_of`): about 30 % of the cases are held out.

Run `python3 -m gpuplane.controllers.diagnosis_corpus tests/fixtures/failure-corpus` for the table.

Controllers layer: imports the model and the classifier only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpuplane.controllers.classifier import Classification, FailureClassifier, line_timestamp
from gpuplane.model.errors import GpuplaneError
from gpuplane.model.failures import FailureAction, FailureClass, SignatureLibrary, load_signature_library
from gpuplane.model.yamlfile import load_yaml_model

#: Per cent of cases held out (`split_of`).
HELD_OUT_PERCENT = 30
#: The node a case's lines are fed on when its entry names none.
DEFAULT_NODE = "node-0"

Cause = Literal["hardware", "network", "job", "infra", "harmless"]
Action = Literal["isolate", "restart", "stop", "none"]
Split = Literal["train", "held_out"]
Form = Literal["quoted", "catalogue"]

#: The label's cause each classifier class stands for (storage faults are the platform's: full disks, quotas).
CAUSE_OF_CLASS: dict[FailureClass, Cause] = {
    FailureClass.GPU_HARDWARE: "hardware", FailureClass.MEMORY: "hardware", FailureClass.INTERCONNECT: "hardware",
    FailureClass.NETWORK: "network", FailureClass.SOFTWARE: "job", FailureClass.INFRASTRUCTURE: "infra",
    FailureClass.STORAGE: "infra",
}
ACTION_OF: dict[FailureAction, Action] = {
    FailureAction.ISOLATE_NODE: "isolate", FailureAction.RESTART_JOB: "restart",
    FailureAction.DO_NOT_RETRY: "stop", FailureAction.LOG_ONLY: "none",
}


class CorpusError(GpuplaneError):
    """A corpus file or entry that is invalid; the message names the file and the entry id."""


def split_of(key: str) -> Split:
    """The split of a case, from the first 32 bits of the SHA-256 of its id (the incident id for an
    incident): held out when that number modulo 100 is below `HELD_OUT_PERCENT`."""
    value = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16)
    return "held_out" if value % 100 < HELD_OUT_PERCENT else "train"


class Label(BaseModel):
    """What the entry's thread says the failure is and what to do about it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = Field(min_length=2, max_length=64, pattern=r"^[a-z0-9]+(?:_[a-z0-9]+)*$")
    cause: Cause
    isolate_node: bool
    restart_helps: bool

    @model_validator(mode="after")
    def _consistent(self) -> Label:
        if self.cause == "harmless" and (self.isolate_node or self.restart_helps):
            raise ValueError("a harmless line neither isolates a node nor needs a restart")
        if self.kind == "harmless" and self.cause != "harmless":
            raise ValueError("kind harmless needs cause harmless")
        return self

    @property
    def harmless(self) -> bool:
        return self.cause == "harmless"

    @property
    def expected_action(self) -> Action:
        """isolate (the node is to blame), else restart (a restart helps), else stop; none when harmless."""
        if self.harmless:
            return "none"
        if self.isolate_node:
            return "isolate"
        return "restart" if self.restart_helps else "stop"


class CorpusEntry(BaseModel):
    """One excerpt: its lines exactly as quoted, where they come from, and its label."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=2, max_length=96, pattern=r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
    source: str = Field(min_length=8)
    project: str = Field(min_length=2)
    form: Form = "quoted"
    lines: str
    node: str | None = Field(default=None, min_length=1)
    incident: str | None = Field(default=None, min_length=2, pattern=r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
    label: Label
    why: str = Field(min_length=8)
    split: Split

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if not (value.startswith("https://") or "#" in value):
            raise ValueError("give a URL (https://...) or owner/repo#number")
        return value

    @field_validator("lines")
    @classmethod
    def _lines(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("no log line")
        return value

    @model_validator(mode="after")
    def _split_and_node(self) -> CorpusEntry:
        expected = split_of(self.case_id)
        if self.split != expected:
            raise ValueError(f"split is {expected} for {self.case_id!r} (split_of), not {self.split}")
        if self.incident is not None and self.node is None:
            raise ValueError("an entry of an incident names its node")
        return self

    @property
    def case_id(self) -> str:
        return self.incident or self.id

    def log_lines(self) -> list[str]:
        """The excerpt's non-empty lines, in order."""
        return [line for line in self.lines.splitlines() if line.strip()]


class _CorpusFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    entries: list[dict[str, Any]] = Field(min_length=1)


@dataclass(frozen=True)
class Case:
    """What is scored once: an entry, or the entries of one incident."""

    id: str
    entries: tuple[CorpusEntry, ...]

    @property
    def label(self) -> Label:
        return self.entries[0].label

    @property
    def split(self) -> Split:
        return self.entries[0].split

    @property
    def form(self) -> Form:
        return "catalogue" if all(e.form == "catalogue" for e in self.entries) else "quoted"


@dataclass(frozen=True)
class Corpus:
    """Entries in file order, with the file each came from."""

    entries: tuple[CorpusEntry, ...]
    files: dict[str, str] = field(default_factory=dict)  # entry id -> file

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[CorpusEntry]:
        return iter(self.entries)

    def cases(self) -> list[Case]:
        """One case per entry without an incident, one per incident (its entries in file order)."""
        grouped: dict[str, list[CorpusEntry]] = {}
        for entry in self.entries:
            grouped.setdefault(entry.case_id, []).append(entry)
        return [Case(case_id, tuple(entries)) for case_id, entries in grouped.items()]


def corpus_files(path: str | Path) -> list[Path]:
    """`path` itself, or the `*.yaml` files of a directory in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.yaml"))
        if not files:
            raise CorpusError(f"{path}: no *.yaml corpus files")
        return files
    return [path]


def load_corpus(path: str | Path) -> Corpus:
    """Every entry of a corpus file or directory, validated; errors read `FILE: entries.3 (id foo): field: ...`.
    Ids are unique across files; the entries of one incident share their label."""
    entries: list[CorpusEntry] = []
    files: dict[str, str] = {}
    where_of: dict[str, str] = {}
    for file in corpus_files(path):
        for raw, where in _raw_entries(file):
            entry = _entry(raw, where)
            if entry.id in where_of:
                raise CorpusError(f"{where}: id: duplicate of {where_of[entry.id]}")
            where_of[entry.id] = where
            files[entry.id] = str(file)
            entries.append(entry)
    corpus = Corpus(tuple(entries), files)
    for case in corpus.cases():
        first = case.entries[0]
        for other in case.entries[1:]:
            if other.label != first.label:
                raise CorpusError(f"{where_of[other.id]}: label: differs from {first.id}'s in incident {case.id}")
    return corpus


def _raw_entries(file: Path) -> Iterator[tuple[dict[str, Any], str]]:
    parsed = load_yaml_model(file, _CorpusFile, CorpusError)
    for index, item in enumerate(parsed.entries):
        yield item, f"{file}: entries.{index} (id {item.get('id', '?')})"


def _entry(raw: dict[str, Any], where: str) -> CorpusEntry:
    try:
        return CorpusEntry.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise CorpusError(f"{where}: {loc + ': ' if loc else ''}{message}") from None


# ------------------------------------------------------------------------------------------------- scoring

@dataclass(frozen=True)
class CaseResult:
    """The classifier's verdict on one case next to its label."""

    case: Case
    signature: str | None
    cause: Cause | None
    action: Action
    in_library: bool

    @property
    def matched(self) -> bool:
        return self.signature is not None

    @property
    def class_right(self) -> bool:
        return self.matched and self.cause == self.case.label.cause

    @property
    def action_right(self) -> bool:
        return self.matched and self.action == self.case.label.expected_action

    @property
    def strict(self) -> bool:
        return self.class_right and self.action_right

    @property
    def flagged(self) -> bool:
        """A harmless case the classifier found a cause in."""
        return self.case.label.harmless and self.matched

    def to_dict(self) -> dict[str, Any]:
        label = self.case.label
        return {"case": self.case.id, "split": self.case.split, "kind": label.kind, "form": self.case.form,
                "expected": {"cause": label.cause, "action": label.expected_action},
                "got": {"signature": self.signature, "cause": self.cause, "action": self.action},
                "matched": self.matched, "strict": self.strict, "in_library": self.in_library}


@dataclass
class Tally:
    """Counts over failure cases (`cases`, `matched`, `strict`) and harmless ones (`harmless`, `flagged`)."""

    cases: int = 0
    matched: int = 0
    strict: int = 0
    harmless: int = 0
    flagged: int = 0

    def add(self, result: CaseResult) -> None:
        if result.case.label.harmless:
            self.harmless += 1
            self.flagged += result.flagged
        else:
            self.cases += 1
            self.matched += result.matched
            self.strict += result.strict

    def to_dict(self) -> dict[str, int]:
        return {"cases": self.cases, "matched": self.matched, "strict": self.strict, "harmless": self.harmless,
                "flagged": self.flagged}


@dataclass(frozen=True)
class Score:
    """Every case's result; tallies by split, kind and form are computed from them."""

    results: tuple[CaseResult, ...]

    @property
    def scored(self) -> list[CaseResult]:
        return [r for r in self.results if not r.in_library]

    @property
    def in_library(self) -> list[CaseResult]:
        return [r for r in self.results if r.in_library]

    def tally(self, *, split: Split | None = None, kind: str | None = None, form: Form | None = None) -> Tally:
        tally = Tally()
        for result in self.scored:
            case = result.case
            if (split is None or case.split == split) and (kind is None or case.label.kind == kind) \
                    and (form is None or case.form == form):
                tally.add(result)
        return tally

    def kinds(self) -> list[str]:
        return sorted({r.case.label.kind for r in self.scored})

    def groups(self) -> list[str]:
        """The rows of the by-kind table: each kind, with the catalogue-form Xid entries as one group."""
        return sorted({group_of(r.case) for r in self.scored})

    def tally_group(self, group: str, *, split: Split | None = None) -> Tally:
        tally = Tally()
        for result in self.scored:
            if group_of(result.case) == group and (split is None or result.case.split == split):
                tally.add(result)
        return tally

    def wrong(self) -> list[CaseResult]:
        """Failure cases not strictly right and flagged harmless cases: the confusion list."""
        return [r for r in self.scored if r.flagged or (not r.case.label.harmless and not r.strict)]

    def to_dict(self) -> dict[str, Any]:
        return {"all": self.tally().to_dict(),
                "splits": {s: self.tally(split=s).to_dict() for s in ("train", "held_out")},
                "forms": {f: self.tally(form=f).to_dict() for f in ("quoted", "catalogue")},
                "kinds": {k: {s: self.tally(split=s, kind=k).to_dict() for s in ("train", "held_out")}
                          for k in self.kinds()},
                "in_library_examples": [r.case.id for r in self.in_library],
                "results": [r.to_dict() for r in self.results]}


#: The by-kind row of every catalogue-form case.
CATALOGUE_GROUP = "xid_* (catalogue)"


def group_of(case: Case) -> str:
    """A case's row in the by-kind table: its kind, or `CATALOGUE_GROUP` for the Xid catalogue's entries."""
    return CATALOGUE_GROUP if case.form == "catalogue" else case.label.kind


def library_examples(library: SignatureLibrary) -> frozenset[str]:
    """Every signature's example lines, stripped."""
    return frozenset(line.strip() for signature in library for line in signature.examples)


def classify_case(classifier: FailureClassifier, case: Case) -> Classification:
    """Feed a case's lines, entry by entry, on each entry's node, and return the verdict (the classifier is
    reset first, escalation history included, so cases do not influence each other)."""
    classifier.reset(forget_history=True)
    for entry in case.entries:
        node = entry.node or DEFAULT_NODE
        for line in entry.log_lines():
            classifier.feed_line(node, line)
    return classifier.verdict()


def settled_action(verdict: Classification) -> FailureAction:
    """The action a failure settles at: a deterministic fault's signature restarts once to rule out a
    transient and stops when it recurs (an escalation to do-not-retry counted per incident); the label's
    "a restart does not help" is that settled action, so it is what is compared."""
    signature = verdict.signature
    escalation = None if signature is None else signature.escalate
    if (escalation is not None and escalation.per == "incident" and verdict.action is FailureAction.RESTART_JOB
            and escalation.action is FailureAction.DO_NOT_RETRY):
        return FailureAction.DO_NOT_RETRY
    return verdict.action


def score(corpus: Corpus | Iterable[CorpusEntry], library: SignatureLibrary | None = None) -> Score:
    """Run the classifier (over `library`, by default the bundled one) on every case of `corpus`."""
    if not isinstance(corpus, Corpus):
        corpus = Corpus(tuple(corpus))
    library = load_signature_library() if library is None else library
    examples = library_examples(library)
    classifier = FailureClassifier(library, line_time=line_timestamp)
    results = []
    for case in corpus.cases():
        in_library = any(line.strip() in examples for entry in case.entries for line in entry.log_lines())
        verdict = classify_case(classifier, case)
        cause = None if verdict.failure_class is None else CAUSE_OF_CLASS[verdict.failure_class]
        action: Action = "none" if verdict.signature is None else ACTION_OF[settled_action(verdict)]
        results.append(CaseResult(case, None if verdict.signature is None else verdict.signature.id, cause,
                                  action, in_library))
    return Score(tuple(results))


# -------------------------------------------------------------------------------------------------- report

def _cell(numerator: int, denominator: int) -> str:
    if denominator == 0:
        return "-"
    return f"{numerator}/{denominator} ({100 * numerator / denominator:.0f} %)"


def _row(name: str, tally: Tally) -> list[str]:
    return [name, str(tally.cases), _cell(tally.matched, tally.cases), _cell(tally.strict, tally.cases),
            _cell(tally.flagged, tally.harmless)]


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render(score: Score, *, wrong: bool = False) -> str:
    """Markdown tables: by split, by form, by kind and split; then the in-library cases (and the confusion
    list when `wrong`)."""
    header = ["", "failure cases", "matched", "strict", "harmless flagged"]
    parts = ["By split:", "", _markdown(header, [_row("train", score.tally(split="train")),
                                                  _row("held out", score.tally(split="held_out")),
                                                  _row("all", score.tally())])]
    parts += ["", "By form (quoted log lines; Xid catalogue entries in the dmesg form):", "",
              _markdown(header, [_row(f, score.tally(form=f)) for f in ("quoted", "catalogue")])]
    kind_header = ["kind", "train cases", "train strict", "held-out cases", "held-out strict", "harmless flagged"]
    kind_rows = []
    for group in score.groups():
        train, held = score.tally_group(group, split="train"), score.tally_group(group, split="held_out")
        both = score.tally_group(group)
        kind_rows.append([group, str(train.cases + train.harmless), _cell(train.strict, train.cases),
                          str(held.cases + held.harmless), _cell(held.strict, held.cases),
                          _cell(both.flagged, both.harmless)])
    parts += ["", "By kind:", "", _markdown(kind_header, kind_rows)]
    library = score.in_library
    parts += ["", f"In library examples (not scored): {len(library)}"
              + (": " + ", ".join(r.case.id for r in library) if library else "")]
    if wrong:
        rows = [[r.case.id, r.case.split, r.case.label.kind, f"{r.case.label.cause}/{r.case.label.expected_action}",
                 f"{r.signature or 'unknown'}: {r.cause or '-'}/{r.action}"] for r in score.wrong()]
        parts += ["", "Not strictly right:", "",
                  _markdown(["case", "split", "kind", "expected cause/action", "got"], rows)]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gpuplane.controllers.diagnosis_corpus",
                                     description="Score the failure classifier on a corpus of real failure logs.")
    parser.add_argument("corpus", help="a corpus YAML file or a directory of them")
    parser.add_argument("--signatures", action="append", default=[],
                        help="an operator signature file extending the bundled library (repeatable)")
    parser.add_argument("--wrong", action="store_true", help="also list the cases that are not strictly right")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    try:
        corpus = load_corpus(args.corpus)
        library = load_signature_library(extra=args.signatures)
    except GpuplaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = score(corpus, library)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        counts = Counter(e.label.harmless for e in corpus)
        print(f"{len(corpus)} entries ({counts[True]} harmless), {len(result.results)} cases, "
              f"{len(library)} signatures\n")
        print(render(result, wrong=args.wrong))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
