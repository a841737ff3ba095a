"""The per-engine health state machine (pure: time is passed in)."""
from __future__ import annotations

import pytest

from rlfleet.crds.specs import HealthSpec
from rlfleet.orchestrator.fleet.health import (
    EngineHealth,
    HealthState,
    LoopStalls,
    ProbeTicket,
    TimeoutVerdict,
    hang_detection_bound,
    judge_lagged_timeouts,
    loop_lag_bound,
    next_round,
    probe_loop_lag,
)

SPEC = HealthSpec(interval_seconds=5, timeout_seconds=2, failure_threshold=3, first_wait_seconds=0)


def probe(h: EngineHealth, now: float, ok: bool, reason: str = "timeout") -> bool:
    ticket = h.start_probe(now)
    if ok:
        h.probe_succeeded(ticket, now + 0.1)
        return False
    return h.probe_failed(ticket, now + SPEC.timeout_seconds, reason)


def test_next_round_is_on_the_grid_strictly_after():
    assert next_round(10.0, 5.0, 10.0) == 15.0
    assert next_round(10.0, 5.0, 14.9) == 15.0
    assert next_round(10.0, 5.0, 15.0) == 20.0
    assert next_round(10.0, 5.0, 3.0) == 10.0


def test_healthy_engine_is_probed_once_per_round():
    h = EngineHealth(SPEC, origin=0.0)
    assert h.is_due(0.0)
    probe(h, 0.0, ok=True)
    assert not h.is_due(4.9)
    assert h.next_due == 5.0
    probe(h, 5.0, ok=True)
    assert h.next_due == 10.0 and h.state is HealthState.HEALTHY


def test_threshold_consecutive_failures_mark_dead_and_dead_is_final():
    h = EngineHealth(SPEC, origin=0.0)
    assert probe(h, 0.0, ok=False) is False
    assert h.state is HealthState.SUSPECT
    # Suspect: probed again after min(interval, timeout), not at the next round.
    assert h.next_due == 2.0
    assert probe(h, 2.0, ok=False) is False
    assert probe(h, 4.0, ok=False) is True
    assert h.dead and h.consecutive_failures == 3
    assert not h.is_due(100.0)
    # A late success (e.g. a hung process continued) changes nothing.
    h.probe_succeeded(ProbeTicket(epoch=h.epoch, started_at=4.0), 6.0)
    assert h.dead


def test_a_success_clears_the_failure_count():
    h = EngineHealth(SPEC, origin=0.0)
    probe(h, 0.0, ok=False)
    probe(h, 2.0, ok=False)
    probe(h, 4.0, ok=True)
    assert h.state is HealthState.HEALTHY and h.consecutive_failures == 0
    assert h.next_due == 5.0  # back on the round grid
    probe(h, 5.0, ok=False)
    probe(h, 7.0, ok=False)
    assert not h.dead


def test_fast_failures_are_spaced_by_the_probe_timeout():
    # A refused connection fails at once; the retry still waits min(interval, timeout).
    h = EngineHealth(SPEC, origin=0.0)
    ticket = h.start_probe(0.0)
    h.probe_failed(ticket, 0.01, "connection refused")
    assert h.next_due == 2.0


def test_result_of_a_probe_started_before_a_pause_is_ignored():
    h = EngineHealth(SPEC, origin=0.0)
    ticket = h.start_probe(0.0)
    h.pause()
    assert h.probe_failed(ticket, 2.0, "timeout") is False
    assert h.consecutive_failures == 0
    h.resume(3.0)
    # Started before the pause, finished after the resume: still ignored.
    assert h.probe_failed(ticket, 3.5, "timeout") is False
    assert h.consecutive_failures == 0


def test_resume_waits_first_wait_and_forgets_failures():
    spec = HealthSpec(interval_seconds=5, timeout_seconds=2, failure_threshold=3, first_wait_seconds=30)
    h = EngineHealth(spec, origin=0.0)
    assert not h.is_due(0.0) and h.is_due(30.0)
    ticket = h.start_probe(30.0)
    h.probe_failed(ticket, 32.0, "timeout")
    h.pause()
    assert not h.is_due(40.0)
    h.resume(50.0)
    assert h.consecutive_failures == 0 and h.state is HealthState.HEALTHY
    assert not h.is_due(79.9) and h.is_due(80.0)
    # The round grid restarts at the resume.
    probe(h, 80.0, ok=True)
    assert h.next_due == 85.0


def test_mark_dead_from_outside_invalidates_probes_in_flight():
    h = EngineHealth(SPEC, origin=0.0)
    ticket = h.start_probe(0.0)
    h.mark_dead("process exited with code -9")
    h.probe_succeeded(ticket, 0.5)
    assert h.dead and h.last_failure == "process exited with code -9"


