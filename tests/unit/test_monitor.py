"""HealthMonitor timing on a virtual clock (looptime), with an injected probe function.

The probe stands for the network call only; what is under test is the monitor's scheduling,
bounds, pause/resume and cancellation.
"""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.crds.specs import HealthSpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.health import hang_detection_bound
from rlfleet.orchestrator.fleet.monitor import REFUSAL_GRACE_S, HealthMonitor, ProbeTarget
from rlfleet.sglang.errors import ConnectionRefused, ServiceUnavailable

pytestmark = pytest.mark.looptime


def stall_loop(seconds: float) -> None:
    """Hold the event loop for `seconds` of its time, as a blocking call or a starved process does:
    nothing runs meanwhile, then every timer that fell due fires at once (moves looptime's clock)."""
    loop = asyncio.get_running_loop()
    loop.setup_looptime(start=loop.time() + seconds)


def voided(fleet: str, reason: str) -> float:
    value = metrics.REGISTRY.get_sample_value("rlfleet_engine_probe_timeouts_voided_total",
                                              {"fleet": fleet, "reason": reason})
    return value or 0.0


class Engines:
    """Probe behaviour per slot: "ok", "hang" (never answers), "refuse" (fails at once), "503"
    (answers 503 at once), "refuse-late" (refused after half a second) or "stall" (blocks the
    prober's event loop for `stall_s` once, then answers like "ok")."""

    def __init__(self, slots: int, answer_s: float = 0.05, stall_s: float = 20.0):
        self.behaviour = {n: "ok" for n in range(slots)}
        self.answer_s = answer_s
        self.stall_s = stall_s
        self.calls: list[tuple[float, int]] = []
        self.dead: dict[int, tuple[float, str]] = {}
        self.gone: set[int] = set()

    def targets(self) -> list[ProbeTarget]:
        return [ProbeTarget(n, 1, f"http://127.0.0.{n + 2}:1") for n in self.behaviour if n not in self.gone]

    async def probe(self, target: ProbeTarget) -> None:
        loop = asyncio.get_running_loop()
        self.calls.append((loop.time(), target.slot))
        match self.behaviour[target.slot]:
            case "ok":
                await asyncio.sleep(self.answer_s)
            case "hang":
                await asyncio.sleep(10_000)
            case "refuse":
                raise ConnectionRefused("connection refused", url=target.url)
            case "503":
                raise ServiceUnavailable("(empty body)", url=target.url, status=503)
            case "refuse-late":
                await asyncio.sleep(0.5)
                raise ConnectionRefused("connection refused", url=target.url)
            case "stall":
                self.behaviour[target.slot] = "ok"
                stall_loop(self.stall_s)
                await asyncio.sleep(self.answer_s)

    async def on_dead(self, target: ProbeTarget, reason: str) -> None:
        self.dead[target.slot] = (asyncio.get_running_loop().time(), reason)
        self.gone.add(target.slot)

    def probe_times(self, slot: int) -> list[float]:
        return [t for t, s in self.calls if s == slot]


async def started(spec: HealthSpec, engines: Engines, fleet: str = "t") -> HealthMonitor:
    monitor = HealthMonitor(spec, targets=engines.targets, probe=engines.probe, on_dead=engines.on_dead, fleet=fleet)
    await monitor.start()
    return monitor


async def hang_until_dead(monitor: HealthMonitor, engines: Engines, slot: int) -> tuple[float, float, str]:
    """Hang one engine now, give the monitor 30 s, stop it: (hung at, marked dead at, reason)."""
    hung_at = asyncio.get_running_loop().time()
    engines.behaviour[slot] = "hang"
    await asyncio.sleep(30)
    await monitor.stop()
    dead_at, reason = engines.dead[slot]
    return hung_at, dead_at, reason


