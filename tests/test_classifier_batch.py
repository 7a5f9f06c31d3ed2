"""`FailureClassifier.feed_lines` (the batch path the CLI and the benchmark use) against `feed_line` one line at a
time: the same verdicts on the whole failure corpus, the same evidence, counters and unmatched report on the
benchmark's mixed log and on arbitrary lines, with either prefilter engine; and the template-key shapes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.cli.bench import classify_bench_log
from gpuplane.controllers.classifier import _FOLD, FailureClassifier, key_shape, line_timestamp, normalise_line
from gpuplane.controllers.diagnosis_corpus import DEFAULT_NODE, load_corpus
from gpuplane.model.failures import load_signature_library

LIBRARY = load_signature_library()
CORPUS = Path(__file__).parent / "fixtures" / "failure-corpus"
ENGINES = ("hyperscan", "re")


def _state(classifier: FailureClassifier) -> tuple[Any, ...]:
    verdict = classifier.verdict().to_dict()
    return verdict, classifier.stats(), classifier.unmatched_report()


def _classifier(engine: str | None = None, **kwargs: Any) -> FailureClassifier:
    classifier = FailureClassifier(LIBRARY, line_time=line_timestamp, **kwargs)
    if engine is not None:
        classifier.prefilter.engine = engine
    return classifier


def test_hyperscan_is_the_engine_where_installed() -> None:
    # hyperscan is a run-time dependency (pyproject); without it the batch scan would run the regex
    assert _classifier().prefilter.engine == "hyperscan"


@pytest.mark.parametrize("engine", ENGINES)
def test_the_whole_corpus_classifies_the_same_line_by_line_and_in_batches(engine: str) -> None:
    one, batch = _classifier(), _classifier(engine)
    cases = load_corpus(CORPUS).cases()
    assert len(cases) > 300
    for case in cases:
        one.reset(forget_history=True)
        batch.reset(forget_history=True)
        returned = []
        for entry in case.entries:
            node = entry.node or DEFAULT_NODE
            lines = entry.log_lines()
            expected = [m for m in (one.feed_line(node, line) for line in lines) if m is not None]
            returned = batch.feed_lines(node, lines)
            assert [m.to_dict() for m in returned] == [m.to_dict() for m in expected], case.id
        assert batch.verdict().to_dict() == one.verdict().to_dict(), case.id
    assert _state(batch)[1:] == _state(one)[1:]


@pytest.mark.parametrize(("engine", "size"), [(e, s) for e in ENGINES for s in (1, 7, 2048)])
def test_the_bench_log_gives_the_same_everything_in_batches(engine: str, size: int) -> None:
    data, nodes, expected = classify_bench_log(6000, seed=3)
    one, batch = _classifier(), _classifier(engine)
    for node, line in zip(nodes, data, strict=True):
        one.feed_line(node, line)
    for start in range(0, len(data), size):
        batch.feed_lines(nodes[start:start + size], data[start:start + size])
    assert _state(batch) == _state(one)
    assert one.stats().matched_lines == expected > 0  # 1 % of 6,000 lines are examples: about 60


# a few signature examples, a near miss, noise with numbers and hex, and the awkward: newlines inside a line,
# NUL, invalid UTF-8, a long line, blanks
_PIECES = [
    "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
    "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error",
    "Killed", "step 12 loss 0.25 comm 0x7f3a", "NCCL INFO comm 0xdeadbeef01 rank 3 nranks 8", "Xid", "\n",
    "\x00", "\t", "  ", "ab12cd34ef", "1.5e-04", "-17", "0x", "é", "x" * 300,
]


@st.composite
def _lines(draw: st.DrawFn) -> list[bytes | str]:
    out: list[bytes | str] = []
    for _ in range(draw(st.integers(0, 30))):
        text = "".join(draw(st.lists(st.sampled_from(_PIECES), min_size=0, max_size=4)))
        kind = draw(st.sampled_from(("str", "bytes", "bad")))
        out.append(text if kind == "str" else text.encode() + (b"\xff\xfe" if kind == "bad" else b""))
    return out


@settings(max_examples=150, deadline=None)
@given(lines=_lines(), engine=st.sampled_from(ENGINES), size=st.integers(1, 9),
       per_line_nodes=st.booleans())
def test_any_lines_give_the_same_in_batches(lines: list[bytes | str], engine: str, size: int,
                                            per_line_nodes: bool) -> None:
    # small caps so the batches cut lines, prune templates and clear the key cache like long logs do
    one = _classifier(max_line_bytes=128, max_templates=2)
    batch = _classifier(engine, max_line_bytes=128, max_templates=2)
    nodes = [f"n{i % 3}" for i in range(len(lines))]
    for node, line in zip(nodes, lines, strict=True):
        one.feed_line(node, line)
    for start in range(0, len(lines), size):
        chunk = lines[start:start + size]
        batch.feed_lines(nodes[start:start + size] if per_line_nodes else "n0", chunk)
        if not per_line_nodes:
            for node in set(nodes[start:start + size]) - {"n0"}:
                batch.feed_lines(node, [])  # the same nodes seen
    if per_line_nodes:
        assert _state(batch) == _state(one)
    else:
        assert _state(batch)[1:] == _state(one)[1:]


def test_feed_lines_wants_one_node_per_line_or_one_for_all() -> None:
    with pytest.raises(ValueError, match="2 nodes for 1 lines"):
        _classifier().feed_lines(["a", "b"], [b"x"])
    with pytest.raises(TypeError, match="a log line is bytes or str"):
        _classifier().feed_lines("a", [b"x", 3])  # type: ignore[list-item]


# ------------------------------------------------------------------------------------------- key shapes

@pytest.mark.parametrize(("first", "second", "same"), [
    # whole numbers of any width share a shape (and so a template)
    (b"comm 0x7f3a rank 12 nranks 512", b"comm 0xdeadbeef01 rank 3 nranks 8", True),
    (b"busId 1b000 pid 7", b"busId 3000a pid 123456", True),
    # a number inside a word, or next to '.', '+', '-', keeps its width: the template rules see it
    (b"cali0a1b2c3d4e up", b"cali0a1 up", False),
    (b"lr 1.5e-04", b"lr 1.5e-4", False),
    (b"v12.3", b"v1.3", False),
])
def test_key_shapes(first: bytes, second: bytes, same: bool) -> None:
    assert (key_shape(first.translate(_FOLD)) == key_shape(second.translate(_FOLD))) is same
    if same:
        assert normalise_line(first) == normalise_line(second)


_TOKENS = ["0", "7", "12", "123456", "0x1f", "0X2", "0xab", "ab12", "1b000", "a1", "cafe", "zz9", "9zz", "1.5",
           "e5", "E", "x", "N", "ab12cd34ef99", "g", "."]
_SEPARATORS = [" ", "  ", "\t", "-", "+", ".", ":", ",", "=", "/", "[", "]", ""]


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(_TOKENS), st.sampled_from(_SEPARATORS)), max_size=12),
       widths=st.lists(st.integers(1, 9), min_size=12, max_size=12))
def test_lines_of_one_shape_have_one_template(parts: list[tuple[str, str]], widths: list[int]) -> None:
    # the same line with its digit runs made other widths and values: where the shapes agree, so do the
    # templates (up to what the key's fold already merges: letters a-f, and a leading 0 with other digits,
    # so a run that starts with 0 keeps starting with 0)
    first = "".join(token + sep for token, sep in parts).encode()
    runs = iter(widths * 20)
    second = re.sub(rb"[0-9]+", lambda m: (b"0" if m.group()[0] == 48 else b"3") * next(runs), first)
    if key_shape(first.translate(_FOLD)) == key_shape(second.translate(_FOLD)):
        assert normalise_line(first).translate(_FOLD) == normalise_line(second).translate(_FOLD)


def test_feed_log_reads_a_log_in_batches_as_line_by_line() -> None:
    from gpuplane.cli.classify_cmd import feed_log

    data, _, _ = classify_bench_log(5000, seed=9)  # more than two batches of 2,048
    one, batch = _classifier(), _classifier()
    for line in data:
        one.feed_line("gpu-node-001", line + b"\n")
    feed_log(batch, "gpu-node-001", (line + b"\n" for line in data))
    assert _state(batch) == _state(one) and one.stats().lines == 5000
