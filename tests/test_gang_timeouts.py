"""A gang's own timeout (`SchedulingRules.gang_timeouts`, a PodGroup's scheduleTimeoutSeconds in Kubernetes) in
place of the scheduler's one `gang_timeout_s`, driven through the simulated cluster."""

from __future__ import annotations

from dataclasses import replace

import pytest

from builders import CATALOG, node, pod
from gpuplane.scheduler import PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())


@pytest.mark.parametrize(
    ("timeouts", "failed_at"),
    [
        ({}, 600.0),                        # no timeout of its own: the scheduler's 600 s
        ({"team/train": 60.0}, 60.0),       # its own 60 s
        ({"team/other": 60.0}, 600.0),      # another gang's timeout is not this one's
        ({"team/train": 1200.0}, 1200.0),   # longer than the default too
    ],
)
def test_a_gang_waits_its_own_timeout_for_its_members(timeouts: dict[str, float], failed_at: float) -> None:
    cluster = SimCluster(CATALOG, [node("n0").gpus(8).obj()])
    rules = SchedulingRules(gang_timeout_s=600.0, gang_timeouts=timeouts)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=rules)
    # 1 of 3 members: it waits until the gang's timeout, then fails (and not a moment before).
    assert cluster.create_pod(replace(pod("w0").whole(1).obj(), gang="team/train", gang_size=3)).ok
    scheduler.run_pending()
    cluster.loop.run(until=failed_at)
    scheduler.run_pending()
    assert cluster.failed == {}
    cluster.loop.run(until=failed_at + 1.0)
    scheduler.run_pending()
    assert set(cluster.failed) == {"w0"}
    assert f"gang team/train timed out after {failed_at:g} s with 1 of 3" in cluster.failed["w0"]
