"""Errors that end a fleet's service: crash loops, too few ready engines, failed weight syncs."""
from __future__ import annotations

from rlfleet.errors import RunError


class FleetFailed(RunError):
    """The fleet cannot serve any more (crash loop, budgets spent, fewer than minReadyEngines).

    `reason` is a short machine word (used as a condition reason); the message quotes the failing
    engine's exit code and last log lines.
    """

    reason = "EngineCrashLoop"

    def __init__(self, message: str, *, reason: str = "EngineCrashLoop", slot: int | None = None,
                 exit_code: int | None = None, log_tail: list[str] | None = None):
        super().__init__(message, reason=reason)
        self.slot = slot
        self.exit_code = exit_code
        self.log_tail = list(log_tail or [])


ROUTER_FAILED_REASON = "RouterUnavailable"


class RouterFailed(FleetFailed):
    """A fleet's router exited (or its pod kept being replaced) and could not be brought back within
    its restart budget: the run must fail. The message quotes the router's last log lines."""

    def __init__(self, message: str, *, log_tail: list[str] | None = None):
        super().__init__(message, reason=ROUTER_FAILED_REASON, log_tail=log_tail)


class FleetNotReady(RunError):
    """Fewer than minReadyEngines engines were alive when a bounded wait ran out.

    Not a TimeoutError: an `except TimeoutError` around a fleet call must not take it for its own timeout.
    """

    reason = "FleetNotReady"


class WeightSyncFailed(RunError):
    """A weight sync could not give enough engines the new weights; `result` tells per engine."""

    reason = "WeightSyncFailed"

    def __init__(self, message: str, result=None):
        super().__init__(message)
        self.result = result
