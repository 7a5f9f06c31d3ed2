"""Scores from the pod's node constraints, as kube-scheduler's default profile has them: preferred node affinity
(`NodeAffinityScore`, NodeAffinity's Score) and PreferNoSchedule taints (`TaintTolerationScore`).

Both give every node 0 when they have no preference to express (no preferred terms, no PreferNoSchedule taint the
pod does not tolerate), so the weighted sum, the ties and every random draw are exactly as without them; they say so
(`NeutralScore.neutral`) and the framework skips them.
"""

from __future__ import annotations

import numpy as np

from gpuplane.model import ClusterState, PodRequest
from gpuplane.scheduler.framework import CycleState, FloatArray, IntArray
from gpuplane.scheduler.scoring import MAX_NODE_SCORE

NODE_AFFINITY_WEIGHT = 2.0
TAINT_TOLERATION_WEIGHT = 3.0
"""The plugins' weights in kube-scheduler's default profile (`getDefaultPlugins`)."""


def default_normalize(raw: IntArray, *, reverse: bool = False) -> FloatArray:
    """`DefaultNormalizeScore` of kube-scheduler's plugins/helper: scale to 0…100 by the largest raw score
    (integer division, as there), reversed when asked. All zeros stay zeros: a constant would shift every node
    alike, which changes no ranking, and zeros leave the other scores' sum bit for bit."""
    top = int(raw.max()) if len(raw) else 0
    if top == 0:
        return np.zeros(len(raw), np.float64)
    scaled = raw * int(MAX_NODE_SCORE) // top
    out: FloatArray = (MAX_NODE_SCORE - scaled if reverse else scaled).astype(np.float64)
    return out


class NodeAffinityScore:
    """Preferred node affinity: the sum of the weights of the terms a node matches, normalised over the feasible
    nodes (`PreferredSchedulingTerms.Score`, then `DefaultNormalizeScore`)."""

    name = "NodeAffinity"

    def neutral(self, pod: PodRequest, state: ClusterState) -> bool:
        return not pod.preferred_terms

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        if not pod.preferred_terms:
            return np.zeros(len(nodes), np.float64)
        return default_normalize(state.preferred_weights(pod.preferred_terms)[nodes])


class TaintTolerationScore:
    """Fewer PreferNoSchedule taints the pod does not tolerate score higher (TaintToleration's Score: the count,
    normalised reversed)."""

    name = "TaintToleration"

    def neutral(self, pod: PodRequest, state: ClusterState) -> bool:
        return state.prefer_no_schedule_counts(pod) is None

    def score(self, cycle: CycleState, pod: PodRequest, state: ClusterState, nodes: IntArray) -> FloatArray:
        counts = state.prefer_no_schedule_counts(pod)
        if counts is None:
            return np.zeros(len(nodes), np.float64)
        return default_normalize(counts[nodes], reverse=True)
