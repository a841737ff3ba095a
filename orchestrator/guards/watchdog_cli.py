"""`rlfleet watchdog replay FILE`: replay recorded rollout-error times through the 503 watchdog rule.

Prints, for each number of checks in a row, how many start offsets the rule stopped the run at, the
most strikes in a row it saw, and how long after the first error it stopped.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from pydantic import ValidationError

from rlfleet.crds.specs import WatchdogSpec
from rlfleet.orchestrator.guards.watchdog_replay import ReplayRow, TraceError, parse_trace, replay


def _checks_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--checks takes whole numbers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--checks values must be 1 or more, got {text!r}")
    return values


def _int_at_least(minimum: int):
    """An argparse type: a whole number of at least `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {minimum} or more, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet watchdog", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    rp = sub.add_parser("replay", help="replay recorded error times (one epoch-seconds or ISO-8601 time a line)")
    rp.add_argument("file", help="trace file, or - for standard input")
    rp.add_argument("--checks", type=_checks_list, default=[6, 8, 10],
                    help="strikes in a row that stop the run, comma-separated (default 6,8,10)")
    rp.add_argument("--limit", type=_non_negative_int, default=100,
                    help="a check strikes when the window holds more errors than this (default 100)")
    rp.add_argument("--window", type=_positive_int, default=60, help="window length in seconds (default 60)")
    rp.add_argument("--interval", type=_positive_int, default=30, help="seconds between checks (default 30)")
    rp.add_argument("--offsets", type=_positive_int, default=30,
                    help="replay start offsets 0..N-1 s after the first error (default 30)")
    rp.add_argument("--json", action="store_true", help="print a JSON list of rows instead of the table")
    return parser


def _fmt_stop(row: ReplayRow) -> str:
    if row.stopped_after_s_min is None:
        return "never"
    return f"{row.stopped_after_s_min:.0f} to {row.stopped_after_s_max:.0f} s"


def format_table(rows: list[ReplayRow], *, errors: int, first: float, last: float, spec: WatchdogSpec) -> str:
    start = datetime.fromtimestamp(first, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [
        f"{errors} errors from {start} over {last - first:.0f} s; checks every {spec.check_interval_seconds} s "
        f"over the last {spec.window_seconds} s, limit {spec.limit}",
        f"{'checks':>6}  {'offsets stopped':<16} {'most strikes in a row':<22} time to stop (after first error)",
    ]
    for row in rows:
        lines.append(f"{row.checks:>6}  {f'{row.stopped} of {row.offsets}':<16} "
                     f"{row.max_strikes_in_a_row:<22} {_fmt_stop(row)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        specs = [WatchdogSpec(window_seconds=args.window, check_interval_seconds=args.interval,
                              limit=args.limit, checks=checks) for checks in args.checks]
    except ValidationError as exc:
        print(f"rlfleet watchdog: bad setting: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    try:
        if args.file == "-":
            times = parse_trace(sys.stdin, name="<stdin>")
        else:
            with open(args.file, encoding="utf-8") as f:
                times = parse_trace(f, name=args.file)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"rlfleet watchdog: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    except TraceError as exc:
        print(f"rlfleet watchdog: {exc}", file=sys.stderr)
        return 2
    rows = [replay(times, spec, args.offsets) for spec in specs]
    if args.json:
        print(json.dumps([row.as_dict() for row in rows]))
    else:
        print(format_table(rows, errors=len(times), first=times[0], last=times[-1], spec=specs[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
