"""The layer contract of the rlfleet package, checked from the source (no imports are executed).

Each line of LAYERS is a layer, lowest first; a module may import modules of its own component or of
a lower layer, never of a higher one, and the components of one layer are independent of each other.
FORBIDDEN adds what layering alone cannot say (the operator uses only the API and the shared layers).
Every module must belong to a component, and module-level imports must have no cycle.

    python scripts/check_layers.py [ROOT]      # exit 0 when kept; 1 with every broken rule listed

ROOT is the directory holding the `rlfleet` package (default: the repository). Top-level folders are
linked into rlfleet/ (rlfleet/orchestrator -> ../orchestrator, ...), so the walk follows the links.
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Lowest first. "a | b" are independent components of one layer.
LAYERS = [
    "rlfleet.util",
    "rlfleet.errors | rlfleet.observability",
    "rlfleet.crds",
    "rlfleet.policy | rlfleet.sglang | rlfleet.kube | rlfleet.snapshot",
    "rlfleet.trainer | rlfleet.orchestrator.fleet",
    "rlfleet.orchestrator.rollout | rlfleet.orchestrator.guards | rlfleet.orchestrator.evaluation",
    "rlfleet.orchestrator.run | rlfleet.operator | rlfleet.devcluster",
    "rlfleet.cli",
]
# (importer prefix, imported prefix): never, whatever the layers say.
FORBIDDEN = [
    ("rlfleet.operator", "rlfleet.orchestrator"),
    ("rlfleet.operator", "rlfleet.trainer"),
    ("rlfleet.operator", "rlfleet.snapshot"),
    ("rlfleet.operator", "rlfleet.devcluster"),
    ("rlfleet.devcluster", "rlfleet.orchestrator"),
    ("rlfleet.devcluster", "rlfleet.trainer"),
    ("rlfleet", "helpers"),  # the test helpers are not part of the product
    ("rlfleet", "tests"),
]
# Modules that belong to no component: the package root (version and doc string only) and the
# orchestrator's package marker.
UNLAYERED = {"rlfleet", "rlfleet.orchestrator"}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    top_level: bool  # executed at import time (not inside a function or `if TYPE_CHECKING`)


def modules_under(root: Path, package: str = "rlfleet") -> dict[str, Path]:
    """Module name -> file, for every .py file under root/package (symlinked folders followed)."""
    found: dict[str, Path] = {}
    base = root / package
    for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        rel = Path(dirpath).relative_to(base)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            parts = [package, *rel.parts]
            if name != "__init__.py":
                parts.append(name[:-3])
            found[".".join(parts)] = Path(dirpath) / name
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, is_package: bool) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            # Imports inside functions or `if TYPE_CHECKING:` still count for the layers, not for cycles.
            deferred = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and _type_checking(child))
            if deferred:
                visit(child, False)
            elif isinstance(child, ast.Import):
                found.extend(Import(module, a.name, child.lineno, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in child.names:
                    found.append(Import(module, f"{base}.{a.name}" if a.name != "*" else base, child.lineno, top))
            else:
                visit(child, top)

    visit(tree, True)
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import names (`from a.b import c` may name module a.b.c or attribute c of a.b)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def component_of(module: str, components: list[str]) -> str | None:
    best = None
    for c in components:
        if (module == c or module.startswith(c + ".")) and (best is None or len(c) > len(best)):
            best = c
    return best


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        scc.append(member)
                        if member == node:
                            break
                    if len(scc) > 1:
                        result.append(sorted(scc))
    return result


def _shown(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def check(root: Path, layers: list[str] = LAYERS, forbidden: list[tuple[str, str]] = FORBIDDEN) -> list[str]:
    """Every broken rule, as one line each naming the file and line; empty when the contract is kept."""
    rank: dict[str, int] = {}
    for level, line in enumerate(layers):
        for component in (c.strip() for c in line.split("|")):
            rank[component] = level
    components = list(rank)
    modules = modules_under(root)
    problems: list[str] = []
    seen: set[str] = set()

    def report(problem: str) -> None:
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        src = component_of(module, components)
        if src is None and module not in UNLAYERED:
            report(f"{module}: belongs to no layer (add its package to LAYERS)")
        where = _shown(path, root)
        for imp in imports_of(module, path, path.name == "__init__.py"):
            for bad_src, bad_dst in forbidden:
                if (module == bad_src or module.startswith(bad_src + ".")) and (
                        imp.imported == bad_dst or imp.imported.startswith(bad_dst + ".")):
                    report(f"{where}:{imp.line}: {module} must not import {imp.imported}")
            target = resolve(imp.imported, modules) if imp.imported.startswith("rlfleet") else None
            if target is None or target == module:
                continue
            if imp.top_level:
                edges[module].add(target)
            dst = component_of(target, components)
            if src is None or dst is None or src == dst:
                continue
            if rank[dst] > rank[src]:
                report(f"{where}:{imp.line}: {module} (layer {src}) imports {target} from the higher layer {dst}")
            elif rank[dst] == rank[src]:
                report(f"{where}:{imp.line}: {module} imports {target}, but {src} and {dst} are independent")
    for cycle in _cycles(edges):
        report("import cycle: " + " -> ".join(cycle + cycle[:1]))
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    problems = check(root)
    for problem in problems:
        print(problem)
    count = len(modules_under(root))
    if problems:
        print(f"layer contract broken: {len(problems)} problem(s) in {count} modules")
        return 1
    print(f"layer contract kept: {count} modules, {len(LAYERS)} layers, no cycles")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
