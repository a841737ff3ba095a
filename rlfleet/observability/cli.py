"""`rlfleet check-monitoring`: check Grafana dashboards and Prometheus rule files against the metrics
rlfleet exports (every series a query reads must exist, with the labels it matches on)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfleet.observability import metrics, monitoring, promql

DEFAULT_CHART = Path("charts/rlfleet")


def _queries(path: Path):
    if path.suffix == ".json":
        return list(monitoring.dashboard_queries(path))
    if path.suffix in (".yaml", ".yml"):
        return list(monitoring.rule_queries(path))
    raise ValueError(f"{path}: expected a Grafana dashboard (.json) or a Prometheus rules file (.yaml)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet check-monitoring", description=__doc__)
    parser.add_argument("files", nargs="*", type=Path,
                        help="dashboard .json and rules .yaml files (default: the chart's, under charts/rlfleet)")
    args = parser.parse_args(argv)
    files = args.files or sorted((DEFAULT_CHART / "dashboards").glob("*.json")) + sorted(
        (DEFAULT_CHART / "alerts").glob("*.yaml"))
    if not files:
        parser.error(f"no files given and none found under {DEFAULT_CHART}")
    exported = promql.exported_series(metrics.REGISTRY)
    checked = bad = 0
    for path in files:
        try:
            queries = _queries(path)
        except (OSError, ValueError) as exc:
            print(f"{path}: {exc}", file=sys.stderr)
            return 2
        for where, expr in queries:
            checked += 1
            try:
                found = monitoring.problems(monitoring.grafana_to_promql(expr), exported)
            except promql.PromQLSyntaxError as exc:
                found = [str(exc)]
            for problem in found:
                bad += 1
                print(f"{where}: {problem}")
    print(f"{checked} queries in {len(files)} files checked, {bad} problems", file=sys.stderr)
    return 1 if bad else 0
