"""The tidal controller sharing its service with the GPU scaler (`TidalController(replicas=...)`): the scaler
(`ScaledObjectScaler`, the HPA algorithm on a request-rate query, 10 requests/s per replica) sets the
service's count, the tidal controller splits it between the subsets, holds the policy's floor, and lends and
reclaims against the count and its forecast. Both act in one loop on one `SimCluster`: the scaler polls a
second before each tidal pass (every minute).

The world is test_tidal_controller's: 2 stable nodes, 4 tidal nodes t0..t3 and 1 training node, 8 × A100
each; `chat` min 8, max 40, day floor 20, night floor 12; shrink 22:30, lend 23:30, reclaim 07:30. At 23:30
t0, t1 and t3 are lent (t2 keeps the night's 4 tidal replicas) and 3 of the 4 training pods run on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpuplane.controllers import FixedForecast, TidalController
from gpuplane.controllers.autoscale import ScaledObjectScaler, ScaledObjectSpec
from gpuplane.port import PodPhase
from test_tidal_controller import BINDING, LEND, NIGHT_LOAD, POLICY, RECLAIM, SHRINK, TICK_S, World, hhmm, night

QUERY = 'sum(rate(requests_total{service="chat"}[1m]))'


class Rate:
    """The scaler's metric source: the request rate it reads, set by the test."""

    def __init__(self, value: float) -> None:
        self.value = value

    def query(self, query: str, *, timeout_s: float | None = None) -> float:
        assert query == QUERY
        return self.value


@dataclass
class Shared:
    world: World
    scaler: ScaledObjectScaler
    rate: Rate
    forecast: dict[str, float]
    counts: list[tuple[float, int]]
    """The scaler's count after each poll."""

    @property
    def controller(self) -> TidalController:
        assert self.world.controller is not None
        return self.world.controller

    def replicas(self, subset: str) -> int:
        return self.world.cluster.workloads[f"chat-{subset}"].replicas

    def running(self, subset: str) -> int:
        return len(self.world.running(f"chat-{subset}-"))


def shared(*, trainers: int = 4) -> Shared:
    """The night world with the GPU scaler reading a night rate of 10/s; the forecast sees the night too."""
    world = night(trainers=trainers)
    scaler = ScaledObjectScaler(ScaledObjectSpec(name="chat", query=QUERY, target=10.0, max_replicas=100))
    rate = Rate(NIGHT_LOAD)
    forecast = {"chat": NIGHT_LOAD}
    world.controller = TidalController(world.cluster, POLICY, [BINDING],
                                       FixedForecast(lambda svc, t, horizon: forecast[svc]), world.cluster.loop.now,
                                       replicas=lambda name: scaler.desired)
    state = Shared(world, scaler, rate, forecast, [])
    loop = world.cluster.loop

    def poll() -> None:
        scaler.poll(loop.now(), rate)
        state.counts.append((loop.now(), scaler.replicas))
        loop.call_later(TICK_S, poll)

    scaler.poll(loop.now(), rate)  # 21:00, before the first tidal pass; then at hh:mm:59
    state.counts.append((loop.now(), scaler.replicas))
    loop.call_at(hhmm("21:01") - 1.0, poll)
    return state


# (time, rate, stable, tidal): the scaler's count ceil(rate / 10) raised to the phase's floor, capped at 40
@pytest.mark.parametrize(("at", "rate", "stable", "tidal"), [
    (hhmm("22:00"), NIGHT_LOAD, 8, 12),    # day: count 1 < day floor 20 → 8 stable + 12 tidal
    (hhmm("23:00"), NIGHT_LOAD, 8, 4),     # shrunk: count 1 < night floor 12 → 8 + 4
    (hhmm("02:00", 1), NIGHT_LOAD, 8, 4),  # lent: still the floor, never below it
    (hhmm("02:00", 1), 150.0, 8, 7),       # lent: count 15 > 12 → 8 + 7 (fits t2's 8 cards: no reclaim)
    (hhmm("08:00", 1), 300.0, 8, 22),      # day again: count 30 > day floor 20 → 8 + 22
    (hhmm("08:00", 1), 1000.0, 8, 32),     # count 100 (the scaler's max) > the policy's max 40 → 8 + 32
])
def test_the_scalers_count_split_and_raised_to_the_floor(at: float, rate: float, stable: int, tidal: int) -> None:
    state = shared()
    state.world.run(at - 30 * 60)
    state.rate.value = rate  # 30 minutes before: the HPA's ramp (4 pods or 100 % per 15 s) and its
    state.world.run(at)      # scale-down window (300 s) are long over
    assert (state.replicas("stable"), state.replicas("tidal")) == (stable, tidal)


