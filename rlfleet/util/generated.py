"""Files generated from code and committed (CRDs, the API reference, dashboards): write or check them.

One loop for every generator's `--check`: a committed file that differs from what its code generates is
stale; `--check` names each one and fails, otherwise the stale ones are rewritten.
"""
from __future__ import annotations

import sys
from pathlib import Path


def stale_files(files: dict[Path, str]) -> list[Path]:
    """The paths of `files` whose committed content is missing or differs."""
    return [p for p, text in files.items() if not p.exists() or p.read_text() != text]


def write_or_check(files: dict[Path, str], *, check: bool, what: str, remedy: str) -> int:
    """Exit status of a generator: with `check`, 1 when any file is stale (each named, with `remedy`);
    without it, every stale file written (0)."""
    stale = stale_files(files)
    if check:
        for path in stale:
            print(f"{path}: differs from what the code generates; run `{remedy}`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path])
        print(f"wrote {path}")
    if not stale:
        print(f"{what} up to date")
    return 0
