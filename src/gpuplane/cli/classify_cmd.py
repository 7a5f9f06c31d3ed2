"""New-problem review and operators' signature files: `gpuplane classify --review` and `gpuplane signatures test`.

The review is the "after training" step: the lines no signature matched are mined into templates with
drain3 (the Drain log parser: a fixed-depth tree over token prefixes, the variable tokens become `<*>`),
each with its count and a few sample lines; templates whose words say something failed get a proposed
signature stub in the library's own YAML format (a pattern from the template's fixed parts, the samples
as examples, another template's line as near miss), checked by the same loader an operator's file goes
through. A stub is a proposal for a person: its class and action are guesses from its words.

`signatures test FILE` loads an operator's file on top of the bundled library, then reports for each of its
signatures whether every example matches and no near miss does, and which signature the classifier would
really pick for each example with the whole library loaded (a broader bundled pattern can shadow it).

CLI layer: the classifier, the model and drain3.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from gpuplane.controllers.classifier import BATCH_LINES, FailureClassifier, line_timestamp
from gpuplane.model.errors import GpuplaneError
from gpuplane.model.failures import (
    Signature,
    SignatureError,
    SignatureLibrary,
    load_signature_library,
    parse_signature_file,
)

#: Words that make an unmatched template a candidate for a signature (a failure, not chatter).
FAILURE_WORDS = re.compile(r"(?i)\b(?:error|errors|fail(?:ed|ure|s)?|fatal|exception|abort(?:ed)?|killed|"
                           r"timed? ?out|timeout|unhealthy|lost|refused|denied|panic|traceback|segfault|"
                           r"cannot|unable|corrupt(?:ed)?|invalid|crash(?:ed)?|oom)\b")
#: drain3's similarity threshold and tree depth (its defaults are 0.4 and 4).
DRAIN_SIM = 0.5
DRAIN_DEPTH = 4
SAMPLES = 3
_WILDCARD = "<*>"
_CLASS_WORDS: tuple[tuple[str, str], ...] = (
    (r"(?i)nvrm|xid|ecc|gpu|nvlink|nvml|cuda", "gpu-hardware"),
    (r"(?i)nccl|\bib\b|infiniband|rdma|socket|connect|rendezvous|c10d|network", "network"),
    (r"(?i)disk|space|i/o|storage|nfs|mount|file", "storage"),
    (r"(?i)kubelet|pod|node|container|plugin|admission", "infrastructure"),
)


@dataclass
class MinedTemplate:
    """One drain3 cluster of unmatched lines."""

    template: str
    count: int
    samples: list[str] = field(default_factory=list)

    @property
    def candidate(self) -> bool:
        return FAILURE_WORDS.search(self.template) is not None


@dataclass(frozen=True)
class Review:
    lines: int
    unmatched: int
    templates: list[MinedTemplate]
    stubs: list[dict[str, Any]]
    refused: list[tuple[str, str]]  # (template, why its stub was refused)

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "unmatched": self.unmatched,
                "templates": [{"template": t.template, "count": t.count, "samples": t.samples,
                               "candidate": t.candidate} for t in self.templates],
                "stubs": self.stubs, "refused": [{"template": t, "why": w} for t, w in self.refused]}


def feed_log(classifier: FailureClassifier, node: str, handle: Iterable[bytes]) -> None:
    """Feed one node's log to `classifier` in batches of `BATCH_LINES` (`feed_lines`, the fast path)."""
    lines = iter(handle)
    while chunk := list(islice(lines, BATCH_LINES)):
        classifier.feed_lines(node, chunk)


def read_lines(path: Path) -> Iterator[str]:
    """A log file's lines (plain or .gz), decoded with replacement, without their line ends."""
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
        for raw in handle:
            yield raw.decode("utf-8", "replace").rstrip("\r\n")


