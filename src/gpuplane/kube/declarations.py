"""What users declare for gpuplane-scheduler: gangs (PodGroups), queues (Queues) and pool quotas (GpuPools).

Accepted conventions, exactly:

- **Gangs**: the scheduler-plugins PodGroup (`scheduling.x-k8s.io/v1alpha1`, namespaced), named by the pod
  label `scheduling.x-k8s.io/pod-group`: `spec.minMember` is the gang size, `spec.scheduleTimeoutSeconds` how
  long its first member waits for the others. `spec.minResources` is validated and not applied: the gang is
  placed all or nothing on its members' own requests, which is what it would guard. A pod may instead carry
  the annotation `gpuplane.io/gang-size` (the codec reads it; no PodGroup needed).
- **Queues**: the `Queue` resource (`gpuplane.io/v1alpha1`, cluster-scoped, `gpuplane.kube.crds.QueueSpec`),
  named by the pod label `gpuplane.io/queue`.
- **Pool quotas**: a valid GpuPool with a `quota` is the queue named after the pool; pods that name no queue
  and select that one pool (`nodeSelector` `gpuplane.io/pool`) count against it (`with_pool_queue`). A Queue
  of the same name wins, and the pool is reported.

Not accepted (documented in docs/kubernetes.md): Volcano's PodGroup (`scheduling.volcano.sh`), KAI's and
Kueue's pod groups; their other fields (queues, task minimums, admission) have no exact meaning here.

Invalid objects are logged once per distinct error, naming the field, and kept in `invalid`; a pod whose
PodGroup is invalid or missing waits (`gang_size` is None). Informer handlers never read another informer
(each holds its own lock while its handlers run): each keeps its objects here, parsed once per change.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuplane.kube.api import JsonObject, KubeApi
from gpuplane.kube.crds import GPU_POOL, QUEUE, GpuPoolSpec, QueueSpec, ResourceError, _error, parse_resource
from gpuplane.kube.informer import DELETED, Informer
from gpuplane.kube.objects import object_key
from gpuplane.model import Catalog, PodRequest
from gpuplane.model.quota import QueueQuota, Quotas

log = logging.getLogger(__name__)

POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"
POD_GROUP_PATH = "/apis/scheduling.x-k8s.io/v1alpha1/podgroups"


class PodGroupSpec(BaseModel):
    """scheduler-plugins' PodGroupSpec (apis/scheduling/v1alpha1/types.go)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    min_member: int = Field(alias="minMember", ge=1, le=2**31 - 1)
    min_resources: dict[str, str | int] = Field(default_factory=dict, alias="minResources")
    schedule_timeout_seconds: int | None = Field(default=None, alias="scheduleTimeoutSeconds", ge=0, le=2**31 - 1)


@dataclass(frozen=True, slots=True)
class PodGroup:
    namespace: str
    name: str
    min_member: int
    timeout_s: float | None
    """None: the scheduler's default gang timeout (scheduler-plugins' 0 and unset both mean the default)."""
    min_resources: bool