async def test_all_engines_are_probed_concurrently_every_interval():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=3)
    engines = Engines(50)
    monitor = await started(spec, engines)
    await asyncio.sleep(9)
    await monitor.stop()
    rounds = sorted({round(t, 6) for t, _ in engines.calls})
    assert rounds == [0, 2, 4, 6, 8]
    for t in rounds:
        assert sorted(s for c, s in engines.calls if round(c, 6) == t) == list(range(50))
    assert engines.dead == {}


async def test_a_refused_connection_is_a_death_at_the_first_probe():
    spec = HealthSpec(interval_seconds=5, timeout_seconds=1, failure_threshold=3)
    engines = Engines(2)
    monitor = await started(spec, engines)
    await asyncio.sleep(7)  # rounds at 0 and 5
    engines.behaviour[1] = "refuse"  # the process is gone: nothing listens on its port
    await asyncio.sleep(20)
    await monitor.stop()
    dead_at, reason = engines.dead[1]
    # Dead at the next round's probe (no retries), told after the grace left to the backend's watch.
    assert dead_at == pytest.approx(10.0 + REFUSAL_GRACE_S)
    assert engines.probe_times(1) == pytest.approx([0.0, 5.0, 10.0])
    assert reason.startswith("connection refused, nothing listens") and "connection_refused" in reason
    assert 0 not in engines.dead


async def test_a_refusal_the_backend_reported_first_is_not_told_again():
    spec = HealthSpec(interval_seconds=5, timeout_seconds=1, failure_threshold=3)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(2)
    engines.behaviour[0] = "refuse"
    await asyncio.sleep(3.1)  # refused at 5
    assert monitor.health(0, 1).dead and engines.dead == {}
    monitor.forget(0, 1)  # the process watch reported the exit (with its code and log) within the grace
    await asyncio.sleep(5)
    await monitor.stop()
    assert engines.dead == {}
    assert engines.probe_times(0) == pytest.approx([0.0, 5.0])


async def test_503s_keep_the_failure_threshold():
    spec = HealthSpec(interval_seconds=5, timeout_seconds=1, failure_threshold=3)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(2)
    engines.behaviour[0] = "503"
    await asyncio.sleep(20)
    await monitor.stop()
    dead_at, reason = engines.dead[0]
    # Round at 5, retries at 6 and 7 (spaced by the probe timeout).
    assert dead_at == pytest.approx(7.0)
    assert "3 consecutive failed health probes" in reason and "unavailable" in reason


async def test_a_refusal_during_a_deliberate_pause_is_not_a_death():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=3)
    engines = Engines(1)
    engines.behaviour[0] = "refuse-late"
    monitor = await started(spec, engines)
    await asyncio.sleep(0.2)  # the probe at 0 is in flight; it will be refused at 0.5
    monitor.pause()  # e.g. a weight sync restarts engines: their ports close on purpose
    await asyncio.sleep(10)
    assert engines.dead == {} and engines.probe_times(0) == pytest.approx([0.0])
    engines.behaviour[0] = "ok"  # back before the resume
    monitor.resume()
    await asyncio.sleep(5)
    await monitor.stop()
    assert engines.dead == {}


async def test_hang_is_marked_dead_within_interval_plus_threshold_times_timeout():
    spec = HealthSpec(interval_seconds=4, timeout_seconds=3, failure_threshold=3)
    engines = Engines(3)
    monitor = await started(spec, engines)
    await asyncio.sleep(5.5)
    hung_at, dead_at, reason = await hang_until_dead(monitor, engines, 2)
    assert dead_at - hung_at <= hang_detection_bound(spec)
    # Round at 8, then back-to-back 3 s probes: 8+3+3+3 = 17.
    assert dead_at == pytest.approx(17.0)
    assert "no answer within 3 s" in reason
    # The hung engine did not delay the others: they kept their rounds.
    assert engines.probe_times(0)[:7] == pytest.approx([0, 4, 8, 12, 16, 20, 24])


