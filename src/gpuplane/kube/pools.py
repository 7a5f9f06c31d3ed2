"""GpuPools in effect: which nodes each pool labels (the operator) and the scheduler's pool table (the extender).

Membership. A node belongs to pool P when it carries the label `gpuplane.io/pool: P`; the operator writes that
label on the nodes a valid GpuPool selects (`nodeSelector`, and a card model among the pool's `models`),
planned by `plan_pools`, a pure function of the valid pools and the nodes, so a second pass changes nothing and
a restarted operator plans the same labels. Per node:

- lent by the tidal controller (label `gpuplane.io/tidal-loan`): left alone; the loan owns its pool label.
- selected by one pool P: labelled P when it has no pool label, or one naming P or another valid GpuPool (that
  pool no longer selects it: it moves). A label naming anything else (set by hand, by the tidal controller on
  return, by an invalid GpuPool) is someone else's: left alone and reported in P's status.
- selected by two or more pools: a conflict. It gets none of them (its label, if any, stays as it is) and is
  reported in each of their statuses.
- selected by none: loses its label only when the label names a valid GpuPool (that pool let go of it).

A deleted or invalid GpuPool's labels stay where they are (the operator cannot tell its labels from someone
else's any more); remove them with `kubectl label nodes -l gpuplane.io/pool=<name> gpuplane.io/pool-`.

Pool table. The scheduler takes per-pool settings (`PoolConfig`) keyed by the pool label's value:
`pool_table` makes them from the GpuPool objects (`oversubscriptionRatio` → `memory_oversell`; the other
fields have no `PoolConfig` counterpart yet). Invalid GpuPools are skipped: their nodes get no oversell.
`PoolSync` keeps an extender's table current from an informer on GpuPools; `apply_pools` swaps the table and
rebuilds the scheduler's cache with it (which keeps the reservations of binds in flight).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from gpuplane.controllers.tidal import LOAN_LABEL
from gpuplane.kube.api import KubeApi
from gpuplane.kube.crds import GPU_POOL, GpuPoolSpec, ResourceError, parse_resource
from gpuplane.kube.extender import Extender
from gpuplane.kube.informer import Informer
from gpuplane.kube.objects import POOL_LABEL, object_key, selects
from gpuplane.model import Catalog, GpuplaneError, NodeSpec, PoolConfig

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ membership (the operator)
@dataclass(frozen=True, slots=True)
class PoolRule:
    """What a valid GpuPool selects: nodes with every label of `node_selector` and a card model in `models`."""

    node_selector: Mapping[str, str]
    models: frozenset[str]
    """Canonical catalog names."""

    @staticmethod
    def of(spec: GpuPoolSpec, catalog: Catalog) -> PoolRule:
        """Raises `CatalogError` for a model the catalog does not know (`parse_resource` checks it first)."""
        return PoolRule(dict(spec.node_selector), frozenset(catalog.canonical(m) for m in spec.models))

    def selects(self, node: NodeSpec) -> bool:
        if node.gpu_model is None or node.gpu_model not in self.models:
            return False
        return selects(self.node_selector, dict(node.labels))


@dataclass(slots=True)
class PoolReport:
    """One pool after the plan: its labelled nodes, and the nodes it selects but cannot have."""

    nodes: list[str] = field(default_factory=list)
    """Nodes the pool selects that carry its label once the plan is applied."""
    models: set[str] = field(default_factory=set)
    """Card models of those nodes."""
    overlapping: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Node → the other pools that select it too."""
    foreign: dict[str, str] = field(default_factory=dict)
    """Node → the pool label someone else set on it."""


@dataclass(frozen=True, slots=True)
class PoolPlan:
    changes: Mapping[str, str | None]
    """Node → the pool label to write (None: remove it). Only nodes whose label changes."""
    reports: Mapping[str, PoolReport]
    """Per pool (every pool planned, in name order)."""


def plan_pools(pools: Mapping[str, PoolRule], nodes: Iterable[NodeSpec]) -> PoolPlan:
    """The pool labels to write so that each node is in the one valid pool that selects it (rules above)."""
    reports = {name: PoolReport() for name in sorted(pools)}
    changes: dict[str, str | None] = {}
    for node in sorted(nodes, key=lambda n: n.name):
        labels = dict(node.labels)
        if LOAN_LABEL in labels:
            continue
        current = labels.get(POOL_LABEL)
        matching = [name for name in reports if pools[name].selects(node)]
        target = current
        if len(matching) > 1:
            for name in matching:
                reports[name].overlapping[node.name] = tuple(m for m in matching if m != name)
        elif len(matching) == 1:
            name = matching[0]
            if current is None or current in pools:
                target = name
            else:
                reports[name].foreign[node.name] = current
        elif current is not None and current in pools:
            target = None
        if target != current:
            changes[node.name] = target
        if target is not None and target in matching:
            reports[target].nodes.append(node.name)
            if node.gpu_model is not None:
                reports[target].models.add(node.gpu_model)
    return PoolPlan(changes, reports)


