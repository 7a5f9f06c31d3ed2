"""The tidal controller and its policy: validation of TidalPolicy (objects and YAML), window phases, drain
ordering on pure functions, and a night in virtual time in a small simulated world (shrink at 22:30, lend
from 23:30, reclaim at 07:30 or at once on a load spike, restart from the nodes' annotations).

The world: 2 stable nodes (s0, s1), 4 tidal nodes (t0..t3) and 1 training node (tr0), 8 × A100 each; one
service `chat` of whole-card replicas (10 requests/s each) with min 8, max 40, day floor 20, night floor 12.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from builders import CATALOG, node, pod
from gpuplane.controllers import (
    EARLY_RECLAIM_REASON,
    LEND_REASON,
    LOAN_ANNOTATION,
    LOAN_LABEL,
    LOAN_TAINT,
    RECLAIM_ANNOTATION,
    SUBSET_LABEL,
    DrainOrder,
    FixedForecast,
    ServiceBinding,
    TidalController,
    drain_costs,
    nodes_emptied,
    removal_order,
)
from gpuplane.model import MILLI_PER_CARD, Assignment, CardShare, NodeSpec, PodRequest, QoS, Taint
from gpuplane.model.tidal import (
    DAY_S,
    Loan,
    TidalPolicy,
    TidalPolicyError,
    TidalService,
    TidalWindow,
    load_tidal_policy,
)
from gpuplane.port import DELETION_COST, Code, NodeInfo, PodInfo, PodPhase, Status
from gpuplane.scheduler import PolicyConfig, Scheduler, SchedulingRules, default_registry
from gpuplane.sim import SimCluster

PROFILE = default_registry().build(PolicyConfig())
A100 = CATALOG.get("A100-40GB")
H = 3600.0
TICK_S = 60.0
START = 21 * H  # 21:00 on day 0 (t = 0 is midnight)
SHRINK = 22.5 * H  # 22:30 → 81000
LEND = 23.5 * H  # 23:30 → 84600
RECLAIM = DAY_S + 7.5 * H  # 07:30 the next day → 113400
GRACE = 90.0  # the policy's reclaim_grace_s (not the default 120)
TRAINING_POOL = "training"
TIDAL_POOL = "inference-tidal"
STABLE_POOL = "inference-stable"
TIDAL_NODES = ("t0", "t1", "t2", "t3")

CHAT = TidalService(name="chat", min_replicas=8, max_replicas=40, day_floor=20)
NIGHT = TidalWindow(name="night", shrink_at="22:30", lend_from="23:30", reclaim_at="07:30", night_replicas={"chat": 12})
POLICY = TidalPolicy(services=(CHAT,), windows=(NIGHT,), reclaim_grace_s=GRACE)
BINDING = ServiceBinding("chat", per_replica_capacity=10.0, gpu_milli_per_replica=MILLI_PER_CARD)

DAY_LOAD = 200.0  # 200 / 10 = 20 replicas: the day floor, so the day changes nothing
NIGHT_LOAD = 10.0  # 1 replica: the night floor 12 rules

# Tidal replica index → node, placed before the controller starts (12 tidal = 20 day - 8 stable).
# t0: 1 pod (the oldest), t1: 3 pods, t2: 8 pods (the newest), t3: empty.
LAYOUT: dict[str, tuple[int, ...]] = {"t0": (0,), "t1": (1, 2, 3), "t2": tuple(range(4, 12)), "t3": ()}


def hhmm(value: str, day: int = 0) -> float:
    hours, minutes = value.split(":")
    return day * DAY_S + int(hours) * H + int(minutes) * 60.0


# ---------------------------------------------------------------------------------------------- policy: validation
def policy_raw(*, services: list[dict[str, Any]] | None = None, windows: list[dict[str, Any]] | None = None,
               **extra: Any) -> dict[str, Any]:
    """A valid policy's raw form, with `services`/`windows`/top-level fields replaced."""
    return {
        "services": services if services is not None else [{"name": "chat", "min_replicas": 8, "max_replicas": 40}],
        "windows": windows if windows is not None else [
            {"name": "night", "shrink_at": "22:30", "lend_from": "23:30", "reclaim_at": "07:30"}],
        **extra,
    }


def window(name: str, shrink: str, reclaim: str, lend: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "shrink_at": shrink, "lend_from": lend if lend is not None else shrink,
            "reclaim_at": reclaim, **extra}


