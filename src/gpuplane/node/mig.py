"""The MIG manager: plan a card's GPU-instance layout from the profiles wanted, diff it against the instances
present, and apply it through the GPU backend.

Geometry comes from the catalog (`gpuplane.model.catalog.MigProfile`: real profile IDs, legal starts on the
memory-slice axis, memory slices, `max_count`, `+me`), never from profile names; which layouts are legal, from
`gpuplane.model.mig.mig_layout_problems` (no overlap, legal starts, compute slices within the card's, `+me` at
most once, no profile above its maximum count).

`plan_layout` keeps every present instance it can (an instance wanted at a fixed start, e.g. the scheduler's
`CardShare.mig_start`, keeps only an instance at that start; one wanted anywhere keeps any instance of its
profile), places the rest at legal free starts, and destroys what is left over, searching all placements so
that a plan exists whenever a legal layout does. `apply_plan` enables MIG mode if needed, destroys, then
creates; failures come back as a `Status` with what was done so far.

`held_instances` says which present instances the live pods' MIG shares hold (the device plugin's reconcile
destroys the others after a grace period).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuplane.model import Assignment, CardModel
from gpuplane.model.catalog import MigProfile
from gpuplane.model.mig import mig_layout_problems
from gpuplane.node.gpu import DeviceBackend, GpuBackendError, MigInstance
from gpuplane.port import Status

__all__ = ["ApplyResult", "MigPlan", "Placement", "Wanted", "apply_plan", "held_instances", "layout_is_legal",
           "parse_profiles", "plan_layout", "wanted_from_assignments"]


@dataclass(frozen=True, slots=True)
class Wanted:
    """One GPU instance wanted: a profile ID, at a fixed memory-slice `start` or (None) anywhere legal."""

    profile_id: int
    start: int | None = None


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """A GPU instance to create: profile ID at memory slice `start`."""

    start: int
    profile_id: int


@dataclass(frozen=True, slots=True)
class MigPlan:
    """What turns the card's present instances into the wanted layout."""

    card: int
    enable_mig: bool
    destroy: tuple[MigInstance, ...]
    create: tuple[Placement, ...]
    keep: tuple[MigInstance, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.enable_mig or self.destroy or self.create)

    @property
    def layout(self) -> tuple[Placement, ...]:
        """The card's instances once the plan is applied, by start."""
        return tuple(sorted([Placement(m.start, m.profile_id) for m in self.keep] + list(self.create)))

    def lines(self, model: CardModel) -> list[str]:
        """The plan in words, one step a line (`--dry-run`)."""
        def name(profile_id: int) -> str:
            profile = model.mig_profile(profile_id)
            return f"{profile.name} (ID {profile_id})" if profile is not None else f"profile ID {profile_id}"

        out = [f"card {self.card}: enable MIG mode"] if self.enable_mig else []
        out += [f"card {self.card}: destroy GPU instance {m.gpu_instance_id}: {name(m.profile_id)} at {m.start}"
                for m in self.destroy]
        out += [f"card {self.card}: create {name(p.profile_id)} at memory slice {p.start}" for p in self.create]
        out += [f"card {self.card}: keep GPU instance {m.gpu_instance_id}: {name(m.profile_id)} at {m.start}"
                for m in self.keep]
        return out or [f"card {self.card}: nothing to do"]


@dataclass(frozen=True, slots=True)
class ApplyResult:
    status: Status
    created: tuple[MigInstance, ...] = ()
    destroyed: tuple[MigInstance, ...] = ()
    pending_reset: bool = False
    """MIG mode was asked for but waits for a GPU reset; nothing else was done."""


