"""Cards held by other GPU stacks: the node annotation the node agent writes and the codec reads.

Another stack's pods can hold a node's cards beside gpuplane: the NVIDIA device plugin's `nvidia.com/gpu` (also
its time-slicing replicas `<uuid>::<n>` and, with MIG, `nvidia.com/mig-*` devices named by MIG UUID), KAI's GPU
sharing (its reservation pods ask `nvidia.com/gpu`), and DRA claims of the NVIDIA DRA driver (`gpu.nvidia.com`).
The node agent reads what each container holds from kubelet's PodResources API (`gpuplane.node.podresources`),
maps it to card indexes and publishes it here; the codec (`objects.node_spec`) turns it into
`NodeSpec.foreign_cards`, which `ClusterState` counts as fully taken.

Annotation `gpuplane.io/foreign-cards` (JSON, written only when it changes):

    {"cards": [{"index": 0, "pods": ["ml/train-0"], "resources": ["nvidia.com/gpu"]}],
     "unmapped": [{"pod": "ml/x", "resource": "nvidia.com/gpu", "device": "GPU-unknown"}]}

`unmapped` lists GPU devices of a known foreign GPU resource or driver that match none of the node's cards (a card
the node agent cannot see, a DRA device named in a way it does not know): the codec then counts every card of the
node as held, since it cannot tell which one is.

The safety net (`holds_unreported`): a node whose allocatable offers a foreign GPU resource (`nvidia.com/gpu`,
`nvidia.com/mig-*`, …) has another GPU stack beside gpuplane; until its node agent has published a report, the codec
counts all of its cards as held, so no card is promised twice while the report is missing. A node whose other
stack is DRA alone offers no such resource: it is covered from the agent's first report on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from gpuplane.kube.api import JsonObject

__all__ = [
    "DRA_GPU_DRIVERS", "FOREIGN_CARDS", "FOREIGN_GPU_PREFIXES", "ForeignHold", "ForeignReport", "UnmappedDevice",
    "foreign_gpu_resource", "holds_unreported",
]

FOREIGN_CARDS = "gpuplane.io/foreign-cards"
FOREIGN_GPU_PREFIXES = ("nvidia.com/",)
"""Extended resources of other GPU stacks (the NVIDIA device plugin's `nvidia.com/gpu`, `nvidia.com/gpu.shared`,
`nvidia.com/mig-<profile>`; KAI's reservation pods ask `nvidia.com/gpu`). gpuplane's own `gpuplane.io/*` are never
foreign."""
DRA_GPU_DRIVERS = ("gpu.nvidia.com",)
"""DRA drivers whose devices are GPUs (the NVIDIA DRA driver: devices `gpu-<minor>`, `gpu-<minor>-mig-…`)."""


def foreign_gpu_resource(resource: str) -> bool:
    """Whether `resource` is another stack's GPU resource."""
    return resource.startswith(FOREIGN_GPU_PREFIXES)


@dataclass(frozen=True, slots=True)
class ForeignHold:
    """One card and who holds it: pods as `namespace/name`, the resources or DRA drivers they hold it through."""

    index: int
    pods: tuple[str, ...]
    resources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class UnmappedDevice:
    pod: str
    resource: str
    device: str


@dataclass(frozen=True, slots=True)
class ForeignReport:
    """What the node agent found other stacks holding (`holds` sorted by card, `unmapped` sorted)."""

    holds: tuple[ForeignHold, ...] = ()
    unmapped: tuple[UnmappedDevice, ...] = ()

    def cards(self, gpus: int) -> frozenset[int]:
        """The cards gpuplane must count as taken on a node of `gpus` cards: all of them when a device is unmapped
        or a hold names a card the node's inventory does not have (the two reports disagree: trust neither)."""
        held = frozenset(h.index for h in self.holds)
        if self.unmapped or any(c >= gpus for c in held):
            return frozenset(range(gpus))
        return held

    def encode(self) -> str:
        doc: JsonObject = {"cards": [{"index": h.index, "pods": list(h.pods), "resources": list(h.resources)}
                                     for h in self.holds]}
        if self.unmapped:
            doc["unmapped"] = [{"pod": u.pod, "resource": u.resource, "device": u.device} for u in self.unmapped]
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @staticmethod
    def decode(raw: str) -> ForeignReport:
        """Raises ValueError saying what is wrong."""
        try:
            doc = json.loads(raw)
            holds = tuple(ForeignHold(_index(c["index"]), tuple(str(p) for p in c.get("pods") or ()),
                                      tuple(str(r) for r in c.get("resources") or ()))
                          for c in doc["cards"])
            unmapped = tuple(UnmappedDevice(str(u["pod"]), str(u["resource"]), str(u["device"]))
                             for u in doc.get("unmapped") or ())
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a foreign-cards report ({exc!r})") from None
        indexes = [h.index for h in holds]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"a card is listed twice in {indexes}")
        return ForeignReport(tuple(sorted(holds, key=lambda h: h.index)), tuple(sorted(unmapped, key=_unmapped_key)))


def _index(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"card index must be a non-negative integer, got {value!r}")
    return value


def _unmapped_key(u: UnmappedDevice) -> tuple[str, str, str]:
    return u.pod, u.resource, u.device


def holds_unreported(allocatable: Mapping[str, str]) -> bool:
    """Whether a node without a report must count all its cards as held: its allocatable offers a foreign GPU
    resource (any amount but a literal 0)."""
    return any(foreign_gpu_resource(name) and str(value).strip() not in ("0", "")
               for name, value in allocatable.items())