def first_error(raw: Mapping[str, Any]) -> str:
    """"loc: message" of the first validation error of `raw` (as the YAML loader reports it)."""
    with pytest.raises(ValidationError) as raised:
        TidalPolicy.model_validate(raw)
    error = raised.value.errors()[0]
    return ".".join(str(p) for p in error["loc"]) + ": " + error["msg"]


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        pytest.param(  # 22:00-06:00 crosses midnight and covers 05:00-06:00 of 05:00-08:00
            policy_raw(windows=[window("night", "22:00", "06:00"), window("morning", "05:00", "08:00")]),
            ("windows night and morning overlap",), id="crossing-midnight-overlaps-morning"),
        pytest.param(  # 23:00-02:00 and 01:00-04:00 share 01:00-02:00
            policy_raw(windows=[window("late", "23:00", "02:00"), window("early", "01:00", "04:00")]),
            ("windows late and early overlap",), id="both-after-midnight"),
        pytest.param(  # 01:00-04:00 and 03:00-05:00 share 03:00-04:00, neither crosses midnight
            policy_raw(windows=[window("a", "01:00", "04:00"), window("b", "03:00", "05:00")]),
            ("windows a and b overlap",), id="same-day"),
        pytest.param(  # one inside the other
            policy_raw(windows=[window("outer", "20:00", "08:00"), window("inner", "01:00", "02:00")]),
            ("overlap", "outer", "inner"), id="nested"),
        pytest.param(
            policy_raw(services=[{"name": "chat", "min_replicas": 9, "max_replicas": 4}]),
            ("services.0", "min_replicas 9 is above max_replicas 4"), id="min-above-max"),
        pytest.param(
            policy_raw(services=[{"name": "chat", "min_replicas": 1, "max_replicas": 4, "day_floor": 5}]),
            ("services.0", "day_floor 5 is above max_replicas 4"), id="day-floor-above-max"),
        pytest.param(
            policy_raw(services=[{"name": "chat", "min_replicas": -1, "max_replicas": 4}]),
            ("services.0.min_replicas",), id="negative-min"),
        pytest.param(
            policy_raw(windows=[window("night", "22:30", "07:30", "23:30", night_replicas={"chta": 8})]),
            ("windows.0.night_replicas", "unknown service 'chta'"), id="night-replicas-unknown-service"),
        pytest.param(  # 7 < chat's minimum of 8
            policy_raw(windows=[window("night", "22:30", "07:30", "23:30", night_replicas={"chat": 7})]),
            ("windows.0.night_replicas.chat", "7 would drop chat under its minimum of 8"), id="night-under-min"),
        pytest.param(  # 22:00 is before shrink_at 22:30
            policy_raw(windows=[window("night", "22:30", "07:30", "22:00")]),
            ("windows.0", "lend_from 22:00 is not between shrink_at 22:30 and reclaim_at 07:30"),
            id="lend-before-shrink"),
        pytest.param(  # [shrink_at, reclaim_at) is half open: lending at the reclaim time lends nothing
            policy_raw(windows=[window("night", "22:30", "07:30", "07:30")]),
            ("windows.0", "lend_from 07:30 is not between"), id="lend-at-reclaim"),
        pytest.param(  # 08:00 is after reclaim_at 07:30 (the window runs 22:30 → 07:30)
            policy_raw(windows=[window("night", "22:30", "07:30", "08:00")]),
            ("windows.0", "lend_from 08:00 is not between"), id="lend-after-reclaim"),
        pytest.param(
            policy_raw(windows=[window("night", "22:30", "22:30")]),
            ("windows.0", "shrink_at and reclaim_at are the same time"), id="empty-window"),
        pytest.param(
            policy_raw(windows=[window("night", "25:00", "07:30")]),
            ("windows.0.shrink_at", "'25:00' is not a time of day HH:MM"), id="hour-25"),
        pytest.param(
            policy_raw(windows=[window("night", "22:30", "7.30")]),
            ("windows.0.reclaim_at", "'7.30' is not a time of day HH:MM"), id="dot-not-colon"),
        pytest.param(
            policy_raw(windows=[window("night", "22:30", "07:60")]),
            ("windows.0.reclaim_at", "'07:60'"), id="minute-60"),
        pytest.param(
            policy_raw(windows=[window("night", "22:30", "07:30", "")]),
            ("windows.0.lend_from", "is not a time of day"), id="empty-clock"),
        pytest.param(
            policy_raw(services=[{"name": "chat", "min_replicas": 1, "max_replicas": 4},
                                 {"name": "chat", "min_replicas": 2, "max_replicas": 8}]),
            ("services defined twice: chat",), id="duplicate-service"),
        pytest.param(policy_raw(services=[]), ("services",), id="no-services"),
        pytest.param(policy_raw(windows=[]), ("windows",), id="no-windows"),
        pytest.param(policy_raw(reclaim_headroom=1.0), ("reclaim_headroom",), id="headroom-1"),
        pytest.param(policy_raw(reclaim_grace_s=-1), ("reclaim_grace_s",), id="negative-grace"),
        pytest.param(policy_raw(lend_early=True), ("lend_early",), id="unknown-field"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(raw: dict[str, Any], fragments: tuple[str, ...]) -> None:
    message = first_error(raw)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    "windows",
    [
        pytest.param([window("night", "22:00", "06:00"), window("morning", "06:00", "08:00")], id="touching"),
        pytest.param([window("a", "01:00", "03:00"), window("b", "03:00", "05:00"), window("c", "23:00", "01:00")],
                     id="three-touching-round-the-clock"),
        pytest.param([window("night", "22:30", "07:30", "22:30")], id="lend-from-shrink"),
        pytest.param([window("day", "09:00", "17:00", "12:00")], id="not-crossing-midnight"),
        pytest.param([window("night", "22:30", "07:30", "7:00")], id="single-digit-hour"),
    ],
)
def test_windows_that_only_touch_are_accepted(windows: list[dict[str, Any]]) -> None:
    policy = TidalPolicy.model_validate(policy_raw(windows=windows))
    assert [w.name for w in policy.windows] == [w["name"] for w in windows]


QUARTER = 900.0


@st.composite
def window_sets(draw: st.DrawFn) -> list[tuple[int, int]]:
    """1 to 3 windows on a quarter-hour grid: (start quarter, length in quarters), never empty nor a whole day."""
    count = draw(st.integers(1, 3))
    return [(draw(st.integers(0, 95)), draw(st.integers(1, 95))) for _ in range(count)]


def clock(quarters: int) -> str:
    minutes = (quarters % 96) * 15
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


@settings(max_examples=150, deadline=None)
@given(window_sets())
def test_windows_are_refused_exactly_when_they_share_a_moment(spans: list[tuple[int, int]]) -> None:
    covered = [{(start + k) % 96 for k in range(length)} for start, length in spans]
    overlap = any(covered[i] & covered[j] for i in range(len(spans)) for j in range(i + 1, len(spans)))
    raw = policy_raw(windows=[window(f"w{i}", clock(start), clock(start + length))
                              for i, (start, length) in enumerate(spans)])
    if overlap:
        assert "overlap" in first_error(raw)
    else:
        TidalPolicy.model_validate(raw)


# ---------------------------------------------------------------------------------------------- policy: YAML
GOOD_YAML = """\
services:
  - {name: chat, min_replicas: 8, max_replicas: 40, day_floor: 20}
  - {name: embed, min_replicas: 2, max_replicas: 10}
windows:
  - {name: night, shrink_at: "22:30", lend_from: "23:30", reclaim_at: "07:30", night_replicas: {chat: 12}}
reclaim_headroom: 0.2
reclaim_grace_s: 90
"""


def test_load_tidal_policy_reads_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "tidal.yaml"
    path.write_text(GOOD_YAML)
    policy = load_tidal_policy(path)
    assert [s.name for s in policy.services] == ["chat", "embed"]
    assert policy.service("chat").day_floor == 20 and policy.service("embed").day_floor == 0
    (night,) = policy.windows
    assert (night.start_s, night.lend_s, night.end_s) == (81000.0, 84600.0, 27000.0)  # 22.5 h, 23.5 h, 7.5 h
    assert night.night_replicas == {"chat": 12}
    assert (policy.reclaim_headroom, policy.reclaim_grace_s, policy.checkpoint_lead_s) == (0.2, 90.0, 600.0)
    with pytest.raises(TidalPolicyError, match="unknown service 'nosuch'"):
        policy.service("nosuch")


SERVICE = "services:\n  - {name: chat, min_replicas: 8, max_replicas: 40}\n"
NIGHT_YAML = 'windows:\n  - {name: night, shrink_at: "22:30", lend_from: "23:30", reclaim_at: "07:30"}\n'


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        pytest.param(SERVICE + 'windows:\n  - {name: n, shrink_at: "22:00", lend_from: "23:00", reclaim_at: "06:00"}\n'
                     '  - {name: m, shrink_at: "05:00", lend_from: "05:00", reclaim_at: "08:00"}\n',
                     ("windows n and m overlap",), id="overlap"),
        pytest.param("services:\n  - {name: chat, min_replicas: 9, max_replicas: 4}\n" + NIGHT_YAML,
                     ("services.0", "min_replicas 9 is above max_replicas 4"), id="min-above-max"),
        pytest.param("services:\n  - {name: chat, min_replicas: 1, max_replicas: 4, day_floor: 6}\n" + NIGHT_YAML,
                     ("services.0", "day_floor 6 is above max_replicas 4"), id="day-floor-above-max"),
        pytest.param(SERVICE + 'windows:\n  - {name: n, shrink_at: "25:00", lend_from: "23:30", reclaim_at: "07:30"}\n',
                     ("windows.0.shrink_at", "'25:00'"), id="hour-25"),
        pytest.param(SERVICE + 'windows:\n  - {name: n, shrink_at: "22:30", lend_from: "7.30", reclaim_at: "07:30"}\n',
                     ("windows.0.lend_from", "'7.30'"), id="dot-not-colon"),
        pytest.param(SERVICE + 'windows:\n  - {name: n, shrink_at: "22:30", lend_from: "21:00", reclaim_at: "07:30"}\n',
                     ("windows.0", "lend_from 21:00 is not between"), id="lend-outside"),
        pytest.param(SERVICE + 'windows:\n  - {name: n, shrink_at: "22:30", lend_from: "23:30", reclaim_at: "07:30",'
                     " night_replicas: {chat: 3}}\n",
                     ("windows.0.night_replicas.chat", "under its minimum of 8"), id="night-under-min"),
        pytest.param(SERVICE + 'windows:\n  - {name: n, shrink_at: "22:30", lend_from: "23:30", reclaim_at: "07:30",'
                     " night_replicas: {search: 3}}\n",
                     ("windows.0.night_replicas", "unknown service 'search'"), id="night-unknown-service"),
        pytest.param(SERVICE + "  - {name: chat, min_replicas: 1, max_replicas: 2}\n" + NIGHT_YAML,
                     ("services defined twice: chat",), id="duplicate-service"),
        pytest.param(SERVICE + NIGHT_YAML + "reclaim_headroom: 1.5\n", ("reclaim_headroom",), id="headroom"),
        pytest.param(SERVICE + NIGHT_YAML + "reclaim_grace: 30\n", ("reclaim_grace",), id="misspelt-field"),
        pytest.param(SERVICE, ("windows",), id="no-windows"),
        pytest.param("services: [\n", (), id="not-yaml"),
    ],
)
def test_load_tidal_policy_errors_name_the_file_and_field(tmp_path: Path, text: str,
                                                          fragments: tuple[str, ...]) -> None:
    path = tmp_path / "tidal.yaml"
    path.write_text(text)
    with pytest.raises(TidalPolicyError) as raised:
        load_tidal_policy(path)
    assert str(raised.value).startswith(f"{path}:")
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_load_tidal_policy_names_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(TidalPolicyError) as raised:
        load_tidal_policy(path)
    assert str(raised.value).startswith(f"{path}:")


