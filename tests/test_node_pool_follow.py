"""The device plugin follows its node's GpuPool: the pool its `gpuplane.io/pool` label names gives the split and the
MIG mode, the flags apply otherwise.

The GpuPools and the node live in the fake API server (real HTTP, real informers); kubelet is the fake one over
real unix-socket gRPC; the cards are a `FakeGpuBackend`. The MIG cases drive the reconcile in virtual time
(`tests.test_node_mig.MigNode`). The command runs as a real child process against the fake API server.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from tests.fake_kubelet import WAIT_S, FakeKubelet
from tests.test_node_mig import GRACE_S, MigNode

from gpuplane.kube.api import node_path
from gpuplane.kube.crds import API_VERSION, GPU_POOL
from gpuplane.kube.localapi import FakeApiServer, node_json
from gpuplane.kube.objects import INVENTORY, POOL_LABEL, NodeInventory
from gpuplane.model import MigMode, default_catalog
from gpuplane.node.allocation import MemoryAssignmentSource
from gpuplane.node.device_plugin import DevicePlugin, MigReconcile, PluginSettings, Sharing, publish_inventory
from gpuplane.node.gpu import GIB, FakeGpuBackend
from gpuplane.node.pool_follow import FLAGS, PoolSharingSource, choose_sharing

NODE = "gpu-node-1"
FLAG_SHARING = Sharing(3, None)
"""The command line's: --split 3, no --mig-mode."""


def gpu_pool(name: str = "shared", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuPool", "metadata": {"name": name},
            "spec": {"models": ["H100-80GB"], **spec}}


def labelled(pool: str | None) -> dict[str, str]:
    return {POOL_LABEL: pool} if pool is not None else {}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- choosing (no server) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pools", "labels", "expected", "pool", "why"),
    [
        # the node's pool gives split 4 and MIG mode on
        ([gpu_pool(split=4, migMode="on")], labelled("shared"), Sharing(4, MigMode.ON), "shared", ""),
        # left out, the CRD's defaults: split 10, dynamic
        ([gpu_pool()], labelled("shared"), Sharing(10, MigMode.DYNAMIC), "shared", ""),
        # another pool's settings are not this node's
        ([gpu_pool("other", split=2), gpu_pool(split=5)], labelled("shared"), Sharing(5, MigMode.DYNAMIC),
         "shared", ""),
        # no label: the flags
        ([gpu_pool(split=4)], labelled(None), FLAG_SHARING, FLAGS, "the node has no gpuplane.io/pool label"),
        # a label naming no GpuPool (set by hand, say): the flags
        ([gpu_pool(split=4)], labelled("gone"), FLAG_SHARING, FLAGS, "no GpuPool gone"),
        # an invalid pool: the flags, with the field
        ([gpu_pool(split=0)], labelled("shared"), FLAG_SHARING, FLAGS, "GpuPool shared is invalid: spec.split"),
        ([gpu_pool(migMode="auto")], labelled("shared"), FLAG_SHARING, FLAGS,
         "GpuPool shared is invalid: spec.migMode"),
        # ... invalid as the operator sees it too: a card model the catalog does not know
        ([gpu_pool(models=["X9000"], split=4)], labelled("shared"), FLAG_SHARING, FLAGS,
         "GpuPool shared is invalid: spec.models[0]"),
    ],
)
def test_the_pool_the_label_names_gives_split_and_mig_mode(pools: list[dict[str, Any]], labels: Mapping[str, str],
                                                           expected: Sharing, pool: str, why: str) -> None:
    choice = choose_sharing(pools, labels, FLAG_SHARING, default_catalog())
    assert (choice.sharing, choice.pool) == (expected, pool)
    assert choice.why.startswith(why) and bool(choice.why) == bool(why)
    assert choice.invalid == ("invalid" in why)


# -- the plugin following the pool, through the API server ----------------------------------------------------


