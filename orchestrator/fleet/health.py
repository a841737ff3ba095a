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
- A refused connection marks the engine dead on the first failure, in a probe or when the probe
  client reconnects a kept-alive connection that ended between probes: nothing listens on its port, so
  the process is gone (a busy, paused or hung engine still accepts connections: its timeouts and
  503s keep the threshold). Engines are only probed once they served (startup is watched elsewhere),
  and never while paused or held, so a port that is not open yet, or closed on purpose, is not seen.
- While paused nothing is probed; results of probes started before a pause are ignored (epochs).
  Every resume waits `first_wait_seconds` and forgets earlier failures: an engine the orchestrator
  paused itself is not blamed for it.
- A hold is the same for one engine (e.g. the heat guard paused its generation); it outlasts
  fleet-wide pauses and resumes, and its release waits `first_wait_seconds` for that engine alone.
- Loop-stall brake: a timeout is only evidence against the engine if the prober's own event loop ran
  while the probe waited. When the loop stood still (an overloaded machine, a blocking call) every probe
  in flight times out at once, answered or not, and a healthy fleet would be marked dead. So a timed-out
  probe's loop lag is measured (the longest stall of the loop since the probe's round was due, LoopStalls,
  and how far past its timeout it was settled); above loop_lag_bound (max(1 s, timeout)) the timeout
  does not count toward `failure_threshold` and the engine is probed again at once. Second guard: when
  more than half of at least MASS_TIMEOUT_MIN_ENGINES probed engines time out together while the loop
  lagged by LOOP_LAG_FLOOR_S or more, none of those timeouts counts (judge_lagged_timeouts). A refused
  connection, an error status or a closed connection is an answer and always counts.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple

from rlfleet.crds.specs import HealthSpec

# A loop stall of this many seconds or more is "the loop lagged"; past max(this, timeout) a timeout is void.
LOOP_LAG_FLOOR_S = 1.0
# Below this many probed engines, many timeouts at once are not taken for the prober's fault.
MASS_TIMEOUT_MIN_ENGINES = 4


