"""HealthMonitor timing on a virtual clock (looptime), with an injected probe function.

The probe stands for the network call only; what is under test is the monitor's scheduling,
bounds, pause/resume and cancellation.
"""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.crds.specs import HealthSpec
from rlfleet.orchestrator.errors import ConnectionRefused
from rlfleet.orchestrator.health import hang_detection_bound
from rlfleet.orchestrator.monitor import HealthMonitor, ProbeTarget

pytestmark = pytest.mark.looptime


class Engines:
    """Probe behaviour per slot: "ok", "hang" (never answers) or "refuse" (fails at once)."""

    def __init__(self, slots: int, answer_s: float = 0.05):
        self.behaviour = {n: "ok" for n in range(slots)}
        self.answer_s = answer_s
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

    async def on_dead(self, target: ProbeTarget, reason: str) -> None:
        self.dead[target.slot] = (asyncio.get_running_loop().time(), reason)
        self.gone.add(target.slot)

    def probe_times(self, slot: int) -> list[float]:
        return [t for t, s in self.calls if s == slot]


async def started(spec: HealthSpec, engines: Engines) -> HealthMonitor:
    monitor = HealthMonitor(spec, targets=engines.targets, probe=engines.probe, on_dead=engines.on_dead, fleet="t")
    await monitor.start()
    return monitor


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


async def test_crash_is_marked_dead_after_threshold_fast_probes():
    spec = HealthSpec(interval_seconds=5, timeout_seconds=1, failure_threshold=3)
    engines = Engines(2)
    monitor = await started(spec, engines)
    await asyncio.sleep(7)  # rounds at 0 and 5
    crashed_at = asyncio.get_running_loop().time()
    engines.behaviour[1] = "refuse"
    await asyncio.sleep(20)
    await monitor.stop()
    dead_at, reason = engines.dead[1]
    # Next round at 10, retries at 11 and 12: dead 12, i.e. within interval + threshold x timeout.
    assert dead_at == pytest.approx(12.0)
    assert dead_at - crashed_at <= hang_detection_bound(spec)
    assert "3 consecutive failed health probes" in reason and "connection_refused" in reason
    assert 0 not in engines.dead


async def test_hang_is_marked_dead_within_interval_plus_threshold_times_timeout():
    spec = HealthSpec(interval_seconds=4, timeout_seconds=3, failure_threshold=3)
    engines = Engines(3)
    monitor = await started(spec, engines)
    await asyncio.sleep(5.5)
    hung_at = asyncio.get_running_loop().time()
    engines.behaviour[2] = "hang"
    await asyncio.sleep(30)
    await monitor.stop()
    dead_at, reason = engines.dead[2]
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
    engines.behaviour[0] = "refuse"
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
