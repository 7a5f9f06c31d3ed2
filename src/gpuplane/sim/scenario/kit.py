"""The scenario contract: settings, typed figures, goals, headlines and tables, shared by every scenario.

A scenario compares arms (our mechanism and its baselines) in one simulated world. It returns a typed
`Figures` model whose every field names the arm it measures, so the rules for figures can be checked by
code: a goal is on our arm, never on a baseline, and each headline names the assumption it rests on and
the direction it moves when that assumption moves.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

Progress = Callable[[str, int, int], None]
"""progress(label, done, total): long work reports here (a bar per label)."""


def no_progress(label: str, done: int, total: int) -> None:
    """A `Progress` that shows nothing."""


class ScenarioSettings(BaseModel):
    """The base of every scenario's settings: unknown fields are errors, and the seed is a field."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(default=1, ge=0, description="the run's randomness; `gpuplane scenario --seeds` sweeps it")


class Figures(BaseModel):
    """The base of every scenario's typed figures. Declare each field with `figure(arm, ...)`."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def figure(arm: str, description: str, unit: str = "") -> Any:
    """A `Figures` field: what it measures, on which arm, in which unit."""
    return Field(description=description, json_schema_extra={"arm": arm, "unit": unit})


def figure_arm(model: type[Figures], name: str) -> str:
    """The arm a figure field was declared on; a field declared without `figure()` is an error."""
    info = model.model_fields.get(name)
    if info is None:
        raise KeyError(f"{model.__name__} has no figure {name!r}")
    extra = info.json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get("arm"), str):
        raise ValueError(f"{model.__name__}.{name} is not declared with figure(arm, ...)")
    return str(extra["arm"])


def figure_unit(model: type[Figures], name: str) -> str:
    extra = model.model_fields[name].json_schema_extra
    return str(extra.get("unit", "")) if isinstance(extra, dict) else ""


def numeric_figures(model: type[Figures]) -> tuple[str, ...]:
    """The fields a seed sweep summarises (numbers and booleans; not series kept for plots)."""
    return tuple(name for name, info in model.model_fields.items()
                 if info.annotation in (int, float, bool) and not info.exclude)


def series(description: str) -> Any:
    """A `Figures` field holding data for plots (time series and the like): kept out of JSON and spreads."""
    return Field(default=(), description=description, exclude=True)


_OPS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, "<": operator.lt,
                                                   ">": operator.gt}


@dataclass(frozen=True, slots=True)
class Goal:
    """A target on one of our arm's figures, judged on the median over seeds."""

    name: str
    figure: str
    op: Literal["<=", ">=", "<", ">"]
    target: float

    def met(self, value: float) -> bool:
        return _OPS[self.op](value, self.target)

    def describe(self) -> str:
        return f"{self.figure} {self.op} {self.target:g}"


@dataclass(frozen=True, slots=True)
class Headline:
    """A headline figure, the assumption it rests on, and what moving that assumption does to it.

    `knob` is a settings field; setting it to `moved` (from the scenario's quick settings) must move the
    figure in `direction`. A test runs every declared headline both ways and asserts the direction.
    """

    figure: str
    assumption: str
    knob: str
    moved: object
    direction: Literal["up", "down"]


@dataclass(frozen=True, slots=True)
class Table:
    """A comparison table: a row per measure, a column per arm."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


S = TypeVar("S", bound=ScenarioSettings)
F = TypeVar("F", bound=Figures)
S_contra = TypeVar("S_contra", bound=ScenarioSettings, contravariant=True)


class Scenario(Protocol, Generic[S, F]):
    """What `gpuplane scenario NAME` runs."""

    name: str
    title: str
    settings: type[S]
    figures: type[F]
    ours: str
    """The arm that is gpuplane's mechanism: every goal is on it."""
    arms: tuple[str, ...]
    goals: tuple[Goal, ...]
    headlines: tuple[Headline, ...]
    quick: Mapping[str, object]
    """Settings overrides for a run of a few seconds (tests, headline-direction checks)."""

    def run(self, settings: S, progress: Progress) -> F:
        """One seeded run of every arm."""
        ...

    def tables(self, figures: F) -> Sequence[Table]:
        """The comparison tables of one run (or of the median run)."""
        ...

    def summary(self, figures: F) -> str:
        """One line for the terminal."""
        ...


def check_scenario(scenario: Scenario[Any, Any]) -> list[str]:
    """What breaks the rules for figures in a scenario's declarations (empty when none)."""
    problems: list[str] = []
    model = scenario.figures
    for name, info in model.model_fields.items():
        if info.exclude:
            continue
        try:
            arm = figure_arm(model, name)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if arm not in scenario.arms and arm != "all":
            problems.append(f"{model.__name__}.{name}: arm {arm!r} is not one of {scenario.arms}")
    if scenario.ours not in scenario.arms:
        problems.append(f"{scenario.name}: our arm {scenario.ours!r} is not one of {scenario.arms}")
    for goal in scenario.goals:
        if goal.figure not in model.model_fields:
            problems.append(f"goal {goal.name}: no figure {goal.figure!r}")
        elif figure_arm(model, goal.figure) != scenario.ours:
            problems.append(f"goal {goal.name}: {goal.figure} is on arm {figure_arm(model, goal.figure)!r}, "
                            f"not ours ({scenario.ours!r}): a goal is never on a baseline")
    for headline in scenario.headlines:
        if headline.figure not in model.model_fields:
            problems.append(f"headline {headline.figure}: no such figure")
        if headline.knob not in scenario.settings.model_fields:
            problems.append(f"headline {headline.figure}: no settings field {headline.knob!r}")
        if not headline.assumption:
            problems.append(f"headline {headline.figure}: names no assumption")
    for key in scenario.quick:
        if key not in scenario.settings.model_fields:
            problems.append(f"{scenario.name}.quick: no settings field {key!r}")
    return problems