# ---------------------------------------------------------------------------------------------- window phases
@pytest.mark.parametrize(
    ("at", "phase"),
    [
        ("12:00", "day"),
        ("22:29", "day"),
        ("22:30", "shrink"),  # shrink_at opens the window
        ("23:29", "shrink"),
        ("23:30", "lend"),  # lend_from
        ("00:00", "lend"),  # across midnight
        ("03:00", "lend"),
        ("07:29", "lend"),
        ("07:30", "day"),  # reclaim_at closes it
        ("07:31", "day"),
    ],
)
@pytest.mark.parametrize("day", [0, 1, 6])
def test_window_phase_at_each_time_of_day(at: str, phase: str, day: int) -> None:
    assert NIGHT.phase(hhmm(at, day)) == phase
    assert NIGHT.phase(hhmm(at, day) + 30.0) == phase  # half a minute later: same minute, same phase


@pytest.mark.parametrize(
    ("t", "reclaim"),
    [
        (hhmm("22:30"), hhmm("07:30", 1)),  # 81000 + (27000 − 81000) mod 86400 = 81000 + 32400 = 113400
        (hhmm("03:00", 1), hhmm("07:30", 1)),  # 4.5 h later, the same day
        (hhmm("07:30", 1), hhmm("07:30", 1)),  # at the close: "at or after" is now
        (hhmm("07:31", 1), hhmm("07:30", 2)),  # a minute late: tomorrow's
        (hhmm("12:00", 3), hhmm("07:30", 4)),
    ],
)
def test_next_reclaim_is_the_next_close_at_or_after(t: float, reclaim: float) -> None:
    assert NIGHT.next_reclaim(t) == reclaim


@pytest.mark.parametrize(
    ("at", "phase"),
    [("00:59", "day"), ("01:00", "lend"), ("04:59", "lend"), ("05:00", "day")],  # lend_from = shrink_at
)
def test_a_window_that_lends_from_its_start_has_no_shrink_phase(at: str, phase: str) -> None:
    early = TidalWindow(name="early", shrink_at="01:00", lend_from="01:00", reclaim_at="05:00")
    assert early.phase(hhmm(at)) == phase


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 95), st.integers(1, 95), st.data())
def test_phase_and_next_reclaim_agree_with_the_clock(start: int, length: int, data: st.DataObject) -> None:
    lend = start + data.draw(st.integers(0, length - 1))
    win = TidalWindow(name="w", shrink_at=clock(start), lend_from=clock(lend), reclaim_at=clock(start + length))
    t = data.draw(st.integers(0, 14 * int(DAY_S))) / 2.0  # a week, on half seconds
    since = (t - start * QUARTER) % DAY_S  # seconds since the window last opened
    expected = "day" if since >= length * QUARTER else "lend" if since >= (lend - start) * QUARTER else "shrink"
    assert win.phase(t) == expected
    close = win.next_reclaim(t)
    assert t <= close < t + DAY_S
    assert math.isclose(close % DAY_S, ((start + length) % 96) * QUARTER, abs_tol=1e-6)
    assert win.phase(close) == "day"


# ---------------------------------------------------------------------------------------------- drain order: pure
ABC: dict[str, list[str]] = {"A": ["a1"], "B": ["b1", "b2"], "C": ["c1", "c2", "c3"]}
ABC_AGE = ["a1", "b1", "b2", "c1", "c2", "c3"]  # oldest first: c3 is the newest


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # cost = pods on the node: a1 1, b* 2, c* 3; ties newest first → a1, b2, b1, c3, c2, c1
        (DrainOrder.FEWEST_INSTANCES, ["a1", "b2", "b1", "c3", "c2", "c1"]),
        # no costs: the reverse of age
        (DrainOrder.NEWEST, ["c3", "c2", "c1", "b2", "b1", "a1"]),
    ],
)
def test_removal_order(order: DrainOrder, expected: list[str]) -> None:
    assert removal_order(ABC, ABC_AGE, order) == expected


@pytest.mark.parametrize(
    ("order", "count", "emptied"),
    [
        (DrainOrder.FEWEST_INSTANCES, 0, 0),
        (DrainOrder.FEWEST_INSTANCES, 1, 1),  # a1 → A
        (DrainOrder.FEWEST_INSTANCES, 2, 1),  # a1, b2 → A (B keeps b1)
        (DrainOrder.FEWEST_INSTANCES, 3, 2),  # a1, b2, b1 → A and B
        (DrainOrder.FEWEST_INSTANCES, 5, 2),  # + c3, c2 → C keeps c1
        (DrainOrder.FEWEST_INSTANCES, 6, 3),
        (DrainOrder.NEWEST, 1, 0),  # c3
        (DrainOrder.NEWEST, 3, 1),  # c3, c2, c1 → C only
        (DrainOrder.NEWEST, 5, 2),  # + b2, b1 → C and B
        (DrainOrder.NEWEST, 6, 3),
    ],
)
def test_nodes_emptied_by_each_order(order: DrainOrder, count: int, emptied: int) -> None:
    assert nodes_emptied(ABC, removal_order(ABC, ABC_AGE, order), count) == emptied