def parse_pod_group(obj: Mapping[str, Any]) -> PodGroup:
    """Validate a PodGroup; `ResourceError` names the field (`spec.minMember: ...`)."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    name, namespace = str(meta.get("name") or ""), str(meta.get("namespace") or "")
    label = f"PodGroup/{namespace}/{name}"
    if obj.get("apiVersion") != POD_GROUP_API:
        raise ResourceError(label, "apiVersion", f"must be {POD_GROUP_API}, got {obj.get('apiVersion')!r}")
    if not name or not namespace:
        raise ResourceError(label, "metadata", "a PodGroup needs a name and a namespace")
    spec_obj = obj.get("spec")
    if not isinstance(spec_obj, Mapping) or "minMember" not in spec_obj:
        # upstream's minMember is omitempty: unset is 0, a gang nobody can complete
        raise ResourceError(label, "spec.minMember", "missing: the gang size must be at least 1")
    try:
        spec = PodGroupSpec.model_validate_json(json.dumps(spec_obj))
    except ValidationError as exc:
        field, message = _error(exc, ["spec"])
        raise ResourceError(label, field.replace("min_member", "minMember"), message) from None
    timeout = spec.schedule_timeout_seconds
    return PodGroup(namespace, name, spec.min_member, float(timeout) if timeout else None, bool(spec.min_resources))


def with_pool_queue(request: PodRequest, quotas: Quotas) -> PodRequest:
    """`request` counted against its pool's queue when it names no queue and selects exactly one pool that has
    a quota (a queue of the pool's name)."""
    if request.queue is not None or request.pools is None or len(request.pools) != 1:
        return request
    (pool,) = request.pools
    return replace(request, queue=pool) if pool in quotas else request


class Declarations:
    """Gangs, queues and pool quotas from the API, kept current by informers.

    `on_change` callbacks run on an informer's thread after any change to what `quotas()` or `gang_size()`
    answer; they must not block for long (the informer waits).
    """

    def __init__(self, api: KubeApi, catalog: Catalog, *, watch_timeout_s: int = 300) -> None:
        self.catalog = catalog
        self._lock = threading.Lock()
        self._queues: dict[str, QueueQuota] = {}
        self._pools: dict[str, QueueQuota] = {}
        self._groups: dict[str, PodGroup] = {}
        self._quotas = Quotas()
        self.invalid: dict[str, str] = {}
        """`Kind/key` → why the object is invalid (or, for a GpuPool, why its quota is not applied)."""
        self._callbacks: list[Callable[[], None]] = []
        self.informers = {
            "queues": Informer(api, QUEUE.path(), watch_timeout_s=watch_timeout_s, name="queues"),
            "gpupools": Informer(api, GPU_POOL.path(), watch_timeout_s=watch_timeout_s, name="gpupools"),
            "podgroups": Informer(api, POD_GROUP_PATH, watch_timeout_s=watch_timeout_s, name="podgroups"),
        }
        self.informers["queues"].add_handler(lambda t, old, new: self._changed(self._queue, t, old, new))
        self.informers["gpupools"].add_handler(lambda t, old, new: self._changed(self._pool, t, old, new))
        self.informers["podgroups"].add_handler(lambda t, old, new: self._changed(self._group, t, old, new))

    # ------------------------------------------------------------------ control
    def start(self, sync_timeout_s: float = 30.0) -> bool:
        """Start the informers and wait for their first lists; False if one has not answered in time (logged;
        it keeps retrying, and what it lists later is applied then)."""
        for informer in self.informers.values():
            informer.start()
        deadline = time.monotonic() + sync_timeout_s
        synced = True
        for informer in self.informers.values():
            if not informer.wait_synced(max(0.0, deadline - time.monotonic())):
                log.warning("%s could not be listed within %.0f s (%s)", informer.name, sync_timeout_s,
                            informer.last_error or "no answer")
                synced = False
        return synced

    def stop(self, timeout_s: float = 5.0) -> None:
        for informer in self.informers.values():
            informer.stop(timeout_s=0)
        for informer in self.informers.values():
            informer.stop(timeout_s=timeout_s)

    def on_change(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    # ------------------------------------------------------------------ answers
    def quotas(self) -> Quotas:
        """The valid Queues, and the valid GpuPools' quotas as queues of their names."""
        with self._lock:
            return self._quotas

    def gang_size(self, namespace: str, group: str) -> int | None:
        """`minMember` of the PodGroup `namespace/group`; None while it is unknown or invalid (its pods wait)."""
        with self._lock:
            found = self._groups.get(f"{namespace}/{group}")
        return found.min_member if found is not None else None

    def gang_timeout_s(self, namespace: str, group: str) -> float | None:
        """The PodGroup's `scheduleTimeoutSeconds`; None: unknown, or the scheduler's default applies."""
        with self._lock:
            found = self._groups.get(f"{namespace}/{group}")
        return found.timeout_s if found is not None else None

    def gang_timeouts(self) -> dict[str, float]:
        """`namespace/group` → scheduleTimeoutSeconds of each PodGroup that sets one (for
        `SchedulingRules.gang_timeouts`)."""
        with self._lock:
            return {key: g.timeout_s for key, g in self._groups.items() if g.timeout_s is not None}

    def with_pool_queue(self, request: PodRequest) -> PodRequest:
        return with_pool_queue(request, self.quotas())

    # ------------------------------------------------------------------ changes
    def _changed(self, apply: Callable[[str, JsonObject | None], bool], event_type: str, old: JsonObject | None,
                 new: JsonObject | None) -> None:
        obj = old if new is None else new
        assert obj is not None
        key = object_key(obj)
        with self._lock:
            changed = apply(key, None if event_type == DELETED else new)
            callbacks = list(self._callbacks) if changed else []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one subscriber's failure must not end the informer's delivery
                log.exception("a declarations subscriber failed")

    def _report(self, what: str, error: str | None) -> None:
        if error is None:
            self.invalid.pop(what, None)
        elif self.invalid.get(what) != error:
            self.invalid[what] = error
            log.warning("%s: %s", what, error)

    def _queue(self, key: str, obj: JsonObject | None) -> bool:
        return self._quota_from(self._queues, f"Queue/{key}", key, obj, self._queue_quota, "invalid, not applied")

    def _pool(self, key: str, obj: JsonObject | None) -> bool:
        return self._quota_from(self._pools, f"GpuPool/{key}", key, obj, self._pool_quota,
                                "invalid, its quota is not applied")

    def _queue_quota(self, obj: JsonObject) -> QueueQuota:
        resource = parse_resource(obj, self.catalog)
        assert isinstance(resource.spec, QueueSpec)
        return resource.spec.quota(resource.name, self.catalog)

    def _pool_quota(self, obj: JsonObject) -> QueueQuota | None:
        resource = parse_resource(obj, self.catalog)
        assert isinstance(resource.spec, GpuPoolSpec)
        q = resource.spec.quota
        return None if q is None else QueueQuota(resource.name, float(q.min_gpus),
                                                 None if q.max_gpus is None else float(q.max_gpus))

    def _quota_from(self, table: dict[str, QueueQuota], what: str, key: str, obj: JsonObject | None,
                    parse: Callable[[JsonObject], QueueQuota | None], invalid: str) -> bool:
        """Keep `obj`'s quota (None: deleted, invalid or without one) in `table`; whether quotas() changed."""
        quota: QueueQuota | None = None
        error: str | None = None
        if obj is not None:
            try:
                quota = parse(obj)
            except ResourceError as exc:
                error = f"{invalid}: {exc}"
        self._report(what, error)
        if quota is None:
            table.pop(key, None)
        else:
            table[key] = quota
        return self._rebuild()

    def _rebuild(self) -> bool:
        queues = dict(self._queues)
        for name, quota in self._pools.items():
            shadowed = name in queues
            self._report(f"GpuPool/{name}", f"spec.quota: not applied: the Queue {name} is defined and wins"
                         if shadowed else None)
            if not shadowed:
                queues[name] = quota
        quotas = Quotas(queues[name] for name in sorted(queues))
        if quotas == self._quotas:
            return False
        self._quotas = quotas
        return True

    def _group(self, key: str, obj: JsonObject | None) -> bool:
        before = self._groups.get(key)
        group: PodGroup | None = None
        error: str | None = None
        if obj is not None:
            try:
                group = parse_pod_group(obj)
            except ResourceError as exc:
                error = f"invalid, its pods wait: {exc}"
        self._report(f"PodGroup/{key}", error)
        if group is None:
            self._groups.pop(key, None)
        else:
            if group.min_resources and (before is None or not before.min_resources):
                log.info("PodGroup/%s: spec.minResources is not applied (the gang is placed all or nothing on its "
                         "members' own requests)", key)
            self._groups[key] = group
        return before != group
