"""gpuplane's recording and alerting rules, with the real promtool: `check rules`, the unit tests in
deploy/monitoring/tests/ (every alert fired and not fired), and mutated rules that those tests must catch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "monitoring" / "rules"
TESTS = ROOT / "deploy" / "monitoring" / "tests"
ALERTS = RULES / "gpuplane-alerts.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool is missing: scripts/test installs it (Debian package prometheus)"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=300, check=False)


def alert_names() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule["alert"] for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def test_check_rules() -> None:
    files = sorted(str(p) for p in RULES.glob("*.yaml"))
    assert len(files) == 2
    result = promtool("check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    # 8 recording rules, 11 alerts.
    assert "SUCCESS: 8 rules found" in result.stdout
    assert "SUCCESS: 11 rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    files = sorted(str(p) for p in TESTS.glob("*.yaml"))
    assert files
    result = promtool("test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in TESTS.glob("*.yaml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alert_names())
    assert len(names) == 11
    assert names - fired == set(), "alerts never fired by a test"
    assert names - quiet == set(), "alerts never checked silent by a test"


# Each mutation changes one alert's threshold, duration or matcher; the unit tests must then fail.
MUTATIONS = [
    ("> 15 * 60", "> 30 * 60"),                       # pending pods: 30 minutes, the 17m case no longer fires
    ("> 5 * 60", "> 60 * 60"),                        # reclaim late: an hour
    ("DCGM_FI_DEV_XID_ERRORS == 79", "DCGM_FI_DEV_XID_ERRORS == 78"),  # Xid 79 dropped from the critical set
    ("ratio_rate5m > 0.05", "ratio_rate5m > 0.5"),    # extender errors at 50 %
    ("lemon\"}) > 0", "lemon\"}) > 1"),                  # quarantined nodes: only from two
    ("sum by (component) (gpuplane_leader) > 1", "sum by (component) (gpuplane_leader) > 2"),
    ("kube-state-metrics\"} == 0", "kube-state-metrics\"} == 0 and up{job=\"nothing\"}"),
    ("status=\"true\"}) == 0)", "status=\"true\"}) == 1)"),  # node Ready inverted
    ("and on () absent(leader_election_master_status", "and on () (leader_election_master_status"),  # silence
    ("or sum(leader_election_master_status{name=\"kube-scheduler\"}) < 1", ""),  # kube-scheduler's lease ignored
    ("increase(DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS[15m]) > 0", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS > 10"),
    ("gpuplane:queue_quota_use:ratio >= 1", "gpuplane:queue_quota_use:ratio > 1"),
]


@pytest.mark.parametrize(("old", "new"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_mutated_rule_fails_its_test(tmp_path: Path, old: str, new: str) -> None:
    text = ALERTS.read_text()
    assert text.count(old) == 1, f"mutation target {old!r} must occur once"
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules" / ALERTS.name).write_text(text.replace(old, new))
    shutil.copy(RULES / "gpuplane-recording.yaml", tmp_path / "rules")
    for path in TESTS.glob("*.yaml"):
        shutil.copy(path, tmp_path / "tests")
    assert promtool("check", "rules", str(tmp_path / "rules" / ALERTS.name)).returncode == 0
    result = promtool("test", "rules", *sorted(str(p) for p in (tmp_path / "tests").glob("*.yaml")))
    assert result.returncode != 0, f"the tests did not notice {old!r} -> {new!r}"
    assert "FAILED" in result.stdout + result.stderr
