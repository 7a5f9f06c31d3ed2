"""The DRA bench's nodes: `gpuplane bench kube --dra` publishes these ResourceSlices for its nodes and starts
`gpuplane scheduler --dra` (`gpuplane.kube.dra`) to allocate the pods' claims."""

from __future__ import annotations

from gpuplane.kube.api import JsonObject
from gpuplane.model import NodeSpec


def bench_slices(spec: NodeSpec) -> list[JsonObject]:
    """A bench node's ResourceSlices (`run_kube_bench(..., dra=bench_slices)`)."""
    from gpuplane.model import default_catalog
    from gpuplane.node.dra_slices import spec_slices

    return spec_slices(spec, default_catalog())
