"""core/v1 Events as client-go's legacy event recorder (`record.EventRecorder`, `makeEvent`) builds them.

`metadata.name` `<object>.<hex nanoseconds>` in the namespace of the object the Event is about (`default` for a
cluster-scoped object such as a Node, as the kubelet's node events), `involvedObject` the object's reference,
`reason`, `message`, `type` `Normal` or `Warning`, `source.component`/`source.host` and their newer twins
`reportingComponent`/`reportingInstance`, `firstTimestamp` = `lastTimestamp` and `count` 1 (the recorder's
client-side aggregation into a series is not done). `kubectl describe` lists them under the object.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuplane.kube.api import JsonObject
from gpuplane.kube.objects import format_time

MESSAGE_LIMIT = 1024
"""A longer message is cut, with an ellipsis (the events.k8s.io `note` limit; client-go truncates there too)."""


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/events"


def core_event(involved: JsonObject, *, reason: str, message: str, warning: bool, component: str, instance: str,
               host: str, t: float, nanos: int, labels: Mapping[str, str] | None = None,
               annotations: Mapping[str, str] | None = None) -> JsonObject:
    """The core/v1 Event about `involved` (an object reference: kind, apiVersion, name, and namespace, uid,
    resourceVersion where it has them) at `t` (epoch seconds; `nanos` names it, unique per recorder)."""
    namespace = involved.get("namespace") or "default"
    metadata: JsonObject = {"name": f"{involved['name']}.{nanos:x}", "namespace": namespace}
    if labels:
        metadata["labels"] = dict(labels)
    if annotations:
        metadata["annotations"] = dict(annotations)
    stamp = format_time(t)
    return {
        "apiVersion": "v1", "kind": "Event", "metadata": metadata,
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT - 1] + "…",
        "type": "Warning" if warning else "Normal",
        "source": {"component": component, "host": host},
        "reportingComponent": component, "reportingInstance": instance,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
