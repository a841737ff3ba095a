"""HealthMonitor: heart-beats every engine of one fleet, concurrently, and reports the dead.

The decisions (when to probe, when an engine is dead) are EngineHealth's; this module only runs
probes as tasks, bounds each by `timeout_seconds`, and calls `on_dead` once per dead incarnation.
One event loop handles a thousand engines: a probe is a task, there is no thread per engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from rlfleet import metrics
from rlfleet.crds.specs import HealthSpec
from rlfleet.orchestrator.errors import CallError, FailureKind
from rlfleet.orchestrator.health import EngineHealth, ProbeTicket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeTarget:
    """One engine incarnation to probe. A recreated slot is a new incarnation (and URL)."""

    slot: int
    incarnation: int
    url: str

    @property
    def key(self) -> tuple[int, int]:
        return (self.slot, self.incarnation)


ProbeFn = Callable[[ProbeTarget], Awaitable[object]]  # returns on success, raises on failure
DeadFn = Callable[[ProbeTarget, str], Awaitable[None]]


def describe_failure(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    """(metric kind, human reason) of a failed probe."""
    if isinstance(exc, CallError):
        return exc.kind.value, str(exc)
    if isinstance(exc, TimeoutError):
        return FailureKind.TIMEOUT.value, f"no answer within {timeout_s:g} s"
    return "error", f"{type(exc).__name__}: {exc}"


class HealthMonitor:
    """Probes the targets of one fleet. start/pause/resume/stop; safe to cancel at any point."""

    def __init__(self, spec: HealthSpec, *, targets: Callable[[], Iterable[ProbeTarget]], probe: ProbeFn,
                 on_dead: DeadFn, fleet: str = "default"):
        self.spec = spec
        self.fleet = fleet
        self._targets = targets
        self._probe_fn = probe
        self._on_dead = on_dead
        self._health: dict[tuple[int, int], EngineHealth] = {}
        self._known: dict[tuple[int, int], ProbeTarget] = {}
        self._probes: dict[tuple[int, int], asyncio.Task] = {}
        self._callbacks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._paused = False
        self._origin = 0.0

    # --- lifecycle ----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def paused(self) -> bool:
        return self._paused

    async def start(self, *, paused: bool = False) -> None:
        if self.running:
            return
        loop = asyncio.get_running_loop()
        self._paused = paused
        self._origin = loop.time()
        self._loop_task = asyncio.create_task(self._run(), name=f"health-monitor-{self.fleet}")

    def pause(self) -> None:
        """Stop probing now; probes in flight are cancelled and their results ignored."""
        self._paused = True
        for health in self._health.values():
            health.pause()
        for task in self._probes.values():
            task.cancel()
        self._wake.set()

    def resume(self) -> None:
        """Probe again after `first_wait_seconds`, with failure counts cleared."""
        now = asyncio.get_running_loop().time()
        self._paused = False
        self._origin = now
        for health in self._health.values():
            health.resume(now)
        self._wake.set()

    def targets_changed(self) -> None:
        """Look at the target list now instead of at the next round (new or removed engines)."""
        self._wake.set()

    def forget(self, slot: int, incarnation: int) -> None:
        """Stop probing an incarnation already known dead (e.g. the process exited)."""
        key = (slot, incarnation)
        if key in self._health:
            self._health[key].mark_dead("known dead")
        task = self._probes.get(key)
        if task is not None:
            task.cancel()
        self._wake.set()

    async def stop(self) -> None:
        """Cancel the loop and every probe; wait for dead callbacks already running to finish."""
        tasks = [t for t in (self._loop_task, *self._probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._loop_task = None
        if self._callbacks:
            await asyncio.gather(*self._callbacks, return_exceptions=True)

    def health(self, slot: int, incarnation: int) -> EngineHealth | None:
        return self._health.get((slot, incarnation))

    # --- the loop -----------------------------------------------------------------------------------

    def _sync_targets(self) -> None:
        current = {t.key: t for t in self._targets()}
        for key in list(self._health):
            if key not in current:
                del self._health[key]
                self._known.pop(key, None)
                task = self._probes.pop(key, None)
                if task is not None:
                    task.cancel()
        for key, target in current.items():
            if key not in self._health:
                # A new engine joins the current round grid (and respects a first wait still running).
                self._health[key] = EngineHealth(self.spec, origin=self._origin, paused=self._paused)
            self._known[key] = target

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            try:
                self._sync_targets()
            except Exception:  # noqa: BLE001 - keep probing the engines already known
                log.exception("fleet %s: reading the engine list failed", self.fleet)
            now = loop.time()
            wake_at = now + self.spec.interval_seconds  # re-read targets at least once a round
            for key, health in self._health.items():
                if health.is_due(now):
                    ticket = health.start_probe(now)
                    self._probes[key] = asyncio.create_task(
                        self._probe_one(self._known[key], health, ticket), name=f"probe-{self.fleet}-{key}")
                due = health.wake_time()
                if due is not None:
                    wake_at = min(wake_at, due)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake_at - loop.time())):
                    await self._wake.wait()

    async def _probe_one(self, target: ProbeTarget, health: EngineHealth, ticket: ProbeTicket) -> None:
        loop = asyncio.get_running_loop()
        labels = {"fleet": self.fleet}
        try:
            try:
                async with asyncio.timeout(self.spec.timeout_seconds):
                    await self._probe_fn(target)
            except Exception as exc:  # noqa: BLE001 - every failure counts as a failed probe
                kind, reason = describe_failure(exc, self.spec.timeout_seconds)
                metrics.ENGINE_PROBES.labels(**labels, result="failure").inc()
                metrics.ENGINE_PROBE_FAILURES.labels(**labels, kind=kind).inc()
                if health.probe_failed(ticket, loop.time(), reason):
                    message = (f"{health.consecutive_failures} consecutive failed health probes, "
                               f"last: {reason}")
                    log.warning("fleet %s slot %d (%s): marked dead: %s", self.fleet, target.slot,
                                target.url, message)
                    task = asyncio.create_task(self._report_dead(target, message))
                    self._callbacks.add(task)
                    task.add_done_callback(self._callbacks.discard)
            else:
                metrics.ENGINE_PROBES.labels(**labels, result="success").inc()
                health.probe_succeeded(ticket, loop.time())
        except asyncio.CancelledError:
            health.probe_abandoned(ticket)
            raise
        finally:
            if self._probes.get(target.key) is asyncio.current_task():
                del self._probes[target.key]
            self._wake.set()

    async def _report_dead(self, target: ProbeTarget, reason: str) -> None:
        try:
            await self._on_dead(target, reason)
        except Exception:  # noqa: BLE001 - a failing callback must not stop monitoring
            log.exception("fleet %s: on_dead for slot %d failed", self.fleet, target.slot)
