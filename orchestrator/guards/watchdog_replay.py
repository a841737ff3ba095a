"""Replay recorded rollout-error times through the watchdog rule (the same WatchdogRule the run uses).

A live watchdog checks at some phase of the trace that nobody chooses, so one replay is one start
offset: checks at first_error + offset + k * interval. Replaying every offset 0..N-1 s shows whether
a setting stops a healthy run at some phases (false alarms) and how long it takes to stop a dead one.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from rlfleet.crds.specs import WatchdogSpec
from rlfleet.orchestrator.guards.watchdog import WatchdogRule


class TraceError(ValueError):
    """A trace line that is neither epoch seconds nor an ISO-8601 time."""


def parse_time(text: str) -> float:
    """Epoch seconds ("1792652189.5") or ISO-8601 ("2026-10-22T07:16:29.123Z"; naive = UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(f"not epoch seconds or an ISO-8601 time: {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def parse_trace(lines: Iterable[str], *, name: str = "trace") -> list[float]:
    """Sorted error times, one per line; blank lines and `#` comments are skipped."""
    times: list[float] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            times.append(parse_time(text))
        except TraceError as exc:
            raise TraceError(f"{name}, line {number}: {exc}") from None
    if not times:
        raise TraceError(f"{name}: no error times")
    times.sort()
    return times


@dataclass(frozen=True)
class OffsetResult:
    offset: int
    stopped_after_s: float | None  # seconds after the first error; None when never stopped
    max_strikes_in_a_row: int


def replay_offset(times: Sequence[float], spec: WatchdogSpec, offset: float) -> OffsetResult:
    """Feed sorted error times to a fresh rule, checking at first + offset + k * interval."""
    rule = WatchdogRule(spec)
    first, last = times[0], times[-1]
    now = first + offset
    fed = 0
    most = 0
    while True:
        while fed < len(times) and times[fed] <= now:
            rule.record_failure(times[fed])
            fed += 1
        result = rule.check(now)
        most = max(most, result.strikes_in_a_row)
        if result.tripped:
            return OffsetResult(int(offset), now - first, most)
        if fed == len(times) and now - spec.window_seconds >= last:
            # The window has moved past the last error: no later check can strike.
            return OffsetResult(int(offset), None, most)
        now += spec.check_interval_seconds


@dataclass(frozen=True)
class ReplayRow:
    """One line of the table: one `checks` setting over all offsets."""

    checks: int
    offsets: int
    stopped: int
    max_strikes_in_a_row: int
    stopped_after_s_min: float | None
    stopped_after_s_max: float | None

    def as_dict(self) -> dict:
        return {
            "checks": self.checks,
            "offsets": self.offsets,
            "stopped": self.stopped,
            "max_strikes_in_a_row": self.max_strikes_in_a_row,
            "stopped_after_s_min": self.stopped_after_s_min,
            "stopped_after_s_max": self.stopped_after_s_max,
        }


def replay(times: Sequence[float], spec: WatchdogSpec, offsets: int) -> ReplayRow:
    """Replay at offsets 0..offsets-1 s with the spec's `checks`."""
    results = [replay_offset(times, spec, offset) for offset in range(offsets)]
    stops = [r.stopped_after_s for r in results if r.stopped_after_s is not None]
    return ReplayRow(
        checks=spec.checks,
        offsets=offsets,
        stopped=len(stops),
        max_strikes_in_a_row=max(r.max_strikes_in_a_row for r in results),
        stopped_after_s_min=round(min(stops), 3) if stops else None,
        stopped_after_s_max=round(max(stops), 3) if stops else None,
    )