def test_random_order_is_the_seeded_permutation_of_the_sorted_names() -> None:
    # costs: the sorted names take the values of one permutation of range(6), in order
    permutation = np.random.default_rng(7).permutation(6)
    expected_costs = {name: int(v) for name, v in zip(sorted(ABC_AGE), permutation, strict=True)}
    costs = drain_costs(ABC, ABC_AGE, DrainOrder.RANDOM, np.random.default_rng(7))
    assert costs == expected_costs
    order = removal_order(ABC, ABC_AGE, DrainOrder.RANDOM, np.random.default_rng(7))
    assert order == sorted(ABC_AGE, key=lambda p: expected_costs[p])  # costs distinct: no tie to break
    # without a generator: the same as seed 0, so runs repeat
    assert removal_order(ABC, ABC_AGE, DrainOrder.RANDOM) == removal_order(
        ABC, ABC_AGE, DrainOrder.RANDOM, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("pods_by_node", "removable", "costs"),
    [
        # a cost per node: its rank by (pods on it, name) among the nodes holding removable pods
        (ABC, ABC_AGE, {"a1": 0, "b1": 1, "b2": 1, "c1": 2, "c2": 2, "c3": 2}),
        # only removable pods get a cost, but every pod on a node counts: C holds 3 even if c1 is not removable
        (ABC, ["b2", "c2", "c3"], {"b2": 0, "c2": 1, "c3": 1}),
        # a node shared with another workload's pods: D holds 4 (x1, x2 are not ours), E holds 1
        ({"D": ["x1", "d1", "x2", "d2"], "E": ["e1"]}, ["d1", "d2", "e1"], {"d1": 1, "d2": 1, "e1": 0}),
        # equal counts do not interleave: A before B by name
        ({"A": ["a1", "a2"], "B": ["b1", "b2"]}, ["a1", "b1", "a2", "b2"], {"a1": 0, "a2": 0, "b1": 1, "b2": 1}),
        (ABC, [], {}),
    ],
)
def test_drain_costs_rank_nodes_by_their_pods(pods_by_node: dict[str, list[str]], removable: list[str],
                                              costs: dict[str, int]) -> None:
    assert drain_costs(pods_by_node, removable, DrainOrder.FEWEST_INSTANCES) == costs
    assert drain_costs(pods_by_node, removable, DrainOrder.NEWEST) == {}


@st.composite
def distinct_nodes(draw: st.DrawFn) -> tuple[dict[str, list[str]], list[str]]:
    """Nodes of distinct pod counts, their pods in a random age order."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5, unique=True))
    by_node = {f"n{i}": [f"n{i}-p{k}" for k in range(size)] for i, size in enumerate(sizes)}
    ages = draw(st.permutations([p for pods in by_node.values() for p in pods]))
    return by_node, list(ages)


@settings(max_examples=100, deadline=None)
@given(distinct_nodes(), st.data())
def test_fewest_instances_empties_the_most_nodes_possible(case: tuple[dict[str, list[str]], list[str]],
                                                          data: st.DataObject) -> None:
    by_node, ages = case
    count = data.draw(st.integers(0, len(ages)))
    # best possible: the smallest nodes first, as many as `count` pods cover
    best, left = 0, count
    for size in sorted(len(p) for p in by_node.values()):
        if size <= left:
            best, left = best + 1, left - size
    order = removal_order(by_node, ages, DrainOrder.FEWEST_INSTANCES)
    assert sorted(order) == sorted(ages)
    assert nodes_emptied(by_node, order, count) == best
    for other in (DrainOrder.NEWEST, DrainOrder.RANDOM):
        assert nodes_emptied(by_node, removal_order(by_node, ages, other), count) <= best


def test_fewest_instances_empties_whole_nodes_when_nodes_hold_as_many_pods() -> None:
    # A and B hold 2 pods each (cost 2 for all); created a1, b1, a2, b2 (a spread placement).
    # Removing 2 pods can empty one whole node; ties newest first take b2 then a2 and empty none.
    by_node = {"A": ["a1", "a2"], "B": ["b1", "b2"]}
    order = removal_order(by_node, ["a1", "b1", "a2", "b2"], DrainOrder.FEWEST_INSTANCES)
    assert nodes_emptied(by_node, order, 2) == 1


# ---------------------------------------------------------------------------------------------- the world
def eight(name: str, pool: str, subset: str | None) -> NodeSpec:
    builder = node(name).gpus(8).pool(pool)
    if subset is not None:
        builder = builder.label(SUBSET_LABEL, subset)
    return builder.obj()


def replica(name: str, pool: str) -> PodRequest:
    return pod(name).cpu(1000).mem(1024).whole(1).pools(pool).obj()


def trainer(name: str, *, tolerate: bool = True) -> PodRequest:
    """A training pod of a whole node, in the training pool, tolerating the loan taint."""
    builder = pod(name).cpu(1000).mem(1024).whole(8).pools(TRAINING_POOL)
    if tolerate:
        builder = builder.tolerate(LOAN_TAINT.key)
    return builder.obj()


def bind_on(cluster: SimCluster, name: str, node_name: str, *cards: int) -> None:
    """Bind a pending pod to exactly these whole cards, past the scheduler."""
    shares = tuple(CardShare(c, MILLI_PER_CARD, A100.memory_mib, A100.encoders, A100.decoders, whole=True)
                   for c in cards)
    status = cluster.bind(name, Assignment(node_name, shares))
    assert status.ok, status.message


@dataclass
class World:
    cluster: SimCluster
    scheduler: Scheduler
    controller: TidalController | None
    load: dict[str, float]
    ledgers: list[tuple[float, frozenset[str]]] = field(default_factory=list)
    """The controller's lent nodes after each tick."""

    def build_controller(self, *, lend: bool = True,
                         drain_order: DrainOrder = DrainOrder.FEWEST_INSTANCES) -> TidalController:
        load = self.load
        return TidalController(self.cluster, POLICY, [BINDING], FixedForecast(lambda svc, t, horizon: load[svc]),
                               self.cluster.loop.now, lend=lend, drain_order=drain_order)

    def tick(self) -> None:
        if self.controller is not None:
            self.controller.reconcile()
            self.ledgers.append((self.now, frozenset(self.controller.ledger)))
        self.scheduler.run_pending()
        self.cluster.loop.call_later(TICK_S, self.tick)

    def run(self, until: float) -> None:
        self.cluster.loop.run(until=until)

    @property
    def now(self) -> float:
        return self.cluster.loop.now()

    def node(self, name: str) -> NodeInfo:
        (info,) = [n for n in self.cluster.list_nodes() if n.name == name]
        return info

    def pods_on(self, node_name: str, *, prefix: str = "") -> list[PodInfo]:
        return sorted((p for p in self.cluster.list_pods() if p.assignment is not None
                       and p.assignment.node == node_name and p.name.startswith(prefix)), key=lambda p: p.name)

    def tidal_layout(self) -> dict[str, list[int]]:
        """Tidal replica indexes per tidal node (running or terminating)."""
        return {n: sorted(p.request.instance or 0 for p in self.pods_on(n, prefix="chat-tidal-")) for n in TIDAL_NODES}

    def running(self, prefix: str) -> list[PodInfo]:
        return [p for p in self.cluster.list_pods() if p.name.startswith(prefix) and p.phase is PodPhase.RUNNING]

    def lent_at(self) -> list[float]:
        return [t for t, ledger in self.ledgers if ledger]


