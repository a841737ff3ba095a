"""The pinned binaries are where tools.py says, are the pinned versions, and a missing one says how to get it."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rlfleet.devcluster.control_plane import ControlPlane
from rlfleet.util import binaries as tools
from rlfleet.util.binaries import MissingTool, tool_path

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(tools, "CACHE_DIR", tmp_path)
    for name in tools.TOOLS:
        monkeypatch.delenv("RLFLEET_" + name.upper().replace("-", "_"), raising=False)
    return tmp_path


@pytest.mark.parametrize("name, target", [("kube-apiserver", "kubernetes"), ("etcd", "etcd"), ("helm", "helm"),
                                          ("promtool", "prometheus")])
def test_missing_binary_names_itself_and_the_build_script(empty_cache: Path, name: str, target: str) -> None:
    with pytest.raises(MissingTool) as raised:
        tool_path(name)
    message = str(raised.value)
    assert name in message
    assert str(empty_cache) in message
    assert f"scripts/build-binaries.sh {target}" in message


def test_control_plane_with_a_missing_binary_fails_before_starting_anything(empty_cache: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "plane"
    with pytest.raises(MissingTool, match=r"etcd .*scripts/build-binaries\.sh etcd"):
        ControlPlane(data_dir).start()
    assert not data_dir.exists()


def test_helm_is_the_pinned_version() -> None:
    result = subprocess.run([str(tool_path("helm")), "version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert 'Version:"v3.22.0"' in result.stdout


def test_promtool_runs() -> None:
    result = subprocess.run([str(tool_path("promtool")), "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert f"promtool, version {tools.PROMETHEUS_VERSION}" in result.stdout + result.stderr


def test_kubernetes_binaries_report_real_versions() -> None:
    for name in ("kube-apiserver", "kube-controller-manager"):
        result = subprocess.run([str(tool_path(name)), "--version"], capture_output=True, text=True, timeout=30)
        assert result.stdout.strip() == f"Kubernetes {tools.KUBERNETES_VERSION}", result.stdout + result.stderr
    kubectl = subprocess.run([str(tool_path("kubectl")), "version", "--client"], capture_output=True, text=True,
                             timeout=30)
    assert f"Client Version: {tools.KUBERNETES_VERSION}" in kubectl.stdout
    etcd = subprocess.run([str(tool_path("etcd")), "--version"], capture_output=True, text=True, timeout=30)
    assert f"etcd Version: {tools.ETCD_VERSION.lstrip('v')}" in etcd.stdout


def test_operator_folder_does_not_shadow_the_stdlib() -> None:
    # Run from the repository root, where `operator/` sits in the interpreter's working directory;
    # -S: nothing imported `operator` yet when `collections` needs it.
    script = ("import collections, operator, rlfleet.operator; print(operator.__file__); "
              "print(list(rlfleet.operator.__path__)[0])")
    for flags in ([], ["-S"]):
        argv = [sys.executable, *flags, "-c", script if not flags else "import operator; print(operator.__file__)"]
        result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.split()
        assert Path(lines[0]).parent == Path(sysconfig.get_paths()["stdlib"])
        if not flags:
            assert Path(lines[1]).resolve() == REPO_ROOT / "operator"


def test_python_dash_m_works_from_the_repository_root() -> None:
    result = subprocess.run([sys.executable, "-m", "rlfleet.cli", "--version"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("rlfleet ")


def test_dev_cluster_up_names_the_missing_binary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env["RLFLEET_CACHE"] = str(tmp_path / "empty-cache")
    result = subprocess.run([sys.executable, "-P", "-m", "rlfleet.cli", "dev-cluster", "up", "--dir",
                             str(tmp_path / "cluster")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"etcd {tools.ETCD_VERSION} is missing" in result.stderr
    assert "scripts/build-binaries.sh etcd" in result.stderr
    assert not (tmp_path / "cluster").exists()
