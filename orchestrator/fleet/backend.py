"""The fleet backend interface, and the slot bookkeeping both backends share.

A fleet is a number of engine slots (fixed for a local fleet; a run's Kubernetes fleet follows the
run's spec.rollout.replicas, see `FleetResize`). Each slot runs one engine incarnation at a time; when an
incarnation dies the slot is recreated (a new incarnation, a new URL) within the restart budgets of
RecoverySpec. `FleetBackend` is what the orchestrator talks to; the local backend (processes) and
the Kubernetes backend (pods, via the operator) implement it. `SlotFleetBackend` holds the shared
state machine and recovery loop so a backend only says how to launch and terminate an incarnation.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

from rlfleet.crds.specs import RecoverySpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.errors import FleetFailed, FleetNotReady
from rlfleet.policy.recovery import SlotView, crash_loop_message, plan_recovery

log = logging.getLogger(__name__)


class EngineState(StrEnum):
    STARTING = "starting"  # launched, not yet answering /health_generate
    ALIVE = "alive"
    DEAD = "dead"  # marked dead, waiting to be recreated
    FAILED = "failed"  # given up (budget spent); never recreated in this run
    STOPPED = "stopped"  # stopped on purpose


class DeathCause(StrEnum):
    """Why an engine was marked dead; values are metric label values."""

    EXITED = "exited"  # the process / container ended while serving
    STARTUP_FAILED = "startup_failed"  # it ended before it ever served
    STARTUP_TIMEOUT = "startup_timeout"  # it never answered within the startup bound
    PROBE_FAILED = "probe_failed"  # failureThreshold consecutive failed health probes
    LOAD_FAILED = "load_failed"  # weight loading kept failing
    UNREACHABLE = "unreachable"  # a call found the connection refused or closed mid-answer
    REQUESTED = "requested"  # someone asked (operator, user)


ENGINE_STATES = tuple(state.value for state in EngineState)  # the values of rlfleet_engine_state's `state`


def export_restart_budget(fleet: str, recovery: RecoverySpec) -> None:
    """`rlfleet_engine_restart_budget` of a fleet: what the restart alerts compare its restarts with."""
    metrics.ENGINE_RESTART_BUDGET.labels(fleet=fleet, scope="engine").set(recovery.max_restarts_per_engine)
    metrics.ENGINE_RESTART_BUDGET.labels(fleet=fleet, scope="run").set(recovery.max_restarts_per_run)


@dataclass(frozen=True)
class EngineSlot:
    """A read-only view of one slot's current incarnation."""

    slot: int
    url: str | None
    state: EngineState
    incarnation: int
    restarts: int
    weight_version: str | None = None
    last_failure: str | None = None
    exit_code: int | None = None
    pid: int | None = None
    pod: str | None = None
    log_path: str | None = None
    started_at: float | None = None  # event-loop clock when this incarnation was launched


@dataclass(frozen=True)
class DeathEvent:
    fleet: str
    slot: int
    incarnation: int
    url: str | None
    cause: DeathCause
    reason: str
    at: float  # wall clock (epoch seconds)
    monotonic: float  # event-loop clock
    started_at: float | None = None  # event-loop clock when the incarnation was launched


@dataclass(frozen=True)
class FleetResize:
    """The fleet's number of slots changed (the fleet was scaled). Slots `replicas` .. `replicas_before` - 1
    are gone: their engines (`retired`, as last seen) leave the router; they are not deaths."""

    fleet: str
    replicas_before: int
    replicas: int
    min_ready: int
    retired: tuple[EngineSlot, ...] = ()


E = TypeVar("E")
Listener = Callable[[E], Coroutine[Any, Any, None] | None]
DeathListener = Listener[DeathEvent]
ResizeListener = Listener[FleetResize]


def fleet_not_ready(backend: FleetBackend, alive: int, waited_s: float) -> FleetNotReady:
    """The error of a bounded wait that ended with fewer than minReadyEngines alive: every slot's state."""
    states = ", ".join(f"slot {e.slot}: {e.state.value}" + (f" ({e.last_failure})" if e.last_failure else "")
                       for e in backend.engines())
    return FleetNotReady(f"fleet {backend.fleet}: {alive} of {backend.replicas} engines alive after "
                         f"{waited_s:g} s, minReadyEngines={backend.min_ready}; {states}")


