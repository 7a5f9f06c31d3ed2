"""Which MIG GPU instances can coexist on one card: the driver's rules, from the catalog's geometry.

A layout is legal when every instance's profile is the model's, every start is one of its profile's legal starts,
the instances' memory slices `[start, start + memory_slices)` neither overlap nor reach past the card's, their
compute slices sum to at most the card's, at most one has the media extensions (`+me`) and no profile exceeds its
maximum count. The MIG manager plans with it and the fake GPU backend refuses what it refuses.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuplane.model.catalog import CardModel

__all__ = ["mig_layout_problems"]


def mig_layout_problems(model: CardModel, layout: Iterable[tuple[int, int]]) -> list[str]:
    """Why the GPU instances `(profile ID, start)` cannot coexist on one card of `model`; empty when they can."""
    reasons: list[str] = []
    used = 0
    compute = 0
    media = 0
    counts: dict[int, int] = {}
    for profile_id, start in layout:
        profile = model.mig_profile(profile_id)
        if profile is None:
            reasons.append(f"{model.name} has no GPU-instance profile ID {profile_id}")
            continue
        if start not in profile.starts:
            reasons.append(f"{profile.name} cannot start at {start} (legal: {list(profile.starts)})")
        mask = profile.slot_mask(start)
        if used & mask:
            reasons.append(f"{profile.name} at {start} overlaps another instance")
        used |= mask
        compute += profile.compute_slices
        media += profile.media_extensions
        counts[profile_id] = counts.get(profile_id, 0) + 1
        if counts[profile_id] == profile.max_count + 1:
            reasons.append(f"more than {profile.max_count} × {profile.name}")
    if used >> model.memory_slices:
        reasons.append(f"an instance reaches past memory slice {model.memory_slices - 1}")
    if compute > model.compute_slices:
        reasons.append(f"{compute} compute slices, the card has {model.compute_slices}")
    if media > 1:
        reasons.append(f"{media} instances with media extensions (+me), at most 1")
    return reasons
