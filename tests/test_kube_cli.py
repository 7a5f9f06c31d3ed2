"""The Kubernetes world's commands without a cluster, and the CLI's shared error exit (`gpuplane.cli.common`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from kubernetes.config import kube_config
from typer.testing import CliRunner

from gpuplane.cli import device_plugin_cmd, extender_cmd, operator_cmd
from gpuplane.cli.common import fail


def cli() -> typer.Typer:
    app = typer.Typer()
    for module in (device_plugin_cmd, extender_cmd, operator_cmd):
        module.register(app)
    return app


@pytest.fixture
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Not in a pod, and the default kubeconfig is missing: nothing says where an API server is."""
    missing = tmp_path / "missing-kubeconfig"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(missing))
    # The client reads $KUBECONFIG once, at import: its default location is what `connect_api` falls back to.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(missing))
    return missing


@pytest.mark.parametrize(("args", "message"), [
    # No kubeconfig flag: not in a cluster, and the default file is missing.
    (["operator"], "no cluster to talk to: kubeconfig"),
    (["extender"], "--kubeconfig: cannot load a configuration: kubeconfig"),
    # The device plugin only tries the API after its cards: fake ones, and a named kubeconfig that is not there.
    (["device-plugin", "--node-name", "n", "--fake-cards", "1", "--kubeconfig", "{missing}"],
     "--kubeconfig: cannot reach the API server: kubeconfig {missing}"),
])
def test_no_cluster_exits_2_with_the_reason_and_no_traceback(no_cluster: Path, args: list[str],
                                                              message: str) -> None:
    args = [a.format(missing=no_cluster) for a in args]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)       # typer.Exit(2), not an escaping KubeConfigError
    assert "Traceback" not in result.output
    assert message.format(missing=no_cluster) in result.output
    assert "not in a cluster and cannot load it" in result.output


def test_fail_prints_field_paths_as_they_are_and_unwrapped() -> None:
    app = typer.Typer()

    @app.command("a")
    def a() -> None:
        fail("metadata.annotations[gpuplane.io/gpu-inventory].model: " + "x" * 100)

    @app.command("b")
    def b() -> None:  # a second command keeps typer from collapsing the app into `a`
        pass

    result = CliRunner().invoke(app, ["a"])
    assert result.exit_code == 2
    # Brackets are not rich markup, and a long message stays on one line.
    assert result.output == "error: metadata.annotations[gpuplane.io/gpu-inventory].model: " + "x" * 100 + "\n"
