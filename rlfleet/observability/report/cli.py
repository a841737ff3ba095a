"""`rlfleet report RUN`: write a run's report (HTML with plots, and a PNG of the main panel)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfleet.observability.report import ReportError, find_summary, load_summary, report_path_for, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet report", description=__doc__)
    parser.add_argument("run", type=Path, help="a run directory holding the summary JSON, or the summary itself")
    parser.add_argument("-o", "--output", type=Path,
                        help="the HTML file (default: beside the summary, <name>-report.html); the PNG goes beside it")
    args = parser.parse_args(argv)
    try:
        summary = find_summary(args.run)
        data = load_summary(summary)
    except ReportError as exc:
        print(f"rlfleet report: {exc}", file=sys.stderr)
        return 2
    written = write_report(data, args.output or report_path_for(summary), title=f"rlfleet run: {summary.name}")
    print(f"rlfleet report: {written.html} (main panel {written.png})")
    return 0
