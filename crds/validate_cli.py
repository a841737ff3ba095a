"""`rlfleet validate FILE...`: check manifests with the same rules as the API server.

Prints every error as `FILE: Kind/name: field.path: message`, and one `valid` line per good object.
Exit status: 0 when every object of every file is valid, 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfleet.crds.loader import Document, FieldError, ManifestError, derivation_errors, load_file, validate_update
from rlfleet.crds.models import TrainingRun


def _report(source: str, documents: list[Document], quiet: bool) -> int:
    bad = 0
    if not documents:
        print(f"{source}: no objects")
        return 1
    for doc in documents:
        if doc.errors:
            bad += 1
            for error in doc.errors:
                print(f"{source}: {doc.label}: {error}")
        elif not quiet:
            print(f"{source}: {doc.label}: valid")
    return bad


def _expand(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        else:
            out.append(path)
    return out


def _print_errors(source: str, label: str, errors: list[FieldError]) -> None:
    for error in errors:
        print(f"{source}: {label}: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet validate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "files", nargs="+", type=Path, metavar="FILE",
        help="manifest files (YAML, several documents each), or directories of *.yaml / *.yml files",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    parser.add_argument(
        "--previous", type=Path, metavar="FILE",
        help="also check FILE's objects (same kind and name) -> FILES as updates: immutable fields may not change",
    )
    args = parser.parse_args(argv)

    previous: dict[tuple[str | None, str | None], Document] = {}
    failed = False
    if args.previous:
        try:
            previous = {(d.kind, d.name): d for d in load_file(args.previous)}
        except ManifestError as exc:
            _print_errors(exc.source, "previous", exc.errors)
            return 1

    for path in _expand(args.files):
        try:
            documents = load_file(path)
        except ManifestError as exc:
            _print_errors(exc.source, "file", exc.errors)
            failed = True
            continue
        for doc in documents:  # what the operator and `rlfleet run` refuse beyond the API server's schema
            if not doc.errors and isinstance(doc.obj, TrainingRun):
                doc.errors.extend(derivation_errors(doc.obj.spec))
        failed |= _report(str(path), documents, args.quiet) > 0
        for doc in documents:
            old = previous.get((doc.kind, doc.name))
            if old is not None and not doc.errors:
                errors = validate_update(old.data, doc.data)
                _print_errors(str(path), doc.label + " (update)", errors)
                failed |= bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
