"""The 503-storm watchdog: a pure rule and the async task that acts on it.

A run whose rollout engines all died keeps sending requests and collecting 503s forever. The rule
tells that apart from the bursts of a healthy but busy run by time, not by count: every
`checkIntervalSeconds` it counts the failures of the last `windowSeconds`; a check whose count is
above `limit` is a strike; `checks` strikes in a row trip it. Healthy bursts reach a few strikes in a
row, a dead engine strikes forever.

`WatchdogRule` is pure (no clock, no I/O): the live task and `rlfleet watchdog replay` both drive it,
so what a replay shows is what the run does.

What is checked is the serving path, not the engines' states: after a trip's one recovery, the run
goes on only if a one-token generation through the fleet's router succeeds. Recoveries are bounded
(`RecoveryBound`, pure): a trip within `retripPeriodSeconds` of a recovery, or failures still above
the limit one full window after it, fail the run; no sequence of events keeps a run in trip-recover
cycles.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from rlfleet.crds.specs import WatchdogSpec
from rlfleet.errors import RunError
from rlfleet.observability import metrics

log = logging.getLogger(__name__)

FAILURE_REASON = "RolloutEnginesUnavailable"


@dataclass(frozen=True)
class CheckResult:
    """What one check saw and decided."""

    at: float
    failures_in_window: int
    strike: bool
    strikes_in_a_row: int
    tripped: bool


class WatchdogRule:
    """Failure timestamps in, strike/trip decisions out.

    Times are seconds on one clock that moves forward: a check at `now` sees the failures recorded
    before it, and never looks at a time earlier than an already recorded failure.
    """

    def __init__(self, spec: WatchdogSpec):
        self.spec = spec
        self._failures: deque[float] = deque()
        self._newest = float("-inf")
        self.strikes_in_a_row = 0
        self.tripped = False

    def record_failure(self, at: float) -> None:
        """Note one failed request at time `at`."""
        self._failures.append(at)
        if at > self._newest:
            self._newest = at
            # Checks never look back further than one window before the newest failure, so older
            # entries can go now: memory stays bounded by one window even during a storm.
            self._prune(at)

    def failures_in_window(self, now: float) -> int:
        """Failures in (now - window, now]."""
        self._prune(now)
        if self._newest <= now:
            return len(self._failures)
        return sum(1 for t in self._failures if t <= now)

    def check(self, now: float) -> CheckResult:
        """Run one check at time `now`. After a trip every later check reports tripped."""
        count = self.failures_in_window(now)
        strike = count > self.spec.limit
        self.strikes_in_a_row = self.strikes_in_a_row + 1 if strike else 0
        if self.strikes_in_a_row >= self.spec.checks:
            self.tripped = True
        return CheckResult(at=now, failures_in_window=count, strike=strike,
                           strikes_in_a_row=self.strikes_in_a_row, tripped=self.tripped)

    def reset(self) -> None:
        """Forget everything (after a successful recovery the count starts over)."""
        self._failures.clear()
        self._newest = float("-inf")
        self.strikes_in_a_row = 0
        self.tripped = False

    def _prune(self, now: float) -> None:
        horizon = now - self.spec.window_seconds
        failures = self._failures
        while failures and failures[0] <= horizon:
            failures.popleft()


class RecoveryBound:
    """After a recovery: does the run deserve another one? Pure; times on the watchdog's clock.

    - a trip within `spec.retrip_period()` seconds of the last recovery fails the run;
    - the first check whose window starts a full window after the recovery (`now - window >=
      recovered_at + window`) must not be a strike: failures that continue past the next window
      mean the recovery did not restore the path, whatever the probe said.
    """

    def __init__(self, spec: WatchdogSpec):
        self.spec = spec
        self.recovered_at: float | None = None
        self._on_probation = False

    def recovered(self, at: float) -> None:
        self.recovered_at = at
        self._on_probation = True

    def verdict(self, result: CheckResult) -> str | None:
        """None while the run may go on; else why it must fail now."""
        if self.recovered_at is None:
            return None
        since = result.at - self.recovered_at
        if result.tripped and since <= self.spec.retrip_period():
            return (f"the watchdog tripped again {since:.0f} s after a recovery (within retripPeriodSeconds "
                    f"{self.spec.retrip_period()} s)")
        if self._on_probation and since >= 2 * self.spec.window_seconds:
            self._on_probation = False
            if result.strike:
                return (f"failures continued past the next window after the recovery ({result.failures_in_window} "
                        f"in the {self.spec.window_seconds} s ending {since:.0f} s after it, limit {self.spec.limit})")
        return None


class RolloutEnginesUnavailable(RunError):
    """The watchdog tripped and recovery left no engine able to serve: the run must fail.

    `reason` is the TrainingRun condition reason; `message` quotes the engines' last log lines.
    """

    reason = FAILURE_REASON

    def __init__(self, message: str, *, engine_logs: Mapping[str, Sequence[str]] | None = None):
        super().__init__(message)
        self.message = message
        self.engine_logs = {k: list(v) for k, v in (engine_logs or {}).items()}


NO_SERVE = "recovery left no engine able to serve through the router"


def unavailable_message(spec: WatchdogSpec, last: CheckResult, engine_logs: Mapping[str, Sequence[str]],
                        *, lines_per_engine: int = 5, why: str = NO_SERVE) -> str:
    """The failure message: what the watchdog saw and why it gave up, then each engine's (and the
    router's) own last log lines."""
    head = (f"more than {spec.limit} failed rollout requests in each of {spec.checks} checks in a row "
            f"(last check: {last.failures_in_window} in {spec.window_seconds} s); {why}")
    if not engine_logs:
        return head + "; no engine log available"
    parts = [head + "."]
    for engine, lines in sorted(engine_logs.items()):
        tail = [line.rstrip() for line in lines if line.strip()][-lines_per_engine:]
        parts.append(f"[{engine}] last log lines:" if tail else f"[{engine}] (empty log)")
        parts += ["    " + line.strip() for line in tail]
    return "\n".join(parts)