async def test_one_failure_then_success_is_not_a_death():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=2)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(0.5)
    engines.behaviour[0] = "503"
    await asyncio.sleep(2)  # the round at 2 fails
    engines.behaviour[0] = "ok"
    await asyncio.sleep(10)
    await monitor.stop()
    assert engines.dead == {}


async def test_nothing_is_probed_while_paused_and_resume_waits_first_wait():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1, first_wait_seconds=5)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(5.1)  # first wait: the first probe happens at 5
    assert engines.probe_times(0) == pytest.approx([5.0])
    monitor.pause()
    engines.behaviour[0] = "hang"  # e.g. the engine loads weights: the orchestrator paused it itself
    await asyncio.sleep(30)
    assert engines.probe_times(0) == pytest.approx([5.0])
    engines.behaviour[0] = "ok"
    monitor.resume()  # at 35.1
    await asyncio.sleep(10)
    await monitor.stop()
    times = engines.probe_times(0)
    assert times[1] == pytest.approx(40.1)  # first wait after the resume
    assert engines.dead == {}


async def test_a_probe_in_flight_at_pause_does_not_count():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1)
    engines = Engines(1)
    engines.behaviour[0] = "hang"
    monitor = await started(spec, engines)
    await asyncio.sleep(0.5)  # the probe at 0 is in flight (it would time out at 1)
    monitor.pause()
    await asyncio.sleep(5)
    assert engines.dead == {}
    # After the resume the still-hung engine is probed again (the cancelled probe does not block it).
    monitor.resume()  # at 5.5
    await asyncio.sleep(5)
    await monitor.stop()
    assert engines.probe_times(0) == pytest.approx([0.0, 5.5])
    assert engines.dead[0][0] == pytest.approx(6.5)


async def test_stop_cancels_hung_probes_and_leaves_no_task():
    spec = HealthSpec(interval_seconds=1, timeout_seconds=100, failure_threshold=3)
    engines = Engines(5)
    for n in range(5):
        engines.behaviour[n] = "hang"
    before = asyncio.all_tasks()
    monitor = await started(spec, engines)
    await asyncio.sleep(3)
    await monitor.stop()
    assert asyncio.all_tasks() == before
    assert not monitor.running


async def test_cancelling_the_owner_task_is_safe():
    spec = HealthSpec(interval_seconds=1, timeout_seconds=1, failure_threshold=3)
    engines = Engines(3)

    async def owner():
        monitor = await started(spec, engines)
        try:
            await asyncio.sleep(1000)
        finally:
            await monitor.stop()

    before = asyncio.all_tasks()
    task = asyncio.create_task(owner())
    await asyncio.sleep(2.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asyncio.all_tasks() == before


async def test_replaced_incarnation_is_a_new_engine():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(1)
    monitor.forget(0, 1)  # the process watch saw it exit
    await asyncio.sleep(5)
    assert engines.probe_times(0) == pytest.approx([0.0])
    await monitor.stop()


# --- per-engine holds --------------------------------------------------------------------------------

async def test_a_held_engine_is_not_probed_across_a_fleet_pause_and_resume():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1, first_wait_seconds=3)
    engines = Engines(2)
    monitor = await started(spec, engines)
    await asyncio.sleep(4.5)  # first probes at 3, then on the grid: 4
    monitor.hold(1, "heat guard")  # at 4.5
    engines.behaviour[1] = "hang"  # a paused engine holds /health_generate
    await asyncio.sleep(6)
    monitor.pause()  # weight sync at 10.5
    await asyncio.sleep(5)
    monitor.resume()  # at 15.5: slot 0 waits first_wait, slot 1 stays held
    await asyncio.sleep(30)
    assert engines.probe_times(1) == pytest.approx([3.0, 4.0])
    assert engines.probe_times(0)[:5] == pytest.approx([3.0, 4.0, 6.0, 8.0, 10.0])
    assert engines.probe_times(0)[5] == pytest.approx(18.5)  # first wait after the fleet resume
    assert monitor.held() == {1: "heat guard"}
    assert engines.dead == {}
    await monitor.stop()


