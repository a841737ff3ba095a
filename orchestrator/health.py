"""The per-engine health state machine: pure, no I/O, time passed in.

Rules (the settings come from HealthSpec):
- Healthy engines are probed on a fleet-wide grid, every `interval_seconds` from the moment
  monitoring (re)started, so all engines are probed in the same round, concurrently.
- After a failed probe the engine is suspect and is probed again without waiting for the next round,
  at most once per min(interval, timeout): a hang is then marked dead within
  interval + failure_threshold x timeout of its start, where Miles needs threshold rounds.
- `failure_threshold` consecutive failures mark the engine dead; dead is final for this incarnation
  (a replacement is a new incarnation with a new state machine), so a late answer from a hung process
  can never bring a replaced slot back.
- While paused nothing is probed; results of probes started before a pause are ignored (epochs).
  Every resume waits `first_wait_seconds` and forgets earlier failures: an engine the orchestrator
  paused itself is not blamed for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from rlfleet.crds.specs import HealthSpec


class HealthState(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # at least one failure, below the threshold
    DEAD = "dead"


@dataclass(frozen=True)
class ProbeTicket:
    """Issued when a probe starts; its result only counts if the epoch is still current."""

    epoch: int
    started_at: float


def next_round(origin: float, interval: float, after: float) -> float:
    """The first grid time origin + k*interval (k >= 0) strictly after `after`."""
    if after < origin:
        return origin
    k = math.floor((after - origin) / interval) + 1
    return origin + k * interval


class EngineHealth:
    """Health of one engine incarnation."""

    def __init__(self, spec: HealthSpec, *, origin: float, paused: bool = False):
        self.spec = spec
        self.origin = origin  # grid origin: when monitoring (re)started
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.total_failures = 0
        self.last_failure: str | None = None
        self.epoch = 0
        self.paused = paused
        self.in_flight: ProbeTicket | None = None
        self.next_due = origin + spec.first_wait_seconds

    @property
    def dead(self) -> bool:
        return self.state is HealthState.DEAD

    def is_due(self, now: float) -> bool:
        return not self.dead and not self.paused and self.in_flight is None and now >= self.next_due

    def wake_time(self) -> float | None:
        """When this engine next wants a probe, or None if it never will until something changes."""
        if self.dead or self.paused or self.in_flight is not None:
            return None
        return self.next_due

    def start_probe(self, now: float) -> ProbeTicket:
        if not self.is_due(now):
            raise RuntimeError(f"probe started while not due (state={self.state}, paused={self.paused}, "
                               f"in_flight={self.in_flight is not None}, due={self.next_due}, now={now})")
        self.in_flight = ProbeTicket(epoch=self.epoch, started_at=now)
        return self.in_flight

    def _settle(self, ticket: ProbeTicket) -> bool:
        """Clear the in-flight probe; True when its result still counts."""
        if self.in_flight == ticket:
            self.in_flight = None
        return ticket.epoch == self.epoch and not self.dead and not self.paused

    def probe_succeeded(self, ticket: ProbeTicket, now: float) -> None:
        if not self._settle(ticket):
            return
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.next_due = next_round(self.origin, self.spec.interval_seconds, max(now, ticket.started_at))

    def probe_failed(self, ticket: ProbeTicket, now: float, reason: str) -> bool:
        """Record a failed probe; True exactly when this failure makes the engine dead."""
        if not self._settle(ticket):
            return False
        self.consecutive_failures += 1
        self.total_failures += 1
        self.last_failure = reason
        if self.consecutive_failures >= self.spec.failure_threshold:
            self.state = HealthState.DEAD
            return True
        self.state = HealthState.SUSPECT
        retry_gap = min(self.spec.interval_seconds, self.spec.timeout_seconds)
        self.next_due = max(now, ticket.started_at + retry_gap)
        return False

    def mark_dead(self, reason: str) -> None:
        """Dead for a reason outside the probes (process exit, failed load)."""
        self.state = HealthState.DEAD
        self.last_failure = reason
        self.epoch += 1

    def probe_abandoned(self, ticket: ProbeTicket) -> None:
        """The probe was cancelled (pause, stop): it neither failed nor succeeded."""
        if self.in_flight == ticket:
            self.in_flight = None

    def pause(self) -> None:
        self.paused = True
        self.epoch += 1  # results of probes already running no longer count
        self.in_flight = None  # the monitor cancels them; the next probe must not wait for them

    def resume(self, now: float) -> None:
        self.paused = False
        self.epoch += 1
        self.origin = now
        if not self.dead:
            self.state = HealthState.HEALTHY
            self.consecutive_failures = 0
        self.next_due = now + self.spec.first_wait_seconds


def hang_detection_bound(spec: HealthSpec) -> float:
    """Worst-case seconds from a hang to the dead mark (first_wait aside)."""
    return spec.interval_seconds + spec.failure_threshold * spec.timeout_seconds
