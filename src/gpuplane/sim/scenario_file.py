"""Scenario settings from YAML: the fields a file sets, and a pydantic model validated with overrides."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from gpuplane.model import GpuplaneError
from gpuplane.model.yamlfile import validate_model

M = TypeVar("M", bound=BaseModel)


class ScenarioError(GpuplaneError):
    """Bad scenario settings; the message names the file and the field."""


def read_scenario_file(path: str | Path, error: type[GpuplaneError] = ScenarioError) -> dict[str, Any]:
    """The fields a YAML scenario file sets (not validated yet: flags may still change them). An empty file
    sets nothing."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise error(f"{path}: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{path}: a scenario file is a mapping of field: value, got {type(raw).__name__}")
    return {str(k): v for k, v in raw.items()}


def load_scenario_model(path: str | Path, model: type[M], overrides: Mapping[str, object],
                        error: type[GpuplaneError] = ScenarioError) -> M:
    """The settings in `path` with `overrides` applied, validated together; errors name the file and field."""
    fields = read_scenario_file(path, error) | {k: v for k, v in overrides.items() if v is not None}
    return validate_model(fields, model, error, str(path))
