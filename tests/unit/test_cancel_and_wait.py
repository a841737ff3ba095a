"""Stopping background tasks never swallows the stopper's own cancellation (a stop must stop)."""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.util.tasks import cancel_and_wait


async def test_cancels_and_waits_and_drops_the_tasks_own_outcome():
    async def forever():
        await asyncio.Event().wait()

    async def fails():
        raise RuntimeError("boom")

    a, b = asyncio.create_task(forever()), asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait([a, b, None])
    assert a.cancelled() and b.done()


async def test_a_cancelled_stopper_stays_cancelled_while_waiting_on_a_stubborn_task():
    release = asyncio.Event()

    async def stubborn():  # takes its time to finish after a cancel (a cleanup that waits)
        try:
            await asyncio.Event().wait()
        finally:
            await release.wait()

    victim = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(victim))
    await asyncio.sleep(0.01)
    stopper.cancel()  # e.g. Ctrl-C during the stop path
    with pytest.raises(asyncio.CancelledError):
        await stopper
    release.set()
    await asyncio.wait([victim])
