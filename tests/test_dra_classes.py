"""The DRA device classes (deploy/dra/deviceclasses.yaml): they pass the strict v1 schema, and their CEL selectors,
evaluated with a CEL library (cel-python) over the devices of the node's ResourceSlices in Kubernetes' device
environment (`device.driver`, `device.attributes[domain]`, `device.capacity[domain]` as quantities,
`device.allowMultipleAllocations`), pick each kind of device exactly; the KEP-5004 extended-resource mapping;
the worked example's request selectors (tests/fixtures/dra_example.yaml)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuplane.kube.dra_cel import SelectorCache, SelectorError
from gpuplane.kube.objects import RES_GPU, quantity
from gpuplane.model import MigMode, default_catalog
from gpuplane.node.dra_slices import DRIVER, DeviceKind, SliceSettings, parse_device_name, resource_slices
from gpuplane.node.gpu import GIB, FakeGpuBackend

ROOT = Path(__file__).parent.parent
CLASSES = [d for d in yaml.safe_load_all((ROOT / "deploy" / "dra" / "deviceclasses.yaml").read_text()) if d]
EXAMPLE = [d for d in yaml.safe_load_all((Path(__file__).parent / "fixtures" / "dra_example.yaml").read_text()) if d]
ALLOCATION_EXAMPLE = [d for d in yaml.safe_load_all(
    (Path(__file__).parent / "fixtures" / "dra_allocation_example.yaml").read_text()) if d]
A100 = default_catalog().get("A100-80GB")
CEL = SelectorCache()


def matches(selectors: list[dict[str, Any]], driver: str, device: dict[str, Any]) -> bool:
    """Every selector true, in order, with the scheduler's own CEL environment (`gpuplane.kube.dra_cel`); an
    evaluation error raises `SelectorError`, as it fails the allocation in Kubernetes."""
    return all(CEL.matches(s["cel"]["expression"], driver, device) for s in selectors)


def node_devices(mode: MigMode = MigMode.DYNAMIC) -> dict[str, dict[str, Any]]:
    infos = FakeGpuBackend(2, 80 * GIB, name="NVIDIA A100-SXM4-80GB", mig_model=A100).describe()
    slices = resource_slices(infos, A100, SliceSettings("node-a", mig_mode=mode))
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def chosen(class_name: str, devices: dict[str, dict[str, Any]], driver: str = DRIVER,
           extra: list[dict[str, Any]] | None = None) -> set[str]:
    [cls] = [c for c in CLASSES if c["metadata"]["name"] == class_name]
    selectors = cls["spec"]["selectors"] + (extra or [])
    return {n for n, d in devices.items() if matches(selectors, driver, d)}


KIND_OF_CLASS = {"gpu.gpuplane.io": DeviceKind.CARD, "mig.gpu.gpuplane.io": DeviceKind.MIG,
                 "vgpu.gpu.gpuplane.io": DeviceKind.VGPU}


def test_the_deploy_manifest_is_the_packaged_one() -> None:
    """The scheduler's bench and parity read the packaged classes (an installed gpuplane has no deploy/); the
    manifest an operator applies must be the same bytes."""
    from gpuplane.sim.dra_bench import DEVICE_CLASSES, device_classes

    assert (ROOT / "deploy" / "dra" / "deviceclasses.yaml").read_bytes() == DEVICE_CLASSES.read_bytes(), (
        "deploy/dra/deviceclasses.yaml differs from src/gpuplane/data/dra-deviceclasses.yaml: copy one onto the other")
    assert device_classes() == CLASSES


@pytest.mark.parametrize("doc", CLASSES + EXAMPLE + ALLOCATION_EXAMPLE,
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
@pytest.mark.parametrize("version", ["1.34", "1.35"])
def test_the_manifests_pass_the_strict_schema(doc: dict[str, Any], version: str) -> None:
    assert kubernetes_validate.validate(doc, version, strict=True) == version


@pytest.mark.parametrize(("name", "kind"), sorted(KIND_OF_CLASS.items(), key=lambda kv: kv[0]))
def test_each_class_picks_exactly_its_kind_of_device(name: str, kind: DeviceKind) -> None:
    devices = node_devices()
    expected = {n for n in devices if (r := parse_device_name(n)) is not None and r.kind is kind}
    assert chosen(name, devices) == expected
    # 2 cards: 2 whole cards, 2 x 25 MIG placements, 2 vGPU devices
    assert len(expected) == {DeviceKind.CARD: 2, DeviceKind.MIG: 50, DeviceKind.VGPU: 2}[kind]


def test_the_classes_cover_every_device_once() -> None:
    devices = node_devices()
    picked = [n for name in KIND_OF_CLASS for n in chosen(name, devices)]
    assert sorted(picked) == sorted(devices)
    assert {c["metadata"]["name"] for c in CLASSES} == set(KIND_OF_CLASS)


def test_another_driver_s_devices_match_no_class() -> None:
    devices = node_devices()
    assert all(chosen(name, devices, driver="gpu.nvidia.com") == set() for name in KIND_OF_CLASS)


def test_the_whole_card_class_is_the_extended_resource_gpuplane_io_gpu() -> None:
    mapped = {c["metadata"]["name"]: c["spec"].get("extendedResourceName") for c in CLASSES}
    assert mapped == {"gpu.gpuplane.io": RES_GPU, "mig.gpu.gpuplane.io": None, "vgpu.gpu.gpuplane.io": None}
    assert RES_GPU == "gpuplane.io/gpu"


def test_a_selector_naming_an_attribute_no_device_has_fails_the_evaluation() -> None:
    # the check above can fail: a misspelt attribute is an evaluation error, not a silent non-match
    devices = node_devices()
    with pytest.raises(SelectorError):
        typo = 'device.attributes["gpu.gpuplane.io"].modle == "x"'
        chosen("gpu.gpuplane.io", devices, extra=[{"cel": {"expression": typo}}])


def _requests(template: str) -> list[dict[str, Any]]:
    [doc] = [d for d in EXAMPLE if d["kind"] == "ResourceClaimTemplate" and d["metadata"]["name"] == template]
    return [r["exactly"] for r in doc["spec"]["spec"]["devices"]["requests"]]


def test_the_example_s_mig_request_picks_the_3g_placements() -> None:
    [request] = _requests("one-3g")
    picked = chosen(request["deviceClassName"], node_devices(), extra=request["selectors"])
    assert picked == {"gpu-0-mig-9-0", "gpu-0-mig-9-4", "gpu-1-mig-9-0", "gpu-1-mig-9-4"}  # starts 0 and 4


@pytest.mark.parametrize(("memory", "expected"), [(80, {"gpu-0", "gpu-1"}), (40, set())])
def test_the_example_s_big_card_request_compares_the_memory_quantity(memory: int, expected: set[str]) -> None:
    [request] = _requests("big-card")
    infos = FakeGpuBackend(2, memory * GIB, name="NVIDIA A100-SXM4-80GB").describe()
    slices = resource_slices(infos, A100, SliceSettings("node-a", mig_mode=MigMode.OFF))
    devices = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    assert chosen(request["deviceClassName"], devices, extra=request["selectors"]) == expected


def test_the_example_s_vgpu_request_fits_the_device_s_capacity_and_policy() -> None:
    [request] = _requests("quarter-card")
    devices = node_devices()
    [name] = chosen(request["deviceClassName"], devices) & {"gpu-0-vgpu"}
    capacity = devices[name]["capacity"]
    for key, raw in request["capacity"]["requests"].items():
        asked, policy = quantity(raw, "", key), capacity[key]["requestPolicy"]["validRange"]
        low, high, step = (quantity(policy[k], "", k) for k in ("min", "max", "step"))
        assert low <= asked <= high and (asked - low) % step == Decimal(0)
    assert quantity("20Gi", "", "") == 20480 * (1 << 20)  # the share HAMi-core limits to 20480 MiB
