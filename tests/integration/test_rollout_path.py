"""The rollout request path and the 503 watchdog through a real sglang-router and real SGLang engines."""
from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import REGISTRY

from helpers.engines import StartupFailed, add_workers, remove_worker, start_engine
from rlfleet.crds.specs import WatchdogSpec
from rlfleet.orchestrator.guards.watchdog import RolloutEnginesUnavailable, WatchdogTask
from rlfleet.orchestrator.rollout.client import RetryPolicy, RolloutClient, RolloutRequestFailed, generate_all
from rlfleet.util.procs import tail_file

pytestmark = pytest.mark.engines

TIMEOUT = aiohttp.ClientTimeout(total=10)


FAILED_RESULTS = ("connection_refused", "connection_closed", "server_error", "unavailable", "timeout", "aborted")


async def wait_running(session: aiohttp.ClientSession, engine_url: str, timeout_s: float = 60) -> None:
    """Until the engine reports a request running (its Prometheus gauge)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.get(engine_url + "/metrics", timeout=TIMEOUT) as resp:
            text = await resp.text()
        if any(float(line.split()[-1]) > 0 for line in text.splitlines() if line.startswith("sglang:num_running_reqs")):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no request ever ran on {engine_url}")


def attempts(fleet: str, result: str) -> float:
    return REGISTRY.get_sample_value("rlfleet_rollout_attempts_total", {"fleet": fleet, "result": result}) or 0.0


async def test_an_engine_killed_mid_rollout_loses_no_sample_and_none_is_counted_twice(
        sglang_engines, sglang_router, shared_engine):
    """The router's only engine dies under load; a replacement (the session's shared engine) joins;
    every sample arrives once.

    (With a second live engine the router itself re-sends in-flight requests, so the client never
    sees the death; with one engine the failures reach the client and its retries must carry them.)
    """
    router = await sglang_router.start()
    doomed, replacement = await sglang_engines.start(), shared_engine
    samples = {f"sample-{i:03d}": {"text": f"Prompt {i}:",
                                   "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
               for i in range(40)}
    fleet = "it-rollout-kill"
    failed_before = sum(attempts(fleet, r) for r in FAILED_RESULTS)
    async with aiohttp.ClientSession() as session:
        await add_workers(session, router.url, [doomed.url])
        client = RolloutClient(router.url, session, fleet=fleet, rng=random.Random(0),
                               policy=RetryPolicy(max_attempts=8, backoff_base_s=0.5, backoff_max_s=4, deadline_s=240))
        rollout = asyncio.create_task(generate_all(client, samples, concurrency=8))
        await wait_running(session, doomed.url)
        doomed.process.signal_group(signal.SIGKILL)
        # What the orchestrator does on the death: the dead engine leaves the router at once; a
        # replacement joins once it is up (here after 1.5 s), and meanwhile the router has no engine.
        await remove_worker(session, router.url, doomed.url)
        await asyncio.sleep(1.5)
        await add_workers(session, router.url, [replacement.url])
        ledger = await asyncio.wait_for(rollout, 300)
    assert ledger.failed == {}
    assert sorted(ledger.delivered) == sorted(samples)  # every sample, once
    assert all(answer["meta_info"]["id"] == sample_id for sample_id, answer in ledger.delivered.items())
    assert sum(attempts(fleet, r) for r in FAILED_RESULTS) > failed_before, "the kill did not hit the rollout"


async def test_watchdog_fails_the_run_with_the_engine_log_when_no_engine_can_serve(sglang_router, tmp_path):
    """All engines gone, and the one recovery attempt starts an engine that dies at startup."""
    router = await sglang_router.start()  # no workers: every /generate is a 503
    spec = WatchdogSpec(window_seconds=2, check_interval_seconds=1, limit=5, checks=3)
    log_dir = tmp_path / "engines"
    missing_model = tmp_path / "no-such-model"
    fleet = "it-watchdog"

    async def recover() -> None:
        with contextlib.suppress(StartupFailed):
            await start_engine(missing_model, log_dir=log_dir, name="rollout-0", ready_timeout_s=180)

    async with aiohttp.ClientSession() as session:
        async def can_serve() -> bool:
            probe = {"text": "a", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            async with session.post(router.url + "/generate", json=probe, timeout=TIMEOUT) as resp:
                return resp.status == 200

        def engine_logs() -> dict[str, list[str]]:
            return {"rollout-0": tail_file(Path(log_dir) / "rollout-0.log", 20)}

        watchdog = WatchdogTask(spec, recover=recover, can_serve=can_serve, engine_logs=engine_logs,
                                fleet=fleet, recovery_timeout_s=200)
        client = RolloutClient(router.url, session, fleet=fleet, on_failure=watchdog.record_failure,
                               policy=RetryPolicy(max_attempts=3, backoff_base_s=0.1, backoff_max_s=1, deadline_s=30))
        sent_before = sum(attempts(fleet, r) for r in ("ok", *FAILED_RESULTS))

        async def producer(worker: int) -> None:
            for n in range(10**6):
                with contextlib.suppress(RolloutRequestFailed):
                    await client.generate(f"w{worker}-{n}", {"text": "hi", "sampling_params": {"max_new_tokens": 4}})

        started = time.monotonic()
        failures: list[RolloutEnginesUnavailable] = []
        try:
            async with asyncio.TaskGroup() as group:
                producers = [group.create_task(producer(w)) for w in range(4)]
                await watchdog.run()
        except* RolloutEnginesUnavailable as raised:
            failures.extend(raised.exceptions)
        elapsed = time.monotonic() - started
        assert all(task.cancelled() for task in producers)  # the failure stops the rollout
    sent = sum(attempts(fleet, r) for r in ("ok", *FAILED_RESULTS)) - sent_before
    assert len(failures) == 1
    exc = failures[0]
    assert exc.reason == "RolloutEnginesUnavailable"
    assert "[rollout-0]" in exc.message and str(missing_model.name) in exc.message, exc.message
    assert watchdog.trips == 1
    assert elapsed < 200
    print(f"watchdog failed the run after {elapsed:.1f} s and {sent:.0f} requests; message:\n{exc.message}")