def make_world(*, lend: bool = True, drain_order: DrainOrder = DrainOrder.FEWEST_INSTANCES,
               layout: Mapping[str, Sequence[int]] = LAYOUT, trainers: int = 0, first_tick: float = START) -> World:
    """The world at 21:00, the day's 20 replicas placed (8 stable on s0, 12 tidal as `layout`), ticking every
    minute from `first_tick` (by default 21:00, so ticks fall on 22:30, 23:30 and 07:30); `trainers` training
    pods submitted."""
    nodes = [eight("s0", STABLE_POOL, "stable"), eight("s1", STABLE_POOL, "stable")]
    nodes += [eight(n, TIDAL_POOL, "tidal") for n in TIDAL_NODES]
    nodes.append(eight("tr0", TRAINING_POOL, None))
    cluster = SimCluster(CATALOG, nodes)
    cluster.loop.run(until=START)
    tidal = sum(len(v) for v in layout.values())
    assert cluster.create_workload("chat-stable", replica("chat-stable", STABLE_POOL), 8).ok
    assert cluster.create_workload("chat-tidal", replica("chat-tidal", TIDAL_POOL), tidal).ok
    for card in range(8):
        bind_on(cluster, f"chat-stable-{card}", "s0", card)
    for node_name, indexes in layout.items():
        for card, index in enumerate(indexes):
            bind_on(cluster, f"chat-tidal-{index}", node_name, card)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=SchedulingRules())
    world = World(cluster, scheduler, None, {"chat": DAY_LOAD})
    world.controller = world.build_controller(lend=lend, drain_order=drain_order)
    for i in range(trainers):
        assert cluster.create_pod(trainer(f"train-{i}")).ok
    cluster.loop.call_at(first_tick, world.tick)
    return world


def night(trainers: int = 4, **kwargs: Any) -> World:
    """A world whose load drops to the night's at 21:00 (the day floor of 20 holds until 22:30)."""
    world = make_world(trainers=trainers, **kwargs)
    world.load["chat"] = NIGHT_LOAD
    return world


def taints(info: NodeInfo) -> list[Taint]:
    return [t for t in info.spec.taints if t == LOAN_TAINT]


def assert_home(info: NodeInfo) -> None:
    """A tidal node serving inference: its pool, no loan label, taint or annotation."""
    assert info.spec.pool == TIDAL_POOL
    assert LOAN_LABEL not in dict(info.spec.labels)
    assert dict(info.spec.labels)[SUBSET_LABEL] == "tidal"
    assert taints(info) == []
    assert LOAN_ANNOTATION not in dict(info.annotations) and RECLAIM_ANNOTATION not in dict(info.annotations)


def assert_lent(info: NodeInfo, since: float) -> None:
    assert info.spec.pool == TRAINING_POOL
    assert dict(info.spec.labels)[LOAN_LABEL] == "lent"
    assert taints(info) == [LOAN_TAINT]
    notes = dict(info.annotations)
    assert json.loads(notes[LOAN_ANNOTATION]) == {"since": since, "window": "night", "home_pool": TIDAL_POOL}
    assert notes[RECLAIM_ANNOTATION] == "113400"  # 07:30 the next day, 86400 + 27000


# ---------------------------------------------------------------------------------------------- targets
def two_services(load: dict[str, float]) -> TidalController:
    embed = TidalService(name="embed", min_replicas=2, max_replicas=10)  # no day floor, no night entry
    policy = TidalPolicy(services=(CHAT, embed), windows=(NIGHT,))
    cluster = SimCluster(CATALOG, [eight("s0", STABLE_POOL, "stable")])
    bindings = [BINDING, ServiceBinding("embed", 5.0, MILLI_PER_CARD)]
    return TidalController(cluster, policy, bindings, FixedForecast(lambda svc, t, horizon: load[svc]),
                           cluster.loop.now)


@pytest.mark.parametrize(
    ("at", "chat_load", "embed_load", "chat", "embed"),
    [
        ("12:00", 0.0, 0.0, 20, 2),  # day: max(min 8, day floor 20) = 20; embed max(2, 0) = 2
        ("12:00", 301.0, 31.0, 31, 7),  # need ⌈301/10⌉ = 31 > 20; embed ⌈31/5⌉ = 7
        ("12:00", 1000.0, 100.0, 40, 10),  # need 100 and 20, capped at max 40 and 10
        ("22:29", 0.0, 0.0, 20, 2),
        ("22:30", 0.0, 0.0, 12, 2),  # shrink: max(min 8, night floor 12, 0) = 12; embed has no night floor
        ("22:30", 150.0, 0.0, 15, 2),  # need 15 > 12
        ("03:00", 95.0, 9.0, 12, 2),  # need ⌈9.5⌉ = 10 < 12; embed ⌈9/5⌉ = 2
        ("03:00", 500.0, 60.0, 40, 10),  # a spike at night: the need rules, capped
        ("07:30", 0.0, 0.0, 20, 2),  # day again
    ],
)
def test_target_is_the_floor_of_the_phase_or_the_need_within_bounds(at: str, chat_load: float, embed_load: float,
                                                                    chat: int, embed: int) -> None:
    controller = two_services({"chat": chat_load, "embed": embed_load})
    assert controller.target_replicas("chat", hhmm(at)) == chat
    assert controller.target_replicas("embed", hhmm(at)) == embed


@pytest.mark.parametrize(
    ("bound", "missing"),
    [
        ([], "chat, embed"),
        (["chat"], "embed"),
        (["embed", "search"], "chat"),
    ],
)
def test_a_policy_naming_a_service_the_cluster_does_not_run_is_refused(bound: list[str], missing: str) -> None:
    policy = TidalPolicy(services=(CHAT, TidalService(name="embed", min_replicas=2, max_replicas=10)),
                         windows=(NIGHT,))
    cluster = SimCluster(CATALOG, [eight("s0", STABLE_POOL, "stable")])
    bindings = [ServiceBinding(name, 10.0, MILLI_PER_CARD) for name in bound]
    with pytest.raises(TidalPolicyError) as raised:
        TidalController(cluster, policy, bindings, FixedForecast(lambda svc, t, horizon: 0.0), cluster.loop.now)
    assert f"unknown service(s) {missing}" in str(raised.value)
    assert str(raised.value).startswith("services:")


# ---------------------------------------------------------------------------------------------- scale-down by cost
@pytest.fixture
def scale_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[World], list[dict[str, str | None]]]]:
    """Installs a spy on a world's `scale`: for each scale-down of chat-tidal, every member's deletion cost
    at the moment of the call."""

    def install(world: World) -> list[dict[str, str | None]]:
        seen: list[dict[str, str | None]] = []
        original = world.cluster.scale

        def spy(workload: str, replicas: int) -> Status:
            members = [p for p in world.cluster.list_pods() if p.request.workload == workload]
            if workload == "chat-tidal" and replicas < len(members):
                seen.append({p.name: dict(p.annotations).get(DELETION_COST) for p in members})
            return original(workload, replicas)

        monkeypatch.setattr(world.cluster, "scale", spy)
        return seen

    yield install


