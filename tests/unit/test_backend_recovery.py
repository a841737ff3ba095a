"""The shared slot state machine and recovery loop of fleet backends, on a virtual clock.

The launch/terminate hooks are scripted (an engine that comes up after N seconds or dies after N
seconds), so the budgets, backoff timing and crash-loop failure can be checked exactly. The local
backend's real processes are covered by the integration tests.
"""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.crds.specs import RecoverySpec
from rlfleet.orchestrator.fleet.backend import DeathCause, DeathEvent, EngineState, SlotFleetBackend, SlotRecord
from rlfleet.orchestrator.fleet.errors import FleetFailed, FleetNotReady
from rlfleet.policy.recovery import backoff_schedule

pytestmark = pytest.mark.looptime


class ScriptedBackend(SlotFleetBackend):
    """Each slot's incarnations follow a script: ("up", seconds) or ("die", seconds, exit_code)."""

    def __init__(self, scripts: dict[int, list[tuple]], **kwargs):
        super().__init__(fleet="t", replicas=len(scripts), **kwargs)
        self.scripts = scripts
        self.launched: list[tuple[float, int, int]] = []
        self.terminated: list[tuple[int, int, bool]] = []
        self.tasks: set[asyncio.Task] = set()

    async def _launch(self, rec: SlotRecord) -> None:
        loop = asyncio.get_running_loop()
        self.launched.append((loop.time(), rec.slot, rec.incarnation))
        script = self.scripts[rec.slot]
        step = script[min(rec.incarnation - 1, len(script) - 1)]
        rec.url = f"http://127.0.0.{rec.slot + 2}:{1000 + rec.incarnation}"
        rec.handle = [f"engine {rec.slot}.{rec.incarnation} starting"]
        task = asyncio.create_task(self._run(rec, rec.incarnation, step))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, rec: SlotRecord, inc: int, step: tuple) -> None:
        await asyncio.sleep(step[1])
        if step[0] == "up":
            self._set_alive(rec.slot, inc)
        else:
            rec.handle.append("OSError: Repo id must be in the form 'repo_name': '/no/such/model'.")
            rec.exit_code = step[2]
            await self.mark_dead(rec.slot, f"process exited with code {step[2]}", cause=DeathCause.STARTUP_FAILED,
                                 incarnation=inc)

    async def _terminate(self, rec: SlotRecord, *, graceful: bool) -> None:
        self.terminated.append((rec.slot, rec.incarnation, graceful))

    def _log_tail(self, rec: SlotRecord, lines: int = 30) -> list[str]:
        return list(rec.handle or [])[-lines:]


SPEC = RecoverySpec(max_restarts_per_engine=2, max_restarts_per_run=10, backoff_base_seconds=1,
                    backoff_max_seconds=60, wait_all_alive_timeout_seconds=600)


async def test_crash_loop_fails_the_fleet_after_the_budget_in_backoff_time():
    backend = ScriptedBackend({0: [("die", 10, 1)]}, recovery=SPEC)
    loop = asyncio.get_running_loop()
    await backend.start()
    with pytest.raises(FleetFailed) as info:
        await backend.wait_all_alive()
    elapsed = loop.time()
    # 3 starts of 10 s each, plus the backoffs before the 2 recreations (1 s, 2 s).
    assert elapsed == pytest.approx(3 * 10 + sum(backoff_schedule(SPEC, 2)))
    assert [t for t, _, _ in backend.launched] == pytest.approx([0, 11, 23])
    error = info.value
    assert error.slot == 0 and error.exit_code == 1 and error.reason == "EngineCrashLoop"
    assert "engine error: OSError: Repo id must be in the form" in str(error)
    assert "3 start(s)" in str(error)
    assert backend.engines()[0].state is EngineState.FAILED
    with pytest.raises(FleetFailed):  # the failure is sticky
        await backend.recover()
    await backend.stop()


