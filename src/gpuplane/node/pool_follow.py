"""The device plugin's split and MIG mode from its node's GpuPool.

The node's pool is the one its label `gpuplane.io/pool` names (the operator writes it, `gpuplane.kube.pools`; the
tidal controller moves it). For the node the plugin runs on:

- the label names a valid GpuPool (`parse_resource`, with the catalog, as the operator and the extender check
  it): the pool's `split` and `migMode` are in force;
- no label, no GpuPool of that name, or an invalid one: the flags' (`--split`, `--mig-mode`). Why is logged once
  while it stays the same (an invalid pool with the field and the reason, as a warning).

Only `split` and `migMode` reach the plugin (`oversubscriptionRatio` is the extender's, `quota` nobody's yet). The
GpuPools and the node's labels come from a `gpuplane.kube.node_watch.NodeWatch` (an informer on the cluster-scoped
`gpupools`, one on the node narrowed to it); a change of either reaches the plugin through
`DevicePlugin.set_sharing` at once, and the choice is made again every `refresh_s` in any case. While the node's
watch is broken (or the node is gone), its last labels are used; until both are listed, the flags apply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuplane.kube.api import KubeApi
from gpuplane.kube.crds import GPU_POOL, GpuPoolSpec, ResourceError, parse_resource
from gpuplane.kube.informer import Informer
from gpuplane.kube.node_watch import NodeWatch
from gpuplane.kube.objects import POOL_LABEL, object_key
from gpuplane.model import Catalog, default_catalog
from gpuplane.node.device_plugin import Sharing

__all__ = ["FLAGS", "PoolSharingSource", "SharingChoice", "choose_sharing"]

log = logging.getLogger(__name__)

FLAGS = ""
"""`SharingChoice.pool` when the flags are in force."""


@dataclass(frozen=True, slots=True)
class SharingChoice:
    """The sharing in force for the node and where it comes from."""

    sharing: Sharing
    pool: str = FLAGS
    """The GpuPool in force; `FLAGS` for the flags."""
    generation: int = 0
    why: str = ""
    """Why the flags are in force (empty when a pool's are)."""
    invalid: bool = False
    """The node's pool exists but is invalid (`why` names the field)."""


def choose_sharing(pools: Sequence[Mapping[str, Any]], labels: Mapping[str, str], flags: Sharing,
                   catalog: Catalog | None = None) -> SharingChoice:
    """The sharing for a node with `labels`, given every GpuPool: the pool its `gpuplane.io/pool` label names when
    that pool is valid, else `flags` (with why)."""
    name = labels.get(POOL_LABEL)
    if not name:
        return SharingChoice(flags, why=f"the node has no {POOL_LABEL} label")
    obj = next((o for o in pools if object_key(o) == name), None)
    if obj is None:
        return SharingChoice(flags, why=f"no GpuPool {name} (the node's {POOL_LABEL} label)")
    try:
        resource = parse_resource(obj, catalog)
    except ResourceError as exc:
        return SharingChoice(flags, why=f"GpuPool {name} is invalid: {exc}", invalid=True)
    spec = resource.spec
    if not isinstance(spec, GpuPoolSpec):  # pragma: no cover - the informer lists gpupools only
        return SharingChoice(flags, why=f"{name} is a {resource.kind.kind}, not a GpuPool", invalid=True)
    return SharingChoice(Sharing(spec.split, spec.mig), name, resource.generation)


class PoolSharingSource:
    """Feeds a device plugin the split and MIG mode of its node's GpuPool (`flags`: the command line's).

    `start()` starts the watches; `run(apply, stop)` calls `apply` (`DevicePlugin.set_sharing`) with the sharing
    whenever it changes: at once on a change either watch brings, and in any case every `refresh_s`."""

    def __init__(self, api: KubeApi, node: str, flags: Sharing, *, catalog: Catalog | None = None,
                 refresh_s: float = 5.0, informer: Informer | None = None,
                 node_informer: Informer | None = None) -> None:
        self.node = node
        self.flags = flags
        self.catalog = catalog if catalog is not None else default_catalog()
        self.refresh_s = refresh_s
        self.watch = NodeWatch(api, node, GPU_POOL.path(), name="gpupools", informer=informer,
                               node_informer=node_informer)
        self.choice = SharingChoice(flags, why="the GpuPools and the node are not listed yet")
        self._logged = ""

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        return self.watch.wait_synced(timeout_s)

    @property
    def last_error(self) -> str:
        return self.watch.last_error

    def resolve(self) -> SharingChoice:
        """The sharing in force now (from the cached GpuPools and the node's last labels), logged when where it
        comes from changes. Before both are listed, and before the node has been seen, the flags'."""
        labels = self.watch.node_labels()
        if labels is None or not self.watch.has_synced:
            return self.choice
        choice = choose_sharing(self.watch.objects(), labels, self.flags, self.catalog)
        self._report(choice)
        self.choice = choice
        return choice

    def run(self, apply: Callable[[Sharing], object], stop: threading.Event) -> None:
        """Until `stop` is set (and `stop()` called, to wake it): give `apply` the node's sharing when it changes."""
        pushed = self.choice.sharing

        def step() -> None:
            nonlocal pushed
            sharing = self.resolve().sharing
            if sharing != pushed:
                apply(sharing)
                pushed = sharing

        self.watch.follow(step, stop, self.refresh_s)

    def _report(self, choice: SharingChoice) -> None:
        if choice.pool:
            line = (f"node {self.node}: {choice.sharing.describe()} from GpuPool {choice.pool} "
                    f"(generation {choice.generation})")
        else:
            line = f"node {self.node}: the flags' {choice.sharing.describe()}: {choice.why}"
        if line != self._logged:
            log.log(logging.WARNING if choice.invalid else logging.INFO, "%s", line)
            self._logged = line