def parse_profiles(model: CardModel, text: str | Iterable[str]) -> tuple[list[Wanted], Status]:
    """`3g.40gb,2g.20gb@4,19` → wanted instances: a driver name or profile ID, optionally `@start`."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    wanted: list[Wanted] = []
    reasons: list[str] = []
    for item in items:
        key, _, at = item.partition("@")
        profile = model.mig_profile(int(key)) if key.isdigit() else model.mig_profile(key)
        if profile is None:
            known = ", ".join(f"{p.name} ({p.profile_id})" for p in model.mig_profiles.values())
            reasons.append(f"{item}: {model.name} has no MIG profile {key!r} (known: {known or 'none'})")
            continue
        if at and not at.isdigit():
            reasons.append(f"{item}: the start after @ must be a memory-slice number")
            continue
        wanted.append(Wanted(profile.profile_id, int(at) if at else None))
    return wanted, (Status.error(*reasons) if reasons else Status.success())


def wanted_from_assignments(assignments: Iterable[Assignment], card: int) -> list[Wanted]:
    """The instances the scheduler's assignments place on `card` (each MIG `CardShare` names its profile and
    start)."""
    return [Wanted(share.mig_profile, share.mig_start) for a in assignments for share in a.cards
            if share.card == card and share.mig_profile is not None]


def held_instances(present: Iterable[MigInstance], wanted: Iterable[Wanted]) -> tuple[MigInstance, ...]:
    """The present instances some wanted instance may be: the one of its profile at its start, or, for one
    wanted anywhere (which instance it got is not recorded), every instance of its profile."""
    wanted = list(wanted)
    return tuple(m for m in present
                 if any(w.profile_id == m.profile_id and w.start in (None, m.start) for w in wanted))


def layout_is_legal(model: CardModel, layout: Sequence[Placement]) -> Status:
    """Whether the instances can coexist on one card of `model` (`gpuplane.model.mig.mig_layout_problems`)."""
    reasons = mig_layout_problems(model, [(p.profile_id, p.start) for p in layout])
    return Status.error(*reasons) if reasons else Status.success()


@dataclass(slots=True)
class _Search:
    model: CardModel
    entries: list[tuple[Wanted, MigProfile]]
    present: list[MigInstance]
    best: tuple[int, tuple[int, ...]] | None = None
    """(instances kept, starts in entry order) of the best complete choice."""
    best_choice: list[tuple[int, int | None]] = field(default_factory=list)
    """Per entry: (start, index of the kept present instance or None)."""

    def run(self) -> None:
        self._step(0, 0, 0, 0, set(), [])

    def _step(self, i: int, used: int, compute: int, media: int, taken: set[int],
              choice: list[tuple[int, int | None]]) -> None:
        if i == len(self.entries):
            kept = sum(1 for _, k in choice if k is not None)
            key = (-kept, tuple(s for s, _ in choice))
            if self.best is None or key < (-self.best[0], self.best[1]):
                self.best = (kept, key[1])
                self.best_choice = list(choice)
            return
        wanted, profile = self.entries[i]
        compute += profile.compute_slices
        media += profile.media_extensions
        if compute > self.model.compute_slices or media > 1:
            return
        options: list[tuple[int, int | None]] = []
        for index, inst in enumerate(self.present):
            if index not in taken and inst.profile_id == profile.profile_id and wanted.start in (None, inst.start):
                options.append((inst.start, index))
        starts = profile.starts if wanted.start is None else (wanted.start,)
        previous = self._previous_new_start(i, choice)
        options += [(s, None) for s in starts if s in profile.starts and s >= previous]
        for start, k in options:
            mask = profile.slot_mask(start)
            if used & mask or (mask >> self.model.memory_slices):
                continue
            if k is not None:
                taken.add(k)
            choice.append((start, k))
            self._step(i + 1, used | mask, compute, media, taken, choice)
            choice.pop()
            if k is not None:
                taken.discard(k)

    def _previous_new_start(self, i: int, choice: list[tuple[int, int | None]]) -> int:
        """Identical entries placed anew take non-decreasing starts (the same layouts in another order add
        nothing)."""
        if i == 0 or self.entries[i - 1][0] != self.entries[i][0] or self.entries[i][0].start is not None:
            return -1
        start, kept = choice[i - 1]
        return -1 if kept is not None else start


def plan_layout(model: CardModel, card: int, wanted: Sequence[Wanted], present: Sequence[MigInstance],
                mig_enabled: bool | None) -> tuple[MigPlan | None, Status]:
    """The plan that turns `present` into a layout with exactly the `wanted` instances, keeping as many present
    instances as any legal layout allows. (None, Status) when no legal layout holds them all."""
    if not model.mig_capable or mig_enabled is None:
        return None, Status.error(f"card {card} ({model.name}) has no MIG")
    entries: list[tuple[Wanted, MigProfile]] = []
    reasons: list[str] = []
    for w in wanted:
        profile = model.mig_profile(w.profile_id)
        if profile is None:
            reasons.append(f"{model.name} has no MIG profile ID {w.profile_id}")
        elif w.start is not None and w.start not in profile.starts:
            reasons.append(f"{profile.name} cannot start at {w.start} (legal: {list(profile.starts)})")
        else:
            entries.append((w, profile))
    if reasons:
        return None, Status.error(*reasons)
    # Fixed starts first, then the largest instances: the search prunes early.
    entries.sort(key=lambda e: (e[0].start is None, -e[1].memory_slices, e[1].profile_id, e[0].start or 0))
    search = _Search(model, entries, sorted(present, key=lambda m: (m.start, m.gpu_instance_id)))
    search.run()
    if search.best is None:
        asked = ", ".join(p.name + (f"@{w.start}" if w.start is not None else "") for w, p in entries)
        return None, Status.error(f"no legal layout of {asked} on card {card} ({model.name})")
    kept_ids = {k for _, k in search.best_choice if k is not None}
    keep = tuple(search.present[k] for k in sorted(kept_ids))
    destroy = tuple(m for k, m in enumerate(search.present) if k not in kept_ids)
    create = tuple(sorted(Placement(start, entries[i][1].profile_id)
                          for i, (start, k) in enumerate(search.best_choice) if k is None))
    enable = not mig_enabled and bool(create)
    return MigPlan(card, enable, destroy, create, keep), Status.success()


def apply_plan(backend: DeviceBackend, plan: MigPlan) -> ApplyResult:
    """Carry the plan out: MIG mode on (if asked; stops there while it waits for a reset), destroy, create."""
    created: list[MigInstance] = []
    destroyed: list[MigInstance] = []
    try:
        if plan.enable_mig and not backend.set_mig_mode(plan.card, True):
            return ApplyResult(Status.error(f"card {plan.card}: MIG mode is pending a GPU reset "
                                            "(stop the card's processes and reset it)"), pending_reset=True)
        for instance in plan.destroy:
            backend.destroy_mig_instance(plan.card, instance.gpu_instance_id)
            destroyed.append(instance)
        for placement in plan.create:
            created.append(backend.create_mig_instance(plan.card, placement.profile_id, placement.start))
    except GpuBackendError as exc:
        return ApplyResult(Status.error(str(exc)), tuple(created), tuple(destroyed))
    return ApplyResult(Status.success(), tuple(created), tuple(destroyed))
