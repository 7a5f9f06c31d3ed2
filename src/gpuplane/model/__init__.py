"""The resource model: card catalog, nodes, requests, assignments and the cluster's free capacity.

The lowest layer: it imports nothing else from gpuplane.
"""

from gpuplane.model.assignment import Assignment, CardShare, RdmaLocality, RdmaShare
from gpuplane.model.catalog import (
    MILLI_PER_CARD,
    CardModel,
    Catalog,
    MigProfile,
    VgpuPackage,
    default_catalog,
)
from gpuplane.model.cluster import Binding, ClusterState, MigInstance, PoolConfig
from gpuplane.model.errors import (
    CatalogError,
    GpuplaneError,
    NodeSpecError,
    PlacementError,
    RequestError,
)
from gpuplane.model.node import MigMode, NodeSpec, RdmaNic, Taint, Topology
from gpuplane.model.priority import (
    PreemptionPolicy,
    PriorityClass,
    PriorityClasses,
    default_priority_classes,
    load_priority_classes,
)
from gpuplane.model.quota import ModelQuota, QueueQuota, QuotaError, Quotas, canonical_models, load_quotas
from gpuplane.model.request import (
    FILTER_EFFECTS,
    UNSCHEDULABLE_TAINT,
    Fraction,
    GpuForm,
    MigSlice,
    NodeSelectorTerm,
    PodRequest,
    PreferredTerm,
    QoS,
    Requirement,
    SelectorOp,
    Toleration,
    WholeCards,
    make_request,
    parse_int64,
)

__all__ = [
    "FILTER_EFFECTS",
    "MILLI_PER_CARD",
    "UNSCHEDULABLE_TAINT",
    "Assignment",
    "Binding",
    "CardModel",
    "CardShare",
    "Catalog",
    "CatalogError",
    "ClusterState",
    "Fraction",
    "GpuForm",
    "GpuplaneError",
    "MigInstance",
    "MigMode",
    "MigProfile",
    "MigSlice",
    "ModelQuota",
    "NodeSelectorTerm",
    "NodeSpec",
    "NodeSpecError",
    "PlacementError",
    "PodRequest",
    "PoolConfig",
    "PreemptionPolicy",
    "PreferredTerm",
    "PriorityClass",
    "PriorityClasses",
    "QoS",
    "QueueQuota",
    "QuotaError",
    "Quotas",
    "RdmaLocality",
    "RdmaNic",
    "RdmaShare",
    "RequestError",
    "Requirement",
    "SelectorOp",
    "Taint",
    "Toleration",
    "Topology",
    "VgpuPackage",
    "WholeCards",
    "canonical_models",
    "default_catalog",
    "default_priority_classes",
    "load_priority_classes",
    "load_quotas",
    "make_request",
    "parse_int64",
]
