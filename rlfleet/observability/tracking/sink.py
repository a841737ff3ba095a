"""One tracker beside the training loop: a bounded queue, a worker task, bounded calls, warn once."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlfleet.observability import metrics
from rlfleet.util.aio import stop_task

log = logging.getLogger(__name__)


class Tracker(Protocol):
    name: str

    async def open(self, params: Mapping[str, str]) -> None: ...

    async def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    async def close(self, status: str) -> None: ...


@dataclass
class SinkCounts:
    written: int = 0
    dropped: int = 0
    failure: str | None = None  # the first failure, as warned
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"written": self.written, "dropped": self.dropped, "failure": self.failure, **self.extra}


class TrackerSink:
    """Feeds one tracker from a bounded queue. Every call is bounded by `call_timeout_s`, `open` by
    `open_timeout_s` (unset: the same; a tracker whose open makes many calls gets a bound scaled to them), a
    record's `log` by `log_timeout_s(number of scalars)` (unset: call_timeout_s; a tracker that writes a large
    record in several requests gets a bound scaled to them); a
    call that fails or runs past it drops its record (an `open` that fails is tried again before the next
    record, so a tracker's open must resume what it got). The first failure is a warning (`on_warning`),
    later ones are only counted."""

    def __init__(self, tracker: Tracker, params: Mapping[str, str], *, call_timeout_s: float = 10.0,
                 open_timeout_s: float | None = None, log_timeout_s: Callable[[int], float] | None = None,
                 queue_size: int = 10_000, on_warning=None):
        self.tracker = tracker
        self.params = dict(params)
        self.call_timeout_s = call_timeout_s
        self.open_timeout_s = call_timeout_s if open_timeout_s is None else open_timeout_s
        self.log_timeout_s = log_timeout_s or (lambda _n: call_timeout_s)
        self.counts = SinkCounts()
        self._queue: asyncio.Queue[tuple[int, dict[str, float]]] = asyncio.Queue(queue_size)
        self._on_warning = on_warning
        self._opened = False
        self._in_flight = 0
        self._task: asyncio.Task | None = None
        metrics.TRACKER_RECORDS.labels(tracker=tracker.name, outcome="written")
        metrics.TRACKER_RECORDS.labels(tracker=tracker.name, outcome="dropped")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._work(), name=f"tracker-{self.tracker.name}")

    def submit(self, step: int, scalars: Mapping[str, float]) -> None:
        """Queue one record; never waits (a full queue drops it, counted)."""
        try:
            self._queue.put_nowait((step, dict(scalars)))
        except asyncio.QueueFull:
            self._drop(1, "its queue is full (the tracker is slower than training)")

    async def close(self, status: str = "FINISHED", *, drain_s: float = 30.0) -> None:
        """Write what is queued within `drain_s` (what is left is dropped, counted), then close the tracker."""
        if self._task is None:
            return
        try:
            async with asyncio.timeout(drain_s):
                await self._queue.join()
        except TimeoutError:
            pass
        await stop_task(self._task)  # a cancellation of the caller (Ctrl-C at the run's end) still propagates
        left = self._queue.qsize() + self._in_flight
        self._in_flight = 0
        if left:
            self._drop(left, f"the run ended with {left} record(s) not written within {drain_s:g} s")
        await self._call(self.tracker.close(status), "close")  # also releases what a failed open held

    async def _work(self) -> None:
        while True:
            step, scalars = await self._queue.get()
            self._in_flight = 1  # dropped if the run ends while it is being written
            try:
                if not self._opened:
                    self._opened = await self._call(self.tracker.open(self.params), "open", self.open_timeout_s)
                if self._opened and await self._call(self.tracker.log(step, scalars), f"step {step}",
                                                     self.log_timeout_s(len(scalars))):
                    self.counts.written += 1
                    metrics.TRACKER_RECORDS.labels(tracker=self.tracker.name, outcome="written").inc()
                else:
                    self._drop(1, None)
                self._in_flight = 0
            finally:
                self._queue.task_done()

    async def _call(self, call, what: str, bound_s: float | None = None) -> bool:
        bound_s = self.call_timeout_s if bound_s is None else bound_s
        try:
            async with asyncio.timeout(bound_s):
                await call
            return True
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self._warn(f"{what}: no answer within {bound_s:g} s")
        except Exception as exc:  # a tracker's failure is never the run's
            self._warn(f"{what}: {type(exc).__name__}: {exc}")
        return False

    def _drop(self, n: int, why: str | None) -> None:
        self.counts.dropped += n
        metrics.TRACKER_RECORDS.labels(tracker=self.tracker.name, outcome="dropped").inc(n)
        if why is not None:
            self._warn(why)

    def _warn(self, message: str) -> None:
        if self.counts.failure is not None:
            return
        self.counts.failure = message[:500]
        text = (f"tracker {self.tracker.name} failed ({message[:300]}); training goes on, its records are dropped "
                "and counted (rlfleet_tracker_records_total{outcome=\"dropped\"})")
        if self._on_warning is not None:  # the run's own warning line
            self._on_warning(text)
        else:
            log.warning(text)