class HealthState(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # at least one failure, below the threshold
    DEAD = "dead"


class ProbeTicket(NamedTuple):
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
        self.last_failure: str | None = None
        self.epoch = 0
        self.paused = paused
        self.held: str | None = None  # why this engine alone is not probed (None: not held)
        self.in_flight: ProbeTicket | None = None
        self.next_due = origin + spec.first_wait_seconds

    @property
    def dead(self) -> bool:
        return self.state is HealthState.DEAD

    @property
    def probing(self) -> bool:
        """Probes may run: alive, and neither paused nor held."""
        return self.state is not HealthState.DEAD and not self.paused and self.held is None

    def is_due(self, now: float) -> bool:
        return self.in_flight is None and now >= self.next_due and self.probing

    def wake_time(self) -> float | None:
        """When this engine next wants a probe, or None if it never will until something changes."""
        if self.in_flight is not None or not self.probing:
            return None
        return self.next_due

    def start_probe(self, now: float) -> ProbeTicket:
        if not self.is_due(now):
            raise RuntimeError(f"probe started while not due (state={self.state}, paused={self.paused}, "
                               f"held={self.held!r}, in_flight={self.in_flight is not None}, "
                               f"due={self.next_due}, now={now})")
        self.in_flight = ProbeTicket(epoch=self.epoch, started_at=now)
        return self.in_flight

    def _settle(self, ticket: ProbeTicket) -> bool:
        """Clear the in-flight probe; True when its result still counts."""
        if self.in_flight == ticket:
            self.in_flight = None
        return ticket.epoch == self.epoch and self.probing

    def probe_succeeded(self, ticket: ProbeTicket, now: float) -> None:
        if not self._settle(ticket):
            return
        self.state = HealthState.HEALTHY
        self.consecutive_failures = 0
        self.next_due = next_round(self.origin, self.spec.interval_seconds, max(now, ticket.started_at))

    def probe_failed(self, ticket: ProbeTicket, now: float, reason: str, *, refused: bool = False) -> bool:
        """Record a failed probe; True exactly when this failure makes the engine dead.

        `refused`: the connection was refused (nothing listens on the port), which is final at once.
        """
        if not self._settle(ticket):
            return False
        self.consecutive_failures += 1
        self.last_failure = reason
        if refused or self.consecutive_failures >= self.spec.failure_threshold:
            self.state = HealthState.DEAD
            return True
        self.state = HealthState.SUSPECT
        retry_gap = min(self.spec.interval_seconds, self.spec.timeout_seconds)
        self.next_due = max(now, ticket.started_at + retry_gap)
        return False

    def connection_refused(self, now: float, reason: str) -> bool:
        """A connection attempt between probes was refused (the probe client watches kept-alive
        connections); True when that makes the engine dead, which it does whenever probes would run."""
        if not self.probing or self.in_flight is not None:
            return False  # paused or held on purpose, already dead, or a probe's own outcome decides
        self.consecutive_failures += 1
        self.last_failure = reason
        self.state = HealthState.DEAD
        return True

    def mark_dead(self, reason: str) -> None:
        """Dead for a reason outside the probes (process exit, failed load)."""
        self.state = HealthState.DEAD
        self.last_failure = reason
        self.epoch += 1

    def probe_void(self, ticket: ProbeTicket, now: float) -> None:
        """The probe timed out while the prober's loop stalled: no evidence either way. Neither the
        state nor the failure count changes; the engine is probed again at once (a healthy one too)."""
        if not self._settle(ticket):
            return
        retry_gap = min(self.spec.interval_seconds, self.spec.timeout_seconds)
        self.next_due = max(now, ticket.started_at + retry_gap)

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
        self._restart(now)

    def hold(self, reason: str) -> None:
        """Stop probing this engine alone until release(); a probe in flight no longer counts."""
        self.held = reason
        self.epoch += 1
        self.in_flight = None  # the monitor cancels it

    def release(self, now: float) -> None:
        """Probe again `first_wait_seconds` from now (unless the fleet is paused), failures forgotten.

        The engine keeps the fleet's round grid, so after its first probe it is probed with the others.
        """
        if self.held is None:
            return
        self.held = None
        self.epoch += 1
        self._restart(now)

    def _restart(self, now: float) -> None:
        if not self.dead:
            self.state = HealthState.HEALTHY
            self.consecutive_failures = 0
        self.next_due = now + self.spec.first_wait_seconds


def hang_detection_bound(spec: HealthSpec) -> float:
    """Worst-case seconds from a hang to the dead mark (first_wait aside)."""
    return spec.interval_seconds + spec.failure_threshold * spec.timeout_seconds


def loop_lag_bound(spec: HealthSpec) -> float:
    """Loop lag above which a timed-out probe says nothing about its engine."""
    return max(LOOP_LAG_FLOOR_S, spec.timeout_seconds)


class LoopStalls:
    """Recent stalls of the prober's own event loop, each measured as a timed wake that came late.

    `record(scheduled, actual)` after every timed wake; `longest_since(t)` is the longest stall that
    was still going on at or after t (a stall that delayed a round counts for the probes it started).
    Only stalls of `notice_s` or more are kept, the last `keep` of them.
    """

    def __init__(self, *, notice_s: float = LOOP_LAG_FLOOR_S / 4, keep: int = 32):
        self.notice_s = notice_s
        self._stalls: deque[tuple[float, float]] = deque(maxlen=keep)  # (scheduled, actual)

    def record(self, scheduled: float, actual: float) -> float:
        """Note a timed wake; returns how late it came (0 when on time or early)."""
        lag = actual - scheduled
        if lag >= self.notice_s:
            self._stalls.append((scheduled, actual))
        return max(0.0, lag)

    def longest_since(self, since: float) -> float:
        return max((end - start for start, end in self._stalls if end >= since), default=0.0)


def probe_loop_lag(stalls: LoopStalls, ticket: ProbeTicket, now: float, timeout_s: float) -> float:
    """How long the loop stood still while a timed-out probe waited: the longest stall since its round
    was due, or how far past its timeout the timeout was seen, whichever is longer."""
    return max(now - ticket.started_at - timeout_s, stalls.longest_since(ticket.started_at), 0.0)


class TimeoutVerdict(StrEnum):
    COUNTS = "counts"  # a failed probe like any other
    LOOP_LAG = "loop_lag"  # void: the loop lagged beyond loop_lag_bound while the probe waited
    MASS_TIMEOUT = "mass_timeout"  # void: most of the fleet timed out at once while the loop lagged


def judge_lagged_timeouts(lags: Sequence[float], probed: int, spec: HealthSpec) -> list[TimeoutVerdict]:
    """Verdicts for probe timeouts settled together (`lags`: each one's probe_loop_lag), `probed`: the
    engines being probed now (alive, neither paused nor held), the timed-out ones included."""
    bound = loop_lag_bound(spec)
    lagged = sum(1 for lag in lags if lag >= LOOP_LAG_FLOOR_S)
    mass = probed >= MASS_TIMEOUT_MIN_ENGINES and lagged * 2 > probed
    verdicts = []
    for lag in lags:
        if lag > bound:
            verdicts.append(TimeoutVerdict.LOOP_LAG)
        elif mass and lag >= LOOP_LAG_FLOOR_S:
            verdicts.append(TimeoutVerdict.MASS_TIMEOUT)
        else:
            verdicts.append(TimeoutVerdict.COUNTS)
    return verdicts
