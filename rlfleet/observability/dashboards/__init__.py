"""The chart's Grafana dashboards, generated from Python: `python -m rlfleet.observability.dashboards [--check]`.

Each dashboard is built with Grafana's foundation SDK (a development-time dependency, requirements-dev.lock)
and every query from the metric objects in rlfleet/observability/metrics.py (`query.series`), so a renamed
metric renames its panels. The JSON under charts/rlfleet/dashboards/ is this module's output, committed
for helm; `--check` writes nothing and exits 1 when a committed file differs from what the code generates.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DASHBOARD_DIR = Path(__file__).resolve().parents[3] / "charts" / "rlfleet" / "dashboards"


def generated_files(directory: Path = DASHBOARD_DIR) -> dict[Path, str]:
    """Every dashboard file and its content."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    from rlfleet.observability.dashboards import fleet, training

    files = {}
    for build in (fleet.build, training.build):
        board = build().build()
        files[directory / f"{board.uid}.json"] = json.dumps(board, cls=JSONEncoder, indent=2) + "\n"
    return files


def stale_files(files: dict[Path, str]) -> list[Path]:
    return [p for p, text in files.items() if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.observability.dashboards",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    parser.add_argument("--dir", type=Path, default=DASHBOARD_DIR, help="where the dashboard JSON files go")
    args = parser.parse_args(argv)
    files = generated_files(args.dir)
    stale = stale_files(files)
    if args.check:
        for path in stale:
            print(f"{path}: differs from what the code generates; run `make dashboards`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path])
        print(f"wrote {path}")
    if not stale:
        print("dashboards are up to date")
    return 0
