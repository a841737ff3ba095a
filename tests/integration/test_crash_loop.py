"""A real SGLang engine that dies at startup every time: the run fails after the restart budget,
with the engine's own error line, in the time the backoff schedule allows and no more."""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.crds.specs import EngineSpec, RecoverySpec
from rlfleet.orchestrator.fleet.backend import DeathCause, DeathEvent, EngineState
from rlfleet.orchestrator.fleet.errors import FleetFailed
from rlfleet.orchestrator.fleet.local_backend import LocalBackend
from rlfleet.policy.recovery import backoff_schedule

pytestmark = [pytest.mark.engines, pytest.mark.asyncio(loop_scope="session")]

RECOVERY = RecoverySpec(max_restarts_per_engine=2, max_restarts_per_run=10, backoff_base_seconds=1,
                        backoff_max_seconds=4)


async def test_engine_dying_at_startup_fails_the_run_after_the_budget(tmp_path):
    missing = tmp_path / "no-such-model"
    backend = LocalBackend(engine=EngineSpec(model_path=str(missing), device="cpu"), replicas=1,
                           recovery=RECOVERY, run_dir=tmp_path / "run", startup_timeout_s=300)
    deaths: list[DeathEvent] = []
    backend.subscribe(deaths.append)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await backend.start()
        with pytest.raises(FleetFailed) as info:
            await backend.wait_all_alive(900)
        total = loop.time() - started
    finally:
        await backend.stop()

    error = info.value
    lives = [event.monotonic - event.started_at for event in deaths]
    backoffs = backoff_schedule(RECOVERY, RECOVERY.max_restarts_per_engine)
    overhead = total - sum(lives) - sum(backoffs)
    print(f"\n[crash-loop] FleetFailed after {total:.1f} s: {len(deaths)} starts lived "
          f"{', '.join(f'{life:.1f}' for life in lives)} s, backoffs {backoffs} s, overhead {overhead:.2f} s\n"
          f"{str(error).splitlines()[0]}\n{str(error).splitlines()[1]}")
    assert len(deaths) == 1 + RECOVERY.max_restarts_per_engine
    assert all(event.cause is DeathCause.STARTUP_FAILED for event in deaths)
    assert [event.incarnation for event in deaths] == [1, 2, 3]
    # The engine's own error line, its exit code and log lines are in the reason.
    assert error.exit_code == 1
    assert "engine error: OSError: Repo id must be in the form" in str(error) and str(missing) in str(error)
    assert "incarnation-3.log" in str(error)
    # Nothing beyond the engines' own lives and the backoff schedule (plus process bookkeeping).
    assert 0 <= overhead < 10.0  # spawning and reaping three engines on a loaded machine; catches a stall
    assert backend.engines()[0].state is EngineState.FAILED
