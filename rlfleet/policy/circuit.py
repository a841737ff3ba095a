"""A pure circuit breaker for one serving path (the rollout router): no clock, no I/O.

When the router refuses connections, every retry of every sample would hit the dead port again:
hundreds of refused requests a second. The circuit counts consecutive connection failures; at
`threshold` it opens, and while open no request is sent (callers fail fast, and still count the
attempt they would have made). When the open period ends, one caller probes the path; success
closes the circuit, failure opens it again for longer (exponential backoff, capped).

Times are seconds on one clock that moves forward (the event loop's).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rlfleet.policy.recovery import exponential_backoff


class CircuitState(StrEnum):
    CLOSED = "closed"  # requests flow
    OPEN = "open"  # nothing is sent until `retry_at`
    HALF_OPEN = "half_open"  # one probe is in flight; others wait for its verdict


class Admission(StrEnum):
    SEND = "send"  # go ahead
    PROBE = "probe"  # the caller must probe the path and report probe_result()
    REJECT = "reject"  # fail fast: the path is known to be down


@dataclass(frozen=True)
class CircuitSettings:
    threshold: int = 5  # consecutive connection failures that open the circuit
    open_base_s: float = 0.5  # first open period; doubles per failed probe
    open_max_s: float = 5.0  # cap on the open period

    def __post_init__(self):
        if self.threshold < 1:
            raise ValueError("threshold must be 1 or more")
        if self.open_base_s <= 0 or self.open_max_s < self.open_base_s:
            raise ValueError("need 0 < open_base_s <= open_max_s")


class CircuitBreaker:
    """closed -> (threshold consecutive failures) -> open -> (period over) -> half_open (one probe)
    -> closed on success, open again (longer) on failure."""

    def __init__(self, settings: CircuitSettings | None = None):
        self.settings = settings or CircuitSettings()
        self.state = CircuitState.CLOSED
        self.consecutive_failures = 0
        self.failed_probes = 0  # probes failed since the circuit last closed (sets the open period)
        self.retry_at = float("-inf")
        self.opened = 0  # times the circuit opened (closed -> open), for metrics

    def admit(self, now: float) -> Admission:
        """May a request be sent at `now`?"""
        if self.state is CircuitState.CLOSED:
            return Admission.SEND
        if self.state is CircuitState.OPEN and now >= self.retry_at:
            self.state = CircuitState.HALF_OPEN
            return Admission.PROBE
        return Admission.REJECT

    def record_success(self) -> None:
        """A request reached the path (any answer from it: the path is up)."""
        self.consecutive_failures = 0
        if self.state is not CircuitState.CLOSED:
            self._close()

    def record_failure(self, now: float) -> bool:
        """A request could not reach the path (refused). True when this opened the circuit."""
        self.consecutive_failures += 1
        if self.state is CircuitState.CLOSED and self.consecutive_failures >= self.settings.threshold:
            self._open(now)
            self.opened += 1
            return True
        return False

    def probe_result(self, ok: bool, now: float) -> None:
        """The verdict of the probe admitted with Admission.PROBE."""
        if ok:
            self._close()
        else:
            self.failed_probes += 1
            self._open(now)

    def open_period(self) -> float:
        s = self.settings
        return exponential_backoff(self.failed_probes, s.open_base_s, s.open_max_s)

    def _open(self, now: float) -> None:
        self.state = CircuitState.OPEN
        self.retry_at = now + self.open_period()

    def _close(self) -> None:
        self.state = CircuitState.CLOSED
        self.consecutive_failures = 0
        self.failed_probes = 0
        self.retry_at = float("-inf")
