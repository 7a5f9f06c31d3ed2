"""The platform week's page, from a fabricated three-seed sweep whose figures are chosen so that every
number on the page is known: the comparison table's cells (medians over seeds, ranges, ours against
vanilla, the goals' verdicts, each report's figure in its own column) as headless Chromium shows them."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuplane.report.browser import Chromium, artefact_path, dom_text, table_rows
from gpuplane.report.platform import (
    COLUMNS,
    cell,
    comparison_rows,
    duration,
    lent_nodes,
    main,
    make_week,
    sections,
    write_week_report,
)
from gpuplane.sim.platform import ARMS, SCENARIO, PlatformFigures, PlatformSettings
from gpuplane.sim.platform.fleet import POOLS
from gpuplane.sim.scenario import Scenario, numeric_figures
from gpuplane.sim.scenario.sweep import Sweep, summarise

SETTINGS = PlatformSettings.model_validate(dict(SCENARIO.quick))
"""12 training nodes of their own (6 A100 + 6 H100)."""

PER_SEED: dict[str, tuple[float, float, float]] = {
    "vanilla_fleet_util_pct": (40.0, 44.0, 50.0),
    "platform_fleet_util_pct": (60.0, 63.2, 65.0),
    "platform_util_gain_points": (20.0, 19.2, 15.0),  # 60 − 40, 63.2 − 44, 65 − 50
    "no_colocation_fleet_util_pct": (50.0, 52.2, 55.5),  # co-location adds 10.0, 11.0, 9.5
    "no_tidal_fleet_util_pct": (55.0, 58.0, 61.0),  # tidal adds 5.0, 5.2, 4.0
    "vanilla_inference_cost": (900.0, 905.0, 930.0),
    "platform_inference_cost": (460.0, 460.0, 460.0),
    "platform_inference_cost_cut_pct": (48.9, 49.2, 50.5),
    "platform_inference_gpu_h_cut_pct": (31.0, 29.0, 28.0),  # median 29 < 30: the goal is missed
    "platform_night_conversion_pct": (17.6, 17.6, 17.6),
    "vanilla_shortage_minutes": (0.0, 0.0, 0.0),
    "platform_shortage_minutes": (20.0, 40.0, 40.0),
    "platform_slo_minutes_added": (0.0, 0.0, 3.0),
    "vanilla_training_wait_p95_s": (37_380.0, 39_990.0, 42_600.0),
}
"""Seeds 1, 2, 3. Every other figure is 0 (ints) or 1.0 (floats)."""


def _run(k: int, ablation: bool = True) -> PlatformFigures:
    values: dict[str, Any] = {}
    for name in numeric_figures(PlatformFigures):
        annotation = PlatformFigures.model_fields[name].annotation
        values[name] = 0 if annotation is int else 1.0
    values.update({name: seeds[k] for name, seeds in PER_SEED.items()})
    if not ablation:
        values.update({name: math.nan for name in values if name.startswith("no_")})
    hours = (1.0, 2.0, 3.0, 4.0)
    pools = (*POOLS, "fleet")
    arms = ARMS if ablation else ARMS[:2]
    return PlatformFigures(
        **values, time_h=hours,
        util_series=tuple((arm, pool, (50.0, 55.0, 60.0, 58.0)) for arm in ARMS[:2] for pool in pools),
        alloc_series=tuple((arm, pool, (70.0, 72.0, 75.0, 74.0)) for arm in ARMS[:2] for pool in pools),
        nodes_series=(("training", (12, 14, 16, 12)), ("inference", (8, 8, 8, 8)), ("inference-stable", (2, 2, 2, 2)),
                      ("inference-tidal", (6, 4, 2, 6)), ("dev", (4, 4, 4, 4))),
        failure_h=(2.5,), recovery_h=(2.62,), vanilla_recovery_h=(3.83,),
        team_cost=(("team-0", 873.0, 425.0), ("team-1", 448.0, 496.0)),
        waits_p95=(("online", 0.0, 2.0), ("training", 37_380.0, 12_602.0), ("dev", 0.0, 0.0),
                   ("batch-low", 0.0, 240.0)),
        ablation=tuple((arm, 60.0 - i, 400.0 + 10 * i, 600.0 + i, 0.0) for i, arm in enumerate(arms)))


def _sweep(ablation: bool = True) -> Sweep[PlatformSettings, PlatformFigures]:
    scenario = cast("Scenario[PlatformSettings, PlatformFigures]", SCENARIO)
    return summarise(scenario, SETTINGS, (1, 2, 3), [_run(k, ablation) for k in range(3)])


EXPECTED: list[tuple[str, tuple[str, ...]]] = [
    # label → vanilla, ours, ours against vanilla, goal, vivo, Kuaishou
    ("fleet-wide daily average GPU utilisation (%)",
     ("44.0 [40.0, 50.0]", "63.2 [60.0, 65.0]", "+19.2 points [+15.0, +20.0]", "≥ 15: met",
      "+5 points (AI GPU utilisation: backfill, tidal, vGPU)", "+7 points (co-location), +3–5 (tidal)")),
    # (60/40 − 1, 63.2/44 − 1, 65/50 − 1) = (+50 %, +43.6 %, +30 %): median +44 % (rounded to the unit)
    ("the same, relative to vanilla's", ("", "", "+44 % [+30, +50]", "", "utilisation +20 %", "")),
    # median of (10.0, 11.0, 9.5) and of (5.0, 5.2, 4.0)
    ("utilisation co-location adds (platform over no-colocation)",
     ("", "", "+10.0 points [+9.5, +11.0]", "", "", "+7 points daily average")),
    ("utilisation tidal lending adds (platform over no-tidal)",
     ("", "", "+5.0 points [+4.0, +5.2]", "", "", "+3–5 points daily average")),
    # the same value on every seed: no range; the cut is shown as a change, with a minus sign
    ("inference cost ($, list prices)", ("905 [900, 930]", "460", "−49.2 % [−50.5, −48.9]", "", "−30 %", "−50 %")),
    ("inference GPU-hours", ("1", "1", "−29.0 % [−31.0, −28.0]", "≥ 30: MISSED", "", "")),
    ("night conversion: inference GPUs lent at night (%)", ("", "17.6", "", "", "", "20 %+")),
    ("shortage minutes (an online replica pending)",
     ("0", "40 [20, 40]", "+40 min [+20, +40]", "", "shortage alerts −80 %", "")),
    ("SLO minutes (load above serving capacity)", ("1", "1", "+0 min [+0, +3]", "≤ 0: met", "", "")),
    ("p95 wait, training (s)", ("39,990 [37,380, 42,600]", "1", "", "", "", "")),
]


@pytest.mark.parametrize(("label", "cells"), EXPECTED, ids=[label for label, _ in EXPECTED])
def test_the_comparison_rows_are_medians_ranges_and_the_reports_beside_ours(label: str,
                                                                            cells: tuple[str, ...]) -> None:
    rows = {row[0]: row[1:] for row in comparison_rows(_sweep())}
    assert rows[label] == cells


def test_an_ablation_not_run_is_a_dash_never_a_made_up_figure() -> None:
    rows = {row[0]: row[1:] for row in comparison_rows(_sweep(ablation=False))}
    assert rows["utilisation co-location adds (platform over no-colocation)"][2] == "—"
    page = sections(_sweep(ablation=False))
    assert "Not run" in page[-1] and "<img" not in page[-1]


def test_the_page_has_every_part_the_issue_lists() -> None:
    page = "".join(sections(_sweep()))
    for heading in ("The comparison", "Utilisation and allocation per pool", "The tide, the loans, faults and "
                    "recoveries", "Waits by class and cost per team", "The ablation"):
        assert f">{heading}</h2>" in page
    # per pool over time, the tide with loans and faults, waits and costs, the ablation bars
    assert page.count("<img") == 4


def test_the_loans_are_the_training_pools_nodes_beyond_its_own() -> None:
    # training pool (12, 14, 16, 12) over its own 6 A100 + 6 H100 nodes
    assert lent_nodes(SETTINGS, _run(0)) == [0, 2, 4, 0]


@pytest.mark.parametrize(("seconds", "shown"), [(2.0, "2 s"), (119.0, "119 s"), (240.0, "4 min"),
                                                (7140.0, "119 min"), (37_380.0, "10.4 h")])
def test_waits_are_labelled_as_people_say_them(seconds: float, shown: str) -> None:
    assert duration(seconds) == shown  # 37,380 s / 3,600 = 10.38 h


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=9))
def test_a_cells_median_lies_within_its_range(values: list[float]) -> None:
    text = cell(values, ".1f").replace("−", "-")
    match = re.fullmatch(r"(-?[\d.]+)(?: \[(-?[\d.]+), (-?[\d.]+)\])?", text)
    assert match is not None, text
    median, low, high = (float(g) if g is not None else None for g in match.groups())
    assert median is not None
    if low is None:  # no range shown: every seed rounds to the figure shown
        assert {f"{v:.1f}" for v in values} == {f"{statistics.median(values):.1f}"}
    else:
        assert high is not None and low <= median <= high


def test_chromium_shows_the_comparison_tables_numbers(tmp_path: Path) -> None:
    """The page as headless Chromium renders it: the comparison table's cells are the figures' medians and
    ranges, and a screenshot of it is kept as a test artefact."""
    path = write_week_report(_sweep(), tmp_path / "week.html")
    browser = Chromium.find()
    dom = browser.dump_dom(path)
    rows = table_rows(dom)
    header = next(row for row in rows if row[1:] == list(COLUMNS))
    assert header[0] == ""
    shown = {row[0]: tuple(row[1:]) for row in rows if len(row) == len(COLUMNS) + 1}
    for label, cells in EXPECTED:
        assert shown[label] == cells
    assert "fleet utilisation 44.0 → 63.2 %" in dom_text(dom)  # the summary line of the median run (seed 2)
    shot = browser.screenshot(path, artefact_path("test_platform_report-week.png"), 1100, 2400)
    assert (shot.width, shot.height) == (1100, 2400) and shot.size_bytes > 10_000


def test_a_real_quick_week_shows_its_own_figures_in_chromium(tmp_path: Path) -> None:
    """A real (short) run of the quick fleet, vanilla and platform: the page Chromium renders shows the run's
    own figures in the comparison table, and its screenshot comes out."""
    settings = SETTINGS.model_copy(update={"days": 0.25, "ablation": False})
    sweep, path, shot = make_week(settings, (1,), tmp_path, artefact_path("test_platform_report-real.png"))
    run = sweep.runs[0]
    rows = table_rows(Chromium.find().dump_dom(path))
    shown = {row[0]: tuple(row[1:]) for row in rows if len(row) == len(COLUMNS) + 1}
    fleet = shown["fleet-wide daily average GPU utilisation (%)"]
    assert fleet[0] == f"{run.vanilla_fleet_util_pct:.1f}"
    assert fleet[1] == f"{run.platform_fleet_util_pct:.1f}"
    assert fleet[2] == f"{run.platform_util_gain_points:+.1f} points".replace("-", "−")
    assert shown["inference GPU-hours"][:2] == (f"{run.vanilla_inference_gpu_h:,.0f}",
                                                f"{run.platform_inference_gpu_h:,.0f}")
    assert shown["utilisation tidal lending adds (platform over no-tidal)"][2] == "—"  # no ablation was run
    assert shot is not None and shot.width == 1100 and shot.height > 2000


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "days"], "write FIELD=VALUE"),
    (["--set", "no_such_field=1"], "no_such_field"),
    (["--set", "days=-1"], "days"),
    (["--seeds", "3-1"], "runs backwards"),
])
def test_the_page_command_refuses_bad_settings_before_running(args: list[str], message: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