def test_the_scalers_count_under_the_floor_keeps_the_floor_and_lends_as_alone() -> None:
    state = shared()
    state.world.run(SHRINK - 1)
    assert state.counts[-1][1] == 1  # the scaler wants 1 replica all night (10 requests/s)
    state.world.run(LEND)
    assert set(state.controller.ledger) == {"t0", "t1", "t3"}  # as the controller alone lends (see its test)
    state.world.run(RECLAIM - 1)
    assert (state.replicas("stable"), state.replicas("tidal")) == (8, 4)  # the night floor 12 held all night
    assert state.running("tidal") == 4 and state.controller.stats.early_reclaims == 0
    state.world.run(RECLAIM)
    assert state.controller.ledger == {} and state.controller.stats.reclaims == 3


# (rate from 01:00, early reclaims, tidal replicas, training pods evicted): the forecast stays at the night's;
# only the scaler's count rises. Unlent tidal capacity: t2, 8000 × 0.9 = 7200 milli; the tidal subset needs
# (count − 8) × 1000. The count climbs from 1 at one poll a minute (4 pods or double per poll), and each pass
# reclaims the cheapest loans that cover the shortfall (each lent node holds one training pod).
@pytest.mark.parametrize(("rate", "early", "tidal", "evicted"), [
    (150.0, 0, 7, 0),    # count 15: 7000 ≤ 7200, nothing reclaimed
    (240.0, 2, 16, 2),   # count 24: 16000 > 7200 → two loans (2 × 7200 + 7200 = 21600 ≥ 16000 at the end)
    (400.0, 3, 32, 3),   # count 40: 32000 → all three loans (4 × 7200 = 28800 < 32000: all that there is)
])
def test_the_scaler_scaling_up_at_night_reclaims_early(rate: float, early: int, tidal: int, evicted: int) -> None:
    state = shared()
    at = hhmm("01:00", 1)
    state.world.run(at - 30)
    assert set(state.controller.ledger) == {"t0", "t1", "t3"}
    state.rate.value = rate
    state.world.run(at + 10 * 60)
    controller = state.controller
    assert controller.stats.early_reclaims == early
    assert controller.stats.training_pods_evicted == evicted
    assert all(loan.early and loan.returned is not None and loan.returned >= at for loan in controller.history)
    assert state.replicas("tidal") == tidal and state.running("tidal") == tidal  # placed once the grace is over
    assert not [p for p in state.world.cluster.list_pods()
                if p.name.startswith("chat-") and p.phase is PodPhase.PENDING]
    first = min((loan.returned for loan in controller.history), default=None)
    if first is not None:  # the first reclaim came on the first pass whose count the unlent nodes could not hold
        count = max(c for t, c in state.counts if t < first)
        assert (count - 8) * 1000 > 7200
        assert all((c - 8) * 1000 <= 7200 for t, c in state.counts if t < first - TICK_S)
    state.world.run(RECLAIM)
    assert controller.ledger == {} and controller.stats.reclaims == 3  # the rest come back at 07:30


def test_a_rise_the_forecast_sees_reclaims_early_while_the_scalers_count_is_low() -> None:
    # forecast 400/s (40 replicas) within its look-ahead; the scaler still reads 10/s
    state = shared()
    at = hhmm("01:00", 1)
    state.world.run(at - 1)
    state.forecast["chat"] = 400.0
    state.world.run(at)
    assert state.controller.stats.early_reclaims == 3
    assert state.replicas("tidal") == 4  # scaling follows the scaler (its count 1 → the floor 12): the nodes
    # come back ahead of the rise, the replicas when the scaler sees it


def test_an_unknown_count_scales_from_the_forecast_as_without_a_scaler() -> None:
    # the reader answers None all night: the same decisions as the controller alone (test_tidal_controller)
    alone, blind = night(trainers=4), night(trainers=4)
    assert blind.controller is not None
    blind.controller = TidalController(blind.cluster, POLICY, [BINDING],
                                       FixedForecast(lambda svc, t, horizon: blind.load[svc]),
                                       blind.cluster.loop.now, replicas=lambda name: None)
    for world in (alone, blind):
        world.run(hhmm("01:00", 1))
        world.load["chat"] = 400.0
        world.run(RECLAIM + TICK_S)
    assert alone.controller is not None
    assert alone.controller.history == blind.controller.history
    assert alone.ledgers == blind.ledgers
