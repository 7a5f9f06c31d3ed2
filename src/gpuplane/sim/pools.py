"""Pool settings from YAML, e.g. a dev pool whose card memory is oversold 1:2::

    pools:
      dev: {memory_oversell: 2.0}
      prod: {}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from gpuplane.model import PoolConfig
from gpuplane.model.yamlfile import load_yaml_model


class _Pool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_oversell: float = Field(default=1.0, ge=1.0, le=16.0)


class _Pools(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: dict[str, _Pool]


def load_pools(path: str | Path) -> dict[str, PoolConfig]:
    """Parse a pools file; errors name the file and the field (e.g. `pools.dev.memory_oversell`)."""
    parsed = load_yaml_model(path, _Pools)
    return {name: PoolConfig(memory_oversell=pool.memory_oversell) for name, pool in parsed.pools.items()}
