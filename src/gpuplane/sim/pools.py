"""Pool settings from YAML, e.g. a dev pool whose card memory is oversold 1:2::

    pools:
      dev: {memory_oversell: 2.0}
      prod: {}
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuplane.model import GpuplaneError, PoolConfig


class _Pool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_oversell: float = Field(default=1.0, ge=1.0, le=16.0)


class _Pools(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: dict[str, _Pool]


def load_pools(path: str | Path) -> dict[str, PoolConfig]:
    """Parse a pools file; errors name the file and the field (e.g. `pools.dev.memory_oversell`)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise GpuplaneError(f"{path}: {exc}") from None
    try:
        parsed = _Pools.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise GpuplaneError(f"{path}: {where}: {first['msg']}") from None
    return {name: PoolConfig(memory_oversell=pool.memory_oversell) for name, pool in parsed.pools.items()}