class Rig:
    """A node and its GpuPools in the fake API server; a device plugin on 2 fake H100s publishing its inventory
    there, fed by a running `PoolSharingSource`, and the fake kubelet."""

    def __init__(self, server: FakeApiServer, directory: Path, labels: Mapping[str, str],
                 pools: list[dict[str, Any]], *, mig: bool = False) -> None:
        self.server = server
        for obj in pools:
            server.add_object(GPU_POOL.path(), obj)
        server.add_node(node_json(NODE, model=None, labels=labels))
        self.backend = FakeGpuBackend(2, 80 * GIB, name="NVIDIA H100 80GB HBM3", uuid_prefix="h100",
                                      mig_model=default_catalog().get("H100-80GB") if mig else None)
        self.kubelet = FakeKubelet(directory)
        self.kubelet.start()
        self.plugin = DevicePlugin(PluginSettings(NODE, directory, split=FLAG_SHARING.split), self.backend,
                                   MemoryAssignmentSource(), publish=functools.partial(publish_inventory, server.api,
                                                                                       NODE))
        self.pools = PoolSharingSource(server.api, NODE, FLAG_SHARING, refresh_s=0.05)
        self.stop = threading.Event()
        # as the command does: the pool's sharing before the first list, then its changes as they come
        self.pools.start()
        assert self.pools.wait_synced(WAIT_S)
        self.plugin.set_sharing(self.pools.resolve().sharing)
        self.feeder = threading.Thread(target=self.pools.run, args=(self.plugin.set_sharing, self.stop))
        self.feeder.start()
        self.plugin.start()
        self.kubelet.wait_registered()

    def close(self) -> None:
        self.stop.set()
        self.pools.stop()
        self.feeder.join(WAIT_S)
        self.plugin.stop(0)
        self.kubelet.stop()

    def units_per_card(self, devices: list[Any]) -> dict[str, int]:
        per_card: dict[str, int] = {}
        for device in devices:
            uuid, _, k = device.id.rpartition("::")
            per_card[uuid] = per_card.get(uuid, 0) + 1
            assert int(k) < per_card[uuid]  # <uuid>::0 .. <uuid>::split-1, in order
        return per_card

    def inventory(self) -> NodeInventory | None:
        node = self.server.get("nodes", NODE)
        raw = ((node or {}).get("metadata", {}).get("annotations") or {}).get(INVENTORY)
        return NodeInventory.decode(raw) if raw else None

    def edit_pool(self, name: str, **spec: Any) -> None:
        self.server.api.patch(GPU_POOL.path(name=name), {"spec": spec})

    def relabel(self, pool: str | None) -> None:
        self.server.api.patch(node_path(NODE), {"metadata": {"labels": {POOL_LABEL: pool}}})


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    directory = Path(tempfile.mkdtemp(prefix="gppool-", dir="/tmp"))  # unix socket paths ≤ 107 bytes
    made: list[Rig] = []
    with FakeApiServer() as server:
        def make(labels: Mapping[str, str], pools: list[dict[str, Any]], **kwargs: Any) -> Rig:
            made.append(Rig(server, directory, labels, pools, **kwargs))
            return made[-1]
        try:
            yield make
        finally:
            for r in made:
                r.close()
            shutil.rmtree(directory, ignore_errors=True)


def test_the_pools_split_is_advertised_and_published_and_follows_edits_and_relabels(
        rig: Callable[..., Rig]) -> None:
    r = rig(labelled("shared"), [gpu_pool(split=4)])
    uuids = [r.backend.uuid(0), r.backend.uuid(1)]
    # the first list already has the pool's split: 2 cards × 4, not the flags' 3
    assert r.units_per_card(r.kubelet.next_list()) == dict.fromkeys(uuids, 4)
    assert r.kubelet.allocatable == 8
    inventory = r.inventory()
    assert inventory is not None and inventory.split == 4 and inventory.mig_mode is MigMode.DYNAMIC  # pool default

    # the pool edited to split 2: an update to kubelet, 2 × 2 units; the inventory follows
    r.edit_pool("shared", split=2)
    assert r.units_per_card(r.kubelet.next_list()) == dict.fromkeys(uuids, 2) and r.kubelet.allocatable == 4
    wait_for(lambda: (i := r.inventory()) is not None and i.split == 2, "the inventory to say split 2")

    # relabelled out of any pool: the flags' split 3
    r.relabel(None)
    assert r.units_per_card(r.kubelet.next_list()) == dict.fromkeys(uuids, 3) and r.kubelet.allocatable == 6
    wait_for(lambda: (i := r.inventory()) is not None and i.split == 3, "the inventory to say split 3")
    assert r.pools.choice.pool == FLAGS and "no gpuplane.io/pool label" in r.pools.choice.why


def test_a_unit_of_the_split_before_a_shrink_is_still_accepted(rig: Callable[..., Rig]) -> None:
    r = rig(labelled("shared"), [gpu_pool(split=4)])
    r.kubelet.next_list()
    r.edit_pool("shared", split=2)
    r.kubelet.next_list()
    # kubelet picked <card>::3 from the list before the shrink: not an unknown device (no pod waits here, so the
    # refusal is the next check's: no pod to match), while ::4 never was one
    with pytest.raises(grpc.RpcError) as info:
        r.kubelet.allocate([[f"{r.backend.uuid(0)}::3"]])
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        r.kubelet.allocate([[f"{r.backend.uuid(0)}::4"]])
    assert info.value.code() is grpc.StatusCode.NOT_FOUND and "::<0..1>" in str(info.value.details())


