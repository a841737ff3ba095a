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
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.crds.specs import WeightSyncSpec
from rlfleet.observability import metrics
from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.backend import DeathCause, EngineSlot, EngineState, FleetBackend
from rlfleet.orchestrator.fleet.errors import WeightSyncFailed
from rlfleet.orchestrator.fleet.membership import RouterMembership, VersionNotPinned
from rlfleet.orchestrator.fleet.monitor import HealthMonitor
from rlfleet.orchestrator.fleet.served_weights import EngineLayout
from rlfleet.orchestrator.fleet.update_group import TransferFailed, UpdateGroup, membership_key
from rlfleet.sglang.engine import CacheNotFlushed, EngineClient, PauseMode, gone_for_good, pin_weights
from rlfleet.sglang.errors import CallError
from rlfleet.sglang.launch import ServedWeights
from rlfleet.snapshot.format import Manifest, SnapshotInvalid, SnapshotReference, validate_snapshot
from rlfleet.util.aio import LazyTask, settle

log = logging.getLogger(__name__)

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
    via: str = "disk"  # disk or broadcast
    checksum: str | None = None  # match, mismatch, unverifiable; None: not checked this sync


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
    mode: str = "disk"  # disk, broadcast, broadcast_fallback (the broadcast failed, disk finished it)
    fallback_reason: str | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    bytes_broadcast: int = 0
    rank0_s: float = 0.0  # broadcast: rank 0's own collectives, summed over the buckets (inside "broadcast")
    verified: bool = False
    scaled_away: list[int] = field(default_factory=list)  # slots scaled away under way (the broadcast went again)
    # Broadcast with a snapshot to write: its write and validation, started once the engines serve the
    # version (the sync does not wait for it); its manifest, or the error. Whoever reuses the weights the
    # snapshot is written from waits for it first.
    snapshot: asyncio.Future[Manifest] | None = field(default=None, repr=False)

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
                 reference: SnapshotReference | str | Path | None = None,
                 wait_alive_timeout_s: float | None = None, fleet: str | None = None,
                 broadcast_address: str = "127.0.0.1", broadcast_device: str = "cpu",
                 served: ServedWeights = ServedWeights(), broadcast_port: int | None = None):
        self.backend = backend
        self.membership = membership
        self.spec = spec
        self.monitor = monitor
        self.wait_alive_timeout_s = wait_alive_timeout_s
        self.fleet = fleet or backend.fleet
        self._engine_client = engine_client
        self._reference = SnapshotReference.from_dir(reference) if isinstance(reference, (str, Path)) else reference
        self._lock = asyncio.Lock()
        self.last_error: str | None = None  # of the last sync (None after a successful one)
        self.broadcast_address = broadcast_address
        self.broadcast_port = broadcast_port  # None: any free port on the address (a pod declares its own)
        # Group names are unique per orchestrator: engines that outlived an earlier trainer may still
        # hold its group under the same counter.
        self._group_prefix = f"rlfleet-{self.fleet}-{secrets.token_hex(4)}"
        self.broadcast_device = broadcast_device
        self.served = served  # how the engines hold the weights: their ranks, how they hash them
        self._group: UpdateGroup | None = None
        self._groups_built = 0
        self._verifiable_syncs = 0  # syncs that carried tensors: what `verifyEvery` counts
        self._unverifiable_said: str | None = None  # why the engines' checksums cannot be predicted, once said
        for outcome in SYNC_OUTCOMES:  # at 0 from the start, so increase() sees the first failure
            metrics.WEIGHT_SYNCS.labels(fleet=self.fleet, outcome=outcome)

    @property
    def pause_mode(self) -> PauseMode:
        """How engines pause generation during a sync (`weightSync.pauseMode`: retract or abort; SGLang's
        in_place is not offered, it leaves an engine inconsistent after an update)."""
        return self.spec.pause_mode

    @property
    def lock(self) -> asyncio.Lock:
        """Held for a whole sync; holding it elsewhere (shared-engine eval) keeps any sync from interleaving."""
        return self._lock

    @property
    def reference(self) -> SnapshotReference | None:
        return self._reference

    @property
    def group(self) -> UpdateGroup | None:
        """The current update group (broadcast mode), None before the first broadcast or after a failure."""
        return self._group

    @property
    def groups_built(self) -> int:
        return self._groups_built

    def export_views(self) -> dict[str, Any] | None:
        """Where the trainer may export the next step's weights (broadcast mode, once a group is built and
        usable): views of the group's shared buffer by HF name, so the broadcast copies nothing; None
        otherwise. Exported there, the weights must not be needed past the sync (the next export
        overwrites them); a group rebuilt meanwhile copies them into its own buffer as any tensors."""
        group = self._group
        if self.spec.mode != "broadcast" or group is None or group.broken or not group.broadcaster.alive:
            return None
        return group.views()

    async def _validated(self, snapshot_dir: Path, step: int, written: Awaitable[Any] | None = None) -> Manifest:
        """The snapshot's manifest once it is written (`written`) and valid; SnapshotInvalid otherwise."""
        if written is not None:
            await written
        return await asyncio.to_thread(validate_snapshot, snapshot_dir, self._reference, expected_step=step,
                                       verify_checksums=self.spec.disk_verify == "full")

    async def sync(self, snapshot_dir: str | Path, step: int, *, version: str | None = None,
                   tensors: Mapping[str, Any] | None = None,
                   write_snapshot: Callable[[], Awaitable[Any]] | None = None) -> WeightSyncResult:
        """Give every engine the snapshot's weights (broadcast mode: `tensors`, the same weights under HF
        names, are broadcast; the snapshot is the fallback). Raises SnapshotInvalid (nothing loaded),
        FleetFailed / FleetNotReady (no fleet to load into) or WeightSyncFailed (too few engines).

        `write_snapshot`: writes the snapshot when called (disk mode: first). In broadcast mode it is
        called once the broadcast is done, and the sync returns without waiting for it: `result.snapshot`
        completes once the snapshot is written and valid (the fleet's reference moves to it then), and
        whoever reuses the tensors it is written from waits for that first. On a machine whose cores
        the engines share, a write beside the broadcast slows the broadcast down; the fallback alone
        writes it at once (and waits for it, the engines paused)."""
        snapshot_dir = Path(snapshot_dir)
        version = version or str(step)
        deferred = write_snapshot is not None and self.spec.mode == "broadcast" and tensors is not None
        async with self._lock:
            started = time.monotonic()
            outcome = "failed"
            mode = "disk"
            snapshot: LazyTask[Manifest] | None = None
            try:
                if deferred:
                    assert write_snapshot is not None
                    snapshot = LazyTask(lambda: self._validated(snapshot_dir, step, write_snapshot()))
                    manifest = None
                else:
                    # Validation touches no engine, so monitoring keeps running while large files are hashed.
                    manifest = await self._validated(snapshot_dir, step,
                                                     write_snapshot() if write_snapshot is not None else None)
                validate_s = time.monotonic() - started
                if self.monitor is not None:
                    self.monitor.pause()
                try:
                    result = await self._apply(snapshot_dir, step, version, tensors, snapshot)
                finally:
                    if self.monitor is not None:
                        self.monitor.resume()
                if snapshot is not None and result.mode == "broadcast":
                    # The engines serve the version: the snapshot (the next fallback, what replacements
                    # start from) is written beside whatever comes next.
                    result.snapshot = snapshot.start()
                    result.snapshot.add_done_callback(self._snapshot_settled(snapshot_dir))
                    snapshot = None  # handed over: not awaited below
                else:
                    if snapshot is not None:  # a fallback wrote it
                        waited = time.monotonic()
                        manifest = await asyncio.shield(snapshot.start())  # a cancel leaves the write whole
                        validate_s = time.monotonic() - waited
                    assert manifest is not None
                    result.validate_s = validate_s
                    result.phases["validate"] = validate_s
                    self._reference = SnapshotReference.from_manifest(manifest, source=str(snapshot_dir))
                result.total_s = time.monotonic() - started
                mode = result.mode
                outcome = result.outcome
                self.last_error = None
                log.info("fleet %s: synced version %s to %d engine(s) by %s in %.2f s (load %.2f s)", self.fleet,
                         version, len(result.synced), result.mode, result.total_s, result.load_s)
                for phase, seconds in result.phases.items():
                    metrics.WEIGHT_SYNC_PHASE_DURATION.labels(fleet=self.fleet, mode=mode, phase=phase).observe(seconds)
                return result
            except SnapshotInvalid as exc:
                outcome = "invalid_snapshot"
                self.last_error = str(exc)
                raise
            except Exception as exc:
                self.last_error = str(exc)
                raise
            finally:
                if snapshot is not None and snapshot.task is not None:  # a fallback's write, after a failure
                    await settle(snapshot.task)  # the writing thread ends by itself; leave none behind
                metrics.WEIGHT_SYNCS.labels(fleet=self.fleet, outcome=outcome).inc()
                metrics.WEIGHT_SYNC_DURATION.labels(fleet=self.fleet, outcome=outcome).observe(
                    time.monotonic() - started)

    def _snapshot_settled(self, snapshot_dir: Path) -> Callable[[asyncio.Future[Manifest]], None]:
        """A handed-over snapshot's completion: a valid one becomes the fleet's reference."""
        def settled(snapshot: asyncio.Future[Manifest]) -> None:
            if not snapshot.cancelled() and snapshot.exception() is None:
                self._reference = SnapshotReference.from_manifest(snapshot.result(), source=str(snapshot_dir))

        return settled

    async def _apply(self, snapshot_dir: Path, step: int, version: str, tensors: Mapping[str, Any] | None,
                     snapshot: LazyTask[Manifest] | None = None) -> WeightSyncResult:
        """Recover, wait, load everywhere, read back, verify, admit. Monitoring is paused meanwhile."""
        result = WeightSyncResult(step=step, version=version, model_path=str(snapshot_dir))
        t1 = time.monotonic()
        result.recovered_slots = await self.backend.recover()
        alive = await self.backend.wait_all_alive(self.wait_alive_timeout_s)
        # As the wait judged it: a minReadyEngines raised while this sync runs counts from the next one
        # (a lowered one, with a scale-down under way, counts at once: see the check below).
        min_ready = self.backend.min_ready
        t2 = time.monotonic()
        result.recover_s = t2 - t1
        result.phases["recover"] = result.recover_s
        self._verifiable_syncs = plan.count_verifiable(self._verifiable_syncs, tensors is not None)
        if self.spec.mode == "broadcast" and tensors is not None:
            result.engines = await self._broadcast_sync(alive, tensors, str(snapshot_dir), version, result, snapshot)
        else:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._sync_engine(engine, str(snapshot_dir), version)) for engine in alive]
            result.engines = [task.result() for task in tasks]
            result.phases["load"] = time.monotonic() - t2
        result.load_s = time.monotonic() - t2
        if tensors is not None and plan.verification_due(self._verifiable_syncs, self.spec.verify_every):
            t3 = time.monotonic()
            await self.verify(result.synced, tensors)
            result.verified = True
            result.phases["verify"] = time.monotonic() - t3
        for outcome in result.synced:
            await self._admit(outcome)
        if len(result.synced) < min(min_ready, self.backend.min_ready):
            failures = "; ".join(f"slot {e.slot}: {e.error}" for e in result.failed)
            raise WeightSyncFailed(f"fleet {self.fleet}: only {len(result.synced)} engine(s) serve version "
                                   f"{version} after the sync; {failures}", result)
        return result

    # --- broadcast mode ------------------------------------------------------------------------------

    async def open_group(self) -> bool:
        """Broadcast mode, when the fleet has come up: build the update group of the engines alive, for
        weights laid out as the reference snapshot's (the launch weights), so that the first sync
        broadcasts at once and the trainer's first export lands in the group's buffer. False when there
        is no group to build, or its build failed: the first sync builds it then, falling back as
        configured."""
        if self.spec.mode != "broadcast" or self._reference is None:
            return False
        specs = plan.table_specs(self._reference.tensors)
        alive = [e for e in self.backend.engines() if e.state is EngineState.ALIVE and e.url]
        if specs is None or not alive:
            return False
        async with self._lock:
            phases: dict[str, float] = {}
            try:
                group = await self._ensure_group(alive, specs, phases)
            except TransferFailed as exc:
                log.warning("fleet %s: the update group could not be built as the fleet came up (the first "
                            "sync tries again): %s", self.fleet, exc)
                return False
        log.info("fleet %s: update group %s of %d engine(s) built in %.2f s", self.fleet, group.group_name, len(alive),
                 phases.get("group", 0.0))
        return True

    async def _ensure_group(self, alive: list[EngineSlot], specs: list[plan.TensorSpec],
                            phases: dict[str, float]) -> UpdateGroup:
        """The update group of exactly these engines and this layout: rebuilt after any change of either."""
        key = membership_key(alive)
        buckets = plan.plan_buckets(specs, self.spec.bucket_megabytes * 1024**2)
        group = self._group
        if group is not None and not group.broken and group.key == key and group.buckets == buckets:
            return group
        started = time.monotonic()
        if group is not None:
            self._group = None
            await group.destroy({e.url for e in alive if e.url})
        self._groups_built += 1
        backend = "nccl" if self.broadcast_device.startswith("cuda") else "gloo"
        self._group = await UpdateGroup.build(
            alive, buckets=buckets, bounds=plan.StepBounds(self.spec.transfer_timeout_seconds),
            client=lambda url: self._engine_client(url), address=self.broadcast_address, backend=backend,
            group_name=f"{self._group_prefix}-{self._groups_built}", device=self.broadcast_device,
            tp_size=self.served.tp_size, port=self.broadcast_port)
        metrics.WEIGHT_UPDATE_GROUP_BUILDS.labels(fleet=self.fleet).inc()
        phases["group"] = time.monotonic() - started
        return self._group

    async def _broadcast_sync(self, alive: list[EngineSlot], tensors: Mapping[str, Any], model_path: str,
                              version: str, result: WeightSyncResult, snapshot: LazyTask[Manifest] | None = None,
                              *, again_if_scaled: bool = True,
                              paused_before: Sequence[EngineSlot] = ()) -> list[EngineSyncOutcome]:
        """`paused_before`: engines still paused by a broadcast that scaled-away engines broke (they hold part
        of the new weights: they stay paused until this one has given them all of it)."""
        outcomes = {e.slot: EngineSyncOutcome(slot=e.slot, incarnation=e.incarnation, url=e.url or "",
                                              via="broadcast") for e in alive}
        bounds = plan.StepBounds(self.spec.transfer_timeout_seconds)
        paused: list[EngineSlot] = [e for e in paused_before if e in alive]
        reason = "start"
        try:
            group = await self._ensure_group(alive, plan.tensor_specs(tensors), result.phases)
            reason = "transfer"
            first_filled = group.fill_first(tensors)  # beside the pause: it touches no engine
            t = time.monotonic()
            try:
                await self._pause_all([e for e in alive if e not in paused], bounds, paused)
            except BaseException:
                await settle(first_filled)  # the pause's failure is the one that counts
                raise
            result.phases["pause"] = time.monotonic() - t
            times = await group.transfer(tensors, version, first_filled)
            result.phases.update(fill=times.fill_s, begin=times.begin_s, broadcast=times.broadcast_s, end=times.end_s)
            result.bytes_broadcast = times.bytes
            result.rank0_s = sum(times.rank0_s)
            metrics.WEIGHT_SYNC_BYTES.labels(fleet=self.fleet).inc(times.bytes)
            t = time.monotonic()
            await self._read_back_all(alive, outcomes, version, bounds)
            result.phases["read_back"] = time.monotonic() - t
        except TransferFailed as exc:
            again = plan.staying_after_scale_down([e.slot for e in alive], self.backend.replicas,
                                                  {*exc.wedged, *exc.gone})
            if again_if_scaled and again is not None:
                staying = [e for e in alive if e.slot in again]
                # Engines scaled away under way (the operator ends their pods) broke the collective: no
                # fault of the transfer. Again, over a group of the engines that stay.
                log.info("fleet %s: engines scaled away during the broadcast of version %s (%s): again over "
                         "slot(s) %s", self.fleet, version, exc, [e.slot for e in staying])
                result.scaled_away = sorted(e.slot for e in alive if e not in staying)
                try:
                    await self._leave_group(staying, bounds)
                except BaseException:
                    await self._continue_all(paused)
                    raise
                # Still paused: generation resumes once they hold the whole of a version again.
                return await self._broadcast_sync(staying, tensors, model_path, version, result, snapshot,
                                                  again_if_scaled=False, paused_before=paused)
            await self._broadcast_failed(exc, reason, alive, outcomes, result)
            if not self.spec.fallback_to_disk:
                await self._continue_all(paused)
                raise WeightSyncFailed(f"fleet {self.fleet}: broadcast of version {version} failed and "
                                       f"fallbackToDisk is false: {exc}", result) from exc
            # The engines stay paused until the disk load: a broadcast cut short leaves them holding part of
            # the new weights, which no generation may use.
            try:
                if snapshot is not None:  # the fallback needs the snapshot written and valid
                    waited = time.monotonic()
                    try:
                        await asyncio.shield(snapshot.start())  # a cancel leaves the write to finish (settled below)
                    finally:
                        result.phases["snapshot_wait"] = time.monotonic() - waited
                return await self._finish_from_disk(alive, outcomes, model_path, version, result)
            finally:  # a disk load continues its engine; the others too (the sync fails then, or is stopped)
                await self._continue_all([e for e in paused if not outcomes[e.slot].ok])
        await self._continue_all(paused)
        result.mode = "broadcast"
        for engine in alive:
            o = outcomes[engine.slot]
            o.load_s = sum(result.phases.get(p, 0.0) for p in ("fill", "begin", "broadcast", "end", "read_back"))
            self._record(engine, o)
        return [outcomes[e.slot] for e in alive]

    async def _leave_group(self, staying: list[EngineSlot], bounds: plan.StepBounds) -> None:
        """Drop the group (the engines that stay leave it) and close any update they began, so a new group's
        begins from a clean state (best effort, bounded)."""
        group, self._group = self._group, None
        if group is not None:
            await group.destroy({e.url for e in staying if e.url})

        async def end(engine: EngineSlot) -> None:
            try:
                await self._engine_client(engine.url or "").end_weight_update(bounds.control_s)
            except CallError as exc:
                log.info("fleet %s slot %d: end_weight_update after a broadcast cut short: %s", self.fleet,
                         engine.slot, exc)

        async with asyncio.TaskGroup() as tg:
            for engine in staying:
                tg.create_task(end(engine))

    async def _pause_all(self, alive: list[EngineSlot], bounds: plan.StepBounds, paused: list[EngineSlot]) -> None:
        """Pause generation everywhere; `paused` gets the engines that did (continued later, also on failure)."""
        async def pause(engine: EngineSlot) -> CallError | None:
            try:
                await self._engine_client(engine.url or "").pause_generation(self.pause_mode, bounds.control_s)
            except CallError as exc:
                return exc
            return None

        async with asyncio.TaskGroup() as tg:
            tasks = [(e, tg.create_task(pause(e))) for e in alive]
        failed = {e.slot: error for e, t in tasks if (error := t.result()) is not None}
        paused.extend(e for e, t in tasks if t.result() is None)
        if failed:  # an engine that is gone is no engine wedged in the broadcast
            raise TransferFailed("pause_generation: " + "; ".join(f"slot {s}: {m}" for s, m in failed.items()),
                                 wedged=[s for s, error in failed.items() if not error.engine_gone],
                                 gone=[s for s, error in failed.items() if error.engine_gone])

    async def _continue_all(self, paused: list[EngineSlot]) -> None:
        async def resume(engine: EngineSlot) -> None:
            if self.monitor is not None and self.monitor.is_held(engine.slot):
                return  # the heat guard resumes it
            try:
                await self._engine_client(engine.url or "").continue_generation()
            except CallError as exc:
                log.warning("continue_generation on slot %d failed: %s", engine.slot, exc)

        async with asyncio.TaskGroup() as tg:
            for engine in paused:
                if self.backend_alive(engine):
                    tg.create_task(resume(engine))

    def backend_alive(self, engine: EngineSlot) -> bool:
        return any(e.slot == engine.slot and e.incarnation == engine.incarnation and e.state is EngineState.ALIVE
                   for e in self.backend.engines())

    async def _read_back_all(self, alive: list[EngineSlot], outcomes: dict[int, EngineSyncOutcome], version: str,
                             bounds: plan.StepBounds) -> None:
        async def read(engine: EngineSlot) -> None:
            o = outcomes[engine.slot]
            o.attempts = 1
            try:
                o.version = await self._engine_client(engine.url or "").weight_version(bounds.control_s)
            except CallError as exc:
                o.error = f"read-back failed: {exc}"
                return
            if o.version == version:
                o.ok = True
            else:
                o.error = f"engine reports weight version {o.version!r} after the broadcast of {version!r}"

        async with asyncio.TaskGroup() as tg:
            for engine in alive:
                tg.create_task(read(engine))
        wrong = [e.slot for e in alive if not outcomes[e.slot].ok]
        if wrong:
            for slot in wrong:
                outcomes[slot].ok = False
            raise TransferFailed("read-back: " + "; ".join(f"slot {s}: {outcomes[s].error}" for s in wrong))

    async def _broadcast_failed(self, exc: TransferFailed, reason: str, alive: list[EngineSlot],
                                outcomes: dict[int, EngineSyncOutcome], result: WeightSyncResult) -> None:
        """Mark the wedged and gone engines dead and abandon the group (rebuilt by the next sync)."""
        log.warning("fleet %s: broadcast failed (%s): %s", self.fleet, reason, exc)
        result.fallback_reason = f"{reason}: {exc}"
        metrics.WEIGHT_SYNC_FALLBACKS.labels(fleet=self.fleet, reason=reason).inc()
        group, self._group = self._group, None
        if group is not None:
            await group.abandon()
        by_slot = {e.slot: e for e in alive}
        for slot in (*exc.wedged, *exc.gone):
            engine = by_slot.get(slot)
            if engine is None:
                continue
            o = outcomes[slot]
            o.ok = False
            o.error = (f"wedged in the weight broadcast: {exc}" if slot in exc.wedged
                       else f"died during the weight broadcast: {exc}")
            cause = DeathCause.UNREACHABLE if slot in exc.gone else DeathCause.LOAD_FAILED
            o.marked_dead = await self.backend.mark_dead(slot, o.error, cause=cause, incarnation=engine.incarnation)

    async def _finish_from_disk(self, alive: list[EngineSlot], outcomes: dict[int, EngineSyncOutcome],
                                model_path: str, version: str, result: WeightSyncResult) -> list[EngineSyncOutcome]:
        result.mode = "broadcast_fallback"
        started = time.monotonic()
        rest = [e for e in alive if not outcomes[e.slot].marked_dead and self.backend_alive(e)]
        bounds = plan.StepBounds(self.spec.transfer_timeout_seconds)

        async def end_then_load(engine: EngineSlot) -> EngineSyncOutcome:
            try:  # close a begun update so the disk load starts from a clean state (best effort)
                await self._engine_client(engine.url or "").end_weight_update(bounds.control_s)
            except CallError as exc:
                log.info("fleet %s slot %d: end_weight_update before the disk fallback: %s", self.fleet,
                         engine.slot, exc)
            return await self._sync_engine(engine, model_path, version)

        async with asyncio.TaskGroup() as tg:
            tasks = {e.slot: tg.create_task(end_then_load(e)) for e in rest}
        for slot, task in tasks.items():
            outcomes[slot] = task.result()
        result.phases["load"] = time.monotonic() - started
        return [outcomes[e.slot] for e in alive]

    def _record(self, engine: EngineSlot, outcome: EngineSyncOutcome) -> None:
        if outcome.ok:
            self.backend.record_weight_version(engine.slot, engine.incarnation, outcome.version or "")
            metrics.ENGINE_WEIGHT_VERSION.labels(fleet=self.fleet, slot=str(engine.slot)).set(
                metrics.version_number(outcome.version))

    # --- verification --------------------------------------------------------------------------------

    @property
    def verifies(self) -> bool:
        """Does a sync given the trainer's tensors compare the engines' checksums at all (verifyEvery on,
        and the engines' layout known)? Otherwise the tensors need not be kept for it."""
        return self.spec.verify_every > 0 and not isinstance(self.engine_layout(), str)

    def engine_layout(self) -> EngineLayout | str:
        """How this fleet's engines hold the weights (for their checksums), or why it is not known."""
        config = self._reference.config if self._reference is not None else {}
        return EngineLayout.of(device=self.served.device, tp_size=self.served.tp_size, config=config,
                               quantization=self.served.quantization)

    async def _expected_checksums(self, tensors: Mapping[str, Any], layout: EngineLayout) -> list[dict[str, str]] | str:
        """The checksums each tensor-parallel rank of an engine should report for the trainer's `tensors`,
        or why they cannot be computed here (no SGLang, or no GPU for a CUDA engine's)."""
        def every_rank() -> list[dict[str, str]]:
            if self.served.device.startswith("cuda"):
                import torch

                if not torch.cuda.is_available():  # a CPU build of torch would fail an assertion instead
                    raise RuntimeError("a CUDA engine's checksums need a CUDA device, and torch sees none")
            return [plan.checksums(tensors, dtype=self.served.dtype, device=self.served.device, layout=layout,
                                   rank=rank) for rank in range(layout.tp_size)]

        try:
            return await asyncio.to_thread(every_rank)
        except (ImportError, RuntimeError) as exc:
            return f"cannot compute the engines' checksum here: {exc}"

    async def verify(self, synced: list[EngineSyncOutcome], tensors: Mapping[str, Any]) -> None:
        """Compare each engine's served-weights checksums, rank by rank, with the trainer's of what that
        rank holds of `tensors`; a mismatch marks the engine dead (its outcome no longer ok). The trainer
        hashes while the engines do (after the transfer: beside it, on shared cores, the hashing only
        slowed the transfer down)."""
        layout = self.engine_layout()
        if isinstance(layout, str):
            if layout != self._unverifiable_said:  # once, not every sync: the engines' layout does not change
                log.warning("fleet %s: served weights not verified: %s", self.fleet, layout)
                self._unverifiable_said = layout
            for o in synced:
                o.checksum = "unverifiable"
        else:
            trainer_side = asyncio.ensure_future(self._expected_checksums(tensors, layout))
            try:
                await self._compare_served(synced, trainer_side)
            finally:
                trainer_side.cancel()
        for o in synced:
            if o.checksum is not None:
                metrics.WEIGHT_CHECKSUMS.labels(fleet=self.fleet, result=o.checksum).inc()

    async def _compare_served(self, synced: list[EngineSyncOutcome],
                              trainer_side: asyncio.Future[list[dict[str, str]] | str]) -> None:
        if not synced:
            return
        bounds = plan.StepBounds(self.spec.transfer_timeout_seconds)

        async def check(o: EngineSyncOutcome) -> None:
            try:
                ranks = await self._engine_client(o.url).weights_checksums(bounds.control_s)
            except CallError as exc:
                o.checksum = "unverifiable"
                log.warning("fleet %s slot %d: weights_checker failed: %s", self.fleet, o.slot, exc)
                return
            expected = await trainer_side
            if isinstance(expected, str):
                o.checksum = "unverifiable"
                return
            verdict = plan.compare_engine(expected, ranks)
            if isinstance(verdict, str):
                o.checksum = "unverifiable"
                log.warning("fleet %s slot %d: served weights not verified: %s", self.fleet, o.slot, verdict)
            elif verdict.mismatched:
                o.checksum = "mismatch"
                o.ok = False
                o.error = f"served weights differ from the trainer's (checksum): {verdict.describe()}"
                o.marked_dead = await self.backend.mark_dead(o.slot, o.error, cause=DeathCause.LOAD_FAILED,
                                                             incarnation=o.incarnation)
            else:
                o.checksum = "match"

        async with asyncio.TaskGroup() as tg:
            for o in synced:
                tg.create_task(check(o))
        expected = await trainer_side
        if isinstance(expected, str):
            log.warning("fleet %s: served weights not verified: %s", self.fleet, expected)

    async def close(self) -> None:
        """Destroy the update group (engines leave it, rank 0 stops)."""
        group, self._group = self._group, None
        if group is not None:
            try:
                await group.destroy()
            except Exception as exc:  # stopping goes on: the process dies with us in any case
                log.warning("fleet %s: destroying the update group: %s", self.fleet, exc)

    async def _admit(self, outcome: EngineSyncOutcome) -> None:
        if outcome.slot >= self.backend.replicas:
            return  # scaled away during the sync: it left the router and serves nothing more
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