def test_a_probe_cannot_start_twice():
    h = EngineHealth(SPEC, origin=0.0)
    h.start_probe(0.0)
    with pytest.raises(RuntimeError):
        h.start_probe(0.0)


def test_hang_detection_bound():
    assert hang_detection_bound(SPEC) == 5 + 3 * 2


def test_pause_releases_the_probe_in_flight():
    h = EngineHealth(SPEC, origin=0.0)
    h.start_probe(0.0)
    h.pause()
    h.resume(10.0)
    assert h.is_due(10.0)


# --- refused connections: the process is gone ----------------------------------------------------

def test_a_refused_connection_is_a_death_at_the_first_failure():
    h = EngineHealth(SPEC, origin=0.0)
    probe(h, 0.0, ok=True)
    ticket = h.start_probe(5.0)
    assert h.probe_failed(ticket, 5.01, "connection refused", refused=True) is True
    assert h.dead and h.consecutive_failures == 1 and h.last_failure == "connection refused"
    assert not h.is_due(100.0)


def test_a_refusal_after_other_failures_is_final_too():
    h = EngineHealth(SPEC, origin=0.0)
    assert probe(h, 0.0, ok=False, reason="HTTP 503") is False
    ticket = h.start_probe(2.0)
    assert h.probe_failed(ticket, 2.0, "connection refused", refused=True) is True


def test_timeouts_and_503s_keep_the_threshold():
    h = EngineHealth(SPEC, origin=0.0)
    assert probe(h, 0.0, ok=False, reason="HTTP 503 unavailable") is False
    assert probe(h, 2.0, ok=False, reason="no answer within 2 s") is False
    assert h.state is HealthState.SUSPECT
    assert probe(h, 4.0, ok=False, reason="HTTP 503 unavailable") is True


def test_a_refusal_that_lands_after_a_pause_or_a_hold_is_ignored():
    # The orchestrator paused (or held) the engine on purpose, e.g. to restart or reload it.
    for stop in (lambda h: h.pause(), lambda h: h.hold("heat guard")):
        h = EngineHealth(SPEC, origin=0.0)
        ticket = h.start_probe(0.0)
        stop(h)
        assert h.probe_failed(ticket, 0.01, "connection refused", refused=True) is False
        assert not h.dead and h.consecutive_failures == 0


# --- per-engine holds ------------------------------------------------------------------------------

HOLD_SPEC = HealthSpec(interval_seconds=5, timeout_seconds=2, failure_threshold=3, first_wait_seconds=10)


def test_a_held_engine_is_never_due_and_a_probe_in_flight_does_not_count():
    h = EngineHealth(HOLD_SPEC, origin=0.0)
    assert not h.is_due(0.0) and h.is_due(10.0)
    ticket = h.start_probe(10.0)
    h.hold("heat guard")
    assert h.in_flight is None and h.held == "heat guard"
    assert h.probe_failed(ticket, 12.0, "no answer within 2 s") is False
    assert h.consecutive_failures == 0
    assert h.wake_time() is None
    assert not any(h.is_due(t) for t in (12.0, 100.0, 10_000.0))


def test_a_hold_outlasts_a_fleet_pause_and_resume():
    h = EngineHealth(HOLD_SPEC, origin=0.0)
    h.hold("heat guard")
    h.pause()  # weight sync
    h.resume(20.0)
    assert not h.paused and h.held == "heat guard"
    assert not h.is_due(30.0) and not h.is_due(1000.0)


def test_release_waits_first_wait_then_rejoins_the_fleet_grid():
    h = EngineHealth(HOLD_SPEC, origin=0.0)
    t = h.start_probe(10.0)
    h.probe_failed(t, 12.0, "no answer within 2 s")
    assert h.state is HealthState.SUSPECT
    h.hold("heat guard")
    h.release(33.0)
    assert h.held is None and h.state is HealthState.HEALTHY and h.consecutive_failures == 0
    assert not h.is_due(42.9) and h.is_due(43.0)  # first wait after the release
    probe(h, 43.0, ok=True)
    assert h.next_due == 45.0  # back on the fleet's round grid (origin 0, interval 5)


def test_release_during_a_fleet_pause_probes_only_after_the_resume():
    h = EngineHealth(HOLD_SPEC, origin=0.0)
    h.hold("heat guard")
    h.pause()
    h.release(20.0)
    assert not h.is_due(40.0)
    h.resume(50.0)
    assert not h.is_due(59.9) and h.is_due(60.0)