async def test_min_ready_lets_the_run_go_on_without_a_crash_looping_slot():
    backend = ScriptedBackend({0: [("up", 5)], 1: [("die", 3, 1)]}, recovery=SPEC, min_ready=1)
    await backend.start()
    alive = await backend.wait_all_alive()
    assert [e.slot for e in alive] == [0]
    assert backend.engines()[1].state is EngineState.FAILED and backend.failure is None
    await backend.stop()


async def test_death_event_then_recovery_makes_a_new_incarnation():
    backend = ScriptedBackend({0: [("up", 2)], 1: [("up", 2)]}, recovery=SPEC)
    events: list[DeathEvent] = []
    backend.subscribe(events.append)
    await backend.start()
    await backend.wait_all_alive()
    old = backend.engines()[1]
    assert await backend.mark_dead(1, "3 consecutive failed health probes", cause=DeathCause.PROBE_FAILED)
    assert [(e.slot, e.incarnation, e.url, e.cause) for e in events] == [(1, 1, old.url, DeathCause.PROBE_FAILED)]
    assert backend.terminated[-1] == (1, 1, False)  # torn down at once, no grace
    # A stale report about the old incarnation changes nothing.
    assert not await backend.mark_dead(1, "late", incarnation=1)
    assert await backend.recover() == [1]
    new = backend.engines()[1]
    assert new.incarnation == 2 and new.url != old.url and new.restarts == 1
    assert new.state is EngineState.STARTING
    await backend.wait_all_alive()
    assert backend.engines()[1].state is EngineState.ALIVE
    assert not await backend.mark_dead(1, "late report about the replaced engine", incarnation=1)
    assert backend.engines()[1].state is EngineState.ALIVE
    await backend.stop()


async def test_wait_all_alive_is_bounded():
    backend = ScriptedBackend({0: [("up", 1000)]}, recovery=SPEC)
    await backend.start()
    loop = asyncio.get_running_loop()
    with pytest.raises(FleetNotReady, match="0 of 1 engines alive after 30 s"):
        await backend.wait_all_alive(30)
    assert loop.time() == pytest.approx(30)
    await backend.stop()


async def test_wait_returns_degraded_when_the_floor_is_met():
    backend = ScriptedBackend({0: [("up", 1)], 1: [("up", 1000)]}, recovery=SPEC, min_ready=1)
    await backend.start()
    alive = await backend.wait_all_alive(20)
    assert [e.slot for e in alive] == [0]
    await backend.stop()


async def test_a_resumed_runs_earlier_recreations_count_against_its_budget():
    spec = RecoverySpec(max_restarts_per_engine=5, max_restarts_per_run=2, backoff_base_seconds=0)
    backend = ScriptedBackend({0: [("die", 1, 1), ("up", 1)]}, recovery=spec)
    backend.count_earlier_restarts(2)  # the run recreated two engines before its checkpoint
    await backend.start()
    with pytest.raises(FleetFailed, match="per run"):
        await backend.wait_all_alive()
    assert len(backend.launched) == 1 and backend.run_restarts == 2
    await backend.stop()

    fresh = ScriptedBackend({0: [("die", 1, 1), ("up", 1)]}, recovery=spec)
    await fresh.start()
    assert len(await fresh.wait_all_alive()) == 1 and fresh.run_restarts == 1
    await fresh.stop()


async def test_run_budget_spans_slots():
    spec = RecoverySpec(max_restarts_per_engine=5, max_restarts_per_run=1, backoff_base_seconds=0)
    backend = ScriptedBackend({0: [("die", 1, 1)], 1: [("die", 1, 1)]}, recovery=spec)
    await backend.start()
    with pytest.raises(FleetFailed, match="per run"):
        await backend.wait_all_alive()
    # Both died at once; one recreation could not bring the fleet back to 2, so none was spent.
    assert backend.run_restarts == 0
    await backend.stop()
