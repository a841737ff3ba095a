"""The chart's Grafana dashboards, generated from Python: `python -m rlfleet.observability.dashboards [--check]`.

Each dashboard is built with Grafana's foundation SDK (a development-time dependency, requirements-dev.lock)
and every query from the metric objects in rlfleet/observability/metrics.py (`query.series`), so a renamed
metric renames its panels. The JSON under charts/rlfleet/dashboards/ is this module's output, committed
for helm; `--check` writes nothing and exits 1 when a committed file differs from what the code generates.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlfleet.util.generated import write_or_check

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.observability.dashboards",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    parser.add_argument("--dir", type=Path, default=DASHBOARD_DIR, help="where the dashboard JSON files go")
    args = parser.parse_args(argv)
    return write_or_check(generated_files(args.dir), check=args.check, what="dashboards are",
                          remedy="make dashboards")
