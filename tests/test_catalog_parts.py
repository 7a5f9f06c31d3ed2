"""Current data-centre parts in the catalog: NVML names map to them, their figures name a source, and the B200's
MIG profiles are a legal GH100-layout table that places and packs like the others."""

from __future__ import annotations

import pytest

from builders import CATALOG, cluster, framework, node, placed, pod
from gpuplane.model import MigMode
from gpuplane.node.device_plugin import canonical_model

NEW_PARTS = ("B200-180GB", "B300-288GB", "GB200-186GB", "GB300-288GB", "H100-NVL-94GB", "H20-96GB", "L20",
             "RTX-PRO-6000")


@pytest.mark.parametrize(("nvml_name", "mib", "model"), [
    # (the name NVML reports, the memory nvidia-smi prints) → the catalog model
    ("NVIDIA B200", 183359, "B200-180GB"),
    ("NVIDIA B300 SXM6 AC", 275040, "B300-288GB"),
    ("NVIDIA GB200", 189471, "GB200-186GB"),
    ("NVIDIA GB300", 284208, "GB300-288GB"),
    ("NVIDIA H100 NVL", 95830, "H100-NVL-94GB"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),  # the family word and the nearest memory still pick SXM5
    ("NVIDIA H20", 97871, "H20-96GB"),
    ("NVIDIA H200", 143771, "H200-141GB"),
    ("NVIDIA L20", 46068, "L20"),
    ("NVIDIA L40S", 46068, "L40S"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "RTX-PRO-6000"),
])
def test_nvml_names_map_to_the_catalog(nvml_name: str, mib: int, model: str) -> None:
    assert canonical_model(nvml_name, mib << 20, CATALOG) == model
    if nvml_name in CATALOG:
        assert CATALOG.canonical(nvml_name) == model


@pytest.mark.parametrize("model", NEW_PARTS)
def test_new_parts_name_their_source(model: str) -> None:
    card = CATALOG.get(model)
    assert card.source and not card.declared_default
    assert card.memory_mib > 0 and card.sms > 0
    if not card.mig_capable and model != "L20":  # L20 (AD102) has no MIG at all
        assert "MIG requests are refused" in card.source


@pytest.mark.parametrize(("profile_id", "name", "memory_mib", "sms", "count", "starts"), [
    # go-nvml's B200 mock: 23552 MiB per memory slice (184320 / 8 = 23040 nominal, the mock rounds to 23 GiB);
    # starts on the 8-slice memory axis as GA100/GH100.
    (19, "1g.23gb", 23552, 18, 7, (0, 1, 2, 3, 4, 5, 6)),
    (20, "1g.23gb+me", 23552, 18, 1, (0, 1, 2, 3, 4, 5, 6)),
    (15, "1g.45gb", 46080, 18, 4, (0, 2, 4, 6)),
    (14, "2g.45gb", 46080, 36, 3, (0, 2, 4)),
    (9, "3g.90gb", 92160, 54, 2, (0, 4)),
    (5, "4g.90gb", 92160, 72, 1, (0,)),
    (0, "7g.180gb", 184320, 126, 1, (0,)),
])
def test_b200_mig_profiles(profile_id: int, name: str, memory_mib: int, sms: int, count: int,
                           starts: tuple[int, ...]) -> None:
    card = CATALOG.get("B200")
    profile = card.mig_profile(name)
    assert profile is not None and profile.profile_id == profile_id
    assert (profile.memory_mib, profile.sms, profile.max_count, profile.starts) == (memory_mib, sms, count, starts)
    assert profile.memory_mib <= card.memory_mib
    assert (card.compute_slices, card.memory_slices) == (7, 8)


def test_b200_packs_mig_and_whole_cards() -> None:
    state = cluster(node("b").gpus(2, "B200").mig(MigMode.DYNAMIC).cpu(64000).mem(524288).obj())
    fw = framework()
    # 3g.90gb + 4g.90gb fill card 0 with no waste (3 + 4 = 7 compute slices, 4 + 4 = 8 memory slices)
    first = placed(fw, state, pod("m3").mig("3g.90gb").obj())
    second = placed(fw, state, pod("m4").mig("4g.90gb").obj())
    assert {first.card_indexes, second.card_indexes} == {(0,)}
    # 54 of 126 SMs' worth of 7 slices: 3 × 1000 // 7 = 428 milli
    assert first.cards[0].compute_milli == 428
    whole = placed(fw, state, pod("w").whole(1).obj())
    assert whole.card_indexes == (1,)
    assert whole.cards[0].memory_mib == 184320
    assert state.check_invariants() == []


@pytest.mark.parametrize("model", [m for m in NEW_PARTS if not CATALOG.get(m).mig_capable])
def test_parts_without_mig_data_refuse_mig_requests(model: str) -> None:
    state = cluster(node("n").gpus(1, model).cpu(8000).mem(65536).obj())
    decision = framework().schedule(pod("m").mig(19).models(model).obj(), state)
    assert decision.assignment is None
