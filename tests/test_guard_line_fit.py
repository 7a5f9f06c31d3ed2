"""GuardLineFit: an offline fraction leaves the node guard's admission line of card memory unpromised, so the
guard does not evict it the moment it starts; online pods and a zero reserve are not limited."""

from __future__ import annotations

import numpy as np
import pytest

from builders import cluster, node, placed, pod
from gpuplane.controllers.colocation import GuardSettings, MemoryGuard
from gpuplane.model import QoS
from gpuplane.scheduler import Framework, PolicyConfig, default_registry
from gpuplane.scheduler.plugins.colocation import GUARD_LINE

T4_MIB = 15_360  # the catalog's T4
RESERVE = 7_168  # the guard's line for a fresh guard: 2 GiB safety + 1.5 × 2 GiB least growth + 2 GiB hysteresis


def _framework(reserve_mib: int) -> Framework:
    profile = default_registry().build(PolicyConfig(node_policy="binpack", guard_reserve_mib=reserve_mib))
    return Framework(profile, np.random.default_rng(0))


def test_the_reserve_is_the_fresh_guards_admission_line() -> None:
    free = 1 << 40
    assert (free - MemoryGuard(GuardSettings()).admissible_bytes(free)) >> 20 == RESERVE


@pytest.mark.parametrize(("online_mib", "offline_mib", "qos", "reserve", "fits"), [
    (7_680, 3_840, QoS.OFFLINE, RESERVE, False),  # 15,360 − 7,680 − 3,840 = 3,840 left < 7,168
    (0, 3_840, QoS.OFFLINE, RESERVE, True),  # 15,360 − 3,840 = 11,520 left ≥ 7,168
    (0, 8_192, QoS.OFFLINE, RESERVE, True),  # 15,360 − 8,192 = 7,168 left: exactly the line
    (0, 8_193, QoS.OFFLINE, RESERVE, False),  # 7,167 left
    (7_680, 3_840, QoS.BEST_EFFORT, RESERVE, False),  # every non-online QoS keeps the line
    (7_680, 3_840, QoS.ONLINE, RESERVE, True),  # online is never limited
    (7_680, 3_840, QoS.OFFLINE, 0, True),  # no reserve, no filter: 3,840 left ≥ 3,840
])
def test_an_offline_fraction_leaves_the_line_free(online_mib: int, offline_mib: int, qos: QoS, reserve: int,
                                                  fits: bool) -> None:
    state = cluster(node("t4").gpus(1, "T4").obj())
    fw = _framework(reserve)
    if online_mib:
        placed(fw, state, pod("replica").fraction(500, mem=online_mib).qos(QoS.ONLINE).obj())
    decision = fw.schedule(pod("nearline").fraction(300, mem=offline_mib).qos(qos).obj(), state)
    assert (decision.assignment is not None) is fits
    if not fits:
        assert GUARD_LINE in decision.status.message
