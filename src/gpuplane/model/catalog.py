"""Card catalog: what each GPU model offers (memory, SMs, codecs, MIG geometry, vGPU packages).

Values come from `shared/reference/protocols.md` §5 (NVML-reported memory sizes, `nvidia-smi mig -lgip`
profile data); the parts added since (B200, B300, GB200, GB300, H100 NVL, H20, L20, RTX PRO 6000) name their
source in `CardModel.source`. The trace's undisclosed models G1/G2/G3 get declared defaults, marked as such.
The packer keys MIG profiles on their ID, slices and legal placements, never on names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpuplane.model.errors import CatalogError

MILLI_PER_CARD = 1000


def slot_mask(start: int, memory_slices: int) -> int:
    """Bitmask of the memory slices `[start, start + memory_slices)` (bit i: memory slice i)."""
    return ((1 << memory_slices) - 1) << start


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile of a MIG-capable model.

    `starts` are the legal start slots on the memory-slice axis; an instance occupies
    memory slices `[start, start + memory_slices)`.
    """

    profile_id: int
    name: str
    compute_slices: int
    memory_slices: int
    starts: tuple[int, ...]
    max_count: int
    memory_mib: int
    sms: int
    decoders: int = 0
    media_extensions: bool = False

    def slot_mask(self, start: int) -> int:
        """Bitmask of the memory slices an instance placed at `start` occupies."""
        return slot_mask(start, self.memory_slices)


@dataclass(frozen=True, slots=True)
class VgpuPackage:
    """A named fractional share of one card model, e.g. "half an A30: 50 % compute, 12 GB"."""

    name: str
    compute_milli: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class CardModel:
    name: str
    memory_mib: int
    sms: int
    encoders: int
    decoders: int
    compute_slices: int = 0
    memory_slices: int = 0
    mig_profiles: Mapping[int, MigProfile] = field(default_factory=lambda: MappingProxyType({}))
    packages: Mapping[str, VgpuPackage] = field(default_factory=lambda: MappingProxyType({}))
    aliases: tuple[str, ...] = ()
    declared_default: bool = False
    """True when the figures are placeholders for an undisclosed model (the trace's G1/G2/G3)."""
    source: str = ""
    """Where the figures come from (vendor data, NVML readings), for the models added after protocols.md §5."""

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def mig_profile(self, key: int | str) -> MigProfile | None:
        """Look a profile up by ID or by this model's driver name (e.g. `3g.40gb`)."""
        if isinstance(key, int):
            return self.mig_profiles.get(key)
        for profile in self.mig_profiles.values():
            if profile.name == key:
                return profile
        return None

    def mig_compute_milli(self, profile: MigProfile) -> int:
        """Share of the card's compute an instance holds, in milli-cards (floor)."""
        return profile.compute_slices * MILLI_PER_CARD // self.compute_slices


class Catalog:
    """Registry of card models, looked up by canonical name or alias (`V100M16` → `V100-16GB`)."""

    def __init__(self, models: Iterable[CardModel]) -> None:
        self._models: dict[str, CardModel] = {}
        self._by_key: dict[str, CardModel] = {}
        for model in models:
            if model.name in self._models:
                raise CatalogError(f"card model {model.name!r} declared twice")
            self._models[model.name] = model
            for key in (model.name, *model.aliases):
                if key.lower() in self._by_key:
                    raise CatalogError(f"card model key {key!r} is ambiguous")
                self._by_key[key.lower()] = model

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._by_key

    def __iter__(self) -> Iterator[CardModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._models)

    def get(self, key: str) -> CardModel:
        try:
            return self._by_key[key.lower()]
        except KeyError:
            known = ", ".join(sorted(self._models))
            raise CatalogError(f"unknown GPU model {key!r} (known: {known})") from None

    def canonical(self, key: str) -> str:
        return self.get(key).name

    def package(self, model: str, name: str) -> VgpuPackage:
        card = self.get(model)
        try:
            return card.packages[name]
        except KeyError:
            known = ", ".join(sorted(card.packages)) or "none"
            raise CatalogError(f"{card.name} has no vGPU package {name!r} (known: {known})") from None


def _gib(value: float) -> int:
    return round(value * 1024)


def _ga100_profiles(slice_mib: tuple[int, int, int, int], sms: tuple[int, ...], names: tuple[str, ...],
                    decoders: tuple[int, ...]) -> dict[int, MigProfile]:
    """A100/H100/H200 share one layout: 7 compute and 8 memory slices, the same IDs and starts.

    `slice_mib` is the instance memory for 1, 2, 4 and 8 memory slices; `sms`, `names` and
    `decoders` follow the ID order 19, 20, 15, 14, 9, 5, 0.
    """
    m1, m2, m4, m8 = slice_mib
    rows = (
        # id, compute, memory slices, starts, max, memory, +me
        (19, 1, 1, tuple(range(7)), 7, m1, False),
        (20, 1, 1, tuple(range(7)), 1, m1, True),
        (15, 1, 2, (0, 2, 4, 6), 4, m2, False),
        (14, 2, 2, (0, 2, 4), 3, m2, False),
        (9, 3, 4, (0, 4), 2, m4, False),
        (5, 4, 4, (0,), 1, m4, False),
        (0, 7, 8, (0,), 1, m8, False),
    )
    return {
        pid: MigProfile(pid, name, comp, mem, starts, count, mib, sm, dec, me)
        for (pid, comp, mem, starts, count, mib, me), sm, name, dec in zip(rows, sms, names, decoders, strict=True)
    }


