"""Reading operator-written YAML into validated pydantic models, with errors naming file and field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gpuplane.model.errors import GpuplaneError

M = TypeVar("M", bound=BaseModel)


def load_yaml_model(path: str | Path, schema: type[M], error: type[GpuplaneError] = GpuplaneError) -> M:
    """Parse `path` and validate it as `schema`; raise `error("FILE: a.b.c: message")` on bad input."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise error(f"{path}: {exc}") from None
    return validate_model(raw, schema, error, str(path))


def validate_model(raw: object, schema: type[M], error: type[GpuplaneError], source: str) -> M:
    """Validate `raw` as `schema`; raise `error("SOURCE: a.b.c: message")` naming the first bad field."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise error(f"{source}: {where + ': ' if where else ''}{first['msg']}") from None
