"""The operator's dependencies apart from the trainer's: requirements-operator.lock pins exactly the closure
of pyproject's [project] dependencies at requirements.lock's versions, none of the heavy packages, and the
operator's import graph stays out of torch, SGLang and transformers. (tests/e2e/test_operator_image.py
runs the operator from an environment built from that lock alone.)"""
from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "sglang", "sglang-router", "transformers", "megatron-core", "safetensors", "numpy", "triton",
         "flashinfer-python", "cryptography"}
HEAVY_MODULES = {"torch", "sglang", "sglang_router", "transformers", "megatron", "safetensors", "numpy", "triton",
                 "flashinfer", "cryptography"}


def pins(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"{path.name}: {line!r} is not an exact pin"
            out[canonicalize_name(name)] = version
    return out


def closure(roots: list[str]) -> set[str]:
    """Every distribution the roots need (no extras), from the installed metadata."""
    seen: set[str] = set()
    todo = [Requirement(r).name for r in roots]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for text in md.distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_the_operator_lock_pins_the_full_locks_versions() -> None:
    full, operator = pins(REPO / "requirements.lock"), pins(REPO / "requirements-operator.lock")
    assert operator
    differ = {n: (v, full.get(n)) for n, v in operator.items() if full.get(n) != v}
    assert not differ, f"requirements-operator.lock differs from requirements.lock (operator, full): {differ}"


def test_the_operator_lock_is_exactly_the_closure_of_the_projects_dependencies() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = closure(project["dependencies"])
    locked = set(pins(REPO / "requirements-operator.lock"))
    assert locked == wanted, f"missing: {sorted(wanted - locked)}, not needed: {sorted(locked - wanted)}"
    assert not locked & HEAVY, sorted(locked & HEAVY)
    # The heavy packages are the trainer's and the engines' extras.
    extras = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["trainer"]}
    assert {"torch", "transformers", "megatron-core", "safetensors"} <= extras


def test_the_operator_imports_no_torch_sglang_or_transformers() -> None:
    code = ("import json, sys\n"
            "import rlfleet.cli, rlfleet.operator.main, rlfleet.operator.handlers\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "kopf" in loaded and "rlfleet" in loaded
    assert not loaded & HEAVY_MODULES, sorted(loaded & HEAVY_MODULES)


def test_the_dockerfile_builds_an_operator_image_from_the_operator_lock_only() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert {"operator", "trainer"} <= set(stages)
    assert "requirements-operator.lock" in stages["operator"]
    assert "requirements.lock" not in stages["operator"].replace("requirements-operator.lock", "")
    assert "requirements.lock" in stages["trainer"]
    assert re.search(r'^CMD \["operator"\]', stages["operator"], re.M)


def test_the_tracking_lock_adds_only_what_requirements_lock_lacks() -> None:
    """requirements-tracking.lock is installed without dependencies and layered under .venv: it must not pin
    a second copy of anything requirements.lock pins, and with it every requirement of tensorboard is pinned
    (at a version that satisfies it)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    full, tracking = pins(REPO / "requirements.lock"), pins(REPO / "requirements-tracking.lock")
    assert not set(full) & set(tracking), sorted(set(full) & set(tracking))
    both = {**full, **tracking}
    for name in tracking:
        for text in requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            wanted = canonicalize_name(req.name)
            assert wanted in both, f"{name} needs {req}, pinned in neither lock"
            assert req.specifier.contains(both[wanted], prereleases=True), f"{name} needs {req}, pinned {both[wanted]}"