def mine(lines: Iterable[str]) -> list[MinedTemplate]:
    """drain3 templates of `lines`, the most frequent first, each with up to `SAMPLES` distinct lines."""
    from drain3 import TemplateMiner  # type: ignore[import-untyped]
    from drain3.template_miner_config import TemplateMinerConfig  # type: ignore[import-untyped]

    config = TemplateMinerConfig()
    config.drain_sim_th = DRAIN_SIM
    config.drain_depth = DRAIN_DEPTH
    config.profiling_enabled = False
    miner = TemplateMiner(config=config)
    samples: dict[int, list[str]] = {}
    for line in lines:
        text = line.strip()
        if not text:
            continue
        result = miner.add_log_message(text)
        kept = samples.setdefault(int(result["cluster_id"]), [])
        if len(kept) < SAMPLES and text not in kept:
            kept.append(text)
    out = [MinedTemplate(cluster.get_template(), cluster.size, samples.get(cluster.cluster_id, []))
           for cluster in miner.drain.clusters]
    return sorted(out, key=lambda t: (-t.count, t.template))


def _stub_id(template: str, taken: set[str]) -> str:
    words = [w.lower() for w in re.findall(r"(?<![\w])[A-Za-z]{3,}(?![\w])", template.replace(_WILDCARD, " "))][:5]
    base = "-".join(words)[:48].strip("-") or "new-problem"
    ident, n = f"review-{base}", 2
    while ident in taken:
        ident, n = f"review-{base}-{n}", n + 1
    taken.add(ident)
    return ident


def stub_pattern(template: str) -> str:
    """A pattern from a template's fixed parts: each escaped (blanks as `\\s+`, digit runs as `\\d+`), the
    variable parts bounded (`.{0,64}?`), at most the first four fixed parts of four characters or more."""
    parts = [p.strip() for p in template.split(_WILDCARD)]
    fixed = [p for p in parts if len(p) >= 4][:4]
    # drain3 splits on blanks and joins with one space: any run of blanks in the line is one in the template;
    # numbers drain3 kept (a template of one line keeps them all) become \d+
    return r".{0,64}?".join(r"\s+".join(_token(word) for word in p.split()) for p in fixed)


def _token(word: str) -> str:
    return r"\d+".join(re.escape(piece) for piece in re.split(r"[0-9]+", word))


def _class_of(template: str) -> str:
    for words, failure_class in _CLASS_WORDS:
        if re.search(words, template):
            return failure_class
    return "software"


def propose(templates: Sequence[MinedTemplate], library: SignatureLibrary) -> tuple[list[dict[str, Any]],
                                                                                     list[tuple[str, str]]]:
    """Signature stubs for the candidate templates, each validated as a `Signature`; refused ones with why."""
    taken = set(library.ids)
    stubs: list[dict[str, Any]] = []
    refused: list[tuple[str, str]] = []
    others = [s for t in templates for s in t.samples[:1]]
    for template in templates:
        if not template.candidate:
            continue
        pattern = stub_pattern(template.template)
        if not pattern:
            refused.append((template.template, "no fixed part of four characters or more"))
            continue
        regex = re.compile(pattern)
        near = next((line for line in others if regex.search(line) is None), None)
        failure_class = _class_of(template.template)
        stub: dict[str, Any] = {
            "id": _stub_id(template.template, taken),
            "description": f"Proposed from {template.count} unmatched line(s): {template.template[:120]}",
            "pattern": pattern, "failure_class": failure_class,
            "blame_node": failure_class == "gpu-hardware", "action": "restart-job",
            "examples": template.samples[:2],
            "near_misses": [near if near is not None else "an unrelated line of the same log"],
        }
        try:
            Signature.model_validate(stub)
        except ValueError as exc:
            refused.append((template.template, str(exc).splitlines()[-1].split(" [type=")[0].strip()))
            continue
        stubs.append(stub)
    return stubs, refused


def review(files: Sequence[Path], library: SignatureLibrary) -> Review:
    """Feed `files` to a classifier, mine its unmatched lines and propose stubs for the candidate templates."""
    classifier = FailureClassifier(library, line_time=line_timestamp)
    unmatched: list[str] = []
    total = 0
    for path in files:
        name = path.name.split(".")[0] or path.name
        for line in read_lines(path):
            total += 1
            if classifier.feed_line(name, line) is None and line.strip():
                unmatched.append(line)
    templates = mine(unmatched)
    stubs, refused = propose(templates, library)
    return Review(total, len(unmatched), templates, stubs, refused)


def stubs_yaml(stubs: Sequence[dict[str, Any]]) -> str:
    """The stubs as a signature file (`gpuplane classify --signatures FILE` takes it as it is)."""
    head = ("# Proposed by gpuplane classify --review: check each class, action and blame_node, tighten the\n"
            "# pattern, add near misses, then test with: gpuplane signatures test FILE\n")
    return head + yaml.safe_dump({"version": 1, "signatures": list(stubs)}, sort_keys=False, allow_unicode=True,
                                 width=120)


