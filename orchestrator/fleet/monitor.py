"""HealthMonitor: heart-beats every engine of one fleet, concurrently, and reports the dead.

The decisions (when to probe, when an engine is dead) are EngineHealth's; this module only runs
probes, bounds each by `timeout_seconds`, and calls `on_dead` once per dead incarnation. One event
loop handles a thousand engines: the default probe is HealthProbeClient's GET /health_generate on a
kept-alive connection per engine, a future with one timer (no thread, no task per probe); an
injected probe function runs as a task. A refused connection is a death at once (health.py), also
when the client reconnects an idle connection that ended between probes (the process died).

Loop-stall brake: when this process's event loop stalls (an overloaded machine, a blocking call), every
probe in flight times out at once and a healthy fleet would be marked dead. The loop therefore wakes at
least every LOOP_TICK_S and notes how late each timed wake came (LoopStalls); a timed-out probe whose
loop lag exceeds max(1 s, timeout_seconds) does not count toward failure_threshold, and timeouts that
hit most of the fleet together while the loop lagged do not count either (a warning is logged). Both are
counted in rlfleet_engine_probe_timeouts_voided_total{reason}. Refusals and other answers always count;
health.py holds the rules.

Holds: `hold(slot, reason)` stops probing one engine (the heat guard paused its generation) until
`release(slot)`, across fleet-wide pauses and resumes. A hold belongs to the incarnation it found:
if that engine dies and is replaced, the replacement is probed as usual.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from rlfleet.crds.specs import HealthSpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.health import (
    LOOP_LAG_FLOOR_S,
    EngineHealth,
    LoopStalls,
    ProbeTicket,
    TimeoutVerdict,
    judge_lagged_timeouts,
    next_round,
    probe_loop_lag,
)
from rlfleet.sglang.errors import CallError, FailureKind
from rlfleet.sglang.probe import HealthProbeClient
from rlfleet.util.aio import stop_task

log = logging.getLogger(__name__)

# How long the report of a refusal waits for the backend's own report of the same death (a SIGKILLed
# CPU engine's process exit was seen ~0.5 s after the kill, its closed port up to ~0.3 s earlier).
REFUSAL_GRACE_S = 0.5

# The loop wakes at least this often, to measure its own stalls (a cheap timer; no engine is scanned).
LOOP_TICK_S = LOOP_LAG_FLOOR_S / 4


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


def is_refusal(exc: BaseException) -> bool:
    """The probe's connection was refused: nothing listens on the engine's port, the process is gone."""
    return isinstance(exc, CallError) and exc.kind is FailureKind.CONNECTION_REFUSED


@dataclass
class _Hold:
    reason: str
    incarnation: int | None  # the held incarnation; None until the monitor knows one for the slot


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (isinstance(exc, CallError) and exc.kind is FailureKind.TIMEOUT)


def describe_failure(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    """(metric kind, human reason) of a failed probe."""
    if isinstance(exc, CallError):
        return exc.kind.value, str(exc)
    if isinstance(exc, TimeoutError):
        return FailureKind.TIMEOUT.value, f"no answer within {timeout_s:g} s"
    return "error", f"{type(exc).__name__}: {exc}"


class HealthMonitor:
    """Probes the targets of one fleet. start/pause/resume/stop; safe to cancel at any point."""

    def __init__(self, spec: HealthSpec, *, targets: Callable[[], Iterable[ProbeTarget]], on_dead: DeadFn,
                 probe: ProbeFn | None = None, fleet: str = "default"):
        """`probe` defaults to GET /health_generate by HealthProbeClient, which bounds each probe by
        `timeout_seconds` itself; an injected probe is bounded by the monitor."""
        self.spec = spec
        self.fleet = fleet
        self._targets = targets
        self._probe_fn = probe
        self.client = HealthProbeClient(on_refused=self._refused_between_probes) if probe is None else None
        self._on_dead = on_dead
        self._health: dict[tuple[int, int], EngineHealth] = {}
        self._known: dict[tuple[int, int], ProbeTarget] = {}
        self._keys_by_url: dict[str, tuple[int, int]] = {}
        self._probes: dict[tuple[int, int], asyncio.Future] = {}  # probes in flight
        self._holds: dict[int, _Hold] = {}
        self._callbacks: set[asyncio.Task] = set()
        self._pending_reports: dict[tuple[int, int], asyncio.TimerHandle] = {}  # refusals, within their grace
        self._wake = asyncio.Event()
        self._wake_at = 0.0  # when the loop wakes on its own next
        self._targets_due = 0.0  # when the target list is read next (once a round, or when told)
        self._loop_task: asyncio.Task | None = None
        self._paused = False
        self._origin = 0.0
        self._stalls = LoopStalls()
        self._lagged_timeouts: list[tuple[ProbeTarget, EngineHealth, ProbeTicket, BaseException, float]] = []
        self._judging: asyncio.Handle | None = None  # the pending judgement of _lagged_timeouts
        labels = {"fleet": fleet}
        self._probe_ok = metrics.ENGINE_PROBES.labels(**labels, result="success")
        self._probe_failed = metrics.ENGINE_PROBES.labels(**labels, result="failure")
        self._failure_kinds: dict[str, object] = {}
        self._voided = {verdict: metrics.ENGINE_PROBE_TIMEOUTS_VOIDED.labels(**labels, reason=verdict.value)
                        for verdict in TimeoutVerdict if verdict is not TimeoutVerdict.COUNTS}

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
        self._targets_due = 0.0
        self._loop_task = asyncio.create_task(self._run(), name=f"health-monitor-{self.fleet}")

    def pause(self) -> None:
        """Stop probing now; probes in flight are cancelled and their results ignored."""
        self._paused = True
        for health in self._health.values():
            health.pause()
        for probe in self._probes.values():
            probe.cancel()
        self._wake.set()

    def resume(self) -> None:
        """Probe again after `first_wait_seconds`, with failure counts cleared."""
        now = asyncio.get_running_loop().time()
        self._paused = False
        self._origin = now
        self._targets_due = 0.0  # engines recreated while paused are probed from now on
        for health in self._health.values():
            health.resume(now)
        self._wake.set()

    def hold(self, slot: int, reason: str) -> None:
        """Stop probing one engine (and never mark it dead by probes) until release(slot).

        Outlasts fleet-wide pause/resume. A probe of it in flight is cancelled and does not count.
        """
        known = [key for key in self._health if key[0] == slot]
        incarnation = max(inc for _, inc in known) if known else None
        self._holds[slot] = _Hold(reason, incarnation)
        if incarnation is not None:
            self._hold_engine((slot, incarnation), reason)
        log.info("fleet %s slot %d: probes held (%s)", self.fleet, slot, reason)

    def release(self, slot: int) -> None:
        """Probe the engine again, `first_wait_seconds` from now, with its failures forgotten."""
        hold = self._holds.pop(slot, None)
        if hold is None:
            return
        health = self._health.get((slot, hold.incarnation)) if hold.incarnation is not None else None
        if health is not None:
            health.release(asyncio.get_running_loop().time())
            self._wake.set()
        log.info("fleet %s slot %d: probes released", self.fleet, slot)

    def held(self) -> dict[int, str]:
        """Held slots and why."""
        return {slot: hold.reason for slot, hold in self._holds.items()}

    def is_held(self, slot: int) -> bool:
        return slot in self._holds

    def _hold_engine(self, key: tuple[int, int], reason: str) -> None:
        health = self._health.get(key)
        if health is not None:
            health.hold(reason)
        task = self._probes.get(key)
        if task is not None:
            task.cancel()

    def targets_changed(self) -> None:
        """Look at the target list now instead of at the next round (new or removed engines)."""
        self._targets_due = 0.0
        self._wake.set()

    def forget(self, slot: int, incarnation: int) -> None:
        """Stop probing an incarnation already known dead (e.g. the process exited)."""
        key = (slot, incarnation)
        pending = self._pending_reports.pop(key, None)
        if pending is not None:
            pending.cancel()  # the backend told first (and knows more)
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
        try:
            for task in tasks:
                with contextlib.suppress(Exception):
                    await stop_task(task)
        finally:  # also when the caller is cancelled meanwhile (the cancellation goes on after this)
            self._loop_task = None
            if self._judging is not None:
                self._judging.cancel()
                self._judging, self._lagged_timeouts = None, []
            for pending in self._pending_reports.values():
                pending.cancel()
            self._pending_reports.clear()
            if self.client is not None:
                self.client.close()
        if self._callbacks:
            await asyncio.gather(*self._callbacks, return_exceptions=True)

    def health(self, slot: int, incarnation: int) -> EngineHealth | None:
        return self._health.get((slot, incarnation))

    # --- the loop -----------------------------------------------------------------------------------

    def _sync_targets(self) -> None:
        current = {t.key: t for t in self._targets()}
        urls: set[str] | None = None
        for key in list(self._health):
            if key not in current:
                del self._health[key]
                gone = self._known.pop(key, None)
                if gone is not None and self._keys_by_url.get(gone.url) == key:
                    del self._keys_by_url[gone.url]
                task = self._probes.pop(key, None)
                if task is not None:
                    task.cancel()
                if self.client is not None and gone is not None:
                    urls = urls if urls is not None else {t.url for t in current.values()}
                    if gone.url not in urls:
                        self.client.forget(gone.url)
                hold = self._holds.get(key[0])
                if hold is not None and hold.incarnation == key[1]:
                    del self._holds[key[0]]  # the held engine is gone; its replacement is not held
        for key, target in current.items():
            if key not in self._health:
                # A new engine joins the current round grid (and respects a first wait still running).
                health = self._health[key] = EngineHealth(self.spec, origin=self._origin, paused=self._paused)
                hold = self._holds.get(key[0])
                if hold is not None and hold.incarnation in (None, key[1]):
                    hold.incarnation = key[1]
                    health.hold(hold.reason)
            self._known[key] = target
            self._keys_by_url[target.url] = key

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            if loop.time() >= self._targets_due:
                # Once a round, on the round grid (not on every wake: with a thousand engines that
                # is a cost of its own).
                self._targets_due = next_round(self._origin, self.spec.interval_seconds, loop.time())
                try:
                    self._sync_targets()
                except Exception:
                    log.exception("fleet %s: reading the engine list failed", self.fleet)
            now = loop.time()
            wake_at = self._targets_due
            for key, health in self._health.items():
                if health.is_due(now):
                    self._launch(key, health, health.start_probe(now))
                due = health.wake_time()
                if due is not None and due < wake_at:
                    wake_at = due
            self._wake_at = wake_at
            await self._sleep_until(wake_at)

    async def _sleep_until(self, wake_at: float) -> None:
        """Wait for wake_at or a wake-up call, waking every LOOP_TICK_S to note how late the loop runs."""
        loop = asyncio.get_running_loop()
        while True:
            tick_at = min(wake_at, loop.time() + LOOP_TICK_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(tick_at):
                    await self._wake.wait()
            self._stalls.record(tick_at, loop.time())
            if self._wake.is_set() or loop.time() >= wake_at:
                return

    def _launch(self, key: tuple[int, int], health: EngineHealth, ticket: ProbeTicket) -> None:
        """Start one probe as a future; `_settle` applies its outcome."""
        target = self._known[key]
        probe: asyncio.Future
        if self.client is not None:
            try:
                # The client bounds the probe by the timeout itself, with no task per probe.
                probe = self.client.submit(target.url, self.spec.timeout_seconds)
            except Exception as exc:
                probe = asyncio.get_running_loop().create_future()
                probe.set_exception(exc)
        else:
            probe = asyncio.create_task(self._bounded_probe(target))
        self._probes[key] = probe
        probe.add_done_callback(functools.partial(self._settle, target, health, ticket))

    async def _bounded_probe(self, target: ProbeTarget) -> None:
        probe = self._probe_fn
        assert probe is not None, "only an injected probe runs here; the default client bounds its own"
        async with asyncio.timeout(self.spec.timeout_seconds):
            await probe(target)

    def _settle(self, target: ProbeTarget, health: EngineHealth, ticket: ProbeTicket, probe: asyncio.Future) -> None:
        key = target.key
        if self._probes.get(key) is probe:
            del self._probes[key]
        if probe.cancelled():
            health.probe_abandoned(ticket)
        else:
            now = asyncio.get_running_loop().time()
            exc = probe.exception()
            if exc is None:
                self._probe_ok.inc()
                health.probe_succeeded(ticket, now)
            else:
                self._probe_failed.inc()
                self._failure_counter(describe_failure(exc, self.spec.timeout_seconds)[0]).inc()
                lag = probe_loop_lag(self._stalls, ticket, now, self.spec.timeout_seconds) if _is_timeout(exc) else 0.0
                if lag >= LOOP_LAG_FLOOR_S:
                    self._defer_lagged_timeout(target, health, ticket, exc, lag)
                    return  # judged with the timeouts settled at the same moment
                self._probe_failure(target, health, ticket, exc, now)
        self._wake_if_due_early(health)

    def _wake_if_due_early(self, health: EngineHealth) -> None:
        """Wake the loop only when this engine is due before the loop wakes anyway (after a success
        it is due at the next round, which the loop already waits for)."""
        due = health.wake_time()
        if due is not None and due < self._wake_at:
            self._wake.set()

    def _defer_lagged_timeout(self, target: ProbeTarget, health: EngineHealth, ticket: ProbeTicket,
                              exc: BaseException, lag: float) -> None:
        """Collect the timeouts a loop stall let fire together; they are judged as one batch right after."""
        if self._judging is None:
            self._judging = asyncio.get_running_loop().call_soon(self._judge_lagged_timeouts)
        self._lagged_timeouts.append((target, health, ticket, exc, lag))

    def _judge_lagged_timeouts(self) -> None:
        batch, self._lagged_timeouts, self._judging = self._lagged_timeouts, [], None
        now = asyncio.get_running_loop().time()
        probed = sum(1 for health in self._health.values() if health.probing)
        verdicts = judge_lagged_timeouts([lag for *_, lag in batch], probed, self.spec)
        voided = sum(1 for verdict in verdicts if verdict is not TimeoutVerdict.COUNTS)
        if voided:
            log.warning("fleet %s: %d probe timeouts not counted: the prober's event loop lagged up to %.1f s "
                        "(%d of %d probed engines timed out together)", self.fleet, voided,
                        max(lag for *_, lag in batch), len(batch), probed)
        for (target, health, ticket, exc, _), verdict in zip(batch, verdicts, strict=True):
            if verdict is TimeoutVerdict.COUNTS:
                self._probe_failure(target, health, ticket, exc, now)
            else:
                self._voided[verdict].inc()
                health.probe_void(ticket, now)
            self._wake_if_due_early(health)

    def _probe_failure(self, target: ProbeTarget, health: EngineHealth, ticket: ProbeTicket, exc: BaseException,
                       now: float) -> None:
        """Count a failed probe (the metrics are counted already); report the engine when it is dead."""
        _, reason = describe_failure(exc, self.spec.timeout_seconds)
        refused = is_refusal(exc)
        if not health.probe_failed(ticket, now, reason, refused=refused):
            return
        if refused:
            message = f"connection refused, nothing listens on the engine's port: {reason}"
        else:
            message = f"{health.consecutive_failures} consecutive failed health probes, last: {reason}"
        self._report(target, message, refused=refused)

    def _report(self, target: ProbeTarget, message: str, *, refused: bool = False) -> None:
        """Tell `on_dead`. A refusal is told after REFUSAL_GRACE_S: the backend's own process or pod
        watch sees the same death within a moment and knows more (exit code, the engine's last log
        lines); when it reports first, forget() drops this report."""
        if refused:
            loop = asyncio.get_running_loop()
            self._pending_reports[target.key] = loop.call_later(REFUSAL_GRACE_S, self._report, target, message)
            return
        self._pending_reports.pop(target.key, None)
        log.warning("fleet %s slot %d (%s): marked dead: %s", self.fleet, target.slot, target.url, message)
        task = asyncio.create_task(self._report_dead(target, message))
        self._callbacks.add(task)
        task.add_done_callback(self._callbacks.discard)

    def _refused_between_probes(self, url: str, error: CallError) -> None:
        """The probe client reconnected an engine's idle connection (it ended between probes) and
        was refused: the process is gone."""
        key = self._keys_by_url.get(url)
        health = self._health.get(key) if key is not None else None
        if key is None or health is None:
            return
        kind, reason = describe_failure(error, self.spec.timeout_seconds)
        if not health.connection_refused(asyncio.get_running_loop().time(), reason):
            return
        self._probe_failed.inc()
        self._failure_counter(kind).inc()
        self._report(self._known[key], f"connection refused, nothing listens on the engine's port: {reason}",
                     refused=True)

    def _failure_counter(self, kind: str):
        counter = self._failure_kinds.get(kind)
        if counter is None:
            counter = self._failure_kinds[kind] = metrics.ENGINE_PROBE_FAILURES.labels(fleet=self.fleet, kind=kind)
        return counter

    async def _report_dead(self, target: ProbeTarget, reason: str) -> None:
        try:
            await self._on_dead(target, reason)
        except Exception:
            log.exception("fleet %s: on_dead for slot %d failed", self.fleet, target.slot)