@pytest.mark.parametrize(
    ("order", "costs", "layout", "emptied", "lent"),
    [
        # 12 → 4 tidal removes 8. Costs = the node's rank by pods on it: #0 on t0 (1 pod) costs 0, #1-3 on t1
        # (3) cost 1, #4-11 on t2 (8) cost 2. Fewest first: #0, then #3, #2, #1, then the 4 newest of t2
        # (#11..#8): t0 and t1 empty.
        (DrainOrder.FEWEST_INSTANCES, {0: "0", 1: "1", 2: "1", 3: "1", **{i: "2" for i in range(4, 12)}},
         {"t0": [], "t1": [], "t2": [4, 5, 6, 7], "t3": []}, 2, {"t0", "t1", "t3"}),
        # Newest first (no costs): #11..#4, all of t2: t2 empties, t0 and t1 keep theirs.
        (DrainOrder.NEWEST, {}, {"t0": [0], "t1": [1, 2, 3], "t2": [], "t3": []}, 1, {"t2", "t3"}),
    ],
)
def test_a_scale_down_removes_the_pods_on_the_nodes_with_fewest_pods(
        scale_calls: Callable[[World], list[dict[str, str | None]]], order: DrainOrder, costs: dict[int, str],
        layout: dict[str, list[int]], emptied: int, lent: set[str]) -> None:
    world = night(trainers=0, drain_order=order)
    seen = scale_calls(world)
    world.run(SHRINK - 1)
    assert seen == [] and world.tidal_layout() == {n: list(v) for n, v in LAYOUT.items()}
    world.run(SHRINK)
    assert len(seen) == 1  # one scale-down, 12 → 4 (night floor 12 − 8 stable)
    assert seen[0] == {f"chat-tidal-{i}": costs.get(i) for i in range(12)}
    assert world.tidal_layout() == layout
    controller = world.controller
    assert controller is not None
    (drain,) = controller.stats.drains
    assert drain.time == SHRINK and drain.removed == 8
    assert drain.emptied["fewest-instances"] == 2 and drain.emptied["newest"] == 1  # t0 + t1 against t2
    assert drain.emptied[order.value] == emptied  # the order the controller used: t3 was empty before
    world.run(LEND)
    assert set(controller.ledger) == lent  # the order decides how many nodes go to training


# ---------------------------------------------------------------------------------------------- a night
def test_a_night_shrinks_at_22_30_lends_from_23_30_and_returns_everything_at_07_30() -> None:
    world = night(trainers=4)  # 4 whole-node training pods: one runs on tr0, three wait for loans
    controller = world.controller
    assert controller is not None
    intruder = pod("intruder").cpu(1000).whole(8).pools(TRAINING_POOL).obj()  # training pool, no toleration

    world.run(SHRINK - 1)  # 22:29: the day floor holds 20 = 8 stable + 12 tidal
    assert len(world.running("chat-tidal-")) == 12 and len(world.running("chat-stable-")) == 8
    assert [p.name for p in world.running("train-")] == ["train-0"]

    world.run(SHRINK)  # 22:30: max(min 8, night floor 12, need 1) = 12 → 4 tidal, all on t2
    assert len(world.running("chat-tidal-")) == 4 and len(world.running("chat-stable-")) == 8
    assert world.tidal_layout() == {"t0": [], "t1": [], "t2": [4, 5, 6, 7], "t3": []}

    world.run(LEND - 1)  # emptied, but not lent before 23:30
    assert controller.ledger == {} and controller.stats.loans == 0
    for name in TIDAL_NODES:
        assert_home(world.node(name))
    assert [p.name for p in world.running("train-")] == ["train-0"]

    world.run(LEND)  # 23:30: room = 4 × 8000 × 0.9 − 4 × 1000 = 24800 ≥ 3 × 7200: t0, t1, t3 lent; t2 busy
    assert set(controller.ledger) == {"t0", "t1", "t3"}
    assert controller.ledger["t0"] == Loan("t0", LEND, "night")
    assert controller.stats.loans == 3
    assert min(world.lent_at()) == LEND
    for name in ("t0", "t1", "t3"):
        assert_lent(world.node(name), LEND)
    assert_home(world.node("t2"))
    for name in ("s0", "s1", "tr0"):  # stable nodes (s1 is empty) and the training node are never lent
        assert LOAN_LABEL not in dict(world.node(name).spec.labels)
    trained = {p.name: p.assignment.node for p in world.running("train-") if p.assignment is not None}
    assert sorted(trained.values()) == ["t0", "t1", "t3", "tr0"]  # the training pods run on the loans at once
    assert all(p.bound_at == LEND for p in world.running("train-") if p.name != "train-0")
    assert world.cluster.create_pod(intruder).ok  # no toleration: it never lands on a lent node
    world.scheduler.run_pending()
    info = world.cluster.get_pod("intruder")
    assert info is not None and info.phase is PodPhase.PENDING

    world.run(RECLAIM - 1)  # 07:29: still lent
    assert set(controller.ledger) == {"t0", "t1", "t3"} and controller.stats.reclaims == 0
    assert max(world.lent_at()) == RECLAIM - TICK_S

    world.run(RECLAIM)  # 07:30: every loan returns on the tick that falls on it
    assert controller.ledger == {}
    for name in TIDAL_NODES:
        assert_home(world.node(name))
    assert sorted(controller.history, key=lambda loan: loan.node) == [
        Loan(n, LEND, "night", returned=RECLAIM, early=False) for n in ("t0", "t1", "t3")]
    assert (controller.stats.reclaims, controller.stats.early_reclaims) == (3, 0)
    assert controller.stats.training_pods_evicted == 3
    for name, node_name in trained.items():
        info = world.cluster.get_pod(name)
        assert info is not None
        if node_name == "tr0":
            assert info.phase is PodPhase.RUNNING  # the training node is not the controller's
        else:
            assert info.phase is PodPhase.TERMINATING
            assert dict(info.annotations)["gpuplane.io/eviction-reason"] == "tidal reclaim"

    world.run(RECLAIM + GRACE - 1)  # the final checkpoint's grace is not cut short
    assert all(world.cluster.get_pod(n) is not None for n in trained)
    world.run(RECLAIM + GRACE)
    assert {n for n in trained if world.cluster.get_pod(n) is not None} == {"train-0"}
    world.run(RECLAIM + GRACE + TICK_S)  # the day's 12 tidal replicas are back on the returned nodes
    assert len(world.running("chat-tidal-")) == 12
    assert all(p.assignment is not None and p.assignment.node in TIDAL_NODES for p in world.running("chat-tidal-"))


def test_offline_work_on_tidal_nodes_neither_keeps_them_from_emptying_nor_from_being_lent() -> None:
    world = night(trainers=4)
    controller = world.controller
    assert controller is not None
    # Near-line pods (QoS offline) on the cards the services left: t1 card 5 (beside 3 replicas), t3 cards 0-1.
    for name, node_name, card in (("near-0", "t1", 5), ("near-1", "t3", 0), ("near-2", "t3", 1)):
        assert world.cluster.create_pod(pod(name).cpu(100).mem(64).whole(1).qos(QoS.OFFLINE)
                                        .pools(TIDAL_POOL).obj()).ok
        bind_on(world.cluster, name, node_name, card)

    world.run(SHRINK)  # drain costs count replicas only: t0 (1) and t1 (3) first, as without the near-line pods
    assert world.tidal_layout() == {"t0": [], "t1": [], "t2": [4, 5, 6, 7], "t3": []}
    assert controller.stats.drains[-1].emptied["fewest-instances"] == 2

    world.run(LEND)  # t0, t1, t3 lent as before: the near-line pods on t1 and t3 are evicted with the grace
    assert set(controller.ledger) == {"t0", "t1", "t3"}
    assert controller.stats.offline_pods_displaced == 3
    for name in ("near-0", "near-1", "near-2"):
        info = world.cluster.get_pod(name)
        assert info is not None and info.phase is PodPhase.TERMINATING
        assert dict(info.annotations)["gpuplane.io/eviction-reason"] == LEND_REASON
    world.run(LEND + GRACE + TICK_S)  # gone after the grace; the training pods hold every lent node's cards
    assert all(world.cluster.get_pod(f"near-{i}") is None for i in range(3))
    trained = sorted(p.assignment.node for p in world.running("train-") if p.assignment is not None)
    assert trained == ["t0", "t1", "t3", "tr0"]


