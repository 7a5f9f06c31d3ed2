"""RDMA networks: the Multus attachment that puts the pod on the NIC the scheduler chose.

The scheduler picks one RDMA NIC (a physical function, PF) near the pod's cards and a number of virtual
functions (VFs) on it (`Assignment.rdma`). At bind it names that PF's network in the pod's Multus annotation
`k8s.v1.cni.cncf.io/networks`, one selection element per VF, in the same merge PATCH as the card assignment.
The network of PF `<pf>` is the NetworkAttachmentDefinition `gpuplane-rdma-<pf>` in one namespace
(`gpuplane-system` by default), as shipped in `deploy/rdma/`.

Why this works on a real cluster (docs/kubernetes.md, "RDMA networks"): a pod's resource requests cannot
change after creation, so the pod asks for `gpuplane.io/rdma-vf` (any PF) when it is created, and the VF of
the chosen PF is steered by gpuplane's node agent (`gpuplane.node.rdma`); annotations can still change until
the pod's sandbox is created, after binding, which is when Multus reads this one. Multus takes the VF's PCI
address from kubelet's PodResources for the resource the network's `k8s.v1.cni.cncf.io/resourceName` names
(`gpuplane.io/rdma-vf`), one device per listed element, and hands it to the SR-IOV CNI; the per-PF network
picks the PF's IP pool.

Selection elements follow the Network Plumbing WG type `NetworkSelectionElement` (network-attachment-definition-
client `pkg/apis/k8s.cni.cncf.io/v1/types.go`): `name`, `namespace`, `interface`, `ips`, `mac`, ... . It has no
`deviceID`; Multus's own copy of the type does, but Multus uses it only when the network names no resourceName
(`LoadDelegateNetConf`), so gpuplane never writes it. The annotation is read as Multus reads it
(`parsePodNetworkAnnotation`): JSON when it contains `[`, `{` or `"`, else a comma-separated list of
`[<namespace>/]<name>[@<interface>]`. A user's own networks are kept, in their order, before gpuplane's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuplane.kube.objects import RES_RDMA, ObjectError
from gpuplane.model import RdmaNic, RdmaShare

NETWORKS = "k8s.v1.cni.cncf.io/networks"
"""Pod annotation: the networks Multus attaches (section 4.1.2 of the Network Plumbing WG specification)."""
RESOURCE_NAME = "k8s.v1.cni.cncf.io/resourceName"
"""NetworkAttachmentDefinition annotation: the device plugin resource whose devices the network consumes."""
DEFAULT_NAMESPACE = "gpuplane-system"
DEFAULT_PREFIX = "gpuplane-rdma-"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_IFNAMSIZ = 16  # Linux interface names are at most 15 bytes (Multus checks the same)


def _field() -> str:
    return f"metadata.annotations[{NETWORKS}]"


def parse_networks(raw: str, obj: str = "pod") -> list[dict[str, Any]]:
    """The selection elements of a `k8s.v1.cni.cncf.io/networks` value, as Multus parses it.

    Comma-separated items become `{"name", "namespace"?, "interface"?}`; JSON elements are kept as written.
    `ObjectError` naming the annotation on a value Multus would refuse.
    """
    if not raw.strip():
        return []
    if any(c in raw for c in '[{"'):
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ObjectError(obj, _field(), f"not a JSON list of network selection elements ({exc})") from None
        if not isinstance(doc, list):
            raise ObjectError(obj, _field(), "JSON form must be a list of network selection elements")
        for i, given in enumerate(doc):
            if not isinstance(given, dict) or not isinstance(given.get("name"), str) or not given["name"]:
                raise ObjectError(obj, f"{_field()}[{i}]", "needs a non-empty string 'name'")
        return doc
    elements: list[dict[str, Any]] = []
    for i, item in enumerate(raw.split(",")):
        namespace, slash, rest = item.strip().rpartition("/")
        if slash and "/" in namespace:
            raise ObjectError(obj, f"{_field()}[{i}]", f"{item.strip()!r}: more than one '/'")
        name, _, interface = rest.partition("@")
        name, namespace, interface = name.strip(), namespace.strip(), interface.strip()
        if "@" in interface:
            raise ObjectError(obj, f"{_field()}[{i}]", f"{item.strip()!r}: more than one '@'")
        for part in (namespace, name) if namespace else (name,):
            if not _DNS_LABEL.match(part):
                raise ObjectError(obj, f"{_field()}[{i}]", f"{part!r} is not a DNS-1123 label")
        if interface and (len(interface) >= _IFNAMSIZ or any(c in interface for c in " \t\n\v\f\r/")):
            raise ObjectError(obj, f"{_field()}[{i}]", f"interface {interface!r}: at most 15 characters, "
                                                       "no '/' or spaces")
        element: dict[str, Any] = {"name": name}
        if namespace:
            element["namespace"] = namespace
        if interface:
            element["interface"] = interface
        elements.append(element)
    return elements


@dataclass(frozen=True, slots=True)
class RdmaNetworks:
    """How a PF's network is named: `<prefix><pf>` in `namespace`.

    `pf` is the NIC's name in the node inventory (`NodeInventory.nics`): the PF's Linux interface name, the name
    the SR-IOV device plugin's `pfNames` selector and the node agent use. Lower-cased, with every character
    outside `[a-z0-9-]` as `-`.
    """

    namespace: str = DEFAULT_NAMESPACE
    prefix: str = DEFAULT_PREFIX
    resource: str = RES_RDMA
    """What the pods request and each network's `k8s.v1.cni.cncf.io/resourceName` names."""

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.namespace):
            raise ValueError(f"RDMA network namespace {self.namespace!r} is not a DNS-1123 label")
        if not re.match(r"^[a-z0-9][-a-z0-9]*$", self.prefix):
            raise ValueError(f"RDMA network prefix {self.prefix!r}: lower-case letters, digits and '-' only")

    def name(self, pf: str) -> str:
        """The NetworkAttachmentDefinition name of PF `pf`; ValueError if it cannot be a DNS-1123 label."""
        name = self.prefix + re.sub(r"[^a-z0-9-]", "-", pf.lower())
        if not _DNS_LABEL.match(name) or len(name) > 63:
            raise ValueError(f"NIC {pf!r}: network name {name!r} is not a DNS-1123 label (63 characters at most)")
        return name

    def ours(self, element: Mapping[str, Any], pod_namespace: str) -> bool:
        """Whether a selection element names one of gpuplane's RDMA networks."""
        namespace = element.get("namespace") or pod_namespace
        return namespace == self.namespace and str(element.get("name", "")).startswith(self.prefix)

    def elements(self, pf: str, vfs: int) -> list[dict[str, Any]]:
        """One selection element per VF: Multus hands each listed element the next device of the resource."""
        return [{"name": self.name(pf), "namespace": self.namespace} for _ in range(vfs)]

    def annotate(self, existing: str | None, pf: str, vfs: int, *, pod_namespace: str, obj: str = "pod") -> str:
        """The `k8s.v1.cni.cncf.io/networks` value after a bind to `vfs` VFs of PF `pf`, in JSON form.

        The user's elements stay first, in order (comma-separated ones as their equivalent JSON); gpuplane's
        elements from an earlier bind are replaced, so binding again never lists a network twice.
        """
        kept = [e for e in parse_networks(existing or "", obj) if not self.ours(e, pod_namespace)]
        return json.dumps(kept + self.elements(pf, vfs), separators=(",", ":"))


def rdma_annotations(networks: RdmaNetworks, annotations: Mapping[str, str], pod: str, nics: Sequence[RdmaNic],
                     share: RdmaShare) -> dict[str, str]:
    """What a bind adds to pod `pod` (`namespace/name`, its current `annotations`) for RDMA share `share` on a
    node with NICs `nics`. ValueError (an `ObjectError` for the pod's annotation) naming what is wrong."""
    if not 0 <= share.nic < len(nics):
        raise ValueError(f"pod {pod}: RDMA NIC {share.nic} assigned, the node has {len(nics)}")
    namespace = pod.partition("/")[0] or "default"
    return {NETWORKS: networks.annotate(annotations.get(NETWORKS), nics[share.nic].name, share.vfs,
                                        pod_namespace=namespace, obj=f"pod {pod}")}
