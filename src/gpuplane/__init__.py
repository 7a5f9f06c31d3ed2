"""gpuplane: an open GPU-cluster platform.

Layers, lowest first: `model` (resources, cards, cluster state) → `port` (the cluster port and clock)
→ `scheduler` (framework and placement plugins) → worlds (`sim`) → `report` → `cli`.
Lower layers never import upper ones (checked by import-linter).
"""

__version__ = "0.1.0"