def test_an_online_pod_keeps_a_tidal_node_from_being_lent() -> None:
    world = night(trainers=4)
    controller = world.controller
    assert controller is not None
    # Not one of the controller's services, but online: the controller never evicts it, so t3 stays home.
    assert world.cluster.create_pod(pod("guest").cpu(100).mem(64).whole(1).pools(TIDAL_POOL).obj()).ok
    bind_on(world.cluster, "guest", "t3", 0)
    world.run(LEND)
    assert set(controller.ledger) == {"t0", "t1"} and controller.stats.offline_pods_displaced == 0
    assert_home(world.node("t3"))


def test_loans_start_and_return_within_one_reconcile_period_when_ticks_miss_the_times() -> None:
    world = night(trainers=4, first_tick=START + 45)  # ticks at hh:mm:45
    controller = world.controller
    assert controller is not None
    world.run(LEND + 44)  # 23:30:44: the window lends, but no tick has run yet
    assert controller.ledger == {}
    world.run(LEND + 45)
    assert set(controller.ledger) == {"t0", "t1", "t3"}
    assert {loan.since for loan in controller.ledger.values()} == {LEND + 45}
    world.run(RECLAIM - 15)  # 07:29:45: still lent
    assert len(controller.ledger) == 3
    world.run(RECLAIM + 45)  # the next tick, 07:30:45, within a period of 07:30
    assert controller.ledger == {}
    assert {loan.returned for loan in controller.history} == {RECLAIM + 45}
    for name in TIDAL_NODES:
        assert_home(world.node(name))


# ---------------------------------------------------------------------------------------------- early reclaim
@pytest.mark.parametrize(
    ("spike", "trainers", "reclaimed", "evicted", "tidal"),
    [
        # 400 / 10 = 40 replicas (max 40): 32 tidal = 32000 milli; the unlent t2 holds 8000 × 0.9 = 7200,
        # short 24800 → free ≥ 24800 / 0.9 ≈ 27556: all three loans (24000), 3 training pods evicted.
        (400.0, 4, 3, 3, 32),
        # 240 / 10 = 24: 16 tidal = 16000; short 16000 − 7200 = 8800 → free ≥ 9778: two loans, the idle one
        # first (no training pod to stop), then the cheapest busy one; 1 training pod evicted.
        (240.0, 3, 2, 1, 16),
    ],
)
def test_a_load_spike_while_lent_reclaims_at_once(spike: float, trainers: int, reclaimed: int, evicted: int,
                                                  tidal: int) -> None:
    world = night(trainers=trainers)
    controller = world.controller
    assert controller is not None
    at = hhmm("01:00", 1)
    world.run(at - 1)
    assert set(controller.ledger) == {"t0", "t1", "t3"}
    busy = {n: len(world.pods_on(n, prefix="train-")) for n in controller.ledger}
    cheapest = sorted(controller.ledger, key=lambda n: (busy[n], n))[:reclaimed]
    world.load["chat"] = spike
    world.run(at)
    assert controller.stats.early_reclaims == reclaimed and controller.stats.reclaims == reclaimed
    assert sorted(controller.history, key=lambda loan: loan.node) == [
        Loan(n, LEND, "night", returned=at, early=True) for n in sorted(cheapest)]
    assert set(controller.ledger) == {"t0", "t1", "t3"} - set(cheapest)
    for name in cheapest:
        assert_home(world.node(name))
    stopping = [p for p in world.cluster.list_pods() if p.phase is PodPhase.TERMINATING]
    assert len(stopping) == evicted == controller.stats.training_pods_evicted
    assert all(p.name.startswith("train-") and p.assignment is not None and p.assignment.node in cheapest
               for p in stopping)
    world.run(at + GRACE - 1)
    assert all(world.cluster.get_pod(p.name) is not None for p in stopping)
    world.run(at + GRACE)
    assert all(world.cluster.get_pod(p.name) is None for p in stopping)
    world.run(at + GRACE + TICK_S)  # the services scaled up at once and are all placed once the grace is over
    assert len(world.running("chat-tidal-")) == tidal
    assert not [p for p in world.cluster.list_pods() if p.name.startswith("chat-") and p.phase is PodPhase.PENDING]
    assert controller.stats.loans == 3  # nothing lent again while the load stays high
    world.run(RECLAIM)
    assert controller.ledger == {} and controller.stats.reclaims == 3
    assert [loan.early for loan in controller.history].count(False) == 3 - reclaimed


@pytest.mark.parametrize(
    ("rise_seen_within", "early", "reason"),
    [
        # The scaling horizon (1800 s) sees the night; the rise to 400 is seen only at 1800 + GRACE (the time
        # a reclaimed node takes to free): the reclaim starts now, early, so the node is back in time.
        (1800.0 + GRACE, 3, EARLY_RECLAIM_REASON),
        # A rise beyond even that is not acted on yet: nothing is reclaimed.
        (1800.0 + GRACE + 1.0, 0, None),
    ],
)
def test_a_reclaim_looks_ahead_by_the_grace_it_takes(rise_seen_within: float, early: int,
                                                     reason: str | None) -> None:
    world = night(trainers=4)
    at = hhmm("01:00", 1)

    def peak(service: str, t: float, horizon: float) -> float:
        return 400.0 if t >= at and horizon >= rise_seen_within else NIGHT_LOAD

    world.controller = TidalController(world.cluster, POLICY, [BINDING], FixedForecast(peak), world.cluster.loop.now)
    controller = world.controller
    world.run(at - 1)
    assert set(controller.ledger) == {"t0", "t1", "t3"}
    world.run(at)
    assert controller.stats.early_reclaims == early
    assert len(world.running("chat-tidal-")) == 4  # scaling saw only the night: its floor 12 − 8 stable
    reasons = {dict(p.annotations).get("gpuplane.io/eviction-reason") for p in world.cluster.list_pods()
               if p.phase is PodPhase.TERMINATING}
    assert reasons == ({reason} if reason else set())


