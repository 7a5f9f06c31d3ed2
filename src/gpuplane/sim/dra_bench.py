"""The DRA side of `gpuplane bench kube --dra` and of the DRA parity: nodes whose cards are published as
ResourceSlices, gpuplane's DeviceClasses, and each pod's request as a ResourceClaim it uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import yaml

from gpuplane.kube.api import JsonObject, KubeApi
from gpuplane.kube.dra import CLASSES, SLICES, claim_manifest
from gpuplane.kube.objects import INVENTORY, RES_GPU, split_key
from gpuplane.kube.standin import node_manifest
from gpuplane.model import NodeSpec, PodRequest

DEVICE_CLASSES = resources.files("gpuplane") / "data" / "dra-deviceclasses.yaml"
"""The DeviceClasses in the package; deploy/dra/deviceclasses.yaml is the same file (tests/test_dra_classes.py)."""


def device_classes() -> list[dict[str, Any]]:
    """gpuplane's DeviceClasses, as the package (and deploy/dra/deviceclasses.yaml) has them."""
    return [d for d in yaml.safe_load_all(DEVICE_CLASSES.read_text()) if d]


def dra_node_manifest(spec: NodeSpec) -> JsonObject:
    """A DRA node: as `node_manifest`, without the device plugin's resource and the GPU inventory (its cards are
    in its ResourceSlices)."""
    node = node_manifest(spec)
    node["metadata"].get("annotations", {}).pop(INVENTORY, None)
    node["status"]["allocatable"].pop(RES_GPU, None)
    return node


SlicesOf = Callable[[NodeSpec], list[JsonObject]]
"""A node's ResourceSlices (`gpuplane.node.dra_slices.spec_slices`; the node layer is not the simulator's to
import, so the caller hands it in)."""


def publish_dra(api: KubeApi, specs: Sequence[NodeSpec], slices_of: SlicesOf, *, classes: bool = True) -> None:
    """Create the DeviceClasses and each node's slices."""
    if classes:
        for cls in device_classes():
            api.create(CLASSES, cls)
    for spec in specs:
        for piece in slices_of(spec):
            api.create(SLICES, piece)


def claim_of(request: PodRequest) -> JsonObject:
    """The claim `<pod>-gpu` asking for the request's GPU form."""
    return claim_manifest(request, f"{split_key(request.name)[1]}-gpu")
