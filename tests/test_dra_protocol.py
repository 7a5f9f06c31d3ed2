"""The DRA plugin's protocol files against upstream kubelet's: the wire items (package, services, RPCs and their
types, messages, field names, numbers, types and labels, enums) of `draplugin.proto`, `pluginregistration.proto`
and `drahealth.proto`, as grpc_tools compiles them, must equal those transcribed from the upstream files
(tests/fixtures/dra_wire.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from gpuplane.node.dra_health import health_protocol
from gpuplane.node.dra_plugin import DRA_PLUGIN_SERVICE, PLUGIN_TYPE, dra_protocol, registration_protocol

FIXTURE = Path(__file__).parent / "fixtures" / "dra_wire.json"
UPSTREAM: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))

_TYPES = {FieldDescriptor.TYPE_STRING: "string", FieldDescriptor.TYPE_BOOL: "bool",
          FieldDescriptor.TYPE_INT64: "int64", FieldDescriptor.TYPE_INT32: "int32",
          FieldDescriptor.TYPE_BYTES: "bytes", FieldDescriptor.TYPE_UINT32: "uint32",
          FieldDescriptor.TYPE_UINT64: "uint64", FieldDescriptor.TYPE_DOUBLE: "double"}


def _field(f: Any) -> list[Any]:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return [f.number, f"map<{_TYPES[key.type]},{_type(value)}>", "map"]
    repeated = f.is_repeated
    return [f.number, _type(f), "repeated" if repeated else "optional"]


def _type(f: Any) -> str:
    if f.enum_type is not None:
        return str(f.enum_type.name)
    return f.message_type.name if f.message_type is not None else _TYPES[f.type]


def wire_items(file: Any) -> dict[str, Any]:
    """The wire-relevant items of a compiled file descriptor, in the fixture's form."""
    services = {s.name: {m.name: [m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming]
                         for m in s.methods}
                for s in file.services_by_name.values()}
    messages = {m.name: {f.name: _field(f) for f in m.fields} for m in file.message_types_by_name.values()}
    items = {"package": file.package, "services": services, "messages": messages}
    if file.enum_types_by_name:
        items["enums"] = {e.name: {v.name: v.number for v in e.values} for e in file.enum_types_by_name.values()}
    return items


def differences(ours: dict[str, Any], upstream: dict[str, Any], where: str = "") -> list[str]:
    """Every path where the two differ (missing on one side, or a different value)."""
    if isinstance(ours, dict) and isinstance(upstream, dict):
        found = []
        for key in sorted(set(ours) | set(upstream)):
            if key not in ours:
                found.append(f"{where}/{key}: missing in ours")
            elif key not in upstream:
                found.append(f"{where}/{key}: not upstream")
            else:
                found += differences(ours[key], upstream[key], f"{where}/{key}")
        return found
    return [] if ours == upstream else [f"{where}: ours {ours!r}, upstream {upstream!r}"]


OURS = {"draplugin.proto": dra_protocol().messages.DESCRIPTOR,
        "pluginregistration.proto": registration_protocol().messages.DESCRIPTOR,
        "drahealth.proto": health_protocol().messages.DESCRIPTOR}


@pytest.mark.parametrize("name", sorted(OURS))
def test_our_proto_has_no_wire_difference_from_upstream(name: str) -> None:
    assert differences(wire_items(OURS[name]), UPSTREAM["files"][name]) == []


def test_the_registration_constants_are_upstream_s() -> None:
    assert UPSTREAM["constants"] == {"DRAPluginService": DRA_PLUGIN_SERVICE, "DRAPlugin": PLUGIN_TYPE}


@pytest.mark.parametrize(("path", "value", "expected"), [
    # a renumbered field, a retyped field, a renamed RPC, a streaming flag, a lost message, a package
    (("draplugin.proto", "messages", "Claim", "uid"), [4, "string", "optional"], "/messages/Claim/uid"),
    (("draplugin.proto", "messages", "Device", "pool_name"), [2, "bytes", "optional"], "/messages/Device/pool_name"),
    (("pluginregistration.proto", "messages", "PluginInfo", "supported_versions"), [4, "string", "optional"],
     "/messages/PluginInfo/supported_versions"),
    (("draplugin.proto", "services", "DRAPlugin", "NodePrepareResources"),
     ["NodePrepareResourcesRequest", "NodePrepareResourcesResponse", False, True],
     "/services/DRAPlugin/NodePrepareResources"),
    (("pluginregistration.proto", "package"), "v1", "/package"),
    # an enum value renumbered
    (("drahealth.proto", "enums", "HealthStatus", "UNHEALTHY"), 3, "/enums/HealthStatus/UNHEALTHY"),
])
def test_the_diff_finds_a_changed_wire_item(path: tuple[str, ...], value: Any, expected: str) -> None:
    upstream = copy.deepcopy(UPSTREAM["files"])
    node = upstream
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    found = differences(wire_items(OURS[path[0]]), upstream[path[0]])
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_diff_finds_a_missing_message() -> None:
    upstream = copy.deepcopy(UPSTREAM["files"]["draplugin.proto"])
    upstream["messages"]["ClaimStatus"] = {"state": [1, "string", "optional"]}
    assert differences(wire_items(OURS["draplugin.proto"]), upstream) == ["/messages/ClaimStatus: missing in ours"]
