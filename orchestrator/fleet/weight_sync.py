"""Weight sync from disk, done safely.

The sequence: validate the snapshot (a bad one fails the sync before any engine sees it, so the old
weights keep serving; validation touches no engine, so it runs before monitoring pauses and hashing
a large snapshot does not blind the monitor); pause health monitoring; recover dead slots; wait until every slot is
alive (bounded); on every engine in parallel pause generation (retract or abort, never in_place),
`update_weights_from_disk {model_path, weight_version}` bounded by the transfer timeout, read the
version back from `/model_info`, continue generation; retry a failing engine `loadRetries` times,
then mark it dead; register engines that now serve the version but are not in the router yet;
resume monitoring.

An engine that closes the connection on an update has died (SGLang dies on bad weight files rather
than answering), so it is marked dead at once, not retried. A 400 "Weights were updated, but the
cache was not flushed" (someone else paused the engine in_place) means the weights did swap: flush
the cache and load again so `/model_info` and the cache agree.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.crds.specs import WeightSyncSpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet.backend import DeathCause, EngineSlot, FleetBackend
from rlfleet.orchestrator.fleet.errors import WeightSyncFailed
from rlfleet.orchestrator.fleet.membership import RouterMembership, VersionNotPinned
from rlfleet.orchestrator.fleet.monitor import HealthMonitor
from rlfleet.sglang.engine import CacheNotFlushed, EngineClient, PauseMode, gone_for_good, pin_weights
from rlfleet.sglang.errors import CallError
from rlfleet.snapshot.format import Manifest, SnapshotInvalid, SnapshotReference, validate_snapshot

log = logging.getLogger(__name__)

SAFE_PAUSE_MODES = ("retract", "abort")
FLUSH_ATTEMPTS = 5
FLUSH_RETRY_S = 0.5
SYNC_OUTCOMES = ("ok", "degraded", "invalid_snapshot", "failed")  # rlfleet_weight_syncs_total{outcome}


@dataclass
class EngineSyncOutcome:
    slot: int
    incarnation: int
    url: str
    ok: bool = False
    version: str | None = None  # read back from /model_info
    attempts: int = 0
    load_s: float = 0.0
    error: str | None = None
    marked_dead: bool = False
    admitted: bool = False  # newly added to the router by this sync


@dataclass
class WeightSyncResult:
    step: int
    version: str
    model_path: str
    engines: list[EngineSyncOutcome] = field(default_factory=list)
    recovered_slots: list[int] = field(default_factory=list)
    validate_s: float = 0.0
    recover_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0

    @property
    def synced(self) -> list[EngineSyncOutcome]:
        return [e for e in self.engines if e.ok]

    @property
    def failed(self) -> list[EngineSyncOutcome]:
        return [e for e in self.engines if not e.ok]

    @property
    def outcome(self) -> str:
        return "ok" if not self.failed else "degraded"


class WeightSync:
    """Runs weight syncs for one fleet."""

    def __init__(self, backend: FleetBackend, membership: RouterMembership, *, spec: WeightSyncSpec,
                 engine_client: Callable[[str], EngineClient], monitor: HealthMonitor | None = None,
                 pause_mode: PauseMode = "retract", reference: SnapshotReference | str | Path | None = None,
                 wait_alive_timeout_s: float | None = None, fleet: str | None = None):
        if pause_mode not in SAFE_PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {SAFE_PAUSE_MODES} (in_place leaves the engine "
                             f"inconsistent after an update), got {pause_mode!r}")
        self.backend = backend
        self.membership = membership
        self.spec = spec
        self.monitor = monitor
        self.pause_mode = pause_mode
        self.wait_alive_timeout_s = wait_alive_timeout_s
        self.fleet = fleet or backend.fleet
        self._engine_client = engine_client
        self._reference = SnapshotReference.from_dir(reference) if isinstance(reference, (str, Path)) else reference
        self._lock = asyncio.Lock()
        self.last_error: str | None = None  # of the last sync (None after a successful one)
        for outcome in SYNC_OUTCOMES:  # at 0 from the start, so increase() sees the first failure
            metrics.WEIGHT_SYNCS.labels(fleet=self.fleet, outcome=outcome)

    @property
    def lock(self) -> asyncio.Lock:
        """Held for a whole sync; holding it elsewhere (shared-engine eval) keeps any sync from interleaving."""
        return self._lock

    @property
    def reference(self) -> SnapshotReference | None:
        return self._reference

    async def sync(self, snapshot_dir: str | Path, step: int, *, version: str | None = None) -> WeightSyncResult:
        """Give every engine the snapshot's weights. Raises SnapshotInvalid (nothing loaded),
        FleetFailed / FleetNotReady (no fleet to load into) or WeightSyncFailed (too few engines)."""
        snapshot_dir = Path(snapshot_dir)
        version = version or str(step)
        async with self._lock:
            started = time.monotonic()
            outcome = "failed"
            try:
                # Validation touches no engine, so monitoring keeps running while large files are hashed.
                manifest: Manifest = await asyncio.to_thread(validate_snapshot, snapshot_dir, self._reference,
                                                             expected_step=step)
                validate_s = time.monotonic() - started
                if self.monitor is not None:
                    self.monitor.pause()
                try:
                    result = await self._apply(snapshot_dir, step, version)
                finally:
                    if self.monitor is not None:
                        self.monitor.resume()
                result.validate_s = validate_s
                result.total_s = time.monotonic() - started
                self._reference = SnapshotReference.from_manifest(manifest, source=str(snapshot_dir))
                outcome = result.outcome
                self.last_error = None
                log.info("fleet %s: synced version %s to %d engine(s) in %.2f s (load %.2f s)", self.fleet,
                         version, len(result.synced), result.total_s, result.load_s)
                return result
            except SnapshotInvalid as exc:
                outcome = "invalid_snapshot"
                self.last_error = str(exc)
                raise
            except Exception as exc:
                self.last_error = str(exc)
                raise
            finally:
                metrics.WEIGHT_SYNCS.labels(fleet=self.fleet, outcome=outcome).inc()
                metrics.WEIGHT_SYNC_DURATION.labels(fleet=self.fleet, outcome=outcome).observe(
                    time.monotonic() - started)

    async def _apply(self, snapshot_dir: Path, step: int, version: str) -> WeightSyncResult:
        """Recover, wait, load everywhere, read back, admit. Monitoring is paused meanwhile."""
        result = WeightSyncResult(step=step, version=version, model_path=str(snapshot_dir))
        t1 = time.monotonic()
        result.recovered_slots = await self.backend.recover()
        alive = await self.backend.wait_all_alive(self.wait_alive_timeout_s)
        t2 = time.monotonic()
        result.recover_s = t2 - t1
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._sync_engine(engine, str(snapshot_dir), version)) for engine in alive]
        result.engines = [task.result() for task in tasks]
        result.load_s = time.monotonic() - t2
        for outcome in result.synced:
            await self._admit(outcome)
        if len(result.synced) < self.backend.min_ready:
            failures = "; ".join(f"slot {e.slot}: {e.error}" for e in result.failed)
            raise WeightSyncFailed(f"fleet {self.fleet}: only {len(result.synced)} engine(s) serve version "
                                   f"{version} after the sync; {failures}", result)
        return result

    async def _admit(self, outcome: EngineSyncOutcome) -> None:
        if self.membership.is_member(outcome.url):
            self.membership.repin(outcome.url, outcome.version or "")
            return
        try:
            await self.membership.admit(outcome.url, outcome.version or "")
            outcome.admitted = True
        except (CallError, VersionNotPinned) as exc:
            # Pinned but not registered: the reconcile loop registers it within an interval.
            log.warning("fleet %s slot %d: router admission failed: %s", self.fleet, outcome.slot, exc)

    async def _sync_engine(self, engine: EngineSlot, model_path: str, version: str) -> EngineSyncOutcome:
        assert engine.url is not None
        outcome = EngineSyncOutcome(slot=engine.slot, incarnation=engine.incarnation, url=engine.url)
        client = self._engine_client(engine.url)
        started = time.monotonic()
        attempts_left = 1 + self.spec.load_retries
        reused_connection_retry = True  # one extra attempt when a closed connection was not a death
        while attempts_left > 0:
            attempts_left -= 1
            outcome.attempts += 1
            try:
                outcome.version = await self._load_once(client, model_path, version, engine.slot)
            except CallError as exc:
                outcome.error = str(exc)
                if exc.engine_gone:
                    if reused_connection_retry and not await gone_for_good(client, exc):
                        reused_connection_retry = False
                        attempts_left += 1
                        continue
                    outcome.marked_dead = await self.backend.mark_dead(
                        engine.slot, f"died during weight load: {exc}", cause=DeathCause.UNREACHABLE,
                        incarnation=engine.incarnation)
                    break
            except _LoadRefused as exc:
                outcome.error = str(exc)
            else:
                outcome.ok = True
                outcome.error = None
                break
        outcome.load_s = time.monotonic() - started
        metrics.ENGINE_WEIGHT_LOAD_DURATION.labels(fleet=self.fleet).observe(outcome.load_s)
        if outcome.ok:
            self.backend.record_weight_version(engine.slot, engine.incarnation, outcome.version or "")
            metrics.ENGINE_WEIGHT_VERSION.labels(fleet=self.fleet, slot=str(engine.slot)).set(
                metrics.version_number(outcome.version))
        elif not outcome.marked_dead:
            outcome.marked_dead = await self.backend.mark_dead(
                engine.slot, f"weight load failed after {outcome.attempts} attempt(s): {outcome.error}",
                cause=DeathCause.LOAD_FAILED, incarnation=engine.incarnation)
        return outcome

    async def _load_once(self, client: EngineClient, model_path: str, version: str, slot: int) -> str:
        """Pause, load, read back, continue. Returns the version read back.

        An engine whose probes the monitor holds (the heat guard paused it) is left paused: the
        guard resumes it when its GPU has cooled.
        """
        def keep_paused() -> bool:
            if self.monitor is not None and self.monitor.is_held(slot):
                log.info("fleet %s slot %d: left paused after the load (held: %s)", self.fleet, slot,
                         self.monitor.held().get(slot))
                return True
            return False

        try:
            pinned = await pin_weights(client, model_path, version, load_timeout_s=self.spec.transfer_timeout_seconds,
                                       pause=self.pause_mode, keep_paused=keep_paused, flush_attempts=FLUSH_ATTEMPTS,
                                       flush_retry_s=FLUSH_RETRY_S, read_back_refused=False)
        except CacheNotFlushed as exc:
            raise _LoadRefused(str(exc)) from exc
        if not pinned.load.success:
            raise _LoadRefused(f"update_weights_from_disk refused: {pinned.load.message}")
        if pinned.served != version:
            raise _LoadRefused(f"engine reports weight version {pinned.served!r} after loading {version!r}")
        return pinned.served


class _LoadRefused(Exception):
    """The engine answered but did not end up serving the version."""