async def test_a_probe_in_flight_when_held_does_not_count_and_release_waits_first_wait():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1, first_wait_seconds=5)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(5.5)  # first probe at 5 answered
    engines.behaviour[0] = "hang"
    await asyncio.sleep(1)  # the probe at 6 hangs (it would time out at 7 and kill: threshold 1)
    monitor.hold(0, "heat guard")  # at 6.5: the heat guard paused generation
    await asyncio.sleep(20)
    assert engines.dead == {} and engines.probe_times(0) == pytest.approx([5.0, 6.0])
    engines.behaviour[0] = "ok"  # resumed by the heat guard
    monitor.release(0)  # at 26.5
    await asyncio.sleep(10)
    await monitor.stop()
    times = engines.probe_times(0)
    assert times[2] == pytest.approx(31.5)  # first wait after the release
    assert times[3] == pytest.approx(32.0)  # then back on the fleet's round grid (origin 0, interval 2)
    assert engines.dead == {} and monitor.held() == {}


async def test_a_held_engine_that_hangs_for_long_is_never_marked_dead_by_probes():
    spec = HealthSpec(interval_seconds=1, timeout_seconds=1, failure_threshold=2)
    engines = Engines(1)
    monitor = await started(spec, engines)
    await asyncio.sleep(0.5)
    monitor.hold(0, "heat guard")
    engines.behaviour[0] = "hang"
    await asyncio.sleep(300)
    await monitor.stop()
    assert engines.dead == {} and engines.probe_times(0) == pytest.approx([0.0])


async def test_a_hold_ends_with_its_engine_and_the_replacement_is_probed():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1)
    engines = Engines(1)
    incarnation = {0: 1}
    engines.targets = lambda: [ProbeTarget(0, incarnation[0], f"http://127.0.0.2:{incarnation[0]}")]
    monitor = await started(spec, engines)
    await asyncio.sleep(1)
    monitor.hold(0, "heat guard")
    await asyncio.sleep(4)
    assert engines.probe_times(0) == pytest.approx([0.0])
    incarnation[0] = 2  # the held engine died; its slot was recreated
    monitor.targets_changed()  # at 5
    await asyncio.sleep(3)
    await monitor.stop()
    assert engines.probe_times(0) == pytest.approx([0.0, 5.0, 6.0])
    assert monitor.held() == {}


async def test_a_hold_before_the_engine_is_known_applies_to_it():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1)
    engines = Engines(1)
    monitor = HealthMonitor(spec, targets=engines.targets, probe=engines.probe, on_dead=engines.on_dead, fleet="t")
    monitor.hold(0, "heat guard")  # the guard paused it before the monitor's first round
    await monitor.start()
    await asyncio.sleep(10)
    assert engines.probe_times(0) == []
    monitor.release(0)
    await asyncio.sleep(1)
    await monitor.stop()
    assert engines.probe_times(0) == pytest.approx([10.0])


async def test_new_engines_join_at_the_next_round_or_at_once_when_announced():
    spec = HealthSpec(interval_seconds=5, timeout_seconds=1, failure_threshold=1)
    engines = Engines(2)
    engines.gone.add(1)  # still starting: not a target yet
    monitor = await started(spec, engines)
    await asyncio.sleep(6)
    engines.gone.discard(1)  # alive at 6; the list is read again at the next round
    await asyncio.sleep(6)
    assert engines.probe_times(1) == pytest.approx([10.0])
    engines.behaviour[2] = "ok"  # a replacement, announced at 12
    monitor.targets_changed()
    await asyncio.sleep(1)
    await monitor.stop()
    assert engines.probe_times(2) == pytest.approx([12.0])
    assert engines.probe_times(0) == pytest.approx([0.0, 5.0, 10.0])


