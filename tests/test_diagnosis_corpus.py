"""The failure-diagnosis corpus (tests/fixtures/failure-corpus) and its scorer
(gpuplane.controllers.diagnosis_corpus)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuplane.controllers.diagnosis_corpus import (
    HELD_OUT_PERCENT,
    CorpusError,
    Tally,
    load_corpus,
    main,
    score,
    split_of,
)
from gpuplane.model.failures import load_signature_library

CORPUS = Path(__file__).parent / "fixtures" / "failure-corpus"


# ------------------------------------------------------------------------------------ the shipped corpus

def test_shipped_corpus_loads_with_its_promised_size() -> None:
    corpus = load_corpus(CORPUS)
    entries = list(corpus)
    assert len(entries) >= 300
    # at least 300 of them quote real log lines (the Xid catalogue's dmesg-form entries come on top)
    assert sum(e.form == "quoted" for e in entries) >= 300
    quoted_harmless = [e for e in entries if e.label.harmless and e.form == "quoted"]
    assert len(quoted_harmless) >= 40
    ids = [e.id for e in entries]
    assert len(set(ids)) == len(ids)
    assert all(e.source and e.why and e.project for e in entries)
    # every file of the directory contributes, and every entry knows its file
    assert {Path(f).name for f in corpus.files.values()} == {p.name for p in CORPUS.glob("*.yaml")}


def test_shipped_corpus_split_is_the_hash_split_and_about_thirty_per_cent() -> None:
    corpus = load_corpus(CORPUS)
    cases = corpus.cases()
    assert all(e.split == split_of(e.case_id) for e in corpus)
    held = sum(c.split == "held_out" for c in cases)
    # about 30 %: within 5 points either way over 300+ cases
    assert 0.25 <= held / len(cases) <= 0.35


def test_shipped_incidents_span_nodes_and_share_a_label() -> None:
    cases = [c for c in load_corpus(CORPUS).cases() if len(c.entries) > 1]
    assert cases, "the corpus holds at least one multi-node incident"
    for case in cases:
        assert len({e.node for e in case.entries}) == len(case.entries)
        assert len({e.label for e in case.entries}) == 1


@pytest.mark.parametrize(("key", "split"), [
    # pinned: a change of the hash scheme moves these and must update the corpus files with it
    ("tiny-oom", "train"), ("tiny-xid79", "held_out"), ("tiny-hami-d", "held_out"), ("tiny-help-text-a", "held_out"),
    ("tiny-info-c", "held_out"), ("tiny-incident", "train"), ("pt-watchdog-118369", "train"),
])
def test_split_of_is_a_fixed_hash(key: str, split: str) -> None:
    assert split_of(key) == split


def test_split_of_holds_out_about_the_promised_share() -> None:
    held = sum(split_of(f"case-{i}") == "held_out" for i in range(2000))
    # 2000 draws at p = 0.30: the standard deviation is sqrt(2000 * 0.3 * 0.7) = 20.5, so +-60 is about 3 sigma
    assert abs(held - 2000 * HELD_OUT_PERCENT / 100) <= 60


# ------------------------------------------------------------------------------- the scorer's arithmetic

TINY_LIBRARY = """
version: 1
signatures:
  - id: tiny-gpu-oom
    description: GPU out of memory
    pattern: 'CUDA out of memory'
    failure_class: software
    blame_node: false
    action: do-not-retry
    examples: ['torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB']
    near_misses: ['CUDA memory is fine']
  - id: tiny-xid-79
    description: GPU fell off the bus
    xid: 79
    failure_class: gpu-hardware
    blame_node: true
    action: isolate-node
    examples: ['NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.']
    near_misses: ['NVRM: Xid (PCI:0000:3b:00): 78, pid=1, vGPU start error']
  - id: tiny-nccl-timeout
    description: NCCL collective timeout
    pattern: 'Watchdog caught collective operation timeout'
    failure_class: network
    blame_node: false
    action: restart-job
    examples: ['[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)']
    near_misses: ['Watchdog started']
