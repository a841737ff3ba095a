"""stop_task on a virtual clock (looptime): real tasks, no fakes."""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.util.aio import LazyTask, resolved, settle, stop_task

pytestmark = pytest.mark.looptime


async def test_stops_a_running_task_and_waits_for_its_cleanup():
    cleaned = asyncio.Event()

    async def worker() -> None:
        try:
            await asyncio.sleep(1000)
        finally:
            await asyncio.sleep(2)  # cleanup that takes time: stop_task waits for it
            cleaned.set()

    task = asyncio.create_task(worker())
    await asyncio.sleep(1)
    await stop_task(task)
    assert task.cancelled() and cleaned.is_set()
    assert asyncio.get_running_loop().time() == pytest.approx(3)


async def test_none_and_finished_tasks_are_fine():
    await stop_task(None)

    async def quick() -> int:
        return 1

    task = asyncio.create_task(quick())
    await task
    await stop_task(task)
    assert task.result() == 1


async def test_a_caller_cancelled_while_waiting_still_gets_cancelled():
    stopped = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(1000)
        finally:
            await asyncio.shield(asyncio.sleep(10))
            stopped.set()

    worker = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    caller_done = asyncio.Event()

    async def caller() -> None:
        try:
            await stop_task(worker)
        finally:
            caller_done.set()
        raise AssertionError("not reached: the caller's cancellation must propagate")

    outer = asyncio.create_task(caller())
    await asyncio.sleep(1)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert outer.cancelled() and caller_done.is_set()
    assert not stopped.is_set()  # the worker was cancelled and finishes its cleanup on its own
    await asyncio.sleep(10)
    assert stopped.is_set() and worker.cancelled()


async def test_an_exception_the_task_ends_with_is_raised():
    async def failing_on_cancel() -> None:
        try:
            await asyncio.sleep(1000)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(failing_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await stop_task(task)

    async def failed_before() -> None:
        raise ValueError("early")

    early = asyncio.create_task(failed_before())
    await asyncio.sleep(0)
    assert early.done()
    with pytest.raises(ValueError, match="early"):
        await stop_task(early)


async def test_a_task_that_swallows_cancellation_and_returns_is_stopped_quietly():
    async def stubborn() -> str:
        try:
            await asyncio.sleep(1000)
        except asyncio.CancelledError:
            return "finished anyway"
        return "never"

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await stop_task(task)
    assert task.result() == "finished anyway"


async def test_plain_futures_are_stopped_too():
    future = asyncio.get_running_loop().create_future()
    await stop_task(future)
    assert future.cancelled()


async def test_settle_waits_without_cancelling_and_hands_back_the_error():
    import threading

    release = threading.Event()

    def copy() -> None:  # work in a thread: cancelling its future would not stop it
        release.wait(5)
        raise OSError("copy failed")

    running = asyncio.ensure_future(asyncio.to_thread(copy))
    asyncio.get_running_loop().call_later(0.05, release.set)
    error = await settle(running)
    assert isinstance(error, OSError) and str(error) == "copy failed" and release.is_set()
    assert await settle(running) is error  # settled already: at once, the same error

    done = asyncio.ensure_future(asyncio.sleep(0))
    assert await settle(done) is None
    cancelled = asyncio.ensure_future(asyncio.sleep(10))
    cancelled.cancel()
    assert await settle(cancelled) is None


async def test_lazy_task_starts_its_work_on_first_use_only_once():
    started: list[int] = []

    async def work() -> int:
        started.append(1)
        return 7

    lazy = LazyTask(work)
    await asyncio.sleep(0)
    assert lazy.task is None and started == []  # not needed yet: nothing ran
    task = lazy.start()
    assert lazy.start() is task  # one task, however often it is asked for
    assert await task == 7 and started == [1]


async def test_resolved_is_a_done_future_that_awaits_to_its_value():
    future = resolved("step_3")
    assert future.done() and await future == "step_3"
