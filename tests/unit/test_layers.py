"""The layer contract (scripts/check_layers.py) holds on the tree, and the check fails when it is broken."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", REPO_ROOT / "scripts" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layers", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_tree_keeps_the_layer_contract() -> None:
    result = subprocess.run([sys.executable, "-P", str(REPO_ROOT / "scripts" / "check_layers.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layer contract kept" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    check = _checker().check
    root = _package(tmp_path, {
        "rlfleet/__init__.py": "",
        "rlfleet/low/__init__.py": "",
        "rlfleet/low/a.py": "from rlfleet.high import b\n",
        "rlfleet/high/__init__.py": "",
        "rlfleet/high/b.py": "",
    })
    problems = check(root, layers=["rlfleet.low", "rlfleet.high"], forbidden=[])
    assert problems == ["rlfleet/low/a.py:1: rlfleet.low.a (layer rlfleet.low) imports rlfleet.high.b "
                        "from the higher layer rlfleet.high"]


def test_independent_components_and_cycles_are_reported(tmp_path: Path) -> None:
    check = _checker().check
    root = _package(tmp_path, {
        "rlfleet/__init__.py": "",
        "rlfleet/x/__init__.py": "",
        "rlfleet/x/one.py": "import rlfleet.x.two\n",
        "rlfleet/x/two.py": "from rlfleet.x import one\n",
        "rlfleet/y/__init__.py": "",
        "rlfleet/y/three.py": "def later():\n    from rlfleet.x import one\n",
    })
    problems = check(root, layers=["rlfleet.x | rlfleet.y"], forbidden=[])
    assert "rlfleet/y/three.py:2: rlfleet.y.three imports rlfleet.x.one, but rlfleet.y and rlfleet.x are independent" \
        in problems
    assert "import cycle: rlfleet.x.one -> rlfleet.x.two -> rlfleet.x.one" in problems


def test_a_forbidden_import_and_an_unlayered_module_are_reported(tmp_path: Path) -> None:
    check = _checker().check
    root = _package(tmp_path, {
        "rlfleet/__init__.py": "",
        "rlfleet/operator/handlers.py": "from rlfleet.orchestrator.run import loop\n",
        "rlfleet/stray.py": "",
    })
    problems = check(root, layers=["rlfleet.operator"], forbidden=[("rlfleet.operator", "rlfleet.orchestrator")])
    assert "rlfleet/operator/handlers.py:1: rlfleet.operator.handlers must not import rlfleet.orchestrator.run.loop" \
        in problems
    assert "rlfleet.stray: belongs to no layer (add its package to LAYERS)" in problems


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"rlfleet": "rlfleet", "orchestrator": "rlfleet.orchestrator", "trainer": "rlfleet.trainer",
             "crds": "rlfleet.crds"}
    found = {"rlfleet.operator"}  # a namespace package (no __init__.py): see pyproject.toml
    for folder, name in roots.items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO_ROOT / folder)
            if folder == "rlfleet" and rel.parts and rel.parts[0] in ("orchestrator", "trainer", "crds", "operator"):
                continue  # the links to the top-level folders, counted under their own names
            found.add(".".join([name, *rel.parts]))
    assert found == listed