def test_an_invalid_pool_leaves_the_flags_in_force_and_says_why_once(rig: Callable[..., Rig],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuplane.node.pool_follow")
    r = rig(labelled("shared"), [gpu_pool(split=4)])
    assert r.units_per_card(r.kubelet.next_list()) == dict.fromkeys([r.backend.uuid(0), r.backend.uuid(1)], 4)
    # the API server's schema would refuse split 0; one stored before the CRD had it is what the plugin can meet
    r.server.mutate("gpupools", "shared", lambda pool: pool["spec"].update(split=0))
    assert len(r.kubelet.next_list()) == 6  # back to the flags' 3 per card
    wait_for(lambda: (i := r.inventory()) is not None and i.split == 3, "the inventory to say split 3")
    time.sleep(0.2)  # a few refreshes (refresh_s 0.05) with nothing new: no new line
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "GpuPool shared is invalid: spec.split" in warnings[0], warnings
    assert "flags' split 3" in warnings[0]


def test_a_pool_with_mig_mode_on_publishes_it_and_puts_the_cards_in_mig_mode(rig: Callable[..., Rig]) -> None:
    r = rig(labelled("mig"), [gpu_pool("mig", split=7, migMode="on")], mig=True)
    inventory = r.inventory()
    assert inventory is not None and inventory.mig_mode is MigMode.ON and inventory.split == 7
    assert [c.mig_enabled for c in r.backend.describe()] == [False, False]
    r.plugin.tick()  # the reconcile: ON keeps the cards in MIG mode
    assert [c.mig_enabled for c in r.backend.describe()] == [True, True]
    r.edit_pool("mig", migMode="dynamic")
    wait_for(lambda: (i := r.inventory()) is not None and i.mig_mode is MigMode.DYNAMIC, "the inventory: dynamic")


# -- MIG mode off: never entered, never forced out -----------------------------------------------------------


def test_mode_off_never_enters_mig_mode_for_an_allocate() -> None:
    with MigNode() as node:
        node.plugin.set_sharing(Sharing(10, MigMode.OFF))
        with pytest.raises(grpc.RpcError) as info:
            node.add("late", 0, 19, 0)  # a 1g share assigned before the node went off
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "MIG mode is off" in str(info.value.details())
        assert node.mig_enabled() is False and node.layout() == []


def test_a_card_with_a_live_mig_instance_is_not_forced_out_when_the_pool_says_off(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuplane.node.device_plugin")
    with MigNode(2) as node:
        kept = node.add("kept", 0, 9, 4)  # card 0: 3g.40gb at 4, held by a live pod
        node.add("done", 1, 19, 0)  # card 1: 1g.10gb at 0, whose pod ends below
        node.delete("done")
        node.plugin.set_sharing(Sharing(10, MigMode.OFF))
        assert node.at(0.0).mig_off == ()
        done = node.at(GRACE_S)  # card 1: unheld and unwanted since 0 → destroyed, and out of MIG mode
        assert [m.card for m in done.destroyed] == [1] and done.mig_off == (1,) and done.errors == ()
        for t in (GRACE_S + 1, 10 * GRACE_S):  # card 0 stays as it is, round after round
            assert node.at(t) == MigReconcile() and node.uuids(0) == [kept] and node.mig_enabled(0) is True
        kept_lines = [r.getMessage() for r in caplog.records if "stays in MIG mode" in r.getMessage()]
        assert len(kept_lines) == 1 and kept_lines[0].startswith("card 0:")  # logged once
        node.delete("kept")  # its pod ends: the instance goes after the grace, then MIG mode
        assert node.at(20 * GRACE_S) == MigReconcile()
        done = node.at(21 * GRACE_S)
        assert [m.uuid for m in done.destroyed] == [kept] and done.mig_off == (0,)
        assert node.mig_enabled(0) is False and node.mig_enabled(1) is False


# -- the command -------------------------------------------------------------------------------------------


def test_the_command_takes_the_split_from_the_nodes_pool(tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="gppool-", dir="/tmp"))
    kubelet = FakeKubelet(directory)
    kubelet.start()
    with FakeApiServer() as server:
        server.add_object(GPU_POOL.path(), gpu_pool(split=4))
        server.add_node(node_json(NODE, model=None, labels=labelled("shared")))
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        script = ("import typer; from gpuplane.cli.device_plugin_cmd import register; app = typer.Typer(); "
                  "register(app); app()")
        env = {**os.environ, "NODE_NAME": NODE, "KUBERNETES_SERVICE_HOST": ""}
        proc = subprocess.Popen([sys.executable, "-c", script, "device-plugin", "--dir", str(directory),
                                 "--fake-cards", "2", "--fake-model", "H100-80GB", "--split", "3",
                                 "--kubeconfig", str(kubeconfig), "--interval", "0.1"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            kubelet.wait_registered()
            assert len(kubelet.next_list()) == 8  # 2 cards × the pool's 4, from the first list
            server.api.patch(GPU_POOL.path(name="shared"), {"spec": {"split": 2}})
            assert len(kubelet.next_list()) == 4
            wait_for(lambda: NodeInventory.decode((server.get("nodes", NODE) or {})["metadata"]["annotations"]
                                                  .get(INVENTORY, '{"model": "x", "cards": []}')).split == 2,
                     "the published inventory to say split 2")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=WAIT_S)
            kubelet.stop()
            shutil.rmtree(directory, ignore_errors=True)
    assert proc.returncode == 0, stderr
    assert "2 cards × 4 units" in stderr and "from GpuPool shared" in stderr