# --- the loop-stall brake ----------------------------------------------------------------------------

async def test_a_stalled_prober_loop_does_not_mark_a_healthy_fleet_dead():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=1)
    engines = Engines(8, stall_s=20)
    monitor = await started(spec, engines, fleet="stall")
    await asyncio.sleep(3)
    engines.behaviour[7] = "stall"  # its probe at 4 (the last started) blocks the loop until 24: all time out
    await asyncio.sleep(30)
    await monitor.stop()
    assert engines.dead == {}
    assert voided("stall", "loop_lag") == 8
    # The void probes were repeated at once, after the stall, and the fleet went back to its rounds.
    for slot in range(8):
        assert engines.probe_times(slot)[:5] == pytest.approx([0, 2, 4, 24, 26])


async def test_most_of_the_fleet_timing_out_while_the_loop_lagged_is_not_counted():
    # A 4.5 s stall, shorter than the 5 s timeout, that ends just after the probes' deadline: the answers
    # of slow but healthy engines (3 s) sat unread, every probe timed out by little.
    spec = HealthSpec(interval_seconds=10, timeout_seconds=5, failure_threshold=1)
    engines = Engines(6, answer_s=3)
    monitor = await started(spec, engines, fleet="mass")
    await asyncio.sleep(11)  # the round at 10 is in flight
    stall_loop(4.5)  # a blocking call on the prober's loop, until 15.5
    await asyncio.sleep(20)
    await monitor.stop()
    assert engines.dead == {}
    assert voided("mass", "mass_timeout") == 6
    assert engines.probe_times(0)[:4] == pytest.approx([0, 10, 15.5, 20])


async def test_a_hang_after_a_stall_is_still_marked_dead_within_the_bound():
    spec = HealthSpec(interval_seconds=4, timeout_seconds=3, failure_threshold=3)
    engines = Engines(3, stall_s=20)
    monitor = await started(spec, engines, fleet="stall-then-hang")
    await asyncio.sleep(3)
    engines.behaviour[0] = "stall"  # the round at 4 stalls until 24
    await asyncio.sleep(25.5)  # 28.5 (the stall counts as the test's sleep too)
    hung_at, dead_at, reason = await hang_until_dead(monitor, engines, 2)
    assert dead_at - hung_at <= hang_detection_bound(spec)
    # Round at 32, then back-to-back 3 s probes: 32+3+3+3 = 41.
    assert dead_at == pytest.approx(41.0) and "3 consecutive failed health probes" in reason
    assert sorted(engines.dead) == [2]


async def test_a_fleet_that_really_hangs_at_once_is_marked_dead():
    # The second guard needs a lagging loop: with the loop running on time, timeouts are evidence.
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=2)
    engines = Engines(6)
    monitor = await started(spec, engines, fleet="all-hang")
    await asyncio.sleep(1)
    for slot in range(6):
        engines.behaviour[slot] = "hang"
    await asyncio.sleep(10)
    await monitor.stop()
    assert sorted(engines.dead) == list(range(6))
    assert [at for at, _ in engines.dead.values()] == pytest.approx([4.0] * 6)  # round at 2, retry at 3
    assert voided("all-hang", "loop_lag") == voided("all-hang", "mass_timeout") == 0


async def test_a_refusal_in_a_stalled_round_still_counts():
    spec = HealthSpec(interval_seconds=2, timeout_seconds=1, failure_threshold=3)
    engines = Engines(4, stall_s=20)
    monitor = await started(spec, engines, fleet="stall-refuse")
    await asyncio.sleep(3)
    engines.behaviour[0] = "stall"
    engines.behaviour[1] = "refuse"  # refused in the stalled round: nothing listens, whatever the loop did
    await asyncio.sleep(30)
    await monitor.stop()
    assert sorted(engines.dead) == [1]
    assert engines.dead[1][1].startswith("connection refused")
