"""The heat guard against a real SGLang engine, with temperatures from a file source."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import aiohttp
import pytest

from rlfleet.crds.specs import HeatGuardSpec
from rlfleet.orchestrator.guards.heat_guard import HeatAction, HeatGuardTask, post_engine_action
from rlfleet.orchestrator.guards.heat_sources import build_source

pytestmark = pytest.mark.engines

PROMPT = {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


async def generate(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[int, dict]:
    async with session.post(url + "/generate", json=PROMPT, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return resp.status, await resp.json(content_type=None)


async def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_hot_engine_is_paused_and_resumed_when_it_cools(shared_engine, tmp_path):
    engine = shared_engine  # paused through its API and resumed before the test ends
    temps = tmp_path / "gpu-temperatures"
    temps.write_text("rollout-0 60\n")
    spec = HeatGuardSpec(enabled=True, min_pause_seconds=2, max_pause_seconds=60,
                         source={"type": "file", "path": str(temps)})
    async with aiohttp.ClientSession() as session:
        guard = HeatGuardTask(spec, build_source(spec.source), engines=lambda: {"rollout-0": engine.url},
                              call_engine=functools.partial(post_engine_action, session),
                              fleet="it-heat", poll_interval_s=0.2)
        runner = asyncio.create_task(guard.run())
        loop = asyncio.get_running_loop()
        try:
            status, _ = await generate(session, engine.url, 30)
            assert status == 200

            step_started = loop.time()
            temps.write_text("# written by the node's sensor reader\nrollout-0 91\n")
            await wait_until(lambda: guard.paused_slots() == {"rollout-0"}, 10, "the pause")
            async with session.get(engine.url + "/ready", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                assert resp.status == 503  # the engine itself reports that it does not take work
            blocked = asyncio.create_task(generate(session, engine.url, 60))
            answered: list[float] = []
            blocked.add_done_callback(lambda _: answered.append(loop.time()))
            await asyncio.sleep(2.5)
            assert not blocked.done(), "a paused engine must hold new requests, not answer them"

            cooled_at = loop.time()
            temps.write_text("rollout-0 70\n")
            await wait_until(lambda: not guard.paused_slots(), 10, "the resume")
            status, body = await asyncio.wait_for(blocked, 30)
            assert status == 200
            assert body["meta_info"]["finish_reason"]["type"] != "abort"  # retract keeps requests
            assert answered[0] >= cooled_at, "the held request was answered before the GPU cooled"
            status, _ = await generate(session, engine.url, 30)
            assert status == 200

            pause, resume = guard.events
            assert (pause.action, pause.reason, pause.temp_c) == (HeatAction.PAUSE, "hot", 91)
            assert (resume.action, resume.reason, resume.temp_c) == (HeatAction.RESUME, "cooled", 70)
            assert resume.paused_seconds >= 2
            assert guard.mark_step(1, step_started, loop.time()).overlapped_pause
            assert not guard.mark_step(2, loop.time() + 1, loop.time() + 2).overlapped_pause
        finally:
            runner.cancel()  # resumes what it paused
            with contextlib.suppress(asyncio.CancelledError):
                await runner
            await post_engine_action(session, engine.url, HeatAction.RESUME)  # the session's engine serves on
