"""The node's ResourceSlices (`gpuplane.node.dra_slices`): every field name is upstream `resource.k8s.io/v1`'s
(tests/fixtures/dra_resource_v1_fields.json, from types.go) and the objects pass the strict v1 schema; the limits
of types.go hold; the MIG counters let through exactly the layouts the driver accepts; vGPU shares are consumable
capacity; an unhealthy card is tainted or left out."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter as Tally
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplane.kube import localapi
from gpuplane.kube.localapi import FakeApiServer
from gpuplane.kube.objects import quantity
from gpuplane.model import MigMode, default_catalog
from gpuplane.model.mig import mig_layout_problems
from gpuplane.node.dra_slices import (
    API_VERSION,
    DRIVER,
    NODE_LABEL,
    PCIE_ROOT,
    RESOURCE_SLICES,
    TAINT_UNHEALTHY,
    DeviceKind,
    DeviceRef,
    SlicePublisher,
    SliceSettings,
    UnhealthyPolicy,
    card_health,
    device_name,
    parse_device_name,
    pcie_root,
    publish_slices,
    resource_slices,
    semver,
)
from gpuplane.node.gpu import GIB, CardInfo, FakeGpuBackend

FIELDS: dict[str, Any] = json.loads((Path(__file__).parent / "fixtures" / "dra_resource_v1_fields.json").read_text())
STRUCTS: dict[str, dict[str, str]] = FIELDS["structs"]
LIMITS: dict[str, int] = FIELDS["limits"]
CATALOG = default_catalog()
A100 = CATALOG.get("A100-80GB")
L4 = CATALOG.get("L4")
SCHEMA_VERSION = "1.35"
"""The newest schema kubernetes_validate ships with resource.k8s.io/v1 consumable capacity and counters."""
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def a100_node(cards: int = 2, **kw: Any) -> list[CardInfo]:
    return FakeGpuBackend(cards, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100, **kw).describe()


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def counter_sets(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for s in slices for c in s["spec"].get("sharedCounters", [])}


def unknown_fields(value: Any, struct: str, where: str = "") -> list[str]:
    """Paths of keys that the upstream struct (and the structs under it) does not have."""
    if struct in ("ObjectMeta", "string", "int", "bool", "quantity"):
        return []
    if struct.startswith("[]"):
        return [p for i, item in enumerate(value) for p in unknown_fields(item, struct[2:], f"{where}[{i}]")]
    if struct.startswith("map[string]"):
        return [p for k, item in value.items() for p in unknown_fields(item, struct[len("map[string]"):],
                                                                       f"{where}[{k}]")]
    fields = STRUCTS[struct]
    found = [f"{where}.{k}: not a field of {struct}" for k in value if k not in fields]
    return found + [p for k, item in value.items() if k in fields
                    for p in unknown_fields(item, fields[k], f"{where}.{k}")]


MODES = [(A100, MigMode.DYNAMIC), (A100, MigMode.ON), (A100, MigMode.OFF), (L4, None)]


def _slices(model: Any, mode: MigMode | None, cards: int = 8) -> list[dict[str, Any]]:
    if model is A100:
        infos = a100_node(cards, numa=[i // 4 for i in range(cards)], nvlink_groups=[range(cards)])
    else:
        infos = FakeGpuBackend(cards, 24 * GIB, name="NVIDIA L4").describe()
    return resource_slices(infos, model, SliceSettings("node-a", mig_mode=mode, driver_version="550.54.15"),
                           pcie_roots={i: f"pci0000:{i:02x}" for i in range(cards)})


@pytest.mark.parametrize(("model", "mode"), MODES, ids=[f"{m.name}-{o}" for m, o in MODES])
def test_every_field_is_upstream_s_and_the_strict_v1_schema_accepts_every_slice(model: Any, mode: Any) -> None:
    for s in _slices(model, mode):
        assert unknown_fields(s, "ResourceSlice") == []
        assert kubernetes_validate.validate(s, SCHEMA_VERSION, strict=True) == SCHEMA_VERSION


def test_the_field_check_and_the_schema_catch_a_misnamed_field() -> None:
    s = _slices(A100, MigMode.DYNAMIC)[-1]
    s["spec"]["devices"][0]["basic"] = {"attributes": {}}  # v1beta1's wrapper, gone in v1
    assert unknown_fields(s, "ResourceSlice") == [".spec.devices[0].basic: not a field of Device"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(s, SCHEMA_VERSION, strict=True)


@pytest.mark.parametrize(("model", "mode"), MODES, ids=[f"{m.name}-{o}" for m, o in MODES])
def test_the_pool_keeps_upstream_s_limits(model: Any, mode: Any) -> None:
    slices = _slices(model, mode)
    for s in slices:
        spec = s["spec"]
        assert ("devices" in spec) != ("sharedCounters" in spec)  # one or the other in v1
        assert len(spec.get("devices", [])) <= LIMITS["ResourceSliceMaxDevicesWithAdvancedFeatures"]
        assert len(spec.get("sharedCounters", [])) <= LIMITS["ResourceSliceMaxCounterSets"]
        assert spec["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": len(slices)}
        assert spec["nodeName"] == "node-a" and spec["driver"] == DRIVER
    names = [d["name"] for s in slices for d in s["spec"].get("devices", [])]
    assert len(names) == len(set(names)) and all(DNS_LABEL.fullmatch(n) for n in names)
    sets = counter_sets(slices)
    for device in devices(slices).values():
        assert len(device.get("attributes", {})) + len(device.get("capacity", {})) <= 32
        assert all(C_IDENTIFIER.fullmatch(k.rpartition("/")[2]) and len(k.rpartition("/")[2]) <= 32
                   for k in [*device["attributes"], *device["capacity"]])
        for attribute in device["attributes"].values():
            [(kind, value)] = attribute.items()
            assert kind in ("int", "string", "bool", "version")
            assert kind == "int" or len(str(value)) <= LIMITS["DeviceAttributeMaxValueLength"]
        consumes = device.get("consumesCounters", [])
        assert len(consumes) <= LIMITS["ResourceSliceMaxDeviceCounterConsumptionsPerDevice"]
        for consumption in consumes:
            available = sets[consumption["counterSet"]]["counters"]
            for name, counter in consumption["counters"].items():
                assert quantity(counter["value"], "", "") <= quantity(available[name]["value"], "", "")
    assert all(len(c["counters"]) <= LIMITS["ResourceSliceMaxCountersPerCounterSet"] for c in sets.values())


def test_a_card_s_device_carries_its_attributes_and_capacity() -> None:
    infos = a100_node(4, numa=[0, 0, 1, 1], nvlink_groups=[(0, 1), (2, 3)])
    slices = resource_slices(infos, A100, SliceSettings("node-a", driver_version="535.104.05"),
                             pcie_roots={0: "pci0000:00", 1: "pci0000:00", 2: "pci0000:80", 3: "pci0000:80"})
    card = devices(slices)["gpu-2"]
    assert card["attributes"] == {
        "type": {"string": "gpu"}, "model": {"string": "A100-80GB"}, "productName": {"string": "NVIDIA A100-SXM4-80GB"},
        "uuid": {"string": "GPU-fake-2"}, "index": {"int": 2}, "numaNode": {"int": 1}, "nvlinkGroup": {"int": 1},
        "driverVersion": {"version": "535.104.5"}, PCIE_ROOT: {"string": "pci0000:80"}}
    assert card["capacity"] == {"memory": {"value": "81920Mi"}, "compute": {"value": "1000"}}  # 80 GiB = 81920 MiB


def test_a_mig_device_per_profile_and_placement_each_consuming_its_slices() -> None:
    slices = resource_slices(a100_node(1), A100, SliceSettings("node-a"))
    found = devices(slices)
    migs = [n for n in found if parse_device_name(n).kind is DeviceKind.MIG]  # type: ignore[union-attr]
    assert len(migs) == sum(len(p.starts) for p in A100.mig_profiles.values())  # 7+7+4+3+2+1+1 = 25
    three_g = found["gpu-0-mig-9-4"]  # 3g.40gb at memory slice 4: slices 4-7, 3 of 7 compute slices, 2 decoders
    assert three_g["consumesCounters"] == [{"counterSet": "gpu-0", "counters": {
        "compute-slices": {"value": "3"}, "decoders": {"value": "2"}, "memory-slice-4": {"value": "1"},
        "memory-slice-5": {"value": "1"}, "memory-slice-6": {"value": "1"}, "memory-slice-7": {"value": "1"}}}]
    assert three_g["attributes"]["profile"] == {"string": "3g.40gb"}
    assert three_g["attributes"]["parentUUID"] == {"string": "GPU-fake-0"} and "uuid" not in three_g["attributes"]
    assert three_g["capacity"] == {"memory": {"value": "40192Mi"}, "compute": {"value": "428"}}  # 3*1000//7
    whole = found["gpu-0"]["consumesCounters"][0]["counters"]
    assert whole == counter_sets(slices)["gpu-0"]["counters"]  # the whole card takes every counter


def _fits(chosen: list[dict[str, Any]], available: dict[str, Any]) -> bool:
    used: Tally[str] = Tally()
    for device in chosen:
        for name, counter in device["consumesCounters"][0]["counters"].items():
            used[name] += int(counter["value"])
    return all(used[name] <= int(c["value"]) for name, c in available.items())


A100_SLICES = resource_slices(a100_node(1), A100, SliceSettings("node-a"))
A100_MIG = sorted(n for n in devices(A100_SLICES) if "-mig-" in n)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(A100_MIG), min_size=1, max_size=8, unique=True))
def test_the_counters_admit_exactly_the_layouts_the_driver_accepts(names: list[str]) -> None:
    chosen = [devices(A100_SLICES)[n] for n in names]
    layout = [(r.profile_id, r.start) for n in names if (r := parse_device_name(n)) is not None]
    assert _fits(chosen, counter_sets(A100_SLICES)["gpu-0"]["counters"]) == (mig_layout_problems(A100, layout) == [])


def test_the_counters_admit_seven_1g_slices_and_refuse_an_eighth_or_an_overlap() -> None:
    found, available = devices(A100_SLICES), counter_sets(A100_SLICES)["gpu-0"]["counters"]
    seven = [found[f"gpu-0-mig-19-{s}"] for s in range(7)]
    assert _fits(seven, available)
    assert not _fits([*seven, found["gpu-0-mig-15-6"]], available)  # 1g.20gb over slices 6-7: slice 6 taken
    assert not _fits([found["gpu-0-mig-9-0"], found["gpu-0-mig-5-0"]], available)  # 3g and 4g both on slices 0-3
    assert not _fits([found["gpu-0"], found["gpu-0-mig-19-0"]], available)  # the whole card and a slice of it


def test_a_vgpu_share_is_consumable_capacity_split_ways() -> None:
    slices = resource_slices(a100_node(1), A100, SliceSettings("node-a", split=4))
    vgpu = devices(slices)["gpu-0-vgpu"]
    assert vgpu["allowMultipleAllocations"] is True and "consumesCounters" not in vgpu
    assert vgpu["capacity"] == {
        "memory": {"value": "81920Mi", "requestPolicy": {
            "default": "20480Mi", "validRange": {"min": "1Mi", "max": "81920Mi", "step": "1Mi"}}},  # 81920/4
        "compute": {"value": "1000", "requestPolicy": {
            "default": "250", "validRange": {"min": "1", "max": "1000", "step": "1"}}},  # 1000/4
        "shares": {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}}  # 4 holders at most
    for capacity in vgpu["capacity"].values():  # types.go: the default lies in the range, a multiple of the step
        policy, value = capacity["requestPolicy"], quantity(capacity["value"], "", "")
        default = quantity(policy["default"], "", "")
        if "validRange" in policy:
            low, high, step = (quantity(policy["validRange"][k], "", "") for k in ("min", "max", "step"))
            assert low <= default <= high <= value and (default - low) % step == Decimal(0)
        else:
            assert policy["validValues"] == sorted(policy["validValues"]) and policy["default"] in policy["validValues"]


@pytest.mark.parametrize(("mode", "kinds"), [
    (MigMode.DYNAMIC, {DeviceKind.CARD, DeviceKind.MIG, DeviceKind.VGPU}),
    (MigMode.ON, {DeviceKind.CARD, DeviceKind.MIG}),
    (MigMode.OFF, {DeviceKind.CARD, DeviceKind.VGPU}),
])
def test_the_mig_mode_decides_which_kinds_are_published(mode: MigMode, kinds: set[DeviceKind]) -> None:
    slices = resource_slices(a100_node(1), A100, SliceSettings("node-a", mig_mode=mode))
    assert {r.kind for n in devices(slices) if (r := parse_device_name(n)) is not None} == kinds
    assert bool(counter_sets(slices)) == (DeviceKind.MIG in kinds)


def test_a_model_without_mig_has_no_counters_and_no_mig_devices() -> None:
    slices = _slices(L4, None, cards=2)
    assert counter_sets(slices) == {} and sorted(devices(slices)) == ["gpu-0", "gpu-0-vgpu", "gpu-1", "gpu-1-vgpu"]
    assert "consumesCounters" not in devices(slices)["gpu-0"]


def test_eight_mig_cards_need_more_than_one_device_slice() -> None:
    slices = _slices(A100, MigMode.DYNAMIC, cards=9)
    # per card: 1 whole + 25 MIG + 1 vGPU = 27 devices; 9 cards = 243 devices = 4 slices of at most 64;
    # 9 counter sets = 2 slices of at most 8
    assert [len(s["spec"].get("sharedCounters", s["spec"].get("devices"))) for s in slices] == [8, 1, 64, 64, 64, 51]
    assert [s["metadata"]["name"] for s in slices] == [f"node-a-{DRIVER}-{k}" for k in range(6)]


def test_an_unhealthy_card_is_tainted_or_left_out() -> None:
    backend = FakeGpuBackend(2, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100)
    infos = backend.describe()
    backend.set_xid(1, 79)  # Xid 79: fallen off the bus (critical)
    health = card_health(backend, infos)
    assert health == {"GPU-fake-0": True, "GPU-fake-1": False}
    tainted = devices(resource_slices(infos, A100, SliceSettings("node-a"), health=health))
    assert all(d["taints"] == [{"key": TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule"}]
               for n, d in tainted.items() if n.startswith("gpu-1"))
    assert not any("taints" in d for n, d in tainted.items() if n.startswith("gpu-0"))
    assert {t["effect"] for d in tainted.values() for t in d.get("taints", [])} <= set(FIELDS["taintEffects"])
    omitted = resource_slices(infos, A100, SliceSettings("node-a", unhealthy=UnhealthyPolicy.OMIT), health=health)
    assert not any(n.startswith("gpu-1") for n in devices(omitted)) and list(counter_sets(omitted)) == ["gpu-0"]
    backend.fail_next(1)
    assert card_health(backend, infos) == {"GPU-fake-0": False, "GPU-fake-1": False}  # no reading: none healthy


def test_device_names_round_trip() -> None:
    refs = [DeviceRef(DeviceKind.CARD, 3), DeviceRef(DeviceKind.VGPU, 0), DeviceRef(DeviceKind.MIG, 7, 19, 6)]
    assert [device_name(r) for r in refs] == ["gpu-3", "gpu-0-vgpu", "gpu-7-mig-19-6"]
    assert [parse_device_name(device_name(r)) for r in refs] == refs
    assert [parse_device_name(n) for n in ("gpu-x", "nic-0", "gpu-0-mig-9", "gpu-1-vgpu-2")] == [None] * 4


@pytest.mark.parametrize(("raw", "expected"), [
    ("535.104.05", "535.104.5"), ("550.54.15", "550.54.15"), ("550.54", "550.54.0"), ("560", "560.0.0"),
    ("550.54.15-beta", None), ("", None), ("1.2.3.4", None),
])
def test_a_driver_version_reads_as_a_semantic_version(raw: str, expected: str | None) -> None:
    assert semver(raw) == expected


def test_the_pcie_root_is_the_first_component_of_the_sysfs_path(tmp_path: Path) -> None:
    device = tmp_path / "devices" / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    device.mkdir(parents=True)
    links = tmp_path / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / "0000:3b:00.0").symlink_to(device)
    assert pcie_root("00000000:3B:00.0", tmp_path) == "pci0000:3a"
    assert pcie_root("00000000:5E:00.0", tmp_path) is None  # no such device
    assert pcie_root(None, tmp_path) is None


def test_every_combination_of_settings_builds() -> None:
    infos = a100_node(2)
    for mode, policy, split in itertools.product([None, *MigMode], UnhealthyPolicy, (1, 7)):
        slices = resource_slices(infos, A100, SliceSettings("n", split=split, mig_mode=mode, unhealthy=policy),
                                 health={"GPU-fake-0": False})
        assert all(unknown_fields(s, "ResourceSlice") == [] for s in slices)


def test_publishing_writes_the_pool_once_per_change_and_deletes_what_is_no_longer_wanted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the local API server serves resource.k8s.io only when told of it (not among its built-in resources yet)
    monkeypatch.setitem(localapi.BUILTIN, ("resource.k8s.io", "resourceslices"), ("ResourceSlice", API_VERSION))
    infos = a100_node(9)
    with FakeApiServer() as server:
        other = resource_slices(a100_node(1), A100, SliceSettings("node-b"))
        assert publish_slices(server.api, "node-b", other) == 1
        first = resource_slices(infos, A100, SliceSettings("node-a"))
        assert publish_slices(server.api, "node-a", first) == 1
        assert publish_slices(server.api, "node-a", resource_slices(infos, A100, SliceSettings("node-a"))) is None

        def stored(node: str) -> list[dict[str, Any]]:
            return server.api.list(RESOURCE_SLICES, label_selector=f"{NODE_LABEL}={node}")[0]

        assert sorted(s["metadata"]["name"] for s in stored("node-a")) == sorted(s["metadata"]["name"] for s in first)
        # card 8 left out: 8 counter sets fit one slice, 8 x 27 = 216 devices fit 4 slices: 5 slices, not 6
        health = {i.uuid: i.index != 8 for i in infos}
        fewer = resource_slices(infos, A100, SliceSettings("node-a", unhealthy=UnhealthyPolicy.OMIT), health=health)
        assert len(first) == 6 and len(fewer) == 5
        assert publish_slices(server.api, "node-a", fewer) == 2
        now = stored("node-a")
        assert len(now) == 5 and {s["spec"]["pool"]["generation"] for s in now} == {2}
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in now} == {5}
        first_slice = next(s for s in now if s["metadata"]["name"].endswith("-0"))
        assert "devices" not in first_slice["spec"] and len(first_slice["spec"]["sharedCounters"]) == 8
        assert not any(d["name"].startswith("gpu-8") for s in now for d in s["spec"].get("devices", []))
        assert len(stored("node-b")) == len(other)  # another node's pool is left alone


def test_the_publisher_follows_the_cards_health(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(localapi.BUILTIN, ("resource.k8s.io", "resourceslices"), ("ResourceSlice", API_VERSION))
    backend = FakeGpuBackend(2, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100)
    with FakeApiServer() as server:
        publisher = SlicePublisher(server.api, backend, backend.describe, A100, SliceSettings("node-a"))

        def tainted() -> set[int]:
            stored = server.api.list(RESOURCE_SLICES, label_selector=f"{NODE_LABEL}=node-a")[0]
            return {d["attributes"]["index"]["int"] for s in stored for d in s["spec"].get("devices", [])
                    if d.get("taints")}

        assert (publisher.tick(), publisher.tick(), tainted()) == (1, None, set())
        backend.set_xid(0, 48)  # Xid 48: double-bit ECC error (critical)
        assert (publisher.tick(), tainted()) == (2, {0})
        backend.set_xid(0, 0)
        assert (publisher.tick(), tainted()) == (3, set())
        publisher.settings = SliceSettings("node-a", mig_mode=MigMode.OFF)  # the pool's MIG mode changed
        assert publisher.tick() == 4
        stored = server.api.list(RESOURCE_SLICES, label_selector=f"{NODE_LABEL}=node-a")[0]
        assert sorted(d["name"] for s in stored for d in s["spec"]["devices"]) == [
            "gpu-0", "gpu-0-vgpu", "gpu-1", "gpu-1-vgpu"]
