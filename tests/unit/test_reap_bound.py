"""A SIGKILLed leader's reap is bounded: a process in uninterruptible sleep may never go, and a stop
(an engine marked dead, a run's cleanup) must not wait for it. The reap goes on in the background."""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.util import procs
from rlfleet.util.procs import reap_within

pytestmark = pytest.mark.looptime  # a virtual clock: the bound is exact, whatever the machine's load


async def exits_when(released: asyncio.Event, status: int = -9) -> int:
    """A leader's reap that ends only when `released` is set (its uninterruptible sleep ends)."""
    await released.wait()
    return status


async def test_a_reap_that_does_not_end_is_given_up_at_the_bound_and_goes_on_behind():
    loop = asyncio.get_running_loop()
    released = asyncio.Event()
    started = loop.time()
    assert await reap_within(exits_when(released), timeout_s=0.2) is None
    assert loop.time() - started == pytest.approx(0.2)
    assert len(procs._reaping) == 1  # still reaping
    released.set()
    await asyncio.sleep(0.01)
    assert not procs._reaping


async def test_a_reap_in_time_gives_the_exit_status():
    released = asyncio.Event()
    released.set()
    assert await reap_within(exits_when(released, -9), timeout_s=5) == -9
    assert not procs._reaping


async def test_a_cancelled_stop_leaves_the_reap_going_on():
    released = asyncio.Event()
    stop = asyncio.ensure_future(reap_within(exits_when(released), timeout_s=60))
    await asyncio.sleep(0.01)
    stop.cancel()
    await asyncio.gather(stop, return_exceptions=True)
    assert stop.cancelled()
    assert len(procs._reaping) == 1
    released.set()
    await asyncio.sleep(0.01)
    assert not procs._reaping