def print_review(result: Review, *, top: int, as_json: bool) -> None:
    """The review as text (templates, then the stubs' YAML) or one JSON object."""
    shown = result.templates[:top]
    if as_json:
        data = result.to_dict()
        data["templates"] = data["templates"][:top]
        print(json.dumps(data))
        return
    print(f"# {result.lines:,} lines, {result.unmatched:,} unmatched, in {len(result.templates):,} templates "
          f"({sum(t.candidate for t in result.templates):,} look like failures)")
    for t in shown:
        print(f"{t.count:>8,}  {'!' if t.candidate else ' '} {t.template}")
        for sample in t.samples[:2]:
            print(f"{'':>11}e.g. {sample[:200]}")
    for template, why in result.refused:
        print(f"# no stub for {template[:100]!r}: {why}")
    if result.stubs:
        print()
        print(stubs_yaml(result.stubs), end="")


# ------------------------------------------------------------------------------------------- signatures test

@dataclass(frozen=True)
class SignatureCheck:
    id: str
    examples: int
    near_misses: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def check_signature_file(path: Path) -> tuple[list[SignatureCheck], str | None]:
    """Check an operator's file: its own examples and near misses, and what the whole library (bundled plus
    the file) picks for each example. The second value is the loader's refusal, if it refuses the file."""
    try:
        own, _ = parse_signature_file(path)
    except (SignatureError, OSError) as exc:
        return [], str(exc)
    try:
        library = load_signature_library(extra=[path])
    except GpuplaneError as exc:
        return [], str(exc)
    classifier = FailureClassifier(library)
    checks = []
    for signature in own:
        problems = [f"example does not match: {line!r}" for line in signature.examples if not signature.matches(line)]
        problems += [f"near miss matches: {line!r}" for line in signature.near_misses if signature.matches(line)]
        for line in signature.examples:
            classifier.reset(forget_history=True)
            found = classifier.feed_line("n", line)
            winner = None if found is None else found.signature.id
            if winner != signature.id:
                problems.append(f"example classified as {winner or 'nothing'} with the whole library: {line!r}")
        checks.append(SignatureCheck(signature.id, len(signature.examples), len(signature.near_misses),
                                     tuple(problems)))
    return checks, None


def signatures_test(
    file: Annotated[Path, typer.Argument(help="an operator's signature file (the library's YAML format)")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Check a signature file: every example matches its signature (and wins with the bundled library
    loaded), no near miss matches. Exit status 1 when anything fails."""
    checks, refused = check_signature_file(file)
    failed = refused is not None or any(not c.ok for c in checks)
    if as_json:
        print(json.dumps({"file": str(file), "ok": not failed, "refused": refused,
                          "signatures": [{"id": c.id, "examples": c.examples, "near_misses": c.near_misses,
                                          "ok": c.ok, "problems": list(c.problems)} for c in checks]}))
    else:
        if refused is not None:
            print(f"refused: {refused}")
        for c in checks:
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.id}: {c.examples} example(s), {c.near_misses} near miss(es)")
            for problem in c.problems:
                print(f"       {problem}")
        print(f"{sum(c.ok for c in checks)}/{len(checks)} signatures pass")
    if failed:
        raise typer.Exit(1)


def classify_review(files: Sequence[Path], signatures: Sequence[Path], *, top: int, as_json: bool) -> None:
    """`gpuplane classify --review`: mine the unmatched lines of `files` and propose signature stubs."""
    try:
        library = load_signature_library(extra=list(signatures))
        result = review(files, library)
    except GpuplaneError as exc:
        print(f"error: {exc}")
        raise typer.Exit(2) from None
    except (OSError, EOFError) as exc:
        print(f"error: {exc}")
        raise typer.Exit(2) from None
    print_review(result, top=top, as_json=as_json)


def register(app: typer.Typer) -> None:
    """Add `gpuplane signatures test FILE` to `app`."""
    group = typer.Typer(help="Operators' failure-signature files.", no_args_is_help=True)
    group.command("test")(signatures_test)
    app.add_typer(group, name="signatures")