"""


def _entry(entry_id: str, lines: str, kind: str, cause: str, isolate: bool = False, restart: bool = False,
           **extra: Any) -> dict[str, Any]:
    raw = {"id": entry_id, "source": "https://example.invalid/issues/1", "project": "example/project",
           "lines": lines, "label": {"kind": kind, "cause": cause, "isolate_node": isolate, "restart_helps": restart},
           "why": "the thread says so", **extra}
    raw["split"] = split_of(str(raw.get("incident") or entry_id))
    return raw


# (id, line, label kind, cause, isolate, restart) -> what the tiny library makes of it
TINY = [
    _entry("tiny-oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB", "gpu_oom", "job"),
    _entry("tiny-xid79", "[Fri Apr  5 21:29:39 2024] NVRM: Xid (PCI:0000:a1:00): 79, pid='<unknown>', "
           "name=<unknown>, GPU has fallen off the bus.", "xid_79", "hardware", isolate=True, restart=True),
    _entry("tiny-timeout", "[rank3]:[E1016 03:33:45.3 ProcessGroupNCCL.cpp:568] [Rank 3] Watchdog caught collective "
           "operation timeout: WorkNCCL(SeqNum=50)", "nccl_timeout", "network", restart=True),
    _entry("tiny-hami-d", "[HAMI-core ERROR (pid:7 allocator.c:115)]: cuMemoryAllocate failed res=2", "gpu_oom", "job"),
    _entry("tiny-mislabelled", "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB", "gpu_oom",
           "hardware", isolate=True, restart=True),
    _entry("tiny-info-c", "node:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>", "harmless", "harmless"),
    _entry("tiny-help-text-a", "INFO CUDA graphs can take 1~3 GiB; if you see CUDA out of memory, lower it",
           "harmless", "harmless"),
    _entry("tiny-copied", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "gpu_oom", "job"),
    _entry("tiny-incident-a", "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)",
           "xid_79", "hardware", isolate=True, restart=True, incident="tiny-incident", node="node-a"),
    _entry("tiny-incident-b", "NVRM: Xid (PCI:0000:17:00): 79, pid=9, GPU has fallen off the bus.",
           "xid_79", "hardware", isolate=True, restart=True, incident="tiny-incident", node="node-b"),
]


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, Path]:
    library = tmp_path / "library.yaml"
    library.write_text(TINY_LIBRARY)
    corpus = tmp_path / "corpus.yaml"
    corpus.write_text(yaml.safe_dump({"entries": TINY}, sort_keys=False))
    return library, corpus


def test_scorer_counts_matched_strict_flagged_and_library_copies(tiny: tuple[Path, Path]) -> None:
    library_path, corpus_path = tiny
    result = score(load_corpus(corpus_path), load_signature_library(library_path))
    # 10 entries -> 9 cases (the two incident entries are one case); tiny-copied repeats an example line
    assert len(result.results) == 9
    assert [r.case.id for r in result.in_library] == ["tiny-copied"]
    by_id = {r.case.id: r for r in result.results}
    # the incident: the Xid on node-b outranks node-a's timeout (isolate-node is more severe than restart-job)
    assert by_id["tiny-incident"].signature == "tiny-xid-79" and by_id["tiny-incident"].strict
    # the mislabelled OOM matches, but as job/stop, not hardware/isolate
    assert by_id["tiny-mislabelled"].matched and not by_id["tiny-mislabelled"].class_right
    assert not by_id["tiny-mislabelled"].action_right
    assert [r.case.id for r in result.wrong()] == ["tiny-hami-d", "tiny-mislabelled", "tiny-help-text-a"]


@pytest.mark.parametrize(("split", "expected"), [
    # failure cases: oom, xid79, timeout, hami, mislabelled, incident = 6 (tiny-copied is not scored)
    # matched: all but hami = 5; strict: oom, xid79, timeout, incident = 4
    # harmless: info, help-text = 2; flagged: help-text (it says "CUDA out of memory") = 1
    (None, Tally(cases=6, matched=5, strict=4, harmless=2, flagged=1)),
    # train: oom, timeout, mislabelled, incident -> 4 cases, all matched, strict 3 (not mislabelled); no harmless
    ("train", Tally(cases=4, matched=4, strict=3, harmless=0, flagged=0)),
    # held out: xid79 (strict), hami (unmatched) -> 2 cases, 1 matched, 1 strict; info and help-text, 1 flagged
    ("held_out", Tally(cases=2, matched=1, strict=1, harmless=2, flagged=1)),
])
def test_scorer_tallies_by_split(tiny: tuple[Path, Path], split: str | None, expected: Tally) -> None:
    library_path, corpus_path = tiny
    result = score(load_corpus(corpus_path), load_signature_library(library_path))
    assert result.tally(split=split) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "expected"), [
    # gpu_oom: oom (strict), hami (unmatched), mislabelled (matched, wrong) -> 3 cases, 2 matched, 1 strict
    ("gpu_oom", Tally(cases=3, matched=2, strict=1)),
    # xid_79: xid79 and the incident, both strict
    ("xid_79", Tally(cases=2, matched=2, strict=2)),
    ("harmless", Tally(harmless=2, flagged=1)),
])
def test_scorer_tallies_by_kind(tiny: tuple[Path, Path], kind: str, expected: Tally) -> None:
    library_path, corpus_path = tiny
    result = score(load_corpus(corpus_path), load_signature_library(library_path))
    assert result.tally(kind=kind) == expected


def test_entry_point_prints_the_tables(tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, corpus_path = tiny
    assert main([str(corpus_path), "--wrong"]) == 0  # the bundled library: the tiny one is not needed to run
    out = capsys.readouterr().out
    assert "10 entries (2 harmless), 9 cases" in out
    assert "| held out |" in out and "Not strictly right:" in out


# ---------------------------------------------------------------------------------- bad files are refused

def _good() -> dict[str, Any]:
    return _entry("e-one", "NVRM: Xid (PCI:0000:a1:00): 79, GPU has fallen off the bus.", "xid_79", "hardware",
                  isolate=True, restart=True)


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.pop("source"), "entries.0 (id e-one): source: Field required"),
    (lambda e: e.update(source="somewhere"), "entries.0 (id e-one): source: give a URL"),
    (lambda e: e.update(split="held_out"), "entries.0 (id e-one): split is train for 'e-one'"),
    (lambda e: e.update(lines="  \n"), "entries.0 (id e-one): lines: no log line"),
    (lambda e: e["label"].update(cause="cosmic-rays"), "entries.0 (id e-one): label.cause:"),
    (lambda e: e["label"].update(cause="harmless"), "entries.0 (id e-one): label: "
                                                    "a harmless line neither isolates a node nor needs a restart"),
    (lambda e: e.update(incident="e-inc", split=split_of("e-inc")), "entries.0 (id e-one): an entry of an incident"),
    (lambda e: e.update(colour="red"), "entries.0 (id e-one): colour: Extra inputs are not permitted"),
    (lambda e: e.update(id="E One"), "entries.0 (id E One): id: String should match pattern"),
])
def test_bad_entries_are_refused_naming_file_and_id(tmp_path: Path, change: Any, message: str) -> None:
    entry = _good()
    change(entry)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}))
    with pytest.raises(CorpusError) as excinfo:
        load_corpus(path)
    assert str(excinfo.value).startswith(f"{path}: ")
    assert message in str(excinfo.value)


def test_duplicate_ids_across_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"entries": [_good()]}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"entries": [_good()]}))
    with pytest.raises(CorpusError, match=r"b\.yaml: entries\.0 \(id e-one\): id: duplicate of .*a\.yaml: entries\.0"):
        load_corpus(tmp_path)


def test_incident_entries_with_different_labels_are_refused(tmp_path: Path) -> None:
    first = _entry("e-one", "line one", "xid_79", "hardware", isolate=True, restart=True, incident="e-inc", node="a")
    second = _entry("e-two", "line two", "nccl_timeout", "network", restart=True, incident="e-inc", node="b")
    path = tmp_path / "inc.yaml"
    path.write_text(yaml.safe_dump({"entries": [first, second]}))
    with pytest.raises(CorpusError, match=r"inc\.yaml: entries\.1 \(id e-two\): label: differs from e-one's"):
        load_corpus(path)


@pytest.mark.parametrize(("text", "message"), [
    ("entries: [\n", "bad.yaml: while parsing"),
    ("entries: []\n", "bad.yaml: entries: List should have at least 1 item"),
    ("{}\n", "bad.yaml: entries: Field required"),
])
def test_bad_files_are_refused_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(CorpusError, match=message):
        load_corpus(path)


def test_an_empty_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"no \*\.yaml corpus files"):
        load_corpus(tmp_path)