class Listeners(Generic[E]):
    """Who hears of a backend's events (deaths, resizes): `subscribe` and `emit`. A listener may be sync
    or async; async ones run as tasks (a death is reported without waiting for router removals), and
    one that fails is logged without keeping the others from hearing."""

    def __init__(self, what: str) -> None:
        self.what = what  # for the log: "death", "resize"
        self._listeners: list[Listener[E]] = []
        self._tasks: set[asyncio.Task] = set()

    def subscribe(self, listener: Listener[E]) -> Callable[[], None]:
        self._listeners.append(listener)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    def emit(self, event: E) -> None:
        for listener in list(self._listeners):
            try:
                result = listener(event)
            except Exception:
                log.exception("%s listener failed for %r", self.what, event)
                continue
            if inspect.iscoroutine(result):
                task = asyncio.create_task(result)
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s listener failed: %r", self.what, task.exception())

    async def drain(self) -> None:
        """Wait for listeners already running (router removals, ...)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def death_listeners() -> Listeners[DeathEvent]:
    return Listeners("death")


class FleetBackend(ABC):
    """What the orchestrator needs from a fleet, wherever its engines run."""

    fleet: str  # the fleet's name (metric label, log prefix)
    replicas: int  # number of slots
    min_ready: int  # the run goes on as long as this many engines can serve

    @abstractmethod
    async def start(self) -> None:
        """Launch every slot (returns once launched, not once alive: see wait_all_alive)."""

    @abstractmethod
    def engines(self) -> list[EngineSlot]:
        """Every slot's current incarnation, in slot order."""

    @abstractmethod
    async def mark_dead(self, slot: int, reason: str, *, cause: DeathCause = DeathCause.REQUESTED,
                        incarnation: int | None = None) -> bool:
        """Mark the slot's incarnation dead and tear it down; listeners hear of it at once.

        With `incarnation`, only that incarnation is affected (a stale report about a replaced
        engine is ignored). Returns False when nothing changed.
        """

    @abstractmethod
    async def recover(self) -> list[int]:
        """Recreate dead slots within the budgets (after their backoff); returns the recreated slots.

        Raises FleetFailed when fewer than min_ready slots can ever serve again.
        """

    @abstractmethod
    async def wait_all_alive(self, timeout: float | None = None) -> list[EngineSlot]:  # noqa: ASYNC109 - the bound ends in FleetNotReady, not a cancel
        """Recover and wait until every slot that is not given up is alive; returns the alive slots.

        When the bound runs out with at least min_ready alive, returns those; with fewer, raises
        FleetNotReady. Raises FleetFailed on a crash loop that leaves fewer than min_ready.
        """

    @abstractmethod
    async def stop(self) -> None:
        """Stop every engine (process groups / pods). Safe to call twice."""

    @abstractmethod
    def subscribe(self, listener: DeathListener) -> Callable[[], None]:
        """Call `listener(event)` for every death; returns the unsubscribe function."""

    def subscribe_resize(self, listener: ResizeListener) -> Callable[[], None]:
        """Call `listener(event)` whenever the number of slots changes; returns the unsubscribe function.
        A fleet of fixed size (a local one) never resizes."""
        return lambda: None

    @abstractmethod
    def record_weight_version(self, slot: int, incarnation: int, version: str) -> None:
        """Remember the version read back from an incarnation (shown in status)."""

    @property
    @abstractmethod
    def failure(self) -> FleetFailed | None:
        """The crash-loop failure, once the fleet has failed."""


@dataclass
class SlotRecord:
    """Mutable bookkeeping of one slot (backend-private)."""

    slot: int
    incarnation: int = 0
    state: EngineState = EngineState.STOPPED
    restarts: int = 0
    url: str | None = None
    weight_version: str | None = None
    last_failure: str | None = None
    exit_code: int | None = None
    dead_since: float | None = None
    cause: DeathCause | None = None
    pid: int | None = None
    pod: str | None = None
    log_path: str | None = None
    starts: int = 0
    started_at: float | None = None
    handle: object = field(default=None, repr=False)  # the backend's process / pod handle

    def view(self) -> EngineSlot:
        return EngineSlot(slot=self.slot, url=self.url, state=self.state, incarnation=self.incarnation,
                          restarts=self.restarts, weight_version=self.weight_version,
                          last_failure=self.last_failure, exit_code=self.exit_code, pid=self.pid,
                          pod=self.pod, log_path=self.log_path, started_at=self.started_at)


