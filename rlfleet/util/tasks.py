"""Stopping background tasks without swallowing the caller's own cancellation."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: asyncio.Future | Iterable[asyncio.Future | None] | None) -> None:
    """Cancel `tasks` and wait until they are done; their own outcome (cancelled, an exception) is
    dropped, but a cancellation of the caller while it waits propagates (a stop path must never make
    a cancelled run keep running)."""
    if tasks is None:
        return
    pending = [tasks] if isinstance(tasks, asyncio.Future) else [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    for task in pending:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warning