def _packages(memory_mib: int) -> dict[str, VgpuPackage]:
    return {
        "half": VgpuPackage("half", 500, memory_mib // 2),
        "quarter": VgpuPackage("quarter", 250, memory_mib // 4),
    }


def _card(name: str, memory_mib: int, sms: int, encoders: int, decoders: int, *, aliases: tuple[str, ...] = (),
          mig: dict[int, MigProfile] | None = None, slices: tuple[int, int] = (0, 0),
          packages: dict[str, VgpuPackage] | None = None, declared_default: bool = False,
          source: str = "") -> CardModel:
    return CardModel(
        name=name, memory_mib=memory_mib, sms=sms, encoders=encoders, decoders=decoders,
        compute_slices=slices[0], memory_slices=slices[1],
        mig_profiles=MappingProxyType(mig or {}),
        packages=MappingProxyType(packages if packages is not None else _packages(memory_mib)),
        aliases=aliases, declared_default=declared_default, source=source,
    )


_GO_NVML_B200 = "NVIDIA/go-nvml pkg/nvml/mock/shared/gpus/b200.go (B200_SXM5_180GB: MemoryMB, GPU-instance profiles)"
_NVIDIA_SMI = "nvidia-smi memory total as printed on the part"
_NO_MIG = ("MIG exists on this part, but no vendor data read here gives its profiles' IDs and sizes: "
           "MIG requests are refused on it until they are added")


def _blackwell_profiles() -> dict[int, MigProfile]:
    """B200 180GB: GPU-instance profiles as go-nvml's B200 mock gives them (memory MiB, SMs, decoders, counts),
    on the GH100 layout (7 compute, 8 memory slices: names 1g.23gb … 7g.180gb are 1/8, 2/8, 4/8 and 8/8 of the
    memory, as the MIG user guide's B200 table gives). The profile IDs and memory-slice starts are the GA100/GH100
    ones (assumed, as for H200 in protocols.md §5.2; the mock's own placements count compute slices): confirm with
    `nvidia-smi mig -lgipp`."""
    return _ga100_profiles(
        (23552, 46080, 92160, 184320), (18, 18, 18, 36, 54, 72, 126),
        ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"), (1, 1, 1, 2, 3, 4, 7))


def default_catalog() -> Catalog:
    """The built-in catalog (protocols.md §5.3–5.4)."""
    a100_40 = _ga100_profiles(
        (4864, 9856, 19968, 40192), (14, 14, 14, 28, 42, 56, 98),
        ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"), (0, 1, 1, 1, 2, 2, 5))
    a100_80 = _ga100_profiles(
        (9856, 19968, 40192, 80384), (14, 14, 14, 28, 42, 56, 98),
        ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), (0, 1, 1, 1, 2, 2, 5))
    h100 = _ga100_profiles(
        (_gib(9.75), _gib(19.62), _gib(39.5), _gib(79.25)), (16, 16, 26, 32, 60, 64, 132),
        ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"), (1, 1, 1, 2, 3, 4, 7))
    h200 = _ga100_profiles(
        (_gib(16.0), _gib(32.25), _gib(69.5), _gib(139.75)), (16, 16, 26, 32, 60, 64, 132),
        ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"), (1, 1, 1, 2, 3, 4, 7))
    a30 = {
        14: MigProfile(14, "1g.6gb", 1, 1, (0, 1, 2, 3), 4, _gib(5.81), 14, 1),
        21: MigProfile(21, "1g.6gb+me", 1, 1, (0, 1, 2, 3), 1, _gib(5.81), 14, 1, True),
        5: MigProfile(5, "2g.12gb", 2, 2, (0, 2), 2, _gib(11.69), 28, 2),
        6: MigProfile(6, "2g.12gb+me", 2, 2, (0, 2), 1, _gib(11.69), 28, 2, True),
        0: MigProfile(0, "4g.24gb", 4, 4, (0,), 1, _gib(23.44), 56, 4),
    }
    return Catalog([
        _card("A100-40GB", 40960, 108, 0, 5, aliases=("A100", "A100-SXM4-40GB"), mig=a100_40, slices=(7, 8)),
        _card("A100-80GB", 81920, 108, 0, 5, aliases=("A100-SXM4-80GB",), mig=a100_80, slices=(7, 8)),
        _card("H100-80GB", 81559, 132, 0, 7, aliases=("H100", "H100-SXM5-80GB"), mig=h100, slices=(7, 8)),
        _card("H200-141GB", 143771, 132, 0, 7, aliases=("H200", "NVIDIA H200"), mig=h200, slices=(7, 8)),
        _card("A30-24GB", 24576, 56, 0, 4, aliases=("A30",), mig=a30, slices=(4, 4),
              packages={"half": VgpuPackage("half", 500, 12288), "quarter": VgpuPackage("quarter", 250, 6144)}),
        _card("T4", 15360, 40, 1, 2),
        _card("A10", 23028, 72, 1, 2),
        _card("L4", 23034, 58, 2, 4),
        _card("L40S", 46068, 142, 3, 3),
        _card("V100-16GB", 16160, 80, 0, 0, aliases=("V100M16", "V100")),
        _card("V100-32GB", 32510, 80, 0, 0, aliases=("V100M32",)),
        _card("P100", 16280, 56, 0, 0),
        # Data-centre parts since protocols.md §5; each names its source. NVML names map through the aliases.
        _card("B200-180GB", 184320, 148, 0, 7, aliases=("B200", "NVIDIA B200", "NVIDIA B200 180GB HBM3e"),
              mig=_blackwell_profiles(), slices=(7, 8),
              source=f"{_GO_NVML_B200}; 148 SMs as CUDA reports them; 7 NVDEC as the mock's 7g profile (no NVENC "
                     "listed). nvidia-smi prints 183359 MiB: the catalog keeps the mock's 184320 so the 7g profile "
                     "fits the card"),
        _card("B300-288GB", 275040, 148, 0, 7, aliases=("B300", "NVIDIA B300 SXM6 AC"),
              source=f"{_NVIDIA_SMI} (275040 MiB); 148 SMs as CUDA reports them; decoders as B200. {_NO_MIG} "
                     "(GPU Operator 25.10.0 names 1g.34gb, 1g.34gb+me, 1g.67gb, 2g.67gb, 3g.135gb, 4g.135gb, "
                     "7g.269gb)"),
        _card("GB200-186GB", 189471, 148, 0, 7, aliases=("GB200", "NVIDIA GB200"),
              source=f"{_NVIDIA_SMI} (189471 MiB); SMs and decoders as B200 (the same Blackwell GPU, not read on "
                     f"GB200 itself). {_NO_MIG} (1g.23gb, 1g.47gb, 2g.47gb, 3g.93gb, 7g.186gb)"),
        _card("GB300-288GB", 284208, 148, 0, 7, aliases=("GB300", "NVIDIA GB300"),
              source=f"{_NVIDIA_SMI} (284208 MiB); SMs and decoders as B300 (not read on GB300 itself). {_NO_MIG} "
                     "(1g.35gb, 1g.70gb, 2g.70gb, 3g.139gb, 4g.139gb, 7g.278gb)"),
        _card("H100-NVL-94GB", 95830, 132, 0, 7, aliases=("H100 NVL", "NVIDIA H100 NVL"),
              source=f"{_NVIDIA_SMI} (95830 MiB); GH100 SMs and decoders as H100 SXM5 (protocols.md §5.4). {_NO_MIG} "
                     "(protocols.md §5.1 names 1g.12gb, 1g.24gb, 2g.24gb, 3g.47gb, 4g.47gb, 7g.94gb, sizes unread)"),
        _card("H20-96GB", 97871, 78, 0, 7, aliases=("H20", "NVIDIA H20"),
              source=f"{_NVIDIA_SMI} (97871 MiB); 78 SMs as CUDA reports them; GH100 decoders as H100. {_NO_MIG} "
                     "(GPU Operator: 1g.12gb, 3g.48gb, 4g.48gb, 7g.96gb)"),
        _card("L20", 46068, 92, 3, 3, aliases=("NVIDIA L20",),
              source=f"{_NVIDIA_SMI} (46068 MiB); 92 SMs as CUDA reports them; AD102 codec units as L40S "
                     "(protocols.md §5.4)"),
        _card("RTX-PRO-6000", 97887, 188, 4, 4,
              aliases=("RTX PRO 6000", "NVIDIA RTX PRO 6000 Blackwell Server Edition"),
              source=f"{_NVIDIA_SMI} (97887 MiB); 188 SMs as CUDA reports them; 4 NVENC and 4 NVDEC (RTX PRO 6000 "
                     f"Blackwell Server Edition datasheet). {_NO_MIG} (4 slices: 1g.24gb, 2g.48gb, 4g.96gb and their "
                     "+gfx/-me variants)"),
        # Undisclosed models in the Alibaba trace: declared defaults, not measured values.
        _card("G1", 16384, 80, 1, 2, declared_default=True),
        _card("G2", 24576, 80, 1, 2, declared_default=True),
        _card("G3", 32768, 80, 1, 2, declared_default=True),
    ])
