"""The node agent in DRA mode: the kubelet plugin (`dra_plugin.DraPlugin`) and the node's ResourceSlices
(`dra_slices.SlicePublisher`) over one GPU backend, kept up by one loop (`run_dra_node`).

This is what `gpuplane dra-plugin` runs in place of the device plugin (deploy/modes/dra), with the split and MIG
mode of the node's GpuPool followed as the device plugin follows them (`set_sharing`). The loop serves the
plugin's sockets again when kubelet removed them (`DraPlugin.tick`) and republishes the pool every tick; the
publisher writes only when the slices changed (a card's health, a MIG mode), so an idle node costs one list of
its own slices per tick. A publish the API server refuses or cannot take is logged and made again at the next
tick: the pool in the cluster is then one tick late, never torn (`publish_slices` writes a whole generation).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from gpuplane.kube.api import ApiError, KubeApi, node_path
from gpuplane.node.device_plugin import Sharing
from gpuplane.node.dra_plugin import DraPlugin
from gpuplane.node.dra_slices import SlicePublisher
from gpuplane.node.gpu import GpuBackendError

__all__ = ["node_uid", "run_dra_node", "set_sharing"]

log = logging.getLogger(__name__)


def node_uid(api: KubeApi, node: str) -> str | None:
    """The Node's UID, for its slices' owner reference (the garbage collector then deletes them with the Node);
    None, logged, when the Node cannot be read (the slices are published without an owner)."""
    try:
        uid = api.get(node_path(node)).get("metadata", {}).get("uid")
    except ApiError as exc:
        log.warning("cannot read Node %s (%s): its ResourceSlices get no owner", node, exc)
        return None
    return str(uid) if uid else None


def set_sharing(publisher: SlicePublisher, sharing: Sharing) -> None:
    """The split and MIG mode of the node's GpuPool (`pool_follow.PoolSharingSource`, as the device plugin takes
    them) for the slices the next tick publishes: the vGPU device's holders and default share, which kinds of
    device are published."""
    publisher.settings = replace(publisher.settings, split=sharing.split, mig_mode=sharing.mig_mode)


def run_dra_node(plugin: DraPlugin, publisher: SlicePublisher, stop: threading.Event, interval_s: float) -> int:
    """Until `stop` is set: every `interval_s` (first at once) serve the plugin's sockets again where they are
    gone and publish the node's slices. The plugin must be started. Returns how many ticks published a new
    generation."""
    published = 0
    while True:
        plugin.tick()
        try:
            if publisher.tick() is not None:
                published += 1
        except (ApiError, GpuBackendError) as exc:
            log.warning("publishing the ResourceSlices failed (again in %g s): %s", interval_s, exc)
        if stop.wait(interval_s):
            return published