class Recording:
    """A forecast that records what it was shown."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float, float]] = []

    def observe(self, service: str, t: float, load: float) -> None:
        self.seen.append((service, t, load))

    def peak_over(self, service: str, t: float, horizon_s: float) -> float:
        return 0.0


def test_each_pass_feeds_the_forecast_what_the_load_source_reads() -> None:
    cluster = SimCluster(CATALOG, [eight("s0", STABLE_POOL, "stable")])
    readings: list[float | None] = [12.0, None, 30.0]
    forecast = Recording()
    controller = TidalController(cluster, POLICY, [BINDING], forecast, cluster.loop.now,
                                 load=lambda service: readings.pop(0))
    for t in (60.0, 120.0, 180.0):
        cluster.loop.run(until=t)
        controller.reconcile()
    # The unreadable second pass teaches nothing and is counted; the others arrive with their pass's time.
    assert forecast.seen == [("chat", 60.0, 12.0), ("chat", 180.0, 30.0)]
    assert controller.stats.load_misses == 1


def test_an_early_reclaim_does_not_lend_again_what_it_took_back() -> None:
    # Tidal nodes: ta (4 GPUs, idle once lent), tb and tc (8 GPUs, each running a training pod); headroom 0.
    # Need 13 replicas − 8 min = 5 tidal = 5000 milli, nothing unlent: short 5000. Cheapest first takes ta
    # (no pod, 4000 < 5000) then tb (1 pod, 12000). The room left is 12000 − 5000 = 7000 ≥ ta's 4000:
    # ta is lent again at once.
    policy = TidalPolicy(services=(TidalService(name="chat", min_replicas=8, max_replicas=40),),
                         windows=(TidalWindow(name="night", shrink_at="22:30", lend_from="23:30",
                                              reclaim_at="07:30"),), reclaim_headroom=0.0)
    nodes = [eight("s0", STABLE_POOL, "stable"), eight("tr0", TRAINING_POOL, None),
             node("ta").gpus(4).pool(TIDAL_POOL).label(SUBSET_LABEL, "tidal").obj(),
             eight("tb", TIDAL_POOL, "tidal"), eight("tc", TIDAL_POOL, "tidal")]
    cluster = SimCluster(CATALOG, nodes)
    cluster.create_workload("chat-stable", replica("chat-stable", STABLE_POOL), 0)
    cluster.create_workload("chat-tidal", replica("chat-tidal", TIDAL_POOL), 0)
    scheduler = Scheduler(cluster, CATALOG, PROFILE, seed=0, now=cluster.loop.now, rules=SchedulingRules())
    load = {"chat": 0.0}
    controller = TidalController(cluster, policy, [BINDING], FixedForecast(lambda svc, t, horizon: load[svc]),
                                 cluster.loop.now)
    cluster.loop.run(until=LEND)
    controller.reconcile()
    assert set(controller.ledger) == {"ta", "tb", "tc"}
    for name, node_name in (("train-tb", "tb"), ("train-tc", "tc")):
        assert cluster.create_pod(trainer(name)).ok
        bind_on(cluster, name, node_name, *range(8))
    scheduler.run_pending()
    cluster.loop.run(until=LEND + 600)
    load["chat"] = 130.0
    controller.reconcile()
    assert controller.stats.loans == 3  # ta must not be lent a second time
    assert "ta" not in controller.ledger or not any(loan.node == "ta" for loan in controller.history)


# ---------------------------------------------------------------------------------------------- restart
@pytest.mark.parametrize(
    ("back_at", "returned"),
    [
        (hhmm("01:00", 1), RECLAIM),  # back during the loan: it returns them at 07:30
        (hhmm("08:00", 1), hhmm("08:00", 1)),  # down across 07:30: its first reconcile returns them
    ],
)
def test_a_restarted_controller_rebuilds_its_ledger_and_returns_every_loan(
        monkeypatch: pytest.MonkeyPatch, back_at: float, returned: float) -> None:
    world = night(trainers=4)
    first = world.controller
    assert first is not None
    world.run(hhmm("01:00", 1) - 1)
    lent = dict(first.ledger)
    assert set(lent) == {"t0", "t1", "t3"}
    world.controller = None  # the controller is gone; the world goes on
    world.run(back_at - 1)

    patched: list[str] = []
    original = world.cluster.patch_node

    def spy(name: str, **kwargs: Any) -> Status:
        patched.append(name)
        return original(name, **kwargs)

    monkeypatch.setattr(world.cluster, "patch_node", spy)
    second = world.build_controller()
    assert second.ledger == lent  # rebuilt from the annotations: same nodes, same since and window
    world.controller = second
    world.run(RECLAIM - 1 if back_at < RECLAIM else back_at - 1)
    assert second.stats.loans == 0 and patched == []  # nothing lent twice
    assert all(len(taints(info)) <= 1 for info in world.cluster.list_nodes())
    world.run(max(RECLAIM, back_at))
    assert second.ledger == {}
    assert sorted(patched) == sorted(lent)  # one patch each: the return
    assert sorted(second.history, key=lambda loan: loan.node) == [
        Loan(n, LEND, "night", returned=returned) for n in sorted(lent)]
    for name in TIDAL_NODES:
        assert_home(world.node(name))


def test_a_restart_before_anything_is_lent_starts_with_an_empty_ledger() -> None:
    world = night(trainers=0)
    world.run(LEND - 1)
    second = world.build_controller()
    assert second.ledger == {}
    world.controller = second
    world.run(LEND)
    assert set(second.ledger) == {"t0", "t1", "t3"} and second.stats.loans == 3


# ---------------------------------------------------------------------------------------------- baseline
def test_without_lending_the_controller_scales_but_never_touches_a_node(monkeypatch: pytest.MonkeyPatch) -> None:
    world = night(trainers=4, lend=False)
    controller = world.controller
    assert controller is not None
    patched: list[str] = []
    monkeypatch.setattr(world.cluster, "patch_node", lambda name, **kwargs: patched.append(name))
    world.run(SHRINK)
    assert len(world.running("chat-tidal-")) == 4  # the services still follow the plan
    world.run(RECLAIM + GRACE + TICK_S)
    assert patched == [] and controller.ledger == {} and controller.history == []
    assert (controller.stats.loans, controller.stats.reclaims, controller.stats.training_pods_evicted) == (0, 0, 0)
    assert world.lent_at() == []
    assert all(info.spec.pool == TIDAL_POOL and taints(info) == [] for info in world.cluster.list_nodes()
               if info.name in TIDAL_NODES)
    assert [p.name for p in world.running("train-")] == ["train-0"]  # training never got more than tr0
    assert len(world.running("chat-tidal-")) == 12  # and the day's replicas are back


def test_a_reclaim_eviction_a_disruption_budget_holds_back_is_retried_even_by_a_restarted_controller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = night(trainers=4)
    world.run(RECLAIM - 1)
    trained = {p.name: p.assignment.node for p in world.running("train-") if p.assignment is not None}
    lent = sorted(name for name, node_name in trained.items() if node_name != "tr0")
    held = lent[0]
    answers = iter([Status(Code.PENDING, ("blocked: disruption budget",))] * 2)  # two passes refused, then allowed
    evict = world.cluster.evict

    def budget(pod: str, *, grace_s: float = 30.0, reason: str = "") -> Status:
        if pod == held:
            answer = next(answers, None)
            if answer is not None:
                return answer
        return evict(pod, grace_s=grace_s, reason=reason)

    monkeypatch.setattr(world.cluster, "evict", budget)
    world.run(RECLAIM)  # 07:30: the nodes return; two pods go, the held one keeps running on its node
    controller = world.controller
    assert controller is not None and controller.ledger == {}
    assert (controller.stats.training_pods_evicted, controller.stats.evictions_held) == (2, 1)
    info = world.cluster.get_pod(held)
    assert info is not None and info.phase is PodPhase.RUNNING

    # A restarted controller knows nothing of it, yet finds it from the world: a training pod on a home node.
    world.controller = world.build_controller()
    world.run(RECLAIM + TICK_S)  # held back once more
    assert world.controller.stats.evictions_held == 1
    world.run(RECLAIM + 2 * TICK_S)  # the budget allows it now
    assert world.controller.stats.training_pods_evicted == 1
    info = world.cluster.get_pod(held)
    assert info is not None and info.phase is PodPhase.TERMINATING
    world.run(RECLAIM + 3 * TICK_S)
    assert world.controller.stats.training_pods_evicted == 1  # terminating pods are not evicted again
