"""The failure-signature library: every bundled signature against its own examples and near misses, the
loader's errors (file, entry, field), and operators' files extending, overriding and disabling entries."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuplane.controllers.classifier import FailureClassifier
from gpuplane.model import GpuplaneError
from gpuplane.model.failures import (
    FailureAction,
    FailureClass,
    Signature,
    SignatureError,
    SignatureLibrary,
    bundled_signatures_path,
    check_pattern,
    load_signature_library,
    required_literals,
    signal_of_exit,
)

LIBRARY = load_signature_library()
SIGNATURES = list(LIBRARY)
EXAMPLES = [(s, i, line) for s in SIGNATURES for i, line in enumerate(s.examples)]
NEAR_MISSES = [(s, i, line) for s in SIGNATURES for i, line in enumerate(s.near_misses)]
NODE = "gpu-node-017"


@pytest.fixture(scope="module")
def classifier() -> FailureClassifier:
    return FailureClassifier(LIBRARY)


# ------------------------------------------------------------------------------------------- the bundled file

def test_bundled_library_covers_the_reference_catalogue() -> None:
    assert len(LIBRARY) >= 45
    xids = {s.xid for s in LIBRARY if s.xid is not None}
    assert {13, 31, 43, 45, 46, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120} <= xids
    # Kubeflow's exit-code classes and torchrun's signal codes
    assert {1, 2, 126, 127, 128, 130, 137, 138, 139, 143, -6, -9, -11, -15} <= {
        s.exit_code for s in LIBRARY if s.exit_code is not None}
    classes = {s.failure_class for s in LIBRARY}
    assert classes == set(FailureClass)
    assert {s.action for s in LIBRARY} == set(FailureAction)
    for wanted in ("nccl-watchdog-timeout", "nccl-remote-error", "net-ib-completion-error", "ib-link-down",
                   "pcie-aer-uncorrected", "nvlink-error", "cuda-oom", "cuda-illegal-address", "nan-loss",
                   "py-import-error", "disk-full", "stale-file-handle", "object-store-transient",
                   "k8s-node-not-ready", "k8s-evicted", "k8s-oomkilled", "k8s-preempted", "hbm-uncorrectable"):
        assert wanted in LIBRARY, wanted


@pytest.mark.parametrize("xid", [48, 64, 79, 95])
def test_critical_xids_are_critical_and_isolate(xid: int) -> None:
    signature = LIBRARY.by_xid(xid)
    assert signature is not None and signature.critical and signature.blame_node
    assert signature.action is FailureAction.ISOLATE_NODE


def test_every_signature_has_examples_and_near_misses() -> None:
    for signature in LIBRARY:
        assert signature.examples and signature.near_misses, signature.id
        assert signature.description.strip(), signature.id


@pytest.mark.parametrize(("signature", "index", "line"), EXAMPLES,
                         ids=[f"{s.id}-example{i}" for s, i, _ in EXAMPLES])
def test_example_matches_its_signature_and_gives_its_verdict(classifier: FailureClassifier, signature: Signature,
                                                             index: int, line: str) -> None:
    classifier.reset(forget_history=True)
    assert signature.matches(line)
    match = classifier.feed_line(NODE, line, t=100.0)
    assert match is not None and match.signature.id == signature.id, (match, line)
    assert match.action is signature.action and match.node == NODE
    verdict = classifier.verdict()
    if signature.action is FailureAction.LOG_ONLY:  # tolerated: never the cause of a failed job
        assert verdict.unknown and verdict.action is FailureAction.RESTART_JOB and verdict.blamed_nodes == ()
        assert verdict.matches == (match,)
        return
    assert verdict.signature is signature and verdict.cause is match
    assert verdict.action is signature.action
    assert verdict.failure_class is signature.failure_class
    assert verdict.blamed_nodes == ((NODE,) if signature.blame_node else ())


@pytest.mark.parametrize(("signature", "index", "line"), EXAMPLES,
                         ids=[f"{s.id}-example{i}" for s, i, _ in EXAMPLES])
def test_example_passes_the_prefilter(classifier: FailureClassifier, signature: Signature, index: int,
                                      line: str) -> None:
    assert classifier.prefilter.regex.search(line.encode()) is not None
    if signature.regex is not None:  # the extracted literals are really required
        lowered = line.lower()
        assert any((lit in lowered) if ci else (lit in line) for lit, ci in signature.literals)


@pytest.mark.parametrize(("signature", "index", "line"), NEAR_MISSES,
                         ids=[f"{s.id}-near-miss{i}" for s, i, _ in NEAR_MISSES])
def test_near_miss_does_not_match_its_signature(classifier: FailureClassifier, signature: Signature, index: int,
                                                line: str) -> None:
    classifier.reset(forget_history=True)
    assert not signature.matches(line)
    match = classifier.feed_line(NODE, line)
    assert match is None or match.signature.id != signature.id


def test_xid_signatures_answer_nvml_events(classifier: FailureClassifier) -> None:
    for signature in LIBRARY:
        if signature.xid is None:
            continue
        classifier.reset(forget_history=True)
        match = classifier.feed_xid(NODE, signature.xid, t=1.0)
        assert match is not None and match.signature is signature


def test_exit_and_signal_signatures_answer_exit_events(classifier: FailureClassifier) -> None:
    for signature in LIBRARY:
        if signature.exit_code is None and signature.signal is None:
            continue
        classifier.reset(forget_history=True)
        match = classifier.feed_exit(NODE, signature.exit_code, signature.signal)
        assert match is not None and match.signature is signature
        assert signature.echo, "exit codes are echoes of the logged cause"


def test_signal_of_exit() -> None:
    assert [signal_of_exit(c) for c in (137, 139, 143, -6, -9, 1, 128, 0)] == [
        "SIGKILL", "SIGSEGV", "SIGTERM", "SIGABRT", "SIGKILL", None, None, None]


def test_bundled_path_is_package_data() -> None:
    path = bundled_signatures_path()
    assert path.name == "failure-signatures.yaml" and path.is_file()
    assert load_signature_library(path).ids == LIBRARY.ids


# --------------------------------------------------------------------------------------------- pattern checks

@pytest.mark.parametrize(("pattern", "message"), [
    ("CUDA error: (", "invalid regex"),
    ("x*", "matches an empty line"),
    ("(?:ab+)+cdef", "nested unbounded quantifiers"),
    (r"abcd\d+\d+", "adjacent unbounded quantifiers"),
    ("abcd.*e.*f.*g", "more than two unbounded"),
    (r"\d+ \w+ ab", "no literal of 4+ characters"),
    ("x" * 2001, "longer than 2000"),
])
def test_check_pattern_rejects(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_pattern(pattern)


def test_required_literals() -> None:
    # the parser factors "Preempt" out of the alternatives; the extraction puts it back
    assert required_literals(r"PreemptionByScheduler|Preempted by \S+ on node") == (("Preempt", False),)
    assert required_literals(r"NVRM: Xid \(PCI:[^)]+\): 79,") == (("NVRM: Xid (PCI:", False),)
    assert required_literals(r"(?i:GPU has fallen off the bus)") == (("gpu has fallen off the bus", True),)
    assert set(required_literals(r"ncclRemoteError|remote process exited")) == {
        ("ncclRemoteError", False), ("remote process exited", False)}
    assert required_literals(r"\d+abc") == ()


# ----------------------------------------------------------------------------------------------- the loader

VALID: dict[str, Any] = {
    "id": "my-sig",
    "description": "a test signature",
    "pattern": r"widget exploded at step \d+",
    "failure_class": "software",
    "blame_node": False,
    "action": "do-not-retry",
    "examples": ["[rank0]: widget exploded at step 12"],
    "near_misses": ["widget assembled at step 12"],
}


def _write(tmp_path: Path, data: object, name: str = "sigs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _entry(**changes: Any) -> dict[str, Any]:
    entry = dict(VALID)
    for key, value in changes.items():
        if value is None:
            entry.pop(key, None)
        else:
            entry[key] = value
    return entry


# (entries of the file, the expected message after "sigs.yaml: ")
BAD_FILES: list[tuple[str, object, str]] = [
    ("bad regex", {"signatures": [_entry(pattern="widget (exploded")]},
     "signatures.0 (id my-sig): pattern: invalid regex: missing ), unterminated subpattern"),
    ("catastrophic regex", {"signatures": [_entry(pattern="(?:widget+)+ exploded")]},
     "signatures.0 (id my-sig): pattern: nested unbounded quantifiers"),
    ("regex matching everything", {"signatures": [_entry(pattern="(?:widget)?")]},
     "signatures.0 (id my-sig): pattern: matches an empty line"),
    ("duplicate id", {"signatures": [_entry(), _entry()]},
     "signatures.1 (id my-sig): id: duplicate of signatures.0"),
    ("two matchers", {"signatures": [_entry(xid=79)]},
     "signatures.0 (id my-sig): matcher: give exactly one of pattern, xid, exit_code, signal (got pattern, xid)"),
    ("no matcher", {"signatures": [_entry(pattern=None)]},
     "signatures.0 (id my-sig): matcher: give exactly one of pattern, xid, exit_code, signal (got none)"),
    ("unknown field", {"signatures": [_entry(severity="high")]},
     "signatures.0 (id my-sig): severity: Extra inputs are not permitted"),
    ("bad action", {"signatures": [_entry(action="reboot")]},
     "signatures.0 (id my-sig): action: Input should be 'isolate-node', 'restart-job', 'do-not-retry' or "
     "'log-only'"),
    ("bad class", {"signatures": [_entry(failure_class="cosmic-rays")]},
     "signatures.0 (id my-sig): failure_class: Input should be 'gpu-hardware'"),
    ("bad id", {"signatures": [_entry(id="My Sig")]},
     "signatures.0 (id My Sig): id: String should match pattern"),
    ("signatures not a list", {"signatures": {"id": "my-sig"}}, "signatures: Input should be a valid list"),
    ("entry not a mapping", {"signatures": ["my-sig"]}, "signatures.0: Input should be a valid dictionary"),
    ("file not a mapping", ["my-sig"], "Input should be a valid dictionary"),
    ("unknown top-level key", {"signature": [_entry()]}, "signature: Extra inputs are not permitted"),
    ("missing field", {"signatures": [_entry(action=None)]}, "signatures.0 (id my-sig): action: Field required"),
    ("no examples", {"signatures": [_entry(examples=[])]},
     "signatures.0 (id my-sig): examples: List should have at least 1 item"),
    ("example does not match", {"signatures": [_entry(examples=["widget fine"])]},
     "signatures.0 (id my-sig): examples.0: does not match this signature: 'widget fine'"),
    ("near miss matches", {"signatures": [_entry(near_misses=["widget exploded at step 3"])]},
     "signatures.0 (id my-sig): near_misses.0: matches this signature"),
    ("multi-line example", {"signatures": [_entry(examples=["a\nb"])]},
     "signatures.0 (id my-sig): examples: item 0 is more than one line"),
    ("isolate without blame", {"signatures": [_entry(action="isolate-node")]},
     "signatures.0 (id my-sig): blame_node: isolate-node needs blame_node: true"),
    ("echo that blames", {"signatures": [_entry(echo=True, blame_node=True)]},
     "signatures.0 (id my-sig): blame_node: an echo signature cannot blame a node"),
    ("fallback that blames", {"signatures": [_entry(fallback=True, blame_node=True)]},
     "signatures.0 (id my-sig): fallback: a fallback signature is neither an echo nor blames a node"),
    ("amendment by a cause", {"signatures": [_entry(amends={"signatures": ["xid-79"], "action": "isolate-node"})]},
     "signatures.0 (id my-sig): amends: only a log-only signature amends other signatures' verdicts"),
    ("device repeat on a pattern", {"signatures": [_entry(device_repeat={
        "processes": 3, "window_s": 60, "action": "isolate-node", "failure_class": "gpu-hardware"})]},
     "signatures.0 (id my-sig): device_repeat: an Xid signature's, neither echo nor fallback, with an action more "
     "severe than its own"),
    ("escalation not worse", {"signatures": [_entry(escalate={"count": 2, "window_s": 60, "action": "restart-job"})]},
     "signatures.0 (id my-sig): escalate.action: restart-job is not more severe than action do-not-retry"),
    ("bad escalation count", {"signatures": [_entry(
        action="restart-job", escalate={"count": 1, "window_s": 60, "action": "do-not-retry"})]},
     "signatures.0 (id my-sig): escalate.count: Input should be greater than or equal to 2"),
    ("unknown signal", {"signatures": [_entry(pattern=None, signal="SIGWHAT", examples=["x"])]},
     "signatures.0 (id my-sig): signal: unknown signal 'SIGWHAT'"),
    ("exit code 0", {"signatures": [_entry(pattern=None, exit_code=0, examples=["Exit Code: 0"])]},
     "signatures.0 (id my-sig): exit_code: 0 is success, not a failure"),
    ("two signatures for one exit code", {"signatures": [
        _entry(pattern=None, exit_code=3, examples=["  exitcode  : 3 (pid: 1)"], near_misses=["exitcode: 4"]),
        _entry(id="other", pattern=None, exit_code=3, examples=["Exit Code: 3"], near_misses=["exitcode: 4"])]},
     "signatures.1 (id other): exit_code: 3 is already matched by my-sig"),
    ("disable in a base file", {"signatures": [_entry()], "disable": ["xid-79"]},
     "disable: only files extending a library may disable signatures"),
]


@pytest.mark.parametrize(("case", "data", "message"), BAD_FILES, ids=[c for c, _, _ in BAD_FILES])
def test_loader_errors_name_file_entry_and_field(tmp_path: Path, case: str, data: object, message: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(SignatureError) as caught:
        load_signature_library(path)
    assert str(caught.value).startswith(f"{path}: {message}"), str(caught.value)


def test_loader_reports_yaml_syntax_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("signatures: [\n  - id: x\n", encoding="utf-8")
    with pytest.raises(SignatureError, match=re.escape(str(path))):
        load_signature_library(path)
    with pytest.raises(SignatureError, match=r"nope\.yaml"):
        load_signature_library(tmp_path / "nope.yaml")


def test_signature_error_is_a_gpuplane_error() -> None:
    assert issubclass(SignatureError, GpuplaneError) and issubclass(SignatureError, ValueError)


def test_operator_file_extends_overrides_and_disables(tmp_path: Path) -> None:
    override = dict(LIBRARY["xid-79"].model_dump(mode="json", exclude_none=True))
    override.update(action="restart-job", blame_node=True, description="ours: restart first")
    extra = _write(tmp_path, {"signatures": [override, _entry()], "disable": ["nan-loss"]}, "ours.yaml")
    library = load_signature_library(extra=[extra])
    assert len(library) == len(LIBRARY)  # +1 new, -1 disabled
    assert library["xid-79"].action is FailureAction.RESTART_JOB
    assert library.ids.index("xid-79") == LIBRARY.ids.index("xid-79")  # replaced in place
    assert library.ids[-1] == "my-sig" and "nan-loss" not in library
    assert library.by_xid(79) is library["xid-79"]
    match = FailureClassifier(library).feed_line("n1", "[rank0]: widget exploded at step 7")
    assert match is not None and match.signature.id == "my-sig"
    # later files win
    again = _write(tmp_path, {"signatures": [_entry(action="restart-job")]}, "later.yaml")
    assert load_signature_library(extra=[extra, again])["my-sig"].action is FailureAction.RESTART_JOB


@pytest.mark.parametrize(("data", "message"), [
    ({"disable": ["no-such-signature"]}, "disable.0: no signature with id 'no-such-signature'"),
    ({"signatures": [_entry(pattern=None, xid=79, examples=["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, x"],
                            near_misses=["NVRM: Xid (PCI:0000:3b:00): 74, pid=1, x"])]},
     "signatures.0 (id my-sig): xid: 79 is already matched by xid-79"),
    ({"signatures": [_entry(), _entry()]}, "signatures.1 (id my-sig): id: duplicate of signatures.0"),
])
def test_operator_file_errors(tmp_path: Path, data: object, message: str) -> None:
    extra = _write(tmp_path, data, "ours.yaml")
    with pytest.raises(SignatureError) as caught:
        load_signature_library(extra=[extra])
    assert str(caught.value) == f"{extra}: {message}" or str(caught.value).startswith(f"{extra}: {message}")


def test_library_lookups() -> None:
    assert LIBRARY.by_exit_code(137) is LIBRARY["exit-137"]
    assert LIBRARY.by_signal("SIGBUS") is LIBRARY["signal-sigbus"]
    assert LIBRARY.resolve_exit(134) is LIBRARY["signal-sigabrt"]  # 128 + 6, no exact signature
    assert LIBRARY.resolve_exit(-7) is LIBRARY["signal-sigbus"]  # torchrun form
    assert LIBRARY.resolve_exit(None, "SIGKILL") is LIBRARY["exit-137"]  # signal name -> 128 + 9
    assert LIBRARY.resolve_exit(None, "segv") is LIBRARY["exit-139"]
    assert LIBRARY.resolve_exit(3) is None and LIBRARY.get("nope") is None
    with pytest.raises(KeyError, match="nope"):
        LIBRARY["nope"]
    with pytest.raises(SignatureError, match="defined twice"):
        SignatureLibrary([LIBRARY["xid-79"], LIBRARY["xid-79"]])


def test_signatures_are_frozen() -> None:
    signature = LIBRARY["xid-79"]
    with pytest.raises(ValueError, match="frozen"):
        signature.action = FailureAction.LOG_ONLY
