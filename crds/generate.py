"""Write the CRDs and the API reference from the models: `python -m rlfleet.crds.generate [--check]`.

    crds/<plural>.yaml       one CustomResourceDefinition per kind (kubectl apply -f crds/)
    docs/api-reference.md    every field with type, default, bounds, description, and the rules

`--check` writes nothing and exits 1 when a committed file differs from what the models generate.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from rlfleet.crds.crd import HEADER, all_crds
from rlfleet.crds.docs import render
from rlfleet.util.generated import write_or_check

CRD_DIR = Path(__file__).resolve().parent
REPO_ROOT = CRD_DIR.parent
DOCS_PATH = REPO_ROOT / "docs" / "api-reference.md"


class _Dumper(yaml.SafeDumper):
    """Block style; long strings folded by yaml itself; no anchors."""

    def ignore_aliases(self, data):
        return True


def crd_yaml(doc: dict) -> str:
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def generated_files(crd_dir: Path = CRD_DIR, docs_path: Path = DOCS_PATH) -> dict[Path, str]:
    """Every generated file and its content."""
    files = {crd_dir / f"{kind.plural}.yaml": crd_yaml(doc) for kind, doc in all_crds()}
    files[docs_path] = render()
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.crds.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    parser.add_argument("--crd-dir", type=Path, default=CRD_DIR)
    parser.add_argument("--docs", type=Path, default=DOCS_PATH)
    args = parser.parse_args(argv)
    return write_or_check(generated_files(args.crd_dir, args.docs), check=args.check,
                          what="CRDs and API reference are", remedy="make crds")


if __name__ == "__main__":
    raise SystemExit(main())
