"""A node agent's view of its own node and of the custom resources that may apply to it.

`NodeWatch` keeps two informers: one on `/api/v1/nodes` narrowed to the node (`fieldSelector=metadata.name=<node>`,
so a 1,000-node cluster costs one small watch per node and no GET per refresh; RBAC cannot narrow a list to one
object, the field selector does), and one on a collection of objects (ColocationPolicies, GpuPools). A change of
either sets `changed`; `follow` calls a step at once after each change and at least every `refresh_s`. While the
node's watch is broken (or the node is gone), `node_labels` answers the labels last seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpuplane.kube.api import JsonObject, KubeApi, node_path
from gpuplane.kube.informer import Informer
from gpuplane.kube.objects import labels_of

__all__ = ["NodeWatch"]


class NodeWatch:
    """The node `node` and the objects under `path` (`name` names that informer in logs). Tests may inject
    either informer."""

    def __init__(self, api: KubeApi, node: str, path: str, *, name: str = "", informer: Informer | None = None,
                 node_informer: Informer | None = None) -> None:
        self.node = node
        self.changed = threading.Event()
        """Set on every change either informer brings (and by `stop`, to wake `follow`)."""
        self.informer = informer or Informer(api, path, name=name or path)
        self.node_informer = node_informer or Informer(api, node_path(), field_selector=f"metadata.name={node}",
                                                       name=f"node {node}")
        for informer_ in (self.informer, self.node_informer):
            informer_.add_handler(lambda *_: self.changed.set())
        self.labels: dict[str, str] | None = None
        """The node's labels as last seen (None: never seen)."""

    def start(self) -> None:
        self.informer.start()
        self.node_informer.start()

    def stop(self) -> None:
        self.changed.set()
        self.informer.stop()
        self.node_informer.stop()

    @property
    def has_synced(self) -> bool:
        """Whether both the objects and the node have been listed."""
        return self.informer.has_synced and self.node_informer.has_synced

    def wait_synced(self, timeout_s: float | None = None) -> bool:
        """Wait (at most `timeout_s` in all) for the first list of the objects and of the node."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for informer in (self.informer, self.node_informer):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not informer.wait_synced(left):
                return False
        return True

    @property
    def last_error(self) -> str:
        """The informers' last errors, for a log line."""
        return "; ".join(e for e in (self.informer.last_error, self.node_informer.last_error) if e)

    def node_labels(self) -> dict[str, str] | None:
        """The node's labels now, or as last seen while it is not in the cache; None before it has been seen."""
        node = self.node_informer.get(self.node)
        if node is not None:
            self.labels = dict(labels_of(node))
        return self.labels

    def objects(self) -> list[JsonObject]:
        return self.informer.objects()

    def follow(self, step: Callable[[], None], stop: threading.Event, refresh_s: float) -> None:
        """Until `stop` is set (and `stop()` called, to wake it): once both are listed, `step()` at once after each
        change and in any case every `refresh_s`."""
        while not stop.is_set():
            if not self.has_synced:
                self.wait_synced(refresh_s)
                continue
            self.changed.clear()
            step()
            self.changed.wait(refresh_s)