def _listing(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def conflict_message(report: PoolReport) -> str:
    """What keeps nodes the pool selects out of it, naming the nodes; empty when nothing does."""
    parts = []
    by_others: dict[tuple[str, ...], list[str]] = {}
    for node, others in report.overlapping.items():
        by_others.setdefault(others, []).append(node)
    for others, names in sorted(by_others.items()):
        parts.append(f"nodes {_listing(names)} are also selected by GpuPool {', '.join(others)}: "
                     "labelled for neither")
    by_label: dict[str, list[str]] = {}
    for node, label in report.foreign.items():
        by_label.setdefault(label, []).append(node)
    for label, names in sorted(by_label.items()):
        parts.append(f"nodes {_listing(names)} carry {POOL_LABEL}={label}, which no valid GpuPool manages: "
                     "left as they are")
    return "; ".join(parts)


# ------------------------------------------------------------------ the pool table (the extender)
def pool_table(objects: Iterable[Mapping[str, Any]], catalog: Catalog
               ) -> tuple[dict[str, PoolConfig], dict[str, str]]:
    """(pool name → `PoolConfig` of each valid GpuPool, pool name → why it is invalid)."""
    table: dict[str, PoolConfig] = {}
    invalid: dict[str, str] = {}
    for obj in objects:
        name = object_key(obj) or "?"
        try:
            resource = parse_resource(obj, catalog)
            spec = resource.spec
            if not isinstance(spec, GpuPoolSpec):
                raise ResourceError(name, "kind", f"not a GpuPool ({resource.kind.kind})")
            table[resource.name] = PoolConfig(memory_oversell=spec.oversubscription_ratio)
        except GpuplaneError as exc:
            invalid[name] = str(exc)
    return table, invalid


def apply_pools(extender: Extender, pools: Mapping[str, PoolConfig], *,
                subscribe_lock: AbstractContextManager[Any] | None = None) -> bool:
    """Give the extender's scheduler `pools` and rebuild its cache with them; False when they are already its
    table. Binds in flight keep their reservations where they still fit (`Scheduler.resync`).

    `subscribe_lock` is the port's event-delivery lock (`KubeCluster.lock`), so no event falls between the
    lists and the rebuilt cache; locks are taken in the extender's order (port, subscribe, state)."""
    with extender.port_lock, subscribe_lock or nullcontext(), extender.state_lock:
        scheduler = extender.scheduler
        if dict(scheduler.pools or {}) == dict(pools):
            return False
        scheduler.pools = dict(pools)
        scheduler.resync()
    log.info("pool table: %s", ", ".join(f"{k} (memory ×{v.memory_oversell:g})" for k, v in sorted(pools.items()))
             or "none")
    return True


class PoolSync:
    """Keeps an extender's pool table equal to the valid GpuPools: an informer on `gpupools` marks the table
    stale on each change, and a worker thread rebuilds it and, when it differs, the scheduler's cache
    (`apply_pools`); one thread applies, so tables are applied in the order the GpuPools changed. Invalid
    GpuPools are logged (once per distinct error) and skipped. The API not answering (no CRD, no RBAC) is
    logged by the informer, which keeps retrying; until it answers the table is empty (no oversell)."""

    def __init__(self, api: KubeApi, catalog: Catalog, extender: Extender, *,
                 subscribe_lock: AbstractContextManager[Any] | None = None, watch_timeout_s: int = 300) -> None:
        self.catalog = catalog
        self.extender = extender
        self.subscribe_lock = subscribe_lock
        self.informer = Informer(api, GPU_POOL.path(), watch_timeout_s=watch_timeout_s, name="gpupools")
        self.invalid: dict[str, str] = {}
        """Pool name → why it is invalid, as of the last refresh."""
        self.applied = 0
        """Tables applied (changes of the scheduler's pool table)."""
        self._stale = threading.Event()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self.informer.add_handler(lambda event_type, old, new: self._stale.set())

    def start(self, sync_timeout_s: float = 10.0) -> bool:
        """Start watching; apply the first list before returning if it answers within the timeout (else
        False, at once if the list failed: the worker applies it when a retry succeeds)."""
        self.informer.start()
        deadline = time.monotonic() + sync_timeout_s
        while not (synced := self.informer.wait_synced(0.02)):
            if self.informer.last_error or time.monotonic() >= deadline:
                break
        if synced:
            self._stale.clear()
            self.refresh()
        else:
            log.warning("GpuPools could not be listed within %.0f s (%s); starting without pools",
                        sync_timeout_s, self.informer.last_error or "no answer")
        self._worker = threading.Thread(target=self._run, name="gpupools sync", daemon=True)
        self._worker.start()
        return synced

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._stale.set()
        self.informer.stop(timeout_s=0)
        if self._worker is not None:
            self._worker.join(timeout_s)

    def refresh(self) -> bool:
        """Rebuild the table from the informer's cache and apply it; whether the scheduler's table changed."""
        table, invalid = pool_table(self.informer.objects(), self.catalog)
        for name, why in sorted(invalid.items()):
            if self.invalid.get(name) != why:
                log.warning("GpuPool %s is invalid, skipped (its nodes get no oversell): %s", name, why)
        self.invalid = invalid
        changed = apply_pools(self.extender, table, subscribe_lock=self.subscribe_lock)
        self.applied += changed
        return changed

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._stale.wait()
            if self._stopping.is_set():
                break
            if not self.informer.wait_synced(1.0):
                continue  # changes before the first complete list: apply the whole list once it is in
            self._stale.clear()
            try:
                self.refresh()
            except Exception:  # a bad table must not end the sync; the next change retries
                log.exception("applying the GpuPools failed")
