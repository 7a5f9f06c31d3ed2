"""SLO time counted in seconds within a step: the shortfall ends when the replica covering the load serves."""

from __future__ import annotations

import pytest

from gpuplane.sim.scenario.slo import shortfall_s


@pytest.mark.parametrize(("load", "ready_at", "expected"), [
    # capacity 10 per replica, the step [60, 120)
    (20.0, [0.0, 0.0], 0.0),  # 2 replicas serve 20 exactly (20 is not above 2 × 10)
    (25.0, [0.0, 0.0, 62.0], 2.0),  # the third (needed for 25) serves 2 s into the step
    (25.0, [0.0, 0.0, 130.0], 60.0),  # it serves after the step: the whole step is short
    (25.0, [0.0, 0.0], 60.0),  # no third replica at all
    (25.0, [90.0, 0.0, 0.0, 75.0], 15.0),  # unsorted: the third-earliest serves at 75
    (0.0, [], 0.0),  # no load, no shortfall
    (5.0, [], 60.0),  # load and no replica
])
def test_the_shortfall_is_counted_in_seconds(load: float, ready_at: list[float], expected: float) -> None:
    assert shortfall_s(load, 10.0, ready_at, 60.0, 60.0) == pytest.approx(expected)


def test_a_step_without_length_or_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        shortfall_s(1.0, 0.0, [], 0.0, 60.0)
