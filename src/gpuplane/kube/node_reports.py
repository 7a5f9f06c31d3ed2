"""What the node agent tells the operator about failures and health: core/v1 Events, built and read here.

The node agent (`gpuplane.node.reporter`) posts one core/v1 `Event` per finding, shaped as client-go's legacy
event recorder shapes them (`record.EventRecorder`): `metadata.name` `<object>.<hex nanoseconds>`, the
namespace of the object it is about (`default` for a Node, as the kubelet's node events), `involvedObject`
the Node (or the Pod whose container logged the evidence), `reason`, `message`, `type` `Warning` (a failure, a
failed check) or `Normal` (a passed check), `source.component`/`source.host`, `reportingComponent`/
`reportingInstance`, `firstTimestamp` = `lastTimestamp`, `count` 1. So `kubectl describe node` shows them.

What the operator needs beyond the text rides in the Event's own metadata: label `gpuplane.io/report`
(`failure` or `health`: the operator's informer selects on it), annotation `gpuplane.io/evidence` (the
evidence as JSON: each item's node, log line, Xid, exit code, signal, and the node's time `t` in epoch
seconds, which the Event's second-precision timestamps cannot carry), `gpuplane.io/observed-at` (when, the same
way), `gpuplane.io/verdict` (the node's
classifier: signature, action, class, blames-node) and, for health, `gpuplane.io/health-event` (the
`HealthEvent` a tier of checks yields). The operator re-classifies a failure from the evidence of every node
of the incident (`classify_incident`), so a node's verdict informs, it does not decide.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gpuplane.controllers.health import HealthEvent
from gpuplane.controllers.recovery import Evidence
from gpuplane.kube.api import JsonObject
from gpuplane.kube.events import core_event
from gpuplane.kube.objects import parse_time

REPORT_LABEL = "gpuplane.io/report"
EVIDENCE_ANNOTATION = "gpuplane.io/evidence"
VERDICT_ANNOTATION = "gpuplane.io/verdict"
HEALTH_EVENT_ANNOTATION = "gpuplane.io/health-event"
OBSERVED_ANNOTATION = "gpuplane.io/observed-at"
"""When the node saw it, epoch seconds (the Event's timestamps have whole seconds only)."""
COMPONENT = "gpuplane-node-agent"
EVENTS_PATH = "/api/v1/events"
"""Every namespace's core/v1 Events (the operator's informer lists this with `REPORT_LABEL` selected)."""

ReportKind = Literal["failure", "health"]


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One finding of one node agent."""

    kind: ReportKind
    node: str
    t: float
    reason: str
    message: str
    evidence: tuple[Evidence, ...] = ()
    health_event: HealthEvent | None = None
    verdict: Mapping[str, Any] | None = None
    pod: str | None = None
    """`namespace/name` of the pod whose container logged the evidence (None: about the node)."""
    key: str = ""
    """The Event's `namespace/name` once posted or read (empty before)."""

    @property
    def warning(self) -> bool:
        return self.kind == "failure" or self.health_event is not HealthEvent.CHECK_PASSED


def _evidence_json(item: Evidence) -> dict[str, Any]:
    line = item.line.decode("utf-8", "replace") if isinstance(item.line, bytes) else item.line
    doc = {"node": item.node, "line": line, "xid": item.xid, "exitCode": item.exit_code, "signal": item.signal,
           "t": item.t}
    return {k: v for k, v in doc.items() if v is not None}


def _evidence_of(doc: Mapping[str, Any]) -> Evidence:
    def opt_int(name: str) -> int | None:
        value = doc.get(name)
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    t = doc.get("t")
    line = doc.get("line")
    signal = doc.get("signal")
    return Evidence(str(doc["node"]), line=line if isinstance(line, str) else None, xid=opt_int("xid"),
                    exit_code=opt_int("exitCode"), signal=signal if isinstance(signal, str) else None,
                    t=float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None)


def report_event(report: NodeReport, host: str, *, seq: int = 0) -> JsonObject:
    """The core/v1 Event for `report` (see the module's docstring); `seq` keeps two Events of one nanosecond
    apart."""
    if report.pod is not None:
        namespace, name = report.pod.split("/", 1)
        involved: JsonObject = {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": name}
    else:
        involved = {"kind": "Node", "apiVersion": "v1", "name": report.node, "uid": report.node}
    annotations = {EVIDENCE_ANNOTATION: json.dumps([_evidence_json(e) for e in report.evidence]),
                   OBSERVED_ANNOTATION: repr(float(report.t))}
    if report.verdict is not None:
        annotations[VERDICT_ANNOTATION] = json.dumps(dict(report.verdict), sort_keys=True)
    if report.health_event is not None:
        annotations[HEALTH_EVENT_ANNOTATION] = report.health_event.value
    return core_event(involved, reason=report.reason, message=report.message, warning=report.warning,
                      component=COMPONENT, instance=host, host=report.node, t=report.t,
                      nanos=int(report.t * 1e9) + seq, labels={REPORT_LABEL: report.kind}, annotations=annotations)


def parse_report(obj: Mapping[str, Any]) -> NodeReport | None:
    """The report an Event carries; None for an Event that is not a node agent's report (or is malformed)."""
    meta = obj.get("metadata") or {}
    kind = (meta.get("labels") or {}).get(REPORT_LABEL)
    if kind not in ("failure", "health"):
        return None
    annotations = meta.get("annotations") or {}
    involved = obj.get("involvedObject") or {}
    try:
        raw = json.loads(annotations.get(EVIDENCE_ANNOTATION) or "[]")
        evidence = tuple(_evidence_of(doc) for doc in raw if isinstance(doc, Mapping))
        verdict = json.loads(annotations[VERDICT_ANNOTATION]) if VERDICT_ANNOTATION in annotations else None
        health = (HealthEvent(annotations[HEALTH_EVENT_ANNOTATION]) if HEALTH_EVENT_ANNOTATION in annotations
                  else None)
    except (ValueError, KeyError, TypeError):
        return None
    node = str((obj.get("source") or {}).get("host") or (evidence[0].node if evidence else involved.get("name", "")))
    if not node or (kind == "health" and health is None):
        return None
    pod = f"{involved.get('namespace')}/{involved.get('name')}" if involved.get("kind") == "Pod" else None
    try:
        t: float | None = float(annotations[OBSERVED_ANNOTATION])
    except (KeyError, ValueError):
        t = parse_time(obj.get("firstTimestamp"))
    return NodeReport(kind, node, float(t or 0.0), str(obj.get("reason") or ""), str(obj.get("message") or ""),
                      evidence, health, verdict if isinstance(verdict, Mapping) else None, pod,
                      f"{meta.get('namespace')}/{meta.get('name')}")


def reports_in_order(objects: Sequence[Mapping[str, Any]]) -> list[NodeReport]:
    """The node agents' reports among `objects`, oldest first (then by Event name)."""
    found = [r for r in (parse_report(o) for o in objects) if r is not None]
    return sorted(found, key=lambda r: (r.t, r.key))