def test_release_without_a_hold_changes_nothing():
    h = EngineHealth(HOLD_SPEC, origin=0.0)
    h.release(3.0)
    assert h.next_due == 10.0 and h.epoch == 0


def test_a_refusal_between_probes_is_a_death_unless_probes_are_off():
    h = EngineHealth(SPEC, origin=0.0)
    probe(h, 0.0, ok=True)
    assert h.connection_refused(1.0, "connection refused") is True
    assert h.dead and h.last_failure == "connection refused"
    for off in (lambda h: h.pause(), lambda h: h.hold("heat guard"), lambda h: h.start_probe(0.0)):
        h = EngineHealth(SPEC, origin=0.0)
        off(h)
        assert h.connection_refused(1.0, "connection refused") is False and not h.dead


# --- the loop-stall brake ----------------------------------------------------------------------------

def test_a_void_probe_changes_neither_state_nor_count_and_is_repeated_at_once():
    h = EngineHealth(SPEC, origin=0.0)
    probe(h, 0.0, ok=False)
    probe(h, 2.0, ok=False)  # suspect, 2 of 3
    ticket = h.start_probe(4.0)
    h.probe_void(ticket, 30.0)  # timed out while the prober's loop stood still until 30
    assert h.state is HealthState.SUSPECT and h.consecutive_failures == 2 and not h.dead
    assert h.is_due(30.0)
    assert probe(h, 30.0, ok=False) is True  # the next real timeout is the third


def test_a_void_probe_from_before_a_pause_is_ignored():
    h = EngineHealth(SPEC, origin=0.0)
    ticket = h.start_probe(0.0)
    h.pause()
    h.resume(10.0)
    h.probe_void(ticket, 10.5)
    assert h.next_due == 10.0  # the resume's schedule stands


def test_loop_lag_bound_is_the_timeout_but_at_least_a_second():
    assert loop_lag_bound(HealthSpec(timeout_seconds=5)) == 5
    assert loop_lag_bound(HealthSpec(timeout_seconds=0.2)) == 1


def test_loop_stalls_keep_the_late_wakes_and_answer_for_a_probe_since_its_start():
    stalls = LoopStalls()
    assert stalls.record(1.0, 1.01) == pytest.approx(0.01)  # on time, noise: not kept
    assert stalls.record(2.0, 1.5) == 0  # woken early by an event
    assert stalls.record(4.25, 24.0) == pytest.approx(19.75)
    assert stalls.longest_since(0.0) == pytest.approx(19.75)
    assert stalls.longest_since(24.0) == pytest.approx(19.75)  # it delayed the round that started at 24
    assert stalls.longest_since(24.5) == 0


def test_probe_loop_lag_is_the_longest_stall_or_the_overshoot_of_the_timeout():
    stalls = LoopStalls()
    ticket = ProbeTicket(epoch=0, started_at=10.0)
    assert probe_loop_lag(stalls, ticket, 12.0, 2.0) == 0  # timed out on time
    assert probe_loop_lag(stalls, ticket, 16.0, 2.0) == 4  # seen 4 s past its deadline
    stalls.record(10.25, 12.5)
    assert probe_loop_lag(stalls, ticket, 12.6, 2.0) == pytest.approx(2.25)


def test_a_timeout_counts_unless_the_loop_lagged_beyond_the_bound():
    spec = HealthSpec(timeout_seconds=5)
    assert judge_lagged_timeouts([0.0, 4.9, 5.0, 5.1], 100, spec) == [
        TimeoutVerdict.COUNTS, TimeoutVerdict.COUNTS, TimeoutVerdict.COUNTS, TimeoutVerdict.LOOP_LAG]


def test_most_of_at_least_four_engines_timing_out_while_the_loop_lagged_do_not_count():
    spec = HealthSpec(timeout_seconds=5)
    mass = TimeoutVerdict.MASS_TIMEOUT
    assert judge_lagged_timeouts([2.0] * 3, 5, spec) == [mass] * 3
    assert judge_lagged_timeouts([2.0] * 2, 4, spec) == [TimeoutVerdict.COUNTS] * 2  # half is not most
    assert judge_lagged_timeouts([2.0] * 3, 3, spec) == [TimeoutVerdict.COUNTS] * 3  # too few engines to tell
    # A timeout with no lag of its own (the loop ran on time while it waited) is evidence, mass or not.
    assert judge_lagged_timeouts([2.0, 2.0, 2.0, 0.0, 6.0], 5, spec) == [
        mass, mass, mass, TimeoutVerdict.COUNTS, TimeoutVerdict.LOOP_LAG]
