"""Synthetic clusters for benchmarks and scale tests: node shapes sampled from a template list."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpuplane.model import NodeSpec


def synthetic_nodes(template: Sequence[NodeSpec], count: int, seed: int = 0) -> list[NodeSpec]:
    """`count` nodes whose shapes (CPU, memory, cards, model) are drawn with replacement from `template`."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if not template:
        raise ValueError("template must hold at least one node")
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(template), size=count)
    return [template[int(i)].with_changes(name=f"synth-node-{k:05d}") for k, i in enumerate(picks)]