# Callbacks the task needs from the orchestrator; kept as plain callables so the task is testable.
RecoverFn = Callable[[], Awaitable[None]]
CanServeFn = Callable[[], Awaitable[bool]]
EngineLogsFn = Callable[[], Mapping[str, Sequence[str]] | Awaitable[Mapping[str, Sequence[str]]]]


class WatchdogTask:
    """Runs the rule on the event-loop clock and acts on a trip.

    Failed requests are reported with `record_failure()` (any coroutine on the same loop). `run()`
    checks every `checkIntervalSeconds`; on a trip it calls `recover()` once, then asks `can_serve()`
    (an end-to-end probe: a one-token generation through the fleet's router). If it passes, the rule
    starts over under `RecoveryBound`; if not, or if the bound says the last recovery did not hold,
    `run()` raises RolloutEnginesUnavailable with the last log lines from `engine_logs()` (the
    engines' and the router's). Cancel the task to stop it.
    """

    def __init__(self, spec: WatchdogSpec, *, recover: RecoverFn, can_serve: CanServeFn,
                 engine_logs: EngineLogsFn, fleet: str = "rollout", recovery_timeout_s: float = 600.0,
                 on_strike: Callable[[int, int], None] | None = None):
        self.spec = spec
        self._on_strike = on_strike  # (strikes in a row, failures in the window), for the run's event log
        self.rule = WatchdogRule(spec)
        self.fleet = fleet
        self._recover = recover
        self._can_serve = can_serve
        self._engine_logs = engine_logs
        self._recovery_timeout_s = recovery_timeout_s
        self.trips = 0
        self.recoveries = 0
        self.bound = RecoveryBound(spec)
        metrics.WATCHDOG_STRIKES_TO_TRIP.labels(fleet=fleet).set(spec.checks)
        # Counters exist at 0 from the start, so increase() sees the first strike and the first trip.
        metrics.WATCHDOG_STRIKES.labels(fleet=fleet)
        metrics.WATCHDOG_TRIPS.labels(fleet=fleet)
        for verdict in ("ok", "failed"):
            metrics.WATCHDOG_RECOVERIES.labels(fleet=fleet, verdict=verdict)

    def record_failure(self, at: float | None = None) -> None:
        """Timestamp one failed rollout request (default: now on the running loop's clock)."""
        self.rule.record_failure(asyncio.get_running_loop().time() if at is None else at)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.spec.check_interval_seconds
        next_check = loop.time() + interval
        while True:
            # Sleep to an absolute deadline so checks never drift by the time a check takes.
            await asyncio.sleep(max(0.0, next_check - loop.time()))
            next_check += interval
            result = self.rule.check(loop.time())
            metrics.WATCHDOG_WINDOW_FAILURES.labels(fleet=self.fleet).set(result.failures_in_window)
            metrics.WATCHDOG_STRIKES_IN_A_ROW.labels(fleet=self.fleet).set(result.strikes_in_a_row)
            if result.strike:
                metrics.WATCHDOG_STRIKES.labels(fleet=self.fleet).inc()
                log.warning("watchdog strike %d/%d: %d failed rollout requests in the last %d s (limit %d)",
                            result.strikes_in_a_row, self.spec.checks, result.failures_in_window,
                            self.spec.window_seconds, self.spec.limit)
                if self._on_strike is not None:
                    self._on_strike(result.strikes_in_a_row, result.failures_in_window)
            why = self.bound.verdict(result)
            if result.tripped:
                self.trips += 1
                metrics.WATCHDOG_TRIPS.labels(fleet=self.fleet).inc()
            if why is not None:
                log.error("watchdog: %s; the run fails", why)
                await self._fail(result, why)
            if result.tripped:
                await self._on_trip(result)
                next_check = loop.time() + interval

    async def _on_trip(self, result: CheckResult) -> None:
        log.error("watchdog tripped after %d strikes in a row; trying one recovery", result.strikes_in_a_row)
        try:
            async with asyncio.timeout(self._recovery_timeout_s):
                await self._recover()
        except Exception as exc:
            log.error("watchdog recovery failed: %s", exc)
        try:
            async with asyncio.timeout(self._recovery_timeout_s):
                serving = await self._can_serve()
        except Exception as exc:
            log.error("watchdog serve check failed: %s", exc)
            serving = False
        if serving:
            self.recoveries += 1
            metrics.WATCHDOG_RECOVERIES.labels(fleet=self.fleet, verdict="ok").inc()
            log.warning("watchdog: a generation through the router succeeds after recovery; counting starts over "
                        "(another trip within %d s fails the run)", self.spec.retrip_period())
            self.rule.reset()
            self.bound.recovered(asyncio.get_running_loop().time())
            metrics.WATCHDOG_STRIKES_IN_A_ROW.labels(fleet=self.fleet).set(0)
            return
        metrics.WATCHDOG_RECOVERIES.labels(fleet=self.fleet, verdict="failed").inc()
        await self._fail(result, NO_SERVE)

    async def _fail(self, result: CheckResult, why: str) -> None:
        logs = self._engine_logs()
        if inspect.isawaitable(logs):
            logs = await logs
        raise RolloutEnginesUnavailable(unavailable_message(self.spec, result, logs, why=why), engine_logs=logs)
