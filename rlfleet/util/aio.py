"""asyncio helpers shared by every layer."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def stop_task(task: asyncio.Future[Any] | None) -> None:
    """Cancel `task` (a task or any future) and wait until it is done.

    - The task ending cancelled (the normal outcome) returns None.
    - An exception the task ended with (before or while it was being cancelled) is raised here, as
      awaiting the task would raise it; callers that do not care suppress `Exception`.
    - The caller's own cancellation is never swallowed: if the caller is cancelled while it waits,
      CancelledError propagates (the task, already cancelled, finishes on its own). This is the
      difference from `task.cancel(); with suppress(CancelledError): await task`, which cannot tell
      the task's cancellation from the caller's.
    """
    if task is None:
        return
    task.cancel()
    if not task.done():
        # asyncio.wait neither raises the task's outcome nor cancels the task when the caller is
        # cancelled, so a CancelledError out of it is always the caller's own.
        await asyncio.wait((task,))
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        raise exc


async def settle(future: asyncio.Future[Any]) -> BaseException | None:
    """Wait until `future` is done without cancelling it (work in a thread ends by itself) and return
    its exception, retrieved, or None; for cleanup paths where another error is the one that counts."""
    if not future.done():
        await asyncio.wait((future,))
    return None if future.cancelled() else future.exception()


def resolved(value: T) -> asyncio.Future[T]:
    """A future already done with `value`, for code that awaits work which, this time, needed none."""
    future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class LazyTask(Generic[T]):
    """Work started as a task on the first `start()`, and only then: work that may not be needed, or
    not yet (a weight snapshot written once the broadcast is done, or at once for its fallback)."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, T]]):
        self._make = make
        self.task: asyncio.Task[T] | None = None  # None: not started

    def start(self) -> asyncio.Task[T]:
        if self.task is None:
            self.task = asyncio.ensure_future(self._make())
        return self.task


def first_error(error: BaseException) -> BaseException:
    """The error a task group raised, unwrapped (its first, innermost one): what ended the work."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error