class SlotFleetBackend(FleetBackend):
    """Shared slot state machine, death events, budgets and the recovery loop.

    Subclasses implement `_launch` (start an incarnation and arrange for `_set_alive` /
    `mark_dead` to be called as it comes up or dies), `_terminate`, and `_log_tail`.
    """

    def __init__(self, *, fleet: str, replicas: int, recovery: RecoverySpec, min_ready: int | None = None):
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        min_ready = replicas if min_ready is None else min_ready
        if not 1 <= min_ready <= replicas:
            raise ValueError(f"min_ready must be between 1 and replicas ({replicas}), got {min_ready}")
        self.fleet = fleet
        self.replicas = replicas
        self.recovery = recovery
        self.min_ready = min_ready
        self._slots = {n: SlotRecord(slot=n) for n in range(replicas)}
        self._run_restarts = 0
        self._deaths = death_listeners()
        self._changed = asyncio.Event()
        self._recover_lock = asyncio.Lock()
        self._failure: FleetFailed | None = None
        self._recovery_started: float | None = None
        self._stopping = False
        export_restart_budget(fleet, recovery)
        # Counters exist at 0 from the start, so increase() sees the first death and recreation.
        metrics.ENGINE_RECREATIONS.labels(fleet=fleet)
        for cause in DeathCause:
            metrics.ENGINES_MARKED_DEAD.labels(fleet=fleet, reason=cause.value)

    # --- subclass hooks -------------------------------------------------------------------------------

    @abstractmethod
    async def _launch(self, rec: SlotRecord) -> None:
        """Start rec's new incarnation (rec.incarnation already advanced, state STARTING)."""

    @abstractmethod
    async def _terminate(self, rec: SlotRecord, *, graceful: bool) -> None:
        """Tear rec's current incarnation down (immediately unless graceful)."""

    @abstractmethod
    def _log_tail(self, rec: SlotRecord, lines: int = 30) -> list[str]:
        """The last lines the incarnation logged."""

    # --- views --------------------------------------------------------------------------------------

    def engines(self) -> list[EngineSlot]:
        return [self._slots[n].view() for n in sorted(self._slots)]

    def alive(self) -> list[EngineSlot]:
        return [e for e in self.engines() if e.state is EngineState.ALIVE]

    @property
    def failure(self) -> FleetFailed | None:
        return self._failure

    @property
    def run_restarts(self) -> int:
        return self._run_restarts

    def count_earlier_restarts(self, restarts: int) -> None:
        """A resumed run's recreations before its checkpoint: they spent maxRestartsPerRun too."""
        self._run_restarts = max(self._run_restarts, restarts)

    def record_weight_version(self, slot: int, incarnation: int, version: str) -> None:
        rec = self._slots[slot]
        if rec.incarnation == incarnation:
            rec.weight_version = version

    def subscribe(self, listener: DeathListener) -> Callable[[], None]:
        return self._deaths.subscribe(listener)

    # --- state changes ------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _set_state(self, rec: SlotRecord, state: EngineState) -> None:
        rec.state = state
        metrics.set_engine_state(self.fleet, rec.slot, state.value, ENGINE_STATES)
        self._notify()

    @staticmethod
    def _now() -> float:
        """The event loop's monotonic clock (virtual in tests)."""
        return asyncio.get_running_loop().time()

    def _set_alive(self, slot: int, incarnation: int) -> bool:
        """An incarnation answered its first health check."""
        rec = self._slots[slot]
        if rec.incarnation != incarnation or rec.state is not EngineState.STARTING:
            return False
        self._set_state(rec, EngineState.ALIVE)
        log.info("fleet %s slot %d incarnation %d alive at %s", self.fleet, slot, incarnation, rec.url)
        if self._recovery_started is not None and all(
                r.state in (EngineState.ALIVE, EngineState.FAILED) for r in self._slots.values()):
            metrics.RECOVERY_DURATION.labels(fleet=self.fleet).observe(self._now() - self._recovery_started)
            self._recovery_started = None
        return True

    async def mark_dead(self, slot: int, reason: str, *, cause: DeathCause = DeathCause.REQUESTED,
                        incarnation: int | None = None) -> bool:
        rec = self._slots.get(slot)
        if rec is None:
            raise KeyError(f"fleet {self.fleet} has no slot {slot}")
        if incarnation is not None and incarnation != rec.incarnation:
            return False
        if rec.state not in (EngineState.STARTING, EngineState.ALIVE):
            return False
        now = self._now()
        rec.last_failure = reason
        rec.cause = cause
        rec.dead_since = now
        self._set_state(rec, EngineState.DEAD)
        metrics.ENGINES_MARKED_DEAD.labels(fleet=self.fleet, reason=cause.value).inc()
        log.warning("fleet %s slot %d incarnation %d (%s) marked dead (%s): %s", self.fleet, slot,
                    rec.incarnation, rec.url, cause.value, reason)
        self._emit(DeathEvent(fleet=self.fleet, slot=slot, incarnation=rec.incarnation, url=rec.url,
                              cause=cause, reason=reason, at=time.time(), monotonic=now,
                              started_at=rec.started_at))
        # Tear down even a hung process now: a late answer from it must never count again.
        await self._terminate(rec, graceful=False)
        return True

    def _emit(self, event: DeathEvent) -> None:
        self._deaths.emit(event)

    async def drain_listeners(self) -> None:
        """Wait for death listeners already running (router removals, ...)."""
        await self._deaths.drain()

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._stopping = False
        await asyncio.gather(*(self._start_incarnation(rec) for rec in self._slots.values()))

    async def _start_incarnation(self, rec: SlotRecord) -> None:
        rec.incarnation += 1
        rec.starts += 1
        rec.url = None
        rec.pid = None
        rec.pod = None
        rec.exit_code = None
        rec.weight_version = None
        rec.dead_since = None
        rec.started_at = self._now()
        self._set_state(rec, EngineState.STARTING)
        try:
            await self._launch(rec)
        except Exception as exc:
            await self.mark_dead(rec.slot, f"launch failed: {exc}", cause=DeathCause.STARTUP_FAILED,
                                 incarnation=rec.incarnation)

    async def stop(self) -> None:
        self._stopping = True
        records = list(self._slots.values())
        for rec in records:
            if rec.state in (EngineState.STARTING, EngineState.ALIVE):
                self._set_state(rec, EngineState.STOPPED)
        await asyncio.gather(*(self._terminate(rec, graceful=True) for rec in records), return_exceptions=True)
        await self.drain_listeners()

    # --- recovery -----------------------------------------------------------------------------------

    def _plan(self):
        views = [SlotView(slot=r.slot, dead=r.state is EngineState.DEAD, failed=r.state is EngineState.FAILED,
                          restarts=r.restarts, dead_since=r.dead_since) for r in self._slots.values()]
        return plan_recovery(views, spec=self.recovery, run_restarts=self._run_restarts,
                             min_ready=self.min_ready, now=self._now())

    def _fail(self, slot: int, why: str) -> FleetFailed:
        rec = self._slots[slot]
        tail = self._log_tail(rec)
        message = crash_loop_message(fleet=self.fleet, slot=slot, why=why, starts=rec.starts,
                                     exit_code=rec.exit_code, last_failure=rec.last_failure, log_tail=tail,
                                     log_path=rec.log_path)
        return FleetFailed(message, reason="EngineCrashLoop", slot=slot, exit_code=rec.exit_code, log_tail=tail)

    async def recover(self) -> list[int]:
        if self._failure is not None:
            raise self._failure
        async with self._recover_lock:
            plan = self._plan()
            for slot, why in plan.give_up.items():
                rec = self._slots[slot]
                self._set_state(rec, EngineState.FAILED)
                log.error("fleet %s slot %d given up: %s", self.fleet, slot, why)
                if plan.fleet_failed and self._failure is None:
                    self._failure = self._fail(slot, why)
            if plan.fleet_failed:
                if self._failure is None:  # the floor was already broken by earlier give-ups
                    failed = [r for r in self._slots.values() if r.state is EngineState.FAILED]
                    self._failure = self._fail(failed[-1].slot if failed else 0,
                                               f"fewer than minReadyEngines={self.min_ready} engines can serve")
                raise self._failure
            if not plan.recreate:
                return []
            if self._recovery_started is None:
                self._recovery_started = self._now()
            recreated = await asyncio.gather(*(self._recreate_at(slot, due) for slot, due in plan.recreate.items()))
            return sorted(slot for slot in recreated if slot is not None)

    async def _recreate_at(self, slot: int, due: float) -> int | None:
        delay = due - self._now()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = self._slots[slot]
        if self._stopping or rec.state is not EngineState.DEAD:
            return None
        rec.restarts += 1
        self._run_restarts += 1
        metrics.ENGINE_RECREATIONS.labels(fleet=self.fleet).inc()
        metrics.ENGINE_RESTARTS.labels(fleet=self.fleet, slot=str(slot)).set(rec.restarts)
        log.info("fleet %s slot %d: recreating (restart %d)", self.fleet, slot, rec.restarts)
        await self._start_incarnation(rec)
        return slot

    async def wait_all_alive(self, timeout: float | None = None) -> list[EngineSlot]:  # noqa: ASYNC109 - the bound ends in FleetNotReady, not a cancel
        loop = asyncio.get_running_loop()
        bound = self.recovery.wait_all_alive_timeout_seconds if timeout is None else timeout
        deadline = loop.time() + bound
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    if self._failure is not None:
                        raise self._failure
                    if self._stopping:
                        break
                    if any(r.state is EngineState.DEAD for r in self._slots.values()):
                        await self.recover()
                        continue
                    waiting = [r for r in self._slots.values() if r.state is EngineState.STARTING]
                    if not waiting:
                        break
                    await self._changed.wait()
        except TimeoutError:
            pass
        alive = self.alive()
        if self._failure is not None:
            raise self._failure
        if len(alive) < self.min_ready:
            raise fleet_not_ready(self, len(alive), bound)
        return alive
