"""Where the pinned external binaries live, and a clear error when one is missing.

Each binary is cached under ~/.cache/rlfleet/<name>-<version>/bin by scripts/build-binaries.sh;
an environment variable RLFLEET_<NAME> (e.g. RLFLEET_KUBE_APISERVER) may point at another copy.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(os.environ.get("RLFLEET_CACHE", Path.home() / ".cache" / "rlfleet"))

KUBERNETES_VERSION = "v1.35.4"
ETCD_VERSION = "v3.6.16"
HELM_VERSION = "v3.22.0"
PROMETHEUS_VERSION = "2.42.0"


@dataclass(frozen=True)
class Tool:
    name: str
    bundle: str  # cache folder name: <bundle>-<version>
    version: str
    build_target: str  # argument to scripts/build-binaries.sh


TOOLS = {
    t.name: t
    for t in (
        Tool("kube-apiserver", "kubernetes", KUBERNETES_VERSION, "kubernetes"),
        Tool("kube-controller-manager", "kubernetes", KUBERNETES_VERSION, "kubernetes"),
        Tool("kubectl", "kubernetes", KUBERNETES_VERSION, "kubernetes"),
        Tool("etcd", "etcd", ETCD_VERSION, "etcd"),
        Tool("helm", "helm", HELM_VERSION, "helm"),
        Tool("prometheus", "prometheus", PROMETHEUS_VERSION, "prometheus"),
        Tool("promtool", "prometheus", PROMETHEUS_VERSION, "prometheus"),
    )
}


class MissingTool(RuntimeError):
    """A pinned binary is not in the cache."""


def tool_path(name: str) -> Path:
    """Return the path of a pinned binary, or raise MissingTool saying how to get it."""
    tool = TOOLS[name]
    override = os.environ.get("RLFLEET_" + name.upper().replace("-", "_"))
    if override:
        path = Path(override)
    else:
        path = CACHE_DIR / f"{tool.bundle}-{tool.version}" / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise MissingTool(
            f"{name} {tool.version} is missing: expected an executable at {path}. "
            f"Build it with `scripts/build-binaries.sh {tool.build_target}` (or `make setup`)."
        )
    return path


def python_executable() -> str:
    """The interpreter that runs SGLang, the router and rlfleet subprocesses: this one."""
    return sys.executable
